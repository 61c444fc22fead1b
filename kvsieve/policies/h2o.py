"""``h2o``: heavy hitters by accumulated attention + a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.policies.base import Observation, Policy, Slots, recent_mask


@dataclass(frozen=True)
class H2OParams:
    recent: int | None = None
    """Recent-window slots; default ``int(budget · recent_ratio)``."""
    recent_ratio: float = 0.5
    """Share of the budget given to the recent window when ``recent`` is not set (the paper: half/half)."""


class H2O(Policy):
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
    here every batch row keeps its own scores. Ties in the top-k follow ``torch.topk``.
    """

    name = "h2o"
    paper = "Zhang et al., H2O: Heavy-Hitter Oracle, NeurIPS 2023 (arXiv:2306.14048)"
    needs_attention = True
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
        self.recent = recent
        self.heavy = self.budget - recent

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"score": ((), torch.float32)}

    def observe(self, slots: Slots, obs: Observation) -> None:
        slots.state["score"] += obs.probs.sum(dim=2)

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        return slots.state["score"].masked_fill(recent_mask(slots, self.recent), float("inf"))
