"""The compiled scan (kvsieve.engine.compiled): the same decisions as the torch scan, where it applies."""

from __future__ import annotations

import math

import pytest
import torch

import kvsieve
from kvsieve.engine import compiled, compiled_scan
from kvsieve.engine import step as step_module
from kvsieve.engine.rules import FixedPriority, LowMarks, Pattern, ScoreRule
from kvsieve.policies import REGISTRY
from kvsieve.policies.ahakv import AhaKV
from kvsieve.policies.base import Observation, Slots, accumulate, demote
from kvsieve.policies.families import MarksPolicy, PriorityPolicy
from kvsieve.policies.h2o import H2O
from kvsieve.policies.knorm import KNorm
from kvsieve.policies.scissorhands import Scissorhands
from kvsieve.policies.snapkv import SnapKV

pytestmark = pytest.mark.skipif(compiled.numba is None, reason="numba (the `fast` extra) is not installed")


def _streamed(model, ids, policy, budget, mask=None, **kwargs):
    """One stream-protocol forward over ``ids``: its logits and every layer's held positions (sorted)."""
    cache = kvsieve.make_cache(model, policy, budget, stream=True, **kwargs)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, cache=cache).logits
    layers = model.config.num_hidden_layers
    return logits, [cache.positions(i).sort(dim=-1).values for i in range(layers)]


def _both(model, ids, policy, budget, monkeypatch, mask=None, **kwargs):
    """The stream with the compiled loop (and, for each run it decided, whether padding was held or came in it)
    and with the torch scan."""
    runs = []
    loop = compiled_scan._score_rule

    def padded(query_pos, pads):  # (the loop's arguments: logits, pos, query_pos, lasts, pads, ...)
        return bool(pads.any() or (query_pos < 0).any())

    monkeypatch.setattr(
        compiled_scan, "_score_rule", lambda *args: runs.append(padded(args[2], args[4])) or loop(*args)
    )
    marks = compiled_scan._low_marks
    monkeypatch.setattr(compiled_scan, "_low_marks", lambda *args: runs.append(False) or marks(*args))
    fixed = compiled_scan._fixed_priority
    monkeypatch.setattr(compiled_scan, "_fixed_priority", lambda *args: runs.append(False) or fixed(*args))
    fast = _streamed(model, ids, policy, budget, mask, **kwargs)
    slow = _streamed(model, ids, policy, budget, mask, kernels="torch", **kwargs)
    return fast, slow, runs


@pytest.mark.parametrize(
    ("policy", "model_name", "dtype", "budget", "params"),
    [
        ("h2o", "llama_gqa", torch.float32, 9, {}),
        ("h2o", "llama_gqa", torch.float32, 24, {"recent": 0}),
        ("h2o", "llama_mha", torch.float32, 16, {"recent_ratio": 1.0}),
        ("h2o", "llama_gqa", torch.float64, 12, {}),
        ("h2o", "gemma3", torch.float32, 10, {}),
        ("tova", "llama_gqa", torch.float32, 9, {}),
        ("tova", "llama_gqa", torch.float32, 14, {"per_head": True}),
        ("tova", "llama_mha", torch.float64, 11, {}),
        ("h2o+local", "llama_gqa", torch.float32, 9, {}),
        ("h2o+local", "llama_mha", torch.float32, 20, {"heavy_ratio": 0.2}),
        ("scissorhands", "llama_gqa", torch.float32, 12, {}),
        ("scissorhands", "llama_gqa", torch.float32, 16, {"window": 7, "drop": 1, "recent": 0}),
        ("scissorhands", "llama_mha", torch.float64, 10, {"threshold": "paper", "drop": 3}),
        ("knorm", "llama_gqa", torch.float32, 12, {}),
        ("knorm", "llama_gqa", torch.float32, 9, {"recent": 0}),
        ("knorm", "llama_mha", torch.float64, 14, {"drop": 4, "recent": 3}),
        ("h2o+strided", "llama_gqa", torch.float32, 12, {}),
        ("h2o+strided", "llama_mha", torch.float64, 16, {"stride": 3, "recent": 2, "heavy_ratio": 0.25}),
        ("h2o+fixed", "llama_gqa", torch.float32, 12, {}),
        ("h2o+fixed", "llama_mha", torch.float32, 20, {"block": 5, "summary": 2, "heavy_ratio": 0.3}),
        ("snapkv", "llama_gqa", torch.float32, 12, {}),
        ("snapkv", "llama_mha", torch.float64, 16, {"window": 3, "kernel": 5}),
        ("snapkv", "llama_gqa", torch.float32, 10, {"kernel": 1}),
        ("ahakv", "llama_gqa", torch.float32, 12, {}),
        ("ahakv", "llama_mha", torch.float64, 10, {"recent": 2}),
        ("ahakv", "llama_gqa", torch.float32, 14, {"sgs": False, "ra": False, "recent": 0}),
        ("ahakv", "llama_gqa", torch.float32, 9, {"sgs_decode": False}),
    ],
)
def test_the_compiled_loop_streams_as_the_torch_scan(
    tiny_models, make_ids, monkeypatch, policy, model_name, dtype, budget, params
) -> None:
    """Every policy that states a rule, in fp32 and fp64, GQA or not, a batch of two: the same kept tokens and
    logits, decided by the loop in every scanned run."""
    model = tiny_models(model_name, dtype)
    ids = make_ids(2, 160)
    (fast_logits, fast_kept), (slow_logits, slow_kept), runs = _both(model, ids, policy, budget, monkeypatch, **params)
    assert all(map(torch.equal, fast_kept, slow_kept))
    assert torch.equal(fast_logits, slow_logits)
    if model_name != "gemma3":  # (its sliding layers are not scanned: the window)
        assert len(runs) >= model.config.num_hidden_layers * 2


