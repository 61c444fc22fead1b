"""Attention over one layer's slots.

Keys carry their original positions, so causality, padding and sliding windows are all ``key_pos <= query_pos``
comparisons, per (batch row, KV head) — one mask helper, :func:`visible`. Two paths use it:

- :func:`fused_attention`: torch's ``scaled_dot_product_attention``, when nothing needs the probabilities (the
  decode steps of every policy that does not observe attention);
- :func:`observed_attention`: explicit logits and probabilities, handed to the policy block by block as an
  :class:`~kvsieve.policies.base.Observation`; also for what the fused kernel cannot do (logit soft-capping,
  attention sinks) and for ``output_attentions``.

Long prompts are attended in blocks of query rows (:data:`BLOCK_ELEMENTS` logits each), so memory grows with
``rows × slots``, never ``prompt²``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from kvsieve.engine.packed import packed_logits, packed_output
from kvsieve.engine.quant import recent
from kvsieve.engine.storage import PackedView
from kvsieve.policies.base import Observation, group_sum, visible_slots

# Elements of one fp32 block of attention logits ([B, Hq, rows, N]); queries are processed in row blocks so
# memory grows with rows·N, never q·N for long prompts. 8 MiB blocks stay in cache: at 4,096 tokens the explicit
# attention of a 2^21-element block runs 2x faster than of a 2^25 one (one CPU thread).
BLOCK_ELEMENTS = 1 << 21
MIN_BLOCK_ROWS = 16  # a floor, so that large batches over long caches do not loop over single rows
T = TypeVar("T")


@dataclass(frozen=True)
class AttentionArgs:
    """What one layer's attention over slots computes, from the arguments the model passed."""

    scaling: float
    window: int | None = None
    """Sliding window: a query at ``p`` sees keys at ``> p - window`` (None = all earlier keys)."""
    softcap: float | None = None
    """Logit soft-capping (Gemma 2): logits become ``softcap · tanh(logits / softcap)`` before masking."""
    sinks: torch.Tensor | None = None
    """``[Hq]`` attention-sink logits (GPT-OSS): one more term per query head in the softmax denominator."""
    weights: bool = False
    """Whether to return the attention probabilities (``output_attentions=True``)."""

    @property
    def explicit(self) -> bool:
        """Whether the logits must be computed explicitly (the fused kernel has none of these)."""
        return self.softcap is not None or self.sinks is not None or self.weights


@dataclass(frozen=True)
class Exact:
    """Quantized slots: the slots' exact keys and values ``[B, Hkv, N, D]`` (meaningful within the residual), read
    instead of the dequantized ones by each query within ``residual`` positions of the token
    (:func:`kvsieve.engine.quant.recent`)."""

    keys: torch.Tensor
    values: torch.Tensor
    residual: int


@dataclass(frozen=True)
class Visibility:
    """What the step's queries may see beyond causality, padding and the window."""

    restrict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """``restrict(key_pos, query_pos)``: a position-only ``[B, Hkv, b, N]`` mask of what real queries see (the
    stream protocol's closed form)."""
    all_visible: bool = False
    """Every query is real and may attend to every slot (a decode step over real tokens without a window): no mask
    is built."""
    causal_tail: bool = False
    """The last ``q`` slots hold the queries' own tokens in query order, so a block of query rows is computed over
    the slots up to its own last token only (the later ones are invisible to it), and observed over those only."""


