"""Sweeps on Ray (``--ray``): a local Ray and a two-node cluster give the in-process results cell by cell; a killed
worker's cell is retried and written once, a cell that always raises is stored with its error, a rerun computes
only the missing and failed cells, Ctrl-C cancels the running cells and keeps the finished ones.

Ray runs on the loopback interface only, in network namespaces of its own (tests/ray_support.py), on a tiny random
model with the real tokenizer and 64 tokens of real text: the workers start in seconds, a cell takes a second.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from ray_support import in_loopback

from kvsieve.cli import main
from kvsieve.evaluation.sweep import Settings, run_sweep

slow = pytest.mark.slow  # (starts Ray: a minute on a 2-core machine shared with other jobs)

POLICIES = ["full", "h2o", "local"]
BUDGETS = [0.25, 0.5]
TOKENS = 64


@pytest.fixture(scope="module")
def in_process(tiny_dir, tmp_path_factory) -> dict[tuple[str, float], dict[str, Any]]:
    """The grid computed in this process: (policy, budget) → row."""
    out = tmp_path_factory.mktemp("in_process")
    result = run_sweep(out, ["ppl"], POLICIES, BUDGETS, settings=Settings(model=tiny_dir, ppl_tokens=TOKENS))
    assert not any("error" in row for row in result.rows)
    return {(row["policy"], row["budget"]): row for row in result.rows}


def _sweep_args(tiny_dir: str, out: Path) -> list[str]:
    args = ["--model", tiny_dir, "--tasks", "ppl", "--ppl-tokens", str(TOKENS), "--out", str(out)]
    return [*args, "--policies", *POLICIES, "--budgets", *map(str, BUDGETS)]


def _same(rows: list[dict[str, Any]], in_process: dict[tuple[str, float], dict[str, Any]]) -> None:
    assert len(rows) == len(in_process)
    for row in rows:
        expected = in_process[row["policy"], row["budget"]]
        assert (row["ppl"], row["n"]) == (pytest.approx(expected["ppl"], rel=1e-6), expected["n"]), row


def _cells(out: Path) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in (out / "cells").glob("*.json")}


@slow
def test_a_two_node_cluster_runs_cells_on_both_nodes(tiny_dir, in_process, tmp_path) -> None:
    args = {"sweep": _sweep_args(tiny_dir, tmp_path)}
    run = in_loopback([sys.executable, str(Path(__file__).parents[1] / "ray_support.py"), "cluster", json.dumps(args)])
    assert run.returncode == 0, run.stderr[-3000:]
    sweep = json.loads(run.stdout.splitlines()[-1])
    assert sweep["returncode"] == 0, sweep["stderr"]
    _same(json.loads(sweep["stdout"])["rows"], in_process)
    nodes = [cell["node"] for cell in _cells(tmp_path).values()]
    assert len(nodes) == 5 and len(set(nodes)) == 2


@pytest.fixture(scope="module")
def local(tiny_dir, tmp_path_factory) -> dict[str, Any]:
    """The scenarios on one local Ray with two CPUs (tests/ray_support.py ``local``)."""
    work = tmp_path_factory.mktemp("local")
    args = {
        "work": str(work),
        "settings": {"model": tiny_dir, "ppl_tokens": TOKENS},
        "policies": POLICIES,
        "budgets": BUDGETS,
        "faults": {"ppl__h2o__r0.25": "kill", "ppl__local__r0.5": "raise"},
        "delete": "ppl__h2o__r0.5",
    }
    script = str(Path(__file__).parents[1] / "ray_support.py")
    run = in_loopback([sys.executable, script, "local", json.dumps(args)])
    assert run.returncode == 0, run.stderr[-3000:]
    return {**json.loads(run.stdout.splitlines()[-1]), "work": work}


@slow
def test_a_local_ray_gives_the_in_process_results(local, in_process, tiny_dir) -> None:
    plain = local["plain"]
    assert plain["computed"] == 5  # full once (the two 100 % cells share it) + 2 bounded policies × 2 budgets
    _same(plain["rows"], in_process)
    assert len(plain["cells"]) == 5 and all(len(cell["node"]) == 56 for cell in plain["cells"].values())  # (hex)
    assert {json.dumps(cell["settings"]) for cell in plain["cells"].values()} == {
        json.dumps(asdict(Settings(model=tiny_dir, ppl_tokens=TOKENS)))
    }
    # the same files as the in-process sweep: --report reads them without Ray
    assert main(["sweep", "--report", "--json", *_sweep_args(tiny_dir, local["work"] / "plain")]) == 0


@slow
def test_a_killed_worker_is_retried_and_its_cell_written_once(local, in_process) -> None:
    first = local["first"]
    tries = [key for key, _ in first["log"]]
    assert tries.count("ppl__h2o__r0.25") == 2  # killed, then retried
    assert sorted(first["writes"]) == sorted(set(first["writes"])) and len(first["writes"]) == 5
    row = next(r for r in first["rows"] if (r["policy"], r["budget"]) == ("h2o", 0.25))
    assert row["ppl"] == pytest.approx(in_process["h2o", 0.25]["ppl"], rel=1e-6)


@slow
def test_a_cell_that_always_raises_is_stored_failed_and_the_rest_complete(local, in_process) -> None:
    first = local["first"]
    assert [key for key, _ in first["log"]].count("ppl__local__r0.5") == 2  # max_retries=1: two attempts
    failed = [r for r in first["rows"] if "error" in r]
    assert [(r["policy"], r["budget"], r["error"]) for r in failed] == [
        ("local", 0.5, "ValueError: injected failure in ppl__local__r0.5")
    ]
    _same([r for r in first["rows"] if "error" not in r], {k: v for k, v in in_process.items() if k != ("local", 0.5)})


@slow
def test_a_rerun_computes_only_the_missing_and_failed_cells(local, in_process) -> None:
    rerun = local["rerun"]
    assert rerun["computed"] == 2
    assert sorted(rerun["writes"]) == sorted(key for key, _ in rerun["log"]) == ["ppl__h2o__r0.5", "ppl__local__r0.5"]
    _same(rerun["rows"], in_process)


@slow
def test_ctrl_c_cancels_the_running_cells_and_keeps_the_finished(local) -> None:
    interrupted = local["interrupted"]
    assert interrupted["raised"]
    assert interrupted["stored"] == interrupted["others"]  # every cell but the hanging one
    assert not interrupted["hung_worker_alive"]  # its task was cancelled: the worker process is gone


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpus-per-cell", "2"], "--cpus-per-cell needs --ray"),
        (["--ray", "--cpus-per-cell", "1.5"], "cpus-per-cell must be a fraction of 1 or a whole number, got 1.5"),
        (["--ray", "--gpus-per-cell", "2.5"], "gpus-per-cell must be a fraction of 1 or a whole number, got 2.5"),
        (["--ray", "--jobs", "2"], "give --jobs/--threads without it"),
        (["--ray", "auto", "--threads", "2"], "give --jobs/--threads without it"),
    ],
)
def test_ray_options_are_checked_before_anything_runs(tmp_path, capsys, no_model, args, message) -> None:
    assert main(["sweep", "--out", str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_reproduce_grids_hand_their_cells_to_ray(tmp_path, monkeypatch) -> None:
    from kvsieve.evaluation import ray_sweep
    from kvsieve.reproduce.experiments import Context, Grid

    sent = []

    def ray_cells(todo, settings, device, options, progress):
        sent.append(([(cell.policy, cell.budget) for cell in todo], options))
        for cell in todo:
            yield cell, {"ppl": 10 + cell.budget, "n": 63}, 0.5, "node-a"

    monkeypatch.setattr(ray_sweep, "ray_cells", ray_cells)
    options = ray_sweep.RayOptions(cpus_per_cell=2)
    part = Grid("grid", "a grid", ["ppl"], ["h2o"], [0.1, 0.2]).run(
        Context(out=tmp_path, model_name="m", progress=False, ray=options)
    )
    assert sent == [([("h2o", 0.1), ("h2o", 0.2)], options)]
    assert part.computed == 2 and [row["ppl"] for row in part.rows] == [10.1, 10.2]
    assert json.loads((tmp_path / "grid/cells/ppl__h2o__r0.1.json").read_text())["node"] == "node-a"
