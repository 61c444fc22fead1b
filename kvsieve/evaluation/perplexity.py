"""Perplexity of a text streamed through an evicting cache (the "prefill" protocol).

The first ``prefill`` tokens are processed in one forward pass with full attention among themselves (their
predictions are scored from that pass), the cache is then compressed to the budget, and every remaining token is
fed one at a time, so each later prediction sees only what the policy kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from kvsieve.api import make_cache
from kvsieve.engine.budget import Budget, resolve_budget
from kvsieve.engine.cache import SieveCache


@dataclass
class PerplexityResult:
    policy: str
    budget_tokens: int | None
    prefill_tokens: int
    tokens_scored: int
    ppl: float
    nll: float
    kv_slots_max: int
    kv_bytes: int
    state_bytes: int
    seconds: float
    decode_tok_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


@torch.inference_mode()
def stream_perplexity(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    policy: str = "h2o",
    budget: Budget = 0.2,
    prefill: int | None = None,
    progress: bool = True,
    cache: SieveCache | None = None,
    **policy_kwargs: Any,
) -> tuple[PerplexityResult, SieveCache]:
    """Perplexity of ``input_ids`` (``[1, L]`` or ``[L]``) under ``policy`` at ``budget``.

    ``budget`` may be a ratio of ``L``. ``prefill`` defaults to the budget (in tokens), so that the prompt pass
    fits the budget and eviction starts with the first streamed token. Returns the result and the cache (which has
    seen every token but the last).
    """
    ids = input_ids.reshape(1, -1).to(model.device)
    length = ids.shape[1]
    if length < 2:
        raise ValueError(f"need at least 2 tokens to score, got {length}")
    budget_tokens = resolve_budget(budget, length)
    prefill = budget_tokens if prefill is None else prefill
    if not 1 <= prefill < length:
        raise ValueError(f"prefill must be in [1, {length - 1}] for a text of {length} tokens, got {prefill}")
    if cache is None:
        cache = make_cache(model, policy, budget_tokens, **policy_kwargs)
    start = time.perf_counter()
    logits = model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits
    nll = _nll(logits[:, :-1], ids[:, 1:prefill])
    nll += _nll(logits[:, -1:], ids[:, prefill : prefill + 1])
    decode_start = time.perf_counter()
    steps = range(prefill, length - 1)
    for i in tqdm(steps, desc=f"{cache.policy_name} ppl", unit="tok", disable=not progress, leave=False):
        logits = model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits
        nll += _nll(logits, ids[:, i + 1 : i + 2])
    end = time.perf_counter()
    scored = length - 1
    mean = nll.item() / scored
    result = PerplexityResult(
        policy=cache.policy_name,
        budget_tokens=cache.budget_tokens,
        prefill_tokens=prefill,
        tokens_scored=scored,
        ppl=math.exp(mean),
        nll=mean,
        kv_slots_max=max(cache.slot_counts()),
        kv_bytes=cache.kv_nbytes(),
        state_bytes=cache.state_nbytes(),
        seconds=end - start,
        decode_tok_s=len(steps) / (end - decode_start) if len(steps) else float("nan"),
    )
    return result, cache
