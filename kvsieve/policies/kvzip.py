"""``kvzip``: keep what the model needs to reconstruct the context (query-agnostic, scored by probes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvsieve.policies.base import SCORE_STATE, Asking, Observation, Policy, Slots, register

REQUEST = "Repeat the previous context exactly."
"""The first probe's request (the authors' words)."""
REQUEST_PART = "Repeat the part of the previous context exactly, starting with"
"""The later probes' request, followed by the last ``overlap`` tokens of the chunk before."""


@dataclass(frozen=True)
class KVzipParams:
    chunk: int = 2000
    """Context tokens reconstructed per probe (the authors' 2,000): each probe attends the whole held context and its
    own tokens, so a probe's work grows with ``chunk`` × the context, never with the context squared."""
    overlap: int = 8
    """Tokens of the previous chunk quoted in a later probe's request, where its reconstruction starts (the
    authors' 8)."""
    layers: Literal["shared", "each"] = "shared"
    """``shared``: one selection over all layers shares the model's budget among them (the paper's selection is over
    all layers and heads); ``each``: every layer keeps the budget."""


@register
class KVzip(Policy):
    """Keeps the tokens the model attends to most while it reconstructs the context, before any question.

    Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", NeurIPS 2025
    (arXiv:2505.23416). The context is held whole (:meth:`~kvsieve.engine.cache.SieveCache.hold`), then fed to the
    model again after a request to repeat it, teacher-forced, in chunks of ``chunk`` tokens: a probe is the request
    (``"Repeat the previous context exactly."``; for later chunks ``"Repeat the part of the previous context exactly,
    starting with"`` and the last ``overlap`` tokens of the chunk before), the end of the user's turn and the
    assistant's header, then the chunk. Each probe attends the held context and its own tokens and is removed after
    (:meth:`~kvsieve.engine.cache.SieveCache.probing`). A held token's score is the largest attention probability any
    probe query gives it, over the query heads of its KV head's group and over the probes' queries (the request's
    too, as the authors' code counts them); then each (row, KV head) keeps its highest scores, as many as its layer's
    share of the budget (below).

    Choices, each where the paper or the authors' code leave kvsieve a decision:

    - **One selection over all layers, the same count for every head of a layer** (``layers="shared"``): the
      ``L · budget`` highest scores of the model (per row and KV head) are taken, and each layer keeps its share of
      them, the average over its heads, each head its own top that many — the budget moves between layers in real
      memory. The paper's default selects over heads too (a global threshold: heads of one layer keep different
      counts): that is ``kvzip:heads=adakv,safeguard=0`` (each layer's share then shared among its heads with no
      floor, each head its own count in real memory; :mod:`kvsieve.policies.adakv`), which on RULER samples kept
      more answers than one count per head and answered as kvpress's ``KVzipPress`` (``docs/results/ruler.md``). In
      a batch the shares are chosen over all its rows together (its rows then keep what they would not alone).
      ``layers="each"``: every layer keeps the budget (the authors' "uniform" head budgets). Measured on
      Qwen2.5-Coder-0.5B, RULER at 4,096 tokens, a quarter kept, question-agnostic: on ``niah_multikey_2`` #0–1 and
      ``niah_single_3`` #0, ``each`` answered none, ``shared`` all three (as kvpress's ``KVzipPress``); the shares
      are far from even (one sample: from 15 tokens in a layer to 3,924 of 4,063).
    - **The probabilities are the model's own**: a softmax over every held token and the probe's own, as the layer's
      forward pass attends. The authors' code normalises the scores of a chunk over the sink tokens, that chunk and
      the probe only (each chunk then scores against itself).
    - **What is reconstructed is all of the compressed part** (a chat template's header included), and every token
      competes for the budget; the authors' code keeps its system prompt outside the compression.
    - **Requests follow the caller's layout** (:class:`~kvsieve.policies.base.Asking`): in kvsieve's prompt split the
      context part ends with a blank line, where the authors prefix the request with one; ``"starting with"`` is
      followed by the quoted tokens without the authors' trailing space (which tokenizes as a token of its own).
    - **While decoding under a bounded budget** (the paper compresses the context only): the scores of held tokens
      and of new ones are updated by each decode query with the same rule (the largest probability it gives), and the
      lowest goes. Under kvsieve's question-agnostic protocol the answer grows without bound and nothing is scored.

    Its cost: the probes are one more pass over the context, each of its queries attending the whole context (about
    the prompt's forward pass again, and the explicit probabilities of every probe query).
    """

    name = "kvzip"
    paper = "Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, NeurIPS 2025"
    Params = KVzipParams

    def setup(self) -> None:
        p = self.params
        if p.chunk < 1:
            raise ValueError(f"kvzip: chunk must be a positive number of tokens, got {p.chunk}")
        if not 0 <= p.overlap <= p.chunk:
            raise ValueError(f"kvzip: overlap must be in [0, chunk={p.chunk}], got {p.overlap}")

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return SCORE_STATE

    def observe(self, slots: Slots, obs: Observation) -> None:
        probs = obs.logits.softmax(dim=-1)  # [B, H, G, b, N]: each query head's own probabilities
        real = (obs.query_pos >= 0)[:, None, None, :, None]  # (a padding query gives nothing)
        score = slots.state["score"]
        torch.maximum(score, (probs * real).amax(dim=(2, 3)), out=score)

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        return slots.state["score"]

    def observes_as(self) -> tuple[str, int, int] | None:
        """The same probes observed by the same rule leave the same scores, whatever the selection that follows
        (``kvzip`` and ``kvzip:heads=adakv`` of one ``chunk`` and ``overlap``): one probing serves them all."""
        own = type(self).observe is KVzip.observe and type(self).probes is KVzip.probes
        return ("kvzip", self.params.chunk, self.params.overlap) if own else None

    def shares_budget(self) -> bool:
        return self.params.layers == "shared"

    def probes(self, context: Sequence[int], asking: Asking) -> list[list[int]]:
        n, overlap = self.params.chunk, self.params.overlap
        chunks = [list(context[i : i + n]) for i in range(0, len(context), n)]
        probes = []
        for i, chunk in enumerate(chunks):
            quoted = chunks[i - 1][len(chunks[i - 1]) - overlap :] if i else []
            request = asking.encode(REQUEST_PART if i else REQUEST) + quoted
            probes.append([*request, *asking.turn_end, *chunk])
        return probes
