"""``kvsieve bench --profile``: the top ops of a few decode steps, to see where a step's time goes."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import PreTrainedModel

from kvsieve.benchmarks.eviction_overhead import BUDGET
from kvsieve.benchmarks.runner import GridPoint, new_cache, next_token, prompt_rows

PROFILE_PROMPT = 2048
"""Prompt tokens before the profiled decode steps (``--profile``)."""


@torch.inference_mode()
def profile_decode(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    policy: str = "h2o",
    budget: int = BUDGET,
    prompt: int = PROFILE_PROMPT,
    steps: int = 16,
    top: int = 25,
) -> dict[str, Any]:
    """Top ops (by self CPU time) of ``steps`` decode steps of ``policy`` after a ``prompt``-token prefill."""
    from torch.profiler import ProfilerActivity, profile

    cache = new_cache(model, policy, budget)
    token = next_token(model, cache, prompt_rows(tokens, GridPoint(prompt, steps, 1), model.device))
    for _ in range(4):  # past the first evictions
        token = next_token(model, cache, token)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            token = next_token(model, cache, token)
    wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return {
        "policy": policy,
        "budget_tokens": budget,
        "prompt_tokens": prompt,
        "steps": steps,
        "step_ms_profiled": wall / steps * 1e3,
        "op_calls_per_step": sum(e.count for e in events) / steps,
        "ops": [
            {
                "op": e.key,
                "calls_per_step": e.count / steps,
                "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                "total_ms_per_step": e.cpu_time_total / 1e3 / steps,
                "self_share": e.self_cpu_time_total / total,
            }
            for e in events[:top]
        ],
    }
