"""The stream protocol's per-token work for a run of tokens, with the heavy algebra batched over the run.

Fed one at a time, each token of a run is stored, attends over the kept slots, is observed by the policy and
makes the policy evict. Only the choice of victims is sequential: every token's query, key and value are known
when the run starts (the layer's input is the previous layer's output for the whole run). So a *scan*:

1. appends all the run's tokens at once, as empty slots (position -1), and computes every query's logits over
   every slot in one matrix product;
2. then, token by token, reveals the token's slot, lets the policy observe its query's probabilities (the logits
   of the slots held at that moment, softmaxed) and evicts by the policy's priorities, marking the victims' slots
   empty (position -1) instead of moving anything — the policy sees an ordinary layer with a few empty slots;
3. computes every query's output in one masked product over what it saw, and gathers the survivors into buffers
   of the budget.

The logits and the kept slots are those of feeding the tokens one at a time (tests: every policy, against the
token-by-token engine). Position-only policies (:class:`~kvsieve.policies.base.PositionalPolicy`) share the whole
run's decisions between the layers of a group: only the first one steps through the run.

Padding (a left-padded batch's first tokens, a right-padded continuation's last ones) is scanned as the layer
steps it: a padding token takes a slot that holds no token (position -1) and is never revealed; such slots count
towards the layer's slots and go first when it evicts; a padding query is observed as zeros and attends every slot
(its output is never used). A run can be scanned when positions are not rolled, the layer has no window, the
attention needs nothing the scan does not compute (soft-capping, sinks, returned weights), and, where padding is
involved, the policy's target is not each row's own count (:attr:`~kvsieve.policies.base.Policy.counts_rows`);
otherwise the layer steps through it chunk by chunk (:func:`~kvsieve.engine.step.run_step`). Quantized slots are read as
:mod:`kvsieve.engine.quant` says: dequantized, and exactly by each query within its residual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvsieve.engine.compiled_scan import compiled_decide
from kvsieve.engine.eviction import shared_decision
from kvsieve.engine.quant import recent
from kvsieve.engine.slot_attention import AttentionArgs, weighted_values
from kvsieve.engine.stream import chunk_positions
from kvsieve.policies import Observation, Slots
from kvsieve.policies.base import demote, extreme, group_sum, protect

if TYPE_CHECKING:
    from kvsieve.engine.layer import SieveLayer
    from kvsieve.engine.step import Chunk
    from kvsieve.engine.storage import SlotStore

SCAN_ELEMENTS = 1 << 22
"""Most logits (``[B, Hq, run, slots]``) of one scanned run; longer runs are cut."""
MAX_RUN = 64
"""Most tokens of one run: every step works on all the run's slots (measured with h2o at budget 128, 640 tokens:
runs of 16 / 32 / 64 / 128 / 256 tokens took 12.4 / 10.0 / 9.5 / 10.2 / 12.6 s)."""
MIN_RUN = 8


def scannable(layer: SieveLayer, chunk: Chunk, args: AttentionArgs) -> bool:
    """Whether ``chunk``'s tokens, fed one at a time to ``layer`` now, can be scanned (see the module docstring)."""
    padded = layer.store.may_hold_padding or (chunk.padding is not None and not bool(chunk.padding.all()))
    return (
        not (padded and layer.policy.counts_rows)
        and layer.rotary is None
        and args.window is None
        and not args.explicit
        and layer.limit is not None
        and not layer.policy.narrows
        and not layer.policy.needs_queries
        and not layer.policy.allocates_heads  # (its heads' shares are chosen at an eviction of the step's)
    )


