"""The rules a policy may state (:meth:`~kvsieve.policies.base.Policy.scan_rule`) so that the engine runs its
decisions without calling it: the stream protocol's scan (:mod:`kvsieve.engine.scan`, compiled loops in
:mod:`kvsieve.engine.compiled_scan`) and a decode step's observation and victim (:mod:`kvsieve.engine.compiled`).
Each is tested against the policy's own ``observe`` / ``n_keep`` / ``keep_scores``; a ``ScoreRule``'s and a
``Pattern``'s once for all their policies, against their torch statement (:class:`~kvsieve.policies.scores.ScorePolicy`,
:meth:`Pattern.kept`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pattern:
    """Which held tokens a rule keeps whatever their scores, from positions alone (the newest position ``last``):
    the real tokens at the ``recent`` newest positions and, with a ``block``, those of ``last``'s block
    (``p >= last // block · block``) are kept; then, while fewer than ``keep`` are, the candidates
    (``(p + offset) % period < span``) newest first, then the others newest first. As
    :meth:`~kvsieve.policies.base.PositionalPolicy.priority` ranks them (``local``, ``strided``, ``fixed``; at most
    ``keep`` protected)."""

    keep: int
    recent: int = 0
    block: int = 0
    period: int = 1
    offset: int = 0
    span: int = 0

    @classmethod
    def window(cls, n: int) -> Pattern:
        """The tokens at the ``n`` newest positions, nothing else (a recent window:
        :func:`~kvsieve.policies.base.recent_mask`)."""
        return cls(keep=0, recent=n)

    def kept(self, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """``[B, H, N]`` bool: the slots (their tokens at positions ``pos``, -1 = empty) the pattern keeps when each
        row's newest position is ``last`` ``[B]`` — the rule in torch, which the compiled loops' reading of it
        (:mod:`kvsieve.engine.compiled`) is tested against."""
        newest = last.view(-1, 1, 1)
        kept = pos > (newest - self.recent).clamp(min=-1)  # (real tokens only: their positions are >= 0)
        if self.block > 0:
            kept |= pos >= newest // self.block * self.block
        if self.keep == 0:
            return kept
        # the free places: the highest ranks, the candidates newest first, then the others (positions: distinct)
        real, lowest = pos >= 0, torch.iinfo(pos.dtype).min
        candidate = (pos + self.offset) % self.period < self.span
        rank = torch.where(candidate, pos, pos - (newest + 1)).masked_fill(kept | ~real, lowest)
        top = rank.topk(min(self.keep, rank.shape[-1]), dim=-1)
        free = self.keep - kept.sum(dim=-1, keepdim=True)
        take = (torch.arange(top.values.shape[-1], device=pos.device) < free) & (top.values > lowest)
        return kept | torch.zeros_like(kept).scatter_(-1, top.indices, take)


@dataclass(frozen=True)
class ScoreRule:
    """A rule a policy's ``observe`` and ``keep_scores`` may follow when each step is one query (a stream's token):
    the query's attention probabilities (its logits first multiplied by ``logit_scale(query_pos)`` ``[B, c]`` where
    given), summed over its GQA group (and then over the layer's KV heads, ``across_heads``), are added to the
    ``score`` state (``SCORE_STATE`` and ``accumulate`` of :mod:`kvsieve.policies.base`) or replace it; the victim
    is the lowest-scored slot outside what ``kept`` keeps — with ``pool`` > 0, the lowest maximum of the scores over
    the ``pool`` held slots around it in position order (the kept ones count as ``-inf``; SnapKV's pooling), the
    oldest of equal ones. A ``logit_scale`` that compares equal for equal arguments (a frozen dataclass) is computed
    once per decode step for all the layers that hold an equal one."""

    accumulate: bool
    kept: Pattern = Pattern(keep=0)
    across_heads: bool = False
    pool: int = 0
    logit_scale: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class LowMarks:
    """Scissorhands' rule: each observed query marks, in a ring of the last ``window`` queries (the ``low`` state,
    ``[..., window]`` bools, its column the query's position mod ``window``), the slots whose group-summed
    probability is below ``G / t`` (``t``: the slots it attended, or its position + 1 when ``by_step``); when a step
    leaves more than ``limit`` slots it keeps ``limit`` (a prompt) or drops ``drop`` (one over: a decode step), the
    most-marked first, then the oldest, never the ``recent`` newest positions."""

    window: int
    recent: int
    drop: int
    by_step: bool


@dataclass(frozen=True)
class FixedPriority:
    """A rule without observation: a priority set once per token (the ``priority`` state, int64, higher kept), the
    ``recent`` newest positions protected; when a step leaves more than ``limit`` slots it keeps ``limit`` (a prompt)
    or drops ``drop`` (one over: a decode step), the lowest priorities first."""

    recent: int
    drop: int


ScanRule = ScoreRule | LowMarks | FixedPriority
"""The rules the stream protocol's compiled scan runs (:meth:`~kvsieve.policies.base.Policy.scan_rule`)."""


def drop_in_bulk(n: int, budget: int, drop: int) -> int:
    """``n_keep`` of a policy that compresses ``drop`` tokens at once: a decode step that leaves ``budget + 1``
    tokens keeps ``budget + 1 - drop`` (the cache then refills for ``drop`` steps), a step that leaves more (a
    prompt) keeps exactly ``budget``, fewer are all kept. ``drop = 1`` is ``min(n, budget)``."""
    if n <= budget:
        return n
    return budget if n - budget > 1 else n - drop
