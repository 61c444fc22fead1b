"""``random``: evict uniformly at random (a seeded baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.engine.rules import Pattern
from kvsieve.policies.base import PositionalPolicy, protect, register

_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class RandomParams:
    seed: int = 0
    """Seed of the draws."""
    recent: int = 1
    """Newest tokens never evicted (1: the token just written, which the next query attends to; 0: none)."""


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2³²`` for 32-bit values in int64 tensors, without int64 overflow."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 0x10000) & _U32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the ``lowbias32`` mixer) of 32-bit values held in int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def head_hashes(seed: int, heads: int, device: torch.device) -> torch.Tensor:
    """``[1, heads, 1]`` the hash of (seed, KV head): the part of :func:`uniform_draws` that no step changes."""
    head = torch.arange(heads, device=device)[None, :, None]
    return _mix(_mix(torch.full_like(head, seed & _U32)) ^ head)


def uniform_draws(base: torch.Tensor, step: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[B, H, N]`` float64 draws in [0, 1), a hash of (seed, KV head) — ``base``, from :func:`head_hashes` —,
    ``step`` ``[B]`` and ``pos`` ``[B, H, N]``."""
    x = _mix(base ^ (step[:, None, None] & _U32))
    x = _mix(x ^ (pos & _U32))
    return x.to(torch.float64) / 2.0**32


@register
class Random(PositionalPolicy):
    """Evicts uniformly at random among the tokens outside the ``recent`` newest.

    A sanity baseline (the "random" eviction of the H2O and Scissorhands ablations). At every step with eviction,
    each (row, KV head) draws a fresh uniform priority for each of its tokens and keeps the ``budget`` highest, so
    the victims are a uniform sample of the unprotected tokens.

    Choices: the newest ``recent`` tokens (default 1) are protected. The draws are not taken from a stateful
    generator but are a hash of (``seed``, KV head, the row's newest position, the token's position): identical
    runs evict identically, a cache reused after ``reset()`` repeats itself, and a row evicts the same tokens
    alone or in any (left-padded) batch. Needs no attention probabilities.
    """

    name = "random"
    paper = "uniform random eviction (baseline in H2O, Zhang et al. 2023, arXiv:2306.14048)"
    Params = RandomParams

    def setup(self) -> None:
        self.base: torch.Tensor | None = None
        if not 0 <= self.params.recent <= self.budget:
            raise ValueError(f"random: recent must be in [0, budget={self.budget}], got {self.params.recent}")
        self.newest = Pattern.window(self.params.recent)

    def priority(self, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        heads, device = pos.shape[1], pos.device
        if self.base is None or self.base.shape[1] != heads or self.base.device != device:
            self.base = head_hashes(self.params.seed, heads, device)  # computed once per layer layout
        return protect(uniform_draws(self.base, last, pos), self.newest.kept(pos, last))
