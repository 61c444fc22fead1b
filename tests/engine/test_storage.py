"""Slots move bit for bit in every dtype (:mod:`kvsieve.engine.storage`)."""

from __future__ import annotations

import pytest
import torch

from kvsieve.engine.quant import as_integers
from kvsieve.engine.storage import SlotStore

SPECIAL = torch.tensor([-0.0, float("inf"), float("-inf"), 1.5, -2.25, 65504.0])


def _tokens(n: int, first: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[2, 2, n, 6]`` of distinct tokens, with values each dtype holds exactly (-0.0 and infinities
    among them)."""
    base = (
        torch.arange(first, first + n, dtype=torch.float64)[None, None, :, None]
        * torch.tensor([1.0, 8.0])[None, :, None, None]
    )
    keys = (base.expand(2, 2, n, 6) + torch.arange(6)).mul(torch.tensor([1.0, -1.0])[:, None, None, None])
    keys[..., 0] = SPECIAL[torch.arange(n) % len(SPECIAL)]
    return keys.to(dtype), (-keys).to(dtype)


def _run(dtype: torch.dtype) -> SlotStore:
    """A prompt of 6 tokens, 4 kept (a gather), one evicted and left stale for a decode token (a scatter), one more
    evicted and closed by moving the last slot into it."""
    keys, values = _tokens(6, 0, dtype)
    store = SlotStore.empty(keys, values, {"score": ((), torch.float32)}, limit=5)
    store.append(keys, values, torch.arange(6).expand(2, 2, 6), {})
    store.keep(torch.tensor([[[0, 2, 3, 5], [1, 2, 4, 5]], [[0, 1, 2, 3], [2, 3, 4, 5]]]))
    store.drop(torch.tensor([[[1], [0]], [[3], [2]]]), leave_stale=True)
    new_keys, new_values = _tokens(1, 6, dtype)
    store.append(new_keys, new_values, torch.full((2, 2, 1), 6), {"score": torch.full((2, 2, 1), 0.5)})
    store.drop(torch.tensor([[[0], [2]], [[1], [1]]]), leave_stale=False)
    return store


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_slots_hold_exactly_what_float32_slots_hold(dtype: torch.dtype) -> None:
    reference, half = _run(torch.float32), _run(dtype)
    assert torch.equal(half.held_positions(), reference.held_positions())
    assert torch.equal(half.held_state()["score"], reference.held_state()["score"])
    for got, want in zip(half.decoded(), reference.decoded(), strict=True):
        assert got.dtype == dtype
        assert torch.equal(as_integers(got), as_integers(want.to(dtype)))  # (bit for bit: -0.0 stays negative)
