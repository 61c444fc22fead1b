"""The step of a :class:`~kvsieve.engine.layer.SieveLayer` over one chunk of tokens: store → attend → observe →
evict.

**Store** the chunk's tokens in the layer's slots (:mod:`kvsieve.engine.storage`) with their positions from the
padding mask; **attend** over the slots (:mod:`kvsieve.engine.slot_attention`): fused where the policy needs no
probabilities, explicit for the rows it observes; let the policy **observe** them; **evict** down to its ``n_keep``
(:mod:`kvsieve.engine.eviction`). A decode step whose observation and victim the policy states as a rule runs them
in one compiled call (:func:`~kvsieve.engine.compiled.compiled_decode`) where the layer's kernels are on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from kvsieve.engine.compiled import compiled_decode, decodes_by_rule
from kvsieve.engine.eviction import evict, expand_stale, ranked_buffer, victims_buffer
from kvsieve.engine.packed import reads_packed
from kvsieve.engine.rope import ranks
from kvsieve.engine.rules import ScoreRule
from kvsieve.engine.slot_attention import (
    AttentionArgs,
    Exact,
    Visibility,
    decided_attention,
    fused_attention,
    observed_attention,
    observing,
    packed_attention,
)
from kvsieve.engine.storage import PackedView
from kvsieve.engine.stream import chunk_positions
from kvsieve.policies import Slots

if TYPE_CHECKING:
    from kvsieve.engine.layer import SieveLayer

T = TypeVar("T")


@dataclass
class Chunk:
    """Tokens of a step: queries ``[B, Hq, c, D]``, keys and values ``[B, H, c, D]``, validity ``[B, c]``."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor | None

    def __getitem__(self, span: slice) -> Chunk:
        return Chunk(
            self.query[:, :, span],
            self.keys[:, :, span],
            self.values[:, :, span],
            None if self.padding is None else self.padding[:, span],
        )


