"""The stream protocol's sequential decisions as one compiled loop, for the rules a policy can state
(:meth:`~kvsieve.policies.base.Policy.scan_rule`), on CPU, with numba (:mod:`kvsieve.engine.compiled`; without it,
or on another device, :mod:`kvsieve.engine.scan` steps through the run with torch ops).

In a scanned run every query's logits are known before the first decision (:mod:`kvsieve.engine.scan`); what is
left is, token by token: reveal the token's slot, softmax its query's logits over the slots held, add them to the
scores, evict. With torch each of these is a dispatched op on a few hundred numbers, 80–160 µs per token and layer
on this CPU; here the whole run is one call. The loops do what the torch scan does, in the same order: each query
head's probabilities ``exp(l - max) / sum`` over the held slots, the group's heads summed in order, then the
policy's state updated; victims are chosen with ``torch.argmin``'s tie rule (the first lowest) or, for several at
once, as the set ``torch.topk`` returns. Padding is handled as the torch scan handles it (padding slots go first, a
padding query observes nothing and sees every slot) under a :class:`~kvsieve.engine.rules.ScoreRule`; a
:class:`~kvsieve.engine.rules.LowMarks` or :class:`~kvsieve.engine.rules.FixedPriority` policy counts each row's
tokens, so padded runs are never scanned for it.
The exponentials (and AhaKV's logit multipliers, computed for the whole run at once) are not torch's vectorized
ones, so scores may differ from the torch scan's in the last bits (tested: the same kept tokens and bitwise the same
logits).
"""

from __future__ import annotations

import numpy as np
import torch

from kvsieve.engine.compiled import add_scores, choose_victim, jit, pattern_fields
from kvsieve.engine.rules import FixedPriority, ScanRule, ScoreRule, drop_in_bulk


@jit
def _group_probs(
    logits: np.ndarray,
    pos: np.ndarray,
    b: int,
    h: int,
    t: int,
    probs: np.ndarray,
    total: np.ndarray,
    scale: float = 1.0,
) -> int:
    """``total`` (zeroed first) = the softmax over the held slots of query ``t``'s logits (times ``scale``), summed
    over the group's heads in order; returns the number of slots held. (The query's own token is held.)"""
    group, n = logits.shape[2], logits.shape[4]
    own = n - logits.shape[3] + t
    total[:] = 0
    zero = total[0]  # (in the logits' dtype)
    held = 0
    for j in range(n):
        held += pos[b, h, j] >= 0
    for g in range(group):
        for j in range(n):
            probs[j] = logits[b, h, g, t, j] * scale
        high = probs[own]
        for j in range(n):
            if pos[b, h, j] >= 0 and probs[j] > high:
                high = probs[j]
        mass = zero
        for j in range(n):
            e = np.exp(probs[j] - high) if pos[b, h, j] >= 0 else zero
            probs[j] = e
            mass += e
        for j in range(n):
            total[j] += probs[j] / mass
    return held


@jit
def _reveal(pos: np.ndarray, gone: np.ndarray, b: int, h: int, t: int, position: int, real: bool) -> None:
    """Reveal the run's ``t``-th slot (at ``position``, -1 for padding) and note what query ``t`` cannot see (a
    padding query: nothing, it sees every slot)."""
    n = pos.shape[2]
    pos[b, h, n - gone.shape[2] + t] = position
    for j in range(n):
        gone[b, h, t, j] = real and pos[b, h, j] < 0


_bulk_target = jit(drop_in_bulk)  # (the policies' own rule, compiled for the loops that call it)


@jit
def _evict_lowest(pos: np.ndarray, order: np.ndarray, b: int, h: int, count: int, kept: float | int) -> None:
    """Evict the ``count`` slots of row ``b``, head ``h`` with the lowest ``order`` (``torch.topk``'s set; the first
    lowest for one), marking them evicted in ``pos``; ``kept``: the order of a protected slot."""
    for _ in range(count):
        victim = np.argmin(order)
        pos[b, h, victim] = -1
        order[victim] = kept


@jit
def _score_rule(
    logits: np.ndarray,
    pos: np.ndarray,
    query_pos: np.ndarray,
    lasts: np.ndarray,
    pads: np.ndarray,
    score: np.ndarray,
    gone: np.ndarray,
    scales: np.ndarray,
    held: int,
    limit: int,
    accumulate: bool,
    pattern: tuple,
    across_heads: bool,
    pool: int,
) -> int:
    """The run's decisions under a :class:`~kvsieve.engine.rules.ScoreRule` (``accumulate``, ``pattern``: its
    ``kept`` pattern's fields, ``across_heads``, ``pool``): ``logits`` ``[B, H, G, c, N]``, ``pos`` ``[B, H, N]``
    (the run's ``c`` slots last, hidden as -1; evicted slots become -1), ``query_pos`` ``[B, c]`` (-1: padding),
    ``lasts`` ``[B, c]`` each row's newest position at each token, ``pads`` ``[B, H, N]`` the slots holding padding
    (updated: they go first), ``score`` ``[B, H, N]`` (updated; a padding query observes zeros), ``gone``
    ``[B, H, c, N]`` (filled: the slots each query could not see), ``scales`` ``[B, c]`` each query's logit
    multiplier, ``held`` slots held before the run. Returns the slots held after it."""
    bsz, heads, _, c, n = logits.shape
    first = n - c
    probs = np.empty(n, dtype=logits.dtype)
    total = np.zeros((heads, n), dtype=logits.dtype)
    order = np.empty(n, dtype=np.float64)
    kept = np.empty(n, dtype=np.bool_)
    rank = np.empty(n, dtype=np.int64)
    ranked = np.empty(n, dtype=np.int64)
    for t in range(c):
        held += 1
        for b in range(bsz):
            real, last = query_pos[b, t] >= 0, lasts[b, t]
            for h in range(heads):
                _reveal(pos, gone, b, h, t, query_pos[b, t], real)
                pads[b, h, first + t] = not real
                if real:
                    _group_probs(logits, pos, b, h, t, probs, total[h], scales[b, t])
                else:
                    total[h] = 0
            add_scores(score, total, b, accumulate, across_heads)
            for h in range(heads):
                if held <= limit:
                    continue
                victim = -1
                for j in range(n):  # (padding first: the first slot holding it)
                    if pads[b, h, j]:
                        victim = j
                        break
                if victim < 0:
                    victim = choose_victim(score, pos, False, b, h, last, pattern, pool, kept, rank, order, ranked)
                pos[b, h, victim] = -1
                pads[b, h, victim] = False
        held = min(held, limit)
    return held


