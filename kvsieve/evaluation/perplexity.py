"""Perplexity of a text under an evicting cache, in either protocol (each result says which):

- ``stream`` (:func:`stream_perplexity`, the H2O paper's): the first ``prefill`` tokens are processed in one forward
  pass with full attention among themselves (their predictions are scored from that pass), the cache is then
  compressed to the budget, and every remaining token is fed one at a time, so each later prediction sees only what
  the policy kept;
- ``prefill`` (:func:`context_perplexity`, the protocol of AhaKV, SnapKV and kvpress): a context is compressed once
  to the budget, then the continuation is read in one forward pass over the compressed context (its tokens see the
  kept context and each other) and only its predictions are scored.
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
    """``whole`` or ``decode`` (stream protocol), ``once`` (prefill protocol)."""
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
    protocol: str = "stream"
    """``stream`` or ``prefill`` (see the module docs)."""

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
            logits = model(ids[:, start : start + chunk], cache=cache, use_cache=True).logits
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
    logits = model(ids[:, :prefill], cache=cache, use_cache=True).logits
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


@torch.inference_mode()
def context_perplexity(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    policy: str = "h2o",
    budget: Budget = 0.2,
    context: int | None = None,
    **policy_kwargs: Any,
) -> tuple[PerplexityResult, SieveCache]:
    """Perplexity of the continuation of ``input_ids`` (``[1, L]`` or ``[L]``) after its first ``context`` tokens
    (default ``2L/3``) were compressed once to ``budget`` (a ratio is of ``context``): the prefill protocol.

    The continuation is read in one forward pass, so nothing is evicted while it is scored: its tokens see the kept
    context and each other. Only the continuation's predictions are scored (the ``L - 1 - context`` tokens after
    the first continuation token: the context's last prediction precedes any compression).
    """
    ids = input_ids.reshape(1, -1).to(model.device)
    length = ids.shape[1]
    context = 2 * length // 3 if context is None else context
    if not 1 <= context <= length - 2:
        raise ValueError(f"context must be in [1, {length - 2}] for a text of {length} tokens, got {context}")
    cache = make_cache(model, policy, resolve_budget(budget, context), **policy_kwargs)
    start = time.perf_counter()
    model(ids[:, :context], cache=cache, use_cache=True)
    kv_slots = max(cache.slot_counts())
    kv_bytes, state_bytes = cache.kv_nbytes(), cache.state_nbytes()
    logits = model(ids[:, context:-1], cache=cache, use_cache=True).logits
    scored = length - 1 - context
    mean = _nll(logits, ids[:, context + 1 :]).item() / scored
    result = PerplexityResult(
        policy=cache.policy_name,
        engine="once",
        budget_tokens=cache.budget_tokens,
        prefill_tokens=context,
        tokens_scored=scored,
        ppl=math.exp(mean),
        nll=mean,
        kv_slots_max=kv_slots,
        kv_bytes=kv_bytes,
        state_bytes=state_bytes,
        seconds=time.perf_counter() - start,
        stream_tok_s=float("nan"),
        protocol="prefill",
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
