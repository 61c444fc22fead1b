"""Budgets: how many KV slots each (batch row, KV head) of a layer may keep.

A budget is either an integer number of tokens or a ratio in (0, 1] of the prompt length. A ratio is resolved
when the cache sees its first forward pass (the prompt; for a left-padded batch, the padded prompt length,
i.e. the longest prompt), or by the caller with :func:`resolve_budget` when the length is known up front.
"""

from __future__ import annotations

import math

Budget = int | float


def parse_budget(text: str | int | float) -> Budget:
    """Parse a budget given on a command line: ``"512"`` → 512 tokens, ``"0.2"`` or ``"20%"`` → ratio 0.2."""
    if isinstance(text, bool):
        raise ValueError(f"budget must be a number of tokens or a ratio, not {text!r}")
    if isinstance(text, int | float):
        return check_budget(text)
    raw = str(text).strip()
    try:
        if raw.endswith("%"):
            return check_budget(float(raw[:-1]) / 100.0)
        if raw.isdigit() or (raw.startswith("-") and raw[1:].isdigit()):
            return check_budget(int(raw))
        return check_budget(float(raw))
    except ValueError as err:
        if "budget" in str(err):
            raise
        raise ValueError(f"budget {text!r} is neither a token count (e.g. 512) nor a ratio (e.g. 0.2 or 20%)") from None


def check_budget(budget: Budget) -> Budget:
    """Validate a budget spec and return it unchanged."""
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise ValueError(f"budget must be an int (tokens) or a float ratio in (0, 1], got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be a positive number of tokens, got {budget}")
        return budget
    if not math.isfinite(budget) or budget <= 0 or budget > 1:
        raise ValueError(f"budget ratio must be in (0, 1], got {budget}; pass an int for a number of tokens (e.g. 512)")
    return budget


def resolve_budget(budget: Budget, length: int) -> int:
    """Tokens allowed for a sequence of ``length`` tokens: an int stays as is, a ratio becomes ``round(r·length)``
    (at least 1)."""
    check_budget(budget)
    if isinstance(budget, int):
        return budget
    if length <= 0:
        raise ValueError(f"cannot resolve budget ratio {budget} against an empty sequence")
    return max(1, round(budget * length))
