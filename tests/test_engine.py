"""The engine on tiny random models: H2O against a naive reference, exact windows, budgets, memory, errors, generate."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kvsieve
from kvsieve.engine.layer import SieveLayer
from kvsieve.policies import REGISTRY, Slots, get_policy

# --------------------------------------------------------------------------------------------------------------------
# H2O against a naive reference attention
# --------------------------------------------------------------------------------------------------------------------


class NaiveH2O:
    """H2O applied literally, inside an eager attention function run over a plain ``DynamicCache``.

    The cache holds every token; this class keeps, per (layer, row, KV head), the set of positions H2O keeps and
    their accumulated scores, and masks the others out of the attention.
    """

    def __init__(self, budget: int, recent: int) -> None:
        self.budget, self.recent = budget, recent
        self.kept: dict[int, list[list[set[int]]]] = {}
        self.score: dict[int, list[list[dict[int, float]]]] = {}

    def attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor,
        scaling: float,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        bsz, q_heads, q_len, _ = query.shape
        kv_heads, n = key.shape[1], key.shape[2]
        group = q_heads // kv_heads
        layer = module.layer_idx
        kept = self.kept.setdefault(layer, [[set() for _ in range(kv_heads)] for _ in range(bsz)])
        score = self.score.setdefault(layer, [[{} for _ in range(kv_heads)] for _ in range(bsz)])
        keep_mask = torch.zeros(bsz, kv_heads, 1, n, dtype=torch.bool)
        for b in range(bsz):
            for h in range(kv_heads):
                kept[b][h].update(range(n - q_len, n))
                keep_mask[b, h, 0, sorted(kept[b][h])] = True
        assert attention_mask.dtype == torch.bool and attention_mask.shape == (bsz, 1, q_len, n)
        allowed = attention_mask & keep_mask.repeat_interleave(group, dim=1)
        k = key.float().repeat_interleave(group, dim=1)
        v = value.float().repeat_interleave(group, dim=1)
        logits = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out = torch.matmul(probs, v)
        summed = probs.view(bsz, kv_heads, group, q_len, n).sum(dim=2).double().tolist()
        for b in range(bsz):
            for h in range(kv_heads):
                for p in kept[b][h]:
                    score[b][h][p] = score[b][h].get(p, 0.0) + sum(summed[b][h][i][p] for i in range(q_len))
                self._evict(kept[b][h], score[b][h], last=n - 1, prompt=q_len > 1)
        return out.transpose(1, 2).to(query.dtype), None

    def _evict(self, kept: set[int], score: dict[int, float], last: int, prompt: bool) -> None:
        if len(kept) <= self.budget:
            return
        recent = {p for p in kept if p > last - self.recent}
        others = sorted(kept - recent, key=lambda p: score[p], reverse=True)
        # After the prompt: the recent window + the heavy best-scored others; at a decode step: one victim.
        evicted = others[self.budget - len(recent) :] if prompt else others[-1:]
        for p in evicted:
            kept.remove(p)
            del score[p]

    def positions(self, layer: int) -> list[list[set[int]]]:
        return [[set(s) for s in row] for row in self.kept[layer]]


def _reference_mask(**kwargs: Any) -> torch.Tensor | None:
    return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})


@pytest.mark.parametrize("model_name", ["llama_mha", "llama_gqa"])
def test_h2o_matches_naive_reference(model_name, request, stream, make_ids) -> None:
    model = request.getfixturevalue(model_name)
    budget, recent, steps = 10, 4, 32
    ref = NaiveH2O(budget, recent)
    AttentionInterface.register("h2o_ref", ref.attention)
    AttentionMaskInterface.register("h2o_ref", _reference_mask)
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation("h2o_ref")
    n_layers = model.config.num_hidden_layers

    ref_kept: list[list[list[list[set[int]]]]] = []
    prompt = make_ids(2, 24)
    ref_logits = stream(
        ref_model,
        DynamicCache(config=ref_model.config),
        prompt,
        steps,
        on_step=lambda: ref_kept.append([ref.positions(i) for i in range(n_layers)]),
    )

    cache = kvsieve.make_cache(model, "h2o", budget, recent=recent)
    kept: list[list[list[list[set[int]]]]] = []

    def record() -> None:
        kept.append([[[set(h.tolist()) for h in row] for row in cache.positions(i)] for i in range(n_layers)])

    logits = stream(model, cache, prompt, steps, on_step=record)
    assert len(kept) == len(ref_kept) == steps + 1
    for step, (got, expected) in enumerate(zip(kept, ref_kept, strict=True)):
        assert got == expected, f"kept positions differ after step {step}"
        assert all(len(s) == budget for layer in got for row in layer for s in row)
    # In every layer, rows and heads keep different sets: the comparison really is per (row, KV head).
    assert all(len({frozenset(s) for row in layer for s in row}) > 1 for layer in kept[-1])
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# Exact windows of streaming_llm and local, with a left-padded row
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "kwargs"), [("streaming_llm", {"sink": 3}), ("local", {})])
def test_window_policies_keep_exact_positions(llama_gqa, policy, kwargs, stream, make_ids) -> None:
    budget, pad = 9, 5
    sink = kwargs.get("sink", 0)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :pad] = 0
    cache = kvsieve.make_cache(llama_gqa, policy, budget, **kwargs)
    seen = [20, 20 - pad]

    def check() -> None:
        for layer in range(len(cache.layers)):
            pos = cache.positions(layer)
            for row, count in enumerate(seen):
                expected = set(range(sink)) | set(range(count - (budget - sink), count))
                for head in range(pos.shape[1]):
                    assert set(pos[row, head].tolist()) == expected, (layer, row, head)
        seen[:] = [s + 1 for s in seen]

    stream(llama_gqa, cache, make_ids(2, 20), 30, attention_mask=mask, on_step=check)


# --------------------------------------------------------------------------------------------------------------------
# Positional policies: one decision per step for the layers that share it
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [name for name, cls in REGISTRY.items() if cls.positional])
@pytest.mark.parametrize(("schedule", "groups"), [("uniform", 1), ([1.0, 1.0, 2.0], 2)])
def test_positional_layers_share_each_decision(llama_gqa, stream, make_ids, policy, schedule, groups) -> None:
    """Layers with the same positional policy and budget compute their priorities once per round (the first layer)
    and evict exactly what each would evict on its own, with padding holes, across a reset and under a schedule
    that gives layers different budgets (then each budget is its own group)."""
    cls = get_policy(policy)
    calls: list[int] = []

    class Counted(cls):
        def keep_scores(self, slots: Slots) -> torch.Tensor:
            calls.append(1)
            return super().keep_scores(slots)

    class Alone(cls):
        positional = False

    def run(cache: kvsieve.SieveCache) -> list[list[list[list[int]]]]:
        cache.reset()
        record = []
        on_step = lambda: record.append([cache.positions(i).sort(dim=-1).values.tolist() for i in range(3)])  # noqa: E731
        stream(llama_gqa, cache, make_ids(2, 20), steps, attention_mask=mask, on_step=on_step)
        return record

    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0
    steps = 12
    kept = []
    for variant in (Counted, Alone, Counted):
        cache = kvsieve.make_cache(llama_gqa, variant, 9, schedule=schedule)
        kept += [run(cache) for _ in range(2 if variant is Counted else 1)]  # the second reuses it after a reset
    assert all(run == kept[1] for run in kept)
    assert len(calls) == 4 * (1 + steps) * groups  # four Counted runs, each: the prompt's round + one per token


def test_each_step_computes_its_positions_once_for_all_layers(gemma3, stream, make_ids, monkeypatch) -> None:
    """The first layer of a one-chunk step computes the positions for every layer (sliding and global ones alike,
    with padding), and the outputs are those of each layer computing them alone."""
    calls = []
    positions = SieveLayer._positions

    def counted(self, padding, q, heads):
        calls.append(self.layer_idx)
        return positions(self, padding, q, heads)

    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0
    runs = []
    for shared in (True, False):
        cache = kvsieve.make_cache(gemma3, "h2o", 9)
        if not shared:  # every layer computes everything itself
            cache.memo.share = lambda what, stamp, make: make()
        runs.append(stream(gemma3, cache, make_ids(2, 20), 5, attention_mask=mask))
    assert torch.equal(runs[0], runs[1])
    monkeypatch.setattr(SieveLayer, "_positions", counted)
    stream(gemma3, kvsieve.make_cache(gemma3, "h2o", 9), make_ids(2, 20), 5, attention_mask=mask)
    assert calls == [0] * 6  # the prompt, then each token


# --------------------------------------------------------------------------------------------------------------------
# Budgets and memory
# --------------------------------------------------------------------------------------------------------------------


def test_ratio_budget_resolves_against_the_prompt(llama_gqa, stream, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "h2o", 0.3)
    assert cache.budget_tokens is None
    stream(llama_gqa, cache, make_ids(1, 37), 5)
    assert cache.budget_tokens == 11  # round(11.1)
    assert cache.slot_counts() == [11, 11, 11]
    with torch.inference_mode():
        llama_gqa(make_ids(1, 30), past_key_values=cache)  # a later chunk does not re-resolve
    assert cache.budget_tokens == 11 and cache.slot_counts() == [11, 11, 11]
    cache.reset()
    assert cache.budget_tokens is None and cache.get_seq_length() == 0
    stream(llama_gqa, cache, make_ids(1, 22), 0)
    assert cache.budget_tokens == 7 and cache.slot_counts() == [7, 7, 7]  # round(6.6)


def test_prompt_buffers_are_freed(llama_gqa, stream, make_ids) -> None:
    budget, bsz = 10, 2
    cfg = llama_gqa.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    slots = (budget + 1) * bsz * cfg.num_key_value_heads * cfg.num_hidden_layers
    expected_kv = 2 * slots * head_dim * 4  # K and V, fp32
    expected_state = slots * (8 + 4) + cfg.num_hidden_layers * bsz * 8  # positions (int64) + h2o score (fp32)
    cache = kvsieve.make_cache(llama_gqa, "h2o", budget)
    sizes: list[tuple[int, int]] = []
    stream(
        llama_gqa,
        cache,
        make_ids(bsz, 200),
        40,
        on_step=lambda: sizes.append((cache.kv_nbytes(), cache.state_nbytes())),
    )
    assert set(sizes) == {(expected_kv, expected_state)}


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (0, "positive number of tokens, got 0"),
        (-5, "positive number of tokens, got -5"),
        (1.5, r"ratio must be in \(0, 1\], got 1.5"),
        (math.nan, r"ratio must be in \(0, 1\], got nan"),
        (True, "got True"),
    ],
)
def test_bad_budget(llama_gqa, budget, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, "h2o", budget)


@pytest.mark.parametrize(
    ("policy", "kwargs", "message"),
    [
        ("h2o", {"recent": 9}, r"h2o: recent window \(9\) is larger than the budget \(8\)"),
        ("streaming_llm", {"sink": 8}, r"streaming_llm: sink \(8\) must be smaller than the budget \(8\)"),
        ("nope", {}, "unknown policy 'nope'; available: full, "),
        ("h2o", {"recnt": 2}, r"policy 'h2o' has no parameter\(s\) recnt \(parameters: .*recent"),
    ],
)
def test_bad_policy_or_params(llama_gqa, policy, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, policy, 8, **kwargs)


def test_unsupported_models() -> None:
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(kvsieve.UnsupportedModelError, match="encoder-decoder"):
        kvsieve.make_cache(t5, "h2o", 8)
    config = Qwen3NextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    with pytest.raises(kvsieve.UnsupportedModelError, match=r"layer types \['linear_attention'\]"):
        kvsieve.make_cache(Qwen3NextForCausalLM(config), "h2o", 8)


def test_invalid_ratio_split_fails_at_first_forward_and_leaves_cache_untouched(llama_gqa, stream, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "streaming_llm", 0.1, sink=4)
    with pytest.raises(ValueError, match=r"sink \(4\) must be smaller than the budget \(2\)"), torch.inference_mode():
        llama_gqa(make_ids(1, 20), past_key_values=cache)
    assert not any(layer.is_initialized for layer in cache.layers)
    assert cache.get_seq_length() == 0 and cache.budget_tokens is None
    # Nothing is half-done: the same cache then works on a longer prompt exactly like a fresh one.
    logits = stream(llama_gqa, cache, make_ids(1, 60), 3)
    fresh = stream(llama_gqa, kvsieve.make_cache(llama_gqa, "streaming_llm", 0.1, sink=4), make_ids(1, 60), 3)
    assert cache.budget_tokens == 6
    torch.testing.assert_close(logits, fresh, atol=0, rtol=0)


def test_4d_mask_and_batch_change_are_rejected(llama_gqa, make_ids) -> None:
    ids = make_ids(2, 6)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    with pytest.raises(ValueError, match="2-D attention_mask"), torch.inference_mode():
        llama_gqa(ids, attention_mask=mask, past_key_values=kvsieve.make_cache(llama_gqa, "h2o", 4))
    cache = kvsieve.make_cache(llama_gqa, "h2o", 4)
    with torch.inference_mode():
        llama_gqa(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="batch size changed from 2 to 1"):
            llama_gqa(ids[:1, :1], past_key_values=cache)


# --------------------------------------------------------------------------------------------------------------------
# kvsieve.generate
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eos_from", ["generate_kwargs", "generation_config"])
def test_generate_per_prompt_results_and_eos(tiny_lm, eos_from, monkeypatch) -> None:
    model, tokenizer = tiny_lm
    prompts = ["Hello there", "The history of the city begins with a small settlement"]
    out = kvsieve.generate(model, tokenizer, prompts, policy="h2o", budget=4, max_new_tokens=10)
    assert out.prompt_tokens == [len(tokenizer(p).input_ids) for p in prompts]
    assert out.budget_tokens == 4 and max(out.cache.slot_counts()) == 4
    assert out.generated_tokens == [10, 10]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    cache = kvsieve.make_cache(model, "h2o", 4)
    new = model.generate(**enc, past_key_values=cache, max_new_tokens=10, do_sample=False)[:, enc.input_ids.shape[1] :]
    tokens = new.tolist()
    assert out.texts == [tokenizer.decode(row, skip_special_tokens=True) for row in tokens]
    assert out.text == out.texts[0]
    # The same generation stopped by an EOS: the first token of row 0 from its 3rd on that is new in the row.
    eos = next(t for i, t in enumerate(tokens[0]) if i >= 2 and t not in tokens[0][:i])
    stop = tokens[0].index(eos) + 1
    other = tokens[1].index(eos) + 1 if eos in tokens[1] else 10
    kwargs = {"eos_token_id": eos}
    if eos_from == "generation_config":
        monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
        kwargs = {}
    stopped = kvsieve.generate(model, tokenizer, prompts, policy="h2o", budget=4, max_new_tokens=10, **kwargs)
    assert stopped.generated_tokens == [stop, other]
    assert stopped.texts[0] == tokenizer.decode(tokens[0][:stop], skip_special_tokens=True)


def test_generate_rejects_bad_arguments(tiny_lm) -> None:
    model, tokenizer = tiny_lm
    with pytest.raises(ValueError, match="prompts must be"):
        kvsieve.generate(model, tokenizer, [])
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        kvsieve.generate(model, tokenizer, "Hi", max_new_tokens=0)
    with pytest.raises(ValueError, match=r"sink \(4\) must be smaller than the budget \(1\)"):
        kvsieve.generate(model, tokenizer, "Hi there", policy="streaming_llm", budget=0.5)
