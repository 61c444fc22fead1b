"""Sweeps: a metric vs the KV budget for several policies and tasks (the H2O paper's Figure 4), resumable.

A sweep is a grid of cells (task, policy, budget); a policy may be a spec with parameters (``"h2o:recent=0"``,
see :mod:`kvsieve.policies`), so an ablation is one more row of the grid. Every finished cell is stored as one JSON
file in ``OUT/cells`` together with the settings it was computed with (model, limit, protocol, question, ppl
tokens); a later run with the same settings never recomputes it, so an interrupted or extended sweep computes only
what is missing.
A cell that fails (e.g. ``streaming_llm`` when a request's budget is not above its 4 sink tokens) is stored with
its ``error`` and shown as such; a later run computes it again.

Tasks:

- ``ppl``: perplexity of the built-in Wikipedia text (the first ``ppl_tokens`` tokens of the first article long
  enough): with the ``stream`` protocol :func:`~kvsieve.evaluation.perplexity.stream_perplexity` (a ratio budget is
  a share of those tokens); with ``prefill``, :func:`~kvsieve.evaluation.perplexity.context_perplexity` (the first
  two thirds compressed once, the last third scored; a ratio budget is a share of the context).
- ``xsum``: ROUGE-1/2/L of summaries of the first ``limit`` GEM XSum articles
  (:func:`~kvsieve.evaluation.summarization.evaluate_xsum`).
- any other name: an lm-eval task or group run through :class:`~kvsieve.evaluation.lm_eval_model.KVSieveLM`
  (the offline pack's short names such as ``social_iqa`` mean ``kvsieve_social_iqa``), ``limit`` documents per
  (sub)task, the task's default shots (5 for the pack); metrics ``acc`` and ``acc_norm``.

``question`` (``aware``, the default, or ``agnostic`` with the ``prefill`` protocol; see
:data:`~kvsieve.evaluation.defaults.QUESTION_MODES`): whether the lm-eval and ``xsum`` cells compress each request's
context with its question or before its continuation (:class:`~kvsieve.evaluation.lm_eval_model.KVSieveLM`);
``ppl`` has no question and is refused under ``agnostic``. Both modes of one grid go to two ``OUT`` directories (a
cell computed with other settings is computed again, in place).

Budgets are ratios (``0.2``, ``20%``) or token counts. ``full`` ignores the budget and a ratio of 1.0 never evicts
anything, so all those cells of a task are computed once, as ``full``, and shared: 100 % = full.

Outputs in ``OUT``: ``results.json``, ``results.csv``, ``results.md`` (per task and metric a table of policies ×
budgets) and ``plots/<task>_<metric>.png`` (metric vs budget, one line per policy).

Where cells are computed: in this process (default); ``jobs > 1``: in that many local processes; ``ray``: as Ray
tasks on a local Ray or a cluster (:mod:`~kvsieve.evaluation.ray_sweep`). Every process loads the model once
(a worker process: :func:`shared_runner`), and only this process writes the cell files, as the cells finish.
"""

from __future__ import annotations

import csv
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import closing
from dataclasses import asdict, dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from kvsieve.engine.budget import Budget, check_budget
from kvsieve.evaluation.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MODEL,
    DEFAULT_QUESTION,
    PROTOCOLS,
    ROUGE_TYPES,
    check_question,
)
from kvsieve.evaluation.tasks import task_name
from kvsieve.policies import get_policy, join_spec, resolve_spec

if TYPE_CHECKING:
    from kvsieve.evaluation.lm_eval_model import KVSieveLM
    from kvsieve.evaluation.ray_sweep import RayOptions

DEFAULT_POLICIES = ("full", "local", "streaming_llm", "h2o")
DEFAULT_BUDGETS: tuple[Budget, ...] = (0.04, 0.1, 0.2, 0.6, 1.0)
MC_METRICS = ("acc", "acc_norm")


def task_metrics(task: str) -> tuple[str, ...]:
    """The metrics a sweep records for ``task``."""
    return {"ppl": ("ppl",), "xsum": ROUGE_TYPES}.get(task, MC_METRICS)


def budget_label(budget: Budget) -> str:
    """``0.2`` → ``"20%"``, ``64`` → ``"64"``."""
    return f"{budget * 100:g}%" if isinstance(budget, float) else str(budget)


