"""A policy's rule (:mod:`kvsieve.engine.rules`) run as compiled loops on CPU, with numba (the ``fast`` extra;
without it, or on another device, the policies' torch code runs). This module holds the decode step's kernels and
what the stream protocol's scan loops (:mod:`kvsieve.engine.compiled_scan`) share with them; :func:`use_kernels` is
what a cache's ``kernels`` option means.

A decode step under a :class:`~kvsieve.engine.rules.ScoreRule` over real slots (:func:`compiled_decode`) takes the
query's probabilities from torch's softmax (they weigh the values too) and does the rest of the policy's step in one
call: the group sums added to the score, the victim chosen. While padding is held, the victim alone is chosen in one
call where the policy's priorities take many small ops (:func:`compiled_victims`: SnapKV's pooling in position order,
the h2o+ patterns' ranking). Victims are chosen with ``torch.argmin``'s tie rule (the first lowest).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvsieve.engine.rules import FixedPriority, LowMarks, Pattern, ScanRule, ScoreRule
from kvsieve.policies.base import Slots

try:
    import numba
except ImportError:  # (the `fast` extra is not installed)
    numba = None

KERNELS = ("auto", "torch")
"""What a cache's steps may run (``make_cache(..., kernels=...)``): the compiled loops where a rule has one and numba
is installed (``auto``), or the policies' torch code only (``torch``: the same decisions, the path of a GPU)."""
_NO_ORDER = np.empty((0, 0, 0), dtype=np.int64)
"""What :func:`_decode_rule` gets for a rule without pooling (it reads no position order)."""
_KERNELS: list = []
"""Every kernel :func:`jit` compiled (what :func:`compilations` counts)."""


def jit(function: Callable | None = None, *, fastmath: bool = False) -> Callable:
    """``function`` compiled by numba (cached on disk, without the GIL), or as it is without numba; ``@jit(fastmath=
    True)``: its floating-point sums may be reordered (vectorized), for products that, like torch's matmuls,
    equal their statement within rounding."""
    if function is None:
        return lambda f: jit(f, fastmath=fastmath)
    if numba is None:
        return function
    kernel = numba.njit(cache=True, nogil=True, fastmath=fastmath)(function)
    _KERNELS.append(kernel)
    return kernel


@jit
def _pattern_kept(
    pos: np.ndarray, b: int, h: int, last: int, pattern: tuple, kept: np.ndarray, rank: np.ndarray
) -> None:
    """``kept`` = the slots of row ``b``, head ``h`` that a :class:`~kvsieve.engine.rules.Pattern` (``pattern``:
    its fields in order) keeps when the newest position is ``last`` (``rank``: scratch)."""
    keep, recent, block, period, offset, span, sinks = pattern
    n = pos.shape[2]
    start = last // block * block if block > 0 else last + 1
    lowest = np.iinfo(np.int64).min
    free = keep
    for j in range(n):
        p = pos[b, h, j]
        kept[j] = p >= 0 and (p > last - recent or p >= start or p < sinks)
        free -= kept[j]
    if free > 0:  # (the free places: the highest ranks, the candidates newest first, then the others)
        for j in range(n):
            p = pos[b, h, j]
            if p < 0 or kept[j]:
                rank[j] = lowest
            else:  # (positions: distinct)
                rank[j] = p if (p + offset) % period < span else p - (last + 1)
        nth = max(0, n - free)
        bar = np.partition(rank, nth)[nth]  # (the nth lowest: a selection, not a sort)
        for j in range(n):
            kept[j] = kept[j] or (rank[j] > lowest and rank[j] >= bar)


@jit
def _position_order(pos: np.ndarray, b: int, h: int, last: int, ranked: np.ndarray, repair: bool) -> None:
    """``ranked`` = the slots of row ``b``, head ``h`` in position order (empty slots first). With ``repair``,
    ``ranked`` holds the order of the decode step before (whose victim's slot now holds the newest position,
    ``last``): that order without the slot, the slot last, where this is the position order (checked:
    positions increasing, the empty slots first); else, and for anything else it holds, a sort: O(n), not O(n log n),
    at a step."""
    n = pos.shape[2]
    if repair:
        w, newest = 0, -1
        for r in range(n):
            j = ranked[r]
            if j < 0 or j >= n:
                break
            if pos[b, h, j] == last:
                newest = j
            elif w < n - 1:
                ranked[w] = j
                w += 1
        if w == n - 1 and newest >= 0:
            ranked[w] = newest
            ordered = True
            for r in range(1, n):  # (increasing, strictly but among empty slots: each held slot once)
                now, before = pos[b, h, ranked[r]], pos[b, h, ranked[r - 1]]
                if now <= before and not (now < 0 and before < 0):
                    ordered = False
                    break
            if ordered:
                return
    ranked[:] = np.argsort(pos[b, h])


