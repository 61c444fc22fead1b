"""Statistics of each layer's attention map: how sparse the rows are (H2O Fig. 2a), how the accumulated attention
falls with rank (H2O Fig. 2b), and how the rows' entropy grows with the query position (AhaKV §3.1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from kvsieve.analysis.attention import Result, accumulated, map_layers, require_tokens

TOP_PERCENTS = (1, 5, 10, 20)
"""The shares of a row's keys (the largest first) whose attention mass :func:`row_sparsity` reports."""
MIN_KEYS = 20
"""Rows with fewer keys are left out of the sparsity statistics (a top 1 % of 5 keys means little)."""
SMALL = 0.01
"""A probability below this share of its row's maximum counts as near zero."""


@dataclass
class SparsityResult(Result):
    """H2O Fig. 2a. Per layer, averaged over heads and the query rows with at least ``MIN_KEYS`` keys."""

    tokens: int
    rows: int
    """Query rows per head counted (those with at least ``MIN_KEYS`` keys)."""
    top_mass: dict[str, list[float]]
    """``"top 1%"`` … ``"top 20%"`` → per layer: the attention mass on that share of a row's keys (the largest
    first, ``ceil(share × keys)`` of them)."""
    near_zero: list[float]
    """Per layer: the fraction of a row's probabilities below ``SMALL`` × the row's maximum."""
    mean_top_mass: dict[str, float]
    mean_near_zero: float


def row_sparsity(weights: torch.Tensor) -> torch.Tensor:
    """``[heads, n, n]`` causal attention → ``[len(TOP_PERCENTS) + 1]``: the mean over heads and the rows with at
    least ``MIN_KEYS`` keys of the mass on each top share of keys, then of the fraction of near-zero probabilities."""
    n = weights.shape[-1]
    keys = torch.arange(MIN_KEYS, n + 1, device=weights.device)  # keys of rows MIN_KEYS - 1 … n - 1
    counts = torch.stack([(p * keys + 99) // 100 for p in TOP_PERCENTS], dim=1)  # ceil(p% × keys), integers
    visible = torch.arange(n, device=weights.device) < keys[:, None]
    per_head = []
    for rows in weights[:, MIN_KEYS - 1 :]:  # one head at a time: the sort holds rows × n values
        mass = rows.sort(dim=-1, descending=True).values.cumsum(-1)
        top = mass.gather(-1, counts - 1) / mass[:, -1:]
        near_zero = ((rows < SMALL * rows.amax(-1, keepdim=True)) & visible).sum(-1) / keys
        per_head.append(torch.cat([top, near_zero[:, None]], dim=1).mean(0))
    return torch.stack(per_head).mean(0)


def sparsity(model: PreTrainedModel, ids: torch.Tensor, progress: bool = False) -> SparsityResult:
    """:class:`SparsityResult` of ``ids`` (``[1, n]``, ``n >= MIN_KEYS``)."""
    n = require_tokens(ids, MIN_KEYS, "sparsity")
    layers = torch.stack(
        map_layers(model, ids, lambda _, w: row_sparsity(w), progress)
    ).T.tolist()  # [statistic][layer]
    top = {f"top {p}%": layers[i] for i, p in enumerate(TOP_PERCENTS)}
    return SparsityResult(
        tokens=n,
        rows=n - MIN_KEYS + 1,
        top_mass=top,
        near_zero=layers[-1],
        mean_top_mass={k: sum(v) / len(v) for k, v in top.items()},
        mean_near_zero=sum(layers[-1]) / len(layers[-1]),
    )


def fit_power_law(values: torch.Tensor) -> tuple[float, float]:
    """Least squares of ``log v = c - s·log r`` over the positive ``values`` sorted descending, ranks ``r = 1, 2,
    …``: the exponent ``s`` and the fit's R² (of the logs)."""
    v = values.double().flatten()
    v = v[v > 0].sort(descending=True).values
    if v.numel() < 3:
        raise ValueError(f"a power-law fit needs at least 3 positive values, got {v.numel()}")
    x = torch.arange(1, v.numel() + 1, dtype=torch.float64).log()
    y = v.log()
    dx, dy = x - x.mean(), y - y.mean()
    slope = (dx * dy).sum() / (dx * dx).sum()
    residual = dy - slope * dx
    return -slope.item(), 1 - ((residual * residual).sum() / (dy * dy).sum()).item()


@dataclass
class PowerLawResult(Result):
    """H2O Fig. 2b: the accumulated attention per token (summed over query rows, averaged over heads), sorted
    descending, against its rank; a power law ``value ∝ rank^-exponent`` fitted over all ranks."""

    tokens: int
    exponent: float
    """Of the accumulated attention averaged over layers."""
    r2: float
    layer_exponents: list[float]
    layer_r2: list[float]
    sorted_mean: list[float]
    """The layer-averaged accumulated attention, largest first (rank 1 first)."""
    layer_sorted: list[list[float]] = field(repr=False)
    """Each layer's accumulated attention, largest first (for the plot)."""


def powerlaw(model: PreTrainedModel, ids: torch.Tensor, progress: bool = False) -> PowerLawResult:
    """:class:`PowerLawResult` of ``ids`` (``[1, n]``)."""
    require_tokens(ids, 3, "powerlaw")
    per_layer = torch.stack(map_layers(model, ids, lambda _, w: accumulated(w), progress)).cpu()  # [layers, n]
    fits = [fit_power_law(row) for row in per_layer]
    mean = per_layer.mean(0)
    exponent, r2 = fit_power_law(mean)
    return PowerLawResult(
        tokens=ids.shape[1],
        exponent=exponent,
        r2=r2,
        layer_exponents=[s for s, _ in fits],
        layer_r2=[r for _, r in fits],
        sorted_mean=mean.sort(descending=True).values.tolist(),
        layer_sorted=per_layer.sort(dim=-1, descending=True).values.tolist(),
    )


def row_entropy(weights: torch.Tensor) -> torch.Tensor:
    """``[heads, n, n]`` causal attention → ``[n]``: each row's entropy in nats, averaged over heads (a uniform row
    over ``i`` keys has ``ln i``)."""
    return -torch.xlogy(weights, weights).sum(-1).mean(0)


@dataclass
class EntropyResult(Result):
    """AhaKV §3.1 (Eq. 6–8): attention-row entropy vs query position ``i`` (the row's number of keys, 1-based)."""

    tokens: int
    mean: list[float]
    """Per query position ``i = 1 … n``: the entropy averaged over heads and layers."""
    uniform: list[float]
    """``ln i``: the entropy of a uniform row over the same keys."""
    per_layer: list[list[float]]
    """``[layer][i - 1]``: averaged over heads."""
    mean_ratio: float
    """The mean over ``i >= 2`` of ``entropy / ln i``."""
    layer_ratio: list[float]


def entropy(model: PreTrainedModel, ids: torch.Tensor, progress: bool = False) -> EntropyResult:
    """:class:`EntropyResult` of ``ids`` (``[1, n]``, ``n >= 2``)."""
    n = require_tokens(ids, 2, "entropy")
    per_layer = torch.stack(map_layers(model, ids, lambda _, w: row_entropy(w), progress)).cpu().double()  # [layers, n]
    uniform = torch.arange(1, n + 1, dtype=torch.float64).log()
    ratio = (per_layer[:, 1:] / uniform[1:]).mean(-1)
    return EntropyResult(
        tokens=n,
        mean=per_layer.mean(0).tolist(),
        uniform=uniform.tolist(),
        per_layer=per_layer.tolist(),
        mean_ratio=ratio.mean().item(),
        layer_ratio=ratio.tolist(),
    )