@dataclass(frozen=True)
class Cell:
    task: str
    policy: str
    budget: Budget

    def computed_as(self) -> Cell:
        """The cell actually computed: ``full`` for the ``full`` policy and for a ratio of 1.0 (with the policy's slot
        quantization, if any: ``"full:kv_bits=4"``)."""
        if not get_policy(self.policy).bounded or (isinstance(self.budget, float) and self.budget == 1.0):
            return Cell(self.task, join_spec("full", resolve_spec(self.policy)[3]), 1.0)
        return self

    @property
    def key(self) -> str:
        kind = "r" if isinstance(self.budget, float) else "t"
        return f"{self.task}__{self.policy}__{kind}{self.budget}"


@dataclass(frozen=True)
class Settings:
    """What a cell's result depends on besides the cell itself."""

    model: str = DEFAULT_MODEL
    limit: int | None = None
    protocol: str = "stream"
    question: str = DEFAULT_QUESTION
    ppl_tokens: int = 1024
    dtype: str | None = None
    """The model's dtype (None: ``load_model``'s default, float32)."""


class Runner:
    """Computes cells in one process; loads the model on first use."""

    def __init__(self, settings: Settings, device: str | None = None) -> None:
        self.settings = settings
        self.device = device
        self._task_managers: dict[str, Any] = {}

    @cached_property
    def loaded(self) -> tuple[Any, Any]:
        from kvsieve.models import load_model

        return load_model(self.settings.model, device=self.device, dtype=self.settings.dtype)

    def run(self, cell: Cell) -> dict[str, Any]:
        """The metrics of ``cell`` (and ``n``, the number of examples or tokens scored)."""
        model, tokenizer = self.loaded
        if cell.task == "ppl":
            return self._perplexity(cell)
        from kvsieve.evaluation.lm_eval_model import KVSieveLM  # (lm-eval: imported only by cells that use it)

        lm = KVSieveLM(
            model=model,
            tokenizer=tokenizer,
            policy=cell.policy,
            budget=cell.budget,
            protocol=self.settings.protocol,
            question=self.settings.question,
            # XSum prompts run from 200 to 8,000 tokens: one at a time, no compute is spent on left padding.
            batch_size=1 if cell.task == "xsum" else DEFAULT_BATCH_SIZE,
        )
        if cell.task == "xsum":
            from kvsieve.evaluation.summarization import evaluate_xsum

            result = evaluate_xsum(lm, self.settings.limit)
            return {**{name: getattr(result, name) for name in ROUGE_TYPES}, "n": result.articles}
        return self._lm_eval(lm, task_name(cell.task))

    def _perplexity(self, cell: Cell) -> dict[str, Any]:
        from kvsieve.data import builtin_text
        from kvsieve.evaluation.perplexity import context_perplexity, stream_perplexity

        model, tokenizer = self.loaded
        tokens = self.settings.ppl_tokens
        ids = tokenizer(builtin_text(min_chars=tokens * 6), return_tensors="pt").input_ids[:, :tokens]
        if self.settings.protocol == "prefill":
            result, _ = context_perplexity(model, ids, cell.policy, cell.budget)
            return {"ppl": result.ppl, "n": result.tokens_scored}
        prefill = None if get_policy(cell.policy).bounded else ids.shape[1] - 1
        result, _ = stream_perplexity(model, ids, cell.policy, cell.budget, prefill=prefill, progress=False)
        return {"ppl": result.ppl, "n": result.tokens_scored}

    def _lm_eval(self, lm: KVSieveLM, name: str) -> dict[str, Any]:
        import lm_eval

        from kvsieve.evaluation.tasks import task_manager

        if name not in self._task_managers:
            self._task_managers[name] = task_manager([name])
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=[name],
            task_manager=self._task_managers[name],
            limit=self.settings.limit,
            bootstrap_iters=0,
            log_samples=False,
            verbosity="WARNING",
        )
        row = results["results"][name]
        metrics = {m: row[f"{m},none"] for m in MC_METRICS if f"{m},none" in row}
        return {**metrics, "n": sum(int(n["effective"]) for n in results["n-samples"].values())}


@lru_cache(maxsize=1)
def shared_runner(settings: Settings, device: str | None) -> Runner:
    """A worker process's runner for ``settings`` (its model loads once per process, not once per cell)."""
    return Runner(settings, device)


def error_result(err: BaseException) -> dict[str, str]:
    """How a failed cell's result is stored."""
    return {"error": f"{type(err).__name__}: {err}"}


Finished = tuple[Cell, dict[str, Any], float, str | None]
"""A computed cell: the cell, its result (metrics or ``error``), its seconds, the Ray node that ran it (or None)."""