def run_length(layer: SieveLayer, query: torch.Tensor, remaining: int) -> int:
    """Tokens of the next scanned run: at most :data:`MAX_RUN`, and :data:`SCAN_ELEMENTS` logits."""
    bsz, heads = query.shape[:2]
    budget = layer.store.used + remaining
    return max(MIN_RUN, min(remaining, MAX_RUN, SCAN_ELEMENTS // max(1, bsz * heads * budget)))


def _logits(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[B, Hkv, G, c, N]`` scaled logits of ``query`` ``[B, Hq, c, D]`` over ``keys`` ``[B, Hkv, N, D]``, in fp32
    (fp64 for a fp64 model)."""
    bsz, n_q, c, dim = query.shape
    n_kv, n = keys.shape[1], keys.shape[2]
    q_fold = (query * scaling).reshape(bsz * n_kv, n_q // n_kv * c, dim)
    logits = torch.bmm(q_fold, keys.transpose(-1, -2).reshape(bsz * n_kv, dim, n))
    return logits.to(torch.promote_types(query.dtype, torch.float32)).view(bsz, n_kv, n_q // n_kv, c, n)


def scan(layer: SieveLayer, chunk: Chunk, args: AttentionArgs) -> torch.Tensor:
    """Feed ``chunk``'s ``c`` tokens to ``layer`` one at a time (see the module docstring); their attention output
    ``[B, Hq, c, D]``."""
    store, policy = layer.store, layer.policy
    if store.stale is not None:
        store.compact()
    heads, c = chunk.keys.shape[1:3]
    first = store.used
    query_pos, newest, new_pos = chunk_positions(layer.newest, chunk.padding, c, heads)  # [B, c], [B], [B, H, c]
    # Each row's newest position when each token is the newest (a padding token's: the row's last real one).
    lasts = query_pos if chunk.padding is None else query_pos.cummax(dim=1).values.clamp(min=layer.newest[:, None])
    store.may_hold_padding |= chunk.padding is not None
    store.append(chunk.keys, chunk.values, new_pos, policy.initial_state(chunk.keys, new_pos))
    n = store.used
    kv = _RunKV(store, query_pos)
    pos = store.positions[:, :, :n]
    pads = None  # the slots holding padding (the run's own as they come), until evicted
    if store.may_hold_padding:
        pads = pos < 0
        pads[:, :, first:] = False
    pos[:, :, first:] = -1  # (hidden until revealed)
    state = {name: t[:, :, :n] for name, t in store.state.items()}
    logits = kv.logits(chunk.query, args.scaling) if policy.needs_attention else None
    gone, kept = shared_decision(
        layer,
        ("run", layer.eviction_rounds),
        lambda: _decide(layer, pos, state, kv, query_pos, lasts, new_pos, logits, pads),
    )
    layer.eviction_rounds += c
    if logits is None:
        logits = kv.logits(chunk.query, args.scaling)
    probs = logits.masked_fill(gone[:, :, None], float("-inf")).softmax(dim=-1)
    out = kv.output(probs).view(*chunk.query.shape[:3], -1)
    layer.newest = newest
    pos[:, :, first:] = new_pos  # (the layers that took a group's decisions revealed nothing)
    store.release()
    if kept is not None:
        store.keep(kept)
    store.settle()  # (whether padding is still held: a mask of all real tokens, or the padding evicted)
    return out


class _RunKV:
    """The keys and values a run reads: the slots as they are, or (quantized) dequantized, with each query reading
    its recent tokens exactly (:func:`~kvsieve.engine.quant.recent`, by the positions when the run starts)."""

    def __init__(self, store: SlotStore, query_pos: torch.Tensor) -> None:
        step, n = store.step, store.used
        self.keys, self.values = (store.kv["keys"], store.kv["values"]) if step is None else (step.keys, step.values)
        self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        self.band = None
        if step is not None and step.exact is not None:
            self.exact_keys, self.exact_values = step.exact_keys, step.exact_values
            self.band = recent(store.positions[:, :, :n], query_pos, store.codec.residual)  # [B, H, c, N]

    def logits(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """``[B, Hkv, G, c, N]`` scaled logits of the run's queries ``[B, Hq, c, D]``, in fp32 (fp64 for a fp64
        model)."""
        logits = _logits(query, self.keys, scaling)
        if self.band is None:
            return logits
        return torch.where(self.band[:, :, None], _logits(query, self.exact_keys, scaling), logits)

    def slots(
        self, pos: torch.Tensor, state: dict[str, torch.Tensor], last: torch.Tensor, t: int, reads: bool
    ) -> Slots:
        """The policy's view when the run's ``t``-th token is the newest (keys and values dequantized only, unless
        the policy ``reads`` them: :attr:`~kvsieve.policies.base.Policy.reads_kv`)."""
        if self.band is None or not reads:
            return Slots(pos, state, last, self.keys, self.values)
        exact = self.band[:, :, t, :, None]
        keys = torch.where(exact, self.exact_keys, self.keys)
        return Slots(pos, state, last, keys, torch.where(exact, self.exact_values, self.values))

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        """``[B, Hq, c, D]`` (flattened over heads and queries) from the probabilities ``[B, Hkv, G, c, N]``."""

        def folded(values: torch.Tensor) -> torch.Tensor:
            return values.reshape(-1, *values.shape[2:])

        weights = probs.to(self.values.dtype)
        if self.band is None:
            return weighted_values(weights, folded(self.values))
        return weighted_values(weights, folded(self.values), folded(self.exact_values), self.band[:, :, None])


def _decide(
    layer: SieveLayer,
    pos: torch.Tensor,
    state: dict[str, torch.Tensor],
    kv: _RunKV,
    query_pos: torch.Tensor,
    lasts: torch.Tensor,
    new_pos: torch.Tensor,
    logits: torch.Tensor | None,
    pads: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step through the run: reveal, observe, evict (``lasts``: each row's newest position at each token ``[B, c]``;
    ``pads``: the slots holding padding ``[B, H, N]``, None when none may, cleared as they go). Returns what each
    query could not see ``[B, H, c, N]`` (a padding query sees every slot: a fully masked row would be NaN) and the
    slots kept at the end ``[B, H, kept]`` in slot order (None: nothing was evicted, all are kept)."""
    policy, limit = layer.policy, layer.limit  # (scanned runs are bounded: the limit holds for the run)
    first = pos.shape[2] - query_pos.shape[1]
    decided = (
        compiled_decide(policy.compiled_rule, logits, pos, query_pos, lasts, pads, state, first, limit)
        if layer.kernels
        else None
    )
    if decided is not None:  # (the same decisions in one compiled loop)
        gone, held = decided
        return gone, None if held == pos.shape[2] else _survivors(pos, pads, held)
    held, evicted, gones = first, 0, []
    # Views made once for the whole run (indexing costs more than the arithmetic on tensors this small).
    columns = pos[:, :, first:].unbind(2)
    pad_columns = [None] * len(columns) if pads is None else pads[:, :, first:].unbind(2)
    real = None if pads is None else query_pos >= 0  # [B, c]: a padding query is observed as zeros
    step_real = [None] * len(columns) if real is None else real[:, None, :, None].unbind(2)  # [B, 1, 1] each
    step_logits = [None] * len(columns) if logits is None else logits.split(1, dim=3)
    wide_pos, shape = pos[:, :, None, None], tuple(pos.shape)  # (a view to ints costs less than to a torch.Size)
    lowest = None if logits is None else extreme(logits.dtype, logits.device, highest=False)
    steps = zip(
        lasts.unbind(1),
        query_pos.split(1, dim=1),
        new_pos.unbind(2),
        columns,
        pad_columns,
        step_real,
        step_logits,
        strict=True,
    )
    for t, (last, step_pos, revealed, column, pad_column, is_real, step_logit) in enumerate(steps):
        column.copy_(revealed)
        if pad_column is not None:
            torch.lt(revealed, 0, out=pad_column)
        held += 1
        wide_gone = wide_pos < 0
        gone = wide_gone.view(*shape)
        gones.append(gone)
        slots = kv.slots(pos, state, last, t, policy.reads_kv)
        if step_logit is not None:
            hidden = wide_gone if is_real is None else wide_gone & is_real[..., None, None]
            masked = torch.where(hidden, lowest, step_logit)
            probs = group_sum(masked.softmax(dim=-1), None if is_real is None else step_pos)
            policy.observe(slots, Observation(probs, masked, step_pos, 1, key_pos=pos))
        target = policy.n_keep(held, limit)
        if target >= held:
            continue
        scores = policy.keep_scores(slots)
        scores = protect(scores, gone)  # (an empty slot is never a victim)
        if pads is not None:  # (padding goes first)
            scores = demote(scores, pads)
        if held - target == 1:
            victims = scores.argmin(dim=-1, keepdim=True)
        else:
            victims = scores.topk(held - target, dim=-1, largest=False, sorted=False).indices
        pos.scatter_(2, victims, -1)
        if pads is not None:
            pads.scatter_(2, victims, False)
        evicted += held - target
        held = target
    gone = torch.stack(gones, dim=2)
    if real is not None:
        gone &= real[:, None, :, None]
    return gone, _survivors(pos, pads, held) if evicted else None


def _survivors(pos: torch.Tensor, pads: torch.Tensor | None, held: int) -> torch.Tensor:
    """The ``held`` slots ``[B, H, held]`` that still hold a token (or padding), in slot order."""
    held_slots = pos >= 0 if pads is None else (pos >= 0) | pads
    kept = held_slots.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[:, :, :held]
    return kept.sort(dim=-1).values
