"""Scissorhands §3 (Liu et al. 2023): the persistence of importance, and the attention map of §3.1.

For a sequence of length ``l`` and ``t = l // 2``, with ``α = 1 / t``: ``S_{a→b}`` is the set of tokens that receive
attention ``>= α`` from at least one query row in ``a … b - 1`` (tokens before the query only). The persistence
ratio of a head is ``|S_{0→t} ∩ S_{t→l}| / |S_{t→l}|``: of the tokens important to the second half's queries, the
share that were already important to the first half's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from kvsieve.analysis.attention import Result, map_layers, require_tokens


def persistence_ratio(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[heads, l, l]`` causal attention → per head, the persistence ratio (NaN where ``S_{t→l}`` is empty) and
    ``|S_{t→l}|``."""
    length = weights.shape[-1]
    t = length // 2
    before = torch.ones(length, length, dtype=torch.bool, device=weights.device).tril(-1)  # key j < query i
    important = (weights >= 1 / t) & before
    first, second = important[:, :t].any(1), important[:, t:].any(1)  # [heads, l]
    size = second.sum(-1)
    return (first & second).sum(-1) / size, size


@dataclass
class PersistenceResult(Result):
    """Per layer, averaged over heads (heads whose ``S_{t→l}`` is empty left out)."""

    tokens: int
    t: int
    alpha: float
    ratio: list[float]
    """Per layer: ``|S_{0→t} ∩ S_{t→l}| / |S_{t→l}|``."""
    important: list[float]
    """Per layer: ``|S_{t→l}|``, the tokens important to the second half's queries."""
    mean_ratio: float
    map_layer: int
    map_head: int
    attention_map: torch.Tensor = field(repr=False)
    """``[l, l]``: head ``map_head`` of layer ``map_layer`` (for the heat map)."""


def persistence(model: PreTrainedModel, ids: torch.Tensor, progress: bool = False) -> PersistenceResult:
    """:class:`PersistenceResult` of ``ids`` (``[1, l]``, ``l >= 2``), with the map of head 0 of the middle layer."""
    length = require_tokens(ids, 2, "persistence")
    map_layer = model.config.get_text_config().num_hidden_layers // 2
    heat_map: list[torch.Tensor] = []

    def reduce(layer: int, weights: torch.Tensor) -> tuple[float, float]:
        if layer == map_layer:
            heat_map.append(weights[0].cpu())
        ratio, size = persistence_ratio(weights)
        return ratio.nanmean().item(), size.double().mean().item()

    rows = map_layers(model, ids, reduce, progress)
    t = length // 2
    ratios = [r for r, _ in rows]
    defined = [r for r in ratios if not math.isnan(r)]
    return PersistenceResult(
        tokens=length,
        t=t,
        alpha=1 / t,
        ratio=ratios,
        important=[s for _, s in rows],
        mean_ratio=sum(defined) / len(defined) if defined else math.nan,
        map_layer=map_layer,
        map_head=0,
        attention_map=heat_map[0],
    )
