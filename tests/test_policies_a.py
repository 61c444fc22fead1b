"""Scissorhands, AhaKV and the H2O variants against naive references.

Each reference test drives a tiny random GQA Llama (batch 2, one row left-padded) through a prompt and decode steps
with a kvsieve cache, records every :class:`Observation` the policy is handed (a spy on ``observe``), and replays
the paper's algorithm on them in plain Python loops over positions, per (layer, row, KV head). After the prompt
and after every decode step, the kept position sets must be equal, and the policy's per-token statistics (scores,
counts) must match.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import kvsieve
from kvsieve.policies import REGISTRY, Observation, Slots
from kvsieve.policies.ahakv import AhaKV, step_gain_probs, value_prior
from kvsieve.policies.scissorhands import Scissorhands

BUDGET = 10
PROMPT = 20
PAD = 5  # left padding of the second row
STEPS = 12


@pytest.fixture
def model(llama_gqa: PreTrainedModel) -> PreTrainedModel:
    """The tiny GQA Llama: 3 layers, 4 query / 2 KV heads (G = 2)."""
    return llama_gqa


# -- recording a run ------------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One ``observe`` call, as nested lists."""

    pos: list
    last: list
    values: list
    probs: list
    logits: list
    allowed: list
    query_pos: list
    step_rows: int


@dataclass
class Run:
    steps: list[list[list[Call]]] = field(default_factory=list)
    """``[step][layer]`` → the observe calls of that step."""
    slots: list[list[list]] = field(default_factory=list)
    """``[step][layer]`` → ``[B][H][N]`` positions held after the step (-1 = empty)."""
    state: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)
    """``[step][layer]`` → the policy state ``[B, H, N, ...]`` of those slots."""
    counts: list[int] = field(default_factory=list)
    """Slots held by layer 0 after each step."""


