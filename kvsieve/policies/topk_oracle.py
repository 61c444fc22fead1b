"""``topk_oracle``: each query attends to its top-``budget`` keys of the FULL cache (a reference: saves no memory)."""

from __future__ import annotations

import torch

from kvsieve.policies.base import Policy, register


@register
class TopKOracle(Policy):
    """Reference only, saves NO memory: keeps every token, and each query attends to its ``budget`` best keys.

    An upper bound for eviction at the same budget (the "top-k attention" oracle of sparse-attention studies, e.g.
    Gupta et al., "Memory-efficient Transformers via Top-k Attention", 2021, arXiv:2106.06899): for every query
    head and query, only the ``budget`` allowed keys with the highest logits ``q·k/sqrt(d)`` enter the softmax;
    the others are masked. No eviction policy can choose better per query, since it must decide before the query
    is known. The cache grows like ``full`` (``bounded = False``).

    Choices: the budget is per query head (each query head of a GQA group picks its own keys); ties as
    ``torch.topk`` breaks them. Needs the logits, so it runs the explicit (non-fused) attention. Where the budget is
    over half a row's keys, it finds the others instead (the row's lowest ``keys - budget``, disallowed keys first):
    the same keys, and ``torch.topk`` of a few is faster than of most.
    """

    name = "topk_oracle"
    paper = "top-k attention oracle (Gupta et al., Memory-efficient Transformers via Top-k Attention, arXiv:2106.06899)"
    row_additive = True
    bounded = False

    def narrow(self, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed[:, :, None]
        if logits.shape[-1] <= self.budget:
            return allowed
        logits = logits.masked_fill(~allowed, float("-inf"))
        rest = logits.shape[-1] - self.budget
        if rest < self.budget:
            low = logits.topk(rest, dim=-1, largest=False).indices
            return torch.ones_like(logits, dtype=torch.bool).scatter_(-1, low, False) & allowed
        top = logits.topk(self.budget, dim=-1).indices
        return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True) & allowed
