"""Gemma 3, the second architecture: sliding-window layers keep their window, the policy runs on the global layers."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from kvsieve.policies import REGISTRY

WINDOW = 8  # the tiny Gemma 3's sliding window (conftest)


def test_tiny_config_mixes_sliding_and_global_layers(gemma3) -> None:
    config = gemma3.config
    assert config.sliding_window == WINDOW
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def test_full_equals_dynamic_cache_past_the_window(gemma3, stream, make_ids) -> None:
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0  # a left-padded row too
    prompt = make_ids(2, 20)
    reference = stream(gemma3, DynamicCache(config=gemma3.config), prompt, 12, attention_mask=mask)
    cache = kvsieve.make_cache(gemma3, "full")
    logits = stream(gemma3, cache, prompt, 12, attention_mask=mask)
    real = torch.cat([mask, torch.ones(2, 12, dtype=torch.long)], dim=1).bool()  # padding logits are meaningless
    torch.testing.assert_close(logits[real], reference[real], atol=1e-4, rtol=0)
    assert cache.slot_counts() == [WINDOW - 1, 32, WINDOW - 1, 32]


def test_sliding_layers_keep_exactly_the_last_window_minus_one(gemma3, stream, make_ids) -> None:
    cache = kvsieve.make_cache(gemma3, "h2o", 6)

    def check() -> None:
        last = cache.get_seq_length() - 1
        for i in (0, 2):
            kept = cache.positions(i)
            assert kept.shape[-1] == WINDOW - 1
            assert all(set(h.tolist()) == set(range(last - WINDOW + 2, last + 1)) for row in kept for h in row)

    stream(gemma3, cache, make_ids(1, 20), 10, on_step=check)


@pytest.mark.parametrize("policy", list(REGISTRY))
def test_every_policy_runs_on_the_global_layers(gemma3, stream, make_ids, policy) -> None:
    budget = 6
    cache = kvsieve.make_cache(gemma3, policy, budget)
    bounded = REGISTRY[policy].bounded

    def check() -> None:
        for layer, n in zip(cache.layers, cache.slot_counts(), strict=True):
            assert n <= (WINDOW - 1 if layer.is_sliding else budget if bounded else cache.get_seq_length())

    logits = stream(gemma3, cache, make_ids(2, 20), 12, on_step=check)
    assert torch.isfinite(logits).all()
    assert [layer.policy.name for layer in cache.layers] == ["local", policy, "local", policy]
    if bounded:
        assert cache.slot_counts() == [WINDOW - 1, budget, WINDOW - 1, budget]


@pytest.mark.slow
def test_real_gemma3_full_equals_dynamic_cache_and_h2o_stays_bounded(wiki_text) -> None:
    model, tokenizer = kvsieve.load_model("gemma3-270m", device="cpu")
    window = model.config.sliding_window
    ids = tokenizer(wiki_text, return_tensors="pt").input_ids[:, :600]
    assert ids.shape[1] == 600 > window
    prompt, decode = ids[:, :596], ids[:, 596:]

    def run(cache) -> torch.Tensor:
        with torch.inference_mode():
            out = [model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits]
            out += [model(decode[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(4)]
        return torch.cat(out, dim=1)

    reference = run(DynamicCache(config=model.config))
    full = kvsieve.make_cache(model, "full")
    torch.testing.assert_close(run(full), reference, atol=1e-3, rtol=1e-4)
    assert full.slot_counts() == [600 if t == "full_attention" else window - 1 for t in model.config.layer_types]

    h2o = kvsieve.make_cache(model, "h2o", 64)
    logits = run(h2o)
    assert torch.isfinite(logits).all()
    assert h2o.slot_counts() == [64 if t == "full_attention" else window - 1 for t in model.config.layer_types]
    assert max(h2o.capacities()) <= window
