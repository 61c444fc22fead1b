"""The fused attention of a single-query step over slots, in each dtype: the attention it states, and in fp32 the
very call the published fp32 results were answered with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvsieve.engine.slot_attention import AttentionArgs, Visibility, fused_attention

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 8, 37


def _step(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(3, HEADS, 1, DIM, generator=g)
    keys, values = (torch.randn(3, KV_HEADS, SLOTS + 5, DIM, generator=g)[:, :, :SLOTS] for _ in range(2))
    return tuple(t.to(dtype) for t in (query, keys, values))


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None):
    """The attention in float64, each query head over its KV head's slots."""
    group = HEADS // KV_HEADS
    q, k, v = (t.double() for t in (query, keys, values))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = (q @ k.transpose(-1, -2)) * DIM**-0.5
    if allowed is not None:
        logits = logits.masked_fill(~allowed.repeat_interleave(group, dim=1), float("-inf"))
    return logits.softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-visible", "masked"])
def test_a_single_query_step_attends_each_head_over_its_kv_head(dtype, masked) -> None:
    query, keys, values = _step(dtype)
    key_pos = torch.arange(SLOTS).expand(3, KV_HEADS, SLOTS).clone()
    if masked:
        key_pos[1, 0, 5:9] = -1  # (empty slots in one row and KV head)
    query_pos = torch.full((3, 1), SLOTS)
    seen = Visibility(all_visible=not masked)
    out = fused_attention(query, keys, values, key_pos, query_pos, AttentionArgs(scaling=DIM**-0.5), seen)
    allowed = (key_pos >= 0)[:, :, None, :] if masked else None
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), _reference(query, keys, values, allowed), atol=tolerance, rtol=0)


def test_fp32_steps_keep_the_per_head_kernel_call() -> None:
    """The fp32 grids were answered with torch's per-head call; a different kernel would round differently."""
    query, keys, values = _step(torch.float32, seed=1)
    key_pos, query_pos = torch.arange(SLOTS).expand(3, KV_HEADS, SLOTS), torch.full((3, 1), SLOTS)
    out = fused_attention(
        query, keys, values, key_pos, query_pos, AttentionArgs(scaling=0.3), Visibility(all_visible=True)
    )
    assert torch.equal(out, F.scaled_dot_product_attention(query, keys, values, scale=0.3, enable_gqa=True))
