"""The shared matrix: every registered policy × every tiny model passes these checks, with no test of its own.

Policies are taken from ``kvsieve.policies.REGISTRY`` at collection time, so new policies are covered as soon as
they are registered.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

import kvsieve
from kvsieve.engine import slot_attention
from kvsieve.policies import REGISTRY

TINY_MODELS = ("llama_mha", "llama_gqa", "gemma3")
TINY_VOCAB = 128
BUDGET = 12
PROMPT = 30
STEPS = 200

policies = pytest.mark.parametrize("policy", list(REGISTRY))


@pytest.fixture(params=TINY_MODELS)
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def model(model_name: str, request: pytest.FixtureRequest) -> PreTrainedModel:
    return request.getfixturevalue(model_name)


def _bounds(model: PreTrainedModel, cache: kvsieve.SieveCache, policy: str) -> list[int | None]:
    """Most slots each layer may hold between steps (None = unbounded); sliding layers keep ``window - 1``; a budget
    shared by the layers (kvzip) gives each its share, which sum to the budget's total."""
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if not REGISTRY[policy].bounded:
        return [window - 1 if layer.is_sliding else None for layer in cache.layers]
    own = [BUDGET if layer.policy is None else layer.policy.budget for layer in cache.layers]
    assert sum(b for b, layer in zip(own, cache.layers, strict=True) if not layer.is_sliding) == BUDGET * sum(
        not layer.is_sliding for layer in cache.layers
    )
    return [window - 1 if layer.is_sliding else b for b, layer in zip(own, cache.layers, strict=True)]


@pytest.fixture(scope="module")
def full_nbytes() -> dict[str, int]:
    """``full``'s ``nbytes()`` after the same run, per model name (filled on first use)."""
    return {}


@policies
def test_budget_invariant_through_200_decode_steps(model_name, model, policy, stream, make_ids, full_nbytes) -> None:
    cache = kvsieve.make_cache(model, policy, BUDGET)

    def check() -> None:
        bounds = _bounds(model, cache, policy)
        for i, (bound, n, cap) in enumerate(zip(bounds, cache.slot_counts(), cache.capacities(), strict=True)):
            if bound is not None:
                assert n <= bound, f"layer {i} holds {n} slots > {bound}"
                assert cap <= bound + 1, f"layer {i} allocates {cap} slots > {bound + 1}"

    logits = stream(model, cache, make_ids(2, PROMPT), STEPS, on_step=check)
    assert torch.isfinite(logits).all()
    for bound, n in zip(_bounds(model, cache, policy), cache.slot_counts(), strict=True):
        assert n == PROMPT + STEPS if bound is None else 0 < n <= bound  # unbounded layers grow with every token
    if model_name not in full_nbytes:
        full = kvsieve.make_cache(model, "full")
        stream(model, full, make_ids(2, PROMPT), STEPS)
        full_nbytes[model_name] = full.nbytes()
    if REGISTRY[policy].bounded:
        assert cache.nbytes() * 5 < full_nbytes[model_name]


@policies
def test_budget_at_least_length_equals_dynamic_cache(model, policy, stream, make_ids) -> None:
    prompt = make_ids(2, 24)
    reference = stream(model, DynamicCache(config=model.config), prompt, 20)
    cache = kvsieve.make_cache(model, policy, 64)
    logits = stream(model, cache, prompt, 20)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    assert cache.get_seq_length() == 44


@pytest.mark.parametrize("policy", [name for name, cls in REGISTRY.items() if not cls.probed])
def test_left_padded_batch_equals_rows_alone(model_name, policy, tiny_models) -> None:
    # (through transformers' generate, which a policy scored by probes cannot fill: kvzip's rows are checked in
    # tests/policies/test_kvzip.py)
    # In float64, so that round-off (which differs between a batch and a row alone) cannot decide the near-ties a
    # random model's scores sometimes have. Every token of a row is distinct (permuted prompts, no repeated or pad
    # token generated), so every kept set shows in the logits.
    model = tiny_models(model_name, torch.float64)
    gen = torch.Generator().manual_seed(2)
    long, short = (3 + torch.randperm(TINY_VOCAB - 3, generator=gen)[None, :n] for n in (20, 13))
    pad = model.config.pad_token_id
    ids = torch.cat([long, torch.cat([torch.full((1, 7), pad), short], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0

    def generate(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=kvsieve.make_cache(model, policy, 10),
            do_sample=False,
            max_new_tokens=30,
            min_new_tokens=30,
            no_repeat_ngram_size=1,
            suppress_tokens=[pad],
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_logits=True,
        )
        return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)

    batch_tokens, batch_logits = generate(ids, mask)
    for row, prompt in enumerate((long, short)):
        tokens, logits = generate(prompt, torch.ones_like(prompt))
        assert torch.equal(batch_tokens[row], tokens[0]), f"row {row}"
        torch.testing.assert_close(batch_logits[row], logits[0], atol=1e-4, rtol=0)


@policies
@pytest.mark.parametrize("streamed", [False, True], ids=["one-step", "stream"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_row_blocks_change_nothing(
    model_name, policy, streamed, padded, stream, make_ids, monkeypatch, tiny_models
) -> None:
    """A prompt attended in blocks of 2 query rows, each over the slots up to its own last token only, leaves the
    same logits, kept tokens and policy state as one block over every slot (float64 model: no near-ties)."""
    model = tiny_models(model_name, torch.float64)
    prompt = make_ids(2, PROMPT)
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :7] = 0

    def run() -> tuple[torch.Tensor, kvsieve.SieveCache]:
        cache = kvsieve.make_cache(model, policy, BUDGET, stream=streamed)
        return stream(model, cache, prompt, 4, attention_mask=mask if padded else None), cache

    reference, whole = run()
    monkeypatch.setattr(slot_attention, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(slot_attention, "MIN_BLOCK_ROWS", 2)
    logits, blocked = run()
    real = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1).bool()  # padding rows' outputs are unused
    torch.testing.assert_close(logits[real], reference[real], atol=1e-5, rtol=0)  # (fp32 logits)
    for a, b in zip(blocked.layers, whole.layers, strict=True):
        assert torch.equal(a.held_positions(), b.held_positions())
        held = b.held_state()
        for name, state in a.held_state().items():
            # (scores are fp32 sums whatever the model's dtype: the blocks add them up in another order)
            torch.testing.assert_close(state, held[name], atol=1e-7, rtol=1e-5)


@policies
def test_deterministic(model, policy, stream, make_ids) -> None:
    runs = []
    for _ in range(2):
        cache = kvsieve.make_cache(model, policy, BUDGET)
        logits = stream(model, cache, make_ids(2, PROMPT), 16)
        runs.append((logits, [cache.positions(i) for i in range(len(cache.layers))]))
    (logits_a, pos_a), (logits_b, pos_b) = runs
    assert torch.equal(logits_a, logits_b)
    assert all(torch.equal(a, b) for a, b in zip(pos_a, pos_b, strict=True))


@policies
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_finite_logits_in_half_precision_with_padding(model_name, policy, dtype, stream, make_ids, tiny_models) -> None:
    cast = tiny_models(model_name, dtype)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :9] = 0
    logits = stream(cast, kvsieve.make_cache(cast, policy, BUDGET), make_ids(2, PROMPT), 16, attention_mask=mask)
    assert torch.isfinite(logits).all()
