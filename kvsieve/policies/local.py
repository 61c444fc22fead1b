"""``local``: a sliding window of the most recent tokens."""

from __future__ import annotations

from kvsieve.policies.base import SinkWindow, register


@register
class Local(SinkWindow):
    """Keeps the ``budget`` most recent tokens of each row; the oldest is evicted first.

    The "local"/window-attention baseline of the H2O and StreamingLLM papers. It is known to collapse once the first
    tokens (the attention sinks) leave the window. Needs no attention probabilities.
    """

    name = "local"
    paper = "Beltagy et al., Longformer, 2020 (window attention baseline in H2O / StreamingLLM)"
