"""The positional policies: local and streaming_llm keep exact windows, strided and fixed their patterns (exact
positions and a naive simulation), random draws seeded, uniform victims independent of the batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from policy_runs import run_kept

import kvsieve
from kvsieve.policies import Slots
from kvsieve.policies.random import Random, RandomParams

# -- local and streaming_llm: exact windows, with a left-padded row -------------------------------------------------


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


# -- strided and fixed: exact positions, and a naive simulation of their rule ---------------------------------------


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
    kept = run_kept(llama_gqa, policy, 8, make_ids(1, 20), 1, stream, **kwargs)
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
    kept = run_kept(llama_gqa, policy, budget, make_ids(2, prompt), steps, stream, **kwargs)
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


# -- random ---------------------------------------------------------------------------------------------------------


def _slots(pos: torch.Tensor, last: torch.Tensor) -> Slots:
    empty = torch.zeros(*pos.shape, 0)
    return Slots(pos=pos, state={}, last=last, keys=empty, values=empty)


def test_random_is_deterministic_and_seeded(llama_gqa, stream, make_ids) -> None:
    prompt = make_ids(2, 20)
    a, b = (run_kept(llama_gqa, "random", 8, prompt, 12, stream, seed=3) for _ in range(2))
    assert a == b
    other = run_kept(llama_gqa, "random", 8, prompt, 12, stream, seed=4)
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
