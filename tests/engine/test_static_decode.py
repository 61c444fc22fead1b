"""A decode step at the budget is static: no host synchronisation and no new slot buffers, for every policy.

What a CUDA graph or ``torch.compile`` of the decode step needs, checked on the CPU: once the
cache holds its budget, a step of one token per row neither reads a tensor's value on the host (``.item()``,
``bool(t)``, ``.tolist()``, ``nonzero``: each a device→host sync on a GPU) nor allocates or resizes slot buffers
(their storage stays where it was), with plain or quantized slots. A probe records every such call the step makes.
Along the path a GPU takes (the compiled CPU loops off), two steps at the budget also dispatch the same ops on the same
shapes, and keep every slot buffer (positions and policy state too) where it was: a captured graph replays them.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import kvsieve
from kvsieve.policies import REGISTRY

SYNCS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"})
BOUNDED = sorted(name for name, cls in REGISTRY.items() if cls.bounded and not cls.probed)
"""(``kvzip`` is filled by its probes, not by a forward pass: tested on its own)"""


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
    """Where every layer's slot buffers are stored: keys and values (or codes), positions and policy state."""
    stores = [layer.store for layer in cache.layers]
    return [t.untyped_storage().data_ptr() for s in stores for t in (*s.kv.values(), s.positions, *s.state.values())]


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


HOST_SYNCS = frozenset(
    {
        "aten.item.default",  # .item(), int(t), float(t)
        "aten._local_scalar_dense.default",
        "aten.is_nonzero.default",  # bool(t) of a one-element tensor
        "aten.nonzero.default",  # data-dependent shapes
        "aten.masked_select.default",
        "aten.equal.default",
    }
)
BULK = {"scissorhands": "drop", "rkv": "buffer"}
"""Policies that drop several tokens at once by default, and the parameter that says how many."""
EVERY_STEP = [f"{name}:{BULK[name]}=1" if name in BULK else name for name in BOUNDED]
"""Every bounded policy, evicting one token per decode step."""
BUDGET = 12


class Recorder(TorchDispatchMode):
    """Every op dispatched, with the shapes of its tensor arguments; the host syncs among them (``.tolist()``
    dispatches no op: :class:`SyncProbe` sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[Any, ...]]] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
        self.ops.append((name, shapes))
        if name in HOST_SYNCS:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def _decode_steps(
    model: torch.nn.Module, policy: str, ids: torch.Tensor, steps: int
) -> tuple[list[Recorder], list[int], kvsieve.SieveCache]:
    """``steps`` recorded decode steps of ``policy`` after the prompt ``ids`` and three more steps, the data pointers
    of the slot buffers before them, and the cache; the policies' torch code only (the path of a GPU: the compiled
    loops are CPU-only)."""
    cache = kvsieve.make_cache(model, policy, BUDGET, kernels="torch")
    recorders = []
    with torch.inference_mode():
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        for _ in range(3):  # (past the first decode steps, whose evictions may still change the slots' layout)
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        buffers = _buffers(cache)
        for _ in range(steps):
            recorders.append(Recorder())
            with recorders[-1]:
                token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    return recorders, buffers, cache


@pytest.mark.parametrize("policy", EVERY_STEP)
def test_a_decode_step_at_the_budget_repeats_the_same_ops_with_no_host_sync(
    policy, llama_gqa, make_ids, monkeypatch
) -> None:
    steps, buffers, cache = _decode_steps(llama_gqa, policy, make_ids(2, 30), 2)
    assert steps[0].syncs == [], f"{policy}: host syncs in a decode step: {sorted(set(steps[0].syncs))}"
    assert steps[0].ops == steps[1].ops, f"{policy}: two decode steps at the budget dispatch different ops"
    assert _buffers(cache) == buffers, f"{policy}: the slot buffers moved"
    assert all(layer.store.used == BUDGET + 1 for layer in cache.layers)


def test_scissorhands_bulk_drops_repeat_every_m_steps_with_no_host_sync(llama_gqa, make_ids, monkeypatch) -> None:
    """Its cache goes ``B+1-m, ..., B+1`` slots (``m`` dropped at once): a cycle of ``m`` step shapes, each the same
    ops whenever it comes back, in the same buffers."""
    drop = 3
    steps, buffers, cache = _decode_steps(llama_gqa, f"scissorhands:drop={drop}", make_ids(2, 30), 2 * drop)
    assert [s.syncs for s in steps] == [[]] * len(steps)
    assert [s.ops for s in steps[:drop]] == [s.ops for s in steps[drop:]]
    assert steps[0].ops != steps[1].ops
    assert _buffers(cache) == buffers


def test_the_recorder_sees_a_host_sync_and_a_new_shape(llama_gqa, make_ids) -> None:
    """The check above can fail: a ``bool`` of a tensor is a sync, and a growing cache changes its ops' shapes."""
    cache = kvsieve.make_cache(llama_gqa, "full", None)
    steps = []
    with torch.inference_mode():
        token = llama_gqa(make_ids(2, 10), cache=cache).logits[:, -1:].argmax(-1)
        for _ in range(2):
            recorder = Recorder()
            with recorder:
                token = llama_gqa(token, cache=cache).logits[:, -1:].argmax(-1)
                bool(token.any())
                int(token.max())
            steps.append(recorder)
    assert steps[0].syncs == ["aten.is_nonzero.default", "aten.item.default"]
    assert steps[0].ops != steps[1].ops


ROW_COUNTING = sorted(name for name in BOUNDED if REGISTRY[name].counts_rows)
"""Policies whose target depends on each row's own count of tokens: they read the counts while padding is held."""


@pytest.mark.parametrize("policy", [name for name in BOUNDED if name not in ROW_COUNTING])
def test_held_padding_is_counted_once_when_it_may_be_gone(llama_gqa, make_ids, policy) -> None:
    """A left-padded row keeps padding slots after its prompt; they go one per decode step, and whether any is left
    is read on the host once, when the most any (row, head) held may be gone — not at every layer and step. The
    other reads are the forward pass's two checks of its padding mask."""
    cache = kvsieve.make_cache(llama_gqa, policy, BUDGET)
    ids = make_ids(2, 30)
    mask = torch.ones_like(ids)
    mask[1, :26] = 0  # (row 1: 4 real tokens, so 8 of its 12 slots hold padding after the prompt)
    reads = []
    with torch.no_grad():
        token = llama_gqa(ids, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
        for _ in range(12):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            probe = SyncProbe()
            with probe:
                token = llama_gqa(token, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
            reads.append(sum(probe.calls.values()))
    layers = len(cache.layers)
    assert sorted(set(reads)) == [2, 2 + layers], reads
    assert reads.count(2 + layers) == 1, reads
    assert not any(layer.store.may_hold_padding for layer in cache.layers)
    assert all(bool((layer.held_positions() >= 0).all()) for layer in cache.layers)
