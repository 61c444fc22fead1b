"""Run a paper's plan and write its report: ``OUT/report.md`` (the claims table computed from the measured numbers,
then each experiment's tables and pictures), ``OUT/results.json`` (the same numbers and verdicts)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsieve.engine.budget import Budget
from kvsieve.evaluation.defaults import DEFAULT_MODEL
from kvsieve.reproduce import PAPERS, default_out
from kvsieve.reproduce.claims import Claim, Results, claims_table, pct, tally
from kvsieve.reproduce.experiments import PROTOCOL_NOTES, Context, Experiment, Part

if TYPE_CHECKING:
    from kvsieve.evaluation.ray_sweep import RayOptions


@dataclass(frozen=True)
class View:
    """A report section built from several experiments' rows (e.g. two protocols side by side)."""

    title: str
    build: Callable[[Results], str]


@dataclass(frozen=True)
class Plan:
    paper: str
    title: str
    """The paper, as the report's heading names it."""
    experiments: Sequence[Experiment]
    claims: Sequence[Claim]
    views: Sequence[View] = field(default_factory=tuple)
    notes: Sequence[str] = field(default_factory=tuple)
    """Lines the report prints under its heading: the choices made where the setting differs from the paper's."""


def load_plan(paper: str, quick: bool = False) -> Plan:
    """The plan of ``paper`` (full size, or the ``quick`` settings)."""
    if paper not in PAPERS:
        raise ValueError(f"unknown paper {paper!r}; one of {', '.join(PAPERS)}")
    return importlib.import_module(f"kvsieve.reproduce.{paper}").plan(quick)


def check_plan(plan: Plan) -> None:
    """Every policy spec of every experiment is known and its parameters parse (before anything runs)."""
    from kvsieve.policies import resolve_spec

    names = [e.name for e in plan.experiments]
    if len(set(names)) != len(names):
        raise ValueError(f"{plan.paper}: experiment names repeat: {names}")
    for experiment in plan.experiments:
        for policy in experiment.policies():
            resolve_spec(policy)


