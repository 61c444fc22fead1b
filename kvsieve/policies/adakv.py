"""``heads=adakv``: AdaKV's budgets by head, over any score policy (``"snapkv:heads=adakv"``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from kvsieve.policies.base import Policy, best_of, demote, protect

HEAD_RULES = ("uniform", "adakv")
"""The values of a policy spec's ``heads`` key: every KV head keeps the layer's budget (``uniform``, the default),
or AdaKV's shares (``adakv``, :func:`adaptive`)."""
PAPER = "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation (arXiv:2407.11550)"
SAFEGUARD = 0.2
"""AdaKV's safeguard α: each head keeps at least ``α`` of the layer's budget per head (the authors' code and
kvpress's ``AdaKVPress`` default to 0.2)."""


def adakv_kept(scores: torch.Tensor, real: torch.Tensor, keep: torch.Tensor, safeguard: float) -> torch.Tensor:
    """AdaKV's selection (Algorithm 1, with the safeguard): ``[B, H, N]``, the slots kept when row ``b``'s heads
    share ``H · keep[b]`` tokens. Each head first keeps its ``max(1, ⌊α · keep[b]⌋)`` best slots (none with α = 0);
    the rest of the row's tokens are the best ``scores`` ``[B, H, N]`` over all its heads at once, so that a head
    whose attention is concentrated gives its budget to the heads whose attention is spread. Only ``real`` slots are
    kept."""
    score = demote(scores, ~real)  # (in the policy's own dtype: an integer priority's ties stay broken)
    safe = (keep.double() * safeguard).floor().long().clamp(min=1 if safeguard > 0 else 0).minimum(keep)
    score = protect(score, best_of(score, safe[:, None]) & real)
    total = scores.shape[1] * keep
    best = score.flatten(1).topk(int(total.max()), dim=-1).indices
    chosen = torch.arange(best.shape[1], device=best.device) < total[:, None]
    kept = torch.zeros_like(real).flatten(1).scatter_(1, best, chosen)
    return kept.view_as(real) & real


@functools.cache
def adaptive(inner: type[Policy]) -> type[Policy]:
    """``inner`` with AdaKV's budgets by head (Feng et al., 2024): at a layer's first eviction its budget, the
    same total as ``inner``'s, is shared among its KV heads by :func:`adakv_kept` on ``inner``'s priorities
    (per batch row); then each (row, head) keeps its count while decoding, evicting by ``inner``'s priorities, and
    holds its own bytes (:meth:`~kvsieve.engine.storage.SlotStore.keep_heads`). Parameter ``safeguard``: α (default
    :data:`SAFEGUARD`).

    Choices: AdaKV compresses the prompt once; kvsieve keeps each head's count while decoding (a kvsieve choice).
    The paper shares the budget of tokens chosen by score; a policy's protected tokens (SnapKV's window) count in
    each head's share, as in kvpress's ``AdaKVPress``. The ``inner`` policies are those that score each slot and
    keep ``min(n, budget)`` (not a positional policy, nor one that drops in bulk or narrows attention)."""
    if not inner.bounded or inner.positional or inner.narrows or inner.counts_rows or inner.allocates_heads:
        raise ValueError(
            f"heads=adakv shares a layer's budget among its heads by a policy's scores: {inner.name} "
            + ("keeps everything" if not inner.bounded else "is not a policy of per-slot scores and min(n, budget)")
        )
    fields = {f.name for f in dataclasses.fields(inner.Params)}
    if "safeguard" in fields:
        raise ValueError(f"{inner.name} has its own parameter named safeguard")
    params = dataclasses.make_dataclass(
        f"AdaKV{inner.Params.__name__}",
        [("safeguard", float, dataclasses.field(default=SAFEGUARD))],
        bases=(inner.Params,),
        frozen=True,
    )

    def setup(self: Policy) -> None:
        if not 0 <= self.params.safeguard <= 1:
            raise ValueError(f"safeguard must be in [0, 1], got {self.params.safeguard}")
        inner.setup(self)

    def share_heads(self: Policy, scores: torch.Tensor, real: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return adakv_kept(scores, real, keep, self.params.safeguard)

    namespace: dict[str, Any] = {
        "name": f"{inner.name}:heads=adakv",
        "paper": f"{inner.paper}; budgets by head: {PAPER}",
        "Params": params,
        "setup": setup,
        "share_heads": share_heads,
        "__doc__": f"{(inner.__doc__ or '').strip().splitlines()[0]} Budgets by head: AdaKV's.",
        "__module__": __name__,
    }
    return type(f"AdaKV{inner.__name__}", (inner,), namespace)
