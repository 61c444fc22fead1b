"""Plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsieve.evaluation.perplexity import PerplexityResult


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (imported lazily: plotting is optional work)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out, write (PNG, 120 dpi, parent folders created) and close ``fig``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    pyplot().close(fig)
    return out


def plot_stream_curves(results: Sequence[PerplexityResult], path: str | Path, title: str = "") -> Path:
    """Interval perplexity and resident memory vs tokens streamed, one line per result."""
    plt = pyplot()
    fig, (ax_ppl, ax_mem) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for r in results:
        if not r.curve:
            raise ValueError(f"result for {r.policy} has no curve (run with curve_every)")
        tokens = [p["tokens"] for p in r.curve]
        label = f"{r.policy} (budget {r.budget_tokens})"
        ax_ppl.plot(tokens, [p["ppl"] for p in r.curve], label=label)
        ax_mem.plot(tokens, [p["rss_mb"] for p in r.curve], label=f"{label} RSS")
        ax_mem.plot(tokens, [p["kv_bytes"] / 2**20 for p in r.curve], linestyle="--", label=f"{label} KV")
    ax_ppl.set_ylabel("perplexity (per interval)")
    ax_ppl.set_yscale("log")
    ax_mem.set_ylabel("MiB")
    ax_mem.set_xlabel("tokens streamed")
    for ax in (ax_ppl, ax_mem):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)
