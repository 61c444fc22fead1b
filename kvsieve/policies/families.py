"""The rule families in torch. A policy of a family states its rule (:mod:`kvsieve.engine.rules`) and gets its
``state_spec``, ``observe``, ``n_keep``, ``keep_scores`` and ``scan_rule`` from the family's class here — the one torch
statement of the rule, which the compiled loops (:mod:`kvsieve.engine.compiled`, :mod:`kvsieve.engine.compiled_scan`)
are tested against once per family — and writes only what differs from it (its parameters, a prompt-only rule, a
variant outside the rule):

- :class:`ScorePolicy`, a :class:`~kvsieve.engine.rules.ScoreRule` (accumulated or last-row attention with a kept
  pattern): ``h2o``, the ``h2o+`` policies, ``tova``, ``snapkv``, ``ahakv``;
- :class:`MarksPolicy`, :class:`~kvsieve.engine.rules.LowMarks` (low-attention marks in a window): ``scissorhands``;
- :class:`PriorityPolicy`, :class:`~kvsieve.engine.rules.FixedPriority` (a priority set once per token):
  ``knorm``.

The positional family (a :class:`~kvsieve.engine.rules.Pattern`) is
:class:`~kvsieve.policies.base.PatternPolicy`."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.nn.functional as F

from kvsieve.engine.rules import FixedPriority, LowMarks, Pattern, ScoreRule, drop_in_bulk
from kvsieve.policies.base import (
    SCORE_STATE,
    Observation,
    Policy,
    Slots,
    accumulate,
    group_sum,
    in_position_order,
    protect,
)


def scaled_probs(obs: Observation, scale: torch.Tensor) -> torch.Tensor:
    """``[B, H, b, N]`` the softmax of each query head's logits times ``scale`` (``[B, 1, b]`` per row, or
    ``[B, H, b]`` per KV head), the group summed, padding rows zero. A scale of 0 gives the uniform distribution over
    the slots the row attended to (the logits are ``-inf`` where masked, and ``-inf · 0`` is NaN: masked again)."""
    logits = (obs.logits * scale[:, :, None, :, None]).nan_to_num_(nan=float("-inf"))
    return group_sum(logits.softmax(dim=-1), obs.query_pos)


def pooled_in_position_order(values: torch.Tensor, pos: torch.Tensor, kernel: int, mean: bool = False) -> torch.Tensor:
    """``[B, H, N]``: each slot's max (``mean``: mean) of ``values`` over the ``kernel`` slots around it in position
    order (empty slots first), in slot order. The places beyond either end count as ``-inf`` for the maximum and as 0
    for the mean, which divides by ``kernel`` there too (``max_pool1d``'s and ``avg_pool1d``'s padding)."""

    def pooled(ordered: torch.Tensor) -> torch.Tensor:
        pool = F.avg_pool1d if mean else F.max_pool1d
        return pool(ordered.reshape(-1, 1, ordered.shape[-1]), kernel, 1, kernel // 2).view_as(ordered)

    return in_position_order(pos, pooled, values)


def pooled_priority(score: torch.Tensor, pos: torch.Tensor, kernel: int, mean: bool = False) -> torch.Tensor:
    """``[B, H, N]`` int64: each slot's :func:`pooled_in_position_order` ``score``, equal values ordered by position
    (newer higher), as one integer: the pooled value's bits in the high half, the position in the low half —
    priorities whose ties do not depend on the slot layout, with no second sort.

    ``score`` is fp32 and non-negative or ``-inf`` (summed probabilities, masked slots; a mean's masked slots are
    0), whose bits order as the int32 they read as."""
    bits = pooled_in_position_order(score, pos, kernel, mean).view(torch.int32).long()
    return (bits << 32) | pos.clamp(min=0)  # (an empty slot's -inf is the lowest anyway)


class ScorePolicy(Policy):
    """A policy of the accumulated-score family: its :meth:`score_rule`, run in torch.

    :meth:`observe` adds each observed row's probabilities (with a ``gain``, the step-gain softmax's: the logits
    first scaled by the rule's ``logit_scale`` at the rows' positions), summed over the GQA group and,
    ``across_heads``, over the layer's KV heads, to the
    ``score`` state (``accumulate``) or sets it to the last row's (otherwise). :meth:`keep_scores` is the score, with
    ``pool`` its max-pooled priority over the held slots in position order (:func:`pooled_priority`, the kept ones
    at ``-inf``; ``mean_pool``: mean-pooled, the kept ones at 0), and the slots of the rule's ``kept`` pattern
    protected. :meth:`scan_rule` is the same rule: the engine's compiled loops run it unless a policy returns None
    there (its own ``observe`` differs in a stream); they pool by the maximum only, so a mean-pooling rule is run
    by this torch code alone (no scan rule)."""

    def __init__(self, budget: int | None, params: Any = None) -> None:
        super().__init__(budget, params)
        self.scores = self.score_rule()
        """:meth:`score_rule`, stated once (the parameters never change)."""

    def score_rule(self) -> ScoreRule:
        """The policy's rule (called once, after ``setup``)."""
        raise NotImplementedError

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return SCORE_STATE

    def observe(self, slots: Slots, obs: Observation) -> None:
        rule = self.scores
        probs = scaled_probs(obs, rule.logit_scale(obs.query_pos)[:, None]) if rule.gain else obs.probs
        if rule.across_heads:
            probs = probs.sum(dim=1, keepdim=True).expand_as(probs)
        if rule.accumulate:
            accumulate(slots.state["score"], probs)
        else:  # (the step's last row: its last block is observed last)
            slots.state["score"].copy_(probs[:, :, -1])

    def observes_as(self) -> Hashable | None:
        return self.scores.observed if type(self).observe is ScorePolicy.observe else None

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        rule, score = self.scores, slots.state["score"]
        kept = rule.kept.kept(slots.pos, slots.last)
        if rule.pool:
            masked = score.masked_fill(kept | (slots.pos < 0), 0.0 if rule.mean_pool else float("-inf"))
            return protect(pooled_priority(masked, slots.pos, rule.pool, rule.mean_pool), kept)
        return protect(score, kept)

    def scan_rule(self) -> ScoreRule | None:
        rule = self.score_rule()
        return None if rule.mean_pool else rule


