"""``kvsieve bench``: the grid (or a preset's cells), the preset's checks, the largest batches under a memory cap and
the plot, as one JSON-ready result."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.benchmarks.capacity import max_batches
from kvsieve.benchmarks.defaults import (
    DEFAULT_BATCHES,
    DEFAULT_BUDGET,
    DEFAULT_POINTS,
    DEFAULT_POLICIES,
    DEFAULT_REPEATS,
    PRESETS,
    STREAM_ENGINE,
)
from kvsieve.benchmarks.eviction_overhead import BUDGET, evaluate_checks, preset_plan
from kvsieve.benchmarks.grid import make_plan, run_bench
from kvsieve.benchmarks.memory import reset_peak_rss
from kvsieve.benchmarks.report import plot_decode
from kvsieve.benchmarks.runner import prompt_tokens
from kvsieve.benchmarks.stream_engine import LENGTH, stream_engine
from kvsieve.engine.budget import Budget


def benchmark(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Sequence[tuple[int, int]] = DEFAULT_POINTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    policies: Sequence[str] = DEFAULT_POLICIES,
    budget: Budget = DEFAULT_BUDGET,
    repeats: int = DEFAULT_REPEATS,
    preset: str | None = None,
    mem_cap_gb: float | None = None,
    plot: str | Path | None = None,
    progress: bool = True,
    title: str = "",
) -> dict[str, Any]:
    """The whole ``kvsieve bench``: the grid (or, with ``preset``, exactly the preset's cells at its budget), the
    checks of the ``eviction-overhead`` preset, the largest batches under ``mem_cap_gb`` and the plot; the
    ``stream-engine`` preset is its own measurement (:mod:`kvsieve.benchmarks.stream_engine`)."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; available: {', '.join(PRESETS)}")
    if preset == STREAM_ENGINE:
        return stream_engine(model, prompt_tokens(tokenizer, LENGTH), repeats=repeats, progress=progress)
    plan = preset_plan() if preset else make_plan(lengths, batches, policies)
    budget = BUDGET if preset else budget
    tokens = prompt_tokens(tokenizer, max(point.prompt for point, _ in plan))
    per_run = reset_peak_rss()
    load = os.getloadavg()[0]
    cells, skipped = run_bench(model, tokens, plan, budget, repeats, progress)
    result: dict[str, Any] = {
        "model": title,
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "load_avg": load,
        "budget": budget,
        "repeats": repeats,
        "rss_method": "reset before each run (malloc_trim + clear_refs)" if per_run else "process peak so far",
        "cells": [c.to_dict() for c in cells],
        "skipped": skipped,
        "checks": [c.to_dict() for c in evaluate_checks(cells)],
    }
    if mem_cap_gb is not None:
        result["max_batch"] = max_batches(model, tokens, cells, mem_cap_gb * 2**30, budget)
    if plot is not None:
        result["plot"] = str(plot_decode(cells, plot, title))
    return result
