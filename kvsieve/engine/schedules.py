"""Layer budget schedules: how one KV budget is shared among the layers of a model, with any policy.

A schedule gives each of the ``L`` policy layers a weight; the layers then share ``L × budget`` tokens (exactly)
in proportion to the weights (:func:`split_budget`). Sliding-window layers (Gemma 3's local layers) keep their own
window and take no part. The schedules:

- ``uniform`` (default): every layer gets the budget.
- ``increasing``: a linear ramp, later layers more (Scissorhands' rule of thumb): weights from 1 at the first layer
  to 3 at the last, i.e. about half the budget at the bottom and 1.5× at the top.
- ``pyramid``: PyramidKV's (Cai et al., 2024, arXiv:2406.02069, §3.3): the layers' budgets fall in an arithmetic
  sequence from the first layer to the last, the last holding ``1/β`` of the mean and the first ``2 − 1/β`` of it,
  ``β = 20`` (:func:`pyramid`). Choices: the sequence shares each layer's whole budget, the policy's own window
  included (the paper keeps its window of instruction tokens in every layer besides; kvpress's ``PyramidKVPress``
  shares the whole budget as here); and a layer whose share exceeds the prompt keeps the whole prompt and holds the
  rest for the tokens that follow, where the paper's code, which compresses the prompt once, lowers the first
  layers' shares to the prompt and gives the excess to the last layers.
- ``profiled``: weights measured per layer on a calibration text (:func:`kvsieve.profiling.profile`, outside the
  engine: it runs the model): layers whose queries spread their attention over more of the context get more tokens.

A layer budget that a policy cannot work with (e.g. ``streaming_llm`` needs ``sink`` < budget) is reported as a
``ValueError`` naming the layer, before any forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

SCHEDULES = ("uniform", "increasing", "pyramid", "profiled")


def split_budget(budget: int, weights: Sequence[float]) -> list[int]:
    """Per-layer budgets with sum ``len(weights) × budget``, each ≥ 1, shared in proportion to ``weights``.

    Every layer first gets 1 token; the other ``L·(budget − 1)`` tokens are shared in proportion to the weights and
    rounded down, and the tokens the rounding leaves go one each to the layers with the largest fractional parts
    (ties: the lower layer first). Equal weights give every layer exactly ``budget``.
    """
    if budget < 1:
        raise ValueError(f"budget must be a positive number of tokens, got {budget}")
    if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"layer weights must be positive finite numbers, got {list(weights)}")
    spare = len(weights) * (budget - 1)
    total = math.fsum(weights)
    shares = [spare * w / total for w in weights]
    floors = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(weights)), key=lambda i: (floors[i] - shares[i], i))
    for i in by_remainder[: spare - sum(floors)]:
        floors[i] += 1
    return [1 + f for f in floors]


def ramp(n_layers: int) -> list[float]:
    """Weights rising linearly from 1 (first layer) to 3 (last layer)."""
    return [1.0 + 2.0 * i / max(1, n_layers - 1) for i in range(n_layers)]


PYRAMID_BETA = 20
"""PyramidKV's β: the last layer holds ``1/β`` of the mean budget (the paper's code and kvpress default to 20)."""


def pyramid(n_layers: int, beta: float = PYRAMID_BETA) -> list[float]:
    """PyramidKV's weights: an arithmetic sequence from ``2 − 1/β`` (first layer) to ``1/β`` (last), mean 1."""
    if n_layers == 1:
        return [1.0]
    top, bottom = 1 / beta, 2 - 1 / beta
    return [bottom - (bottom - top) * i / (n_layers - 1) for i in range(n_layers)]


def schedule_weights(
    schedule: str | Sequence[float], n_layers: int, profiled: Callable[[], list[float]]
) -> list[float] | None:
    """Weights of the ``n_layers`` policy layers under ``schedule`` (None = uniform): one of :data:`SCHEDULES`
    (``profiled`` calls ``profiled()``), or explicit weights (e.g. from :func:`kvsieve.profiling.profile` on your
    own text)."""
    if not isinstance(schedule, str):
        return list(schedule)
    if schedule == "uniform":
        return None
    if schedule == "increasing":
        return ramp(n_layers)
    if schedule == "pyramid":
        return pyramid(n_layers)
    if schedule == "profiled":
        return profiled()
    raise ValueError(f"unknown layer schedule {schedule!r}; available: {', '.join(SCHEDULES)} (or a list of weights)")
