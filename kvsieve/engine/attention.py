"""The ``kvsieve`` attention implementation, plugged in through transformers' public interfaces.

- ``AttentionMaskInterface``: :func:`sieve_mask`. A kvsieve cache layer *claims* the mask that transformers
  builds right after asking it for the mask sizes (:func:`claim_mask`); a claimed mask is a :class:`SieveMask`
  (the 2-D padding mask and the layer's sliding window) instead of a dense ``[q, kv]`` mask. Any other cache gets
  exactly the mask of the model's own implementation.
- ``AttentionInterface``: :func:`sieve_attention`. Transformers calls ``cache.update(k, v, layer_idx)`` right
  before the attention of that layer but does not pass the cache to the attention function, so an evicting cache
  layer *hands over* itself and the key tensor it returned (:func:`hand_over`). The attention function takes the
  hand-over only if it receives that very key tensor, checks that it implements every argument the model passes
  (:func:`attention_args`: it fails closed), and then lets the layer run the step
  (:meth:`kvsieve.engine.layer.SieveLayer.attend`): masked attention over the kept slots, the policy's view of
  the probabilities, and eviction. Without a hand-over (any other cache) it is the model's own implementation.

Each model gets the name of its own implementation's twin (:func:`implementation_name`): ``"kvsieve"`` for a model
that ran sdpa, ``"kvsieve_eager"`` for one that ran eager attention (Gemma 2, GPT-OSS: softcapping and attention
sinks are not sdpa features), ``"kvsieve_<name>"`` for any other registered implementation.

The attention over slots itself is :mod:`kvsieve.engine.slot_attention`; it implements logit soft-capping (Gemma 2)
and attention sinks (GPT-OSS: a learned logit per query head in the softmax denominator, whose probability belongs to
no token) exactly as the models' eager attention does.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvsieve.engine.slot_attention import AttentionArgs

ATTN_IMPLEMENTATION = "kvsieve"
"""The name of kvsieve's attention implementation for models whose own implementation is sdpa (the default)."""


class UnsupportedModelError(RuntimeError):
    """The model uses a feature kvsieve does not implement; raised before anything is computed with it."""


# -- names: one kvsieve implementation per fallback -------------------------------------------------------------


def implementation_name(fallback: str) -> str:
    """The name of kvsieve's implementation whose *fallback* — what runs over caches that are not kvsieve's — is
    ``fallback`` (``"sdpa"``, ``"eager"`` or any name registered in transformers' ``AttentionInterface``)."""
    return ATTN_IMPLEMENTATION if fallback == "sdpa" else f"{ATTN_IMPLEMENTATION}_{fallback}"


def fallback_of(name: str | None) -> str | None:
    """The fallback of kvsieve implementation ``name``; None when ``name`` is not one of kvsieve's."""
    if name == ATTN_IMPLEMENTATION:
        return "sdpa"
    prefix = ATTN_IMPLEMENTATION + "_"
    return name[len(prefix) :] if name is not None and name.startswith(prefix) else None


def register(fallback: str = "sdpa") -> str:
    """Register kvsieve's attention and mask functions whose fallback is ``fallback`` (idempotent); return the
    implementation's name."""
    if fallback != "eager" and (fallback not in ALL_ATTENTION_FUNCTIONS or fallback_of(fallback) is not None):
        raise ValueError(f"cannot fall back to attention implementation {fallback!r}: it is not registered")
    name = implementation_name(fallback)
    AttentionInterface.register(name, partial(sieve_attention, fallback=fallback))
    AttentionMaskInterface.register(name, partial(sieve_mask, fallback=fallback))
    return name


def use_kvsieve_attention(model: PreTrainedModel) -> str:
    """Switch ``model`` to kvsieve's attention implementation and return its name.

    Over a kvsieve cache it attends over the kept slots; over any other cache it runs the model's own implementation
    (the one it had: ``sdpa``, ``eager``, ...; for a model built with ``"kvsieve"`` directly, transformers' default
    for it), so the model behaves with a ``DynamicCache``, ``StaticCache``, ... exactly as before.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    current = model.config._attn_implementation
    fallback = fallback_of(current)
    if fallback is None:
        fallback = current or model.get_correct_attn_implementation(None)
    elif fallback == "sdpa" and model.get_correct_attn_implementation(None) != "sdpa":
        fallback = "eager"  # built with "kvsieve" directly, but the model cannot run sdpa (softcapping, sinks)
    name = register(fallback)
    if current != name:
        model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot switch to a custom attention implementation (it does not use "
            "transformers' AttentionInterface), so kvsieve cannot see its attention"
        )
    return name


def _model_name(module: torch.nn.Module) -> str:
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    return f"{model_type} ({type(module).__name__})" if model_type else type(module).__name__


def _fallback_attention(fallback: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The model's own attention function: a registered one, or the eager attention of the module's model file."""
    if fallback != "eager":
        return ALL_ATTENTION_FUNCTIONS[fallback]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(f"{_model_name(module)}: its model file has no eager_attention_forward")
    return eager


