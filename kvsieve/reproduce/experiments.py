"""The kinds of experiment a paper's plan is made of. Each writes under ``OUT/<name>/`` and is resumable:

- :class:`Grid`: a :func:`~kvsieve.evaluation.sweep.run_sweep` grid (its cells, tables and plots);
- :class:`Analysis`: one ``kvsieve analyze`` analysis, its JSON written once (``result.json``) with its settings;
- :class:`Rolling`: perplexity of long rolling streams (position rolling) per policy and cache size, with curves;
- :class:`Needle`: passkey retrieval accuracy per policy over needle depths;
- :class:`PrefillPositions`: where each policy's kept tokens lie after one compression of a text (the prefill
  protocol; the stream protocol's is :class:`Analysis` ``positions``).

The last three store one JSON file per cell (``OUT/<name>/cells/<key>.json``: settings, result, seconds); a cell
found with the same settings is never recomputed, a cell that failed is retried. Every row records its protocol:
``stream`` (eviction from the first token, one token at a time), ``prefill`` (a context compressed once, then the
continuation or answer under the cache) or ``attention map`` (the full model's attention, nothing evicted).
"""

from __future__ import annotations

import json
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from kvsieve.engine.budget import Budget
from kvsieve.results import md_table

if TYPE_CHECKING:
    from kvsieve.evaluation.ray_sweep import RayOptions

PROTOCOL_NOTES = {
    "stream": "stream protocol: eviction from the first token, every later token one at a time (H2O's)",
    "prefill": "prefill protocol: the context compressed once, then the continuation/answer under the cache",
    "attention map": "the full model's attention maps (eager attention, nothing evicted)",
}


@dataclass
class Context:
    """What every experiment of one run shares: the output folder, the model (loaded once, on first use) and the
    texts."""

    out: Path
    model_name: str
    device: str | None = None
    dtype: str | None = None
    compute: bool = True
    progress: bool = True
    ray: RayOptions | None = None
    """Where grids compute their cells: as Ray tasks, or (None) in this process."""
    _loaded: tuple[Any, Any] | None = field(default=None, repr=False)
    _ids: dict[int, tuple[torch.Tensor, str]] = field(default_factory=dict, repr=False)

    @property
    def loaded(self) -> tuple[Any, Any]:
        if self._loaded is None:
            from kvsieve.models import load_model

            self._loaded = load_model(self.model_name, device=self.device, dtype=self.dtype)
        return self._loaded

    def text(self, tokens: int) -> tuple[torch.Tensor, str]:
        """The first ``tokens`` tokens of the built-in Wikipedia text (``[1, tokens]``: the first article long
        enough, else the articles joined) and its title."""
        if tokens not in self._ids:
            from kvsieve.data import builtin_text

            text = builtin_text(min_chars=tokens * 6)
            ids = self.loaded[1](text, return_tensors="pt").input_ids[:, :tokens]
            if ids.shape[1] < tokens:
                raise ValueError(f"the built-in text has {ids.shape[1]} tokens, {tokens} needed")
            self._ids[tokens] = ids, text.splitlines()[0].strip("= ")
        return self._ids[tokens]

    def common(self) -> dict[str, Any]:
        """The settings every result depends on."""
        return {"model": self.model_name, "dtype": self.dtype}

    def rel(self, path: str | Path) -> str:
        """``path`` relative to the paper's folder (as the report links it)."""
        path = Path(path)
        try:
            return str(path.relative_to(self.out))
        except ValueError:
            return str(path)


@dataclass
class Part:
    """What an experiment measured (finished cells only, others marked missing) and how it is reported."""

    rows: list[dict[str, Any]]
    computed: int
    """Cells computed by this run."""
    missing: int
    """Cells not finished (or failed)."""
    seconds: float
    """Compute time of the finished cells (their stored seconds)."""
    settings: dict[str, Any]
    files: dict[str, str]
    """Name → path relative to the paper's folder."""
    markdown: str


class Experiment(ABC):
    name: str
    title: str
    protocol: str

    def policies(self) -> list[str]:
        """Every policy (spec) it runs: checked before anything runs."""
        return []

    @abstractmethod
    def run(self, ctx: Context) -> Part:
        """Compute what is missing (if ``ctx.compute``) and return the part."""


