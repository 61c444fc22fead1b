"""``streaming_llm``: attention sinks + a recent window."""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.policies.base import SinkWindow, register


@dataclass(frozen=True)
class StreamingLLMParams:
    sink: int = 4
    """Number of first tokens always kept (the paper uses 4)."""


@register
class StreamingLLM(SinkWindow):
    """Keeps the first ``sink`` tokens of each row plus the ``budget - sink`` most recent ones.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv:2309.17453).
    "First" means the first real tokens of the row (left padding is not counted). Positions are the original ones
    (no position rolling). Needs no attention probabilities.
    """

    name = "streaming_llm"
    paper = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024 (arXiv:2309.17453)"
    Params = StreamingLLMParams

    def setup(self) -> None:
        sink = self.params.sink
        if sink < 0:
            raise ValueError(f"streaming_llm: sink must be >= 0, got {sink}")
        if sink >= self.budget:
            raise ValueError(f"streaming_llm: sink ({sink}) must be smaller than the budget ({self.budget})")
        self.sinks = sink
