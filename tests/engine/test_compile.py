"""A model switched to kvsieve's attention still compiles with transformers' own caches: its decode steps under
``torch.compile(fullgraph=True)`` over a ``StaticCache`` and a ``DynamicCache`` give the eager tokens (the kvsieve
mask and attention functions fall back to the model's own without breaking the graph). And a decode step over a
kvsieve cache at its budget compiles as one graph: the recipe of docs/guarantees.md."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import DynamicCache, StaticCache

import kvsieve


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test traces from scratch (the traces of a model's forward are kept per code object, across tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


@pytest.mark.slow
def test_a_compiled_forward_called_directly_takes_the_prompt_then_the_decode_steps(tiny_factory, make_ids) -> None:
    """``torch.compile(model.forward, dynamic=False)`` called on the prompt itself, then on each decode step, over a
    ``StaticCache``, on a model switched to kvsieve's attention: the eager tokens. Run in a thread of its own, whose
    kvsieve hand-over state (thread-local) is first read inside the compiled frame: reading it must change no guard
    of that frame."""
    model = tiny_factory("llama_gqa")
    ids = make_ids(1, 48)
    before = _greedy(model, ids, StaticCache(config=model.config, max_cache_len=64), model.forward, 6)
    kvsieve.use_kvsieve_attention(model)
    compiled = torch.compile(model.forward, dynamic=False)

    def greedy() -> list[int]:
        cache = StaticCache(config=model.config, max_cache_len=64)
        with torch.inference_mode():
            token = compiled(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens = [token]
            for i in range(5):
                position = torch.tensor([[ids.shape[1] + i]])
                token = compiled(token, cache=cache, use_cache=True, position_ids=position).logits[:, -1:].argmax(-1)
                tokens.append(token)
        return torch.cat(tokens, dim=1)[0].tolist()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(greedy).result() == before


def _decode(model, policy: str, ids: torch.Tensor, forward, steps: int) -> list[list[int]]:
    """The prompt, and decode steps until every layer holds its budget, through the eager model; then ``steps``
    greedy decode steps through ``forward``: their tokens per row (the recipe of docs/guarantees.md)."""
    cache = kvsieve.make_cache(model, policy, 12)
    with torch.inference_mode():
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        while cache.slot_counts() != cache.budgets:
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        tokens = []
        for _ in range(steps):
            token = forward(token, cache=cache).logits[:, -1:].argmax(-1)
            tokens.append(token)
    return torch.cat(tokens, dim=1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["streaming_llm", "h2o"])  # (a positional rule; an accumulated score)
def test_a_kvsieve_decode_step_at_the_budget_compiles_as_one_graph(llama_gqa, make_ids, policy) -> None:
    """``torch.compile(model.forward, fullgraph=True)`` over a kvsieve cache at its budget gives the eager tokens,
    and is traced twice in all: once with the step's counters as constants, once with them symbolic (no retrace at
    later steps, nor for another cache of the same policy)."""
    ids = make_ids(2, 8)  # (shorter than the budget: eager steps fill the cache first)
    eager = _decode(llama_gqa, policy, ids, llama_gqa.forward, 8)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(llama_gqa.forward, fullgraph=True, backend=counter)
    assert _decode(llama_gqa, policy, ids, compiled, 8) == eager
    assert _decode(llama_gqa, policy, ids, compiled, 4) == [row[:4] for row in eager]
    assert counter.frame_count == 2


@pytest.mark.parametrize(
    ("quant", "with_mask", "refusal"),
    [
        ({}, True, "a compiled step over a kvsieve cache takes no attention_mask"),
        ({"kv_bits": 4, "group_size": 16, "residual": 4}, False, "a compiled step over quantized slots"),
    ],
    ids=["mask", "quantized"],
)
def test_what_a_compiled_step_does_not_take_is_refused_before_it_runs(
    llama_gqa, make_ids, quant, with_mask, refusal
) -> None:
    """Whether a row holds padding is read on the host, and quantized slots are not traced: a compiled step with
    either is refused, and the cache is as it was."""
    cache = kvsieve.make_cache(llama_gqa, "h2o", 12, **quant)
    ids = make_ids(2, 14)
    with torch.inference_mode():
        llama_gqa(ids, cache=cache)
        held = cache.slot_counts()
        compiled = torch.compile(llama_gqa.forward, fullgraph=True, backend="eager")
        mask = {"attention_mask": torch.ones(2, 15, dtype=torch.long)} if with_mask else {}
        with pytest.raises(Exception, match=refusal):
            compiled(ids[:, :1], cache=cache, **mask)
    assert cache.slot_counts() == held
    assert all(layer.tokens_seen == 14 for layer in cache.layers)
