"""A :class:`~kvsieve.engine.layer.SieveLayer`'s held tokens as tensors and counters, and back (saved contexts:
:meth:`SieveCache.export <kvsieve.engine.cache.SieveCache.export>` / ``restore``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvsieve.engine.quant import Residual, past
from kvsieve.engine.storage import SlotStore

if TYPE_CHECKING:
    from kvsieve.engine.layer import SieveLayer


def export_layer(layer: SieveLayer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The layer's held tokens (keys, values, positions, policy state: the slots in use only) and newest positions
    as tensors, and its counters, for :func:`restore_layer`."""
    if layer.store is None:
        raise ValueError(f"layer {layer.layer_idx} holds nothing yet")
    store = layer.store
    store.code_pending()  # (saved codes are complete: a restored layer starts with every token coded)
    if store.stale is not None or store.layout is not None:
        store = store.copy()
        if store.stale is not None:
            store.compact()
        store.unpack()
    n = store.used
    residual = {} if store.residual is None else {"residual": store.residual.kv}
    tensors = {
        **{name: t[:, :, :n] for name, t in store.kv.items()},
        **residual,
        "positions": store.positions[:, :, :n],
        "newest": layer.newest.clone(),  # (layers share it)
        **{f"state.{name}": t[:, :, :n] for name, t in store.state.items()},
        **({} if store.counts is None else {"counts": store.counts}),
    }
    counters = {
        "tokens_seen": layer.tokens_seen,
        "eviction_rounds": layer.eviction_rounds,
        "may_hold_padding": store.may_hold_padding,
        "decoding": layer.decoding,
        "dtype": str(store.dtype).removeprefix("torch."),
        "budget": layer.policy.budget,
    }
    return {name: t.contiguous() for name, t in tensors.items()}, counters


def restore_layer(
    layer: SieveLayer, tensors: dict[str, torch.Tensor], counters: dict[str, Any], prompt_len: int
) -> None:
    """Make ``layer`` hold what :func:`export_layer` gave (the policy resolved against a prompt of ``prompt_len``
    tokens)."""
    layer.reset()
    layer.policy = layer.plan.resolve(prompt_len)[layer.layer_idx]
    if counters.get("budget") not in (None, layer.policy.budget):  # (its share of a budget shared by the layers)
        layer.policy = layer.plan.set_budget(layer.layer_idx, int(counters["budget"]))
    codec = layer.codec
    residual = ("residual",) if codec.residual else ()
    needed = {*codec.names(), *residual, "positions", "newest"} | {f"state.{n}" for n in layer.policy.state_spec()}
    missing = [name for name in sorted(needed) if name not in tensors]
    if missing:
        raise ValueError(
            f"layer {layer.layer_idx} misses {', '.join(missing)} for policy {layer.policy.name} with {codec}"
        )
    positions = tensors["positions"]
    layer.device = positions.device
    layer.dtype = getattr(torch, counters["dtype"]) if "dtype" in counters else tensors["keys"].dtype
    layer.decoding = bool(counters["decoding"])
    layer.store = SlotStore(
        kv={name: tensors[name] for name in codec.names()},
        positions=positions,
        state={name: tensors[f"state.{name}"] for name in layer.policy.state_spec()},
        limit=layer.store_limit(),
        used=positions.shape[2],
        may_hold_padding=bool(counters["may_hold_padding"]),
        codec=codec,
        residual=Residual(tensors["residual"], codec.residual, past(positions)) if residual else None,
        dtype=layer.dtype,
    )
    if "counts" in tensors:  # (heads that keep their own counts: packed again, each with room for what it holds)
        held = positions >= 0
        layer.store.keep_heads(held, tensors["counts"], held.sum(dim=-1))
    layer.newest = tensors["newest"]
    layer.tokens_seen = int(counters["tokens_seen"])
    layer.eviction_rounds = int(counters["eviction_rounds"])
    layer.is_initialized = True
