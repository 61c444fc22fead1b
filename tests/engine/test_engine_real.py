"""The engine on the real default model (SmolLM2-135M) and real Wikipedia text (all ``slow``)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from kvsieve.policies import REGISTRY

pytestmark = pytest.mark.slow

PREFILL, DECODE = 300, 30


@pytest.fixture(scope="module")
def wiki_ids(real_model, wiki_text) -> torch.Tensor:
    """``[1, PREFILL + DECODE]`` tokens of a real article."""
    ids = real_model[1](wiki_text, return_tensors="pt").input_ids[:, : PREFILL + DECODE]
    assert ids.shape[1] == PREFILL + DECODE
    return ids


def _teacher_forced(model, cache, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits ``[1, L, V]`` of ``ids`` fed as one ``prefill`` pass, then one token per step."""
    with torch.inference_mode():
        out = [model(ids[:, :prefill], cache=cache).logits]
        out += [model(ids[:, i : i + 1], cache=cache).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def dynamic_logits(real_model, wiki_ids) -> torch.Tensor:
    model = real_model[0]
    return _teacher_forced(model, DynamicCache(config=model.config), wiki_ids, PREFILL)


def test_full_equals_dynamic_cache(real_model, wiki_ids, dynamic_logits) -> None:
    model, tokenizer = real_model
    cache = kvsieve.make_cache(model, "full")
    logits = _teacher_forced(model, cache, wiki_ids, PREFILL)
    torch.testing.assert_close(logits, dynamic_logits, atol=1e-4, rtol=0)
    assert cache.slot_counts() == [PREFILL + DECODE] * model.config.num_hidden_layers
    # Greedy generation through model.generate.
    prompt = wiki_ids[:, :PREFILL]
    texts = []
    for cache in (DynamicCache(config=model.config), kvsieve.make_cache(model, "full")):
        out = model.generate(prompt, cache=cache, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        texts.append(tokenizer.decode(out[0, PREFILL:]))
    assert texts[0] == texts[1] and len(texts[0]) > 40


SHORT_PREFILL, SHORT = 64, 68


@pytest.fixture(scope="module")
def short_dynamic_logits(real_model, wiki_ids) -> torch.Tensor:
    model = real_model[0]
    return _teacher_forced(model, DynamicCache(config=model.config), wiki_ids[:, :SHORT], SHORT_PREFILL)


@pytest.mark.parametrize("policy", [name for name, cls in REGISTRY.items() if not cls.probed])  # (kvzip: refused)
def test_budget_at_least_length_equals_dynamic_cache(real_model, wiki_ids, short_dynamic_logits, policy) -> None:
    model = real_model[0]
    cache = kvsieve.make_cache(model, policy, SHORT)
    logits = _teacher_forced(model, cache, wiki_ids[:, :SHORT], SHORT_PREFILL)
    torch.testing.assert_close(logits, short_dynamic_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "local"])
def test_left_padded_batch_generation_equals_prompts_alone(real_model, wiki_text, policy) -> None:
    model, tokenizer = real_model
    paragraphs = wiki_text.split("\n\n")
    prompts = [" ".join(paragraphs[1].split()[:30]), " ".join(paragraphs[2].split()[:18])]
    batch = kvsieve.generate(model, tokenizer, prompts, policy=policy, budget=16, max_new_tokens=12)
    assert all(n > 16 for n in batch.prompt_tokens) and batch.prompt_tokens[0] != batch.prompt_tokens[1]
    for i, prompt in enumerate(prompts):
        alone = kvsieve.generate(model, tokenizer, prompt, policy=policy, budget=16, max_new_tokens=12)
        assert batch.texts[i] == alone.text, f"prompt {i}"
        assert batch.generated_tokens[i] == alone.generated_tokens[0]


def test_h2o_slots_stay_within_budget_through_200_decode_steps(real_model, wiki_ids, stream) -> None:
    model = real_model[0]
    budget = 32
    cache = kvsieve.make_cache(model, "h2o", budget)
    counts: list[int] = []

    def check() -> None:
        assert max(cache.slot_counts()) <= budget and max(cache.capacities()) <= budget + 1
        counts.append(min(cache.slot_counts()))

    logits = stream(model, cache, wiki_ids[:, :64], 200, on_step=check)
    assert counts == [budget] * 201
    assert torch.isfinite(logits).all()
    assert cache.get_seq_length() == 264
