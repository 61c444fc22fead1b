"""``tova``: keep the tokens the current query attends to most (Token Omission Via Attention)."""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.engine.rules import ScoreRule
from kvsieve.policies.base import register
from kvsieve.policies.families import ScorePolicy


@dataclass(frozen=True)
class TOVAParams:
    per_head: bool = False
    """False (the paper): one score per layer, the attention averaged over all heads, so every KV head keeps the same
    tokens. True: each KV head keeps its own tokens, scored by its GQA group's attention."""


@register
class TOVA(ScorePolicy):
    """Keeps the ``budget`` tokens with the highest attention from the newest query; no accumulation.

    Oren et al., "Transformers are Multi-State RNNs", 2024 (arXiv:2401.06104), as in the authors' ``TOVACache``:
    after each step that leaves more than ``budget`` tokens, score every token (the new ones included) by the
    attention probability it gets from the step's last query row, averaged over all heads of the layer, and keep
    the top ``budget``. After the prompt this is one top-k by the last prompt token's attention; at each decode step
    it evicts the token the current query attends to least. Nothing is protected.

    Choices: with ``per_head=True`` the score is per KV head (its group's query heads summed), which the paper does
    not do. With left padding the step's last query is real in every row. Ties follow ``torch.topk``. The rule is a
    :class:`~kvsieve.engine.rules.ScoreRule` (``score_rule``), run by the family's torch code
    (:class:`~kvsieve.policies.families.ScorePolicy`) or, on CPU, by the compiled loops, with the same decisions.
    """

    name = "tova"
    paper = "Oren et al., Transformers are Multi-State RNNs, 2024 (arXiv:2401.06104)"
    row_additive = True
    Params = TOVAParams

    def observed_rows(self) -> int:
        return 1

    def score_rule(self) -> ScoreRule:
        return ScoreRule(accumulate=False, across_heads=not self.params.per_head)
