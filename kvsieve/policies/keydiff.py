"""``keydiff``: keep the keys least like the others (no attention, no queries)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsieve.engine.rules import Pattern
from kvsieve.policies.base import Policy, Slots, protect, register


@dataclass(frozen=True)
class KeyDiffParams:
    recent: int | None = None
    """Newest tokens never evicted; default ``min(32, budget // 2)`` (0: the paper's bare rule, see the class doc)."""


@register
class KeyDiff(Policy):
    """Keeps the tokens whose cached keys are least like the mean key direction, and the ``recent`` newest.

    Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
    Resource-Constrained Environments", 2025 (arXiv:2504.15364): keys that point away from the others draw attention
    that the others do not, so after each step that leaves more than ``budget`` tokens, every held key (per row and
    KV head, the step's new ones included) is scored by its cosine similarity to the *anchor* — the mean of the held
    keys, each normalised to unit length — and the most similar go. The keys are the cached ones (after RoPE), in
    fp32. The anchor is recomputed at every eviction over the tokens held then, so a token's priority changes as the
    others do (no per-slot state). Needs no attention probabilities and no queries: the prompt is attended at the
    fused kernel's speed.

    Choices: the paper evicts block by block while the prompt is fed; kvsieve evicts at the end of each forward pass
    (the whole prompt at once, kvpress's ``KeyDiffPress``; ``make_cache(..., stream=True)`` evicts token by token).
    Decode-time protection is kvsieve's, as for ``knorm``: without it a generated token whose key lies near the
    anchor is evicted before any later query can attend to it; ``recent=0`` is the paper's bare rule. Similarities
    are compared at float16 resolution (about 3 significant digits), equal ones keeping the newer token.
    """

    name = "keydiff"
    paper = (
        "Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in "
        "Resource-Constrained Environments, 2025 (arXiv:2504.15364)"
    )
    Params = KeyDiffParams
    reads_kv = True

    def setup(self) -> None:
        p = self.params
        self.recent = min(32, self.budget // 2) if p.recent is None else p.recent
        if not 0 <= self.recent <= self.budget:
            raise ValueError(f"keydiff: recent must be in [0, budget={self.budget}], got {self.recent}")
        self.newest = Pattern.window(self.recent)

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        real = (slots.pos >= 0)[..., None]
        unit = F.normalize(slots.keys.float(), dim=-1) * real  # [B, H, N, D]
        anchor = F.normalize(unit.sum(dim=2, keepdim=True), dim=-1)  # (the mean's direction: its length cancels)
        similarity = (unit * anchor).sum(dim=-1)
        # Compared at float16 resolution (round-off of the anchor's sum, which a batch adds in another order, cannot
        # decide), the least alike kept first, then the newer.
        score = (-similarity).to(torch.float16).double() * 2**32 + slots.pos.clamp(min=0)
        return protect(score, self.newest.kept(slots.pos, slots.last)) if self.recent else score
