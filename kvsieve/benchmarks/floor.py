"""The *floor* of the benchmark: a plain cache that already holds ``budget`` tokens and does no eviction work.

Each layer is a ring buffer of exactly ``budget + 1`` slots allocated on its first update: the ``budget`` tokens held
between steps and the new one, which a cache at that budget attends to together before it evicts (an evicting cache
allocates the same spare slot). The prompt is attended in full (the step returns its own keys, so transformers' sdpa
runs with ``is_causal``) and its newest ``budget + 1`` tokens are copied into the ring; every later token overwrites
the oldest slot and the step attends over all filled slots with transformers' sdpa and no mask. That is the least
work any cache holding ``budget`` tokens can do per step, so its speed and memory are the best an evicting cache can
reach at that budget.

Its *outputs are not meaningful*: the ring is not in position order and no mask hides anything, so only its
speed and memory are measured. It is built through transformers' public ``Cache`` / ``CacheLayerMixin`` API and
runs with the plain ``"sdpa"`` attention implementation.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class FloorLayer(CacheLayerMixin):
    """One layer of a :class:`FloorCache`: a ring of ``budget + 1`` slots (see the module docstring)."""

    is_sliding = False

    def __init__(self, budget: int) -> None:
        super().__init__()
        if budget <= 0:
            raise ValueError(f"the floor cache needs a positive budget, got {budget}")
        self.budget = budget
        self.slots = budget + 1
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, heads = key_states.shape[:2]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((bsz, heads, self.slots, key_states.shape[-1]))
        self.values = value_states.new_zeros((bsz, heads, self.slots, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A single token overwrites the oldest slot; a prompt (the first step only) keeps its newest tokens."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if q == 1:
            slot = self.seen % self.slots
            self.keys[:, :, slot : slot + 1] = key_states
            self.values[:, :, slot : slot + 1] = value_states
            self.seen += 1
            filled = min(self.seen, self.slots)
            return self.keys[:, :, :filled], self.values[:, :, :filled]
        if self.seen:
            raise ValueError("the floor cache takes one multi-token step (the prompt), then single tokens")
        kept = min(q, self.slots)
        shift = (q - kept) % self.slots  # the token at position p lives in slot p % (budget + 1)
        self.keys[:, :, :kept] = key_states[:, :, q - kept :].roll(shift, dims=2)
        self.values[:, :, :kept] = value_states[:, :, q - kept :].roll(shift, dims=2)
        self.seen = q
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length = query_length if self.seen == 0 else min(self.seen + query_length, self.slots)
        return kv_length, self.seen + query_length - kv_length

    def get_seq_length(self) -> int:
        """Tokens seen (RoPE positions stay true), not slots held."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.seen = 0
        self.is_initialized = False


class FloorCache(Cache):
    """A :class:`FloorLayer` per model layer, each holding ``budget`` tokens between steps."""

    layers: list[FloorLayer]

    def __init__(self, budget: int, num_layers: int) -> None:
        super().__init__(layers=[FloorLayer(budget) for _ in range(num_layers)])
        self.budget = budget