def weighted_values(
    weights: torch.Tensor,
    values: torch.Tensor,
    exact_values: torch.Tensor | None = None,
    band: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weights`` ``[B, Hkv, G, q, N]`` times ``values`` ``[B·Hkv, N, D]`` → ``[B·Hkv, G·q, D]``. Quantized slots
    with ``exact_values``: the weights where ``band`` ``[B, Hkv, 1, q, N]`` is set (each query's recent slots) weigh
    those instead."""
    bsz, heads, n = weights.shape[0], weights.shape[1], weights.shape[-1]

    def product(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(w.reshape(bsz * heads, -1, n), v)

    if exact_values is None:
        return product(weights, values)
    return product(torch.where(band, 0, weights), values) + product(torch.where(band, weights, 0), exact_values)


def visible(
    key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None, seen: Visibility
) -> torch.Tensor | None:
    """``[B, Hkv, b, N]``: the slots each query may attend to, or None when it may attend to every slot."""
    if seen.all_visible:
        return None
    allowed = visible_slots(key_pos, query_pos, window)
    if seen.restrict is not None:
        allowed &= seen.restrict(key_pos, query_pos) | (query_pos < 0)[:, None, :, None]
    return allowed


def prompt_only(keys: torch.Tensor, query_pos: torch.Tensor, window: int | None, seen: Visibility) -> bool:
    """Whether the slots are the queries' own tokens (as many: a step's tokens go after the slots held, in order),
    all real, and nothing but causality limits what they see — a prompt over an empty layer, whose whole mask is
    the plain causal one."""
    q_len = query_pos.shape[1]
    return (
        q_len > 1
        and keys.shape[2] == q_len
        and window is None
        and seen.restrict is None
        and bool((query_pos >= 0).all())
    )


@dataclass
class _Block:
    """Query rows ``start:end`` and the slots they are computed over (the first ``cols``)."""

    start: int
    end: int
    query: torch.Tensor
    query_pos: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    key_pos: torch.Tensor

    @property
    def cols(self) -> int:
        return self.keys.shape[2]


def _blocks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    causal_tail: bool,
) -> Iterator[_Block]:
    bsz, n_q_heads, q_len, _ = query.shape
    n_slots = keys.shape[2]
    rows = max(MIN_BLOCK_ROWS, BLOCK_ELEMENTS // max(1, bsz * n_q_heads * n_slots))
    for start in range(0, q_len, rows):
        end = min(q_len, start + rows)
        cols = n_slots - q_len + end if causal_tail else n_slots
        q_blk, qp = (query, query_pos) if end - start == q_len else (query[:, :, start:end], query_pos[:, start:end])
        if cols == n_slots:
            yield _Block(start, end, q_blk, qp, keys, values, key_pos)
        else:
            yield _Block(start, end, q_blk, qp, keys[:, :, :cols], values[:, :, :cols], key_pos[:, :, :cols])


def _folds_on(query: torch.Tensor) -> bool:
    """Whether a single-query step folds the query heads of a group into the query axis even when it needs no
    mask: on the CPU in bf16 and fp16, where torch's kernel attends one query row per head 6 to 10 times slower
    than a group's rows per KV head (``scripts/ruler_cost.py``'s decode steps; in fp32 the per-head call, about
    half as fast there, is kept: the published fp32 grids were answered with it)."""
    return query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)


def fused_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    args: AttentionArgs,
    seen: Visibility,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, q, D]`` over slots ``keys``/``values`` ``[B, Hkv, N, D]`` whose tokens are at
    ``key_pos`` ``[B, Hkv, N]``, for queries at ``query_pos`` ``[B, q]`` (-1 = empty/padding), with torch's fused
    kernel. Returns ``[B, Hq, q, D]``."""
    bsz, n_q_heads, q_len, head_dim = query.shape
    n_kv_heads = keys.shape[1]
    group = n_q_heads // n_kv_heads
    if q_len == 1:
        allowed = visible(key_pos, query_pos, args.window, seen)
        if allowed is None and not _folds_on(query):  # (per query head: more work items than per KV head)
            return F.scaled_dot_product_attention(query, keys, values, scale=args.scaling, enable_gqa=group > 1)
        # Fold the group's query heads into the query axis: the per-KV-head mask then broadcasts.
        q_fold = query.reshape(bsz, n_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(q_fold, keys, values, attn_mask=allowed, scale=args.scaling)
        return out.reshape(bsz, n_q_heads, 1, -1)
    if prompt_only(keys, query_pos, args.window, seen):
        # The kernel's own causal mask, over the whole prompt at once (its memory stays O(n·block) too).
        return F.scaled_dot_product_attention(
            query, keys, values, is_causal=True, scale=args.scaling, enable_gqa=group > 1
        )
    # With one head layout (one KV head, or every head holding the same tokens in the same slots, as after a
    # fresh prompt), the mask broadcasts over heads instead of being copied per query head.
    shared_layout = q_len > 1 and (n_kv_heads == 1 or bool((key_pos == key_pos[:, :1]).all()))
    outputs = []
    for blk in _blocks(query, keys, values, key_pos, query_pos, seen.causal_tail):
        allowed = visible(blk.key_pos, blk.query_pos, args.window, seen)
        if allowed is not None:
            allowed = allowed[:, :1] if shared_layout else allowed.repeat_interleave(group, dim=1)
        outputs.append(
            F.scaled_dot_product_attention(
                blk.query, blk.keys, blk.values, attn_mask=allowed, scale=args.scaling, enable_gqa=group > 1
            )
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def decided_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    decide: Callable[[torch.Tensor], tuple[torch.Tensor, T]],
) -> tuple[torch.Tensor, T]:
    """A decode step's attention (``query`` ``[B, Hq, 1, D]``, every slot visible) whose probabilities come from
    ``decide(logits)`` → ``(probs, decision)``, logits and probabilities ``[B, Hkv, G, N]`` (fp32, fp64 for a fp64
    model). Returns the output ``[B, Hq, 1, D]`` and the decision."""
    bsz, n_q_heads, _, head_dim = query.shape
    n_kv_heads, n_slots = keys.shape[1], keys.shape[2]
    group = n_q_heads // n_kv_heads
    q_fold = (query * scaling).reshape(bsz * n_kv_heads, group, head_dim)
    key_t = keys.transpose(-1, -2).reshape(bsz * n_kv_heads, head_dim, n_slots)
    precision = torch.promote_types(query.dtype, torch.float32)
    logits = torch.bmm(q_fold, key_t).to(precision).view(bsz, n_kv_heads, group, n_slots)
    probs, decision = decide(logits)
    out = weighted_values(probs.to(values.dtype), values.reshape(bsz * n_kv_heads, n_slots, -1))
    return out.view(bsz, n_q_heads, 1, -1), decision


@functools.cache
def _everything(device: torch.device) -> torch.Tensor:
    """A 0-dim True on ``device``: expanded, the mask of a step whose queries see every slot (a view, not built)."""
    with torch.inference_mode(False):  # (usable outside inference mode as well)
        return torch.ones((), dtype=torch.bool, device=device)


def observed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    args: AttentionArgs,
    seen: Visibility,
    observe: Callable[[Observation], None] | None = None,
    narrow: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    exact: Exact | None = None,
    step_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention of :func:`fused_attention`, computed explicitly: logits and probabilities in fp32 (fp64 for a
    fp64 model), soft-capped and with sinks as ``args`` say. ``observe`` gets each block of rows as an
    :class:`~kvsieve.policies.base.Observation`; ``narrow(logits, allowed)`` may restrict each query head's keys
    among the slots of earlier steps, the first ``N - step_rows`` (see :meth:`~kvsieve.policies.base.Policy.narrow`:
    the step's own slots, the last ones, are attended as allowed); with ``exact``, each query reads its recent slots'
    exact keys and values; ``step_rows``: the step's query rows when ``query`` holds its last rows only (the
    observations' :attr:`~kvsieve.policies.base.Observation.step_rows`). Returns the output ``[B, Hq, q, D]`` and, with
    ``args.weights``, the probabilities ``[B, Hq, q, N]``."""
    bsz, n_q_heads, q_len, head_dim = query.shape
    n_kv_heads, n_slots = keys.shape[1], keys.shape[2]
    group = n_q_heads // n_kv_heads
    precision = torch.promote_types(query.dtype, torch.float32)
    # Prompt blocks whose earlier slots are all real and unrestricted need a mask on their diagonal only.
    diagonal_only = (
        seen.causal_tail
        and q_len > 1
        and args.window is None
        and narrow is None
        and seen.restrict is None
        and bool((key_pos >= 0).all())
    )

    # Keys transposed once, contiguous for a prompt: its matmuls run ~1.5x faster. The products are batched over
    # (row, KV head) pairs (bmm: faster than a 4-D matmul for a decode step).
    def folded(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_t = keys.transpose(-1, -2)
        key_t = (key_t.contiguous() if q_len > 1 else key_t).reshape(bsz * n_kv_heads, head_dim, n_slots)
        return key_t, values.reshape(bsz * n_kv_heads, n_slots, -1)

    key_t, values_3d = folded(keys, values)
    exact_key_t, exact_values_3d = (None, None) if exact is None else folded(exact.keys, exact.values)
    sinks = None if args.sinks is None else args.sinks.to(precision).view(1, n_kv_heads, group, 1, 1)
    earlier = n_slots - (step_rows or q_len)  # (the slots of earlier steps: those a narrowing policy narrows)
    all_weights = query.new_zeros((bsz, n_q_heads, q_len, n_slots), dtype=torch.float32) if args.weights else None
    outputs = []
    for blk in _blocks(query, keys, values, key_pos, query_pos, seen.causal_tail):
        b, cols, kp, qp = blk.end - blk.start, blk.cols, blk.key_pos, blk.query_pos
        allowed = None if diagonal_only else visible(kp, qp, args.window, seen)
        q_fold = (blk.query * args.scaling).reshape(bsz * n_kv_heads, group * b, head_dim)
        logits = torch.bmm(q_fold, key_t[..., :cols]).to(precision).view(bsz, n_kv_heads, group, b, cols)
        band = exact_values = None
        if exact is not None:
            band, exact_values = recent(kp, qp, exact.residual)[:, :, None], exact_values_3d[:, :cols]
            exact_logits = torch.bmm(q_fold, exact_key_t[..., :cols]).to(precision)
            logits = torch.where(band, exact_logits.view_as(logits), logits)
        if args.softcap is not None:  # before masking, as the models' eager attention
            logits = torch.tanh(logits / args.softcap) * args.softcap
        if narrow is not None:  # (the earlier steps' slots narrowed, the step's own as allowed)
            allowed = visible_slots(kp, qp, args.window) if allowed is None else allowed
            logits[..., :earlier].masked_fill_(~narrow(logits[..., :earlier], allowed[..., :earlier]), float("-inf"))
            logits[..., earlier:].masked_fill_(~allowed[:, :, None, :, earlier:], float("-inf"))
        elif allowed is not None:
            logits.masked_fill_(~allowed[:, :, None], float("-inf"))
        elif diagonal_only:
            diagonal = visible_slots(kp[:, :, cols - b :], qp)
            logits[..., cols - b :].masked_fill_(~diagonal[:, :, None], float("-inf"))
        if sinks is None:
            probs = logits.softmax(dim=-1)
        else:  # the sink's probability belongs to no token: dropped after the softmax
            probs = torch.cat([logits, sinks.expand(bsz, -1, -1, b, 1)], dim=-1).softmax(dim=-1)[..., :cols]
        out = weighted_values(probs.to(values.dtype), values_3d[:, :cols], exact_values, band)
        outputs.append(out.view(bsz, n_q_heads, b, -1))
        if all_weights is not None:
            all_weights[:, :, blk.start : blk.end, :cols] = probs.reshape(bsz, n_q_heads, b, cols)
        if observe is not None:
            summed = group_sum(probs, None if seen.all_visible or diagonal_only else qp)  # (else none is padding)
            mask = _everything(query.device).expand(bsz, n_kv_heads, b, cols) if seen.all_visible else allowed
            observe(Observation(summed, logits, qp, step_rows or q_len, key_pos=kp, window=args.window, mask=mask))
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)), all_weights


def packed_attention(
    query: torch.Tensor,
    view: PackedView,
    query_pos: torch.Tensor,
    scaling: float,
    decide: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, T]],
) -> tuple[torch.Tensor, T]:
    """A decode step's attention (``query`` ``[B, Hq, 1, D]``: a real token per row; no window, soft-capping, sinks or
    probabilities returned) over packed slots read where they lie (:mod:`kvsieve.engine.packed`): the gathered
    slots' products, masked as :func:`visible` masks them, the probabilities from ``decide(logits, allowed)`` →
    ``(probs, decision)`` (logits and probabilities ``[B, Hkv, G, 1, N]``, allowed ``[B, Hkv, 1, N]``). Returns the
    output ``[B, Hq, 1, D]`` and the decision."""
    bsz, n_q_heads, _, head_dim = query.shape
    store, pos = view.store, view.pos
    n_kv_heads, width = pos.shape[1], pos.shape[2]
    group = n_q_heads // n_kv_heads
    precision = torch.promote_types(query.dtype, torch.float32)
    q_fold = (query * scaling).reshape(bsz * n_kv_heads, group, head_dim)
    logits = packed_logits(q_fold, store.kv["keys"], store.layout, width).to(precision)
    logits = logits.view(bsz, n_kv_heads, group, 1, width)
    allowed = visible_slots(pos, query_pos)
    probs, decision = decide(logits.masked_fill_(~allowed[:, :, None], float("-inf")), allowed)
    out = packed_output(probs.view(bsz * n_kv_heads, group, width), store.kv["values"], store.layout)
    return out.view(bsz, n_q_heads, 1, head_dim), decision


def observing(
    observe: Callable[[Observation], None] | None, key_pos: torch.Tensor, query_pos: torch.Tensor
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, None]]:
    """What :func:`packed_attention` decides with when the policy's torch code observes (``observe``; None: nothing
    observes): the softmax, observed as :func:`observed_attention` observes a step's one row (slots at ``key_pos``
    ``[B, Hkv, N]``, queries at ``query_pos`` ``[B, 1]``)."""

    def decide(logits: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs = logits.softmax(dim=-1)
        if observe is not None:
            observe(Observation(group_sum(probs, query_pos), logits, query_pos, 1, key_pos=key_pos, mask=allowed))
        return probs, None

    return decide
