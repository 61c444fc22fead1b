"""The ``profiled`` layer schedule's statistic, measured by running the model (so it lives outside the engine)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine.attention import use_kvsieve_attention
from kvsieve.engine.cache import SieveCache
from kvsieve.fetch import cache_dir
from kvsieve.policies import Observation, Policy, Slots

COVERAGE = 0.9
"""Share of a query's attention that the ``profiled`` statistic asks to cover."""
PROFILE_TOKENS = 512
"""Tokens of the calibration text used by :func:`profile`."""
PROFILE_VERSION = 1
"""Bump when the profile statistic changes, so that cached profiles are measured again."""


@dataclass(frozen=True)
class CoverageParams:
    start: int = 0
    """Queries at earlier positions are not counted."""


class Coverage(Policy):
    """Measures, without evicting, the ``profiled`` statistic of one layer (see :func:`profile`)."""

    name = "coverage"
    paper = "kvsieve's layer profile"
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
    from kvsieve.data import builtin_text

    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"no tokenizer saved with the model ({model.name_or_path!r}); pass one to "
                "kvsieve.profiling.profile(model, tokenizer) and give make_cache its weights"
            ) from err
    text = builtin_text(min_chars=tokens * 6) if text is None else text
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < 32:
        raise ValueError(f"the calibration text has {ids.shape[1]} tokens; a profile needs at least 32")
    path = _profile_path(model, ids)
    if path.is_file():
        return json.loads(path.read_text())["weights"]
    cache = SieveCache.for_model(model, Coverage, Coverage.make_params(start=ids.shape[1] // 2), None)
    use_kvsieve_attention(model)
    with torch.inference_mode():
        model(ids.to(model.device), cache=cache, use_cache=True)
    weights = [layer.policy.value for layer in cache.layers if not layer.is_sliding]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"model": model.name_or_path, "tokens": ids.shape[1], "weights": weights}, indent=1))
    tmp.replace(path)
    return weights


def _profile_path(model: PreTrainedModel, ids: torch.Tensor) -> Path:
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
