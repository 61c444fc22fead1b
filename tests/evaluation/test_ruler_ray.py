"""``kvsieve ruler --ray``: each sample with settings still to answer is one Ray task, and the cells written are those
of an in-process run; a failed sample stores nothing and the command names it; the ``--ray`` options are checked
before anything runs.

The grid: niah_single_1 and vt at 256 tokens, 2 samples, full plus h2o at 0.5 under both protocols, answers capped
at 3 tokens, on a tiny random Llama with the real tokenizer saved as a model directory (``tiny_dir`` of
tests/conftest.py). The Ray tasks run in this process through a fake of ``ray_sweep.ray_tasks``, and once on a real
local Ray in a loopback-only network namespace (tests/ray_support.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_support import in_loopback

import kvsieve.ruler.predict as ruler_predict
import kvsieve.ruler.run as ruler_run
from kvsieve.cli import main
from kvsieve.evaluation import ray_sweep
from kvsieve.evaluation.ray_sweep import RayOptions
from kvsieve.models import load_model
from kvsieve.ruler.run import GridSettings, grid_settings, run_ruler

TASKS = ["niah_single_1", "vt"]
LENGTH = 256
SAMPLES = 2
SETTINGS = grid_settings(["full", "h2o"], [0.5], ["agnostic", "aware"])
KEYS = [s.key for s in SETTINGS]  # full, agnostic_h2o_c0.5, aware_h2o_c0.5
CAP = 3


def _cap(task: str) -> int:
    return CAP


@pytest.fixture(scope="module")
def sources() -> ruler_run.Sources:
    return ruler_run.sources(with_reading=False)  # (what the command gives these tasks)


@pytest.fixture(scope="module")
def in_process(tiny_dir, sources, tmp_path_factory) -> dict[str, Any]:
    """The tiny model as a worker loads it, its grid settings, and the grid answered in this process."""
    model, tokenizer = load_model(tiny_dir, device="cpu")
    grid = GridSettings(model=tiny_dir, dtype="float32", seed=0, haystack="wikipedia")
    out = tmp_path_factory.mktemp("in_process")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ruler_predict, "max_new_tokens", _cap)
        run_ruler(model, tokenizer, out, lambda: sources, grid, TASKS, [LENGTH], SETTINGS, SAMPLES, progress=False)
    return {"model": model, "tokenizer": tokenizer, "grid": grid, "out": out}


def _answers(out: Path) -> dict[str, Any]:
    """Cell file → its settings and each sample's answer (text, score, tokens; not the timings)."""
    found = {}
    for path in sorted((out / "cells").glob("*.json")):
        cell = json.loads(path.read_text())
        kept = {i: {k: p[k] for k in ("text", "score", "answer_tokens")} for i, p in cell["predictions"].items()}
        found[path.name] = {"settings": cell["settings"], "predictions": kept}
    return found


def _fake_ray(monkeypatch, model, tokenizer) -> dict[str, Any]:
    """``ray_sweep.ray_tasks`` run in this process: each submission's units as (task, length, sample, setting keys)
    and its other arguments, the models the tasks asked for; the tasks of the samples (task, index) in ``fail``
    fail."""
    seen: dict[str, Any] = {"units": [], "models": [], "calls": [], "fail": set()}

    def ray_tasks(function, calls, options, running) -> Iterator[tuple[int, Any, BaseException | None]]:
        seen["units"].append([(c[3].task, c[3].length, c[3].index, [s.key for s in c[5]]) for c in calls])
        seen["calls"].append([(c[0], c[1], c[2], options) for c in calls])
        running(1)
        for index, args in enumerate(calls):
            if (args[3].task, args[3].index) in seen["fail"]:
                yield index, None, ValueError("injected failure")
            else:
                yield index, function(*args), None

    def worker_model(name, dtype, device):
        seen["models"].append((name, dtype, device))
        return model, tokenizer

    monkeypatch.setattr(ray_sweep, "ray_tasks", ray_tasks)
    monkeypatch.setattr(ruler_run, "_worker_model", worker_model)
    monkeypatch.setattr(ruler_predict, "max_new_tokens", _cap)
    return seen


def test_ray_units_are_the_samples_with_pending_settings_and_give_the_in_process_cells(
    in_process, sources, tmp_path, monkeypatch
) -> None:
    model, tokenizer, grid = in_process["model"], in_process["tokenizer"], in_process["grid"]
    seen = _fake_ray(monkeypatch, model, tokenizer)
    options = RayOptions(cpus_per_cell=2)

    def run() -> None:
        args = (TASKS, [LENGTH], SETTINGS, SAMPLES)
        run_ruler(None, tokenizer, tmp_path, lambda: sources, grid, *args, progress=False, ray=options, device="cpu")

    run()
    assert seen["units"] == [[(t, LENGTH, i, KEYS) for i in range(SAMPLES) for t in TASKS]]  # (sample-major)
    assert seen["calls"] == [[(grid, "cpu", 2, options)] * 4]  # (threads: the task's CPUs)
    assert seen["models"] == [(grid.model, "float32", "cpu")] * 4
    assert _answers(tmp_path) == _answers(in_process["out"])

    # answers deleted: one sample of one cell, a whole cell; exactly the samples lacking them are sent, with those
    one = tmp_path / "cells" / f"vt_{LENGTH}_aware_h2o_c0.5.json"
    cell = json.loads(one.read_text())
    del cell["predictions"]["1"]
    one.write_text(json.dumps(cell))
    (tmp_path / "cells" / f"niah_single_1_{LENGTH}_full.json").unlink()
    run()
    assert seen["units"][1] == [
        ("niah_single_1", LENGTH, 0, ["full"]),
        ("niah_single_1", LENGTH, 1, ["full"]),
        ("vt", LENGTH, 1, ["aware_h2o_c0.5"]),
    ]
    assert _answers(tmp_path) == _answers(in_process["out"])

    run()  # a complete grid: no task, and no Ray
    assert len(seen["units"]) == 2


