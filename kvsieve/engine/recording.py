"""Speculative decoding (assisted generation, prompt lookup) over a :class:`~kvsieve.engine.layer.SieveLayer`.

``activate_past_recording`` makes the layer feed the tokens after a prompt one at a time, as decode steps, and keep
them with the state before the first of them (:func:`record`), until ``crop`` commits them or rolls the rejected ones
back exactly (:func:`roll_back`: the state restored, the accepted tokens fed again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvsieve.engine.slot_attention import AttentionArgs
from kvsieve.engine.step import Chunk, run_step
from kvsieve.engine.storage import SlotStore

if TYPE_CHECKING:
    from kvsieve.engine.layer import SieveLayer


@dataclass
class Recording:
    """A recording layer's state before its recorded tokens, and those tokens (see :func:`roll_back`)."""

    store: SlotStore
    newest: torch.Tensor
    tokens_seen: int
    tokens: list[tuple[Chunk, AttentionArgs]] = field(default_factory=list)


def record(layer: SieveLayer, chunk: Chunk, args: AttentionArgs, tokens_before: int) -> None:
    """Keep a token fed after the prompt (``tokens_before``: the tokens seen before it), with the layer's state
    before the first one recorded."""
    if layer.recording is None:
        layer.recording = Recording(layer.store.copy(), layer.newest.clone(), tokens_before)
    layer.recording.tokens.append((chunk, args))


def roll_back(layer: SieveLayer, tokens_to_remove: int) -> None:
    """Remove the last ``-tokens_to_remove`` tokens fed since recording began or since the last ``crop``, exactly:
    the layer returns to its state before the recorded tokens and feeds the tokens that stay again, as it fed them
    (what their steps evicted is therefore back). ``0`` commits the recorded tokens."""
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop({tokens_to_remove}): pass minus the number of tokens to remove (transformers' convention)"
        )
    recording, tokens = layer.recording, -tokens_to_remove
    recorded = 0 if recording is None else len(recording.tokens)
    if tokens > recorded:
        raise ValueError(
            f"cannot remove the last {tokens} tokens of layer {layer.layer_idx}: kvsieve rolls back only the "
            f"{recorded} token(s) fed after a prompt since cache.activate_past_recording() (transformers calls it "
            "for assisted generation and prompt lookup) or since the last crop"
        )
    layer.recording = None
    if tokens == 0:
        return
    replay = recording.tokens[: recorded - tokens]
    layer.store, layer.newest = recording.store, recording.newest
    layer.tokens_seen = recording.tokens_seen + len(replay)
    for offset, (chunk, args) in enumerate(replay):
        run_step(layer, chunk, args, offset=offset)
