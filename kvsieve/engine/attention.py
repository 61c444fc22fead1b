"""The ``kvsieve`` attention implementation, plugged in through transformers' public interfaces.

- ``AttentionMaskInterface``: :func:`sieve_mask` keeps the 2-D padding mask (which tokens of the batch are real)
  instead of building a dense ``[q, kv]`` mask; the dense sdpa mask is only built, lazily, when the attention runs
  over an ordinary transformers cache.
- ``AttentionInterface``: :func:`sieve_attention`. Transformers calls ``cache.update(k, v, layer_idx)`` right
  before the attention of that layer but does not pass the cache to the attention function, so an evicting cache
  layer *hands over* itself and the key tensor it returned (:func:`hand_over`). The attention function takes the
  hand-over only if it receives that very key tensor, and then lets the layer run the step
  (:meth:`kvsieve.engine.cache.SieveLayer.attend`): masked attention over the kept slots, the policy's view of
  the probabilities, and eviction. Without a hand-over (e.g. a ``DynamicCache``) it is transformers' sdpa.

:func:`slot_attention` is the attention over slots itself: keys carry their original positions, so causality,
padding and sliding windows are all ``key_pos <= query_pos`` comparisons, per (batch row, KV head).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvsieve.policies.base import Observation, visible_slots

ATTN_IMPLEMENTATION = "kvsieve"

# Elements of one fp32 block of attention logits ([B, Hq, rows, N]); queries are processed in row blocks so
# memory grows with rows·N, never q·N for long prompts. 8 MiB blocks stay in cache: at 4,096 tokens the explicit
# attention of a 2^21-element block runs 2x faster than of a 2^25 one (one CPU thread).
BLOCK_ELEMENTS = 1 << 21
MIN_BLOCK_ROWS = 16  # a floor, so that large batches over long caches do not loop over single rows


class UnsupportedModelError(RuntimeError):
    """The model does not route its attention through the transformers interfaces kvsieve relies on."""


@dataclass(eq=False)
class SieveMask:
    """What :func:`sieve_mask` returns: the padding mask, plus the dense sdpa mask on demand."""

    padding: torch.Tensor | None
    """``[B, seen + q]`` bool (True = real token), or None when every token is real."""
    dense_kwargs: dict[str, Any] = field(repr=False)

    def new_tokens(self, q: int) -> torch.Tensor | None:
        """``[B, q]`` validity of the step's ``q`` new tokens (None = all real)."""
        return None if self.padding is None else self.padding[:, -q:]

    @cached_property
    def dense(self) -> torch.Tensor | None:
        """The mask transformers' sdpa attention would get (for caches that are not kvsieve's)."""
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**self.dense_kwargs)


def sieve_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> SieveMask:
    """Mask function registered under ``"kvsieve"`` (same signature as transformers' mask functions)."""
    padding = attention_mask
    if padding is not None:
        padding = padding.to(torch.bool)
        if bool(padding.all()):
            padding = None
    return SieveMask(padding=padding, dense_kwargs={"attention_mask": attention_mask, **kwargs})


class _HandOver(threading.local):
    layer: Any = None
    keys: torch.Tensor | None = None


_HAND_OVER = _HandOver()


def hand_over(layer: Any, keys: torch.Tensor) -> None:
    """Called by an evicting cache layer's ``update``: the next attention call over ``keys`` belongs to it."""
    _HAND_OVER.layer, _HAND_OVER.keys = layer, keys


def _take_hand_over(keys: torch.Tensor) -> Any:
    layer, expected = _HAND_OVER.layer, _HAND_OVER.keys
    _HAND_OVER.layer = _HAND_OVER.keys = None
    if layer is None:
        return None
    if keys is not expected:
        raise UnsupportedModelError(
            f"the attention of layer {layer.layer_idx} did not receive the keys its kvsieve cache layer returned "
            "(the model transforms cached keys between cache.update() and attention); this architecture is not "
            "supported by kvsieve"
        )
    return layer


def sieve_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: SieveMask | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered under ``"kvsieve"`` (transformers' attention-interface signature)."""
    layer = _take_hand_over(key)
    if layer is None:
        dense = attention_mask.dense if isinstance(attention_mask, SieveMask) else attention_mask
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module,
            query,
            key,
            value,
            dense,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            **kwargs,
        )
    if attention_mask is not None and not isinstance(attention_mask, SieveMask):
        raise ValueError(
            "kvsieve caches take a 2-D attention_mask (batch, tokens) or none; a prepared 4-D mask cannot be "
            "applied to evicted slots"
        )
    padding = None if attention_mask is None else attention_mask.new_tokens(query.shape[-2])
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = layer.attend(query, key, value, padding=padding, scaling=scale, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the ``"kvsieve"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, sieve_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sieve_mask)


