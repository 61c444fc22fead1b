"""Scissorhands §3 (Liu et al. 2023): the persistence of importance, and the attention map of §3.1.

For a sequence of length ``l`` and ``t = l // 2``, with ``α = 1 / t``: ``S_{a→b}`` is the set of tokens that receive
attention ``>= α`` from at least one query row in ``a … b - 1`` (tokens before the query only). The persistence
ratio of a head is ``|S_{0→t} ∩ S_{t→l}| / |S_{t→l}|``: of the tokens important to the second half's queries, the
share that were already important to the first half's. Tokens of the second half belong to ``S_{t→l}`` but cannot
belong to ``S_{0→t}``, so the ratio over the tokens before ``t`` (``|S_{0→t} ∩ S_{t→l}| / |S_{t→l} ∩ [0, t)|``) is
reported too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from kvsieve.analysis.attention import Result, map_layers, require_tokens


def persistence_ratio(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[heads, l, l]`` causal attention → per head: the persistence ratio, the ratio over the tokens before ``t``
    (NaN where the denominator is empty), and ``|S_{t→l}|``."""
    length = weights.shape[-1]
    t = length // 2
    before = torch.ones(length, length, dtype=torch.bool, device=weights.device).tril(-1)  # key j < query i
    important = (weights >= 1 / t) & before
    first, second = important[:, :t].any(1), important[:, t:].any(1)  # [heads, l]
    both = (first & second).sum(-1)
    size = second.sum(-1)
    return both / size, both / second[:, :t].sum(-1), size


@dataclass
class PersistenceResult(Result):
    """Per layer, averaged over heads (heads whose ratio is undefined left out)."""

    tokens: int
    t: int
    alpha: float
    ratio: list[float]
    """Per layer: ``|S_{0→t} ∩ S_{t→l}| / |S_{t→l}|``."""
    early_ratio: list[float]
    """Per layer: ``|S_{0→t} ∩ S_{t→l}| / |S_{t→l} ∩ [0, t)|``."""
    important: list[float]
    """Per layer: ``|S_{t→l}|``, the tokens important to the second half's queries."""
    mean_ratio: float
    mean_early_ratio: float
    map_layer: int
    map_head: int
    attention_map: torch.Tensor = field(repr=False)
    """``[l, l]``: head ``map_head`` of layer ``map_layer`` (for the heat map)."""


def _mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN if none)."""
    defined = [v for v in values if not math.isnan(v)]
    return sum(defined) / len(defined) if defined else math.nan


def persistence(model: PreTrainedModel, ids: torch.Tensor, progress: bool = False) -> PersistenceResult:
    """:class:`PersistenceResult` of ``ids`` (``[1, l]``, ``l >= 2``), with the map of head 0 of the middle layer."""
    length = require_tokens(ids, 2, "persistence")
    map_layer = model.config.get_text_config().num_hidden_layers // 2
    heat_map: list[torch.Tensor] = []

    def reduce(layer: int, weights: torch.Tensor) -> list[float]:
        if layer == map_layer:
            heat_map.append(weights[0].cpu())
        return [v.double().nanmean().item() for v in persistence_ratio(weights)]

    ratio, early, important = (list(column) for column in zip(*map_layers(model, ids, reduce, progress), strict=True))
    t = length // 2
    return PersistenceResult(
        tokens=length,
        t=t,
        alpha=1 / t,
        ratio=ratio,
        early_ratio=early,
        important=important,
        mean_ratio=_mean(ratio),
        mean_early_ratio=_mean(early),
        map_layer=map_layer,
        map_head=0,
        attention_map=heat_map[0],
    )
