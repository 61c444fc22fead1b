"""A cache's memory, known before it runs (what the server admits requests against, what a RULER sample's settings
are grouped by), a recorded prompt pass's, and the memory free for them.

A request runs alone in its own :class:`~kvsieve.engine.cache.SieveCache` (batch 1). Each layer allocates slots
of ``kv_heads × (2 × head_dim × dtype bytes + 8 + policy state bytes)``: the keys and values (quantized slots: their
codes, scales and zeros, plus the residual's exact copies per layer: :mod:`kvsieve.engine.quant`), the slot's
original position (int64) and the policy's per-slot state. The slot count follows the engine's growth rule
(:func:`~kvsieve.engine.storage.grown_capacity`): a bounded layer never holds more than ``budget + 1`` slots
between steps; an unbounded one (``full``) grows with the tokens fed. The prefill of a prompt longer than a bounded
layer's slots holds the prompt in one layer at a time, until that layer's eviction gathers it into ``budget + 1``
slots: the *peak* reservation adds that prompt-sized buffer, held until the prefill ends. Where the heads keep their
own counts (``heads=adakv``) the keys and values are as many bytes, packed; positions and state have a slot axis as
long as the largest head's, counted at its bound, one head holding the layer's whole budget (so ``steady`` bounds
what such a cache holds, where it is exact otherwise). A policy scored by probes
(``kvzip``) holds the prompt in every layer, and a probe's tokens besides (counted as the prompt's again), until it
compresses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvsieve.engine.cache import SieveCache
from kvsieve.engine.storage import grown_capacity

POSITION_BYTES = torch.empty((), dtype=torch.long).element_size()


@dataclass(frozen=True)
class Reservation:
    """Bytes a request's cache may hold: ``steady`` (every decode step), ``peak`` (during its prefill).
    ``layout``: what another cache must share to decode in one batch with it (policy, parameters, budgets in tokens,
    slot quantization);
    ``fixed``: every layer holds ``budget + 1`` slots once the request evicts, so its rows, padded to a batch's
    slots, never hold more than ``steady`` (otherwise the slots grow with the tokens fed)."""

    steady: int
    peak: int
    layout: str = ""
    fixed: bool = False


def kv_geometry(model: PreTrainedModel) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of ``model``'s attention layers."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def reservation(model: PreTrainedModel, cache: SieveCache, prompt_tokens: int, max_tokens: int) -> Reservation:
    """What ``cache`` (made for ``model``, budget resolved) holds at most for a prompt of ``prompt_tokens`` and
    ``max_tokens`` generated tokens (the last one is never fed back)."""
    policies = cache.plan.resolve(prompt_tokens)
    kv_heads, head_dim = kv_geometry(model)
    kv_bytes = cache.codec.slot_bytes(head_dim, model.dtype)
    fixed_bytes = cache.codec.fixed_bytes(head_dim, model.dtype, kv_heads)
    fed = prompt_tokens + max_tokens - 1
    steady, transient, held, fixed = 0, 0, 0, True
    probed = any(policy.probed for policy in policies)
    for policy in policies:
        state = sum(math.prod(extra) * dtype.itemsize for extra, dtype in policy.state_spec().values())
        slot = kv_heads * (kv_bytes + POSITION_BYTES + state)
        limit = policy.budget + 1 if policy.bounded else math.inf
        capacity = final_capacity(prompt_tokens, fed, limit)
        steady += capacity * slot + POSITION_BYTES + fixed_bytes  # (+ the row's newest position)
        if policy.allocates_heads and fed >= limit:  # (positions and state: as many slots as its largest head)
            steady += (kv_heads * policy.budget + 1 - capacity) * kv_heads * (POSITION_BYTES + state)
        fixed &= capacity == limit
        if prompt_tokens > limit:
            transient = max(transient, prompt_tokens * slot)
        held += 2 * prompt_tokens * slot  # (probed: the prompt and a probe in every layer)
    if probed:
        transient = max(transient, held - steady)
    layout = repr((cache.plan.layer_policies, cache.budgets, cache.rolling, cache.codec))
    return Reservation(steady=steady, peak=steady + transient, layout=layout, fixed=fixed)


def recorded_pass_bytes(model: PreTrainedModel, tokens: int) -> int:
    """Bytes the recording of a prompt pass of ``tokens`` holds (:class:`~kvsieve.engine.shared.RecordedPass`): each
    layer's queries, keys and values, in the model's dtype."""
    config = model.config.get_text_config()
    kv_heads, head_dim = kv_geometry(model)
    per_token = (config.num_attention_heads + 2 * kv_heads) * head_dim * model.dtype.itemsize
    return config.num_hidden_layers * tokens * per_token


def final_capacity(prompt_tokens: int, fed: int, limit: int | float) -> int:
    """Slots a layer of slot limit ``limit`` holds after a prompt of ``prompt_tokens`` and one token at a time up to
    ``fed`` tokens: ``limit`` once it evicts, else what the growth rule reached."""
    capacity = grown_capacity(prompt_tokens, limit)
    for needed in range(prompt_tokens + 1, fed + 1):
        if needed > capacity:
            capacity = grown_capacity(needed, limit)
    return capacity if fed < limit else int(limit)


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: a GPU's free memory, the host's available memory (Linux's
    ``MemAvailable``); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024
