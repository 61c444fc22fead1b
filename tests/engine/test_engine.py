"""The engine on tiny random models: decisions and positions shared per step, ratio budgets, memory, what it refuses
(budgets, models, masks), ``kvsieve.generate``. Each policy's own rule is tested in its file (``test_h2o.py``, ...)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM, T5Config, T5ForConditionalGeneration

import kvsieve
from kvsieve.engine import compiled
from kvsieve.engine import eviction as eviction_module
from kvsieve.engine import layer as layer_module
from kvsieve.engine import step as step_module
from kvsieve.engine.rules import ScoreRule
from kvsieve.engine.scan import MAX_RUN, scan
from kvsieve.engine.storage import expand_index
from kvsieve.engine.stream import chunk_positions
from kvsieve.policies import REGISTRY, Slots, get_policy
from kvsieve.policies.base import SinkWindow

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


@pytest.mark.parametrize(
    "policy", [name for name, cls in REGISTRY.items() if cls.positional and not issubclass(cls, SinkWindow)]
)
def test_positional_layers_share_every_run_of_a_scanned_stream(llama_gqa, make_ids, monkeypatch, policy) -> None:
    """A stream scanned in several runs in one forward pass (each layer scans all its runs before the next layer
    starts): the first layer of the group decides every run and the others take each decision, with the logits and
    kept positions of every layer deciding alone."""
    cls = get_policy(policy)
    calls: list[bool] = []

    class Counted(cls):
        def keep_scores(self, slots: Slots) -> torch.Tensor:
            calls.append(self.positional)
            return super().keep_scores(slots)

    class Alone(Counted):
        positional = False

    runs = []
    monkeypatch.setattr(layer_module, "scan", lambda *args: runs.append(1) or scan(*args))
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :6] = 0
    results = []
    for variant in (Counted, Alone):
        cache = kvsieve.make_cache(llama_gqa, variant, 9, stream=True)
        with torch.inference_mode():
            logits = llama_gqa(input_ids=make_ids(2, 200), attention_mask=mask, cache=cache).logits
        results.append((logits, [cache.positions(i).sort(dim=-1).values for i in range(3)]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
    assert len(runs) >= 2 * 3 * 2  # several runs per layer, both variants
    shared, alone = calls.count(True), calls.count(False)
    assert shared > 2 * MAX_RUN and alone == 3 * shared


def test_each_step_computes_its_positions_once_for_all_layers(gemma3, stream, make_ids, monkeypatch) -> None:
    """The first layer of a one-chunk step computes the positions for every layer (sliding and global ones alike,
    with padding), and the outputs are those of each layer computing them alone."""
    calls = []

    def counted(*args):
        calls.append(args)
        return chunk_positions(*args)

    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0
    runs = []
    for shared in (True, False):
        cache = kvsieve.make_cache(gemma3, "h2o", 9)
        if not shared:  # every layer computes everything itself
            cache.memo.share = lambda what, stamp, make: make()
        runs.append(stream(gemma3, cache, make_ids(2, 20), 5, attention_mask=mask))
    assert torch.equal(runs[0], runs[1])
    monkeypatch.setattr(step_module, "chunk_positions", counted)
    cache = kvsieve.make_cache(gemma3, "h2o", 9)
    stream(gemma3, cache, make_ids(2, 20), 5, attention_mask=mask)
    assert len(cache.layers) > 1 and len(calls) == 6  # the prompt, then each token: once for all layers


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o", "knorm"])
def test_a_shared_victim_is_expanded_once_for_all_layers(llama_gqa, stream, make_ids, monkeypatch, policy) -> None:
    """The slot a positional group's layers all evicted is expanded over the keys' head dimension once per decode
    step (the next token is written into it), by the first layer; a compiled decode step (h2o) or victim (knorm)
    writes each layer's victims into the same buffer every step, expanded once for all steps. The kept positions
    are those of every layer expanding at every step."""
    calls, params = [], {"recent": 2} if policy == "knorm" else {}

    def counted(index: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        calls.append(t.dim())
        return expand_index(index, t)

    steps, kept = 6, []
    for shared in (True, False):
        cache = kvsieve.make_cache(llama_gqa, policy, 9, **params)
        if not shared:
            cache.memo.derive = lambda what, source, make: make()
        stream(llama_gqa, cache, make_ids(2, 20), steps)
        kept.append([cache.positions(i).sort(dim=-1).values for i in range(len(cache.layers))])
    assert all(torch.equal(a, b) for a, b in zip(*kept, strict=True))
    monkeypatch.setattr(eviction_module, "expand_index", counted)
    cache = kvsieve.make_cache(llama_gqa, policy, 9, **params)
    stream(llama_gqa, cache, make_ids(2, 20), steps)
    expansions = calls.count(4)  # (positions are 3-D: their index is the victim itself)
    assert expansions == (steps - 1 if policy == "streaming_llm" else len(cache.layers))


def test_ahakv_step_gain_is_computed_once_per_decode_step(llama_gqa, stream, make_ids, monkeypatch) -> None:
    """AhaKV's step-gain multiplier depends on the rows' newest positions and the budget alone: the layers of a
    decode step (equal budgets: equal rules) share one, with the logits and kept positions of each layer computing
    its own."""
    calls = []
    scale = ScoreRule.logit_scale

    def counted(rule: ScoreRule, query_pos: torch.Tensor) -> torch.Tensor:
        calls.append(rule.gain)
        return scale(rule, query_pos)

    monkeypatch.setattr(ScoreRule, "logit_scale", counted)
    steps, runs = 6, []
    for shared in (True, False):
        calls.clear()
        cache = kvsieve.make_cache(llama_gqa, "ahakv", 9)
        if not shared:
            cache.memo.derive = lambda what, source, make: make()
        logits = stream(llama_gqa, cache, make_ids(2, 20), steps)
        runs.append((logits, [cache.positions(i) for i in range(len(cache.layers))], len(calls)))
    (logits, kept, once), (alone_logits, alone_kept, per_layer) = runs
    assert torch.equal(logits, alone_logits)
    assert all(torch.equal(a, b) for a, b in zip(kept, alone_kept, strict=True))
    assert per_layer - once == steps * (len(cache.layers) - 1)


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
        llama_gqa(make_ids(1, 30), cache=cache)  # a later chunk does not re-resolve
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


def test_kernels_are_auto_or_torch(llama_gqa) -> None:
    with pytest.raises(ValueError, match="kernels must be one of auto, torch, got 'numba'"):
        kvsieve.make_cache(llama_gqa, "h2o", 8, kernels="numba")
    torch_only = kvsieve.make_cache(llama_gqa, "h2o", 8, kernels="torch")
    assert not any(layer.kernels for layer in torch_only.layers)
    auto = kvsieve.make_cache(llama_gqa, "h2o", 8)
    assert all(layer.kernels == (compiled.numba is not None) for layer in auto.layers)


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
        llama_gqa(make_ids(1, 20), cache=cache)
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
        llama_gqa(ids, attention_mask=mask, cache=kvsieve.make_cache(llama_gqa, "h2o", 4))
    cache = kvsieve.make_cache(llama_gqa, "h2o", 4)
    with torch.inference_mode():
        llama_gqa(ids, cache=cache)
        with pytest.raises(ValueError, match="batch size changed from 2 to 1"):
            llama_gqa(ids[:1, :1], cache=cache)


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
    new = model.generate(**enc, cache=cache, max_new_tokens=10, do_sample=False)[:, enc.input_ids.shape[1] :]
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
