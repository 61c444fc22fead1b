"""SnapKV against a naive reference applied literally to the captured observations."""

from __future__ import annotations

import pytest
import torch
from policy_runs import Kept, capture, run_kept

from kvsieve.policies.families import pooled_priority
from kvsieve.policies.snapkv import SnapKV


def _naive_snapkv(calls, budget: int, window: int, kernel: int, n_layers: int, mean: bool = False) -> list[Kept]:
    """SnapKV applied literally to the captured observations, one position at a time (``mean``: the scores
    mean-pooled, the places beyond either end of the tokens outside the window counting as 0)."""
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
                    near = {p: [s[o] for o in others[max(0, j - half) : j + half + 1]] for j, p in enumerate(others)}
                    pooled = {p: sum(v) / kernel if mean else max(v) for p, v in near.items()}
                    best = sorted(others, key=lambda p: (pooled[p], p), reverse=True)[: budget - len(protected)]
                    for p in set(others) - set(best):
                        del s[p]
                heads.append(set(s))
            rows.append(heads)
        out[-1].append(rows)
    return out


@pytest.mark.parametrize(
    ("kwargs", "window", "kernel"),
    [
        ({}, 6, 7),
        ({"window": 3, "kernel": 3}, 3, 3),
        ({"pooling": "mean"}, 6, 7),
        ({"pooling": "mean", "kernel": 5}, 6, 5),
    ],
)
def test_snapkv_matches_naive_reference(llama_gqa, stream, make_ids, monkeypatch, kwargs, window, kernel) -> None:
    calls = capture(monkeypatch, SnapKV)
    budget, steps = 12, 10
    kept = run_kept(llama_gqa, "snapkv", budget, make_ids(2, 30), steps, stream, kernels="torch", **kwargs)
    mean = kwargs.get("pooling") == "mean"
    assert kept == _naive_snapkv(calls, budget, window, kernel, len(kept[0]), mean)
    # the prompt's selection is not just the newest tokens
    assert any(min(s) < 30 - budget for layer in kept[0] for row in layer for s in row)


@pytest.mark.parametrize(
    ("mean", "levels", "seed"),
    [
        # max: ties, zeros, tiny and large values and -inf (masked slots)
        (False, [0.0, 1e-30, 0.25, 0.5, 3e5, float("-inf")], 0),
        # mean: the places beyond either end count as 0 (avg_pool1d's padding); scores whose sums are exact in fp32
        (True, [0.0, 0.25, 0.5, 3.0, 1024.0], 1),
    ],
)
def test_pooled_priority_orders_by_the_pooled_score_then_position(mean, levels, seed) -> None:
    """The integer priority sorts slots as (the max, or the sum over the kernel, of the score over the kernel's
    neighbours in position order, position), in any slot layout."""
    gen = torch.Generator().manual_seed(seed)
    kernel, n = 5, 40
    for _ in range(50):
        pos = torch.randperm(300, generator=gen)[:n].view(1, 1, n)
        score = torch.tensor(levels)[torch.randint(0, len(levels), (1, 1, n), generator=gen)]
        priority = pooled_priority(score, pos, kernel, mean=mean)
        order = sorted(range(n), key=lambda s: int(pos[0, 0, s]))
        rank = {slot: i for i, slot in enumerate(order)}
        near = {
            s: [float(score[0, 0, order[j]]) for j in range(max(0, rank[s] - 2), min(n, rank[s] + 3))] for s in range(n)
        }
        pooled = {s: sum(v) / kernel if mean else max(v) for s, v in near.items()}
        expected = sorted(range(n), key=lambda s: (pooled[s], int(pos[0, 0, s])))
        assert priority[0, 0].argsort().tolist() == expected


def test_mean_and_max_pooling_keep_different_tokens() -> None:
    """One score where the two poolings disagree: a lone peak wins its neighbours the top places under the maximum;
    under the mean a broad plateau outranks it."""
    pos = torch.arange(11).view(1, 1, 11)
    score = torch.tensor([[[0.0, 0.0, 0.9, 0.0, 0.0, 0.4, 0.4, 0.4, 0.4, 0.4, 0.0]]])
    by_max = pooled_priority(score, pos, 3).argsort(descending=True)[0, 0, :3].tolist()
    by_mean = pooled_priority(score, pos, 3, mean=True).argsort(descending=True)[0, 0, :3].tolist()
    assert sorted(by_max) == [1, 2, 3]  # (0.9 around the peak, 0.4 on the plateau)
    assert sorted(by_mean) == [6, 7, 8]  # (1.2 / 3 inside the plateau, 0.9 / 3 around the peak)
