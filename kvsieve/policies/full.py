"""``full``: keep every token (the reference every other policy is compared with)."""

from __future__ import annotations

from kvsieve.policies.base import Policy, register


@register
class Full(Policy):
    """Keeps the whole KV cache: no budget, no eviction. The budget argument is ignored.

    Same logits as transformers' own ``DynamicCache`` (tested), so it is the quality ceiling of every comparison.
    """

    name = "full"
    paper = "no eviction (dense attention)"
    bounded = False
