"""``scissorhands``: drop the tokens that most often received less than their uniform share of attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvsieve.engine.rules import LowMarks
from kvsieve.policies.base import register
from kvsieve.policies.families import MarksPolicy


@dataclass(frozen=True)
class ScissorhandsParams:
    window: int = 100
    """History window ``w``: the last ``w`` attention rows (query tokens) whose low-attention events count."""
    recent: int | None = None
    """Recent window ``r`` (never dropped); default ``min(10, budget + 1 - drop)``."""
    drop: int | None = None
    """Tokens dropped per compression ``m``; default ``max(1, budget // 2)`` (the paper's experiments: B/2)."""
    threshold: Literal["attended", "paper"] = "attended"
    """A row marks a token below ``1/t``: ``t`` = the tokens the row ``attended`` (its uniform share of the kept
    ones) or, ``paper``, Algorithm 2's ``t`` = the generation step (the tokens the row has seen, evicted ones too)."""


@register
class Scissorhands(MarksPolicy):
    """Scissorhands: keep the pivotal tokens, i.e. drop those that keep getting below-average attention.

    Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache Compression at
    Test Time", NeurIPS 2023 (arXiv:2305.17118), Algorithms 1 and 2, per (batch row, KV head):

    - a query row that attended to ``t`` tokens marks every token it gave less than the uniform share ``1/t`` as
      *unimportant* (``threshold="attended"``, the default; Algorithm 2 writes ``1/t`` with ``t`` the generation
      step, i.e. the tokens seen including evicted ones: ``threshold="paper"``, a lower bar once the cache is full).
      The default keeps the paper's meaning — below the row's uniform share — for a row whose softmax covers only
      the kept tokens; measured (``kvsieve reproduce scissorhands``, 1,024 Wikipedia tokens, stream protocol, full
      19.77) the two do not differ consistently: 21.50 vs 21.58 at 10 %, 20.33 vs 20.10 at 20 %. A token's count
      is the number of such marks from the last ``w`` rows (the history window);
    - the ``r`` newest tokens (the recent window) are never dropped (the paper's ``I[:-r] ← 0`` means the last r);
    - when a decode step leaves ``B + 1`` tokens, the ``m`` tokens with the highest counts are dropped at once, so
      the cache goes ``B+1-m, B+2-m, ..., B`` and compresses every ``m`` steps — exactly Algorithm 1, which
      compresses the ``B`` cached tokens to ``B - m`` and then appends the new one. ``n_keep`` tells a decode step
      from a multi-token one (a prompt) by ``n - B``: more than one token over the budget → keep exactly ``B``
      (a prompt of exactly ``B + 1`` tokens is treated like a decode step and keeps ``B + 1 - m``).

    Defaults: ``w = 100`` and ``r = 10`` as in the authors' released code; ``m = B/2`` as in the paper's experiments
    (for small budgets ``r`` shrinks so that ``m`` tokens outside it can always be dropped).

    Choices where the paper is silent:

    - GQA: a row marks a token when the mean over the group's query heads of its probability is below ``1/t``
      (the group-summed probability below ``G/t``), so the group acts as one attention head of the KV head.
    - The window is kept exactly: every slot holds a ring buffer of ``w`` bits, one per row of the window, indexed
      by the row's position mod ``w``; a row rewrites its column for every slot (marked or not). Rows from before a
      token existed do not count (a new slot starts at zero and such rows never attended it), so a young token has
      had fewer chances to be marked. Memory: ``w`` bytes (torch bools) per slot, KV head and layer — 100 bytes
      next to 256 bytes of bf16 K+V for head_dim 64; packing bits would divide it by 8.
    - Ties in the count: the older token is dropped first. Padding queries mark nothing.

    The rule is :class:`~kvsieve.engine.rules.LowMarks` (``marks_rule``), run by its family's torch code
    (:class:`~kvsieve.policies.families.MarksPolicy`) or, on CPU, by the compiled loops, with the same decisions.
    """

    name = "scissorhands"
    paper = "Liu et al., Scissorhands: Persistence of Importance, NeurIPS 2023 (arXiv:2305.17118)"
    Params = ScissorhandsParams

    def setup(self) -> None:
        p = self.params
        if p.window < 1:
            raise ValueError(f"scissorhands: window must be >= 1, got {p.window}")
        drop = max(1, self.budget // 2) if p.drop is None else p.drop
        if not 1 <= drop <= self.budget:
            raise ValueError(f"scissorhands: drop must be in [1, budget={self.budget}], got {drop}")
        recent = min(10, self.budget + 1 - drop) if p.recent is None else p.recent
        if not 0 <= recent <= self.budget + 1 - drop:
            raise ValueError(
                f"scissorhands: recent must be in [0, budget + 1 - drop = {self.budget + 1 - drop}], got {recent}"
            )
        self.drop, self.recent = drop, recent

    def marks_rule(self) -> LowMarks:
        return LowMarks(self.params.window, self.recent, self.drop, by_step=self.params.threshold == "paper")
