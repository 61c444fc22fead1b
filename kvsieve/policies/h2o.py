"""``h2o``: heavy hitters by accumulated attention + a recent window."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Literal

import torch

from kvsieve.engine.rules import Pattern, ScoreRule
from kvsieve.policies.base import Observation, Slots, accumulate, group_sum, protect, register
from kvsieve.policies.families import ScorePolicy


@dataclass(frozen=True)
class H2OParams:
    recent: int | None = None
    """Recent-window slots; default ``int(budget · recent_ratio)``."""
    recent_ratio: float = 0.5
    """Share of the budget given to the recent window when ``recent`` is not set (the paper: half/half)."""
    transform: Literal["identity", "sqrt", "log"] = "identity"
    """Score function ``h``: ``identity``, ``sqrt`` (``sqrt(z+1)``) or ``log`` (``log(z+1)``); see the class doc."""
    normalize: bool = False
    """Divide the score by the number of query rows that have seen the token (mean instead of sum)."""


TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda z: z,
    "sqrt": lambda z: (z + 1).sqrt(),
    "log": torch.log1p,
}


@register
class H2O(ScorePolicy):
    """Heavy-Hitter Oracle: keep the tokens that received the most attention, plus the most recent ones.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
    NeurIPS 2023 (arXiv:2306.14048), as in the authors' real-drop implementation (``H2OKVCache_LayerWise``):

    - per KV head, a token's score is the attention probability it has received, accumulated in fp32 over every
      query row and every step while it is kept (a new token's first term is the current step's column, its
      attention to itself included); the query heads of a GQA group are summed;
    - budget ``B = heavy + recent``; after any step that leaves more than ``B`` tokens, keep the last ``recent``
      tokens and the ``heavy`` best-scored tokens outside them. After the prompt this is one top-k; at each decode
      step it evicts exactly the lowest-scored token outside the recent window.

    Choices: padding queries add nothing; the original code assumes batch size 1 and sums the batch dimension,
    here every batch row keeps its own scores. Ties in the top-k follow ``torch.topk``. The rule is a
    :class:`~kvsieve.engine.rules.ScoreRule` (``score_rule``), run by the family's torch code
    (:class:`~kvsieve.policies.families.ScorePolicy`) or, with the default ``transform`` and no ``normalize``
    (``scan_rule``), on CPU by the compiled loops, with the same decisions.

    Variants:

    - ``recent=0`` (or ``recent_ratio=0``): heavy hitters only, the paper's "w. H2" ablation — the newest token
      competes like any other.
    - ``transform`` ``h``: we read the score function of the paper's submodular analysis as
      ``F(S) = Σ_rows h(attention mass the row puts on the kept set S)`` for a concave ``h``, the greedy step
      evicting the token whose removal lowers ``F`` least; ``h`` = identity gives the accumulated attention above.
      (A monotone ``h`` of the accumulated score alone would change no top-k: it only matters where terms
      combine.) Each row adds, per query head, the token's marginal value ``h(1) - h(1 - a)`` (the row's mass
      over the slots it attended is 1 when it is observed), summed over the group's heads and the rows. The
      marginal is frozen then: re-evaluating it after later evictions would need every past row's attention.
      With ``sqrt(z+1)`` or ``log(z+1)`` it is convex in ``a``: one strong attention outweighs several weak ones
      of the same total.
    - ``normalize``: the score divided by the number of query rows that have seen the token (its age + 1, its own
      row included) — the mean attention, de-biased against old tokens, as in Cold Compress's H2O variant.
    """

    name = "h2o"
    paper = "Zhang et al., H2O: Heavy-Hitter Oracle, NeurIPS 2023 (arXiv:2306.14048)"
    row_additive = True
    Params = H2OParams

    def setup(self) -> None:
        p = self.params
        if not 0.0 <= p.recent_ratio <= 1.0:
            raise ValueError(f"h2o: recent_ratio must be in [0, 1], got {p.recent_ratio}")
        recent = int(self.budget * p.recent_ratio) if p.recent is None else p.recent
        if recent < 0:
            raise ValueError(f"h2o: recent must be >= 0, got {recent}")
        if recent > self.budget:
            raise ValueError(f"h2o: recent window ({recent}) is larger than the budget ({self.budget})")
        if p.transform not in TRANSFORMS:
            raise ValueError(f"h2o: transform must be one of {', '.join(TRANSFORMS)}, got {p.transform!r}")
        self.recent = recent
        self.heavy = self.budget - recent

    def score_rule(self) -> ScoreRule:
        return ScoreRule(accumulate=True, kept=Pattern.window(self.recent))

    def observe(self, slots: Slots, obs: Observation) -> None:
        if self.params.transform == "identity":  # h(1) - h(1 - a) = a: the rule's group-summed probabilities
            super().observe(slots, obs)
            return
        h = TRANSFORMS[self.params.transform]
        probs = obs.logits.softmax(dim=-1)
        accumulate(slots.state["score"], group_sum(h(torch.ones_like(probs)) - h(1 - probs), obs.query_pos))

    def observes_as(self) -> Hashable | None:
        return self.scores.observed if self.params.transform == "identity" else None  # (then the family's observe)

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        if not self.params.normalize:
            return super().keep_scores(slots)
        score = slots.state["score"] / (slots.age + 1)
        return protect(score, self.scores.kept.kept(slots.pos, slots.last))

    def scan_rule(self) -> ScoreRule | None:
        plain = self.params.transform == "identity" and not self.params.normalize
        return self.score_rule() if plain else None
