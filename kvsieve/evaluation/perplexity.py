"""Perplexity of a text streamed through an evicting cache (the "prefill" protocol).

The first ``prefill`` tokens are processed in one forward pass with full attention among themselves (their
predictions are scored from that pass), the cache is then compressed to the budget, and every remaining token is
fed one at a time, so each later prediction sees only what the policy kept.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from kvsieve.api import make_cache
from kvsieve.engine.budget import Budget, resolve_budget
from kvsieve.engine.cache import SieveCache

ENGINES = ("whole", "decode")
WHOLE_CHUNK = 256  # tokens per forward pass of the whole-sequence engine (bounds the logits' memory)


@dataclass
class PerplexityResult:
    policy: str
    engine: str
    budget_tokens: int | None
    prefill_tokens: int
    tokens_scored: int
    ppl: float
    nll: float
    kv_slots_max: int
    kv_bytes: int
    state_bytes: int
    seconds: float
    stream_tok_s: float
    curve: list[dict[str, float]] = field(default_factory=list)
    """With ``curve_every``: per interval, tokens scored so far, the interval's perplexity, RSS and KV bytes."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def stream_logits(
    model: PreTrainedModel, cache: SieveCache, ids: torch.Tensor, engine: str = "whole", progress: bool = False
) -> Iterator[tuple[int, torch.Tensor]]:
    """Feed ``ids`` (``[B, n]``) through ``cache`` one token at a time; yield ``(offset, logits [B, c, V])``.

    ``engine="decode"`` runs one forward pass per token. ``engine="whole"`` runs a few long forward passes with the
    cache streaming (:meth:`~kvsieve.engine.cache.SieveCache.streaming`), so each layer performs the per-token cache
    work internally: the same logits (the "stream" protocol), many times faster.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    chunk = WHOLE_CHUNK if engine == "whole" else 1
    with (
        cache.streaming(),
        tqdm(
            total=ids.shape[1], desc=f"{cache.policy_name} {engine}", unit="tok", disable=not progress, leave=False
        ) as bar,
    ):
        for start in range(0, ids.shape[1], chunk):
            logits = model(ids[:, start : start + chunk], past_key_values=cache, use_cache=True).logits
            bar.update(logits.shape[1])
            yield start, logits


@torch.inference_mode()
def stream_perplexity(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    policy: str = "h2o",
    budget: Budget = 0.2,
    prefill: int | None = None,
    engine: str = "whole",
    progress: bool = True,
    rolling: bool = False,
    curve_every: int | None = None,
    **policy_kwargs: Any,
) -> tuple[PerplexityResult, SieveCache]:
    """Perplexity of ``input_ids`` (``[1, L]`` or ``[L]``) under ``policy`` at ``budget``.

    ``budget`` may be a ratio of ``L``. The first ``prefill`` tokens (default: the budget) are processed in one
    pass with full attention among themselves; every later token is streamed through the evicting cache
    (``engine``: see :func:`stream_logits`). ``rolling``: position rolling (see :func:`kvsieve.make_cache`), for
    texts longer than the model's positions. ``curve_every``: record a point of the curve every that many streamed
    tokens (rounded up to the engine's chunk). Returns the result and the cache (which has seen all but the last
    token).
    """
    ids = input_ids.reshape(1, -1).to(model.device)
    length = ids.shape[1]
    if length < 2:
        raise ValueError(f"need at least 2 tokens to score, got {length}")
    budget_tokens = resolve_budget(budget, length)
    if prefill is None and budget_tokens >= length:
        raise ValueError(
            f"the text has {length} tokens and the budget is {budget_tokens}: nothing would be evicted (the prefill "
            "defaults to the budget and must be shorter than the text); use a smaller budget, more tokens of text, "
            f"or a prefill below {length}"
        )
    prefill = budget_tokens if prefill is None else prefill
    if not 1 <= prefill < length:
        raise ValueError(f"prefill must be in [1, {length - 1}] for a text of {length} tokens, got {prefill}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    cache = make_cache(model, policy, budget_tokens, rolling=rolling, **policy_kwargs)
    start = time.perf_counter()
    logits = model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits
    nll = _nll(logits, ids[:, 1 : prefill + 1])
    stream_start = time.perf_counter()
    rest = ids[:, prefill : length - 1]
    curve: list[dict[str, float]] = []
    interval_nll, interval_tokens = 0.0, 0
    for offset, chunk_logits in stream_logits(model, cache, rest, engine, progress):
        first = prefill + 1 + offset
        chunk_nll = _nll(chunk_logits, ids[:, first : first + chunk_logits.shape[1]])
        nll += chunk_nll
        interval_nll += chunk_nll.item()
        interval_tokens += chunk_logits.shape[1]
        if curve_every and (interval_tokens >= curve_every or first + chunk_logits.shape[1] == length):
            point = {"tokens": first + chunk_logits.shape[1] - 1, "ppl": math.exp(interval_nll / interval_tokens)}
            curve.append(point | {"rss_mb": rss_mb(), "kv_bytes": cache.kv_nbytes()})
            interval_nll, interval_tokens = 0.0, 0
    end = time.perf_counter()
    scored = length - 1
    mean = nll.item() / scored
    result = PerplexityResult(
        policy=cache.policy_name,
        engine=engine,
        budget_tokens=cache.budget_tokens,
        prefill_tokens=prefill,
        tokens_scored=scored,
        ppl=math.exp(mean),
        nll=mean,
        kv_slots_max=max(cache.slot_counts()),
        kv_bytes=cache.kv_nbytes(),
        state_bytes=cache.state_nbytes(),
        seconds=end - start,
        stream_tok_s=rest.shape[1] / (end - stream_start) if rest.shape[1] else float("nan"),
        curve=curve,
    )
    return result, cache


def rss_mb() -> float:
    """Resident memory of this process in MiB (current on Linux, peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
