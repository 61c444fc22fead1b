"""``strided``: the strided Sparse Transformer pattern (local window + every ``stride``-th token), at a budget."""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.engine.rules import Pattern
from kvsieve.policies.base import PatternPolicy, register


@dataclass(frozen=True)
class StridedParams:
    recent: int | None = None
    """Local window of newest tokens; default ``budget // 2``."""
    stride: int | None = None
    """Period of the kept earlier positions; default the local window (Child et al. use one length ``l`` for both)."""


@register
class Strided(PatternPolicy):
    """Keeps a local window of the newest tokens plus every ``stride``-th earlier position, newest first.

    Child et al., "Generating Long Sequences with Sparse Transformers", 2019 (arXiv:1904.10509), the strided
    pattern, as the H2O paper uses it for a baseline. Its heads attend to the previous ``l`` tokens and to every
    ``l``-th token before them, counted back from the query; a cache that really evicts cannot follow offsets that
    move with every query, so kvsieve anchors the stride at absolute positions. Per (row, KV head):

    - the ``recent`` newest tokens are kept;
    - earlier tokens at positions ``p`` with ``p % stride == 0`` (position 0, the first token, among them) are the
      pattern's candidates; they are kept newest first, as many as the budget leaves;
    - if the candidates do not fill the budget, the other earlier tokens fill it, newest first (so a budget at least
      the length keeps everything, like ``full``).

    Since a token's rank among the tokens outside the window never rises, what the cache holds at any time is
    exactly this rule applied to all tokens seen so far. Needs no attention probabilities.
    """

    name = "strided"
    paper = "Child et al., Generating Long Sequences with Sparse Transformers, 2019 (arXiv:1904.10509)"
    Params = StridedParams

    def setup(self) -> None:
        p = self.params
        self.recent = self.budget // 2 if p.recent is None else p.recent
        if not 0 <= self.recent <= self.budget:
            raise ValueError(f"strided: recent must be in [0, budget={self.budget}], got {self.recent}")
        self.stride = max(1, self.recent) if p.stride is None else p.stride
        if self.stride < 1:
            raise ValueError(f"strided: stride must be >= 1, got {self.stride}")

    def pattern(self) -> Pattern:
        return Pattern(keep=self.budget, recent=self.recent, period=self.stride, span=1)
