"""``fixed``: the fixed Sparse Transformer pattern (current block + summary tokens of past blocks), at a budget."""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.engine.rules import Pattern
from kvsieve.policies.base import PatternPolicy, register


@dataclass(frozen=True)
class FixedParams:
    block: int | None = None
    """Block length ``l``; default ``budget // 2``."""
    summary: int | None = None
    """Summary tokens ``c`` at the end of each block; default ``max(1, block // 16)`` (the paper: ``c`` = 8 to 16 for
    ``l`` = 128 to 256)."""


@register
class Fixed(PatternPolicy):
    """Keeps the tokens of the current block plus the last ``summary`` tokens of every earlier block, newest first.

    Child et al., "Generating Long Sequences with Sparse Transformers", 2019 (arXiv:1904.10509), the fixed pattern,
    as the H2O paper uses it for a baseline: a query at position ``i`` attends to its own block
    (``p // l == i // l``) and to the "summary" positions of the blocks (``p % l >= l - c``). Per (row, KV head):

    - the tokens of the newest token's block are kept (``block ≤ budget``);
    - summary tokens of earlier blocks are kept newest first, as many as the budget leaves;
    - if they do not fill the budget, the other earlier tokens fill it, newest first (so a budget at least the length
      keeps everything, like ``full``).

    The rule is applied to the tokens the cache still holds at each step: when a new block starts, its old block's
    tokens compete only with the earlier tokens still held. Needs no attention probabilities.
    """

    name = "fixed"
    paper = "Child et al., Generating Long Sequences with Sparse Transformers, 2019 (arXiv:1904.10509)"
    Params = FixedParams

    def setup(self) -> None:
        p = self.params
        self.block = max(1, self.budget // 2) if p.block is None else p.block
        if not 1 <= self.block <= self.budget:
            raise ValueError(f"fixed: block must be in [1, budget={self.budget}], got {self.block}")
        self.summary = max(1, self.block // 16) if p.summary is None else p.summary
        if not 1 <= self.summary <= self.block:
            raise ValueError(f"fixed: summary must be in [1, block={self.block}], got {self.summary}")

    def pattern(self) -> Pattern:
        # (a summary position: p % block >= block - summary, i.e. (p + summary) % block < summary)
        return Pattern(keep=self.budget, block=self.block, period=self.block, offset=self.summary, span=self.summary)
