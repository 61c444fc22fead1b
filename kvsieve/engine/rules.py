"""The rules of the eviction families (:mod:`kvsieve.policies.families`, and a :class:`Pattern`'s positional
policies), which a policy states so that the engine runs its decisions without calling it: the stream protocol's scan
(:mod:`kvsieve.engine.scan`, compiled loops in :mod:`kvsieve.engine.compiled_scan`) and a decode step's observation
and victim (:mod:`kvsieve.engine.compiled`). Each compiled reading is tested once per family against the family's
torch statement."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

PROTECTED = torch.iinfo(torch.long).max
"""The priority of a protected slot in an integer priority (one built from positions)."""


@dataclass(frozen=True)
class Pattern:
    """Which held tokens a rule keeps from positions alone (the newest position ``last``), at most ``keep`` of them:
    the real tokens at the ``sinks`` first positions, at the ``recent`` newest and, with a ``block``, those of
    ``last``'s block (``p >= last // block · block``) are protected; then, while fewer than ``keep`` are kept, the
    candidates (``(p + offset) % period < span``) newest first, then the others newest first.

    The positional policies are patterns (:class:`~kvsieve.policies.base.PatternPolicy`: ``local``,
    ``streaming_llm``, ``strided``, ``fixed``), the ``h2o+`` policies keep one whatever their scores, and a recent
    window (:meth:`window`) is one. :meth:`priority` is the pattern's one statement; :meth:`kept` is its top ``keep``,
    which the compiled loops' reading (:mod:`kvsieve.engine.compiled`) is tested against."""

    keep: int
    recent: int = 0
    block: int = 0
    period: int = 1
    offset: int = 0
    span: int = 0
    sinks: int = 0

    @classmethod
    def window(cls, n: int) -> Pattern:
        """The tokens at the ``n`` newest positions, nothing else (a recent window)."""
        return cls(keep=0, recent=n)

    def protected(self, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """``[B, H, N]`` bool: the slots (their tokens at positions ``pos``, -1 = empty) of real tokens among the
        sinks, the recent window or the newest token's block when each row's newest position is ``last`` ``[B]``."""
        newest = last.view(-1, 1, 1)
        kept = pos > (newest - self.recent).clamp(min=-1)  # (real tokens only: their positions are >= 0)
        if self.block > 0:
            kept |= pos >= newest // self.block * self.block
        if self.sinks > 0:
            kept |= (pos >= 0) & (pos < self.sinks)
        return kept

    def priority(self, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """``[B, H, N]`` int64 priorities (higher kept): :data:`PROTECTED` for :meth:`protected`, then the
        candidates by position, then the others by position (below every candidate). Padding falls among the
        others; the engine never keeps it over real tokens."""
        return self._ranked(pos, last, self.protected(pos, last))

    def kept(self, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """``[B, H, N]`` bool: the slots the pattern keeps — :meth:`protected` and, up to ``keep`` in all, the real
        tokens of the highest :meth:`priority`."""
        protected = self.protected(pos, last)
        if self.keep == 0:
            return protected
        real = pos >= 0
        ranked = self._ranked(pos, last, protected).masked_fill(~real, torch.iinfo(pos.dtype).min)
        top = ranked.topk(min(self.keep, pos.shape[-1]), dim=-1).indices
        return protected | torch.zeros_like(protected).scatter_(-1, top, True) & real

    def _ranked(self, pos: torch.Tensor, last: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        """:meth:`priority`, given :meth:`protected`."""
        rank = pos
        if self.span > 0:
            candidate = (pos + self.offset) % self.period < self.span
            rank = torch.where(candidate, pos, pos - (last.view(-1, 1, 1) + 1))
        return rank.masked_fill(protected, PROTECTED)


def step_gain(count: torch.Tensor, budget: int) -> torch.Tensor:
    """The step-gain softmax's multiplier of the scaled logits of a row that has seen ``count`` tokens (fp32) at a
    ``budget`` ``k``: ``sqrt(2 ln(count / k))``, 0 (uniform) while ``count <= k`` (AhaKV's SGS)."""
    return (2 * torch.log(count / budget)).clamp(min=0).sqrt()


@dataclass(frozen=True)
class ScoreRule:
    """A rule a policy's ``observe`` and ``keep_scores`` may follow when each step is one query (a stream's token):
    the query's attention probabilities (with a ``gain`` ``k`` > 0, the step-gain softmax's: its logits first
    multiplied by :meth:`logit_scale`), summed over its GQA group (and then over the layer's KV heads,
    ``across_heads``), are added to the ``score`` state (``SCORE_STATE`` and ``accumulate`` of
    :mod:`kvsieve.policies.base`) or replace it; the victim is the lowest-scored slot outside what ``kept`` keeps —
    with ``pool`` > 0, the lowest maximum of the scores over the ``pool`` held slots around it in position order (the
    kept ones count as ``-inf``; SnapKV's pooling), the oldest of equal ones; with ``mean_pool`` the lowest mean over
    them instead (the kept ones and the ``pool // 2`` places beyond either end count as 0: the authors' ``avgpool``,
    run by the policies' torch code only). The multiplier depends on the rows' positions and ``gain`` alone: the
    layers of a decode step with equal gains compute it once."""

    accumulate: bool
    kept: Pattern = Pattern(keep=0)
    across_heads: bool = False
    pool: int = 0
    gain: int = 0
    mean_pool: bool = False

    @property
    def observed(self) -> ScoreRule:
        """The fields the observation reads (``kept`` and the pooling choose among the scores, they do not make
        them)."""
        return replace(self, kept=Pattern(keep=0), pool=0, mean_pool=False)

    def logit_scale(self, query_pos: torch.Tensor) -> torch.Tensor:
        """``[B, c]`` fp32: :func:`step_gain` at ``gain`` of the rows at ``query_pos`` ``[B, c]`` (the tokens they
        have seen: their position + 1)."""
        return step_gain((query_pos + 1).float(), self.gain)


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

    @property
    def observed(self) -> LowMarks:
        """The fields the marking reads (``recent`` and ``drop`` choose among the marked, they do not mark)."""
        return replace(self, recent=0, drop=1)


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
