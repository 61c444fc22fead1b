"""Budgets: how many KV slots each (batch row, KV head) of a layer may keep.

A budget is either an integer number of tokens or a ratio in (0, 1] of the prompt length. A ratio is resolved
when the cache sees its first forward pass (the prompt; for a left-padded batch, the padded prompt length,
i.e. the longest prompt), or by the caller with :func:`resolve_budget` when the length is known up front.
"""

from __future__ import annotations

import math

import torch

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


def shared_budgets(priorities: list[torch.Tensor], total: int) -> list[int]:
    """Each layer's share of ``total`` tokens per (row, KV head), by one selection over all layers: ``priorities``
    ``[B, H, N_l]`` per layer (comparable across layers; -inf: a slot that holds no token). The ``total · B · H``
    highest are taken; a layer's budget is its count among them over ``B · H`` (each of its heads keeps that many:
    heads hold the same count), at least 1, the remainders going to the largest fractions, so that the budgets sum
    to ``total``; where every held token is taken, what is left is shared evenly (room to grow, as under a uniform
    budget larger than the prompt)."""
    rows_heads = priorities[0].shape[0] * priorities[0].shape[1]
    sizes = torch.tensor([p.shape[-1] for p in priorities])
    flat = torch.cat([p.float().flatten(0, 1).T.flatten() for p in priorities])  # (layer by layer)
    owner = torch.repeat_interleave(torch.arange(len(sizes)), sizes * rows_heads)
    chosen = owner[flat.topk(min(total * rows_heads, flat.numel())).indices.cpu()]
    share = torch.bincount(chosen, minlength=len(sizes)).double() / rows_heads
    budgets = share.floor().long().clamp(min=1)
    while int(budgets.sum()) > total:  # (the floor of 1 took more: the largest give it back)
        budgets[int(budgets.argmax())] -= 1
    fraction = (share - share.floor()).tolist()
    for i in sorted(range(len(sizes)), key=lambda i: -fraction[i]):  # (the largest remainders first, with room)
        if int(budgets.sum()) < total and budgets[i] < sizes[i]:
            budgets[i] += 1
    left = total - int(budgets.sum())
    budgets += left // len(sizes) + (torch.arange(len(sizes)) < left % len(sizes)).long()
    return budgets.tolist()