def run_step(
    layer: SieveLayer,
    chunk: Chunk,
    args: AttentionArgs,
    closed_form: bool = False,
    offset: int = 0,
    columns: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk, its tokens starting at index ``offset`` of the step's: store → attend → observe → evict. Returns
    its output and, with ``args.weights``, its probabilities by column (``columns``: see :func:`columns_of`)."""
    slots, query_pos, start = store_chunk(layer, chunk.keys, chunk.values, chunk.padding, offset)
    out, weights, victim = _attend(layer, chunk, slots, query_pos, start, args, closed_form)
    if weights is not None:
        weights = _by_column(weights, slots.pos, columns, layer.tokens_seen)
    evict(layer, slots, victim)
    layer.store.release()
    return out, weights


def probe_step(layer: SieveLayer, chunk: Chunk, args: AttentionArgs) -> torch.Tensor:
    """A probe's step (:meth:`~kvsieve.engine.cache.SieveCache.probing`): its tokens stored after the held ones,
    attended and observed like a prompt's, then removed — the layer holds the tokens it held before, their state as
    the policy's observation left it, and has seen the tokens it had seen. Returns the output."""
    store, q = layer.store, chunk.keys.shape[2]
    if store.stale is not None:
        store.compact()
    newest, seen = layer.newest, layer.tokens_seen - q
    slots, query_pos, start = store_chunk(layer, chunk.keys, chunk.values, chunk.padding, 0)
    out = _attend(layer, chunk, slots, query_pos, start, args, False)[0]
    store.release()
    store.truncate(start)
    layer.newest, layer.tokens_seen = newest, seen
    if layer.layer_idx == layer.n_layers - 1:  # (the positions shared by the probe's layers must not outlive it)
        layer.memo.clear()
    return out


def store_chunk(
    layer: SieveLayer, keys: torch.Tensor, values: torch.Tensor, padding: torch.Tensor | None, offset: int
) -> tuple[Slots, torch.Tensor, int]:
    """Store a chunk's tokens (keys and values ``[B, H, q, D]``, validity ``[B, q]``; starting at index ``offset`` of
    the step's) after the held ones: the view of the slots in use, the chunk's query positions ``[B, q]`` (-1 =
    padding) and the slot of its first token."""
    store = layer.store
    q, heads = keys.shape[2], keys.shape[1]
    if store.stale is not None and q > 1:
        store.compact()
    query_pos, layer.newest, new_pos = layer.memo.share(
        "positions",
        (layer.tokens_seen, offset, q, heads),
        lambda: chunk_positions(layer.newest, padding, q, heads),
    )
    store.may_hold_padding |= padding is not None
    keys = keys if layer.rotary is None else layer.rotary.rotate(keys, -query_pos[:, None, :])
    start = store.append(
        keys,
        values,
        new_pos,
        layer.policy.initial_state(keys, new_pos),
        layer.newest,
        padding is not None,
        lambda stale, t: expand_stale(layer, stale, t),
    )
    packed = q == 1 and layer.kernels and reads_packed(store)  # (read where they lie: see _attend)
    return store.view(layer.newest, gather=not packed), query_pos, start


def _attend(
    layer: SieveLayer,
    chunk: Chunk,
    slots: Slots,
    query_pos: torch.Tensor,
    start: int,
    args: AttentionArgs,
    closed_form: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The chunk's attention over the slots in use, observed by the policy where it asks: the output, the
    probabilities (with ``args.weights``) and the victim per (row, head) when a compiled decode step chose it. A
    decode step of real tokens takes :func:`_attend_decode`; any other step the general path below (a quantized
    residual read exactly, position rolling, the stream protocol's closed form, narrowing, the rows before those
    the policy observes attended by the fused kernel)."""
    store, policy = layer.store, layer.policy
    q = chunk.keys.shape[2]
    if policy.needs_queries and (layer.limit is not None or layer.probing):
        observe_queries(layer, slots, chunk.query, query_pos, args.scaling)
    if q == 1 and _decodes(layer, chunk, args):
        out, victim = _attend_decode(layer, chunk.query, slots, query_pos, start, args)
        return out, None, victim
    keys, values, query, exact = slots.keys, slots.values, chunk.query, None
    if q > 1 and store.step is not None and store.step.exact is not None:
        # Quantized slots with a residual: each query reads its own recent tokens exactly (quant.recent).
        keys, values = store.step.keys, store.step.values
        exact = Exact(store.step.exact_keys, store.step.exact_values, store.codec.residual)
    if layer.rotary is not None:
        query, keys, rank = _rolled(layer, query, keys, slots.pos, query_pos, start)
        if exact is not None:
            exact = Exact(layer.rotary.rotate(exact.keys, rank), exact.values, exact.residual)
    seen = Visibility(
        restrict=policy.stream_visible if closed_form and q > 1 else None,
        all_visible=q == 1 and chunk.padding is None and args.window is None and not store.may_hold_padding,
        causal_tail=not policy.reads_kv,  # (the chunk's tokens are the last q slots, in order)
    )
    observes = layer.observes
    narrows = policy.narrows and keys.shape[2] > q  # (it narrows the slots of earlier steps: are there any?)
    if not (observes or narrows or args.explicit or exact is not None):
        return fused_attention(query, keys, values, slots.pos, query_pos, args, seen), None, None
    observe = (lambda obs: policy.observe(slots.prefix(obs.key_pos.shape[-1]), obs)) if observes else None
    narrow = policy.narrow if narrows else None
    # The rows before those the policy observes need no probabilities: the fused kernel attends them over the slots
    # before the chunk's later tokens (which they cannot see).
    rows = policy.observed_rows() if observes and not (args.explicit or exact) else None
    head = 0 if rows is None else max(0, q - rows)
    outs, weights = [], None
    if head:
        before = keys.shape[2] - (q - head)
        early = (t[:, :, :before] for t in (keys, values, slots.pos))
        outs.append(fused_attention(query[:, :, :head], *early, query_pos[:, :head], args, seen))
    if head < q:
        late = (query[:, :, head:], keys, values, slots.pos, query_pos[:, head:], args, seen)
        out, weights = observed_attention(*late, observe, narrow, exact, step_rows=q)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2), weights, None


def _rolled(
    layer: SieveLayer, query: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, query_pos: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position rolling: the keys (stored un-rotated) rotated by their slots' rank among the held positions ``pos``,
    the step's queries (their tokens from slot ``start`` on) by their own slots' rank; and the ranks."""
    rank = ranks(pos)
    q = query.shape[2]
    query_rank = rank[:, :, start : start + q].repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
    query = layer.rotary.rotate(query, query_rank - query_pos[:, None, :])
    return query, layer.rotary.rotate(keys, rank), rank


def _decodes(layer: SieveLayer, chunk: Chunk, args: AttentionArgs) -> bool:
    """Whether a step of one token per row takes :func:`_attend_decode`: every row's token real, and nothing that
    only the general path does (a window, soft-capping, sinks, probabilities returned, autograd, a narrowing
    policy)."""
    explicit = args.window is not None or args.explicit or chunk.query.requires_grad
    return chunk.padding is None and not explicit and not layer.policy.narrows


def _attend_decode(
    layer: SieveLayer, query: torch.Tensor, slots: Slots, query_pos: torch.Tensor, start: int, args: AttentionArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step's attention (:func:`_decodes`): the output and the victim per (row, head) when the policy's
    compiled rule chose it. Packed slots (budgets by head) are read where they lie (:func:`packed_attention`). The
    policy observes by its compiled rule where it states one and every slot is a token (:func:`_decide_by_rule`),
    else by its torch code; a step nothing observes runs the fused kernel (dense slots) or a plain softmax."""
    policy, store = layer.policy, layer.store
    observes = layer.observes and policy.observed_rows() != 0
    ruled = observes and layer.kernels and decodes_by_rule(policy.compiled_rule, query.device)
    observe = (lambda obs: policy.observe(slots, obs)) if observes else None
    if isinstance(slots, PackedView):  # (holes masked by their positions)

        def packed(decide: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]):
            return packed_attention(query, slots, query_pos, args.scaling, lambda logits, _: decide(logits[:, :, :, 0]))

        decided = _decide_by_rule(layer, slots, query, packed) if ruled else None
        if decided is not None:
            return decided
        return packed_attention(query, slots, query_pos, args.scaling, observing(observe, slots.pos, query_pos))
    keys, values = slots.keys, slots.values
    if layer.rotary is not None:
        query, keys, _ = _rolled(layer, query, keys, slots.pos, query_pos, start)
    seen = Visibility(all_visible=not store.may_hold_padding)
    if ruled and seen.all_visible:
        decided = _decide_by_rule(
            layer, slots, query, lambda decide: decided_attention(query, keys, values, args.scaling, decide)
        )
        if decided is not None:
            return decided
    if observe is None:
        return fused_attention(query, keys, values, slots.pos, query_pos, args, seen), None
    return observed_attention(query, keys, values, slots.pos, query_pos, args, seen, observe, step_rows=1)[0], None


def observe_queries(
    layer: SieveLayer, slots: Slots, query: torch.Tensor, query_pos: torch.Tensor, scaling: float
) -> None:
    """Hand the policy the step's queries ``[B, Hq, q, D]`` as :meth:`~kvsieve.policies.base.Policy.observe_queries`
    takes them: per KV head's group, scaled."""
    bsz, n_q, q, dim = query.shape
    heads = slots.pos.shape[1]
    grouped = (query * scaling).view(bsz, heads, n_q // heads, q, dim)
    layer.policy.observe_queries(slots, grouped, query_pos, layer.rope)


def _decide_by_rule(
    layer: SieveLayer,
    slots: Slots,
    query: torch.Tensor,
    attend: Callable[[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]], tuple[torch.Tensor, T]],
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A decode step over real slots (or packed ones: holes masked) whose observation (and victim) the policy states
    as a rule (:func:`compiled_decode`: a ``ScoreRule``'s score and victim, ``LowMarks``' marks in one compiled
    call), attended by ``attend(decide)`` (:func:`decided_attention`, :func:`packed_attention`). Returns the output
    and the victim (None when no single slot goes or the policy chooses it; over packed slots, each (row, head)'s
    lowest, whether it goes or not); None where that does not apply (autograd; a policy that observes none of the
    step's rows) and the step attends, observes and chooses in torch."""
    if query.requires_grad or layer.policy.observed_rows() == 0:
        return None
    used, rule = layer.store.used, layer.policy.compiled_rule
    will_evict = isinstance(slots, PackedView) or layer.n_keep(used) == used - 1
    victims = victims_buffer(layer, slots.pos)
    scale = None
    if isinstance(rule, ScoreRule) and rule.gain:  # (made once for the layers of equal gains)
        scale = layer.memo.derive(
            ("logit_scale", rule.gain), slots.last, lambda: rule.logit_scale(slots.last[:, None])[:, 0]
        )
    ranked = ranked_buffer(layer, slots.pos) if isinstance(rule, ScoreRule) and rule.pool else None
    out, ruled = attend(lambda logits: compiled_decode(rule, logits, slots, will_evict, victims, scale, ranked))
    return out, victims if will_evict and ruled is not None else None


def columns_of(layer: SieveLayer, padding: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, tokens seen]``: the column of each row's token at each position (None: position = column)."""
    if padding is None:
        return None
    if padding.shape[1] != layer.tokens_seen:
        raise ValueError(
            f"output_attentions with a kvsieve cache needs the attention mask of all {layer.tokens_seen} tokens "
            f"seen, got one of {padding.shape[1]}"
        )
    return torch.argsort((~padding).to(torch.uint8), dim=1, stable=True).to(layer.device)


def _by_column(weights: torch.Tensor, pos: torch.Tensor, columns: torch.Tensor | None, total: int) -> torch.Tensor:
    """Slot probabilities ``[B, Hq, b, N]`` laid out by column ``[B, Hq, b, total]`` (0 for tokens not held):
    ``pos`` ``[B, Hkv, N]`` are the slots' positions, ``columns`` maps positions to columns (None: identity)."""
    group = weights.shape[1] // pos.shape[1]
    held = pos.clamp(min=0)
    col = held if columns is None else columns.gather(1, held.flatten(1)).view_as(pos)
    col = col.repeat_interleave(group, dim=1)[:, :, None, :].expand_as(weights)
    real = (pos >= 0).repeat_interleave(group, dim=1)[:, :, None, :]
    return weights.new_zeros((*weights.shape[:3], total)).scatter_add_(3, col, weights * real)
