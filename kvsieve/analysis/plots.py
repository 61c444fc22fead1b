"""The analyses' figures (matplotlib, Agg backend), one PNG each, drawn from the results' dataclasses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvsieve.analysis.kept import PositionsResult, RecallResult
from kvsieve.analysis.maps import EntropyResult, PowerLawResult, SparsityResult
from kvsieve.analysis.persistence import PersistenceResult
from kvsieve.evaluation.plots import pyplot, save_figure


def _finish(fig: Any, axes: list[Any], path: str | Path, title: str) -> Path:
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_xlabel() == "layer":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def plot_sparsity(result: SparsityResult, path: str | Path, title: str = "") -> Path:
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    layers = range(len(result.near_zero))
    for name, values in result.top_mass.items():
        ax.plot(layers, values, marker="o", markersize=3, label=f"mass on {name} of keys")
    ax.plot(layers, result.near_zero, "k--", marker="s", markersize=3, label="share of scores < 1% of row max")
    ax.set_xlabel("layer")
    ax.set_ylabel("share (mean over heads and rows)")
    ax.set_ylim(0, 1.02)
    return _finish(fig, [ax], path, title)


def plot_powerlaw(result: PowerLawResult, path: str | Path, title: str = "") -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    ranks = torch.arange(1, result.tokens + 1, dtype=torch.float64)
    colors = plt.cm.viridis(torch.linspace(0, 1, len(result.layer_sorted)).tolist())
    for values, color in zip(result.layer_sorted, colors, strict=True):
        ax.loglog(ranks, values, color=color, alpha=0.35, linewidth=0.8)
    mean = torch.tensor(result.sorted_mean, dtype=torch.float64)
    ax.loglog(ranks, mean, "k", linewidth=2, label="mean over layers (thin: layers, dark → light = first → last)")
    # The fitted line through the means of the logs: log v = mean(log v) - s·(log r - mean(log r)).
    fit = (mean.log().mean() - result.exponent * (ranks.log() - ranks.log().mean())).exp()
    ax.loglog(ranks, fit, "r--", label=f"fit: rank^-{result.exponent:.2f}, R² {result.r2:.3f}")
    ax.set_xlabel("rank")
    ax.set_ylabel("accumulated attention (sum over query rows)")
    return _finish(fig, [ax], path, title)


def plot_persistence(result: PersistenceResult, path: str | Path, title: str = "") -> Path:
    from matplotlib.colors import LogNorm

    fig, (ax_ratio, ax_map) = pyplot().subplots(1, 2, figsize=(12, 5))
    ax_ratio.plot(range(len(result.ratio)), result.ratio, marker="o", label="|S(0→t) ∩ S(t→l)| / |S(t→l)|")
    ax_ratio.plot(range(len(result.ratio)), result.early_ratio, marker="s", label="over the tokens before t")
    ax_ratio.set_xlabel("layer")
    ax_ratio.set_ylabel("persistence ratio")
    ax_ratio.set_ylim(0, 1.02)
    ax_ratio.set_title(f"persistence ratio (t = {result.t}, α = 1/t), mean over heads", fontsize=9)
    image = ax_map.imshow(result.attention_map.clamp(min=1e-6), cmap="magma", norm=LogNorm(vmin=1e-4, vmax=1))
    fig.colorbar(image, ax=ax_map, label="attention probability")
    ax_map.set_xlabel("key position")
    ax_map.set_ylabel("query position")
    ax_map.set_title(f"attention map, layer {result.map_layer}, head {result.map_head}", fontsize=9)
    return _finish(fig, [ax_ratio], path, title)


def plot_positions(result: PositionsResult, path: str | Path, title: str = "") -> Path:
    panels = 2 if result.accumulated is not None else 1
    fig, axes = pyplot().subplots(panels, 1, figsize=(9, 3.6 * panels), squeeze=False)
    ax = axes[0, 0]
    edges = result.bin_edges
    for row in result.policies:
        shares = [c / row.kept for c in row.counts]
        ax.stairs(shares, edges, linewidth=1.5, label=f"{row.policy} (mean position {row.mean_position:.2f})")
    ax.set_xlabel("original position")
    ax.set_ylabel("share of kept tokens")
    ax.set_title(
        f"kept positions after {result.tokens} tokens, budget {result.budget_tokens}: "
        f"{result.layers} layers × {result.kv_heads} KV heads pooled",
        fontsize=9,
    )
    if result.accumulated is not None:
        ax = axes[1, 0]
        ax.semilogy(range(result.tokens), result.accumulated, linewidth=0.8, label="per token")
        ax.stairs(result.accumulated_binned, edges, baseline=None, color="k", linewidth=1.5, label="mean per bin")
        ax.set_xlabel("position")
        ax.set_ylabel("accumulated attention")
        ax.set_title("H2O's accumulated attention (full eager attention, mean over heads and layers)", fontsize=9)
    return _finish(fig, list(axes[:, 0]), path, title)


def plot_entropy(result: EntropyResult, path: str | Path, title: str = "") -> Path:
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    positions = range(1, result.tokens + 1)
    for values in result.per_layer:
        ax.plot(positions, values, color="tab:blue", alpha=0.12, linewidth=0.6)
    ax.plot(positions, result.mean, color="tab:blue", linewidth=2, label="mean over heads and layers (thin: layers)")
    ax.plot(positions, result.uniform, "k--", label="ln i (uniform row)")
    ax.set_xlabel("query position i (keys in the row)")
    ax.set_ylabel("attention entropy (nats)")
    return _finish(fig, [ax], path, title)


def plot_recall(result: RecallResult, path: str | Path, title: str = "") -> Path:
    fig, (ax_layer, ax_step) = pyplot().subplots(1, 2, figsize=(13, 4.5))
    steps = range(result.first_step, result.tokens)
    for row in result.policies:
        label = f"{row.policy} (mean {row.mean:.3f})"
        ax_layer.plot(range(len(row.per_layer)), row.per_layer, marker="o", markersize=3, label=label)
        ax_step.plot(steps, row.curve, linewidth=0.8, label=label)
    ax_layer.set_xlabel("layer")
    ax_layer.set_ylabel("attention recall (mean over heads and decode steps)")
    ax_step.set_xlabel("decode step (query position)")
    ax_step.set_ylabel("attention recall (mean over heads and layers)")
    ax_step.set_title(f"budget {result.budget_tokens} of {result.tokens} tokens", fontsize=9)
    return _finish(fig, [ax_layer, ax_step], path, title)


PLOTS = {
    "sparsity": plot_sparsity,
    "powerlaw": plot_powerlaw,
    "persistence": plot_persistence,
    "positions": plot_positions,
    "entropy": plot_entropy,
    "recall": plot_recall,
}
"""Analysis name → its figure."""
