"""The baselines strided, fixed, random, tova, snapkv, knorm and topk_oracle against naive references."""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kvsieve
from kvsieve.cli import main
from kvsieve.policies import REGISTRY, Slots
from kvsieve.policies.h2o import H2O, H2OParams
from kvsieve.policies.knorm import KNorm, KNormParams
from kvsieve.policies.random import Random, RandomParams
from kvsieve.policies.snapkv import SnapKV
from kvsieve.policies.tova import TOVA

Kept = list[list[list[set[int]]]]  # [layer][row][KV head] -> positions


def _recorder(cache: kvsieve.SieveCache, into: list[Kept]) -> Callable[[], None]:
    def record() -> None:
        into.append([[[set(h.tolist()) for h in row] for row in cache.positions(i)] for i in range(len(cache.layers))])

    return record


def _run(model, policy: str, budget: int, prompt: torch.Tensor, steps: int, stream, **kwargs: Any) -> list[Kept]:
    """Kept positions after the prompt and after every decode step."""
    cache = kvsieve.make_cache(model, policy, budget, **kwargs)
    kept: list[Kept] = []
    stream(model, cache, prompt, steps, on_step=_recorder(cache, kept))
    return kept


def _simulate(priority: Callable[[int, int], tuple], budget: int, prompt: int, steps: int) -> list[set[int]]:
    """The kept set after each step of a rule that, after every step, drops the lowest ``priority(pos, last)``."""
    kept: set[int] = set()
    out = []
    for first, last in [(0, prompt - 1)] + [(p, p) for p in range(prompt, prompt + steps)]:
        kept |= set(range(first, last + 1))
        while len(kept) > budget:
            kept.remove(min(kept, key=lambda p: priority(p, last)))
        out.append(set(kept))
    return out


# --------------------------------------------------------------------------------------------------------------------
# strided and fixed: exact positions
# --------------------------------------------------------------------------------------------------------------------


def _strided(recent: int, stride: int) -> Callable[[int, int], tuple]:
    return lambda p, last: (2 if last - p < recent else 1 if p % stride == 0 else 0, p)