@jit
def _pooled_victim(
    score: np.ndarray,
    pos: np.ndarray,
    b: int,
    h: int,
    kept: np.ndarray,
    pool: int,
    order: np.ndarray,
    ranked: np.ndarray,
) -> int:
    """The slot of row ``b``, head ``h`` with the lowest maximum score over the ``pool`` held slots around it in
    position order (``kept`` slots count as ``-inf`` and are never the victim), the oldest of equal ones (``order``:
    scratch; ``ranked``: the slots in position order, :func:`_position_order`)."""
    n = pos.shape[2]
    for r in range(n):
        j = ranked[r]
        order[r] = -np.inf if pos[b, h, j] < 0 or kept[j] else score[b, h, j]
    victim, low = -1, np.inf
    half = pool // 2
    for r in range(n):
        j = ranked[r]
        if pos[b, h, j] < 0 or kept[j]:
            continue
        high = -np.inf
        for i in range(max(0, r - half), min(n, r + half + 1)):
            high = max(high, order[i])
        if high < low:  # (in position order: the oldest of equal maxima)
            victim, low = j, high
    return victim


@jit
def choose_victim(
    score: np.ndarray,
    pos: np.ndarray,
    padded: bool,
    b: int,
    h: int,
    last: int,
    pattern: tuple,
    pool: int,
    kept: np.ndarray,
    rank: np.ndarray,
    order: np.ndarray,
    ranked: np.ndarray,
    repair: bool = False,
) -> int:
    """The slot a :class:`~kvsieve.engine.rules.ScoreRule` (``pattern``, ``pool``) evicts from row ``b``, head
    ``h`` when the newest position is ``last``: if ``padded``, the first slot holding padding (position -1: every
    slot holds a token or padding), else the lowest-scored (pooled) outside the pattern (``kept``, ``rank``,
    ``order``: scratch; ``ranked``, ``repair``: the position order for pooling, see :func:`_position_order`)."""
    n = pos.shape[2]
    if padded:
        for j in range(n):
            if pos[b, h, j] < 0:
                return j
    _pattern_kept(pos, b, h, last, pattern, kept, rank)
    if pool > 0:
        _position_order(pos, b, h, last, ranked, repair)
        return _pooled_victim(score, pos, b, h, kept, pool, order, ranked)
    for j in range(n):  # (the first of equal scores)
        order[j] = np.inf if pos[b, h, j] < 0 or kept[j] else score[b, h, j]
    return np.argmin(order)


@jit
def _victims(
    score: np.ndarray, pos: np.ndarray, padded: bool, lasts: np.ndarray, pattern: tuple, pool: int, out: np.ndarray
) -> None:
    """``out`` ``[B, H, 1]`` = :func:`choose_victim` of every row and head (a step's one eviction; ``lasts``:
    ``[B]``)."""
    n = pos.shape[2]
    kept = np.empty(n, dtype=np.bool_)
    rank = np.empty(n, dtype=np.int64)
    ranked = np.empty(n, dtype=np.int64)
    order = np.empty(n, dtype=np.float64)
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            out[b, h, 0] = choose_victim(score, pos, padded, b, h, lasts[b], pattern, pool, kept, rank, order, ranked)


@jit
def _fixed_victims(
    priority: np.ndarray, pos: np.ndarray, padded: bool, lasts: np.ndarray, recent: int, out: np.ndarray
) -> None:
    """``out`` ``[B, H, 1]`` = each row and head's one victim under a :class:`~kvsieve.engine.rules.FixedPriority`
    (``recent``): if ``padded``, the first slot holding padding, else the lowest ``priority`` outside the ``recent``
    newest positions (the first of equal ones)."""
    n = pos.shape[2]
    order = np.empty(n, dtype=np.int64)
    highest = np.iinfo(np.int64).max
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            victim = -1
            if padded:
                for j in range(n):
                    if pos[b, h, j] < 0:
                        victim = j
                        break
            if victim < 0:
                for j in range(n):
                    order[j] = highest if pos[b, h, j] > lasts[b] - recent else priority[b, h, j]
                victim = np.argmin(order)
            out[b, h, 0] = victim