# -- masks ------------------------------------------------------------------------------------------------------


class _Pending(threading.local):
    """What a kvsieve cache layer hands to the next mask or attention call of its thread. Every field is set on the
    instance from the start, so that writing one never adds a key to the instance's dict: a compiled frame guards
    on that dict, and a frame that changed it would fail its own guards."""

    def __init__(self) -> None:
        self.mask_kv_length: int | None = None  # a claimed mask: its number of keys
        self.layer: Any = None  # a handed-over layer, and the key tensor whose attention call belongs to it
        self.keys: torch.Tensor | None = None


_PENDING = _Pending()


def claim_mask(kv_length: int) -> None:
    """Called by a kvsieve cache layer's ``get_mask_sizes``: the mask transformers builds next (of ``kv_length``
    keys) is for a kvsieve cache, so :func:`sieve_mask` returns a :class:`SieveMask`."""
    _PENDING.mask_kv_length = kv_length


@dataclass(eq=False)
class SieveMask:
    """What :func:`sieve_mask` returns for a kvsieve cache."""

    padding: torch.Tensor | None
    """``[B, seen + q]`` bool (True = real token), or None when every token is real."""
    window: int | None = None
    """The sliding window of the layers this mask is for (the model's mask rule ``kv > q - window``)."""
    unsupported: str | None = None
    """What the model asked of this mask that kvsieve does not implement (raised when a layer uses it)."""
    new: tuple[int, torch.Tensor | None] | None = field(default=None, repr=False)
    """:meth:`new_tokens` of the last step length asked."""

    def new_tokens(self, q: int) -> torch.Tensor | None:
        """``[B, q]`` validity of the step's ``q`` new tokens (None = all real: a batch's decode steps after left
        padding take the paths of real tokens). Checked once per mask, which the layers of a forward pass share."""
        if self.padding is None:
            return None
        if self.new is None or self.new[0] != q:
            new = self.padding[:, -q:]
            self.new = (q, None if bool(new.all()) else new)
        return self.new[1]


def _unsupported_mask(
    mask_function: Callable[..., Any] | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    use_vmap: bool = False,
    config: Any = None,
    **kwargs: Any,
) -> str | None:
    """Why a mask built with these arguments is not the causal (or sliding-window causal) mask of a decoder that
    kvsieve implements; None when it is."""
    if "allow_is_bidirectional_skip" in kwargs or mask_function is bidirectional_mask_function:
        return "bidirectional attention"
    if use_vmap:
        return "an extra mask function (e.g. bidirectional attention over image tokens)"
    if not allow_is_causal_skip:
        return "a mask it materialises on purpose (its own mask rule, packed sequences or block overlays)"
    if local_size is None:
        return None if mask_function is causal_mask_function else "a mask function other than causal"
    if local_size != getattr(config, "sliding_window", None):
        return f"chunked attention (chunks of {local_size} tokens)"
    return None


def sieve_mask(*, fallback: str, **kwargs: Any) -> Any:
    """Mask function registered with each kvsieve implementation (transformers' mask-function signature).

    A :class:`SieveMask` when a kvsieve cache layer claimed the mask (:func:`claim_mask`), else the mask of the
    fallback implementation."""
    claimed, _PENDING.mask_kv_length = _PENDING.mask_kv_length, None
    if claimed is None or claimed != kwargs.get("kv_length"):
        dense = ALL_MASK_ATTENTION_FUNCTIONS.get(fallback)
        return None if dense is None else dense(**kwargs)  # (transformers passes no mask to unlisted kernels)
    padding = kwargs.get("attention_mask")
    if padding is not None and torch.compiler.is_compiling():
        raise ValueError(
            "a compiled step over a kvsieve cache takes no attention_mask (whether a row holds padding is read on "
            "the host); run steps with a mask eagerly"
        )
    if padding is not None:
        padding = padding.to(torch.bool)
        if bool(padding.all()):
            padding = None
    unsupported = _unsupported_mask(**kwargs)
    window = kwargs.get("local_size") if unsupported is None else None
    return SieveMask(padding=padding, window=window, unsupported=unsupported)


# -- attention --------------------------------------------------------------------------------------------------


def _always(value: Any) -> bool:
    return True


NEUTRAL_ARGUMENTS: dict[str, Callable[[Any], bool]] = {
    "position_ids": _always,  # positions come from the padding mask; they are the same for left-padded rows
    "sliding_window": _always,  # the window comes from the layer's mask, as sdpa and eager attention apply it
    "use_cache": _always,
    "output_hidden_states": _always,
    "output_router_logits": _always,
    "return_dict": _always,
    "num_items_in_batch": _always,
    "tokenizer": _always,  # generate() hands its tokenizers on to the forward pass (stop strings, assistants)
    "assistant_tokenizer": _always,
    "dropout": lambda p: not p,  # 0.0 in eval mode
    "is_causal": lambda causal: causal is None or bool(causal),
}
"""Attention keywords that leave the attention over the slots unchanged, when their value passes the test."""
IMPLEMENTED_ARGUMENTS = frozenset({"scaling", "softcap", "s_aux", "output_attentions"})
"""Attention keywords :func:`slot_attention` implements."""


