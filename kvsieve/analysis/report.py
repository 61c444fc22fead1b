"""Run one analysis, write its PNG and markdown summary, and render the summary (the command's readable output)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from kvsieve.analysis import ANALYSES, DEFAULT_POLICIES, POLICY_ANALYSES, kept, maps, persistence
from kvsieve.analysis.plots import PLOTS
from kvsieve.engine.budget import Budget

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sparsity": maps.sparsity,
    "powerlaw": maps.powerlaw,
    "persistence": persistence.persistence,
    "positions": kept.positions,
    "entropy": maps.entropy,
    "recall": kept.recall,
}


def run_analysis(
    name: str,
    model: PreTrainedModel,
    ids: torch.Tensor,
    out_dir: str | Path,
    *,
    policies: Sequence[str] = DEFAULT_POLICIES,
    budget: Budget = 0.2,
    progress: bool = False,
    about: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Analysis ``name`` of ``ids`` (``[1, n]``; ``policies`` and ``budget`` for the policy analyses); writes
    ``<out_dir>/<name>.png`` and ``<name>.md``. Returns the result's dict with ``analysis``, ``about`` (what the
    figure's title and the summary say about the run: the model, the text) and ``files``."""
    if name not in FUNCTIONS:
        raise ValueError(f"unknown analysis {name!r}; one of {', '.join(FUNCTIONS)}")
    options = {"policies": list(policies), "budget": budget} if name in POLICY_ANALYSES else {}
    result = FUNCTIONS[name](model, ids, progress=progress, **options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"png": str(out / f"{name}.png"), "markdown": str(out / f"{name}.md")}
    report = {"analysis": name, "about": about or {}, **result.to_dict(), "files": files}
    PLOTS[name](result, files["png"], title=_about(report))
    Path(files["markdown"]).write_text(markdown(report) + "\n", encoding="utf-8")
    return report


def _about(report: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in report["about"].items())


def _cell(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def _sparsity(r: dict[str, Any]) -> list[str]:
    top = r["top_mass"]
    lines = [
        f"Averaged over layers, heads and the {r['rows']} query rows with at least {maps.MIN_KEYS} keys: the top "
        + ", ".join(f"{k.split()[1]} of keys hold {v:.1%}" for k, v in r["mean_top_mass"].items())
        + f" of a row's attention; {r['mean_near_zero']:.1%} of the scores are below {maps.SMALL:.0%} of the row's "
        "maximum.",
        "",
    ]
    rows = [[layer, *(top[k][layer] for k in top), r["near_zero"][layer]] for layer in range(len(r["near_zero"]))]
    rows.append(["mean", *r["mean_top_mass"].values(), r["mean_near_zero"]])
    return lines + _table(["layer", *top, f"< {maps.SMALL:.0%} of max"], rows)


def _powerlaw(r: dict[str, Any]) -> list[str]:
    exponents = r["layer_exponents"]
    return [
        f"Accumulated attention (averaged over layers) ∝ rank^-{r['exponent']:.3f}, R² {r['r2']:.3f} (least squares "
        f"of log value vs log rank over ranks 1–{r['tokens']}); per layer the exponent is "
        f"{min(exponents):.3f}–{max(exponents):.3f}. The top-ranked token holds {r['sorted_mean'][0]:.1f} of the "
        f"{sum(r['sorted_mean']):.0f} attention rows' mass.",
        "",
        *_table(["layer", "exponent", "R²"], list(zip(range(len(exponents)), exponents, r["layer_r2"], strict=True))),
    ]


def _persistence(r: dict[str, Any]) -> list[str]:
    rows = list(zip(range(len(r["ratio"])), r["ratio"], r["early_ratio"], r["important"], strict=True))
    return [
        f"t = {r['t']}, α = 1/t = {r['alpha']:.4f}. Of the tokens important (attention ≥ α) to some query in the "
        f"second half, {r['mean_ratio']:.1%} were already important to some query in the first half; of those "
        f"before t, {r['mean_early_ratio']:.1%} (means over layers and heads). Heat map: layer {r['map_layer']}, "
        f"head {r['map_head']}.",
        "",
        *_table(["layer", "persistence ratio", "ratio before t", "tokens in S(t→l)"], rows),
    ]


def _positions(r: dict[str, Any]) -> list[str]:
    policies = r["policies"]
    lines = [
        f"Budget {r['budget_tokens']} of {r['tokens']} tokens; kept positions of {r['layers']} layers × "
        f"{r['kv_heads']} KV heads pooled once the whole text has streamed through the cache. Mean kept position "
        "(0 = first token, 1 = last): " + ", ".join(f"{p['policy']} {p['mean_position']:.3f}" for p in policies) + ".",
        "",
    ]
    edges = r["bin_edges"]
    header = ["positions", *(f"{p['policy']} (share kept)" for p in policies)]
    if r["accumulated_binned"] is not None:
        header.append("accumulated attention (mean)")
    rows = []
    for b in range(len(edges) - 1):
        row = [f"{edges[b]}–{edges[b + 1] - 1}", *(p["counts"][b] / p["kept"] for p in policies)]
        rows.append(row + ([r["accumulated_binned"][b]] if r["accumulated_binned"] is not None else []))
    return lines + _table(header, rows)


def _entropy(r: dict[str, Any]) -> list[str]:
    n = r["tokens"]
    marks = sorted({*(2**k for k in range(1, n.bit_length())), n})
    rows = [[i, r["mean"][i - 1], r["uniform"][i - 1], r["mean"][i - 1] / r["uniform"][i - 1]] for i in marks]
    return [
        f"Mean attention-row entropy over heads and layers: {r['mean'][-1]:.3f} nats at i = {n} (ln {n} = "
        f"{r['uniform'][-1]:.3f}); entropy / ln i averaged over i = 2…{n}: {r['mean_ratio']:.3f} (per layer "
        f"{min(r['layer_ratio']):.3f}–{max(r['layer_ratio']):.3f}).",
        "",
        *_table(["i", "entropy (nats)", "ln i", "ratio"], rows),
    ]


def _recall(r: dict[str, Any]) -> list[str]:
    policies = r["policies"]
    summary = [
        [p["policy"], p["mean"], p["loss"], min(p["per_layer"]), int(torch.tensor(p["per_layer"]).argmin())]
        for p in policies
    ]
    layers = range(len(policies[0]["per_layer"]))
    return [
        f"Budget {r['budget_tokens']} of {r['tokens']} tokens: the first {r['first_step']} tokens are the prefill, "
        f"then {r['tokens'] - r['first_step']} decode steps. Recall = the full attention's mass (the full model's "
        "query over every previous token, mean over heads) on the tokens the policy's cache holds at that step.",
        "",
        *_table(["policy", "mean recall", "attention loss", "lowest layer recall", "at layer"], summary),
        "",
        *_table(
            ["layer", *(p["policy"] for p in policies)], [[i, *(p["per_layer"][i] for p in policies)] for i in layers]
        ),
    ]


SECTIONS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "sparsity": _sparsity,
    "powerlaw": _powerlaw,
    "persistence": _persistence,
    "positions": _positions,
    "entropy": _entropy,
    "recall": _recall,
}


def markdown(report: dict[str, Any]) -> str:
    """The markdown summary of a :func:`run_analysis` report (also the command's readable output)."""
    name = report["analysis"]
    return "\n".join(
        [
            f"# {name}: {ANALYSES[name].replace('%%', '%')}",
            "",
            f"{_about(report)}, {report['tokens']} tokens".lstrip(", "),
            "",
            *SECTIONS[name](report),
            "",
            f"![{name}]({Path(report['files']['png']).name})",
        ]
    )