@jit
def add_scores(score: np.ndarray, total: np.ndarray, b: int, accumulate: bool, across_heads: bool) -> None:
    """Row ``b``'s ``score`` ``[B, H, N]`` plus (``accumulate``) or replaced by its query's group-summed
    probabilities ``total`` ``[H, N]`` (summed over the heads too, ``across_heads``: ``total`` changes)."""
    heads, n = total.shape
    if across_heads:
        for h in range(1, heads):
            total[0] += total[h]
        for h in range(1, heads):
            total[h] = total[0]
    for h in range(heads):
        for j in range(n):
            score[b, h, j] = score[b, h, j] + total[h, j] if accumulate else total[h, j]


@jit
def _decode_rule(
    probs: np.ndarray,
    pos: np.ndarray,
    lasts: np.ndarray,
    score: np.ndarray,
    victims: np.ndarray,
    evict: bool,
    accumulate: bool,
    pattern: tuple,
    across_heads: bool,
    pool: int,
    ranked: np.ndarray,
) -> None:
    """A decode step under a :class:`~kvsieve.engine.rules.ScoreRule` (as one token of :func:`_score_rule`):
    ``probs`` ``[B, H, G, N]``, each row's query's probabilities over the slots in use (all held: no padding),
    summed over the group in order into ``score`` (updated); ``victims`` ``[B, H, 1]`` filled when one slot goes
    (``evict``); ``ranked`` ``[B, H, N]``: the slots in position order at the step before, updated (pooling)."""
    bsz, heads, group, n = probs.shape
    total = np.zeros((heads, n), dtype=probs.dtype)
    order = np.empty(n, dtype=np.float64)
    kept = np.empty(n, dtype=np.bool_)
    rank = np.empty(n, dtype=np.int64)
    for b in range(bsz):
        total[:] = 0
        for h in range(heads):
            for g in range(group):
                for j in range(n):
                    total[h, j] += probs[b, h, g, j]
        add_scores(score, total, b, accumulate, across_heads)
        if evict:
            for h in range(heads):
                own = ranked[b, h] if pool > 0 else rank  # (a rule without pooling has no position order)
                victims[b, h, 0] = choose_victim(
                    score, pos, False, b, h, lasts[b], pattern, pool, kept, rank, order, own, True
                )


@jit
def _decode_marks(probs: np.ndarray, pos: np.ndarray, lasts: np.ndarray, low: np.ndarray, by_step: bool) -> None:
    """A decode step's marks under :class:`~kvsieve.engine.rules.LowMarks` (as one token of :func:`_low_marks`):
    ``probs`` ``[B, H, G, N]``, each row's query's probabilities over the slots in use (all held: no padding),
    summed over the group in order; the query's column of the ``low`` ring ``[B, H, N, window]`` rewritten."""
    bsz, heads, group, n = probs.shape
    total = np.zeros(n, dtype=probs.dtype)
    for b in range(bsz):
        last = lasts[b]
        column = last % low.shape[3]
        bar = np.float32(group) / np.float32(last + 1 if by_step else n)
        for h in range(heads):
            total[:] = 0
            for g in range(group):
                for j in range(n):
                    total[j] += probs[b, h, g, j]
            for j in range(n):
                low[b, h, j, column] = total[j] < bar


def pattern_fields(pattern: Pattern) -> tuple[int, int, int, int, int, int, int]:
    """A :class:`~kvsieve.engine.rules.Pattern`'s fields as the loops take them."""
    p = pattern
    return p.keep, p.recent, p.block, p.period, p.offset, p.span, p.sinks


def compilations() -> int:
    """How many kernels (:func:`jit`) this process compiled, rather than loaded from numba's on-disk cache (0
    without numba): what a run's first use costs, which timings report apart from decoding."""
    if numba is None:
        return 0
    return sum(sum(kernel.stats.cache_misses.values()) for kernel in _KERNELS)


