"""Scissorhands against a naive reference of its Algorithm 2 (see ``policy_runs``), and its window on synthetic rows."""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import pytest
import torch
from policy_runs import BUDGET, STEPS, Call, Reference, keep_recent_and_best, record, replay

import kvsieve
from kvsieve.policies import Observation, Slots
from kvsieve.policies.scissorhands import Scissorhands


class ScissorhandsReference(Reference):
    """Algorithm 2 with the window kept as {row position: marked} per token."""

    def __init__(
        self, budget: int, group: int, window: int, recent: int, drop: int, threshold: str = "attended"
    ) -> None:
        super().__init__(budget, group)
        self.window, self.recent, self.drop, self.threshold = window, recent, drop, threshold
        self.marks: dict[int, dict[int, bool]] = defaultdict(dict)

    def row(self, call: Call, b: int, h: int, r: int) -> None:
        allowed = call.allowed[b][h][r]
        t = call.query_pos[b][r] + 1 if self.threshold == "paper" else sum(allowed)
        uniform = self.group / t  # the group-summed probability of a uniform row over t tokens
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
    ("params", "window", "recent", "drop", "threshold"),
    [
        ({"window": 4, "recent": 2, "drop": 3}, 4, 2, 3, "attended"),
        ({}, 100, 6, 5, "attended"),
        ({"window": 7, "recent": 0, "drop": 1}, 7, 0, 1, "attended"),
        ({"window": 4, "recent": 2, "drop": 3, "threshold": "paper"}, 4, 2, 3, "paper"),
    ],
    ids=["w4-r2-m3", "defaults", "w7-r0-m1", "w4-r2-m3-paper"],
)
def test_scissorhands_matches_reference(
    llama_gqa, stream, monkeypatch, params, window, recent, drop, threshold
) -> None:
    run = record(llama_gqa, stream, monkeypatch, "scissorhands", **params)
    reference = partial(ScissorhandsReference, BUDGET, 2, window, recent, drop, threshold)
    replay(run, reference, lambda state: state["low"].sum(dim=-1))
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


def test_a_short_row_of_a_padded_batch_compresses_as_if_alone(tiny_models) -> None:
    """Rows of 1, 2 and 6 tokens at budget 4: each row compresses when its own count reaches B + 1 (the batch's
    slots are shared, so a row that keeps fewer tokens holds an empty slot) and gives the logits it gives alone."""
    model = tiny_models("llama_mha", torch.float64)
    lengths, steps = [1, 2, 6], 8
    gen = torch.Generator().manual_seed(0)
    tokens = torch.stack([3 + torch.randperm(125, generator=gen)[: 6 + steps] for _ in lengths])
    mask = torch.ones(3, 6, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, : 6 - length] = 0
    caches = [kvsieve.make_cache(model, "scissorhands", 4) for _ in lengths]
    with torch.inference_mode():
        cache = kvsieve.make_cache(model, "scissorhands", 4)
        ids, full_mask, logits = tokens[:, :6], mask, []
        for t in range(steps + 1):
            logits.append(model(ids, attention_mask=full_mask, cache=cache).logits)
            ids = tokens[:, 6 + t : 7 + t]
            full_mask = torch.cat([full_mask, full_mask.new_ones(3, 1)], dim=1)
        batch = torch.cat(logits, dim=1)
        for row, (length, alone) in enumerate(zip(lengths, caches, strict=True)):
            row_ids, row_logits = tokens[row : row + 1, 6 - length : 6], []
            for t in range(steps + 1):
                row_logits.append(model(row_ids, cache=alone).logits)
                row_ids = tokens[row : row + 1, 6 + t : 7 + t]
            expected = torch.cat(row_logits, dim=1)[0]
            torch.testing.assert_close(batch[row, 6 - length :], expected, atol=1e-5, rtol=1e-5)
            held = cache.positions(0)[row]
            assert torch.equal(
                held[held >= 0].view(held.shape[0], -1).sort(-1).values, alone.positions(0)[0].sort(-1).values
            )


def test_the_papers_threshold_marks_fewer_tokens_once_tokens_were_evicted(llama_gqa, stream, monkeypatch) -> None:
    """1/t with t the step is below 1/(tokens attended) once the cache dropped tokens: fewer marks."""
    runs = {
        threshold: record(llama_gqa, stream, monkeypatch, "scissorhands", drop=3, threshold=threshold)
        for threshold in ("attended", "paper")
    }
    marks = {name: sum(int(s["low"].sum()) for s in run.state[-1]) for name, run in runs.items()}
    assert marks["paper"] < marks["attended"]