def _timed(runner: Runner, cell: Cell) -> Finished:
    """Run one cell; a cell that fails (e.g. a budget too small for the policy) yields ``{"error": ...}``."""
    start = time.perf_counter()
    try:
        result = runner.run(cell)
    except Exception as err:  # recorded in the cell, so that one failing cell does not stop the sweep
        result = error_result(err)
    return cell, result, time.perf_counter() - start, None


def _work(settings: Settings, device: str | None, cell: Cell) -> Finished:
    return _timed(shared_runner(settings, device), cell)


class Progress:
    """The bar over the cells to compute: done (with ETA), running and failed."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc="sweep cells", unit="cell", disable=not enabled)
        self.failed = 0
        self.running = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def show_running(self, running: int) -> None:
        self.running = running
        self.bar.set_postfix(running=running, failed=self.failed)

    def finished(self, cell: Cell, result: dict[str, Any], seconds: float) -> None:
        self.failed += "error" in result
        self.bar.update(1)
        self.bar.set_postfix(running=self.running, failed=self.failed)
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
        self.bar.write(f"{cell.task} {cell.policy} {budget_label(cell.budget)}: {shown} ({seconds:.0f} s)", sys.stderr)


def _compute(
    todo: Sequence[Cell],
    settings: Settings,
    device: str | None,
    jobs: int,
    threads: int | None,
    ray: RayOptions | None,
    progress: Progress,
) -> Iterator[Finished]:
    """The cells of ``todo`` as they finish: in this process, in ``jobs`` local processes, or as Ray tasks."""
    if not todo:
        return
    if ray is not None:
        from kvsieve.evaluation.ray_sweep import ray_cells

        yield from ray_cells(todo, settings, device, ray, progress)
    elif jobs > 1:
        with ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=torch.set_num_threads,
            initargs=(threads or max(1, (os.cpu_count() or 1) // jobs),),
        ) as pool:
            futures = [pool.submit(_work, settings, device, cell) for cell in todo]
            for done, future in enumerate(as_completed(futures)):
                progress.show_running(min(jobs, len(todo) - done))
                yield future.result()
    else:
        if threads:
            torch.set_num_threads(threads)
        runner = Runner(settings, device)
        progress.show_running(1)
        for cell in todo:
            yield _timed(runner, cell)


@dataclass
class SweepResult:
    rows: list[dict[str, Any]]
    """One row per requested cell: task, policy, budget, budget_label, computed_as, the metrics, n, seconds."""
    computed: int
    """Cells computed by this run (the others were found on disk)."""
    files: dict[str, str]
    """Output name → path (results.json/csv/md and one PNG per task and metric)."""
    table: str
    """The markdown tables."""


def _cell_path(out: Path, cell: Cell) -> Path:
    return out / "cells" / f"{cell.key}.json"


def _load_cell(out: Path, cell: Cell, settings: Settings) -> dict[str, Any] | None:
    path = _cell_path(out, cell)
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    # (cells written before a setting existed were computed with its default)
    return stored if {**asdict(Settings()), **stored.get("settings", {})} == asdict(settings) else None


def _finished(out: Path, cell: Cell, settings: Settings) -> bool:
    """Whether ``cell`` is stored with ``settings`` and did not fail (else a run computes it)."""
    stored = _load_cell(out, cell, settings)
    return stored is not None and "error" not in stored["result"]


def _save_cell(
    out: Path, cell: Cell, settings: Settings, result: dict[str, Any], seconds: float, node: str | None = None
) -> None:
    """Write the cell's file atomically (a ``.partial`` file renamed); ``node``: the Ray node that computed it."""
    path = _cell_path(out, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"cell": asdict(cell), "settings": asdict(settings), "result": result, "seconds": seconds}
    if node is not None:
        record["node"] = node
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(path)