def use_kernels(kernels: str) -> bool:
    """Whether a cache made with ``kernels`` (one of :data:`KERNELS`) runs the compiled loops where they apply."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    return kernels == "auto" and numba is not None


def decodes_by_rule(rule: ScanRule | None, device: torch.device) -> bool:
    """Whether :func:`compiled_decode` runs a decode step under ``rule`` on ``device``."""
    return isinstance(rule, ScoreRule | LowMarks) and device.type == "cpu"


def compiled_decode(
    rule: ScoreRule | LowMarks,
    logits: torch.Tensor,
    slots: Slots,
    evict: bool,
    victims: torch.Tensor,
    scale: torch.Tensor | None = None,
    ranked: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step's observation and choice under ``rule`` (where :func:`decodes_by_rule`): ``logits``
    ``[B, H, G, N]`` of each row's one query over the slots in use (each holding a real token; the query's position
    is the newest) → its probabilities ``[B, H, G, N]`` (torch's softmax), and, in one compiled call, the policy's
    state updated and, under a ``ScoreRule``, the victim per (row, head) written into ``victims`` ``[B, H, 1]``
    (int64; when one slot goes, ``evict``) and returned (None under ``LowMarks``, whose evictions the policy
    chooses). A ``ScoreRule``'s score adds the softmax of the logits times its ``logit_scale`` where it has one
    (``scale``: its value ``[B]`` at the rows' newest positions, if already computed). A pooling rule ranks the slots
    by position: ``ranked`` ``[B, H, N]`` (int64, on CPU), kept from step to step, holds that order, repaired in O(N)
    where it is the order of the step before (anything else is sorted again; without it the slots are sorted)."""
    probs = logits.softmax(dim=-1)
    pos, last = slots.pos.numpy(), slots.last.numpy()
    if isinstance(rule, LowMarks):
        _decode_marks(probs.numpy(), pos, last, slots.state["low"].numpy(), rule.by_step)
        return probs, None
    observed = probs
    if rule.gain:
        scale = rule.logit_scale(slots.last[:, None])[:, 0] if scale is None else scale
        observed = (logits * scale[:, None, None, None]).softmax(dim=-1)
    _decode_rule(
        observed.numpy(),
        pos,
        last,
        slots.state["score"].numpy(),
        victims.numpy(),
        evict,
        rule.accumulate,
        pattern_fields(rule.kept),
        rule.across_heads,
        rule.pool,
        _position_buffer(ranked, rule.pool, pos.shape),
    )
    return probs, victims


def _position_buffer(ranked: torch.Tensor | None, pool: int, shape: tuple[int, ...]) -> np.ndarray:
    """What :func:`_decode_rule` ranks the slots in: ``ranked``; without one, for a pooling rule, a new buffer (sorted
    at this step), and for a rule without pooling, which reads none, an empty array."""
    if ranked is not None:
        return ranked.numpy()
    return np.full(shape, -1, dtype=np.int64) if pool else _NO_ORDER


def compiled_victims(
    rule: ScanRule | None, slots: Slots, padded: bool, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """A step's one victim per (row, head) ``[B, H, 1]`` by a :class:`~kvsieve.engine.rules.ScoreRule`'s or a
    :class:`~kvsieve.engine.rules.FixedPriority`'s ``keep_scores`` in one compiled call (``slots``: the slots in use,
    each holding a token or, if ``padded``, maybe padding, which goes first), the slot ``argmin`` picks from the
    policy's priorities; None when the loop does not apply (no such rule, no numba, not on CPU) or would not pay (a
    score without pooling or a pattern to rank: the policy's priorities are then one or two ops, cheaper than the
    call) and the engine asks the policy. The victims are written into ``out`` (int64, on CPU) when given."""
    fixed = isinstance(rule, FixedPriority)
    if not (fixed or (isinstance(rule, ScoreRule) and (rule.pool or rule.kept.keep))):
        return None
    if slots.pos.device.type != "cpu":
        return None
    pos = slots.pos
    out = torch.empty((*pos.shape[:2], 1), dtype=torch.long) if out is None else out
    if fixed:
        _fixed_victims(
            slots.state["priority"].numpy(), pos.numpy(), padded, slots.last.numpy(), rule.recent, out.numpy()
        )
        return out
    score, last = slots.state["score"].numpy(), slots.last.numpy()
    _victims(score, pos.numpy(), padded, last, pattern_fields(rule.kept), rule.pool, out.numpy())
    return out
