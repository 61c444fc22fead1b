"""The papers' headline claims checked on a RULER grid (:func:`claims`; :func:`markdown`: one table per length).

Each claim is a :class:`~kvsieve.reproduce.claims.Claim` whose check reads the grid's rows
(:func:`~kvsieve.ruler.report.collect`): averages over the grid's tasks with their standard errors
(:func:`~kvsieve.ruler.scoring.task_average`), every row of a task computed on the same samples. A check needs
every task the full cache answered at that length; a cell still missing makes its claim "not evaluated".

Choices, where the papers' settings and RULER's differ:

- **A 20 % budget** (H2O, Scissorhands' "5× compression") is read at compression 0.75: a quarter kept, the grid's
  nearest point and the one keeping more — the lenient reading.
- **Within a few points** of the full cache: at most :data:`CLOSE` points below its average (as
  :mod:`kvsieve.reproduce` reads the papers' accuracy claims).
- **At least as accurate** (AhaKV vs H2O): a mean not below the other's at every compression of the grid.
- **StreamingLLM loses retrieval** (its cache keeps the attention sinks and the latest tokens; what lies between is
  gone): on the single-needle tasks, its average is below the full cache's by more than :data:`SIGNIFICANT` standard
  errors of the difference (√(se₁² + se₂²): the samples are shared, so this overstates the difference's error) at
  every compression.

Each claim is checked under both protocols (:data:`~kvsieve.evaluation.defaults.QUESTION_MODES`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvsieve.evaluation.defaults import QUESTION_MODES
from kvsieve.reproduce.claims import Check, Claim, Missing, Outcome, Results, claims_table, signed
from kvsieve.ruler.scoring import plus_minus, task_average

__all__ = ["CLOSE", "RETRIEVAL", "SIGNIFICANT", "at_least", "below_full", "claims", "close_to_full", "markdown"]

PART = "ruler"
FIFTH = 0.75
"""The grid's compression read as the papers' 20 % budget."""
CLOSE = 5.0
"""'Within a few points': at most this many points below."""
SIGNIFICANT = 2.0
"""'Below': by more than this many standard errors of the difference."""
RETRIEVAL = ("niah_single_1", "niah_single_2", "niah_single_3")
"""The tasks whose answer is one needle retrieved from the context."""


def _mean(
    results: Results, length: int, policy: str, protocol: str = "", compression: float = 0.0, tasks: Sequence[str] = ()
) -> tuple[float, float | None]:
    """``policy``'s average over ``tasks`` (default: those the full cache answered at ``length``) and its standard
    error (None at one sample); :class:`~kvsieve.reproduce.claims.Missing` unless every task has its row."""
    expected = list(tasks) or sorted({r["task"] for r in results.rows(PART, length=length, policy="full")})
    where: dict[str, Any] = {"length": length, "policy": policy}
    if policy != "full":
        where |= {"protocol": protocol, "compression": compression}
    rows = [r for r in results.rows(PART, **where) if r["task"] in expected]
    shown = "full" if policy == "full" else f"{policy} ({protocol}, compression {compression:g})"
    if not expected or len(rows) < len(expected):
        raise Missing(f"{shown}: {len(rows)} of {len(expected) or 'the'} tasks at {length:,} tokens")
    return task_average(rows)


def _compressions(results: Results, length: int, protocol: str, policy: str) -> list[float]:
    found = sorted({r["compression"] for r in results.rows(PART, length=length, protocol=protocol, policy=policy)})
    if not found:
        raise Missing(f"{policy}: no {protocol} cells at {length:,} tokens")
    return found


def close_to_full(length: int, policy: str, protocol: str, compression: float) -> Check:
    """``policy``'s average at ``compression`` is at most :data:`CLOSE` points below the full cache's."""

    def check(results: Results) -> Outcome:
        mine, full = _mean(results, length, policy, protocol, compression), _mean(results, length, "full")
        number = f"{policy} {plus_minus(*mine)} vs full {plus_minus(*full)} ({signed(mine[0] - full[0], 1)})"
        return Outcome(number, mine[0] >= full[0] - CLOSE)

    return check


def at_least(length: int, policy: str, rival: str, protocol: str) -> Check:
    """At every compression of the grid, ``policy``'s average is not below ``rival``'s."""

    def check(results: Results) -> Outcome:
        parts, holds = [], True
        for c in _compressions(results, length, protocol, policy):
            mine, theirs = (_mean(results, length, p, protocol, c) for p in (policy, rival))
            holds &= mine[0] >= theirs[0]
            parts.append(f"{c:g}: {plus_minus(*mine)} vs {plus_minus(*theirs)}")
        return Outcome(f"{policy} vs {rival}, " + "; ".join(parts), holds)

    return check


def below_full(length: int, policy: str, protocol: str, tasks: Sequence[str]) -> Check:
    """At every compression of the grid, ``policy``'s average over ``tasks`` is below the full cache's by more than
    :data:`SIGNIFICANT` standard errors of the difference."""

    def check(results: Results) -> Outcome:
        full = _mean(results, length, "full", tasks=tasks)
        parts, holds = [f"full {plus_minus(*full)}"], True
        for c in _compressions(results, length, protocol, policy):
            mine = _mean(results, length, policy, protocol, c, tasks)
            if full[1] is None or mine[1] is None:
                raise Missing(f"{policy} ({protocol}, compression {c:g}): one sample, no standard error")
            gap, error = full[0] - mine[0], math.hypot(full[1], mine[1])
            holds &= gap > SIGNIFICANT * error
            below = f" ({gap / error:.1f} se below)" if error else ""
            parts.append(f"{c:g}: {plus_minus(*mine)}{below}")
        return Outcome(f"{policy} on {', '.join(tasks)}: " + "; ".join(parts), holds)

    return check


def claims(length: int) -> list[Claim]:
    """The claims at ``length`` tokens, each under both protocols."""

    def where(protocol: str) -> str:
        return f"RULER {length:,} tokens, question-{protocol}"

    each: list[tuple[str, str, Callable[[str], str], Callable[[str], Check]]] = [
        (
            "H2O Fig. 4",
            "at a 20% budget h2o's accuracy stays within a few points of the full cache's",
            lambda p: (
                f"{where(p)}, average over the tasks at compression {FIFTH:g} (a quarter kept); within {CLOSE:g} points"
            ),
            lambda p: close_to_full(length, "h2o", p, FIFTH),
        ),
        (
            "Scissorhands §5 (downstream tasks)",
            "at a 20% budget (5× compression) scissorhands keeps the full cache's accuracy",
            lambda p: f"{where(p)}, average over the tasks at compression {FIFTH:g} (4×); within {CLOSE:g} points",
            lambda p: close_to_full(length, "scissorhands", p, FIFTH),
        ),
        (
            "AhaKV (LongBench)",
            "ahakv is at least as accurate as h2o at the same budget",
            lambda p: f"{where(p)}, average over the tasks at each compression (ahakv vs h2o)",
            lambda p: at_least(length, "ahakv", "h2o", p),
        ),
        (
            "StreamingLLM (FAQ)",
            "the cache holds the attention sinks and the latest tokens only: a needle between them is lost",
            lambda p: (
                f"{where(p)}, the single-needle tasks; below the full cache by more than {SIGNIFICANT:g} "
                "standard errors at each compression"
            ),
            lambda p: below_full(length, "streaming_llm", p, RETRIEVAL),
        ),
    ]
    return [
        Claim(source, statement, setting(p), check(p))
        for source, statement, setting, check in each
        for p in QUESTION_MODES
    ]


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Per length of ``rows`` (:func:`~kvsieve.ruler.report.collect`), the claims table and how many hold."""
    results, lines = Results({PART: rows}), []
    for length in sorted({r["length"] for r in rows}):
        evaluated = [c.evaluate(results) for c in claims(length)]
        held = sum(c["holds"] is True for c in evaluated)
        pending = sum(c["holds"] is None for c in evaluated)
        lines += [f"{length:,} tokens: {held} of {len(evaluated)} claims hold"
                  + (f" ({pending} not evaluated)." if pending else "."), "", claims_table(evaluated)]  # fmt: skip
    return "\n".join(lines)