class _HighKeys(PriorityPolicy):
    """A new member of the fixed-priority family (not registered): its rule and a priority per token, nothing else."""

    name = "high_keys"

    def priority_rule(self) -> FixedPriority:
        return FixedPriority(recent=2, drop=3)

    def initial_priority(self, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return torch.sub(pos, (keys.float().amax(dim=-1) * 64).round().long(), alpha=-(2**32))  # (ties: newest)


class _ByStepMarks(MarksPolicy):
    """A new member of the low-marks family (not registered): its rule, nothing else."""

    name = "by_step_marks"

    def marks_rule(self) -> LowMarks:
        return LowMarks(window=6, recent=1, drop=2, by_step=True)


@pytest.mark.parametrize("policy", [_HighKeys, _ByStepMarks])
def test_a_new_member_of_a_family_is_run_by_the_loops_as_by_its_torch_statement(
    llama_gqa, make_ids, monkeypatch, policy
) -> None:
    """A policy that states only a family's rule streams with the compiled loop, the same logits and kept tokens as
    the family's torch code, and decodes alike."""
    (fast_logits, fast_kept), (slow_logits, slow_kept), runs = _both(
        llama_gqa, make_ids(2, 120), policy, 12, monkeypatch
    )
    assert len(runs) >= 3 * 2
    assert all(map(torch.equal, fast_kept, slow_kept))
    assert torch.equal(fast_logits, slow_logits)
    _generates_alike(llama_gqa, make_ids, monkeypatch, policy, padded=True)


class _LeastAttendedH2O(H2O):
    """h2o keeping the tokens least attended: it overrides how it observes and states no rule of its own (not
    registered)."""

    name = "least_attended_h2o"

    def observe(self, slots: Slots, obs: Observation) -> None:
        accumulate(slots.state["score"], -obs.probs)


class _MostMarkedScissorhands(Scissorhands):
    """Scissorhands keeping its most-marked tokens: it overrides how it scores and states no rule of its own (not
    registered)."""

    name = "most_marked_scissorhands"

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        return -super().keep_scores(slots)


class _LowestKNorm(KNorm):
    """knorm keeping its largest key norms: it overrides how it scores and states no rule of its own."""

    name = "lowest_knorm"

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        return -super().keep_scores(slots)


@pytest.mark.parametrize(
    ("policy", "parent"), [(_LeastAttendedH2O, H2O), (_MostMarkedScissorhands, Scissorhands), (_LowestKNorm, KNorm)]
)
def test_a_policy_that_overrides_its_familys_statement_is_never_run_by_the_loops(
    llama_gqa, make_ids, monkeypatch, policy, parent
) -> None:
    """A subclass that overrides how its family observes or scores, without stating its own rule, keeps its parent's
    rule (its own methods read it) but no compiled loop stands in for its methods: neither in a stream nor at a
    decode step. Its own code decides (other tokens than its parent's), with the loops available or not."""
    assert parent(12).compiled_rule is not None
    assert policy(12).rule == parent(12).rule and policy(12).compiled_rule is None
    ids = make_ids(2, 120)
    (fast_logits, fast_kept), (slow_logits, slow_kept), runs = _both(llama_gqa, ids, policy, 12, monkeypatch)
    assert not runs
    assert all(map(torch.equal, fast_kept, slow_kept)) and torch.equal(fast_logits, slow_logits)
    _, parents_kept = _streamed(llama_gqa, ids, parent, 12)
    assert not all(map(torch.equal, fast_kept, parents_kept))
    calls: list[int] = []
    for name in ("_decode_rule", "_decode_marks", "_victims", "_fixed_victims"):
        monkeypatch.setattr(compiled, name, _counted(getattr(compiled, name), calls))
    _generates_alike(llama_gqa, make_ids, monkeypatch, policy, padded=False)
    assert not calls


@pytest.mark.parametrize(
    ("policy", "params"),
    [
        ("h2o", {}),
        ("tova", {}),
        ("h2o+local", {}),
        ("h2o", {"recent": 0}),
        ("h2o+fixed", {}),
        ("h2o+strided", {}),
        ("snapkv", {}),
        ("ahakv", {}),
    ],
)
def test_left_padded_batches_stream_the_same_with_the_compiled_loop(llama_gqa, make_ids, monkeypatch, policy, params):
    """Padding slots go first, padding queries observe nothing and see every slot: as in the torch scan."""
    mask = torch.ones(2, 140, dtype=torch.long)
    mask[1, :7] = 0
    (fast_logits, fast_kept), (slow_logits, slow_kept), runs = _both(
        llama_gqa, make_ids(2, 140), policy, 9, monkeypatch, mask=mask, **params
    )
    assert len(runs) >= 3 * 2 and any(runs)  # (padding in some)
    assert all(map(torch.equal, fast_kept, slow_kept))
    assert torch.equal(fast_logits, slow_logits)


@pytest.mark.parametrize(
    ("policy", "params"),
    [
        ("h2o", {"transform": "sqrt"}),
        ("ahakv", {"sgs_tokens": "kept"}),
        ("snapkv", {"window": 0}),
        ("snapkv", {"pooling": "mean"}),
    ],
)
def test_the_torch_scan_decides_where_no_rule_applies(llama_gqa, make_ids, monkeypatch, policy, params) -> None:
    """Variants whose rule the loop does not run: it is never called, and the results are the torch scan's."""
    fast, slow, runs = _both(llama_gqa, make_ids(2, 120), policy, 9, monkeypatch, **params)
    assert not runs
    assert torch.equal(fast[0], slow[0])


def test_only_policies_with_such_a_rule_state_it() -> None:
    rules = {name: cls(16).scan_rule() for name, cls in REGISTRY.items() if cls.bounded}
    assert rules.pop("h2o") == ScoreRule(accumulate=True, kept=Pattern(keep=0, recent=8))
    assert rules.pop("tova") == ScoreRule(accumulate=False, across_heads=True)
    assert rules.pop("h2o+local") == ScoreRule(accumulate=True, kept=Pattern(keep=8, recent=8))
    assert rules.pop("h2o+strided") == ScoreRule(accumulate=True, kept=Pattern(keep=8, recent=4, period=4, span=1))
    assert rules.pop("h2o+fixed") == ScoreRule(
        accumulate=True, kept=Pattern(keep=8, block=4, period=4, offset=1, span=1)
    )
    assert rules.pop("snapkv") == ScoreRule(accumulate=True, kept=Pattern(keep=0, recent=8), pool=7)
    aha = rules.pop("ahakv")
    assert (aha.accumulate, aha.kept, aha.pool) == (True, Pattern(keep=0, recent=8), 0)
    gain = aha.logit_scale(torch.tensor([[14, 15, 63]]))  # (15, 16 and 64 tokens seen)
    assert gain.tolist() == [pytest.approx([0.0, 0.0, (2 * math.log(4)) ** 0.5])]
    assert rules.pop("scissorhands") == LowMarks(window=100, recent=9, drop=8, by_step=False)
    assert rules.pop("knorm") == FixedPriority(recent=8, drop=1)
    assert set(rules.values()) == {None}
    assert H2O(16, H2O.make_params(normalize=True)).scan_rule() is None
    assert H2O(16, H2O.make_params(recent=3)).scan_rule() == ScoreRule(accumulate=True, kept=Pattern(keep=0, recent=3))
    assert AhaKV(16, AhaKV.make_params(sgs=False)).scan_rule().gain == 0
    assert SnapKV(16, SnapKV.make_params(pooling="mean")).scan_rule() is None  # (the loops pool by the maximum)


def _slots(gen: torch.Generator, n: int, padding: int) -> Slots:
    """A layer's slots in use as a decode step leaves them: two rows, three heads, held positions with gaps in
    any slot order (a victim's slot takes the next token), ``padding`` slots of padding in the first row, scores
    with ties."""
    batch, heads, last = 2, 3, 4 * n
    pos = torch.empty(batch, heads, n, dtype=torch.long)
    for b in range(batch):
        for h in range(heads):
            window = torch.arange(last - n // 4 + 1, last + 1)  # (the newest: a recent window is held)
            older = torch.randperm(last - n // 4 + 1, generator=gen)[: n - len(window)]
            pos[b, h] = torch.cat([older, window])[torch.randperm(n, generator=gen)]
    pos[0, :, torch.randperm(n, generator=gen)[:padding]] = -1
    score = torch.randint(0, 6, (batch, heads, n), generator=gen).float() / 8
    priority = torch.randint(-3, 3, (batch, heads, n), generator=gen)
    state = {"score": score, "priority": priority}
    return Slots(pos, state, torch.tensor([last, last]), torch.zeros(0), torch.zeros(0))


@pytest.mark.parametrize(
    ("policy", "params"),
    [
        ("snapkv", {}),
        ("snapkv", {"kernel": 3, "window": 5}),
        ("h2o+strided", {}),
        ("h2o+strided", {"stride": 3, "recent": 2}),
        ("h2o+fixed", {}),
        ("h2o+fixed", {"block": 5, "summary": 2}),
        ("h2o+local", {}),
        ("knorm", {}),
        ("knorm", {"recent": 0}),
    ],
)
@pytest.mark.parametrize("padding", [0, 3])
def test_a_decode_steps_victim_is_the_policys(policy, params, padding) -> None:
    """The compiled victim is the slot the policy's priorities give (padding first, then argmin: ties to the
    first slot, or for pooled scores to the oldest), whatever the slot order."""
    cls = REGISTRY[policy]
    instance = cls(16, cls.make_params(**params))
    gen = torch.Generator().manual_seed(len(policy) + padding)
    for _ in range(20):
        slots = _slots(gen, 17, padding)
        scores = instance.keep_scores(slots)
        if padding:
            scores = demote(scores, slots.pos < 0)
        expected = scores.argmin(dim=-1, keepdim=True)
        assert torch.equal(compiled.compiled_victims(instance.rule, slots, padding > 0), expected)


@pytest.mark.parametrize("policy", ["h2o", "tova", "ahakv"])
def test_a_decode_step_asks_the_policy_where_the_loop_does_not_pay(policy) -> None:
    """A plain recent window (or none) is one or two ops: the loop does not take it."""
    instance = REGISTRY[policy](16)
    assert compiled.compiled_victims(instance.rule, _slots(torch.Generator().manual_seed(0), 17, 0), False) is None


def _counted(loop, calls: list[int]):
    """``loop`` noting each call in ``calls``."""

    def counted(*args):
        calls.append(1)
        return loop(*args)

    return counted


RULE_POLICIES = [
    *("h2o", "tova", "ahakv", "snapkv", "h2o+local", "h2o+strided", "h2o+fixed", "scissorhands"),
    "ahakv:kv_bits=4,group_size=8,residual=3",  # (quantized slots: read dequantized, exact within the residual)
]


def _generates_alike(model, make_ids, monkeypatch, policy: str | type, padded: bool) -> None:
    """A prompt (its second row left-padded, if ``padded``), then 29 decode steps: the same tokens and the same held
    positions with the compiled loops and without them."""
    ids = make_ids(2, 8 if padded else 40)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0 if padded else 1
    results = []
    for kernels in ("auto", "torch"):
        cache = kvsieve.make_cache(model, policy, 12, kernels=kernels)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, cache=cache, max_new_tokens=30, do_sample=False, pad_token_id=0
            )
        results.append((out, [cache.positions(i).sort(dim=-1).values for i in range(3)]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(map(torch.equal, results[0][1], results[1][1]))


@pytest.mark.parametrize("policy", RULE_POLICIES)
@pytest.mark.parametrize("padded", [False, True])
def test_generation_decodes_the_same_with_the_compiled_step(llama_gqa, make_ids, monkeypatch, policy, padded) -> None:
    """Decode steps with the loops (each step's scores and victim in one call; while padding is held, the victim alone
    where pooling or a pattern ranks) give what they give without them."""
    calls = {"_decode_rule": [], "_decode_marks": [], "_victims": []}
    for name, seen in calls.items():
        monkeypatch.setattr(compiled, name, _counted(getattr(compiled, name), seen))
    _generates_alike(llama_gqa, make_ids, monkeypatch, policy, padded)
    # (While a row's padding is held, the victim alone, by the loop where it ranks; once it is gone, whole steps.
    # Scissorhands counts each row's tokens: a padded row keeps fewer, its empty slots stay.)
    rule = REGISTRY[policy.split(":")[0]](12).rule
    marks = isinstance(rule, LowMarks)
    steps = calls["_decode_marks" if marks else "_decode_rule"]
    assert len(steps) >= 3 * (0 if padded and marks else 20 if padded else 29)
    ranks = isinstance(rule, ScoreRule) and bool(rule.pool or rule.kept.keep)
    assert bool(calls["_victims"]) == (padded and ranks)


@pytest.mark.parametrize("padded", [False, True])
def test_generation_decodes_the_same_with_the_compiled_fixed_priority_victim(llama_gqa, make_ids, monkeypatch, padded):
    """knorm (a :class:`FixedPriority`): each decode step's victim by the loop, the same tokens and held positions as
    by the policy's priorities in torch."""
    calls = []
    monkeypatch.setattr(compiled, "_fixed_victims", _counted(compiled._fixed_victims, calls))
    _generates_alike(llama_gqa, make_ids, monkeypatch, "knorm:recent=4", padded)
    assert len(calls) >= 3 * (20 if padded else 29)


def test_the_position_order_is_repaired_after_a_decode_step_and_sorted_otherwise() -> None:
    """A pooling rule's compiled decode step keeps the slots' position order from step to step: the order of the
    step before, its victim's slot (now the newest token) moved last, is the position order; a buffer that is not
    the order of the step before (new, stale, another permutation, out of range) is sorted again."""
    gen = torch.Generator().manual_seed(0)
    n, last = 40, 99
    pos = torch.randperm(100, generator=gen)[:n].view(1, 1, n)
    pos[0, 0, 7] = last  # (the newest token)
    ranked = torch.full((n,), -1)

    def order(repair: bool) -> torch.Tensor:
        compiled._position_order(pos.numpy(), 0, 0, int(pos.max()), ranked.numpy(), repair)
        return ranked.clone()

    assert torch.equal(order(True), pos[0, 0].argsort())  # (a new buffer: sorted)
    for step in range(5):  # decode steps: the victim's slot takes the newest position
        victim = int(torch.randint(n, (1,), generator=gen))
        pos[0, 0, victim] = last + 1 + step
        assert torch.equal(order(True), pos[0, 0].argsort())
    swapped = ranked.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    for stale in (swapped, torch.arange(n), torch.full((n,), n)):
        ranked.copy_(stale)
        assert torch.equal(order(True), pos[0, 0].argsort())
    ranked.copy_(swapped)
    assert torch.equal(order(False), pos[0, 0].argsort())  # (no repair asked: sorted)


def test_snapkv_decode_steps_keep_the_same_tokens_with_the_order_kept_or_sorted(
    llama_gqa, make_ids, monkeypatch
) -> None:
    """Generation under snapkv (pooling in position order) holds the same positions whether each layer keeps its
    position order between decode steps or sorts at every step."""
    kept = []
    for keep_order in (True, False):
        if not keep_order:
            monkeypatch.setattr(step_module, "ranked_buffer", lambda layer, pos: torch.full(pos.shape, -1))
        cache = kvsieve.make_cache(llama_gqa, "snapkv", 12, window=4)
        with torch.inference_mode():
            token = llama_gqa(make_ids(2, 30), cache=cache).logits[:, -1:].argmax(-1)
            for _ in range(12):
                token = llama_gqa(token, cache=cache).logits[:, -1:].argmax(-1)
        kept.append([cache.positions(i) for i in range(len(cache.layers))])
    assert all(torch.equal(a, b) for a, b in zip(*kept, strict=True))


def test_a_pooling_decode_step_without_a_kept_order_sorts_the_slots() -> None:
    """``compiled_decode`` under SnapKV's pooling rule, given no position order to repair, ranks the slots afresh:
    the same scores and victims as with a new (sorted) buffer."""
    rule = REGISTRY["snapkv"](32).rule
    runs = []
    for ranked in (None, torch.full((2, 3, 40), -1)):
        slots = _slots(torch.Generator().manual_seed(3), 40, 0)
        logits = torch.randn((2, 3, 2, 40), generator=torch.Generator().manual_seed(4))
        victims = torch.zeros((2, 3, 1), dtype=torch.long)
        compiled.compiled_decode(rule, logits, slots, True, victims, ranked=ranked)
        runs.append((victims, slots.state["score"]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