@jit
def _low_marks(
    logits: np.ndarray,
    pos: np.ndarray,
    query_pos: np.ndarray,
    low: np.ndarray,
    gone: np.ndarray,
    held: int,
    limit: int,
    recent: int,
    drop: int,
    by_step: bool,
) -> int:
    """The run's decisions under :class:`~kvsieve.engine.rules.LowMarks` (as :func:`_score_rule`; ``low``
    ``[B, H, N, window]``, updated)."""
    bsz, heads, group, c, n = logits.shape
    window = low.shape[3]
    probs = np.empty(n, dtype=logits.dtype)
    total = np.zeros(n, dtype=logits.dtype)
    order = np.empty(n, dtype=np.float64)
    for t in range(c):
        held += 1
        target = _bulk_target(held, limit, drop)
        for b in range(bsz):
            last = query_pos[b, t]
            column = last % window
            for h in range(heads):
                _reveal(pos, gone, b, h, t, last, True)
                attended = _group_probs(logits, pos, b, h, t, probs, total)
                bar = np.float32(group) / np.float32(last + 1 if by_step else attended)
                for j in range(n):
                    low[b, h, j, column] = pos[b, h, j] >= 0 and total[j] < bar
                if target == held:
                    continue
                for j in range(n):  # fewest marks first, then newest: pos - marks * (last + 1)
                    protected = pos[b, h, j] < 0 or pos[b, h, j] > last - recent
                    order[j] = np.inf if protected else pos[b, h, j] - low[b, h, j].sum() * (last + 1.0)
                _evict_lowest(pos, order, b, h, held - target, np.inf)
        held = target
    return held


@jit
def _fixed_priority(
    pos: np.ndarray,
    query_pos: np.ndarray,
    priority: np.ndarray,
    gone: np.ndarray,
    held: int,
    limit: int,
    recent: int,
    drop: int,
) -> int:
    """The run's decisions under :class:`~kvsieve.engine.rules.FixedPriority` (as :func:`_score_rule`, without
    logits; ``priority`` ``[B, H, N]`` int64)."""
    bsz, heads, c, n = gone.shape
    protected = np.iinfo(np.int64).max
    order = np.empty(n, dtype=np.int64)
    start = held
    for b in range(bsz):  # (nothing is observed: each row and head goes through the run on its own)
        for h in range(heads):
            held = start
            for t in range(c):
                last = query_pos[b, t]
                _reveal(pos, gone, b, h, t, last, True)
                target = _bulk_target(held + 1, limit, drop)
                if target <= held:
                    for j in range(n):
                        keep = pos[b, h, j] < 0 or (recent > 0 and pos[b, h, j] > last - recent)
                        order[j] = protected if keep else priority[b, h, j]
                    _evict_lowest(pos, order, b, h, held + 1 - target, protected)
                held = target
    return held


def compiled_decide(
    rule: ScanRule | None,
    logits: torch.Tensor | None,
    pos: torch.Tensor,
    query_pos: torch.Tensor,
    lasts: torch.Tensor,
    pads: torch.Tensor | None,
    state: dict[str, torch.Tensor],
    held: int,
    limit: int,
) -> tuple[torch.Tensor, int] | None:
    """A run's decisions by the compiled loop (see the module docstring; the arguments are
    :func:`~kvsieve.engine.scan._decide`'s): what each query could not see ``[B, H, c, N]`` and the slots held after
    the run; ``pos``, ``pads`` and the policy's state change in place. None when the loop does not apply (no rule,
    no numba, not on CPU, more than one token over the limit, padding under a rule that does not count it) and the
    torch scan decides."""
    if rule is None or pos.device.type != "cpu" or held > limit:
        return None
    bsz, heads, n = pos.shape
    gone = torch.empty((bsz, heads, query_pos.shape[1], n), dtype=torch.bool)
    if isinstance(rule, FixedPriority):
        if pads is not None:
            return None
        held = _fixed_priority(
            pos.numpy(), query_pos.numpy(), state["priority"].numpy(), gone.numpy(), held, limit, rule.recent, rule.drop
        )
        return gone, held
    if logits is None:
        return None
    run = logits.detach().numpy(), pos.numpy(), query_pos.numpy()
    if isinstance(rule, ScoreRule):
        padding = (torch.zeros_like(pos, dtype=torch.bool) if pads is None else pads).numpy()
        scales = rule.logit_scale(query_pos) if rule.gain else torch.ones(query_pos.shape)
        held = _score_rule(
            *run,
            lasts.numpy(),
            padding,
            state["score"].numpy(),
            gone.numpy(),
            scales.float().numpy(),
            held,
            limit,
            rule.accumulate,
            pattern_fields(rule.kept),
            rule.across_heads,
            rule.pool,
        )
    elif pads is None:
        held = _low_marks(*run, state["low"].numpy(), gone.numpy(), held, limit, rule.recent, rule.drop, rule.by_step)
    else:
        return None
    return gone, held
