"""``expected_attention``: keep the tokens the future queries are expected to attend to, in closed form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvsieve.policies.base import SCORE_STATE, Policy, Slots, protect, register

if TYPE_CHECKING:
    from kvsieve.engine.rope import Rotary


@dataclass(frozen=True)
class ExpectedAttentionParams:
    future: int = 512
    """Future positions the rotation of the queries is averaged over (the paper's and kvpress's 512)."""
    sinks: int = 4
    """The first positions: always kept, and their queries left out of the statistics (outliers)."""
    covariance: bool = True
    """Whether the queries' covariance enters the expectation (else their mean alone)."""
    value_norm: bool = True
    """Whether a token's expected attention is weighted by its value's L2 norm."""
    epsilon: float = 0.0
    """Added to the expected attention before the value norm weighs it."""


@register
class ExpectedAttention(Policy):
    """Keeps the tokens that the next queries, modelled as Gaussian, are expected to attend to most.

    Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
    Distribution", 2025 (arXiv:2510.00636). At each step that may evict, the step's queries (each query head's,
    without RoPE: un-rotated from their positions) give a mean ``μ`` and a covariance ``Σ``, the first ``sinks``
    positions left out. A query ``t`` positions ahead is ``R(t)·q``; averaging the rotation over the next
    ``future`` positions (``R̄``, from the model's RoPE frequencies) gives the expected query's mean ``R̄μ`` and
    covariance ``R̄ΣR̄ᵀ``. A logit ``s·q·k`` (``s``: the model's attention scaling) of a Gaussian query has the expected
    exponential ``exp(s·k·R̄μ + s²/2 · kᵀR̄ΣR̄ᵀk)``; normalised over the held keys it is the expected attention, averaged
    over the query heads of the KV head's group, then (``value_norm``) ``(· + epsilon) · ‖v‖``. The first ``sinks``
    positions are kept; the others compete by that score. No attention weights: the step attends with the fused kernel.

    Choices: the statistics are those of the step's own queries — the prompt's at the prompt (kvpress: the same,
    ``n_sink`` = 4, 512 future positions from the prompt's end), a decode step's one query after it (its mean, no
    covariance): the score of every held token is recomputed at each step; kvsieve does not keep a running window of
    earlier queries. The logits use the model's attention scaling (kvpress: ``1/√d``, the same for most models).
    Needs the model's RoPE as kvsieve states it (``Rotary``): other position encodings, and position rolling, are
    refused.
    """

    name = "expected_attention"
    paper = (
        "Devoto et al., Expected Attention: KV Cache Compression by Estimating Attention from Future Queries "
        "Distribution, 2025 (arXiv:2510.00636)"
    )
    Params = ExpectedAttentionParams
    reads_kv = True

    def setup(self) -> None:
        p = self.params
        if p.future < 1:
            raise ValueError(f"expected_attention: future must be a positive number of positions, got {p.future}")
        if not 0 <= p.sinks < self.budget:
            raise ValueError(f"expected_attention: sinks must be in [0, budget={self.budget}), got {p.sinks}")
        if not 0 <= p.epsilon < float("inf"):
            raise ValueError(f"expected_attention: epsilon must be a finite number >= 0, got {p.epsilon}")

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return SCORE_STATE

    def observe_queries(self, slots: Slots, queries: torch.Tensor, query_pos: torch.Tensor, rope: Rotary) -> None:
        p = self.params
        bsz, heads, group, q, dim = queries.shape
        flat = queries.float().reshape(bsz, heads * group, q, dim)
        plain = rope.rotate(flat, -query_pos.clamp(min=0)[:, None, :])  # (the queries before RoPE)
        weight = (query_pos >= p.sinks)[:, None, :, None].float()  # (padding's position is -1)
        count = weight.sum(dim=2).clamp(min=1)  # [B, 1, 1]
        mean = (plain * weight).sum(dim=2) / count  # [B, Hq, D]
        # R̄: the rotation averaged over the next `future` positions
        ahead = slots.last + 1  # (the first of the `future` positions)
        keys = slots.keys.float()  # [B, H, N, D]: each KV head's keys, for its group's query heads
        expected_query = rope.averaged(mean, ahead, p.future).view(bsz, heads, group, dim)
        logits = torch.einsum("bhnd,bhgd->bhgn", keys, expected_query)  # (k · R̄μ)
        if p.covariance and q > 1:  # (one query has no covariance: the term is 0)
            centered = (plain - mean[:, :, None]) * weight
            cov = torch.einsum("bhnd,bhne->bhde", centered, centered) / count[..., None]
            # R̄ Σ R̄ᵀ: `averaged` turns each row (M ↦ M R̄ᵀ), so twice with a transpose between (Σ is symmetric)
            rotated = rope.averaged(rope.averaged(cov, ahead, p.future).transpose(-1, -2), ahead, p.future)
            spread = keys[:, :, None] @ rotated.view(bsz, heads, group, dim, dim)  # [B, H, G, N, D]
            logits = logits + 0.5 * (spread * keys[:, :, None]).sum(dim=-1)
        logits = logits.masked_fill((slots.pos < 0)[:, :, None], float("-inf"))
        expected = logits.softmax(dim=-1).mean(dim=2)
        if p.value_norm:
            expected = (expected + p.epsilon) * torch.linalg.vector_norm(slots.values.float(), dim=-1)
        slots.state["score"].copy_(expected)

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        score = slots.state["score"]
        sinks = self.params.sinks
        return protect(score, (slots.pos >= 0) & (slots.pos < sinks)) if sinks else score
