"""``rkv``: keep the tokens that are attended and not repeated, compressing in bulk while generating (R-KV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsieve.engine.rules import drop_in_bulk
from kvsieve.policies.base import Observation, Policy, Slots, protect, register
from kvsieve.policies.families import pooled_in_position_order

ROWS = 1024
"""Rows of the keys' similarity matrix computed at once (its memory: ``ROWS × N`` per head)."""


@dataclass(frozen=True)
class RKVParams:
    window: int | None = None
    """α: the newest tokens, always kept, whose queries score the others; default ``min(8, budget // 2)`` (the
    paper's 8)."""
    buffer: int | None = None
    """Tokens evicted at once when a decode step fills the cache (the paper's B_buffer); default
    ``min(128, budget // 2, budget + 1 - window)``."""
    mix: float = 0.1
    """λ: the weight of importance against redundancy (the paper's 0.1)."""
    kernel: int = 7
    """Max-pooling width of the importance over neighbouring positions."""
    threshold: float = 0.5
    """Cosine similarity above which two keys are near-duplicates."""


@register
class RKV(Policy):
    """Keeps the tokens important to the newest queries and unlike the other keys, in bulk while decoding.

    Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models", 2025 (arXiv:2505.24133), §3. At
    each compression, per row and KV head, over the held tokens:

    - *importance* ``I``: the logits of each of the newest ``window`` (α) queries, the maximum over the KV head's
      query group, softmaxed over the tokens older than the window; the mean over the α queries, max-pooled over
      ``kernel`` neighbouring positions;
    - *redundancy* ``R``: the cosine similarities ``S`` of the held keys (window included; no self-similarity); in
      each row ``i`` the most recent ``j`` with ``S_ij > threshold`` is set to 0 (a token's newest near-duplicate is
      not counted against it); ``R_j`` = the softmax over the held tokens of the column means ``mean_i S_ij``;
    - score ``Z = mix·I − (1 − mix)·R``; the window is kept, and of the others the highest ``Z``.

    Compression runs when a decode step fills the cache: it then drops ``buffer`` tokens at once (the cache refills
    for ``buffer`` steps); a prompt longer than the budget is compressed to the budget.

    Choices: kvsieve's ``budget`` is the most tokens the cache holds (the paper's ``B_budget + B_buffer``, so memory
    is at the budget, not above it). The queries' logits are kept per slot for the α newest queries (a ring of α
    columns, as Scissorhands keeps its marks), so a compression needs no extra pass. Where a row has no
    near-duplicate, nothing is set to 0 (the authors' code then zeroes the similarity to the first token). λ is the
    paper's 0.1 (the authors' code defaults to 0.07). Rows are scored alone (the authors' code scores the first row
    of a batch).
    """

    name = "rkv"
    paper = "Cai et al., R-KV: Redundancy-aware KV Cache Compression for Reasoning Models, 2025 (arXiv:2505.24133)"
    Params = RKVParams
    reads_kv = True

    def setup(self) -> None:
        p = self.params
        self.window = max(1, min(8, self.budget // 2)) if p.window is None else p.window
        if not 1 <= self.window <= self.budget:
            raise ValueError(f"rkv: window must be in [1, budget={self.budget}], got {self.window}")
        most = self.budget + 1 - self.window
        self.buffer = max(1, min(128, self.budget // 2, most)) if p.buffer is None else p.buffer
        if not 1 <= self.buffer <= most:
            raise ValueError(f"rkv: buffer must be in [1, budget + 1 - window = {most}], got {self.buffer}")
        if not 0.0 <= p.mix <= 1.0:
            raise ValueError(f"rkv: mix must be in [0, 1], got {p.mix}")
        if p.kernel < 1 or p.kernel % 2 == 0:
            raise ValueError(f"rkv: kernel must be a positive odd number, got {p.kernel}")
        if not -1.0 <= p.threshold <= 1.0:
            raise ValueError(f"rkv: threshold must be a cosine similarity in [-1, 1], got {p.threshold}")

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"logits": ((self.window,), torch.float32)}

    def initial_state(self, keys: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": keys.new_full((*pos.shape, self.window), float("-inf"), dtype=torch.float32)}

    def observed_rows(self) -> int:
        return self.window

    def observe(self, slots: Slots, obs: Observation) -> None:
        w = self.window
        logits = obs.logits[:, :, :, -w:].amax(dim=2).float()  # [B, H, b, N]: the group's maximum
        ring, query_pos = slots.state["logits"], obs.query_pos[:, -w:]
        for r in range(logits.shape[2]):  # (each row rewrites the column of its position, a padding row nothing)
            column = (query_pos[:, r].clamp(min=0) % w)[:, None, None, None].expand(*ring.shape[:3], 1)
            row = logits[:, :, r, :, None]
            real = (query_pos[:, r] >= 0)[:, None, None, None]
            ring.scatter_(3, column, torch.where(real, row, ring.gather(3, column)))

    def n_keep(self, n: int, limit: int | None = None) -> int:
        return drop_in_bulk(n, self.budget if limit is None else limit, self.buffer)

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        p = self.params
        held = slots.pos >= 0
        older = held & (slots.pos <= slots.last[:, None, None] - self.window)
        logits = slots.state["logits"].masked_fill(~older[..., None], float("-inf"))
        importance = logits.softmax(dim=2).nan_to_num(0.0).mean(dim=-1)  # (a query that saw none gives 0)
        importance = pooled_in_position_order(importance.masked_fill(~older, 0.0), slots.pos, p.kernel)
        unit = F.normalize(slots.keys.float(), dim=-1) * held[..., None]
        total = unit.new_zeros(held.shape)  # [B, H, N]: each column's sum of similarities over the rows
        for start in range(0, unit.shape[2], ROWS):  # (rows in blocks: memory ROWS × N per head, not N × N)
            rows = slice(start, start + ROWS)
            sim = unit[:, :, rows] @ unit.transpose(-1, -2)  # [B, H, r, N]
            own = torch.arange(start, start + sim.shape[2], device=sim.device)
            sim[:, :, torch.arange(sim.shape[2], device=sim.device), own] = 0.0
            similar = sim > p.threshold
            newest = torch.where(similar, slots.pos[:, :, None, :], -1).amax(dim=-1, keepdim=True)  # [B, H, r, 1]
            total += sim.masked_fill(similar & (slots.pos[:, :, None, :] == newest), 0.0).sum(dim=2)
        mean = total / held.sum(dim=-1, keepdim=True).clamp(min=1)  # (empty rows are zero)
        redundancy = mean.masked_fill(~held, float("-inf")).softmax(dim=-1)
        score = p.mix * importance - (1 - p.mix) * redundancy
        score = score.masked_fill(~held, float("-inf"))
        return protect(score, held & ~older)