def _fixed(block: int, summary: int) -> Callable[[int, int], tuple]:
    return lambda p, last: (2 if p // block == last // block else 1 if p % block >= block - summary else 0, p)


@pytest.mark.parametrize(
    ("policy", "kwargs", "expected"),
    [
        # window 16..19 + the multiples of 4 (newest first), then after token 20 the oldest multiple (0) goes.
        ("strided", {"recent": 4, "stride": 4}, [{0, 4, 8, 12, 16, 17, 18, 19}, {4, 8, 12, 16, 17, 18, 19, 20}]),
        # only 0 and 8 are candidates: the newest other tokens (14, 15) fill the budget.
        ("strided", {"recent": 4, "stride": 8}, [{0, 8, 14, 15, 16, 17, 18, 19}, {0, 8, 15, 16, 17, 18, 19, 20}]),
        # block 16..19 + the last position of each earlier block; token 20 opens a block: 19 stays as a summary.
        ("fixed", {"block": 4, "summary": 1}, [{3, 7, 11, 15, 16, 17, 18, 19}, {3, 7, 11, 15, 17, 18, 19, 20}]),
    ],
)
def test_pattern_policies_exact_example(llama_gqa, stream, make_ids, policy, kwargs, expected) -> None:
    kept = _run(llama_gqa, policy, 8, make_ids(1, 20), 1, stream, **kwargs)
    assert [step[0][0][0] for step in kept] == expected
    assert all(s == step[0][0][0] for step in kept for layer in step for row in layer for s in row)


@pytest.mark.parametrize(
    ("policy", "kwargs", "rule"),
    [
        ("strided", {"recent": 3, "stride": 5}, _strided(3, 5)),
        ("strided", {}, _strided(5, 5)),  # defaults: recent = budget // 2, stride = recent
        ("fixed", {"block": 4, "summary": 2}, _fixed(4, 2)),
        ("fixed", {}, _fixed(5, 1)),  # defaults: block = budget // 2, summary = max(1, block // 16)
    ],
)
def test_pattern_policies_match_naive_simulation(llama_gqa, stream, make_ids, policy, kwargs, rule) -> None:
    budget, prompt, steps = 11, 23, 30
    kept = _run(llama_gqa, policy, budget, make_ids(2, prompt), steps, stream, **kwargs)
    expected = _simulate(rule, budget, prompt, steps)
    for step, (got, want) in enumerate(zip(kept, expected, strict=True)):
        assert all(s == want for layer in got for row in layer for s in row), f"step {step}"


def test_strided_is_its_rule_over_all_tokens_seen() -> None:
    """The documented closed form: the window plus the best of all earlier tokens, whatever was evicted before."""
    budget, recent, stride = 9, 3, 4
    for step, kept in enumerate(_simulate(_strided(recent, stride), budget, 10, 40)):
        last = 9 + step
        window = set(range(last - recent + 1, last + 1))
        earlier = sorted(range(last - recent + 1), key=lambda p: (p % stride == 0, p), reverse=True)
        assert kept == window | set(earlier[: budget - recent])


# --------------------------------------------------------------------------------------------------------------------
# random
# --------------------------------------------------------------------------------------------------------------------


def _slots(pos: torch.Tensor, last: torch.Tensor) -> Slots:
    empty = torch.zeros(*pos.shape, 0)
    return Slots(pos=pos, state={}, last=last, keys=empty, values=empty)


def test_random_is_deterministic_and_seeded(llama_gqa, stream, make_ids) -> None:
    prompt = make_ids(2, 20)
    a, b = (_run(llama_gqa, "random", 8, prompt, 12, stream, seed=3) for _ in range(2))
    assert a == b
    other = _run(llama_gqa, "random", 8, prompt, 12, stream, seed=4)
    assert other != a
    # heads and rows draw independently; the newest token is always kept (recent=1)
    assert len({frozenset(s) for row in a[-1][0] for s in row}) > 1
    assert all(31 in s for layer in a[-1] for row in layer for s in row)


def test_random_victims_are_uniform_and_recent_is_protected() -> None:
    """Decode steps over 21 slots (oldest first): the victim is uniform among the 19 outside the window of 2."""
    policy = Random(20, RandomParams(seed=0, recent=2))
    counts = torch.zeros(21, dtype=torch.long)
    for last in range(20, 20 + 3800):
        pos = torch.arange(last - 20, last + 1).view(1, 1, 21)
        counts[policy.keep_scores(_slots(pos, torch.tensor([last]))).argmin()] += 1
    assert counts[19:].sum() == 0
    assert counts[:19].min() > 140 and counts[:19].max() < 260  # 200 expected for each


def test_random_draws_do_not_depend_on_the_batch_or_slot_layout() -> None:
    policy = Random(8, RandomParams(seed=7))
    alone = policy.keep_scores(_slots(torch.tensor([[[0, 1, 2, 3, 4, 5]]]), torch.tensor([5])))
    # the same row after another row in a batch, with padding slots and its slots in another order
    batch_pos = torch.tensor([[[9, 8, 7, 6, 5, 4, 3, 2]], [[-1, -1, 5, 3, 4, 0, 2, 1]]])
    batch = policy.keep_scores(_slots(batch_pos, torch.tensor([9, 5])))
    order = batch_pos[1, 0, 2:]
    torch.testing.assert_close(batch[1, 0, 2:], alone[0, 0, order], atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# tova and snapkv: references from the captured observations
# --------------------------------------------------------------------------------------------------------------------


def _capture(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[tuple[int, torch.Tensor, Any]]:
    """Record (layer id, slot positions, observation) of every ``observe`` call of ``cls``."""
    calls: list[tuple[int, torch.Tensor, Any]] = []
    original = cls.observe

    def observe(self, slots, obs) -> None:
        calls.append((id(self), slots.pos.clone(), copy.deepcopy(obs)))
        original(self, slots, obs)

    monkeypatch.setattr(cls, "observe", observe)
    return calls


@pytest.mark.parametrize("per_head", [False, True])
def test_tova_keeps_the_top_of_the_last_query(llama_gqa, stream, make_ids, monkeypatch, per_head) -> None:
    calls = _capture(monkeypatch, TOVA)
    budget, steps = 7, 6
    kept = _run(llama_gqa, "tova", budget, make_ids(2, 18), steps, stream, per_head=per_head)
    n_layers = len(kept[0])
    assert len(calls) == n_layers * (steps + 1)  # one block per step and layer
    for i, (_, pos, obs) in enumerate(calls):
        step, layer = divmod(i, n_layers)
        score = obs.probs[:, :, -1]
        if not per_head:
            score = score.sum(dim=1, keepdim=True).expand_as(score)
        for b in range(2):
            for h in range(score.shape[1]):
                top = score[b, h].topk(budget).indices
                assert kept[step][layer][b][h] == set(pos[b, h, top].tolist()), f"step {step} layer {layer}"
    heads_differ = any(row[0] != row[1] for layer in kept[-1] for row in layer)
    assert heads_differ == per_head


def _naive_snapkv(calls, budget: int, window: int, kernel: int, n_layers: int) -> list[Kept]:
    """SnapKV applied literally to the captured observations, one position at a time."""
    score: dict[tuple[int, int, int], dict[int, float]] = {}
    out: list[Kept] = []
    for i, (_, pos, obs) in enumerate(calls):
        layer = i % n_layers
        if layer == 0:
            out.append([])
        rows: Kept = []
        for b in range(pos.shape[0]):
            last = int(obs.query_pos[b].max())
            heads = []
            for h in range(pos.shape[1]):
                s = score.setdefault((layer, b, h), {})
                for slot, p in enumerate(pos[b, h].tolist()):
                    s.setdefault(p, 0.0)
                    for r, q in enumerate(obs.query_pos[b].tolist()):
                        if q > last - window:
                            s[p] += float(obs.probs[b, h, r, slot])
                held = sorted(s)
                if len(held) > budget:
                    protected = [p for p in held if p > last - window]
                    others = [p for p in held if p <= last - window]
                    half = kernel // 2
                    pooled = {
                        p: max(s[o] for o in others[max(0, j - half) : j + half + 1]) for j, p in enumerate(others)
                    }
                    best = sorted(others, key=lambda p: (pooled[p], p), reverse=True)[: budget - len(protected)]
                    for p in set(others) - set(best):
                        del s[p]
                heads.append(set(s))
            rows.append(heads)
        out[-1].append(rows)
    return out


@pytest.mark.parametrize(("kwargs", "window", "kernel"), [({}, 6, 7), ({"window": 3, "kernel": 3}, 3, 3)])
def test_snapkv_matches_naive_reference(llama_gqa, stream, make_ids, monkeypatch, kwargs, window, kernel) -> None:
    calls = _capture(monkeypatch, SnapKV)
    budget, steps = 12, 10
    kept = _run(llama_gqa, "snapkv", budget, make_ids(2, 30), steps, stream, **kwargs)
    assert kept == _naive_snapkv(calls, budget, window, kernel, len(kept[0]))
    # the prompt's selection is not just the newest tokens
    assert any(min(s) < 30 - budget for layer in kept[0] for row in layer for s in row)


# --------------------------------------------------------------------------------------------------------------------
# knorm: from the key norms of an uncompressed run
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recent", [0, 3])
def test_knorm_keeps_the_lowest_key_norms(llama_gqa, stream, make_ids, recent) -> None:
    budget, prompt_len, steps = 8, 20, 10
    prompt = make_ids(2, prompt_len)
    kept = _run(llama_gqa, "knorm", budget, prompt, steps, stream, recent=recent)
    full = DynamicCache(config=llama_gqa.config)
    stream(llama_gqa, full, prompt, steps)  # the same tokens (the stream's decode tokens are seeded)
    norms = [layer.keys.norm(dim=-1) for layer in full.layers]  # [B, H, L]

    def expected(layer: int, b: int, h: int, last: int) -> set[int]:
        window = set(range(last - recent + 1, last + 1))
        # lowest norms first; equal norms (a repeated token: RoPE keeps the norm) newer first
        earlier = sorted(range(last - recent + 1), key=lambda p: (float(norms[layer][b, h, p]), -p))
        return window | set(earlier[: budget - recent])

    # after the prompt every layer's keys are those of full attention; later, layer 0's keys still are
    for layer in range(len(norms)):
        for b in range(2):
            for h in range(norms[0].shape[1]):
                assert kept[0][layer][b][h] == expected(layer, b, h, prompt_len - 1)
    for step in range(1, steps + 1):
        last = prompt_len - 1 + step
        assert [[kept[step][0][b][h] for h in range(2)] for b in range(2)] == [
            [expected(0, b, h, last) for h in range(2)] for b in range(2)
        ]


def test_knorm_ties_keep_the_newer_token_whatever_the_slot_order() -> None:
    policy = KNorm(2, KNormParams())
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])  # norms 1, 1, 2
    for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0]):
        pos = torch.tensor([5, 2, 7])[order].view(1, 1, 3)
        state = policy.initial_state(keys[order].view(1, 1, 3, 2), pos)  # the priority is set when a token is cached
        slots = Slots(pos=pos, state=state, last=torch.tensor([7]), keys=keys[order].view(1, 1, 3, 2), values=keys)
        ranked = policy.keep_scores(slots)[0, 0].argsort(descending=True)
        assert pos[0, 0, ranked].tolist() == [5, 2, 7]