def slot_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    scaling: float,
    window: int | None = None,
    observe: Callable[[Observation], None] | None = None,
    narrow: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    restrict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    all_visible: bool = False,
    causal_tail: bool = False,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, q, D]`` over slots ``key``/``value`` ``[B, Hkv, N, D]``.

    ``key_pos`` ``[B, Hkv, N]`` and ``query_pos`` ``[B, q]`` are original positions (-1 = empty/padding). When
    ``observe`` is given, the logits and fp32 probabilities are computed explicitly and passed block by block as an
    :class:`~kvsieve.policies.base.Observation`; otherwise torch's fused ``scaled_dot_product_attention`` runs
    and no probabilities exist. With ``observe``, ``narrow(logits, allowed)`` may restrict each query head's keys
    further (see :meth:`~kvsieve.policies.base.Policy.narrow`). ``restrict(key_pos, query_pos)`` (a position-only
    ``[B, Hkv, b, N]`` mask) restricts what real queries see. ``all_visible``: the caller guarantees that every
    query is real and may attend to every slot (a decode step over real tokens without a window), so no mask is
    built. ``causal_tail``: the last ``q`` slots hold the queries' own tokens in query order (a step's new
    tokens), so a block of query rows is computed over the slots up to its own last token only — the later ones
    are invisible to it — and its observation covers those slots only (``Observation.key_pos`` says how many).
    Returns ``[B, Hq, q, D]``.
    """
    bsz, n_q_heads, q_len, head_dim = query.shape
    n_kv_heads, n_slots = key.shape[1], key.shape[2]
    group = n_q_heads // n_kv_heads
    rows = max(MIN_BLOCK_ROWS, BLOCK_ELEMENTS // max(1, bsz * n_q_heads * n_slots))
    # With one head layout (one KV head, or every head holding the same tokens in the same slots, as after a
    # fresh prompt), the sdpa mask broadcasts over heads instead of being copied per query head.
    shared_layout = q_len > 1 and (n_kv_heads == 1 or bool((key_pos == key_pos[:, :1]).all()))
    # Observed prompt blocks whose earlier slots are all real and unrestricted need a mask on their diagonal only.
    diagonal_only = (
        observe is not None
        and causal_tail
        and q_len > 1
        and window is None
        and narrow is None
        and restrict is None
        and bool((key_pos >= 0).all())
    )
    # Keys transposed once for the explicit logits, contiguous for a prompt: its matmuls run ~1.5x faster. The
    # explicit products are batched over (row, KV head) pairs (bmm: faster than a 4-D matmul for a decode step).
    key_t = values_3d = None
    if observe is not None:
        key_t = key.transpose(-1, -2)
        key_t = (key_t.contiguous() if q_len > 1 else key_t).reshape(bsz * n_kv_heads, head_dim, n_slots)
        values_3d = value.reshape(bsz * n_kv_heads, n_slots, -1)
    outputs = []
    for start in range(0, q_len, rows):
        end = min(q_len, start + rows)
        b = end - start
        cols = n_slots - q_len + end if causal_tail else n_slots
        q_blk, qp = (query, query_pos) if b == q_len else (query[:, :, start:end], query_pos[:, start:end])
        k_blk, v_blk, kp = (
            (key, value, key_pos) if cols == n_slots else (key[:, :, :cols], value[:, :, :cols], key_pos[:, :, :cols])
        )
        allowed = None if all_visible or diagonal_only else visible_slots(kp, qp, window)
        if restrict is not None:
            allowed = allowed & (restrict(kp, qp) | (qp < 0)[:, None, :, None])
        if observe is not None:
            q_fold = (q_blk * scaling).reshape(bsz * n_kv_heads, group * b, head_dim)
            logits = torch.bmm(q_fold, key_t if cols == n_slots else key_t[..., :cols])
            logits = logits.float().view(bsz, n_kv_heads, group, b, cols)
            if narrow is not None:
                allowed = visible_slots(kp, qp, window) if allowed is None else allowed
                logits.masked_fill_(~narrow(logits, allowed), float("-inf"))
            elif allowed is not None:
                logits.masked_fill_(~allowed[:, :, None], float("-inf"))
            elif diagonal_only:
                diagonal = visible_slots(kp[:, :, cols - b :], qp)
                logits[..., cols - b :].masked_fill_(~diagonal[:, :, None], float("-inf"))
            probs = logits.softmax(dim=-1)
            weights = probs.view(bsz * n_kv_heads, group * b, cols).to(value.dtype)
            out = torch.bmm(weights, values_3d if cols == n_slots else values_3d[:, :cols])
            out = out.view(bsz, n_q_heads, b, -1)
            summed = probs.sum(dim=2)
            if not (all_visible or diagonal_only):  # (otherwise no query is padding)
                summed.mul_((qp >= 0)[:, None, :, None])
            observe(Observation(summed, logits, qp, q_len, key_pos=kp, window=window, mask=allowed))
        elif b == 1:
            # Decode: fold the group's query heads into the query axis; the per-KV-head mask then broadcasts.
            q_fold = q_blk.reshape(bsz, n_kv_heads, group, head_dim)
            out = F.scaled_dot_product_attention(q_fold, k_blk, v_blk, attn_mask=allowed, scale=scaling)
            out = out.reshape(bsz, n_q_heads, 1, -1)
        else:
            if allowed is not None:
                allowed = allowed[:, :1] if shared_layout else allowed.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(
                q_blk, k_blk, v_blk, attn_mask=allowed, scale=scaling, enable_gqa=group > 1
            )
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
