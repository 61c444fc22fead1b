"""Policies that count only a step's last query rows (``Policy.observed_rows``) get exactly the prompt's decisions of
observing every row, while the earlier rows are attended with the fused kernel."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from kvsieve.engine import slot_attention
from kvsieve.policies import REGISTRY, Policy, resolve_spec

SPECS = ["tova", "snapkv", "ahakv", "scissorhands:window=10", "tova:per_head=true", "snapkv:window=0", "rkv:window=5"]


def test_the_policies_that_declare_it():
    declared = {name for name, cls in REGISTRY.items() if cls.observed_rows is not Policy.observed_rows}
    assert declared == {"tova", "snapkv", "ahakv", "scissorhands", "rkv"}
    assert REGISTRY["ahakv"](16, REGISTRY["ahakv"].Params(ra=False)).observed_rows() is None


def _run(model: torch.nn.Module, spec: str, ids: torch.Tensor, mask: torch.Tensor) -> tuple[list, list, torch.Tensor]:
    policy, params, _, _ = resolve_spec(spec, {})
    cache = kvsieve.make_cache(model, policy, 16, **params)
    logits = [model(ids, attention_mask=mask, cache=cache, use_cache=True).logits]
    token = logits[-1][:, -1:].argmax(-1)
    for _ in range(3):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits.append(model(token, attention_mask=mask, cache=cache, use_cache=True).logits)
        token = logits[-1][:, -1:].argmax(-1)
    kept = [cache.positions(i).sort(dim=-1).values for i in range(len(cache.layers))]
    states = [layer.held_state() for layer in cache.layers]
    return kept, states, torch.cat([t[:, -1] for t in logits])


@pytest.mark.parametrize("model_name", ["llama_gqa", "gemma3"])
@pytest.mark.parametrize("spec", SPECS)
def test_last_rows_only_decide_as_every_row(tiny_models, monkeypatch, model_name: str, spec: str):
    model = tiny_models(model_name, torch.float64)
    monkeypatch.setattr(slot_attention, "BLOCK_ELEMENTS", 256)  # (prompt rows in several blocks)
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # (a left-padded row)
    with torch.no_grad():
        split = _run(model, spec, ids, mask)
        cls = REGISTRY[resolve_spec(spec, {})[0].name]
        monkeypatch.setattr(cls, "observed_rows", Policy.observed_rows)  # every row observed
        whole = _run(model, spec, ids, mask)
    for a, b in zip(split[0], whole[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(split[1], whole[1], strict=True):
        assert a.keys() == b.keys() and all(torch.allclose(a[k].double(), b[k].double(), atol=1e-12) for k in a)
    torch.testing.assert_close(split[2], whole[2], rtol=1e-9, atol=1e-9)