# --- a sweep grid -------------------------------------------------------------------------------------------------


@dataclass
class Grid(Experiment):
    """A :func:`~kvsieve.evaluation.sweep.run_sweep` grid in ``OUT/<name>``."""

    name: str
    title: str
    tasks: Sequence[str]
    grid_policies: Sequence[str]
    budgets: Sequence[Budget]
    protocol: str = "stream"
    limit: int | None = None
    ppl_tokens: int = 1024

    def policies(self) -> list[str]:
        return list(self.grid_policies)

    def run(self, ctx: Context) -> Part:
        from kvsieve.evaluation.sweep import Settings, run_sweep

        settings = Settings(
            model=ctx.model_name, limit=self.limit, protocol=self.protocol, ppl_tokens=self.ppl_tokens, dtype=ctx.dtype
        )
        result = run_sweep(
            ctx.out / self.name,
            self.tasks,
            self.grid_policies,
            self.budgets,
            settings=settings,
            device=ctx.device,
            progress=ctx.progress,
            compute=ctx.compute,
            ray=ctx.ray,
        )
        rows = [row | {"protocol": self.protocol} for row in result.rows]
        cells = {(r["task"], r["computed_as"], r["budget"] if r["computed_as"] != "full" else 1.0): r for r in rows}
        images = [
            f"![{self.name}: {key}]({ctx.rel(path)})"
            for key, path in result.files.items()
            if key.endswith(("_ppl", "_acc"))
        ]
        table = result.table.replace("\n### ", "\n#### ").replace("### ", "#### ", 1)
        return Part(
            rows=rows,
            computed=result.computed,
            missing=sum(1 for r in cells.values() if r.get("missing") or r.get("error")),
            seconds=sum(r.get("seconds", 0.0) for r in cells.values() if not r.get("missing")),
            settings={"protocol": self.protocol, **asdict(settings), "tasks": list(self.tasks)},
            files={k: ctx.rel(v) for k, v in result.files.items()},
            markdown=table + "\n" + "\n".join(images) + "\n",
        )


# --- cells stored one JSON file each -----------------------------------------------------------------------------


