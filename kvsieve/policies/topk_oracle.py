"""``topk_oracle``: each query attends to its top-``budget`` keys of the FULL cache (a reference: saves no memory)."""

from __future__ import annotations

import torch

from kvsieve.policies.base import Policy, register


@register
class TopKOracle(Policy):
    """Reference only, saves NO memory: keeps every token, and each query attends to its ``budget`` best earlier keys.

    An upper bound for eviction at the same budget (the "top-k attention" oracle of sparse-attention studies, e.g.
    Gupta et al., "Memory-efficient Transformers via Top-k Attention", 2021, arXiv:2106.06899), stated for a cache:
    at a step, an eviction cache of ``budget`` tokens lets each query see at most ``budget`` tokens held before the
    step and the step's own tokens (causally). The oracle lets each query head see the same: its own step's tokens
    and, of every token held before the step, the ``budget`` with the highest logits ``q·k/sqrt(d)`` (the others
    are masked). No eviction policy can choose better per query, since it must decide before the query is known.
    The cache grows like ``full`` (``bounded = False``).

    Choices: the budget counts earlier keys only, as an eviction cache's does, so a prompt fed to an empty cache is
    attended in full (as every policy's prompt step is: a compress-once grid's prompt pass is shared with it) and
    the answer's queries are narrowed; tokens fed together are thus not fed as one step each (not ``row_additive``:
    the stream protocol feeds them one at a time). Top-k attention as Gupta et al. define it narrows every query
    over all its keys, the step's own included: on RULER at 4k that narrows the prompt pass too (a pass of its own
    per setting), measured in ``docs/results/ruler.md``. A decode budget is refused: an eviction cache that grows
    after the prompt holds more than ``budget`` earlier tokens. The budget is per query head (each query head of a
    GQA group picks its own keys); ties as ``torch.topk`` breaks them. Needs the logits, so it runs the explicit
    (non-fused) attention. Where the budget is over half a row's keys, it finds the others instead (the row's lowest
    ``keys - budget``, disallowed keys first): the same keys, and ``torch.topk`` of a few is faster than of most.
    """

    name = "topk_oracle"
    paper = "top-k attention oracle (Gupta et al., Memory-efficient Transformers via Top-k Attention, arXiv:2106.06899)"
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
