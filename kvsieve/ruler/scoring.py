"""RULER's scoring: string-match recall of the expected answers in the model's answer (Hsieh et al., 2024).

A sample scores the share of its answers that occur in the prediction, case-insensitively (``all``: needle tasks,
variable tracking, cwe, fwe); the QA task scores 1 when any of its acceptable answers occurs (``part``). A task's
score is the mean over its samples, in percent, reported with the standard error of that mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MATCH", "mean_and_stderr", "plus_minus", "score", "task_average"]

MATCH = {"qa": "part"}
"""Task → how its answers are matched (``all`` unless named here)."""


def score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """The sample's score in [0, 1]: the share of ``answers`` found in ``prediction`` (``all``), or whether any is
    (``part``); matching ignores case."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    text = prediction.lower()
    found = [answer.lower() in text for answer in answers]
    return float(any(found)) if MATCH.get(task, "all") == "part" else sum(found) / len(found)


def mean_and_stderr(scores: Sequence[float]) -> tuple[float, float | None]:
    """The mean of ``scores`` and its standard error (sample standard deviation / √n; None for one score, which has
    none), in percent."""
    if not scores:
        raise ValueError("no scores")
    n = len(scores)
    mean = sum(scores) / n
    if n == 1:
        return 100 * mean, None
    variance = sum((s - mean) ** 2 for s in scores) / (n - 1)
    return 100 * mean, 100 * math.sqrt(variance / n)


def plus_minus(mean: float, stderr: float | None, digits: int = 1) -> str:
    """``mean ± stderr`` to ``digits`` decimals; ``± –`` where there is no standard error (one sample)."""
    return f"{mean:.{digits}f} ± " + ("–" if stderr is None else f"{stderr:.{digits}f}")


def task_average(rows: Sequence[Mapping[str, Any]]) -> tuple[float, float | None]:
    """The mean of task scores (rows with ``score`` and ``stderr`` in percent) and its standard error, that of a mean
    of independent means: √Σse² / T (None if a task has none: one sample)."""
    mean = sum(r["score"] for r in rows) / len(rows)
    if any(r["stderr"] is None for r in rows):
        return mean, None
    return mean, math.sqrt(sum(r["stderr"] ** 2 for r in rows)) / len(rows)