def attention_args(module: torch.nn.Module, query: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> AttentionArgs:
    """The :class:`AttentionArgs` of one attention call over a kvsieve cache layer; fails closed.

    Raises :class:`UnsupportedModelError` for any keyword argument that is neither implemented nor neutral (see
    :data:`NEUTRAL_ARGUMENTS`; an unknown keyword is neutral only when None) and for a mask kvsieve cannot apply,
    so that no feature of a model (or of a future transformers) is silently ignored."""
    if isinstance(mask, torch.Tensor):
        raise ValueError(
            "kvsieve caches take a 2-D attention_mask (batch, tokens) or none; a prepared 4-D mask cannot be "
            "applied to evicted slots"
        )
    if not isinstance(mask, SieveMask):
        raise UnsupportedModelError(
            f"{_model_name(module)} did not build its attention mask with transformers' masking utilities, so "
            "kvsieve cannot tell which keys each query may see"
        )
    if mask.unsupported is not None:
        raise UnsupportedModelError(f"{_model_name(module)} uses {mask.unsupported}, which kvsieve does not implement")
    for name, value in kwargs.items():
        if name in IMPLEMENTED_ARGUMENTS:
            continue
        neutral = NEUTRAL_ARGUMENTS.get(name)
        if not (value is None if neutral is None else neutral(value)):
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            hint = " (the model is in training mode: call model.eval())" if name == "dropout" else ""
            raise UnsupportedModelError(
                f"{_model_name(module)} passes the attention argument {name}={shown}{hint}, which kvsieve does not "
                "implement; refusing rather than computing a different attention"
            )
    scaling = kwargs.get("scaling")
    return AttentionArgs(
        scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
        window=mask.window,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        weights=bool(kwargs.get("output_attentions")),
    )


def hand_over(layer: Any, keys: torch.Tensor | None) -> None:
    """Called by an evicting cache layer's ``update``: the next attention call over ``keys`` belongs to it (None:
    withdraw a hand-over that no attention call will take)."""
    _PENDING.layer, _PENDING.keys = layer, keys


def _take_hand_over(module: torch.nn.Module, keys: torch.Tensor) -> Any:
    layer, expected = _PENDING.layer, _PENDING.keys
    _PENDING.layer = _PENDING.keys = None
    if layer is None:
        return None
    if keys is not expected:
        layer.discard_step()
        raise UnsupportedModelError(
            f"{_model_name(module)}: the attention of layer {layer.layer_idx} did not receive the keys its kvsieve "
            "cache layer returned (the model transforms cached keys between cache.update() and attention); this "
            "architecture is not supported by kvsieve"
        )
    return layer


_SDPA_LACKS = ("softcap", "s_aux")


def sieve_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    fallback: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function registered with each kvsieve implementation (transformers' attention-interface
    signature): kvsieve's attention over a kvsieve cache layer's slots, the ``fallback`` implementation otherwise."""
    layer = _take_hand_over(module, key)
    if layer is None:
        if isinstance(attention_mask, SieveMask):
            raise UnsupportedModelError(
                f"{_model_name(module)}: layer {getattr(module, 'layer_idx', '?')} attends over keys that its kvsieve "
                "cache layer did not return (e.g. keys shared between layers); not supported"
            )
        lacking = [name for name in _SDPA_LACKS if fallback == "sdpa" and kwargs.get(name) is not None]
        if lacking:
            raise UnsupportedModelError(
                f"{_model_name(module)} passes {', '.join(lacking)}, which sdpa ignores or refuses; switch the model "
                "with kvsieve.use_kvsieve_attention(model) (make_cache and load_model do), which falls back to its "
                "eager attention"
            )
        return _fallback_attention(fallback, module)(module, query, key, value, attention_mask, **kwargs)
    try:
        # (checked by the first layer, which every forward pass runs: the config's attributes are slow to read)
        layers = getattr(module.config, "num_hidden_layers", None) if layer.layer_idx == 0 else None
        if layers is not None and layers != layer.n_layers:
            raise ValueError(
                f"this kvsieve cache was made for a model of {layer.n_layers} layers, not {layers}: a cache serves one "
                "model; make one for this model with kvsieve.make_cache"
            )
        args = attention_args(module, query, attention_mask, kwargs)
    except (UnsupportedModelError, ValueError):
        layer.discard_step()
        raise
    out, weights = layer.attend(query, key, value, attention_mask, args)
    return out.transpose(1, 2).contiguous(), weights