def record(model: PreTrainedModel, stream: Callable, monkeypatch, policy: str, **params: Any) -> Run:
    """Run ``policy`` at ``BUDGET`` on a padded batch of 2 through a prompt and ``STEPS`` decode steps."""
    cls = REGISTRY[policy]
    calls: dict[int, list[Call]] = defaultdict(list)
    observe = cls.observe

    def spy(self, slots: Slots, obs: Observation) -> None:
        lists = [t.tolist() for t in (slots.pos, slots.last, slots.values, obs.probs, obs.logits, obs.allowed)]
        calls[id(self)].append(Call(*lists, obs.query_pos.tolist(), obs.step_rows))
        observe(self, slots, obs)

    monkeypatch.setattr(cls, "observe", spy)
    cache = kvsieve.make_cache(model, policy, BUDGET, **params)
    run, seen = Run(), defaultdict(int)

    def on_step() -> None:
        step_calls = []
        for layer in cache.layers:
            key = id(layer.policy)
            step_calls.append(calls[key][seen[key] :])
            seen[key] = len(calls[key])
        run.steps.append(step_calls)
        stores = [layer.store for layer in cache.layers]
        run.slots.append([store.positions[:, :, : store.used].tolist() for store in stores])
        run.state.append([{k: v[:, :, : store.used].clone() for k, v in store.state.items()} for store in stores])
        run.counts.append(cache.slot_counts()[0])

    ids = torch.randint(3, 128, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    stream(model, cache, ids, STEPS, attention_mask=mask, on_step=on_step)
    return run


# -- naive references -----------------------------------------------------------------------------------------------


def softmax(logits: list[float], allowed: list[bool], scale: float = 1.0) -> list[float]:
    """Softmax of ``scale · logits`` over the allowed entries (0 elsewhere)."""
    top = max(scale * x for x, a in zip(logits, allowed, strict=True) if a)
    exp = [math.exp(scale * x - top) if a else 0.0 for x, a in zip(logits, allowed, strict=True)]
    total = sum(exp)
    return [e / total for e in exp]


def keep_recent_and_best(present: set[int], last: int, n_keep: int, recent: int, key: Callable) -> set[int]:
    """The ``recent`` newest positions plus the best others by ``key`` (highest first)."""
    protected = {p for p in present if p > last - recent}
    others = sorted(present - protected, key=key, reverse=True)
    return protected | set(others[: n_keep - len(protected)])


class Reference:
    """One (layer, row, KV head): per-position statistics updated row by row, and the eviction rule."""

    def __init__(self, budget: int, group: int) -> None:
        self.budget, self.group = budget, group
        self.score: dict[int, float] = defaultdict(float)

    def begin(self, call: Call, b: int, h: int) -> None:
        """Called before the rows of each observe call."""

    def row(self, call: Call, b: int, h: int, r: int) -> None:
        raise NotImplementedError

    def n_keep(self, n: int) -> int:
        return min(n, self.budget)

    def keep(self, present: set[int], last: int, n_keep: int) -> set[int]:
        raise NotImplementedError

    def stat(self, p: int, last: int) -> float:
        """The policy's stored statistic of position ``p``."""
        return self.score[p]


def replay(run: Run, make: Callable[[], Reference], stat: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> None:
    """Replay every (layer, row, head) through a fresh reference; compare kept sets and statistics at each step."""
    batch, heads = len(run.slots[0][0]), len(run.slots[0][0][0])
    for layer in range(len(run.slots[0])):
        for b in range(batch):
            for h in range(heads):
                ref, present = make(), set()
                for step, calls in enumerate(run.steps):
                    for call in calls[layer]:
                        present |= {p for p in call.pos[b][h] if p >= 0}
                        ref.begin(call, b, h)
                        for r, qp in enumerate(call.query_pos[b]):
                            if qp >= 0:
                                ref.row(call, b, h, r)
                    last = calls[layer][-1].last[b]
                    n_keep = ref.n_keep(len(present))
                    if n_keep < len(present):
                        present = ref.keep(present, last, n_keep)
                    where = f"layer {layer}, row {b}, head {h}, step {step}"
                    slots = run.slots[step][layer][b][h]
                    assert {p for p in slots if p >= 0} == present, where
                    got = stat(run.state[step][layer])[b, h].tolist()
                    for p, value in zip(slots, got, strict=True):
                        if p >= 0:
                            assert value == pytest.approx(ref.stat(p, last), rel=1e-4, abs=1e-5), f"{where}, pos {p}"


# -- Scissorhands ---------------------------------------------------------------------------------------------------


class ScissorhandsReference(Reference):
    """Algorithm 2 with the window kept as {row position: marked} per token."""

    def __init__(self, budget: int, group: int, window: int, recent: int, drop: int) -> None:
        super().__init__(budget, group)
        self.window, self.recent, self.drop = window, recent, drop
        self.marks: dict[int, dict[int, bool]] = defaultdict(dict)

    def row(self, call: Call, b: int, h: int, r: int) -> None:
        allowed = call.allowed[b][h][r]
        uniform = self.group / sum(allowed)  # the group-summed probability of a uniform row
        for s, p in enumerate(call.pos[b][h]):
            if allowed[s]:
                self.marks[p][call.query_pos[b][r]] = call.probs[b][h][r][s] < uniform

    def count(self, p: int, last: int) -> int:
        return sum(marked for q, marked in self.marks[p].items() if q > last - self.window)

    def n_keep(self, n: int) -> int:
        if n <= self.budget:
            return n
        return self.budget if n - self.budget > 1 else n - self.drop

    def keep(self, present: set[int], last: int, n_keep: int) -> set[int]:
        return keep_recent_and_best(present, last, n_keep, self.recent, key=lambda p: (-self.count(p, last), p))

    def stat(self, p: int, last: int) -> float:
        return self.count(p, last)


@pytest.mark.parametrize(
    ("params", "window", "recent", "drop"),
    [
        ({"window": 4, "recent": 2, "drop": 3}, 4, 2, 3),
        ({}, 100, 6, 5),
        ({"window": 7, "recent": 0, "drop": 1}, 7, 0, 1),
    ],
    ids=["w4-r2-m3", "defaults", "w7-r0-m1"],
)
def test_scissorhands_matches_reference(model, stream, monkeypatch, params, window, recent, drop) -> None:
    run = record(model, stream, monkeypatch, "scissorhands", **params)
    replay(run, partial(ScissorhandsReference, BUDGET, 2, window, recent, drop), lambda state: state["low"].sum(dim=-1))
    # The prompt is cut to the budget; then the cache grows by one per step and drops `drop` tokens at once.
    expected = [BUDGET]
    for _ in range(STEPS):
        expected.append(expected[-1] + 1 - (drop if expected[-1] == BUDGET else 0))
    assert run.counts == expected


def test_scissorhands_window_forgets_and_young_tokens_count_fewer_rows() -> None:
    """Synthetic rows (one KV head, G = 2): a mark leaves the count once its row is ``w`` rows old, and rows from
    before a token existed never count for it."""
    policy = Scissorhands(4, Scissorhands.make_params(window=2, recent=0, drop=1))
    pos = torch.tensor([[[0, 1, 2, -1]]])
    state = {"low": torch.zeros(1, 1, 4, 2, dtype=torch.bool)}

    def step(q: int, probs: list[float]) -> list[int]:
        slots = Slots(pos=pos, state=state, last=torch.tensor([q]), keys=torch.empty(0), values=torch.empty(0))
        obs = Observation(
            probs=torch.tensor(probs).view(1, 1, 1, 4),
            logits=torch.zeros(1, 1, 2, 1, 4),
            query_pos=torch.tensor([[q]]),
            step_rows=1,
            key_pos=pos,
        )
        policy.observe(slots, obs)
        return state["low"].sum(dim=-1)[0, 0].tolist()

    # Row 1 sees tokens 0, 1 (uniform group share 2/2 = 1): token 0 is below it.
    assert step(1, [0.5, 1.5, 0.0, 0.0]) == [1, 0, 0, 0]
    # Row 2 sees 3 tokens (share 2/3): tokens 0 and 2 are below; token 2 has one row, tokens 0, 1 two.
    assert step(2, [0.2, 1.2, 0.6, 0.0]) == [2, 0, 1, 0]
    # Row 3: nobody is below; row 1 leaves the window of 2 rows, so token 0 loses its first mark.
    assert step(3, [0.7, 0.7, 0.7, 0.0]) == [1, 0, 1, 0]
    assert step(4, [0.7, 0.7, 0.7, 0.0]) == [0, 0, 0, 0]
    # Decision order: fewest marks kept first, ties keep the newer token.
    state["low"][0, 0, :3, 0] = torch.tensor([True, False, False])
    scores = policy.keep_scores(Slots(pos, state, torch.tensor([4]), torch.empty(0), torch.empty(0)))
    assert scores[0, 0, :3].argsort().tolist() == [0, 1, 2]


# -- H2O variants ---------------------------------------------------------------------------------------------------

TRANSFORMS = {"identity": lambda z: z, "sqrt": lambda z: math.sqrt(z + 1), "log": lambda z: math.log(z + 1)}


class H2OReference(Reference):
    def __init__(self, budget: int, group: int, recent: int, transform: str, normalize: bool) -> None:
        super().__init__(budget, group)
        self.recent, self.h, self.normalize = recent, TRANSFORMS[transform], normalize

    def row(self, call: Call, b: int, h: int, r: int) -> None:
        allowed = call.allowed[b][h][r]
        for g in range(self.group):
            probs = softmax(call.logits[b][h][g][r], allowed)
            for s, p in enumerate(call.pos[b][h]):
                if allowed[s]:
                    self.score[p] += self.h(1) - self.h(1 - probs[s])

    def keep(self, present: set[int], last: int, n_keep: int) -> set[int]:
        def key(p: int) -> float:  # with normalize: the mean over the rows that have seen the token
            return self.score[p] / (last - p + 1 if self.normalize else 1)

        return keep_recent_and_best(present, last, n_keep, self.recent, key)


@pytest.mark.parametrize(
    "params",
    [{}, {"transform": "sqrt"}, {"transform": "log", "recent": 2}, {"normalize": True}, {"recent": 0}],
    ids=["plain", "sqrt", "log", "normalize", "heavy-only"],
)
def test_h2o_variants_match_reference(model, stream, monkeypatch, params) -> None:
    run = record(model, stream, monkeypatch, "h2o", **params)
    recent = params.get("recent", BUDGET // 2)
    make = partial(H2OReference, BUDGET, 2, recent, params.get("transform", "identity"), params.get("normalize", False))
    replay(run, make, lambda state: state["score"])


H2O_VARIANTS = {
    "sqrt": {"transform": "sqrt"},
    "log": {"transform": "log"},
    "normalize": {"normalize": True},
    "heavy-only": {"recent": 0},
}


def test_h2o_variants_change_decisions(model, stream, monkeypatch) -> None:
    """Each variant keeps other tokens than plain H2O somewhere; heavy-only evicts a token in its own step."""
    plain = record(model, stream, monkeypatch, "h2o").slots
    runs = {name: record(model, stream, monkeypatch, "h2o", **params).slots for name, params in H2O_VARIANTS.items()}
    assert all(slots != plain for slots in runs.values())
    # Row 0 is not padded: its token of decode step s is at position PROMPT - 1 + s.
    assert any(
        PROMPT - 1 + step not in head
        for step, layers in enumerate(runs["heavy-only"][1:], start=1)
        for layer in layers
        for head in layer[0]
    )


# -- AhaKV ----------------------------------------------------------------------------------------------------------


class AhaKVReference(Reference):
    def __init__(self, budget: int, group: int, recent: int, ra: bool, sgs: bool, vpe: bool, kernel: int) -> None:
        super().__init__(budget, group)
        self.recent, self.ra, self.sgs, self.vpe, self.kernel = recent, ra, sgs, vpe, kernel
        self.prior: dict[int, float] = {}

    def begin(self, call: Call, b: int, h: int) -> None:
        """γ̄ of the call's tokens: squared value norms, mean over a centred window in position order, / max."""
        self.prior = {}
        if not (self.vpe and call.step_rows > 1):
            return
        tokens = sorted(
            (p, sum(v * v for v in values))
            for p, values in zip(call.pos[b][h], call.values[b][h], strict=True)
            if p >= 0
        )
        half = self.kernel // 2
        pooled = []
        for j in range(len(tokens)):
            window = tokens[max(0, j - half) : j + half + 1]
            pooled.append(sum(nu for _, nu in window) / len(window))
        self.prior = {p: g / max(pooled) for (p, _), g in zip(tokens, pooled, strict=True)}

    def row(self, call: Call, b: int, h: int, r: int) -> None:
        qp, last = call.query_pos[b][r], call.last[b]
        if self.ra and qp <= last - self.recent:
            return
        allowed = call.allowed[b][h][r]
        seen = qp + 1
        gain = math.sqrt(2 * math.log(seen / self.budget)) if seen > self.budget else 0.0
        for s, p in enumerate(call.pos[b][h]):
            if not allowed[s]:
                continue
            if self.sgs:
                a = sum(softmax(call.logits[b][h][g][r], allowed, gain)[s] for g in range(self.group))
            else:
                a = call.probs[b][h][r][s]
            self.score[p] += a * self.prior.get(p, 1.0)

    def keep(self, present: set[int], last: int, n_keep: int) -> set[int]:
        return keep_recent_and_best(present, last, n_keep, self.recent, key=lambda p: self.score[p])


@pytest.mark.parametrize("vpe", [True, False], ids=["vpe", "no-vpe"])
@pytest.mark.parametrize("sgs", [True, False], ids=["sgs", "no-sgs"])
@pytest.mark.parametrize("ra", [True, False], ids=["ra", "no-ra"])
def test_ahakv_matches_reference(model, stream, monkeypatch, ra, sgs, vpe) -> None:
    run = record(model, stream, monkeypatch, "ahakv", recent=3, ra=ra, sgs=sgs, vpe=vpe, kernel=3)
    replay(run, partial(AhaKVReference, BUDGET, 2, 3, ra, sgs, vpe, 3), lambda state: state["score"])


def test_ahakv_components_change_decisions(model, stream, monkeypatch) -> None:
    full = record(model, stream, monkeypatch, "ahakv", recent=3).slots
    for off in ("ra", "sgs", "vpe"):
        assert record(model, stream, monkeypatch, "ahakv", recent=3, **{off: False}).slots != full, off


def test_ahakv_with_every_component_off_is_h2o(model, stream, monkeypatch) -> None:
    """RA, SGS and VPE off: accumulated probabilities + the last B_r tokens, i.e. H2O with ``recent = B_r``."""
    ablated = record(model, stream, monkeypatch, "ahakv", recent=3, ra=False, sgs=False, vpe=False)
    h2o = record(model, stream, monkeypatch, "h2o", recent=3)
    assert ablated.slots == h2o.slots


def _observation(logits: torch.Tensor, query_pos: list[int], step_rows: int = 1) -> Observation:
    """An observation of ``logits`` ``[1, 1, G, b, N]`` with causal masking by slot index = position."""
    n = logits.shape[-1]
    qp = torch.tensor([query_pos])
    allowed = torch.arange(n)[None, None, None, :] <= qp[:, None, :, None]
    logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
    probs = logits.softmax(dim=-1).sum(dim=2)
    return Observation(probs, logits, qp, step_rows, key_pos=torch.arange(n).view(1, 1, n))


def test_step_gain_softmax_scales_logits_by_sqrt_2_ln_i_over_k() -> None:
    logits = torch.randn(1, 1, 2, 2, 40, generator=torch.Generator().manual_seed(0))
    obs = _observation(logits, [9, 39])  # rows that have seen 10 and 40 tokens
    got = step_gain_probs(obs, budget=10)
    # i = 10 <= k: the uniform distribution 1/i per query head (the group of 2 sums to 2/i).
    torch.testing.assert_close(got[0, 0, 0, :10], torch.full((10,), 2 / 10))
    assert got[0, 0, 0, 10:].abs().max() == 0
    # i = 40 > k: softmax of the scaled logits times sqrt(2 ln 4).
    expected = (logits[0, 0, :, 1] * math.sqrt(2 * math.log(4))).softmax(dim=-1).sum(dim=0)
    torch.testing.assert_close(got[0, 0, 1], expected)


def test_ahakv_sgs_scores_of_a_short_prompt_are_uniform(model) -> None:
    """A prompt within the budget (every row has i <= k): each row gives every token it sees 1/i per query head."""
    length, group = 12, 2
    cache = kvsieve.make_cache(model, "ahakv", 16, recent=4, ra=False, vpe=False)
    with torch.inference_mode():
        model(torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(3)), past_key_values=cache)
    expected = torch.tensor([sum(group / i for i in range(j + 1, length + 1)) for j in range(length)])
    for layer in cache.layers:
        torch.testing.assert_close(layer.store.state["score"][0, :, :length], expected.expand(2, -1))
    plain = kvsieve.make_cache(model, "ahakv", 16, recent=4, ra=False, vpe=False, sgs=False)
    with torch.inference_mode():
        model(torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(3)), past_key_values=plain)
    assert not torch.allclose(plain.layers[0].store.state["score"][0, :, :length], expected.expand(2, -1))


def test_value_prior_pools_squared_norms_in_position_order() -> None:
    # One (row, head): slots hold positions 3, 0, -1 (empty), 2, 1 with value norms² 9, 1, -, 4, 16.
    pos = torch.tensor([[[3, 0, -1, 2, 1]]])
    values = torch.tensor([[3.0, 0.0], [1.0, 0.0], [7.0, 7.0], [0.0, 2.0], [0.0, 4.0]]).view(1, 1, 5, 2)
    slots = Slots(pos=pos, state={}, last=torch.tensor([3]), keys=values, values=values)
    # In position order ν = [1, 16, 4, 9]; kernel 3 (truncated at the ends): γ = [8.5, 7, 29/3, 6.5].
    gamma = torch.tensor([6.5, 8.5, 0.0, 29 / 3, 7.0])
    torch.testing.assert_close(value_prior(slots, 3), (gamma / (29 / 3)).view(1, 1, 5))
    torch.testing.assert_close(value_prior(slots, 1), torch.tensor([[[9 / 16, 1 / 16, 0.0, 4 / 16, 1.0]]]))


def test_ahakv_value_prior_applies_to_prompt_steps_only() -> None:
    obs_prompt = _observation(torch.zeros(1, 1, 2, 4, 4), [0, 1, 2, 3], step_rows=4)
    obs_decode = _observation(torch.zeros(1, 1, 2, 1, 4), [3], step_rows=1)
    values = torch.tensor([1.0, 2.0, 1.0, 2.0]).view(1, 1, 4, 1)
    policy = AhaKV(4, AhaKV.make_params(recent=1, ra=False, sgs=False, kernel=1))
    state = {"score": torch.zeros(1, 1, 4)}
    slots = Slots(pos=torch.arange(4).view(1, 1, 4), state=state, last=torch.tensor([3]), keys=values, values=values)
    policy.observe(slots, obs_prompt)
    # Uniform rows (zero logits): token j gets G/i from each row i > j; γ̄ = ν / max ν = [1/4, 1, 1/4, 1].
    prompt = torch.tensor([sum(2 / i for i in range(j + 1, 5)) for j in range(4)]) * torch.tensor([0.25, 1, 0.25, 1])
    torch.testing.assert_close(state["score"][0, 0], prompt)
    policy.observe(slots, obs_decode)  # a decode row: 2/4 to every token, no prior
    torch.testing.assert_close(state["score"][0, 0], prompt + 0.5)


# -- parameters -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "params", "name"),
    [
        ("scissorhands", {"window": 0}, "window"),
        ("scissorhands", {"drop": 0}, "drop"),
        ("scissorhands", {"drop": BUDGET + 1}, "drop"),
        ("scissorhands", {"recent": BUDGET, "drop": 2}, "recent"),
        ("scissorhands", {"recent": -1}, "recent"),
        ("ahakv", {"recent": BUDGET + 1}, "recent"),
        ("ahakv", {"recent": 0}, "recent"),
        ("ahakv", {"kernel": 4}, "kernel"),
        ("ahakv", {"kernel": 0}, "kernel"),
        ("h2o", {"recent": BUDGET + 1}, "recent"),
    ],
)
def test_invalid_params_raise_naming_the_parameter(policy, params, name) -> None:
    with pytest.raises(ValueError, match=rf"{policy}: {name}\b"):
        REGISTRY[policy](BUDGET, REGISTRY[policy].make_params(**params))


def test_small_budgets_get_valid_defaults() -> None:
    for budget in (1, 2, 5):
        for cls in (Scissorhands, AhaKV):
            policy = cls(budget)
            assert 0 <= policy.recent <= budget
