"""The grid of ``kvsieve bench``: (prompt, generation) pairs × batch sizes, each with the references and the
policies, run in rounds (see :mod:`kvsieve.benchmarks.runner`), grid points that cannot run here skipped."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from kvsieve.benchmarks.defaults import DEFAULT_BUDGET, DEFAULT_REPEATS
from kvsieve.benchmarks.memory import MIB, available_bytes, full_kv_bytes_per_token
from kvsieve.benchmarks.runner import REFERENCES, Cell, GridPoint, Run, measure_round, prompt_rows, summarize
from kvsieve.engine.budget import Budget, resolve_budget
from kvsieve.policies import resolve_spec

MEM_SHARE = 0.5
"""A grid point is skipped when the full cache alone would take more than this share of the available memory."""


def rounds(policies: Sequence[str], repeats: int) -> list[list[str]]:
    """The policy order of each round of one grid point: every policy once per round, odd rounds reversed."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    return [list(policies) if r % 2 == 0 else list(policies)[::-1] for r in range(repeats)]


def pair_lengths(prompts: Sequence[int], gens: Sequence[int]) -> list[tuple[int, int]]:
    """(prompt, gen) pairs: element-wise when both lists have the same length, a single value pairs with every
    value of the other list."""
    if len(prompts) == len(gens):
        return list(zip(prompts, gens, strict=True))
    if len(gens) == 1:
        return [(p, gens[0]) for p in prompts]
    if len(prompts) == 1:
        return [(prompts[0], g) for g in gens]
    raise ValueError(
        f"--prompt-lens ({len(prompts)} values) and --gen-lens ({len(gens)}) must pair up: give as many of each, or "
        "one value for either"
    )


def check_policies(policies: Sequence[str]) -> list[str]:
    """``policies`` as given, each a reference (``dynamic_full``, ``floor``), a registered policy or a spec
    (``"h2o:kv_bits=4"``); an unknown name or a bad parameter is an error."""
    for name in policies:
        if name not in REFERENCES:
            resolve_spec(name)
    return list(policies)


def make_plan(
    lengths: Sequence[tuple[int, int]], batches: Sequence[int], policies: Sequence[str]
) -> list[tuple[GridPoint, list[str]]]:
    """Every (prompt, gen) pair at every batch size, each with the references and ``policies``."""
    for prompt, gen in lengths:
        if prompt < 1 or gen < 2:
            raise ValueError(f"need prompts of at least 1 token and at least 2 generated tokens, got {prompt}+{gen}")
    if not batches or min(batches) < 1:
        raise ValueError(f"batch sizes must be positive, got {list(batches)}")
    names = [*REFERENCES, *(p for p in dict.fromkeys(check_policies(policies)) if p not in REFERENCES)]
    return [(GridPoint(p, g, b), names) for p, g in lengths for b in batches]


def skip_reason(model: PreTrainedModel, point: GridPoint) -> str | None:
    """Why a grid point cannot run here (too many positions for the model, or too little memory), or None."""
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_pos is not None and point.prompt + point.gen - 1 > max_pos:
        return f"{point.prompt}+{point.gen} tokens exceed the model's {max_pos} positions"
    full = point.batch * (point.prompt + point.gen) * full_kv_bytes_per_token(model)
    if full > MEM_SHARE * available_bytes():
        return f"the full cache ({full / MIB:.0f} MiB) exceeds {MEM_SHARE:.0%} of the available memory"
    return None


def warm_up(model: PreTrainedModel, tokens: torch.Tensor, policies: Iterable[str]) -> None:
    """One short run per policy (with eviction), so that no measured run pays for first-use initialisation."""
    measure_round(model, list(policies), 16, tokens[:32].to(model.device)[None], 3)


def run_bench(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    plan: Sequence[tuple[GridPoint, Sequence[str]]],
    budget: Budget = DEFAULT_BUDGET,
    repeats: int = DEFAULT_REPEATS,
    progress: bool = True,
) -> tuple[list[Cell], list[dict[str, Any]]]:
    """Run ``plan`` (grid points with their policies, e.g. from :func:`make_plan`) in ``repeats`` rounds each (see
    :func:`measure_round`).

    ``tokens``: ``[n]`` ids, the prompts' source. ``budget``: tokens, or a ratio of each prompt. Returns the cells
    and the skipped grid points (their prompt and generation lengths, batch size and the reason).
    """
    runnable, skipped = [], []
    for point, names in plan:
        reason = skip_reason(model, point)
        if reason is None:
            runnable.append((point, list(names)))
        else:
            skipped.append(
                {"prompt_tokens": point.prompt, "gen_tokens": point.gen, "batch": point.batch, "reason": reason}
            )
    warm_up(model, tokens, dict.fromkeys(n for _, names in runnable for n in names))
    cells = []
    total = sum(len(names) * repeats for _, names in runnable)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        for point, names in runnable:
            budget_tokens = resolve_budget(budget, point.prompt)
            ids = prompt_rows(tokens, point, model.device)
            runs: dict[str, list[Run]] = {name: [] for name in names}
            for r, order in enumerate(rounds(names, repeats)):
                bar.set_postfix_str(f"{point.label} round {r + 1}")
                for name, run in measure_round(model, order, budget_tokens, ids, point.gen).items():
                    runs[name].append(run)
                bar.update(len(order))
            cells.extend(summarize(name, point, budget_tokens, runs[name], runs) for name in names)
    return cells, skipped