def load_record(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The stored record at ``path`` if it was computed with ``settings`` and did not fail, else None."""
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record.get("settings") != settings or "error" in record.get("result", {}):
        return None
    return record


def save_record(path: Path, settings: dict[str, Any], result: dict[str, Any], seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"settings": settings, "result": result, "seconds": seconds}, indent=2))
    partial.replace(path)


def stored_error(path: Path, settings: dict[str, Any]) -> str | None:
    """The error a cell stored at ``path`` with ``settings`` failed with, if it did."""
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return record["result"].get("error") if record.get("settings") == settings else None


class CellExperiment(Experiment):
    """An experiment made of cells, each stored as ``OUT/<name>/<file>``."""

    @abstractmethod
    def cells(self) -> list[tuple[str, dict[str, Any]]]:
        """``(file name, parameters)`` of each cell; the parameters are part of its settings."""

    @abstractmethod
    def compute(self, ctx: Context, params: dict[str, Any]) -> dict[str, Any]:
        """The result of one cell (plain JSON)."""

    @abstractmethod
    def rows(self, params: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows a finished cell contributes."""

    @abstractmethod
    def section(self, ctx: Context, done: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[str, dict[str, str]]:
        """The report's markdown for the finished cells ``(params, result)`` and the files it wrote."""

    def run(self, ctx: Context) -> Part:
        folder = ctx.out / self.name
        base = ctx.common() | {"protocol": self.protocol} | self.settings()
        cells = [(folder / file, params, base | params) for file, params in self.cells()]
        found = {path: load_record(path, settings) for path, _, settings in cells}
        todo = (
            [(path, params, settings) for path, params, settings in cells if found[path] is None] if ctx.compute else []
        )
        with tqdm(total=len(todo), desc=self.name, unit="cell", disable=not ctx.progress or not todo) as bar:
            for path, params, settings in todo:
                start = time.perf_counter()
                try:
                    result = self.compute(ctx, params)
                except Exception as err:  # stored and shown; retried by the next run
                    result = {"error": f"{type(err).__name__}: {err}"}
                seconds = time.perf_counter() - start
                save_record(path, settings, result, seconds)
                found[path] = load_record(path, settings)
                bar.update()
                bar.write(f"{self.name} {path.stem}: " + (result.get("error") or f"done ({seconds:.0f} s)"), sys.stderr)
        rows, done, seconds, missing = [], [], 0.0, 0
        for path, params, settings in cells:
            record = found[path]
            if record is None:
                missing += 1
                error = stored_error(path, settings)
                rows.append(params | {"protocol": self.protocol, "missing": True} | ({"error": error} if error else {}))
                continue
            seconds += record["seconds"]
            done.append((params, record["result"]))
            rows += [row | {"protocol": self.protocol} for row in self.rows(params, record["result"])]
        markdown, files = self.section(ctx, done) if done else ("(no finished cells yet)\n", {})
        return Part(
            rows=rows,
            computed=len(todo),
            missing=missing,
            seconds=seconds,
            settings=ctx.common() | {"protocol": self.protocol} | self.settings(),
            files=files,
            markdown=markdown,
        )

    def settings(self) -> dict[str, Any]:
        """The experiment's own settings (for the report)."""
        return {}


# --- one analysis ------------------------------------------------------------------------------------------------


@dataclass
class Analysis(CellExperiment):
    """``kvsieve analyze ANALYSIS`` on the first ``tokens`` tokens of the built-in text: ``OUT/<name>/result.json``
    (the analysis's report) with its PNG and markdown summary next to it."""

    name: str
    title: str
    analysis: str
    tokens: int = 1024
    analysis_policies: Sequence[str] = ()
    budget: Budget = 0.2

    @property
    def protocol(self) -> str:  # type: ignore[override]
        return "stream" if self.analysis_policies else "attention map"

    def policies(self) -> list[str]:
        return list(self.analysis_policies)

    def cells(self) -> list[tuple[str, dict[str, Any]]]:
        params: dict[str, Any] = {"analysis": self.analysis, "tokens": self.tokens}
        if self.analysis_policies:
            params |= {"policies": list(self.analysis_policies), "budget": self.budget}
        return [("result.json", params)]

    def settings(self) -> dict[str, Any]:
        return self.cells()[0][1]

    def compute(self, ctx: Context, params: dict[str, Any]) -> dict[str, Any]:
        from kvsieve.analysis.report import run_analysis

        ids, title = ctx.text(self.tokens)
        options = {"policies": self.analysis_policies, "budget": self.budget} if self.analysis_policies else {}
        about = {"model": ctx.model_name, "text": title}
        out = ctx.out / self.name
        return run_analysis(self.analysis, ctx.loaded[0], ids, out, progress=ctx.progress, about=about, **options)

    def rows(self, params: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
        rows = [dict(result)]
        for kept in result.get("policies", []) if self.analysis == "positions" else []:
            rows.append(
                {
                    "policy": kept["policy"],
                    "first_share": kept["counts"][0] / kept["kept"],
                    "mean_position": kept["mean_position"],
                    "budget_tokens": result["budget_tokens"],
                }
            )
        return rows

    def section(self, ctx: Context, done: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[str, dict[str, str]]:
        from kvsieve.analysis.report import SECTIONS

        result = done[0][1]
        png = f"{self.name}/{self.analysis}.png"  # (where run_analysis wrote it, wherever OUT is now)
        lines = [f"{result['about'].get('text', '')}, {result['tokens']} tokens.", "", *SECTIONS[self.analysis](result)]
        return "\n".join([*lines, "", f"![{self.analysis}]({png})", ""]), {"png": png}


# --- rolling streams ---------------------------------------------------------------------------------------------


@dataclass
class Rolling(CellExperiment):
    """Perplexity of ``tokens`` tokens of real text streamed through caches of ``sizes`` slots with position
    rolling (RoPE positions by rank in the cache, so a stream may outrun the model's positions): one cell per
    policy and size, each with a curve of interval perplexity, resident memory and KV bytes."""

    name: str
    title: str
    rolling_policies: Sequence[str]
    sizes: Sequence[int]
    tokens: int
    curve_every: int
    protocol: str = "stream"

    def policies(self) -> list[str]:
        return list(self.rolling_policies)

    def cells(self) -> list[tuple[str, dict[str, Any]]]:
        return [
            (f"cells/{policy}__{size}.json", {"policy": policy, "size": size})
            for size in self.sizes
            for policy in self.rolling_policies
        ]

    def settings(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "curve_every": self.curve_every, "rolling": True}

    def compute(self, ctx: Context, params: dict[str, Any]) -> dict[str, Any]:
        from kvsieve.evaluation.perplexity import stream_perplexity

        ids, title = ctx.text(self.tokens)
        result, _ = stream_perplexity(
            ctx.loaded[0],
            ids,
            params["policy"],
            params["size"],
            progress=ctx.progress,
            rolling=True,
            curve_every=self.curve_every,
        )
        return result.to_dict() | {"text": title}

    def rows(self, params: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
        keep = ("ppl", "tokens_scored", "kv_bytes", "budget_tokens", "seconds", "stream_tok_s", "curve")
        return [params | {k: result[k] for k in keep}]

    def section(self, ctx: Context, done: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[str, dict[str, str]]:
        from kvsieve.evaluation.perplexity import PerplexityResult
        from kvsieve.evaluation.plots import plot_stream_curves

        table = []
        for params, r in done:
            curve = r["curve"]
            rss = f"{curve[0]['rss_mb']:,.0f} → {curve[-1]['rss_mb']:,.0f}" if curve else "—"
            table.append(
                [params["policy"], params["size"], f"{r['tokens_scored']:,}", f"{r['ppl']:.2f}",
                 f"{r['kv_bytes'] / 2**20:.2f}", rss, f"{r['seconds']:.0f}"]
            )  # fmt: skip
        fields = PerplexityResult.__dataclass_fields__
        results = [PerplexityResult(**{k: v for k, v in r.items() if k in fields}) for _, r in done if r["curve"]]
        png = ctx.out / self.name / "rolling.png"
        plot_stream_curves(results, png, title=f"{ctx.model_name}, rolling positions, {done[0][1]['text']}")
        header = ["policy", "cache slots", "tokens scored", "ppl", "KV MiB", "RSS MiB first → last", "seconds"]
        return md_table(header, table) + f"\n![rolling streams]({ctx.rel(png)})\n", {"png": ctx.rel(png)}


# --- needle ------------------------------------------------------------------------------------------------------


@dataclass
class Needle(CellExperiment):
    """Passkey retrieval (:func:`~kvsieve.evaluation.needle.run_needle`): a prompt of ``length`` tokens with the key
    at each depth, compressed once to ``budget`` and answered under the cache (the prefill protocol); one cell per
    policy."""

    name: str
    title: str
    needle_policies: Sequence[str]
    budget: Budget
    length: int
    depths: Sequence[float]
    trials: int
    protocol: str = "prefill"

    def policies(self) -> list[str]:
        return list(self.needle_policies)

    def cells(self) -> list[tuple[str, dict[str, Any]]]:
        common = {"budget": self.budget, "length": self.length, "depths": list(self.depths), "trials": self.trials}
        return [(f"cells/{policy}.json", {"policy": policy} | common) for policy in self.needle_policies]

    def settings(self) -> dict[str, Any]:
        return {"budget": self.budget, "length": self.length, "depths": list(self.depths), "trials": self.trials}

    def compute(self, ctx: Context, params: dict[str, Any]) -> dict[str, Any]:
        from kvsieve.data import builtin_text
        from kvsieve.evaluation.needle import run_needle

        model, tokenizer = ctx.loaded
        cells = run_needle(
            model,
            tokenizer,
            builtin_text(),
            lengths=[self.length],
            depths=self.depths,
            trials=self.trials,
            policy=params["policy"],
            budget=self.budget,
            progress=ctx.progress,
        )
        return {"cells": [c.to_dict() for c in cells]}

    def rows(self, params: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"policy": params["policy"], "budget": self.budget} | cell for cell in result["cells"]]

    def section(self, ctx: Context, done: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[str, dict[str, str]]:
        from kvsieve.evaluation.plots import pyplot, save_figure

        fig, ax = pyplot().subplots(figsize=(6.4, 4))
        table = []
        for params, result in done:
            cells = result["cells"]
            ax.plot([c["depth"] for c in cells], [c["accuracy"] for c in cells], marker="o", label=params["policy"])
            mean = sum(c["correct"] for c in cells) / sum(c["trials"] for c in cells)
            table.append([params["policy"], *(f"{c['correct']}/{c['trials']}" for c in cells), f"{mean:.3f}"])
        ax.set_xlabel("needle depth (0 = start of the prompt, 1 = end)")
        ax.set_ylabel("exact match")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"passkey at {self.length} tokens, budget {_label(self.budget)}")
        png = save_figure(fig, ctx.out / self.name / "needle.png")
        header = ["policy", *(f"depth {d:g}" for d in self.depths), "mean"]
        return md_table(header, table) + f"\n![needle]({ctx.rel(png)})\n", {"png": ctx.rel(png)}


def _label(budget: Budget) -> str:
    return f"{budget * 100:g}%" if isinstance(budget, float) else f"{budget} tokens"


# --- kept positions after one compression -----------------------------------------------------------------------


BINS = 20


@dataclass
class PrefillPositions(CellExperiment):
    """Where each policy's kept tokens lie after the first ``tokens`` tokens of the text were compressed once to
    ``budget`` (the prefill protocol): the share in each twentieth of the text, all layers and KV heads pooled."""

    name: str
    title: str
    kept_policies: Sequence[str]
    budget: Budget
    tokens: int = 1024
    protocol: str = "prefill"

    def policies(self) -> list[str]:
        return list(self.kept_policies)

    def cells(self) -> list[tuple[str, dict[str, Any]]]:
        return [
            (f"cells/{p}.json", {"policy": p, "budget": self.budget, "tokens": self.tokens}) for p in self.kept_policies
        ]

    def settings(self) -> dict[str, Any]:
        return {"budget": self.budget, "tokens": self.tokens, "bins": BINS}

    def compute(self, ctx: Context, params: dict[str, Any]) -> dict[str, Any]:
        from kvsieve.api import make_cache
        from kvsieve.engine.budget import resolve_budget

        model = ctx.loaded[0]
        ids, _ = ctx.text(self.tokens)
        n = ids.shape[1]
        cache = make_cache(model, params["policy"], resolve_budget(self.budget, n))
        with torch.inference_mode():
            model(ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
        pooled = torch.cat([cache.positions(layer)[0].flatten() for layer in range(len(cache.layers))]).cpu()
        counts = torch.bincount(pooled * BINS // n, minlength=BINS).tolist()
        return {
            "counts": counts,
            "kept": pooled.numel(),
            "budget_tokens": cache.budget_tokens,
            "first_share": counts[0] / pooled.numel(),
            "mean_position": pooled.double().mean().item() / (n - 1),
        }

    def rows(self, params: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
        return [params | result]

    def section(self, ctx: Context, done: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[str, dict[str, str]]:
        from kvsieve.evaluation.plots import pyplot, save_figure

        fig, ax = pyplot().subplots(figsize=(7, 4))
        width = 0.8 / len(done)
        for i, (params, r) in enumerate(done):
            shares = [c / r["kept"] for c in r["counts"]]
            ax.bar([b + i * width for b in range(BINS)], shares, width=width, label=params["policy"])
        ax.set_xlabel(f"position in the text (twentieths of {self.tokens} tokens)")
        ax.set_ylabel("share of the kept tokens")
        ax.legend()
        ax.grid(alpha=0.3)
        ax.set_title(f"kept positions after one compression to {_label(self.budget)} (prefill protocol)")
        png = save_figure(fig, ctx.out / self.name / "positions.png")
        table = [
            [p["policy"], r["budget_tokens"], f"{r['first_share']:.3f}", f"{r['mean_position']:.3f}"] for p, r in done
        ]
        header = ["policy", "budget (tokens)", "share kept in the first twentieth", "mean kept position (0–1)"]
        return md_table(header, table) + f"\n![kept positions]({ctx.rel(png)})\n", {"png": ctx.rel(png)}