def run_sweep(
    out: str | Path,
    tasks: Sequence[str] = ("ppl",),
    policies: Sequence[str] = DEFAULT_POLICIES,
    budgets: Sequence[Budget] = DEFAULT_BUDGETS,
    *,
    settings: Settings | None = None,
    jobs: int = 1,
    threads: int | None = None,
    device: str | None = None,
    progress: bool = True,
    compute: bool = True,
    ray: RayOptions | None = None,
) -> SweepResult:
    """Run the grid ``tasks × policies × budgets`` (missing and failed cells only) and write the outputs into ``out``.

    ``compute=False`` only writes the outputs of the cells already finished (the others are shown as missing:
    "—" in the tables, no point in the plots), e.g. while a long sweep is still running.

    ``threads``: torch threads per process (default: torch's own with one job, ``cores // jobs`` with several; on a
    busy machine 1 is often much faster than oversubscribing the cores). ``ray``: compute the cells as Ray tasks
    instead (their threads follow ``ray.cpus_per_cell``).
    """
    settings = settings or Settings()
    if settings.protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {settings.protocol!r}")
    check_question(settings.question, settings.protocol)
    if settings.question == "agnostic" and "ppl" in tasks:
        raise ValueError("the ppl task has no question to compress the context before: run it with question=aware")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if ray is not None and (jobs > 1 or threads):
        raise ValueError("with Ray, each cell is a task with --cpus-per-cell threads: give --jobs/--threads without it")
    for policy in policies:
        resolve_spec(policy)  # a name or a spec ("ahakv:sgs=false"): checked before anything runs
    for budget in budgets:
        check_budget(budget)
    out = Path(out)
    cells = [Cell(task, policy, budget) for task in tasks for policy in policies for budget in budgets]
    needed = dict.fromkeys(cell.computed_as() for cell in cells) if compute else {}
    todo = [c for c in needed if not _finished(out, c, settings)]
    with Progress(len(todo), progress) as bar:
        finished = _compute(todo, settings, device, jobs, threads, ray, bar)
        with closing(finished):  # (Ctrl-C while a cell is written: the outstanding ones are cancelled all the same)
            for cell, result, seconds, node in finished:
                _save_cell(out, cell, settings, result, seconds, node)
                bar.finished(cell, result, seconds)
    rows = []
    for cell in cells:
        stored = _load_cell(out, cell.computed_as(), settings)
        found = {"missing": True} if stored is None else {**stored["result"], "seconds": stored["seconds"]}
        label, computed_as = budget_label(cell.budget), cell.computed_as().policy
        rows.append({**asdict(cell), "budget_label": label, "computed_as": computed_as, **found})
    files, table = write_outputs(out, rows, tasks)
    return SweepResult(rows=rows, computed=len(todo), files=files, table=table)


def plot_metric(rows: Sequence[dict[str, Any]], task: str, metric: str) -> Figure:
    """``metric`` vs budget on ``task``, one line per policy (x: % of the sequence for ratios, else tokens)."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    selected = [r for r in rows if r["task"] == task and r.get(metric) is not None]
    ratios = all(isinstance(r["budget"], float) for r in selected)
    for policy in dict.fromkeys(r["policy"] for r in selected):
        points = sorted(
            (r["budget"] * 100 if ratios else r["budget"], r[metric]) for r in selected if r["policy"] == policy
        )
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy)
    ax.set_xlabel("KV cache budget (% of each sequence)" if ratios else "KV cache budget (tokens)")
    ax.set_ylabel(metric)
    n = max((r.get("n", 0) for r in selected), default=0)
    ax.set_title(f"{task}: {metric} vs KV budget (n = {n})")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _format(metric: str, row: dict[str, Any]) -> str:
    if row.get("missing"):
        return "—"
    value = row.get(metric)
    if value is None:
        return "error"
    return f"{value:.3f}" if metric in MC_METRICS else f"{value:.2f}"


def markdown_tables(rows: Sequence[dict[str, Any]], tasks: Sequence[str]) -> str:
    """Per task and metric, a table of policies (rows) × budgets (columns)."""
    parts = []
    for task in tasks:
        selected = [r for r in rows if r["task"] == task]
        labels = list(dict.fromkeys(r["budget_label"] for r in selected))
        policies = list(dict.fromkeys(r["policy"] for r in selected))
        value = {(r["policy"], r["budget_label"]): r for r in selected}
        n = max((r.get("n", 0) for r in selected), default=0)
        for metric in task_metrics(task):
            lines = [
                f"### {task}: {metric} (n = {n})",
                "",
                "| policy | " + " | ".join(labels) + " |",
                "|---|" + "---:|" * len(labels),
            ]
            lines += [f"| {p} | " + " | ".join(_format(metric, value[p, b]) for b in labels) + " |" for p in policies]
            parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def write_outputs(out: Path, rows: list[dict[str, Any]], tasks: Sequence[str]) -> tuple[dict[str, str], str]:
    """Write results.json/csv/md and the plots; return the paths and the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "results.json", "csv": out / "results.csv", "markdown": out / "results.md"}
    files["json"].write_text(json.dumps(rows, indent=2))
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(files["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    table = markdown_tables(rows, tasks)
    files["markdown"].write_text(table)
    for task in tasks:
        for metric in task_metrics(task):
            path = out / "plots" / f"{task}_{metric}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            plot_metric(rows, task, metric).savefig(path, dpi=120)
            files[f"{task}_{metric}"] = path
    return {name: str(path) for name, path in files.items()}, table
