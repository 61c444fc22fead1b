"""Eviction: a :class:`~kvsieve.engine.layer.SieveLayer`'s slots cut down to its policy's ``n_keep`` after a step.

The policy's priorities choose what stays (padding and empty slots lowest); a row that counts its own tokens
(``Policy.counts_rows`` with padding held) keeps its own number of them. When one slot goes, its slot goes stale and
the next token is written into it (no copy of the cache); several victims are removed by one gather into buffers
of ``limit + 1`` slots. The layers of a positional group (:class:`~kvsieve.engine.plan.PolicyPlan`) share each
decision (:func:`shared_decision`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, TypeVar

import torch

from kvsieve.engine.compiled import compiled_victims
from kvsieve.engine.storage import GROWTH, expand_index
from kvsieve.policies import Slots
from kvsieve.policies.base import best_of, demote, protect

if TYPE_CHECKING:
    from kvsieve.engine.layer import SieveLayer

T = TypeVar("T")


def evict(layer: SieveLayer, slots: Slots, victim: torch.Tensor | None = None) -> None:
    """Evict down to the policy's ``n_keep`` (``slots``: the view of the slots in use; ``victim``: the slot per
    (row, head) already chosen when one goes)."""
    layer.eviction_rounds += 1
    store, policy = layer.store, layer.policy
    if policy.allocates_heads:
        _evict_heads(layer, slots, victim)
        return
    target, rows = layer.n_keep(store.used), None
    if policy.counts_rows and store.may_hold_padding:  # each row's target from its own count of tokens
        rows = [layer.n_keep(count) for count in (slots.pos[:, 0] >= 0).sum(dim=-1).tolist()]
        target = max(rows)
    if target >= store.used:
        return
    if rows is not None:
        chosen, evicted = _choose_per_row(layer, slots, rows, target)
        store.keep(chosen)
        store.positions[:, :, :target].masked_fill_(evicted, -1)  # (holes where a row keeps fewer)
    else:
        chosen = (
            victim
            if victim is not None
            else shared_decision(layer, layer.eviction_rounds, lambda: _choose(layer, slots, target))
        )
        if store.used - target == 1:
            store.drop(chosen, leave_stale=not store.may_hold_padding and layer.rotary is None)
            store.settle(single=True)
            return
        store.keep(chosen)
    store.settle()


def _evict_heads(layer: SieveLayer, slots: Slots, lowest: torch.Tensor | None = None) -> None:
    """Evict where each KV head keeps its own count (:meth:`~kvsieve.policies.base.Policy.share_heads`), into
    packed slots (:meth:`~kvsieve.engine.storage.SlotStore.keep_heads`).

    The first time a row holds more than the layer's budget (its prompt, most often), the policy shares the row's
    budget among its heads (until then each of its heads holds the row's tokens: a prompt that fits the budget is
    not compressed); afterwards each of its (row, head) keeps its count, plus what the decode budget lets every head
    grow by, by the policy's priorities. A step that leaves each (row, head) at most one token over, or a free slot of
    its own (and no row to share), evicts one victim per (row, head) over, left stale for its next token (the
    others' next token goes into their free slot; ``lowest`` ``[B, H, 1]``: each (row, head)'s lowest slot, if a
    compiled decode step chose it); otherwise one gather, with room for what the (row, head) may hold (without
    bound: :data:`~kvsieve.engine.storage.GROWTH` more)."""
    store, policy = layer.store, layer.policy
    real = slots.pos >= 0
    held = real.sum(dim=-1)
    target = layer.n_keep(store.used)
    counts = torch.full_like(held, -1) if store.counts is None else store.counts
    fresh = counts < 0
    over = fresh & (held > target)  # (the heads of a row not shared yet hold the same tokens)
    if store.counts is None and not bool(over.any()):
        return
    limit = layer.limit  # (None: no bound now, every token kept)
    most = held if limit is None else torch.where(fresh, target, counts + (limit - policy.budget))
    excess = held - most
    if store.layout is not None:
        free = held < store.layout.caps
        if bool((~over.any()) & ((excess == 1) | ((excess <= 0) & free)).all()):  # (one read on the host)
            lowest = (victim_slots(layer, slots, holes=True) if lowest is None else lowest)[..., 0].to(real.device)
            own = torch.arange(store.used, device=real.device) < store.layout.caps[..., None]
            first_free = (real | ~own).to(torch.uint8).argmin(dim=-1)
            store.drop(torch.where(excess == 1, lowest, first_free)[..., None], leave_stale=True)
            return
    scores = policy.keep_scores(slots)
    kept = best_of(demote(scores, ~real), most) & real
    if bool(over.any()):
        shared = policy.share_heads(scores, real, held[:, 0].clamp(max=target)) & real
        kept = torch.where(over[..., None], shared, kept)
        counts = torch.where(over, shared.sum(dim=-1), counts)
        most = torch.where(over, counts, most)
    store.keep_heads(kept, counts, most if limit is not None else kept.sum(dim=-1) + GROWTH)


def shared_decision(layer: SieveLayer, round_: Hashable, choose: Callable[[], T]) -> T:
    """``choose()``, or the decision the layer's positional group made for eviction round ``round_``
    (:meth:`~kvsieve.engine.plan.StepMemo.decide`)."""
    i = layer.layer_idx
    return layer.memo.decide(layer.plan.groups[i], round_, choose, layer.plan.members[i])


def keep_scores(layer: SieveLayer, slots: Slots) -> torch.Tensor:
    """The policy's priorities, padding and empty slots lowest."""
    scores = layer.policy.keep_scores(slots)
    return demote(scores, slots.pos < 0) if layer.store.may_hold_padding else scores


