"""The stream protocol's sequential decisions as one compiled loop, for the rules a policy can state
(:meth:`~kvsieve.policies.base.Policy.scan_rule`), on CPU, with numba (the ``fast`` extra; without it, or on
another device, :mod:`kvsieve.engine.scan` steps through the run with torch ops).

In a scanned run every query's logits are known before the first decision (:mod:`kvsieve.engine.scan`); what is
left is, token by token: reveal the token's slot, softmax its query's logits over the slots held, add them to the
scores, evict the lowest-scored slot. With torch each of these is a dispatched op on a few hundred numbers, about
100 µs per token and layer on this CPU; here the whole run is one call. The loop does what the torch scan does, in
the same order: each query head's probabilities ``exp(l - max) / sum`` over the held slots, the group's heads
summed in order, the sum added to the fp32 score; the victim is the first slot of the lowest score among the held
slots outside the recent window (``torch.argmin``'s tie rule). The exponentials are not torch's vectorized ones, so
scores may differ from the torch scan's in the last bits (tested: the same kept tokens and logits).
"""

from __future__ import annotations

import numpy as np
import torch

from kvsieve.policies.base import ScoreRule

try:
    import numba
except ImportError:  # (the `fast` extra is not installed)
    numba = None

ENABLED = numba is not None
"""Whether scans use the compiled loop where they can (tests switch it off to compare with the torch scan)."""


def _score_rule(
    logits: np.ndarray,
    pos: np.ndarray,
    query_pos: np.ndarray,
    score: np.ndarray,
    gone: np.ndarray,
    held: int,
    limit: int,
    accumulate: bool,
    recent: int,
    across_heads: bool,
) -> int:
    """The run's decisions under a :class:`~kvsieve.policies.base.ScoreRule` (``accumulate``, ``recent``,
    ``across_heads``): ``logits`` ``[B, H, G, c, N]``, ``pos`` ``[B, H, N]`` (the run's ``c`` slots last, hidden as
    -1; evicted slots become -1), ``query_pos`` ``[B, c]``, ``score`` ``[B, H, N]`` (updated), ``gone``
    ``[B, H, c, N]`` (filled: the slots each query could not see), ``held`` slots held before the run. Returns the
    slots held after it."""
    bsz, heads, group, c, n = logits.shape
    first = n - c
    probs = np.empty(n, dtype=logits.dtype)
    total = np.zeros((heads, n), dtype=logits.dtype)
    zero = total[0, 0]  # (in the logits' dtype)
    for t in range(c):
        held += 1
        for b in range(bsz):
            last = query_pos[b, t]
            for h in range(heads):
                pos[b, h, first + t] = last
                total[h] = 0
                for j in range(n):
                    gone[b, h, t, j] = pos[b, h, j] < 0
                for g in range(group):
                    high = logits[b, h, g, t, first + t]  # (the query's own token is held)
                    for j in range(n):
                        if pos[b, h, j] >= 0 and logits[b, h, g, t, j] > high:
                            high = logits[b, h, g, t, j]
                    mass = zero
                    for j in range(n):
                        e = np.exp(logits[b, h, g, t, j] - high) if pos[b, h, j] >= 0 else zero
                        probs[j] = e
                        mass += e
                    for j in range(n):
                        total[h, j] += probs[j] / mass
            if across_heads:
                for h in range(1, heads):
                    total[0] += total[h]
                for h in range(1, heads):
                    total[h] = total[0]
            for h in range(heads):
                for j in range(n):
                    score[b, h, j] = score[b, h, j] + total[h, j] if accumulate else total[h, j]
                if held > limit:
                    victim, lowest = 0, np.inf
                    for j in range(n):
                        if pos[b, h, j] >= 0 and pos[b, h, j] <= last - recent and score[b, h, j] < lowest:
                            victim, lowest = j, score[b, h, j]
                    pos[b, h, victim] = -1
        held = min(held, limit)
    return held


if numba is not None:
    _score_rule = numba.njit(cache=True, nogil=True)(_score_rule)


def compiled_decide(
    rule: ScoreRule | None,
    logits: torch.Tensor | None,
    pos: torch.Tensor,
    query_pos: torch.Tensor,
    state: dict[str, torch.Tensor],
    held: int,
    limit: int,
) -> tuple[torch.Tensor, int] | None:
    """A run's decisions by the compiled loop (see the module docstring): what each query could not see
    ``[B, H, c, N]`` and the slots held after the run; ``pos`` and the scores change in place. None when the loop
    does not apply (no rule, no numba, not on CPU, more than one victim per token) and the torch scan decides."""
    if not ENABLED or rule is None or logits is None or logits.device.type != "cpu" or held > limit:
        return None
    bsz, heads, _, c, n = logits.shape
    gone = torch.empty((bsz, heads, c, n), dtype=torch.bool)
    held = _score_rule(
        logits.detach().numpy(),
        pos.numpy(),
        query_pos.numpy(),
        state["score"].numpy(),
        gone.numpy(),
        held,
        limit,
        rule.accumulate,
        rule.recent,
        rule.across_heads,
    )
    return gone, held
