"""The accumulated-score family in torch: a policy that states a :class:`~kvsieve.engine.rules.ScoreRule` gets its
observation and priorities from :class:`ScorePolicy` — the one torch statement of the rule, which the compiled loops
(:mod:`kvsieve.engine.compiled`, :mod:`kvsieve.engine.compiled_scan`) are tested against — and writes only what
differs from it (its parameters, a prompt-only rule, a variant outside the rule)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvsieve.engine.rules import ScoreRule
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


def pooled_priority(score: torch.Tensor, pos: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[B, H, N]`` int64: each slot's max of ``score`` over the ``kernel`` slots around it in position order,
    equal maxima ordered by position (newer higher), as one integer: the pooled maximum's bits in the high half, the
    position in the low half — priorities whose ties do not depend on the slot layout, with no second sort.

    ``score`` is fp32 and non-negative or ``-inf`` (summed probabilities, masked slots), whose bits order as the
    int32 they read as."""

    def pooled(ordered: torch.Tensor) -> torch.Tensor:
        return F.max_pool1d(ordered.reshape(-1, 1, ordered.shape[-1]), kernel, 1, kernel // 2).view_as(ordered)

    bits = in_position_order(pos, pooled, score).view(torch.int32).long()
    return (bits << 32) | pos.clamp(min=0)  # (an empty slot's -inf is the lowest anyway)


class ScorePolicy(Policy):
    """A policy of the accumulated-score family: its :meth:`score_rule`, run in torch.

    :meth:`observe` adds each observed row's probabilities (the logits first scaled by the rule's ``logit_scale``
    at the rows' positions), summed over the GQA group and, ``across_heads``, over the layer's KV heads, to the
    ``score`` state (``accumulate``) or sets it to the last row's (otherwise). :meth:`keep_scores` is the score, with
    ``pool`` its max-pooled priority over the held slots in position order (:func:`pooled_priority`, the kept ones
    at ``-inf``), and the slots of the rule's ``kept`` pattern protected. :meth:`scan_rule` is the same rule: the
    engine's compiled loops run it unless a policy returns None there (its own ``observe`` differs in a stream)."""

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
        probs = obs.probs if rule.logit_scale is None else scaled_probs(obs, rule.logit_scale(obs.query_pos)[:, None])
        if rule.across_heads:
            probs = probs.sum(dim=1, keepdim=True).expand_as(probs)
        if rule.accumulate:
            accumulate(slots.state["score"], probs)
        else:  # (the step's last row: its last block is observed last)
            slots.state["score"].copy_(probs[:, :, -1])

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        rule, score = self.scores, slots.state["score"]
        kept = rule.kept.kept(slots.pos, slots.last)
        if rule.pool:
            masked = score.masked_fill(kept | (slots.pos < 0), float("-inf"))
            return protect(pooled_priority(masked, slots.pos, rule.pool), kept)
        return protect(score, kept)

    def scan_rule(self) -> ScoreRule | None:
        return self.score_rule()
