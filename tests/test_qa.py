"""Budgets by phase (prompt / decoding), compress-once-ask-many (:mod:`kvsieve.qa`) and saved contexts."""

from __future__ import annotations

import pytest
import torch

import kvsieve

PHASE_POLICIES = ["h2o", "scissorhands", "snapkv", "streaming_llm", "knorm", "tova", "ahakv"]


def _feed(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``ids`` fed in one forward pass through ``cache``."""
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits


def _feed_one_by_one(model, cache, ids: torch.Tensor, slots: list[int] | None = None) -> torch.Tensor:
    logits = []
    for i in range(ids.shape[1]):
        logits.append(_feed(model, cache, ids[:, i : i + 1]))
        if slots is not None:
            slots.append(max(cache.slot_counts()))
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("policy", PHASE_POLICIES)
def test_prompt_is_compressed_to_budget_then_cache_grows_to_decode_budget(llama_gqa, make_ids, policy) -> None:
    prompt, tail = make_ids(2, 24, seed=1), make_ids(2, 12, seed=2)
    cache = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=14)
    _feed(llama_gqa, cache, prompt)
    assert cache.slot_counts() == [8, 8, 8] and cache.decode_budget_tokens == 14
    slots: list[int] = []
    _feed_one_by_one(llama_gqa, cache, tail, slots)
    assert max(slots) == 14 and min(slots[6:]) > 8  # (scissorhands and knorm drop several at once)
    assert slots[:6] == list(range(9, 15))  # nothing evicted while there is room


@pytest.mark.parametrize("policy", PHASE_POLICIES)
def test_stream_continuation_respects_the_decode_budget(llama_gqa, make_ids, policy) -> None:
    """A continuation fed in one stream-protocol pass (scanned runs) is the token-by-token one under the phase's
    limit."""
    prompt, tail = make_ids(1, 24, seed=3), make_ids(1, 20, seed=4)
    one = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=12)
    _feed(llama_gqa, one, prompt)
    expected = _feed_one_by_one(llama_gqa, one, tail)
    streamed = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=12)
    _feed(llama_gqa, streamed, prompt)
    with streamed.streaming():
        got = _feed(llama_gqa, streamed, tail)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert streamed.slot_counts() == one.slot_counts()
    for layer in range(3):
        assert torch.equal(streamed.positions(layer).sort(-1).values, one.positions(layer).sort(-1).values)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "streaming_llm", "knorm"])
def test_unbounded_decode_budget_is_prefill_only_compression(llama_gqa, make_ids, policy) -> None:
    prompt, tail = make_ids(2, 24, seed=5), make_ids(2, 10, seed=6)
    one_pass = kvsieve.make_cache(llama_gqa, policy, 8)  # (the continuation attends before any eviction)
    _feed(llama_gqa, one_pass, prompt)
    expected = _feed(llama_gqa, one_pass, tail)
    grow = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=None)
    _feed(llama_gqa, grow, prompt)
    assert grow.slot_counts() == [8, 8, 8]
    torch.testing.assert_close(_feed_one_by_one(llama_gqa, grow, tail), expected, rtol=1e-5, atol=1e-5)
    assert grow.slot_counts() == [18, 18, 18]
    at_once = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=None)
    _feed(llama_gqa, at_once, prompt)
    torch.testing.assert_close(_feed(llama_gqa, at_once, tail), expected, rtol=1e-5, atol=1e-5)


def test_unbounded_decoding_observes_nothing(llama_gqa, make_ids, monkeypatch) -> None:
    """Once the cache may grow without bound nothing is evicted again: the policy is not asked to observe."""
    cache = kvsieve.make_cache(llama_gqa, "h2o", 8, decode_budget=None)
    _feed(llama_gqa, cache, make_ids(1, 16, seed=7))
    observed = []
    policy_cls = type(cache.layers[0].policy)
    monkeypatch.setattr(policy_cls, "observe", lambda self, slots, obs: observed.append(1))
    _feed_one_by_one(llama_gqa, cache, make_ids(1, 4, seed=8))
    assert observed == []


def test_set_prompt_length_starts_decoding_in_the_first_pass(llama_gqa, make_ids) -> None:
    ids = make_ids(1, 30, seed=9)
    split = kvsieve.make_cache(llama_gqa, "h2o", 8, decode_budget=12)
    split.set_prompt_length(20)
    got = _feed(llama_gqa, split, ids)
    apart = kvsieve.make_cache(llama_gqa, "h2o", 8, decode_budget=12)
    expected = torch.cat([_feed(llama_gqa, apart, ids[:, :20]), _feed_one_by_one(llama_gqa, apart, ids[:, 20:])], 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert split.slot_counts() == apart.slot_counts() == [12, 12, 12]


def test_ratio_decode_budget_resolves_against_the_prompt(llama_gqa, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "h2o", 0.25, decode_budget=0.5)
    _feed(llama_gqa, cache, make_ids(1, 40, seed=10))
    assert (cache.budget_tokens, cache.decode_budget_tokens) == (10, 20)
    _feed_one_by_one(llama_gqa, cache, make_ids(1, 14, seed=11))
    assert cache.slot_counts() == [20, 20, 20]


@pytest.mark.parametrize(
    ("budget", "decode_budget", "message"),
    [
        (8, 4, r"decode_budget \(4 tokens\) must be at least the budget \(8 tokens\)"),
        (8, "more", "decode_budget must be tokens, a ratio, None or 'budget'"),
        (8, -3, "positive"),
        (8, 1.5, r"ratio must be in \(0, 1\]"),
    ],
)
def test_bad_decode_budget_is_refused_before_any_work(llama_gqa, budget, decode_budget, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, "h2o", budget, decode_budget=decode_budget)


def test_ratio_decode_budget_below_budget_fails_at_the_prompt(llama_gqa, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "h2o", 0.5, decode_budget=0.25)
    with pytest.raises(ValueError, match="must be at least the budget"):
        _feed(llama_gqa, cache, make_ids(1, 40, seed=12))


def test_sliding_layers_keep_their_window_while_policy_layers_grow(gemma3, make_ids) -> None:
    cache = kvsieve.make_cache(gemma3, "h2o", 6, decode_budget=None)
    _feed(gemma3, cache, make_ids(1, 20, seed=13))
    _feed_one_by_one(gemma3, cache, make_ids(1, 10, seed=14))
    window = gemma3.config.sliding_window - 1
    assert cache.slot_counts() == [window, 16, window, 16]