def victim_slots(layer: SieveLayer, slots: Slots, holes: bool = False) -> torch.Tensor:
    """Each (row, head)'s one victim ``[B, H, 1]`` by the policy's priorities, the slot ``argmin`` picks: an empty
    slot first (padding goes before tokens), or, ``holes`` (a head's free slots where heads keep their own counts),
    never. In one compiled call where the policy's rule has one (:func:`compiled_victims`), else by its torch code."""
    if layer.kernels:
        out = victims_buffer(layer, slots.pos) if layer.plan.groups[layer.layer_idx] is None else None
        padded = layer.store.may_hold_padding and not holes
        victims = compiled_victims(layer.policy.compiled_rule, slots, padded, out)
        if victims is not None:
            return victims
    scores = protect(layer.policy.keep_scores(slots), slots.pos < 0) if holes else keep_scores(layer, slots)
    return scores.argmin(dim=-1, keepdim=True)


def _choose(layer: SieveLayer, slots: Slots, target: int) -> torch.Tensor:
    """By the policy's priorities: the victim slot ``[B, H, 1]`` when one slot goes, else the ``target`` slots kept
    ``[B, H, target]``, in slot order."""
    if layer.store.used - target == 1:
        return victim_slots(layer, slots)
    scores = keep_scores(layer, slots)
    return scores.topk(target, dim=-1, sorted=False).indices.sort(dim=-1).values


def _choose_per_row(layer: SieveLayer, slots: Slots, rows: list[int], target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``target`` best slots ``[B, H, target]`` in slot order, and which of them go all the same ``[B, H,
    target]`` because their row keeps only its ``rows[b]`` best."""
    best = keep_scores(layer, slots).topk(target, dim=-1).indices  # best first
    beyond = torch.arange(target, device=best.device) >= torch.tensor(rows, device=best.device)[:, None, None]
    chosen, order = best.sort(dim=-1)
    return chosen, beyond.expand_as(best).gather(-1, order)


def victims_buffer(layer: SieveLayer, like: torch.Tensor) -> torch.Tensor:
    """The layer's buffer of victims ``[B, H, 1]`` (``like``: ``[B, H, ...]``; int64, on CPU), where a compiled step
    writes them: rewritten at every step, so the stale slot it becomes is expanded once (:func:`expand_stale`). Not
    for the decisions a positional group shares: each of its layers holds the victim until its own next token is
    written."""
    victims = layer.victims
    if victims is None or victims.shape[:2] != like.shape[:2]:
        victims = layer.victims = torch.zeros((*like.shape[:2], 1), dtype=torch.long)
    return victims


def ranked_buffer(layer: SieveLayer, pos: torch.Tensor) -> torch.Tensor:
    """The layer's slots in position order ``[B, H, N]`` as a pooling rule's compiled decode step left them (int64,
    on CPU; ``pos``: the positions of the slots in use), or, new, -1 (sorted at the first step)."""
    ranked = layer.ranked
    if ranked is None or ranked.shape != pos.shape:
        ranked = layer.ranked = torch.full(pos.shape, -1, dtype=torch.long)
    return ranked


def expand_stale(layer: SieveLayer, stale: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The stale slots expanded over slot tensor ``t``'s trailing dimensions; a victim the layers of a positional
    group share (:func:`shared_decision`) is expanded once for all of them, a layer's own buffer of victims
    (:func:`victims_buffer`) once for all steps."""
    group = layer.plan.groups[layer.layer_idx]
    owner = ("layer", layer.layer_idx) if group is None else ("group", group)
    return layer.memo.derive(("stale", owner, t.shape[3:]), stale, lambda: expand_index(stale, t))