def _ruler(out: Path, *extra: str) -> list[str]:
    args = ["ruler", "--out", str(out), "--tasks", *TASKS, "--lengths", str(LENGTH), "--samples", str(SAMPLES)]
    return [*args, "--policies", "full", "h2o", "--compressions", "0.5", "--protocols", "agnostic", "aware", *extra]


def test_a_failed_sample_stores_nothing_and_the_command_reports_the_rest_then_names_it(
    in_process, tmp_path, capsys, monkeypatch
) -> None:
    model, tokenizer = in_process["model"], in_process["tokenizer"]
    loads, tokenizers = [], []
    monkeypatch.setattr("kvsieve.models.load_model", lambda *a, **k: loads.append(k) or (model, tokenizer))
    monkeypatch.setattr("kvsieve.models.load_tokenizer", lambda name: tokenizers.append(name) or tokenizer)
    seen = _fake_ray(monkeypatch, model, tokenizer)
    seen["fail"].add(("vt", 1))
    argv = _ruler(tmp_path, "--model", in_process["grid"].model, "--device", "cuda:1", "--json")
    assert main([*argv, "--ray", "auto", "--max-retries", "0"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error.startswith("1 sample(s) failed after their retries, nothing stored for them")
    assert error.endswith(": vt 256 #1; the first error: ValueError: injected failure")
    assert loads == [] and tokenizers == [in_process["grid"].model]  # this process: the tokenizer alone
    assert {device for *_, device in seen["models"]} == {"cuda:1"}
    assert seen["calls"][0][0][3] == RayOptions(address="auto", max_retries=0)
    rows = json.loads((tmp_path / "results.json").read_text())  # the report of what finished
    assert {(r["task"], r["samples"]) for r in rows} == {("niah_single_1", 2), ("vt", 1)}
    expected = _answers(in_process["out"])
    for name in [n for n in expected if n.startswith("vt")]:
        del expected[name]["predictions"]["1"]
    assert _answers(tmp_path) == expected

    seen["fail"].clear()
    assert main([*argv, "--ray"]) == 0  # the rerun computes the failed sample, under every setting
    assert seen["units"][1] == [("vt", LENGTH, 1, KEYS)]
    assert json.loads(capsys.readouterr().out)["rows"] == json.loads((tmp_path / "results.json").read_text())
    assert _answers(tmp_path) == _answers(in_process["out"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpus-per-cell", "2"], "--cpus-per-cell needs --ray"),
        (["--max-retries", "1"], "--max-retries needs --ray"),
        (["--ray", "--cpus-per-cell", "1.5"], "cpus-per-cell must be a fraction of 1 or a whole number, got 1.5"),
        (["--ray", "--gpus-per-cell", "2.5"], "gpus-per-cell must be a fraction of 1 or a whole number, got 2.5"),
        (["--ray", "auto", "--threads", "2"], "each sample is a task with --cpus-per-cell threads: give --threads"),
        (["--ray", "--max-retries", "-1"], "expected an integer >= 0, got '-1'"),
    ],
)
def test_ray_options_are_checked_before_anything_runs(tmp_path, capsys, no_model, args, message) -> None:
    assert main(["ruler", "--out", str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


# A driver in the loopback namespace: a local Ray of two CPUs whose workers cap the answers and log each model load
# (process id), then the command with --ray (it joins that Ray).
DRIVER = """
import os, sys, ray
log, cap = sys.argv[1], int(sys.argv[2])

def worker_setup():
    import kvsieve.models
    import kvsieve.ruler.predict as predict
    predict.max_new_tokens = lambda task: cap
    load = kvsieve.models.load_model
    def logged(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        return load(*args, **kwargs)
    kvsieve.models.load_model = logged

ray.init(address="local", num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False,
         logging_level="WARNING", log_to_driver=False, runtime_env={"worker_process_setup_hook": worker_setup})
from kvsieve.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_a_local_ray_gives_the_in_process_cells(in_process, tmp_path) -> None:
    out, log = tmp_path / "out", tmp_path / "loads.log"
    argv = _ruler(out, "--model", in_process["grid"].model, "--ray", "--json")
    run = in_loopback([sys.executable, "-c", DRIVER, str(log), str(CAP), *argv])
    assert run.returncode == 0, run.stderr[-3000:]
    assert _answers(out) == _answers(in_process["out"])
    pids = log.read_text().split()
    assert 1 <= len(pids) <= 2 and len(set(pids)) == len(pids)  # (4 tasks; a worker loads the model once)
