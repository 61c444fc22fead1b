"""How the tokens of one forward pass are cut into eviction rounds (chunks), each stored, attended, observed and
evicted before the next.

- An ordinary forward pass is one chunk (a prompt, a decode step).
- The **stream protocol** (``make_cache(..., stream=True)`` or ``with cache.streaming():``): one forward over a
  whole sequence gives the logits of feeding it one token at a time, at a fraction of the cost (the per-token work
  runs inside each layer). Where that changes nothing, chunks are longer: the tokens that fit before the first
  eviction are one chunk when the policy's statistics add up row by row (``row_additive``, or no observation); a
  :class:`~kvsieve.policies.base.SinkWindow` policy, whose kept set is known in closed form, attends chunks of
  ``max(budget, 64)`` tokens with each query seeing exactly what it would one at a time, evicting at their end.
- Tokens after a prompt in the same pass (``set_prompt_length``: speculative decoding verifies its first drafts in
  the prompt's pass) and every token of a recorded step: one at a time, exactly as decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.policies.base import Policy, SinkWindow

CLOSED_FORM_CHUNK = 64
"""Fewest tokens per chunk when a closed-form policy streams."""


@dataclass(frozen=True)
class Chunks:
    """The chunk boundaries of a step (``bounds[i]:bounds[i+1]``) and whether they are closed-form."""

    bounds: list[int]
    closed_form: bool = False


def plan_chunks(
    q: int, prompt: int, *, stream: bool, decode: bool, policy: Policy, limit: int | None, held: int, rolling: bool
) -> Chunks:
    """The chunks of a step of ``q`` tokens whose first ``prompt`` tokens are a prompt (0 for a later step).

    ``stream``: the stream protocol; ``decode``: the step's tokens are decode steps (recording); ``limit``: the most
    tokens the layer holds after a step (None: no bound; the closed form holds only at the policy's budget);
    ``held``: slots the layer holds before the step; ``rolling``: position rolling (keys re-rotated by rank depend on
    the step, so no closed form)."""
    if prompt < q and (prompt > 0 or decode):  # one token at a time after the prompt
        return Chunks([0, *range(max(prompt, 1), q + 1)])
    if not stream or q == 1:
        return Chunks([0, q])
    if isinstance(policy, SinkWindow) and not rolling and limit == policy.budget:
        step = max(policy.budget, CLOSED_FORM_CHUNK)
        return Chunks([*range(0, q, step), q], closed_form=True)
    if policy.row_additive or not policy.needs_attention:
        room = q if limit is None else min(limit - held, q)
        if room > 1:  # the tokens that fit before the first eviction: one chunk, the same result
            return Chunks([0, *range(room, q + 1)])
    return Chunks(list(range(q + 1)))


def chunk_positions(
    newest: torch.Tensor, padding: torch.Tensor | None, q: int, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query positions ``[B, q]`` (-1 = padding) of a chunk of ``q`` tokens after each row's ``newest`` position
    ``[B]``, each row's newest position after it ``[B]``, and the positions to store ``[B, heads, q]``."""
    if padding is None:  # (a decode step needs no arange)
        first = newest + 1
        query_pos = first[:, None] if q == 1 else first[:, None] + torch.arange(q, device=newest.device)
        newest = first if q == 1 else newest + q
    else:
        query_pos = (newest[:, None] + padding.cumsum(-1)).masked_fill(~padding, -1)
        newest = newest + padding.sum(-1)
    return query_pos, newest, query_pos[:, None, :].expand(-1, heads, -1)
