"""A decode step at the budget is static: no host synchronisation and no new slot buffers, for every policy.

What a CUDA graph or ``torch.compile`` of the decode step needs (issue 20, target 6), checked on the CPU: once the
cache holds its budget, a step of one token per row neither reads a tensor's value on the host (``.item()``,
``bool(t)``, ``.tolist()``, ``nonzero``: each a device→host sync on a GPU) nor allocates or resizes slot buffers
(their storage stays where it was), with plain or quantized slots. A probe records every such call the step makes.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import kvsieve
from kvsieve.policies import REGISTRY

SYNCS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"})
BOUNDED = sorted(name for name, cls in REGISTRY.items() if cls.bounded)


class SyncProbe(TorchFunctionMode):
    """Counts the tensor calls that read a value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _buffers(cache: kvsieve.SieveCache) -> list[int]:
    return [t.untyped_storage().data_ptr() for layer in cache.layers for t in layer.store.kv.values()]


def test_probe_sees_host_reads():
    probe = SyncProbe()
    with probe:
        x = torch.ones(3)
        x.sum().item()
        bool(x.all())
        x.nonzero()
    assert probe.calls == {"item": 1, "__bool__": 1, "nonzero": 1}


QUANTIZED = {"kv_bits": 4, "group_size": 16, "residual": 4}
"""Quantized slots whose residual's tokens are coded during the probed steps (the 5th decode step codes them)."""


@pytest.mark.parametrize("quant", [{}, QUANTIZED], ids=["plain", "4bit"])
@pytest.mark.parametrize("model_name", ["llama_gqa", "gemma3"])
@pytest.mark.parametrize("policy", BOUNDED)
def test_decode_step_is_static(tiny_models, model_name: str, policy: str, quant: dict[str, int]):
    model = tiny_models(model_name, torch.float32)
    cache = kvsieve.make_cache(model, policy, 16, **quant)
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        token = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(2):  # (the first decode steps leave the prompt's buffers for the budget's)
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        buffers = _buffers(cache)
        probe = SyncProbe()
        with probe:
            for _ in range(3):
                token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert probe.calls == {}, f"{policy}: host reads in a decode step: {dict(probe.calls)}"
    assert _buffers(cache) == buffers
