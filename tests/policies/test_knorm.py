"""KNorm keeps the tokens with the lowest key norms (checked against an uncompressed run), ties the newer."""

from __future__ import annotations

import pytest
import torch
from policy_runs import run_kept
from transformers import DynamicCache

from kvsieve.policies import Slots
from kvsieve.policies.knorm import KNorm, KNormParams


@pytest.mark.parametrize(("recent", "drop"), [(0, 1), (3, 1), (0, 4), (3, 6)])
def test_knorm_keeps_the_lowest_key_norms(llama_gqa, stream, make_ids, recent, drop) -> None:
    budget, prompt_len, steps = 8, 20, 10
    prompt = make_ids(2, prompt_len)
    kept = run_kept(llama_gqa, "knorm", budget, prompt, steps, stream, recent=recent, drop=drop)
    full = DynamicCache(config=llama_gqa.config)
    stream(llama_gqa, full, prompt, steps)  # the same tokens (the stream's decode tokens are seeded)
    norms = [layer.keys.norm(dim=-1) for layer in full.layers]  # [B, H, L]

    def keep(held: set[int], n: int, layer: int, b: int, h: int) -> set[int]:
        last = max(held)
        window = {p for p in held if p > last - recent}
        # lowest norms first; equal norms (a repeated token: RoPE keeps the norm) newer first
        earlier = sorted(held - window, key=lambda p: (float(norms[layer][b, h, p]), -p))
        return window | set(earlier[: n - len(window)])

    # after the prompt every layer's keys are those of full attention; later, layer 0's keys still are
    for layer in range(len(norms)):
        for b in range(2):
            for h in range(norms[0].shape[1]):
                assert kept[0][layer][b][h] == keep(set(range(prompt_len)), budget, layer, b, h)
    for b in range(2):
        for h in range(2):
            held = kept[0][0][b][h]
            for step in range(1, steps + 1):
                held = held | {prompt_len - 1 + step}
                if len(held) > budget:  # a decode step fills the cache: `drop` tokens go at once
                    held = keep(held, len(held) - drop, 0, b, h)
                assert kept[step][0][b][h] == held, (b, h, step)
    sizes = {len(kept[step][0][0][0]) for step in range(steps + 1)}
    assert sizes == set(range(budget + 1 - drop, budget + 1))


def test_knorm_drop_must_leave_room_outside_the_recent_window() -> None:
    with pytest.raises(ValueError, match=r"knorm: drop must be in \[1, budget \+ 1 - recent = 6\], got 7"):
        KNorm(8, KNormParams(recent=3, drop=7))


def test_knorm_ties_keep_the_newer_token_whatever_the_slot_order() -> None:
    policy = KNorm(2, KNormParams(recent=0))
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])  # norms 1, 1, 2
    for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0]):
        pos = torch.tensor([5, 2, 7])[order].view(1, 1, 3)
        state = policy.initial_state(keys[order].view(1, 1, 3, 2), pos)  # the priority is set when a token is cached
        slots = Slots(pos=pos, state=state, last=torch.tensor([7]), keys=keys[order].view(1, 1, 3, 2), values=keys)
        ranked = policy.keep_scores(slots)[0, 0].argsort(descending=True)
        assert pos[0, 0, ranked].tolist() == [5, 2, 7]


@pytest.mark.parametrize(("budget", "recent"), [(8, 4), (64, 32), (409, 32)])
def test_knorm_protects_a_recent_window_by_default(budget: int, recent: int) -> None:
    assert KNorm(budget).recent == recent
    assert KNorm(budget, KNormParams(recent=0)).recent == 0