def reproduce(
    paper: str,
    out: str | Path | None = None,
    *,
    quick: bool = False,
    model: str = DEFAULT_MODEL,
    device: str | None = None,
    dtype: str | None = None,
    compute: bool = True,
    progress: bool = True,
    ray: RayOptions | None = None,
) -> dict[str, Any]:
    """Run what is missing of ``paper``'s experiments (``compute=False``: nothing, the report of what is finished)
    and write ``report.md`` and ``results.json`` in ``out``. Returns the command's result: the claims, the files,
    the cells computed by this run. ``ray``: the grids' cells run as Ray tasks (the other experiments here)."""
    plan = load_plan(paper, quick)
    check_plan(plan)
    out = Path(out or default_out(paper, quick))
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a folder")
    if not compute and not out.is_dir():
        raise ValueError(f"nothing to report: {str(out)!r} does not exist (run `kvsieve reproduce {paper}` first)")
    ctx = Context(out=out, model_name=model, device=device, dtype=dtype, compute=compute, progress=progress, ray=ray)
    if compute:
        ctx.loaded  # noqa: B018  (a model that cannot load fails here, before anything is written)
        if ray is not None:
            from kvsieve.evaluation.ray_sweep import connect

            connect(ray)  # (and so does a Ray that cannot start or be reached)
    start = time.perf_counter()
    parts: dict[str, Part] = {}
    for i, experiment in enumerate(plan.experiments, 1):
        if progress:
            print(f"[{paper} {i}/{len(plan.experiments)}] {experiment.name}: {experiment.title}", file=sys.stderr)
        parts[experiment.name] = experiment.run(ctx)
    results = Results({name: part.rows for name, part in parts.items()})
    claims = [claim.evaluate(results) for claim in plan.claims]
    report = {
        "paper": paper,
        "title": plan.title,
        "quick": quick,
        "model": model,
        "dtype": dtype,
        "claims": claims,
        "experiments": {
            e.name: {
                "title": e.title,
                "protocol": e.protocol,
                "settings": parts[e.name].settings,
                "computed": parts[e.name].computed,
                "missing": parts[e.name].missing,
                "seconds": parts[e.name].seconds,
                "files": parts[e.name].files,
                "rows": parts[e.name].rows,
            }
            for e in plan.experiments
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    files = {"report": str(out / "report.md"), "json": str(out / "results.json")}
    Path(files["json"]).write_text(json.dumps(report, indent=2, default=str))
    Path(files["report"]).write_text(markdown(plan, report, results, parts), encoding="utf-8")
    computed = sum(part.computed for part in parts.values())
    return {
        "paper": paper,
        "out": str(out),
        "computed": computed,
        "missing": sum(part.missing for part in parts.values()),
        "seconds": time.perf_counter() - start,
        "claims": claims,
        "table": claims_table(claims),
        "files": files,
    }


def _settings_line(settings: dict[str, Any]) -> str:
    """The experiment's own settings (the model and protocol are said elsewhere)."""
    shown = {k: v for k, v in settings.items() if v is not None and k not in ("protocol", "model", "dtype")}
    if "ppl" not in shown.get("tasks", ["ppl"]):
        shown.pop("ppl_tokens", None)
    return ", ".join(f"{k} " + (", ".join(map(str, v)) if isinstance(v, list) else str(v)) for k, v in shown.items())


def markdown(plan: Plan, report: dict[str, Any], results: Results, parts: dict[str, Part]) -> str:
    """``report.md``: the heading and notes, the claims table, the views, then each experiment's section."""
    lines = [
        f"# Reproducing {plan.title}",
        "",
        f"`kvsieve reproduce {plan.paper}{' --quick' if report['quick'] else ''}`: model {report['model']} "
        f"({report['dtype'] or 'float32'}), {'quick' if report['quick'] else 'full-size'} settings. Every number "
        "below is read from the files in this folder; each claim's verdict is computed from them.",
        "",
        *(f"- {note}" for note in plan.notes),
        "",
        "## Claims",
        "",
        claims_table(report["claims"]),
        tally(report["claims"]),
        "",
    ]
    for view in plan.views:
        lines += [f"## {view.title}", "", view.build(results), ""]
    for name, part in report["experiments"].items():
        protocol = part["protocol"]
        status = f"{part['missing']} cell(s) not finished" if part["missing"] else "complete"
        lines += [
            f"## {part['title']}",
            "",
            f"`{name}/` — {PROTOCOL_NOTES.get(protocol, protocol)}; {_settings_line(part['settings'])}; {status}; "
            f"compute time of its cells {part['seconds']:.0f} s.",
            "",
            parts[name].markdown,
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def side_by_side(
    parts: Sequence[tuple[str, str]],
    policies: Sequence[str],
    budgets: Sequence[Budget],
    *,
    task: str = "ppl",
    metric: str = "ppl",
    columns: Callable[[str], Sequence[str]] | None = None,
    column_names: Sequence[str] = (),
) -> Callable[[Results], str]:
    """A view: one row per policy, one column per (part, budget) — e.g. the stream and prefill protocols side by
    side. ``columns(policy)`` adds leading columns (``column_names``)."""

    def build(results: Results) -> str:
        header = ["policy", *column_names, *(f"{label} {pct(b)}" for label, _ in parts for b in budgets)]
        lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for policy in policies:
            values = []
            for _, part in parts:
                for budget in budgets:
                    rows = results.rows(part, task=task, policy=policy, budget=budget)
                    value = rows[0].get(metric) if rows else None
                    values.append("—" if value is None else f"{value:.2f}")
            lead = list(columns(policy)) if columns else []
            lines.append("| " + " | ".join([policy, *lead, *values]) + " |")
        return "\n".join(lines) + "\n"

    return build