# --------------------------------------------------------------------------------------------------------------------
# topk_oracle: an eager attention masked to the top-k logits of each query
# --------------------------------------------------------------------------------------------------------------------


def _topk_attention(k: int):
    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        logits = (query @ keys.transpose(-1, -2) * scaling).masked_fill(~attention_mask, float("-inf"))
        top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
        keep = torch.zeros_like(attention_mask.expand_as(logits)).scatter(-1, top, True) & attention_mask
        out = F.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1) @ values
        return out.transpose(1, 2), None

    return attention


def test_topk_oracle_equals_masked_eager_attention_and_keeps_everything(llama_gqa, stream, make_ids) -> None:
    k, prompt, steps = 5, make_ids(2, 16), 8
    AttentionInterface.register("topk_ref", _topk_attention(k))
    AttentionMaskInterface.register("topk_ref", lambda **kw: sdpa_mask(**{**kw, "allow_is_causal_skip": False}))
    ref_model = copy.deepcopy(llama_gqa)
    ref_model.set_attn_implementation("topk_ref")
    reference = stream(ref_model, DynamicCache(config=ref_model.config), prompt, steps)
    cache = kvsieve.make_cache(llama_gqa, "topk_oracle", k)
    logits = stream(llama_gqa, cache, prompt, steps)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    assert cache.slot_counts() == [16 + steps] * len(cache.layers)
    assert cache.layers[0].policy.budget == k and not REGISTRY["topk_oracle"].bounded
    full = stream(llama_gqa, kvsieve.make_cache(llama_gqa, "full"), prompt, steps)
    assert not torch.allclose(logits, full, atol=1e-2)  # the narrowing really changes the attention