class _BulkPolicy(Policy):
    """What the marks and priority families share: their rule (``scan_rule``, held as ``rule``) protects the
    ``recent`` newest positions, and a decode step that leaves one over the limit drops ``drop`` tokens at once
    (:func:`~kvsieve.engine.rules.drop_in_bulk`)."""

    rule: LowMarks | FixedPriority

    def __init__(self, budget: int | None, params: Any = None) -> None:
        super().__init__(budget, params)
        self.newest = Pattern.window(self.rule.recent)

    def n_keep(self, n: int, limit: int | None = None) -> int:
        return drop_in_bulk(n, self.budget if limit is None else limit, self.rule.drop)


class MarksPolicy(_BulkPolicy):
    """A policy of the low-attention-marks family: its :meth:`marks_rule`, run in torch.

    :meth:`observe` lets each of a step's last ``window`` rows rewrite its column of the ``low`` ring (the row's
    position mod ``window``) for every slot: True where the slot's group-summed probability is below ``G / t``
    (``t``: the slots the row attended, or its position + 1 with ``by_step``), False elsewhere; a padding row
    writes nothing. :meth:`n_keep` drops ``drop`` at a decode step that leaves one over the limit.
    :meth:`keep_scores` ranks the most-marked lowest, then the oldest, the ``recent`` newest protected."""

    row_additive = True
    rule: LowMarks

    def marks_rule(self) -> LowMarks:
        """The policy's rule (called once, after ``setup``)."""
        raise NotImplementedError

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"low": ((self.rule.window,), torch.bool)}

    def observed_rows(self) -> int:
        return self.rule.window  # (the last w rows rewrite every column of the ring)

    def observes_as(self) -> Hashable | None:
        return self.rule.observed if type(self).observe is MarksPolicy.observe else None

    def observe(self, slots: Slots, obs: Observation) -> None:
        w = self.rule.window
        # Only the block's last w rows can still be in the window; their positions are distinct mod w.
        probs, allowed, query_pos = obs.probs[:, :, -w:], obs.allowed[:, :, -w:], obs.query_pos[:, -w:]
        # t: the slots each row attended or, by_step, the tokens it has seen (its own included)
        t = (query_pos + 1).clamp(min=1)[:, None, :, None] if self.rule.by_step else allowed.sum(-1, keepdim=True)
        low = allowed & (probs < obs.logits.shape[2] / t)  # [B, H, b, N]
        ring = slots.state["low"]
        if low.shape[2] == 1:  # one row (a decode step): it rewrites its own column, a padding row nothing
            column = (query_pos.clamp(min=0) % w)[:, None, :, None].expand(*ring.shape[:3], 1)
            real = (query_pos >= 0)[:, None, :, None]
            ring.scatter_(3, column, torch.where(real, low.transpose(2, 3), ring.gather(3, column)))
            return
        column = F.one_hot(query_pos.clamp(min=0) % w, w) * (query_pos >= 0)[..., None]  # [B, b, w]
        marks = torch.einsum("bhrn,brc->bhnc", low.float(), column.float()) > 0
        ring.copy_(torch.where(column.any(dim=1)[:, None, None, :], marks, ring))

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        count = slots.state["low"].sum(dim=-1)
        score = (slots.pos - count * (slots.last[:, None, None] + 1)).double()  # fewest marks first, then newest
        return protect(score, self.newest.kept(slots.pos, slots.last))

    def scan_rule(self) -> LowMarks:
        return self.marks_rule()


class PriorityPolicy(_BulkPolicy):
    """A policy of the fixed-priority family: its :meth:`priority_rule`, run in torch, and its
    :meth:`initial_priority`, computed once per token as it is cached (no observation).

    :meth:`n_keep` drops ``drop`` at a decode step that leaves one over the limit; :meth:`keep_scores` is the
    ``priority`` state, the ``recent`` newest protected."""

    rule: FixedPriority

    def priority_rule(self) -> FixedPriority:
        """The policy's rule (called once, after ``setup``)."""
        raise NotImplementedError

    def initial_priority(self, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[B, H, q]`` int64 priorities (higher kept) of tokens being cached, from their keys ``[B, H, q, D]`` (as
        cached) and positions ``[B, H, q]`` (-1 = padding)."""
        raise NotImplementedError

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"priority": ((), torch.int64)}

    def initial_state(self, keys: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"priority": self.initial_priority(keys, pos)}

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        priority = slots.state["priority"]
        if self.rule.recent:
            priority = protect(priority, self.newest.kept(slots.pos, slots.last))
        return priority

    def scan_rule(self) -> FixedPriority:
        return self.priority_rule()
