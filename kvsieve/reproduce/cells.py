"""The cell experiments of the papers' plans (:class:`~kvsieve.reproduce.experiments.CellExperiment`):

- :class:`Analysis`: one ``kvsieve analyze`` analysis, its JSON written once (``result.json``) with its settings;
- :class:`Rolling`: perplexity of long rolling streams (position rolling) per policy and cache size, with curves;
- :class:`Needle`: passkey retrieval accuracy per policy over needle depths;
- :class:`PrefillPositions`: where each policy's kept tokens lie after one compression of a text (the prefill
  protocol; the stream protocol's is :class:`Analysis` ``positions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvsieve.engine.budget import Budget
from kvsieve.reproduce.experiments import CellExperiment, Context
from kvsieve.results import md_table


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
