"""What every analysis shares: each layer's eager attention map reduced on the fly, a progress bar over layers, the
accumulated attention per token, and the results' base class."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

T = TypeVar("T")


class Result:
    """Base of the analyses' dataclasses: fields declared with ``repr=False`` hold arrays only the plots need and
    are left out of :meth:`to_dict`."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON content: plain numbers, strings and lists (nested results as dicts)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.repr}  # type: ignore[arg-type]


def _plain(value: Any) -> Any:
    if isinstance(value, Result):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's self-attention modules (transformers' ``*Attention`` modules with a ``layer_idx``), by layer."""
    modules = [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
    ]
    if not modules:
        raise ValueError(f"{type(model).__name__}: found no attention modules with a layer_idx")
    return sorted(modules, key=lambda m: m.layer_idx)


@contextmanager
def on_attention(model: PreTrainedModel, fn: Callable[[int, Any], None]) -> Iterator[None]:
    """Within the block, ``fn(layer_idx, output)`` runs after each attention module's forward."""

    def hook(module: torch.nn.Module, _args: Any, output: Any) -> None:  # (a value returned would replace the output)
        fn(module.layer_idx, output)

    handles = [m.register_forward_hook(hook) for m in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def layer_progress(model: PreTrainedModel, desc: str, enabled: bool) -> Iterator[None]:
    """A progress bar of the layers a forward pass inside the block has run."""
    with (
        tqdm(total=len(attention_modules(model)), desc=desc, unit="layer", disable=not enabled, leave=False) as bar,
        on_attention(model, lambda _layer, _output: bar.update()),
    ):
        yield


@torch.inference_mode()
def map_layers(
    model: PreTrainedModel, ids: torch.Tensor, reduce: Callable[[int, torch.Tensor], T], progress: bool = False
) -> list[T]:
    """One forward pass over ``ids`` (``[1, n]``) with transformers' eager attention; ``reduce(layer, weights)``
    receives each layer's attention probabilities ``[heads, n, n]`` (fp32, causal: 0 above the diagonal) as the
    layer finishes, so only one layer's map is held at a time. Returns what it returned, in layer order.

    The model runs ``eager`` for the pass and gets its previous implementation back afterwards.
    """
    require_tokens(ids, 1, "an attention map")
    reduced: dict[int, T] = {}

    def take(layer: int, output: Any) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise ValueError(f"{type(model).__name__}: layer {layer}'s eager attention returned no probabilities")
        reduced[layer] = reduce(layer, weights[0].float())

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with layer_progress(model, "attention maps", progress), on_attention(model, take):
            model(ids.to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    return [reduced[layer] for layer in sorted(reduced)]


def accumulated(weights: torch.Tensor) -> torch.Tensor:
    """``[heads, n, n]`` → ``[n]``: the attention each token received, summed over the query rows and averaged over
    heads (H2O's accumulated attention score)."""
    return weights.sum(1).mean(0)


def require_tokens(ids: torch.Tensor, minimum: int, analysis: str) -> int:
    """The length ``n`` of ``ids`` (``[1, n]``); a ``ValueError`` naming ``analysis`` when it is below ``minimum``."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected token ids of shape [1, n], got {tuple(ids.shape)}")
    if ids.shape[1] < minimum:
        raise ValueError(f"{analysis} needs a text of at least {minimum} tokens, got {ids.shape[1]}")
    return ids.shape[1]
