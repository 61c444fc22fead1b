"""``snapkv``: keep what an observation window of recent queries attends to, pooled, plus the window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvsieve.engine.rules import Pattern, ScoreRule
from kvsieve.policies.base import Observation, Slots, register
from kvsieve.policies.families import ScorePolicy


@dataclass(frozen=True)
class SnapKVParams:
    window: int | None = None
    """Observation window: the newest queries whose attention is counted, and the newest tokens always kept;
    default ``min(32, budget // 2)`` (the paper: 32)."""
    kernel: int = 7
    """Width of the 1-D pooling over positions (odd; 1 = no pooling)."""
    pooling: Literal["max", "mean"] = "max"
    """How the scores are pooled: their maximum (the authors' ``maxpool``) or their mean (``avgpool``: the authors'
    code's default and kvpress's; positions beyond the ends count as 0)."""


@register
class SnapKV(ScorePolicy):
    """Keeps the ``window`` newest tokens plus the tokens the observation window attends to most, pooled.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024 (arXiv:2404.14469), as
    in the authors' ``SnapKVCluster``. At the prompt: a token's score is the attention it gets from the last
    ``window`` prompt queries (probabilities summed over those queries and over the GQA group of its KV head); the
    scores of the tokens outside the window are pooled along positions (kernel ``kernel``, the window's tokens
    excluded from the pooling), and the top ``budget - window`` of them are kept with the window. A prompt that
    fits the budget is not compressed.

    The pooling is the paper's ambiguity: its listing calls a ``pool1d`` it does not name, the authors' code offers
    ``maxpool`` and ``avgpool`` (its default). kvsieve pools by the maximum (``pooling="max"``, the default, which
    every published grid used); ``pooling="mean"`` is the other (a window's sum over ``kernel``, the places beyond
    either end and the window's tokens counting as 0, as ``avg_pool1d`` pads), kvpress's ``SnapKVPress`` rule: the
    mean is linear, so summing over the GQA group and the queries before pooling (kvsieve) ranks as averaging over
    them (kvpress) does, up to round-off. Both are measured beside kvpress on RULER (``docs/results/kvpress.md``). The
    compiled loops pool by the maximum only: under the mean the policy's torch code runs (no ``scan_rule``).

    SnapKV compresses the prompt only; kvsieve keeps the cache bounded during decoding with the same rule
    (a kvsieve choice): each decode query is in the observation window, so its attention is added to the scores;
    when a step leaves more than ``budget`` tokens, the ``window`` newest are kept and the others compete by pooled
    score (pooling over the held tokens in position order). Scores accumulate while a token is held. Ties of the
    pooled scores (frequent: neighbours share a maximum) keep the newer token. The priorities are a
    :class:`~kvsieve.engine.rules.ScoreRule` with pooling (``score_rule``, in torch by
    :class:`~kvsieve.policies.families.ScorePolicy`); with a window the rule also observes as a stream does
    (``scan_rule``), so on CPU the compiled loops run it, with the same decisions.
    """

    name = "snapkv"
    paper = "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024 (arXiv:2404.14469)"
    Params = SnapKVParams

    def setup(self) -> None:
        p = self.params
        self.window = min(32, self.budget // 2) if p.window is None else p.window
        if not 0 <= self.window <= self.budget:
            raise ValueError(f"snapkv: window must be in [0, budget={self.budget}], got {self.window}")
        if p.kernel < 1 or p.kernel % 2 == 0:
            raise ValueError(f"snapkv: kernel must be a positive odd number, got {p.kernel}")

    def observed_rows(self) -> int:
        return self.window

    def observe(self, slots: Slots, obs: Observation) -> None:
        observing = obs.query_pos > (slots.last[:, None] - self.window)
        slots.state["score"] += (obs.probs * observing[:, None, :, None]).sum(dim=2)

    def score_rule(self) -> ScoreRule:
        p = self.params
        return ScoreRule(
            accumulate=True, kept=Pattern.window(self.window), pool=p.kernel, mean_pool=p.pooling == "mean"
        )

    def scan_rule(self) -> ScoreRule | None:
        # (in a stream each query is the newest token, inside a window of at least one: every one is counted)
        return None if self.window == 0 else super().scan_rule()
