"""The papers' claims checked on a RULER grid (:mod:`kvsieve.ruler.claims`): each check against hand-computed
averages, claims a grid cannot decide reported as not evaluated, and the claims in a grid's report and a page's
results block."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kvsieve.reproduce.claims import Results
from kvsieve.results import render
from kvsieve.ruler.claims import below_full, claims, close_to_full, markdown
from kvsieve.ruler.report import write_report
from kvsieve.ruler.scoring import task_average

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")


def row(policy: str, score: float, stderr: float | None, task: str, protocol: str = "aware", c: float = 0.75) -> dict:
    full = policy == "full"
    return {
        "task": task,
        "length": 4096,
        "protocol": "both" if full else protocol,
        "policy": policy,
        "compression": 0.0 if full else c,
        "samples": 4,
        "score": score,
        "stderr": stderr,
    }


def grid(scores: dict[tuple[str, float], float], stderr: float | None = 10.0) -> list[dict[str, Any]]:
    """The full cache at 100 ± 0 on the three single-needle tasks, each (policy, compression) at its score on each
    task, under both protocols."""
    rows = [row("full", 100.0, 0.0 if stderr is not None else None, t) for t in TASKS]
    for (policy, c), score in scores.items():
        rows += [row(policy, score, stderr, t, protocol, c) for t in TASKS for protocol in ("aware", "agnostic")]
    return rows


def holds(check, rows) -> bool:
    return check(Results({"ruler": rows})).holds


def test_task_average_and_its_standard_error_by_hand() -> None:
    rows = [{"score": 70.0, "stderr": 10.0}] * 3
    mean, se = task_average(rows)
    assert (mean, se) == (70.0, pytest.approx(math.sqrt(300) / 3))  # 5.77
    assert task_average([*rows, {"score": 30.0, "stderr": None}]) == (60.0, None)


@pytest.mark.parametrize(("score", "expected"), [(95.0, True), (94.9, False)])
def test_close_to_full_is_at_most_five_points_below(score: float, expected: bool) -> None:
    rows = grid({("h2o", 0.75): score})
    assert holds(close_to_full(4096, "h2o", "aware", 0.75), rows) is expected


def test_close_to_full_names_both_averages_and_the_gap() -> None:
    outcome = close_to_full(4096, "h2o", "agnostic", 0.75)(Results({"ruler": grid({("h2o", 0.75): 80.0})}))
    assert outcome.number == "h2o 80.0 ± 5.8 vs full 100.0 ± 0.0 (−20.0)"


@pytest.mark.parametrize(("score", "expected"), [(88.0, True), (89.0, False)])
def test_below_full_needs_more_than_two_standard_errors_of_the_difference(score: float, expected: bool) -> None:
    # by hand: the difference's error is √(0² + 5.77²) = 5.77, so "below" needs a gap over 11.55 points
    rows = grid({("streaming_llm", 0.25): score, ("streaming_llm", 0.75): 30.0})
    assert holds(below_full(4096, "streaming_llm", "aware", TASKS), rows) is expected


def test_below_full_needs_a_standard_error() -> None:
    rows = grid({("streaming_llm", 0.75): 30.0}, stderr=None)
    evaluated = {(c.source, c.setting): c.evaluate(Results({"ruler": rows})) for c in claims(4096)}
    streaming = [v for (source, _), v in evaluated.items() if source.startswith("StreamingLLM")]
    assert all(v["holds"] is None and "no standard error" in v["missing"] for v in streaming)


def test_ahakv_at_least_h2o_at_every_compression() -> None:
    rows = grid({("ahakv", 0.25): 80.0, ("h2o", 0.25): 70.0, ("ahakv", 0.75): 40.0, ("h2o", 0.75): 40.0})
    verdicts = {c.setting: c.evaluate(Results({"ruler": rows})) for c in claims(4096) if c.source.startswith("AhaKV")}
    assert [v["holds"] for v in verdicts.values()] == [True, True]
    worse = [r | {"score": 39.9} if (r["policy"], r["compression"]) == ("ahakv", 0.75) else r for r in rows]
    verdicts = [c.evaluate(Results({"ruler": worse})) for c in claims(4096) if c.source.startswith("AhaKV")]
    assert [v["holds"] for v in verdicts] == [False, False]
    assert "0.25: 80.0 ± 5.8 vs 70.0 ± 5.8; 0.75: 39.9 ± 5.8 vs 40.0 ± 5.8" in verdicts[0]["number"]


def test_a_claim_whose_cells_are_missing_is_not_evaluated() -> None:
    rows = grid({("h2o", 0.75): 90.0})
    rows = [r for r in rows if not (r["policy"] == "h2o" and r["task"] == "niah_single_3")]
    (h2o, *_) = (c.evaluate(Results({"ruler": rows})) for c in claims(4096))
    assert h2o["holds"] is None and h2o["missing"] == "h2o (aware, compression 0.75): 2 of 3 tasks at 4,096 tokens"


def test_the_claims_in_the_report_and_in_a_results_block(tmp_path) -> None:
    (tmp_path / "cells").mkdir()
    for r in grid({("h2o", 0.75): 90.0, ("streaming_llm", 0.75): 30.0}):
        scores = {"full": [1, 1], "h2o": [1, 0.8], "streaming_llm": [0, 0.6]}[r["policy"]]
        settings = {k: r[k] for k in ("task", "length", "policy", "compression")}
        settings["protocol"] = "aware" if r["policy"] == "full" else r["protocol"]
        predictions = {str(i): {"score": s, "first_token_s": 1.0, "total_s": 2.0} for i, s in enumerate(scores)}
        name = f"{r['task']}_{settings['protocol']}_{r['policy']}_{r['compression']}.json"
        (tmp_path / "cells" / name).write_text(json.dumps({"settings": settings, "predictions": predictions}))
    rows = write_report(tmp_path)["rows"]
    # by hand: h2o 90 ± 10 on each task → 90 ± 5.8, 10 points below full; streaming_llm 30 ± 30 → 30 ± 17.3, the gap
    # 70 is 4.0 of its standard errors
    table = markdown(rows)
    assert table.startswith("4,096 tokens: 2 of 8 claims hold (4 not evaluated).")
    assert "h2o 90.0 ± 5.8 vs full 100.0 ± 0.0 (−10.0) | no |" in table
    assert "0.75: 30.0 ± 17.3 (4.0 se below) | yes |" in table
    assert "## The papers' claims\n\n" + table in (tmp_path / "results.md").read_text()
    page = render("<!-- results: . claims -->\n<!-- /results -->", tmp_path)
    assert page == "<!-- results: . claims -->\n" + table + "\n<!-- /results -->"
