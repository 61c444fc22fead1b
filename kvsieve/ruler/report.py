"""A RULER grid's report from its cell files: ``results.json``, ``results.csv``, ``results.md`` and plots.

Each row is one cell: task, length, protocol, policy, compression, the samples (those of its task and length answered
under every setting), the mean score and its standard error in percent
(:func:`~kvsieve.ruler.scoring.mean_and_stderr`), and the mean seconds to the first answer token and per answer. The
markdown holds per length the full cache's score per task (the ceiling), then per length and protocol the average
over tasks of each policy at each compression (its standard error: that of a mean of the task means, √Σse²/T) with
the full cache's average as the ceiling, then per compression a task × policy table, then the papers' claims checked
on the grid (:mod:`~kvsieve.ruler.claims`). ``depths.csv`` holds the single-needle tasks' scores by the needle's
depth (:func:`by_depth`). Plots (``plots/``): the average score against the compression, one line per policy, the
ceiling dashed (``score_<length>_<protocol>.png``); a task × policy heat map per compression
(``tasks_<length>_<protocol>_c<compression>.png``); a policy × needle depth heat map per compression
(``depth_<length>_<protocol>_c<compression>.png``). A documentation page
embeds a grid's summary tables, its :func:`overview` or its claims in a results block (:mod:`kvsieve.results`)
naming the grid's directory.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsieve.evaluation.plots import pyplot, save_figure
from kvsieve.ruler import claims
from kvsieve.ruler.scoring import mean_and_stderr, plus_minus, task_average
from kvsieve.ruler.tasks import load_samples

__all__ = ["DEPTH_BINS", "by_depth", "collect", "markdown", "overview", "summary", "write_report"]

FIELDS = (
    "task",
    "length",
    "protocol",
    "policy",
    "compression",
    "samples",
    "score",
    "stderr",
    "first_token_s",
    "answer_s",
)
DEPTH_BINS = 5
"""The single-needle tasks are also scored by the needle's depth in the haystack, in this many equal bins."""


_Cells = dict[tuple[str, int], tuple[list[dict[str, Any]], list[str]]]