def test_topk_oracle_needs_a_budget(llama_gqa) -> None:
    with pytest.raises(ValueError, match="topk_oracle: budget must be a positive number"):
        kvsieve.make_cache(llama_gqa, "topk_oracle", None)


# --------------------------------------------------------------------------------------------------------------------
# validation, attention needs, listing
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "kwargs", "message"),
    [
        ("strided", {"recent": 9}, "strided: recent must be in"),
        ("strided", {"stride": 0}, "strided: stride must be >= 1"),
        ("fixed", {"block": 9}, "fixed: block must be in"),
        ("fixed", {"block": 4, "summary": 5}, "fixed: summary must be in"),
        ("random", {"recent": 9}, "random: recent must be in"),
        ("snapkv", {"window": 9}, "snapkv: window must be in"),
        ("snapkv", {"kernel": 4}, "snapkv: kernel must be a positive odd number"),
        ("knorm", {"recent": -1}, "knorm: recent must be in"),
        ("streaming_llm", {"sink": True}, "invalid value True for streaming_llm parameter 'sink'"),
        ("h2o", {"normalize": "false", "recent": "abc"}, "invalid value 'abc' for h2o parameter 'recent'"),
    ],
)
def test_bad_params(llama_gqa, policy, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, policy, 8, **kwargs)


