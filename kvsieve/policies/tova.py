"""``tova``: keep the tokens the current query attends to most (Token Omission Via Attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.engine.rules import ScoreRule
from kvsieve.policies.base import SCORE_STATE, Observation, Policy, Slots, register


@dataclass(frozen=True)
class TOVAParams:
    per_head: bool = False
    """False (the paper): one score per layer, the attention averaged over all heads, so every KV head keeps the same
    tokens. True: each KV head keeps its own tokens, scored by its GQA group's attention."""


@register
class TOVA(Policy):
    """Keeps the ``budget`` tokens with the highest attention from the newest query; no accumulation.

    Oren et al., "Transformers are Multi-State RNNs", 2024 (arXiv:2401.06104), as in the authors' ``TOVACache``:
    after each step that leaves more than ``budget`` tokens, score every token (the new ones included) by the
    attention probability it gets from the step's last query row, averaged over all heads of the layer, and keep
    the top ``budget``. After the prompt this is one top-k by the last prompt token's attention; at each decode step
    it evicts the token the current query attends to least. Nothing is protected.

    Choices: with ``per_head=True`` the score is per KV head (its group's query heads summed), which the paper does
    not do. With left padding the step's last query is real in every row. Ties follow ``torch.topk``. The rule is a
    :class:`~kvsieve.engine.rules.ScoreRule` (``scan_rule``): the stream protocol's scan decides on CPU in one
    compiled loop, with the same decisions.
    """

    name = "tova"
    paper = "Oren et al., Transformers are Multi-State RNNs, 2024 (arXiv:2401.06104)"
    row_additive = True
    Params = TOVAParams

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return SCORE_STATE

    def observed_rows(self) -> int:
        return 1

    def observe(self, slots: Slots, obs: Observation) -> None:
        last = obs.probs[:, :, -1]  # the block's last query; the step's last block is observed last
        if not self.params.per_head:
            last = last.sum(dim=1, keepdim=True).expand_as(last)
        slots.state["score"].copy_(last)

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        return slots.state["score"]

    def scan_rule(self) -> ScoreRule:
        return ScoreRule(accumulate=False, across_heads=not self.params.per_head)