def _cells(out: str | Path) -> _Cells:
    """``(task, length)`` → its cell files' contents and the samples every one of them answered, in order."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(Path(out, "cells").glob("*.json")):
        stored = json.loads(path.read_text())
        cells[(stored["settings"]["task"], stored["settings"]["length"])].append(stored)
    common = {key: set.intersection(*(set(c["predictions"]) for c in group)) for key, group in cells.items()}
    return {key: (group, sorted(common[key], key=int)) for key, group in cells.items()}


def _protocol(settings: dict[str, Any]) -> str:
    """A cell's protocol in the report: the full cache's is ``both`` (without eviction they compute the same)."""
    return settings["protocol"] if settings["policy"] != "full" else "both"


def collect(out: str | Path) -> list[dict[str, Any]]:
    """One row per cell file in ``out/cells`` (see the module docstring), over the samples of its ``(task, length)``
    answered under every setting of the grid, so that every row of a task is computed on the same samples (a cell
    still being computed narrows its task's rows until it catches up)."""
    return _rows(_cells(out))


def _rows(cells: _Cells) -> list[dict[str, Any]]:
    rows = []
    for group, common in cells.values():
        for stored in group:
            settings = stored["settings"]
            predictions = [stored["predictions"][i] for i in common]
            if not predictions:
                continue
            mean, stderr = mean_and_stderr([p["score"] for p in predictions])
            rows.append(
                {
                    "task": settings["task"],
                    "length": settings["length"],
                    "protocol": _protocol(settings),
                    "policy": settings["policy"],
                    "compression": settings["compression"],
                    "samples": len(predictions),
                    "score": round(mean, 2),
                    "stderr": None if stderr is None else round(stderr, 2),
                    "first_token_s": round(sum(p["first_token_s"] for p in predictions) / len(predictions), 3),
                    "answer_s": round(sum(p["total_s"] for p in predictions) / len(predictions), 3),
                }
            )
    return rows


def by_depth(out: str | Path) -> list[dict[str, Any]]:
    """The single-needle tasks' scores (:data:`~kvsieve.ruler.claims.RETRIEVAL`, pooled) by where the needle sits:
    one row per (length, protocol, policy, compression, depth bin: :data:`DEPTH_BINS` equal shares of the haystack),
    over the samples of each task that every setting answered, read with their depths from ``out/samples``."""
    return _depth_rows(out, _cells(out))


def _depth_rows(out: str | Path, cells: _Cells) -> list[dict[str, Any]]:
    scores: dict[tuple[int, str, str, float, int], list[float]] = defaultdict(list)
    for (task, length), (group, common) in cells.items():
        path = Path(out, "samples", f"{task}_{length}.jsonl")
        if task not in claims.RETRIEVAL or not path.is_file():
            continue
        depth = {sample.index: sample.depths[0] for sample in load_samples(path)}
        for stored in group:
            settings = stored["settings"]
            for i in common:
                at = min(int(depth[int(i)] * DEPTH_BINS), DEPTH_BINS - 1)
                key = (length, _protocol(settings), settings["policy"], settings["compression"], at)
                scores[key].append(stored["predictions"][i]["score"])
    return [
        {
            "length": length,
            "protocol": protocol,
            "policy": policy,
            "compression": compression,
            "depth_from": at / DEPTH_BINS,
            "depth_to": (at + 1) / DEPTH_BINS,
            "samples": len(got),
            "score": round(100 * sum(got) / len(got), 2),
        }
        for (length, protocol, policy, compression, at), got in sorted(scores.items())
    ]


def write_report(out: str | Path, title: str = "RULER") -> dict[str, Any]:
    """Write ``results.json``, ``results.csv``, ``results.md`` and the plots of ``out``; the rows and the paths."""
    out = Path(out)
    cells = _cells(out)  # (read once: the rows and the depths)
    rows = _rows(cells)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.md").write_text(markdown(rows, title))
    depths = _depth_rows(out, cells)
    names = ["results.json", "results.csv", "results.md"]
    if depths:
        with open(out / "depths.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, list(depths[0]))
            writer.writeheader()
            writer.writerows(depths)
        names.append("depths.csv")
    plots = _plots(rows, out / "plots") + _depth_plots(depths, out / "plots")
    return {"rows": rows, "files": [str(out / n) for n in names] + plots}


@dataclass
class _Section:
    """The rows of one (length, protocol), indexed once for the tables and the plots."""

    length: int
    protocol: str
    tasks: list[str]
    compressions: list[float]
    policies: list[str]
    full: dict[str, dict[str, Any]]
    """Task → the full cache's row (the ceiling; it belongs to both protocols)."""
    cells: dict[tuple[str, float], dict[str, dict[str, Any]]]
    """(policy, compression) → task → row."""

    def by_task(self, policy: str, compression: float) -> dict[str, dict[str, Any]]:
        """Task → row of ``policy`` at ``compression`` (``full``: the ceiling)."""
        return self.full if policy == "full" else self.cells.get((policy, compression), {})

    def average(self, policy: str, compression: float = 0.0) -> tuple[float, float] | None:
        """The average over the tasks and its standard error, or None unless every task has a row."""
        got = self.by_task(policy, compression)
        return task_average(list(got.values())) if len(got) == len(self.tasks) else None


def _sections(rows: Sequence[dict[str, Any]]) -> list[_Section]:
    """One section per (length, protocol) of the bounded rows, in order."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["policy"] != "full":
            groups[(row["length"], row["protocol"])].append(row)
    sections = []
    for (length, protocol), group in sorted(groups.items()):
        tasks = sorted({r["task"] for r in group})
        cells: dict[tuple[str, float], dict[str, dict[str, Any]]] = defaultdict(dict)
        for r in group:
            cells[(r["policy"], r["compression"])][r["task"]] = r
        full = {r["task"]: r for r in rows if r["policy"] == "full" and r["length"] == length and r["task"] in tasks}
        compressions = sorted({r["compression"] for r in group})
        policies = list(dict.fromkeys(r["policy"] for r in group))
        sections.append(_Section(length, protocol, tasks, compressions, policies, full, dict(cells)))
    return sections


def _mean_text(average: tuple[float, float | None] | None) -> str:
    return "–" if average is None else plus_minus(*average)


def summary(rows: Sequence[dict[str, Any]], level: int = 2) -> str:
    """The average tables alone (what ``kvsieve ruler`` prints), under headings of ``level``."""
    return markdown(rows, title="", per_task=False, level=level)


def overview(rows: Sequence[dict[str, Any]]) -> str:
    """Per length, the full cache's average over the tasks (the ceiling), then one table: each policy's average
    (± its standard error) at each compression under each protocol — the summary in a page's worth."""
    lines, bounded = [], _sections(rows)
    for length in sorted({r["length"] for r in rows}):
        full = [r for r in rows if r["policy"] == "full" and r["length"] == length]
        lines += [f"{length:,} tokens, average over {len(full)} task(s), score % ± standard error; the full cache "
                  f"(the ceiling): **{_mean_text(task_average(full) if full else None)}**.", ""]  # fmt: skip
        sections = [s for s in bounded if s.length == length]
        if not sections:
            continue
        columns = [(s, c) for s in sections for c in s.compressions]
        header = [f"{s.protocol} {c:g}" if i == 0 else f"{c:g}" for s in sections for i, c in enumerate(s.compressions)]
        lines += ["| policy | " + " | ".join(header) + " |", "|---|" + "---:|" * len(columns)]
        for policy in dict.fromkeys(p for s, _ in columns for p in s.policies):
            lines += [f"| {policy} | " + " | ".join(_mean_text(s.average(policy, c)) for s, c in columns) + " |"]
        lines += [""]
    return "\n".join(lines)


def leaders(rows: Sequence[dict[str, Any]], top: int = 3) -> str:
    """Per length and protocol, at each compression, the ``top`` policies by their average over the tasks (± its
    standard error), best first, and the full cache's: which policies keep the most answers."""
    lines = []
    for s in _sections(rows):
        full = s.average("full")
        lines += [f"{s.length:,} tokens, question-{s.protocol}, average score % over {len(s.tasks)} task(s) ± standard "
                  f"error; the full cache: **{_mean_text(full)}**.", ""]  # fmt: skip
        lines += ["| dropped | " + " | ".join(f"#{i + 1}" for i in range(top)) + " |", "|---|" + "---|" * top]
        for c in s.compressions:
            ranked = sorted(
                ((average, p) for p in s.policies if (average := s.average(p, c)) is not None), key=lambda x: -x[0][0]
            )
            cells = [f"`{p}` {_mean_text(average)}" for average, p in ranked[:top]]
            lines += [f"| {c:.0%} | " + " | ".join(cells + ["–"] * (top - len(cells))) + " |"]
        lines += [""]
    return "\n".join(lines)


def markdown(rows: Sequence[dict[str, Any]], title: str = "RULER", per_task: bool = True, level: int = 2) -> str:
    """The report's tables (see the module docstring) under headings of ``level`` (the title one above);
    ``per_task=False``: the average tables only."""
    h = "#" * level
    lines = [f"{h[1:]} {title}", ""] if title else []
    for length in sorted({r["length"] for r in rows if r["policy"] == "full"}):
        full = sorted((r for r in rows if r["policy"] == "full" and r["length"] == length), key=lambda r: r["task"])
        mean, se = task_average(full)
        lines += [f"{h} {length} tokens, the full cache (the ceiling)", ""]
        lines += ["| " + " | ".join(["task", *(r["task"] for r in full), "average"]) + " |"]
        lines += ["|---|" + "---:|" * (len(full) + 1)]
        lines += ["| score % | " + " | ".join(plus_minus(r["score"], r["stderr"], 0) for r in full)]
        lines[-1] += f" | {plus_minus(mean, se)} |"
        lines += ["| samples | " + " | ".join(str(r["samples"]) for r in full) + " | |", ""]
    for sec in _sections(rows):
        lines += [f"{h} {sec.length} tokens, question-{sec.protocol}", ""]
        lines += [f"Average over {len(sec.tasks)} task(s) ({', '.join(sec.tasks)}), score % ± standard error.", ""]
        lines += ["| policy | " + " | ".join(f"{c:g}" for c in sec.compressions) + " |"]
        lines += ["|---|" + "---:|" * len(sec.compressions)]
        if (ceiling := sec.average("full")) is not None:
            lines += ["| full (ceiling) | " + " | ".join(plus_minus(*ceiling) for _ in sec.compressions)]
            lines[-1] += " |"
        for policy in sec.policies:
            cells = [_mean_text(sec.average(policy, c)) for c in sec.compressions]
            lines += [f"| {policy} | " + " | ".join(cells) + " |"]
        for c in sec.compressions if per_task else ():
            lines += ["", f"{h}# compression {c:g} (per task)", ""]
            lines += ["| policy | " + " | ".join(sec.tasks) + " |", "|---|" + "---:|" * len(sec.tasks)]
            for policy in ["full", *sec.policies]:
                by_task = sec.by_task(policy, c)
                cells = [
                    plus_minus(by_task[t]["score"], by_task[t]["stderr"], 0) if t in by_task else "–" for t in sec.tasks
                ]
                lines += [f"| {policy} | " + " | ".join(cells) + " |"]
        lines += [""]
    if per_task:
        lines += [f"{h} The papers' claims", "", claims.markdown(rows)]
    return "\n".join(lines) + "\n"


def _heat_map(plt: Any, grid: list[list[float]], size: tuple[float, float]) -> tuple[Any, Any]:
    """A figure of ``grid``'s scores (0–100, NaN: blank), each cell labelled, with a colour bar; the caller names
    the axes."""
    fig, ax = plt.subplots(figsize=size)
    im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    for i, line in enumerate(grid):
        for j, value in enumerate(line):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="score (%)")
    return fig, ax


def _plots(rows: Sequence[dict[str, Any]], folder: Path) -> list[str]:
    paths = []
    plt = pyplot()
    for sec in _sections(rows):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy in sec.policies:
            points = [(c, got[0]) for c in sec.compressions if (got := sec.average(policy, c)) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=policy)
        if (ceiling := sec.average("full")) is not None:
            ax.axhline(ceiling[0], color="black", linestyle="--", label="full")
        ax.set_ylim(0, 100)
        ax.set_xlabel("compression (share of tokens dropped)")
        ax.set_ylabel(f"average score over {len(sec.tasks)} task(s) (%)")
        ax.set_title(f"RULER {sec.length} tokens, question-{sec.protocol}")
        ax.legend(fontsize=7, ncol=2)
        paths.append(str(save_figure(fig, folder / f"score_{sec.length}_{sec.protocol}.png")))
        names = ["full", *sec.policies]
        for c in sec.compressions:
            grid = [[sec.by_task(p, c).get(t, {}).get("score", math.nan) for p in names] for t in sec.tasks]
            fig, ax = _heat_map(plt, grid, (0.7 * len(names) + 2.5, 0.45 * len(sec.tasks) + 1.8))
            ax.set_xticks(range(len(names)), names, rotation=60, ha="right")
            ax.set_yticks(range(len(sec.tasks)), sec.tasks)
            ax.set_title(f"RULER {sec.length} tokens, question-{sec.protocol}, compression {c:g}")
            paths.append(str(save_figure(fig, folder / f"tasks_{sec.length}_{sec.protocol}_c{c:g}.png")))
    return paths


def _depth_plots(rows: Sequence[dict[str, Any]], folder: Path) -> list[str]:
    """Per (length, protocol, compression), a policy × needle depth heat map (:func:`by_depth`), the full cache on
    top: ``depth_<length>_<protocol>_c<compression>.png``."""
    paths = []
    plt = pyplot()
    for length, protocol, c in sorted(
        {(r["length"], r["protocol"], r["compression"]) for r in rows if r["policy"] != "full"}
    ):
        here = [r for r in rows if r["length"] == length and r["policy"] == "full"]
        here += [r for r in rows if (r["length"], r["protocol"], r["compression"]) == (length, protocol, c)]
        bins = sorted({(r["depth_from"], r["depth_to"]) for r in here})
        names = list(dict.fromkeys(r["policy"] for r in here))
        score = {(r["policy"], r["depth_from"]): r["score"] for r in here}
        count = {r["depth_from"]: r["samples"] for r in here if r["policy"] == "full"}
        grid = [[score.get((p, b), math.nan) for b, _ in bins] for p in names]
        fig, ax = _heat_map(plt, grid, (0.9 * len(bins) + 3, 0.35 * len(names) + 1.8))
        labels = [f"{b:.0%}–{e:.0%}\n(n = {count.get(b, '–')})" for b, e in bins]
        ax.set_xticks(range(len(bins)), labels, fontsize=8)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("needle depth (share of the haystack before it)")
        ax.set_title(
            f"RULER {length} tokens, question-{protocol}, compression {c:g}: single needles by depth", fontsize=9
        )
        paths.append(str(save_figure(fig, folder / f"depth_{length}_{protocol}_c{c:g}.png")))
    return paths
