"""The kinds of experiment a paper's plan is made of. Each writes under ``OUT/<name>/`` and is resumable:

- :class:`Grid`: a :func:`~kvsieve.evaluation.sweep.run_sweep` grid (its cells, tables and plots);
- a :class:`CellExperiment` (:mod:`kvsieve.reproduce.cells`): an analysis, rolling streams, passkey retrieval,
  where the kept tokens lie after a prefill.

A cell experiment stores one JSON file per cell (``OUT/<name>/cells/<key>.json``: settings, result, seconds); a cell
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
