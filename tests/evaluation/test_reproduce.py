"""``kvsieve reproduce``: the claims' predicates on synthetic numbers (both outcomes, and not evaluated), the papers'
plans, resumable cells, one-line errors before anything is written, and each paper's ``--quick`` run on the real
model (``slow``): files, one computed verdict per claim, the page a ``--json`` result renders, a second run that
computes nothing, ``--report``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvsieve.cli import main
from kvsieve.reproduce import PAPERS, claims
from kvsieve.reproduce.ahakv import ablation_specs
from kvsieve.reproduce.claims import Claim, Missing, Results, claims_table, tally
from kvsieve.reproduce.experiments import CellExperiment, Context
from kvsieve.reproduce.runner import check_plan, load_plan
from kvsieve.results import command_line, render_file


def _ppl_rows(values: dict[tuple[str, float], float]) -> list[dict[str, Any]]:
    return [{"task": "ppl", "policy": p, "budget": b, "ppl": v} for (p, b), v in values.items()]


def _holds(check: claims.Check, parts: dict[str, list[dict[str, Any]]]) -> bool | None:
    return Claim("src", "statement", "setting", check).evaluate(Results(parts))["holds"]


def test_beats_both_outcomes_and_missing() -> None:
    check = claims.beats("g", "h2o", ["h2o:recent=0", "local"], [0.1, 0.2])
    good = {("h2o", 0.1): 20.0, ("h2o:recent=0", 0.1): 25.0, ("local", 0.1): 40.0}
    good |= {("h2o", 0.2): 19.0, ("h2o:recent=0", 0.2): 22.0, ("local", 0.2): 30.0}
    assert _holds(check, {"g": _ppl_rows(good)}) is True
    assert _holds(check, {"g": _ppl_rows(good | {("local", 0.2): 18.5})}) is False
    assert _holds(check, {"g": _ppl_rows(good | {("h2o", 0.2): 22.0})}) is False  # a tie is not "beats"
    assert _holds(
        claims.beats("g", "h2o", ["h2o:recent=0"], [0.2], strict=False), {"g": _ppl_rows(good | {("h2o", 0.2): 22.0})}
    )
    del good["local", 0.1]
    evaluated = Claim("s", "t", "u", check).evaluate(Results({"g": _ppl_rows(good)}))
    assert evaluated["holds"] is None and "local" in evaluated["missing"] and evaluated["number"] == "—"


def test_a_failed_or_missing_cell_is_not_evaluated() -> None:
    rows = [*_ppl_rows({("h2o", 0.2): 20.0}), {"task": "ppl", "policy": "local", "budget": 0.2, "missing": True}]
    assert _holds(claims.beats("g", "h2o", ["local"], [0.2]), {"g": rows}) is None
    rows[-1] = {"task": "ppl", "policy": "local", "budget": 0.2, "error": "ValueError: budget"}
    with pytest.raises(Missing, match="failed"):
        Results({"g": rows}).value("g", "ppl", task="ppl", policy="local", budget=0.2)
    assert _holds(claims.beats("g", "h2o", ["local"], [0.2]), {}) is None  # the part was never run


def test_pairs_beat_and_ppl_within() -> None:
    values = {("h2o+strided", 0.1): 21.0, ("strided", 0.1): 40.0, ("h2o+fixed", 0.1): 22.0, ("fixed", 0.1): 90.0}
    check = claims.pairs_beat("g", [("h2o+strided", "strided"), ("h2o+fixed", "fixed")], [0.1])
    assert _holds(check, {"g": _ppl_rows(values)}) is True
    assert _holds(check, {"g": _ppl_rows(values | {("fixed", 0.1): 21.0})}) is False
    within = claims.ppl_within("g", "scissorhands", "full", [0.2], 1.05)
    assert _holds(within, {"g": _ppl_rows({("scissorhands", 0.2): 20.4, ("full", 0.2): 19.5})}) is True
    assert _holds(within, {"g": _ppl_rows({("scissorhands", 0.2): 20.6, ("full", 0.2): 19.5})}) is False


def test_accuracy_close() -> None:
    def rows(h2o: float) -> list[dict[str, Any]]:
        return [
            {"task": t, "policy": p, "budget": 0.2, "acc": v, "n": 20}
            for t in ("a", "b")
            for p, v in (("full", 0.6), ("h2o", h2o))
        ]

    check = claims.accuracy_close("mc", "h2o", "full", 0.2, ["a", "b"], 0.05)
    assert _holds(check, {"mc": rows(0.55)}) is True
    assert _holds(check, {"mc": rows(0.54)}) is False
    assert _holds(claims.accuracy_close("mc", "h2o", "full", 0.2, ["a", "b"], 0.0), {"mc": rows(0.6)}) is True


def test_main_effect_of_a_factorial_ablation() -> None:
    specs = ablation_specs()
    assert len(set(specs.values())) == 8 and specs[True, True, True] == "ahakv"

    def rows(effects: tuple[float, float, float]) -> list[dict[str, Any]]:
        return _ppl_rows(
            {
                (spec, 0.2): 20 + sum(e for e, on in zip(effects, combo, strict=True) if on)
                for combo, spec in specs.items()
            }
        )

    parts = {"t": rows((-1.0, -0.5, 0.3))}
    assert [_holds(claims.main_effect("t", c, specs, i, [0.2]), parts) for i, c in enumerate("ABC")] == [
        True,
        True,
        False,
    ]


def test_rolling_and_memory_flat() -> None:
    def run(policy: str, size: int, ppl: float, rss: list[float], kv: list[int]) -> dict[str, Any]:
        curve = [
            {"tokens": i, "ppl": ppl, "rss_mb": r, "kv_bytes": k} for i, (r, k) in enumerate(zip(rss, kv, strict=True))
        ]
        return {"policy": policy, "size": size, "ppl": ppl, "curve": curve}

    flat = [run("h2o", 128, 20.0, [1200, 1250, 1210], [5, 5, 5]), run("streaming_llm", 128, 21.0, [1200] * 3, [5] * 3)]
    assert _holds(claims.rolling_at_most("r", "h2o", "streaming_llm", [128]), {"r": flat}) is True
    assert _holds(claims.rolling_at_most("r", "streaming_llm", "h2o", [128]), {"r": flat}) is False
    memory = claims.memory_flat("r", ["h2o", "streaming_llm"], [128], 0.10)
    assert _holds(memory, {"r": flat}) is True
    assert _holds(memory, {"r": [flat[0], run("streaming_llm", 128, 21.0, [1200, 1300, 1400], [5] * 3)]}) is False
    assert _holds(memory, {"r": [flat[0], run("streaming_llm", 128, 21.0, [1200] * 3, [5, 6, 7])]}) is False


def test_layer_share_most_and_almost_all() -> None:
    row = {"values": [0.99] * 6 + [0.5] * 4}
    assert _holds(claims.layer_share("a", lambda r: r["values"], 0.95, claims.MOST, "x"), {"a": [row]}) is True
    assert _holds(claims.layer_share("a", lambda r: r["values"], 0.95, claims.ALMOST_ALL, "x"), {"a": [row]}) is False
    row = {"values": [0.99] * 9 + [0.5, math.nan]}  # undefined layers are left out
    assert _holds(claims.layer_share("a", lambda r: r["values"], 0.95, claims.ALMOST_ALL, "x"), {"a": [row]}) is True
    assert (
        _holds(claims.layer_share("a", lambda r: r["values"], 0.95, claims.MOST, "x"), {"a": [{"values": [0.5] * 3}]})
        is False
    )


def test_power_law_and_entropy() -> None:
    ranks = range(1, 101)
    law = {"exponent": 0.7, "r2": 0.9, "sorted_mean": [r**-0.7 for r in ranks]}
    assert _holds(claims.power_law("p", 0.8), {"p": [law]}) is True
    assert _holds(claims.power_law("p", 0.8), {"p": [law | {"r2": 0.5}]}) is False
    uniform = [math.log(i) for i in range(1, 101)]
    assert _holds(claims.entropy_grows("e", 0.9), {"e": [{"mean": [0.5 * u for u in uniform], "uniform": uniform}]})
    falling = {"mean": [3 - 0.5 * u for u in uniform], "uniform": uniform}
    assert _holds(claims.entropy_grows("e", 0.9), {"e": [falling]}) is False


def test_less_at_start_and_needle() -> None:
    rows = [
        {"policy": "ahakv", "first_share": 0.05, "mean_position": 0.7},
        {"policy": "h2o", "first_share": 0.2, "mean_position": 0.6},
    ]
    assert _holds(claims.less_at_start("k", "ahakv", "h2o"), {"k": rows}) is True
    assert _holds(claims.less_at_start("k", "h2o", "ahakv"), {"k": rows}) is False

    def cells(policy: str, correct: list[int]) -> list[dict[str, Any]]:
        return [{"policy": policy, "depth": d / 4, "correct": c, "trials": 3} for d, c in enumerate(correct)]

    needle = {"n": cells("ahakv", [3, 2, 3]) + cells("h2o", [3, 1, 3])}
    assert _holds(claims.needle_at_least("n", "ahakv", ["h2o"]), needle) is True
    assert _holds(claims.needle_at_least("n", "h2o", ["ahakv"]), needle) is False


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("paper", list(PAPERS))
def test_plans_are_consistent(paper: str, quick: bool) -> None:
    plan = load_plan(paper, quick)
    check_plan(plan)  # every policy spec is known, its parameters parse; names unique
    names = {e.name for e in plan.experiments}
    for claim in plan.claims:
        row = claim.evaluate(Results({}))
        assert row["holds"] is None and row["missing"].split(":")[0] in names, claim
    table = claims_table([c.evaluate(Results({})) for c in plan.claims])
    assert table.count("\n| **") == len(plan.claims) and table.count("not evaluated") == len(plan.claims)


class _Toy(CellExperiment):
    name, title, protocol = "toy", "a toy", "stream"

    def __init__(self, fail: bool = False, scale: int = 1) -> None:
        self.calls: list[int] = []
        self.fail, self.scale = fail, scale

    def cells(self) -> list[tuple[str, dict[str, Any]]]:
        return [(f"cells/{i}.json", {"i": i}) for i in range(3)]

    def settings(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def compute(self, ctx: Context, params: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(params["i"])
        if self.fail and params["i"] == 1:
            raise ValueError("too small")
        return {"value": params["i"] * self.scale}

    def rows(self, params: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
        return [params | result]

    def section(self, ctx: Context, done: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[str, dict[str, str]]:
        return f"{len(done)} done\n", {}


def test_cells_are_resumable_failures_retried_settings_checked(tmp_path: Path) -> None:
    ctx = Context(out=tmp_path, model_name="m", progress=False)
    toy = _Toy(fail=True)
    part = toy.run(ctx)
    assert (part.computed, part.missing, toy.calls) == (3, 1, [0, 1, 2])
    assert part.rows[1] == {"i": 1, "protocol": "stream", "missing": True, "error": "ValueError: too small"}
    assert Results({"toy": part.rows}).value("toy", "value", i=2) == 2
    toy = _Toy()
    part = toy.run(ctx)  # the failed cell only
    assert (part.computed, part.missing, toy.calls, part.markdown) == (1, 0, [1], "3 done\n")
    assert json.loads((tmp_path / "toy/cells/0.json").read_text())["settings"] == {
        "model": "m", "dtype": None, "protocol": "stream", "scale": 1, "i": 0
    }  # fmt: skip
    toy = _Toy()
    assert toy.run(ctx).computed == 0 and toy.calls == []
    toy = _Toy(scale=2)
    report = Context(out=tmp_path, model_name="m", progress=False, compute=False)
    assert toy.run(report).missing == 3 and toy.calls == []  # other settings: not these results, nothing computed
    assert toy.run(ctx).computed == 3


@pytest.mark.usefixtures("no_model")
def test_cli_errors_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["reproduce", "nope"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and err.count("error") == 1
    assert main(["reproduce", "h2o", "--report", "--json"]) == 2
    assert "nothing to report" in json.loads(capsys.readouterr().out)["error"]
    (tmp_path / "file").write_text("x")
    assert main(["reproduce", "h2o", "--out", "file", "--json"]) == 2
    assert "is a file" in json.loads(capsys.readouterr().out)["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def _claims_rows(report: str) -> list[str]:
    section = report.split("## Claims\n\n", 1)[1].split("\n\n")[0]
    return [line for line in section.splitlines() if line.startswith("| **")]


@pytest.mark.slow
@pytest.mark.parametrize("paper", list(PAPERS))
def test_cli_reproduce_quick(paper: str, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / paper

    def run(*extra: str) -> dict[str, Any]:
        assert main(["reproduce", paper, "--quick", "--out", str(out), "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    first = run()
    plan = load_plan(paper, quick=True)
    assert first["computed"] > 0 and first["missing"] == 0
    assert [c["holds"] in (True, False) for c in first["claims"]] == [True] * len(plan.claims), first["claims"]
    report = (out / "report.md").read_text()
    rows = _claims_rows(report)
    assert len(rows) == len(plan.claims) and all(row.endswith((" | yes |", " | no |")) for row in rows)
    results = json.loads((out / "results.json").read_text())
    assert list(results["experiments"]) == [e.name for e in plan.experiments]
    for name, part in results["experiments"].items():
        assert (out / name).is_dir() and part["missing"] == 0 and part["rows"]
        assert all(row["protocol"] in ("stream", "prefill", "attention map") for row in part["rows"])
        for path in part["files"].values():
            assert (out / path).exists(), path
        assert f"`{name}/`" in report
    pictures = [line.split("](")[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]
    assert pictures and all((out / p).stat().st_size > 5000 for p in pictures)
    (tmp_path / "printed.json").write_text(json.dumps(first))  # (a page renders what --json printed)
    page = render_file(tmp_path / "printed.json")
    assert [line for line in page.splitlines() if line.startswith("| **")] == rows
    assert tally(first["claims"]) in report and tally(first["claims"]) in page
    assert command_line(first["provenance"]["command"]) in page  # (its --out, an absolute path, by its name)

    assert run()["computed"] == 0  # resumed: every part found on disk

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvsieve.models.load_model", refuse)
    again = run("--report")
    assert again["computed"] == 0 and again["claims"] == first["claims"]
