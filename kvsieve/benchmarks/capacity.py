"""The largest batch under a memory cap (the H2O paper's Table 3 idea): predicted by a memory model fitted on the
measured cells, then verified by a run where that is affordable here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from kvsieve.benchmarks.defaults import DEFAULT_BUDGET
from kvsieve.benchmarks.memory import MIB, MemoryModel, MemSample, available_bytes, model_nbytes, rss_bytes
from kvsieve.benchmarks.runner import FLOOR, Cell, GridPoint, measure, prompt_rows
from kvsieve.engine.budget import Budget, resolve_budget

VERIFY_STEPS = 4
"""Decode steps of a run that verifies a predicted largest batch."""
VERIFY_MAX_S = 300.0
"""A predicted batch is verified only if its run is expected to take at most this long."""


def max_batches(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    cells: Sequence[Cell],
    cap_bytes: float,
    budget: Budget = DEFAULT_BUDGET,
) -> list[dict[str, Any]]:
    """For every policy but the floor, at the longest (prompt + gen) measured: the largest batch under ``cap_bytes``
    predicted by a :class:`MemoryModel` fitted on its cells' medians (every batch size measured there), then — if it is
    expected to fit in the available memory and take at most :data:`VERIFY_MAX_S` — verified by a run of that batch
    (prefill + :data:`VERIFY_STEPS` decode steps) whose peak RSS is compared with the cap."""
    if not cells:
        return []
    longest = max(cells, key=lambda c: (c.prompt_tokens + c.gen_tokens, c.prompt_tokens))
    weights = model_nbytes(model)
    rows = []
    for name in dict.fromkeys(c.policy for c in cells if c.policy != FLOOR):
        group = [
            c
            for c in cells
            if c.policy == name and (c.prompt_tokens, c.gen_tokens) == (longest.prompt_tokens, longest.gen_tokens)
        ]
        if not group:
            continue
        mem = MemoryModel.fit(
            weights,
            [
                MemSample(
                    c.batch, (c.peak_rss_mb - c.rss_growth_mb) * MIB, c.peak_rss_mb * MIB, c.kv_bytes, c.tokens_held
                )
                for c in group
            ],
        )
        batch = mem.max_batch(cap_bytes)
        row: dict[str, Any] = {
            "policy": name,
            "budget_tokens": group[0].budget_tokens,
            "prompt_tokens": longest.prompt_tokens,
            "gen_tokens": longest.gen_tokens,
            "cap_mb": cap_bytes / MIB,
            "model_mb": mem.model_bytes / MIB,
            "runtime_mb": mem.runtime_bytes / MIB,
            "kv_bytes_per_token": mem.kv_bytes_per_token,
            "tokens_held": mem.tokens_held,
            "act_mb_per_seq": mem.act_bytes_per_seq / MIB,
            "max_batch": batch,
            "predicted_peak_mb": mem.peak(batch) / MIB,
            "verified_peak_mb": None,
            "verified": None,
            "note": "",
        }
        seconds = batch * max(c.prefill_s / c.batch for c in group)  # the prefill dominates a verification run
        current, _ = rss_bytes()
        if batch == 0:
            row["note"] = "not even one sequence fits under the cap"
        elif mem.peak(batch) - current > 0.8 * available_bytes():
            row["note"] = "not verified: the batch would not fit in this machine's available memory"
        elif seconds > VERIFY_MAX_S:
            row["note"] = f"not verified: the run would take about {seconds:.0f} s"
        else:
            point = GridPoint(longest.prompt_tokens, VERIFY_STEPS + 1, batch)
            ids = prompt_rows(tokens, point, model.device)
            run = measure(model, name, resolve_budget(budget, point.prompt), ids, point.gen)
            row["verified_peak_mb"] = run.peak_rss / MIB
            row["verified"] = run.peak_rss <= cap_bytes
        rows.append(row)
    return rows
