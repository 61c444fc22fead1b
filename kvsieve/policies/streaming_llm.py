"""``streaming_llm``: attention sinks + a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.policies.base import PROTECTED, Policy, Slots


@dataclass(frozen=True)
class StreamingLLMParams:
    sink: int = 4
    """Number of first tokens always kept (the paper uses 4)."""


class StreamingLLM(Policy):
    """Keeps the first ``sink`` tokens of each row plus the ``budget - sink`` most recent ones.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv:2309.17453).
    "First" means the first real tokens of the row (left padding is not counted). Positions are the original ones
    (no position rolling). Needs no attention probabilities.
    """

    name = "streaming_llm"
    paper = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024 (arXiv:2309.17453)"
    Params = StreamingLLMParams
    stream_closed_form = True
    positional = True

    def setup(self) -> None:
        sink = self.params.sink
        if sink < 0:
            raise ValueError(f"streaming_llm: sink must be >= 0, got {sink}")
        if sink >= self.budget:
            raise ValueError(f"streaming_llm: sink ({sink}) must be smaller than the budget ({self.budget})")
        self.recent = self.budget - sink

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        # padding (position -1) falls under the sinks here, but the engine never keeps it over real tokens
        return slots.pos.masked_fill(slots.pos < self.params.sink, PROTECTED)

    def stream_visible(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """The sinks and ``i - recent .. i``."""
        kp, qp = key_pos[:, :, None, :], query_pos[:, None, :, None]
        return (kp < self.params.sink) | (kp >= qp - self.recent)
