"""A model switched to kvsieve's attention still compiles with transformers' own caches: its decode steps under
``torch.compile(fullgraph=True)`` over a ``StaticCache`` and a ``DynamicCache`` give the eager tokens (the kvsieve
mask and attention functions fall back to the model's own without breaking the graph)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import kvsieve


def _greedy(model, ids: torch.Tensor, cache, forward, steps: int) -> list[int]:
    """The prompt through the eager model, then ``steps`` greedy decode steps through ``forward``."""
    with torch.inference_mode():
        token = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens = [token]
        for i in range(steps - 1):
            position = torch.tensor([[ids.shape[1] + i]])
            token = forward(token, cache=cache, use_cache=True, position_ids=position).logits[:, -1:].argmax(-1)
            tokens.append(token)
    return torch.cat(tokens, dim=1)[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_transformers_caches_compile_on_a_model_switched_to_kvsieve(tiny_factory, make_ids, kind) -> None:
    model = tiny_factory("llama_gqa")
    config, ids = model.config, make_ids(1, 16)

    def cache():
        return StaticCache(config=config, max_cache_len=64) if kind == "static" else DynamicCache(config=config)

    before = _greedy(model, ids, cache(), model.forward, 6)  # (the model's own attention)
    kvsieve.use_kvsieve_attention(model)
    assert model.config._attn_implementation.startswith("kvsieve")
    compiled = torch.compile(model.forward, fullgraph=True)
    assert _greedy(model, ids, cache(), compiled, 6) == before
