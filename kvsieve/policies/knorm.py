"""``knorm``: keep the keys with the lowest L2 norm (no attention needed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.engine.rules import FixedPriority
from kvsieve.policies.base import register
from kvsieve.policies.families import PriorityPolicy


@dataclass(frozen=True)
class KNormParams:
    recent: int | None = None
    """Newest tokens never evicted; default ``min(32, budget // 2)`` (0: the paper's bare rule, see the class doc)."""
    drop: int = 1
    """Tokens evicted at once when a decode step fills the cache (1: one per step). The authors' code compresses
    in bulk: when the cache reaches its limit it keeps a ratio of it, so new tokens live until the next compression.
    """


@register
class KNorm(PriorityPolicy):
    """Keeps the ``budget`` tokens whose cached keys have the lowest L2 norm (plus the ``recent`` newest).

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
    (arXiv:2406.11430): a low key norm goes with high attention, so after each step that leaves more than
    ``budget`` tokens, the highest-norm keys are evicted (as kvpress' ``KnormPress``: score ``-‖k‖``). The norm is
    the fp32 L2 norm of the cached key per KV head; RoPE is a rotation, so it is the pre-RoPE norm too. It is computed
    once, when the token is cached, and kept as a per-slot priority.

    Choices: norms are compared at float16 resolution (about 3 significant digits), so floating-point round-off
    of the key projection or of RoPE cannot decide between equal keys; equal norms (e.g. the same token at two
    positions: RoPE keeps the norm) keep the newer token; every layer gets the same rule (a layer schedule can share
    the budget unevenly). Needs no attention probabilities.

    Decode-time protection (a kvsieve decision, measured). The paper's rule protects nothing: at a decode step a
    just-generated token with a high key norm is evicted at once, before any query could attend to it. The authors'
    code applies the rule after every forward pass too, but compresses by a ratio once the cache passes a limit (so
    new tokens usually live until the next compression: ``drop``); Cold Compress protects a recent window and sink
    tokens for its key-norm strategy. On SmolLM2-135M (2,048 Wikipedia tokens, budget 20 %; full 19.57), stream
    protocol: ``recent=0`` 85.27, 8 → 22.63, 32 → 20.44, 204 (half) → 19.84, ``recent=0, drop=204`` 21.85 (h2o
    19.69); prefill protocol (1,365 tokens compressed once, 682 scored; full 22.29): ``recent=0`` 22.96, 8 → 22.38,
    32 → 22.27, 204 → 22.71. Default ``recent = min(32, budget // 2)``: the best of both protocols together;
    ``recent=0`` is the paper's bare rule (kvpress's ``KnormPress``).

    The rule is :class:`~kvsieve.engine.rules.FixedPriority` (``priority_rule``), run by its family's torch code
    (:class:`~kvsieve.policies.families.PriorityPolicy`) or, on CPU, by the compiled loops, with the same decisions.
    """

    name = "knorm"
    paper = "Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, EMNLP 2024"
    Params = KNormParams

    def setup(self) -> None:
        p = self.params
        self.recent = min(32, self.budget // 2) if p.recent is None else p.recent
        if not 0 <= self.recent <= self.budget:
            raise ValueError(f"knorm: recent must be in [0, budget={self.budget}], got {self.recent}")
        if not 1 <= p.drop <= self.budget + 1 - self.recent:
            raise ValueError(
                f"knorm: drop must be in [1, budget + 1 - recent = {self.budget + 1 - self.recent}], got {p.drop}"
            )

    def priority_rule(self) -> FixedPriority:
        return FixedPriority(self.recent, self.params.drop)

    def initial_priority(self, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(keys.float(), dim=-1).to(torch.float16)
        # The bit patterns of non-negative float16 numbers order like their values (< 2**15): one exact integer
        # key ranks the lowest norm first and, among equal norms, the newest token first.
        return torch.sub(pos, norm.view(torch.int16), alpha=2**32)