# Values of each annotated type: accepted (given → stored) and refused, as Python values and as command-line text.
GOOD: dict[type, list[tuple[Any, Any]]] = {
    bool: [(True, True), (False, False), ("true", True), ("FALSE", False), ("1", True), ("0", False)],
    int: [(3, 3), ("3", 3), ("-2", -2)],
    float: [(1, 1.0), (0.25, 0.25), ("0.25", 0.25), ("1", 1.0)],
}
BAD: dict[type, list[Any]] = {
    bool: [1, 0, 2.5, "abc", "yes", "2", ""],
    int: [True, 2.5, 2.0, "2.5", "abc", "true", ""],
    float: [True, False, "abc", "true", ""],
}
NONE = [None, "none", "NULL"]
PARAMS = [
    (name, f.name, typing.get_type_hints(cls.Params)[f.name])
    for name, cls in REGISTRY.items()
    for f in dataclasses.fields(cls.Params)
]


def _cases(kind: Any) -> tuple[list[tuple[Any, Any]], list[Any]]:
    """(accepted (given, stored) pairs, refused values) for a parameter annotated ``kind``."""
    args = typing.get_args(kind)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else kind
    if typing.get_origin(base) is typing.Literal:
        good, bad = [(c, c) for c in typing.get_args(base)], [1, True, "nope", ""]
    else:
        good, bad = GOOD[base], BAD[base]
    return (good + [(v, None) for v in NONE], bad) if optional else (good, bad + NONE)


def test_params_walk_covers_every_kind() -> None:
    kinds = {kind for _, _, kind in PARAMS}
    assert {bool, int, float, int | None} <= kinds
    assert any(typing.get_origin(kind) is typing.Literal for _, _, kind in PARAMS)


@pytest.mark.parametrize(("policy", "name", "kind"), PARAMS, ids=[f"{p}-{n}" for p, n, _ in PARAMS])
def test_params_are_checked_against_their_annotations(policy, name, kind) -> None:
    cls = REGISTRY[policy]
    good, bad = _cases(kind)
    for value, expected in good:
        stored = getattr(cls.make_params(**{name: value}), name)
        assert stored == expected and type(stored) is type(expected), (value, stored)
    for value in bad:
        with pytest.raises(ValueError, match=rf"^invalid value .* for {policy} parameter '{name}' \(expected .+\)$"):
            cls.make_params(**{name: value})


@pytest.mark.parametrize(
    ("policy", "kwargs", "message"),
    [
        ("h2o", {"normalize": "abc"}, "invalid value 'abc' for h2o parameter 'normalize' (expected true/false)"),
        ("h2o", {"recent": 1.5}, "invalid value 1.5 for h2o parameter 'recent' (expected an integer or none)"),
        ("h2o", {"recent_ratio": True}, "invalid value True for h2o parameter 'recent_ratio' (expected a number)"),
        (
            "h2o",
            {"transform": "square"},
            "invalid value 'square' for h2o parameter 'transform' (expected one of identity, sqrt, log)",
        ),
        (
            "streaming_llm",
            {"sink": "2.5"},
            "invalid value '2.5' for streaming_llm parameter 'sink' (expected an integer)",
        ),
        ("local", {"sink": 4}, "policy 'local' has no parameter(s) sink (parameters: none)"),
    ],
)
def test_params_errors_say_what_is_expected(policy, kwargs, message) -> None:
    with pytest.raises(ValueError) as err:
        REGISTRY[policy].make_params(**kwargs)
    assert str(err.value) == message


def test_h2o_params_built_directly_still_check_the_transform() -> None:
    with pytest.raises(ValueError, match="h2o: transform must be one of identity, sqrt, log"):
        H2O(8, H2OParams(transform="square"))


def test_only_attention_policies_ask_for_probabilities() -> None:
    baselines = ("strided", "fixed", "random", "tova", "snapkv", "knorm", "topk_oracle")
    assert {name for name in baselines if REGISTRY[name].needs_attention} == {"tova", "snapkv", "topk_oracle"}


def test_policies_json_lists_memory_saving(capsys) -> None:
    assert main(["policies", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["policies"]}
    assert set(rows) == set(REGISTRY)
    assert rows["topk_oracle"]["saves_memory"] is False and rows["topk_oracle"]["takes_budget"] is True
    assert rows["full"]["takes_budget"] is False and rows["snapkv"]["saves_memory"] is True
    assert rows["snapkv"]["params"] == {"window": None, "kernel": 7}
    assert all(row["paper"] and row["summary"] for row in rows.values())
