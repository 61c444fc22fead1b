"""A decode step's products over packed slots (budgets by head: :class:`~kvsieve.engine.storage.HeadLayout`), read
where they lie: each (row, KV head)'s keys and values are one run of the packed buffers, so the step's logits and
output need not gather every head to the width of the largest (what :meth:`~kvsieve.engine.storage.SlotStore.slot_kv`
does, a copy of the layer's keys and values at every step, and attention over the largest head's width for every
head).

:func:`packed_logits` and :func:`packed_output` run as numba loops on the CPU (fp32 and fp64); they compute what
the gathered slots' products compute (``torch.bmm`` over :meth:`~kvsieve.engine.storage.HeadLayout.unpacked`, the
statement they are tested against), the masks, softmax and observation staying torch's
(:func:`~kvsieve.engine.slot_attention.packed_attention`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvsieve.engine.compiled import jit, numba
from kvsieve.engine.storage import HeadLayout, SlotStore

PACKED_DTYPES = (torch.float32, torch.float64)
"""The dtypes the loops read (numba has no bfloat16)."""


def reads_packed(store: SlotStore) -> bool:
    """Whether a decode step can read ``store``'s keys and values where they lie: packed plain slots, with numba, on
    the CPU, in a dtype of :data:`PACKED_DTYPES`."""
    if numba is None or store.layout is None or store.quantized:
        return False
    keys = store.kv["keys"]
    return keys.device.type == "cpu" and keys.dtype in PACKED_DTYPES


@jit(fastmath=True)
def _logits(query: np.ndarray, keys: np.ndarray, offsets: np.ndarray, caps: np.ndarray, out: np.ndarray) -> None:
    """``out[i, g, s]`` = query ``[I, G, D]`` row ``g`` of (row, head) ``i`` · its key in slot ``s`` (packed row
    ``offsets[i] + s``), for its ``caps[i]`` slots; 0 beyond (slots without a token: masked by their position)."""
    n_pairs, group, dim = query.shape
    width = out.shape[2]
    for i in range(n_pairs):
        own = min(caps[i], width)
        for s in range(own):
            row = offsets[i] + s
            for g in range(group):
                acc = 0.0
                for d in range(dim):
                    acc += query[i, g, d] * keys[row, d]
                out[i, g, s] = acc
        out[i, :, own:] = 0.0


@jit(fastmath=True)
def _output(probs: np.ndarray, values: np.ndarray, offsets: np.ndarray, caps: np.ndarray, out: np.ndarray) -> None:
    """``out[i, g]`` = Σ over (row, head) ``i``'s slots ``s`` of ``probs[i, g, s]`` × its value in slot ``s``
    (slots beyond its ``caps[i]`` have probability 0: no token)."""
    n_pairs, group, width = probs.shape
    dim = values.shape[1]
    out[:] = 0.0
    for i in range(n_pairs):
        for s in range(min(caps[i], width)):
            row = offsets[i] + s
            for g in range(group):
                p = probs[i, g, s]
                if p != 0.0:
                    for d in range(dim):
                        out[i, g, d] += p * values[row, d]


def _flat(layout: HeadLayout) -> tuple[np.ndarray, np.ndarray]:
    return layout.offsets.flatten().numpy(), layout.caps.flatten().numpy()


def packed_logits(query: torch.Tensor, keys: torch.Tensor, layout: HeadLayout, width: int) -> torch.Tensor:
    """``query`` ``[B·H, G, D]`` (each KV head's group, scaled) against packed ``keys`` ``[slots, D]``: the logits
    ``[B·H, G, width]`` of each (row, head)'s first ``width`` slots."""
    out = query.new_empty((*query.shape[:2], width))
    _logits(query.contiguous().numpy(), keys.numpy(), *_flat(layout), out.numpy())
    return out


def packed_output(probs: torch.Tensor, values: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    """``probs`` ``[B·H, G, width]`` over packed ``values`` ``[slots, D]``: ``[B·H, G, D]``."""
    out = values.new_empty((*probs.shape[:2], values.shape[1]))
    _output(probs.to(values.dtype).contiguous().numpy(), values.numpy(), *_flat(layout), out.numpy())
    return out
