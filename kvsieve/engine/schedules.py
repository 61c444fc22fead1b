"""Layer budget schedules: how one KV budget is shared among the layers of a model, with any policy.

A schedule gives each of the ``L`` policy layers a weight; the layers then share ``L × budget`` tokens (exactly)
in proportion to the weights (:func:`split_budget`). Sliding-window layers (Gemma 3's local layers) keep their own
window and take no part. The schedules:

- ``uniform`` (default): every layer gets the budget.
- ``increasing``: a linear ramp, later layers more (Scissorhands' rule of thumb): weights from 1 at the first layer
  to 3 at the last, i.e. about half the budget at the bottom and 1.5× at the top.
- ``pyramid``: the same ramp reversed, earlier layers more (like PyramidKV, whose own ramp is steeper).
- ``profiled``: weights measured per layer on a calibration text (:func:`profile`): layers whose queries spread
  their attention over more of the context get more tokens.

A layer budget that a policy cannot work with (e.g. ``streaming_llm`` needs ``sink`` < budget) is reported as a
``ValueError`` naming the layer, before any forward pass.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.fetch import cache_dir
from kvsieve.policies.base import Observation, Policy, Slots

SCHEDULES = ("uniform", "increasing", "pyramid", "profiled")
COVERAGE = 0.9
"""Share of a query's attention that the ``profiled`` statistic asks to cover."""
PROFILE_TOKENS = 512
"""Tokens of the calibration text used by :func:`profile`."""
PROFILE_VERSION = 1
"""Bump when the profile statistic changes, so that cached profiles are measured again."""


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


def schedule_weights(schedule: str | Sequence[float], model: PreTrainedModel, n_layers: int) -> list[float] | None:
    """Weights of the ``n_layers`` policy layers of ``model`` under ``schedule`` (None = uniform).

    ``schedule`` is one of :data:`SCHEDULES`, or explicit weights (e.g. from :func:`profile` on your own text).
    """
    if not isinstance(schedule, str):
        return list(schedule)
    if schedule == "uniform":
        return None
    if schedule == "increasing":
        return ramp(n_layers)
    if schedule == "pyramid":
        return ramp(n_layers)[::-1]
    if schedule == "profiled":
        return profile(model)
    raise ValueError(f"unknown layer schedule {schedule!r}; available: {', '.join(SCHEDULES)} (or a list of weights)")


@dataclass(frozen=True)
class CoverageParams:
    start: int = 0
    """Queries at earlier positions are not counted."""


class Coverage(Policy):
    """Measures, without evicting, the ``profiled`` statistic of one layer (see :func:`profile`)."""

    name = "coverage"
    paper = "kvsieve's layer profile"
    needs_attention = True
    bounded = False
    Params = CoverageParams

    def setup(self) -> None:
        self.total = 0.0
        self.count = 0

    def observe(self, slots: Slots, obs: Observation) -> None:
        probs = obs.probs  # the group's heads summed: each real row sums to the group size
        cumulative = probs.sort(dim=-1, descending=True).values.cumsum(dim=-1)
        needed = (cumulative < COVERAGE * probs.sum(dim=-1, keepdim=True)).sum(dim=-1) + 1
        share = needed / obs.allowed.sum(dim=-1)
        counted = (obs.query_pos >= self.params.start)[:, None, :].expand_as(share)
        self.total += float(share[counted].sum())
        self.count += int(counted.sum())

    @property
    def value(self) -> float:
        """The mean share (NaN before any counted query)."""
        return self.total / self.count if self.count else float("nan")


def profile(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None = None,
    text: str | None = None,
    tokens: int = PROFILE_TOKENS,
) -> list[float]:
    """The ``profiled`` weights of ``model``'s policy layers, measured on a calibration text (cached on disk).

    Statistic of a layer: over the queries in the second half of the text (positions ≥ ``tokens // 2``) and over
    its KV heads, the mean share of the context (keys ``0..p`` for a query at position ``p``) that the fewest
    highest-attended keys need to hold :data:`COVERAGE` of the query's attention (the attention of the KV head's
    query heads averaged). A layer that attends to a few tokens scores low and gets a small budget.

    ``text`` defaults to the built-in Wikipedia text, ``tokenizer`` to the one saved with the model. The first
    ``tokens`` tokens are run once through the kvsieve engine with full attention. The profile is cached as JSON in
    ``cache_dir()/"profiles"``, keyed by the model (path, config, a checksum of its embeddings, dtype), the token
    ids and the statistic's version.
    """
    from kvsieve.api import make_cache
    from kvsieve.data import builtin_text

    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"no tokenizer saved with the model ({model.name_or_path!r}); pass one to "
                "kvsieve.engine.schedules.profile(model, tokenizer) and give make_cache its weights"
            ) from err
    text = builtin_text(min_chars=tokens * 6) if text is None else text
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < 32:
        raise ValueError(f"the calibration text has {ids.shape[1]} tokens; a profile needs at least 32")
    path = _profile_path(model, ids)
    if path.is_file():
        return json.loads(path.read_text())["weights"]
    cache = make_cache(model, Coverage, None, start=ids.shape[1] // 2)
    with torch.inference_mode():
        model(ids.to(model.device), past_key_values=cache, use_cache=True)
    weights = [layer.policy.value for layer in cache.layers if not layer.is_sliding]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"model": model.name_or_path, "tokens": ids.shape[1], "weights": weights}, indent=1))
    tmp.replace(path)
    return weights


def _profile_path(model: PreTrainedModel, ids: torch.Tensor):
    embeddings = model.get_input_embeddings().weight
    key = {
        "version": PROFILE_VERSION,
        "coverage": COVERAGE,
        "model": model.name_or_path,
        "config": model.config.to_json_string(use_diff=False),
        "embedding_sum": float(embeddings.detach().double().sum()),
        "dtype": str(embeddings.dtype),
        "ids": ids.flatten().tolist(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(str(model.name_or_path).rstrip("/"))) or "model"
    return cache_dir() / "profiles" / f"{slug}-{digest}.json"
