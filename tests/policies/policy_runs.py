"""Recording policy runs for the tests that check a policy against a naive reference.

``record`` drives a tiny random model (batch 2, one row left-padded) through a prompt and decode steps with a
kvsieve cache, records every :class:`Observation` the policy is handed (a spy on ``observe``), and ``replay`` runs
a :class:`Reference` (the paper's algorithm in plain Python loops over positions) on them per (layer, row, KV head).
After the prompt and after every decode step, the kept position sets must be equal, and the policy's per-token
statistics (scores, counts) must match. ``run_kept`` and ``capture`` are the lighter kind: the kept positions after
each step, and the raw observations.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel
from transformers.masking_utils import sdpa_mask

import kvsieve
from kvsieve.engine.storage import SlotStore
from kvsieve.policies import REGISTRY, Observation, Slots

BUDGET = 10
PROMPT = 20
PAD = 5  # left padding of the second row
STEPS = 12

Kept = list[list[list[set[int]]]]  # [layer][row][KV head] -> positions


# -- observations and state, step by step ---------------------------------------------------------------------------


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
    """Run ``policy`` at ``BUDGET`` on a padded batch of 2 through a prompt and ``STEPS`` decode steps, the policy's
    own code observing every step (the compiled decode steps do without ``observe``: they are switched off here and
    compared with it in ``test_compiled_scan``)."""
    cls = REGISTRY[policy]
    calls: dict[int, list[Call]] = defaultdict(list)
    observe = cls.observe

    def spy(self, slots: Slots, obs: Observation) -> None:
        lists = [t.tolist() for t in (slots.pos, slots.last, slots.values, obs.probs, obs.logits, obs.allowed)]
        calls[id(self)].append(Call(*lists, obs.query_pos.tolist(), obs.step_rows))
        observe(self, slots, obs)

    monkeypatch.setattr(cls, "observe", spy)
    cache = kvsieve.make_cache(model, policy, BUDGET, kernels="torch", **params)
    run, seen = Run(), defaultdict(int)

    def on_step() -> None:
        step_calls = []
        for layer in cache.layers:
            key = id(layer.policy)
            step_calls.append(calls[key][seen[key] :])
            seen[key] = len(calls[key])
        run.steps.append(step_calls)
        stores = [_held(layer.store) for layer in cache.layers]
        run.slots.append([store.positions[:, :, : store.used].tolist() for store in stores])
        run.state.append([{k: v[:, :, : store.used].clone() for k, v in store.state.items()} for store in stores])
        run.counts.append(cache.slot_counts()[0])

    ids = torch.randint(3, 128, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    stream(model, cache, ids, STEPS, attention_mask=mask, on_step=on_step)
    return run


def _held(store: SlotStore) -> SlotStore:
    """``store`` without its stale slot (a decode step's victim whose slot the next token takes), as saved."""
    if store.stale is None:
        return store
    store = store.copy()
    store.compact()
    return store


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


# -- kept positions and raw observations ----------------------------------------------------------------------------


def recorder(cache: kvsieve.SieveCache, into: list[Kept]) -> Callable[[], None]:
    """An ``on_step`` that appends the positions every layer holds to ``into``."""

    def record() -> None:
        into.append([[[set(h.tolist()) for h in row] for row in cache.positions(i)] for i in range(len(cache.layers))])

    return record


def run_kept(model, policy: str, budget: int, prompt: torch.Tensor, steps: int, stream, **kwargs: Any) -> list[Kept]:
    """Kept positions after the prompt and after every decode step."""
    cache = kvsieve.make_cache(model, policy, budget, **kwargs)
    kept: list[Kept] = []
    stream(model, cache, prompt, steps, on_step=recorder(cache, kept))
    return kept


def capture(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[tuple[int, torch.Tensor, Any]]:
    """Record (layer id, slot positions, observation) of every ``observe`` call of ``cls`` (the compiled decode steps do
    without it: make the caches with ``kernels="torch"``)."""
    calls: list[tuple[int, torch.Tensor, Any]] = []
    original = cls.observe

    def observe(self, slots, obs) -> None:
        calls.append((id(self), slots.pos.clone(), copy.deepcopy(obs)))
        original(self, slots, obs)

    monkeypatch.setattr(cls, "observe", observe)
    return calls


def reference_mask(**kwargs: Any) -> torch.Tensor | None:
    """A boolean sdpa mask that is never skipped: the mask function of the reference attention implementations."""
    return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})
