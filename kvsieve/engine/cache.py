"""A transformers ``Cache`` whose layers physically hold at most a budget of tokens.

Each layer is a :class:`~kvsieve.engine.layer.SieveLayer` (the step: store → attend → observe → evict). Between
steps a bounded layer holds at most ``budget`` tokens in ``budget + 1`` allocated slots (the spare slot receives the
next decode token). ``get_seq_length()`` is the number of tokens seen, so RoPE positions stay true.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from kvsieve.engine.attention import UnsupportedModelError
from kvsieve.engine.budget import Budget
from kvsieve.engine.compiled import use_kernels
from kvsieve.engine.eviction import keep_scores
from kvsieve.engine.layer import SieveLayer
from kvsieve.engine.plan import SAME, DecodeBudget, PolicyPlan, StepMemo, shared_budgets
from kvsieve.engine.quant import PLAIN, Codec, KVQuant
from kvsieve.engine.rope import Rotary
from kvsieve.engine.saved import export_layer, restore_layer
from kvsieve.policies import NoParams, Policy
from kvsieve.policies.local import Local


def layer_types(model: PreTrainedModel) -> list[str]:
    """The attention type of each layer of ``model`` (``full_attention`` or ``sliding_attention``); other kinds
    of layers, encoder-decoders and configs without layers are refused."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    config = model.config.get_text_config()
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; kvsieve needs a decoder-only LM"
        )
    n_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(n_layers, int) or n_layers <= 0:
        raise UnsupportedModelError(f"{type(model).__name__}: its config has no num_hidden_layers")
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
    unsupported = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unsupported:
        raise UnsupportedModelError(
            f"{type(model).__name__} has layer types {unsupported}; kvsieve supports full and sliding-window attention"
        )
    return types


class SieveCache(Cache):
    """A cache of :class:`SieveLayer` s. Build it with :func:`kvsieve.make_cache`."""

    layers: list[SieveLayer]

    def __init__(
        self,
        plan: PolicyPlan,
        sliding: Sequence[bool],
        stream: bool = False,
        codec: Codec = PLAIN,
        kernels: str = "auto",
    ) -> None:
        if not isinstance(stream, bool):
            raise ValueError(f"stream must be True or False, got {stream!r}")
        self.memo = StepMemo()
        fast = use_kernels(kernels)
        super().__init__(layers=[SieveLayer(plan, self.memo, i, s, codec, fast) for i, s in enumerate(sliding)])
        self.plan = plan
        self.codec = codec
        for layer in self.layers:
            layer.streaming = stream

    @classmethod
    def for_model(
        cls,
        model: PreTrainedModel,
        policy: type[Policy],
        params: Any,
        budget: Budget | None,
        weights: Sequence[float] | None = None,
        *,
        rolling: bool = False,
        stream: bool = False,
        decode_budget: DecodeBudget = SAME,
        quant: KVQuant | None = None,
        kernels: str = "auto",
    ) -> SieveCache:
        """A cache for ``model``'s layers: the policy (with a budget, and ``weights`` for a layer schedule) on the
        full-attention layers, a window on the sliding ones, slots quantized as ``quant`` says, steps running the
        ``kernels`` (see :func:`kvsieve.make_cache`)."""
        types = layer_types(model)
        config = model.config.get_text_config()
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" in types and not window:
            raise UnsupportedModelError(
                f"{type(model).__name__} has sliding layers but no sliding_window in its config"
            )
        if policy.allocates_heads and rolling:
            raise ValueError(f"{policy.name}: heads keeping their own counts are not rolled (no position rolling)")
        layers = [(policy, params, None) if t == "full_attention" else (Local, NoParams(), window - 1) for t in types]
        takes_budget = policy.takes_budget()
        plan = PolicyPlan(layers, budget if takes_budget else None, weights if takes_budget else None, decode_budget)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if quant is not None:
            quant.check(head_dim)
        sliding = [t == "sliding_attention" for t in types]
        cache = cls(plan, sliding, stream=stream, codec=quant or PLAIN, kernels=kernels)
        if rolling:
            if policy.needs_queries:
                raise ValueError(f"{policy.name} reads the queries at their true positions: no position rolling")
            cache.enable_rolling(Rotary.from_config(config))
        if policy.needs_queries:  # (the policy runs on the full-attention layers)
            rope = Rotary.from_config(config, "full_attention" if "sliding_attention" in types else None)
            for layer in cache.layers:
                layer.rope = rope
        return cache

    @property
    def budget_tokens(self) -> int | None:
        """The resolved budget in tokens (None before a ratio budget meets its prompt, or when unbounded)."""
        return self.plan.budget_tokens

    def resolve(self, prompt_len: int) -> int | None:
        """Resolve a ratio budget against a prompt of ``prompt_len`` tokens now (every layer's policy is built and
        validated); the budget in tokens. The first forward pass does it otherwise."""
        self.plan.resolve(prompt_len)
        return self.budget_tokens

    @property
    def decode_budget_tokens(self) -> int | None:
        """The most tokens a policy layer holds after the prompt under a uniform schedule (the resolved decode budget;
        None: unbounded, or not resolved yet)."""
        if self.budget_tokens is None or self.plan.growth is None:
            return None
        return self.budget_tokens + self.plan.growth

    @property
    def budgets(self) -> list[int | None]:
        """Each layer's budget in tokens (None: unbounded, or a ratio budget not resolved yet)."""
        policies = self.plan.policies
        return [None] * len(self.layers) if policies is None else [policy.budget for policy in policies]

    @property
    def policy_name(self) -> str:
        return self.plan.layer_policies[-1][0].name

    def reset(self) -> None:
        super().reset()
        self.plan.reset()
        self.memo.clear()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"this kvsieve cache was made for a model of {len(self.layers)} layers, not one with a layer "
                f"{layer_idx}: a cache serves one model; make one for this model with kvsieve.make_cache"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def join(self, other: SieveCache) -> None:
        """Append the batch rows of ``other`` to this cache's (continuous batching: a request prefilled alone joins a
        running batch). Both must have been made alike (policy, parameters, budgets in tokens, rolling) and hold
        tokens. Each row keeps exactly its tokens and policy state; rows that hold fewer slots are padded with empty
        ones. Feed the joined batch each row's own ``position_ids``: ``get_seq_length()`` is the larger of the two.
        ``batch_select_indices`` removes rows."""
        if (
            self.plan.layer_policies != other.plan.layer_policies
            or self.budgets != other.budgets
            or self.plan.growth != other.plan.growth
            or self.rolling != other.rolling
            or self.stream != other.stream
        ):
            raise ValueError("only caches made alike (policy, parameters, budget in tokens, rolling) can be joined")
        for layer, joining in zip(self.layers, other.layers, strict=True):
            layer.join(joining)
        self.memo.clear()  # (what the layers shared was for the old batch)

    def export(self) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """Every layer's held tokens and policy state as tensors (named ``layers.{i}.…``) and counters, to be saved
        (:meth:`restore` takes them back into a cache made alike)."""
        tensors, counters = {}, []
        for i, layer in enumerate(self.layers):
            held, counted = export_layer(layer)
            tensors.update({f"layers.{i}.{name}": t for name, t in held.items()})
            counters.append(counted)
        return tensors, counters

    def restore(self, tensors: dict[str, torch.Tensor], counters: list[dict[str, Any]], prompt_len: int) -> None:
        """Hold what :meth:`export` gave a cache made alike (a ratio budget resolved against ``prompt_len``)."""
        if len(counters) != len(self.layers):
            raise ValueError(f"saved state of {len(counters)} layers, this cache has {len(self.layers)}")
        self.memo.clear()
        for i, (layer, counted) in enumerate(zip(self.layers, counters, strict=True)):
            prefix = f"layers.{i}."
            held = {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}
            restore_layer(layer, held, counted, prompt_len)

    def hold(self) -> None:
        """Evict nothing until :meth:`compress`: the forward passes from now on are stored whole (and not observed:
        a bounded policy observes only what it may evict by), and :meth:`probing` passes score what is held. For a
        policy that scores a context by passes of its own (``kvzip``): :func:`kvsieve.compress_context` holds the
        context, feeds the policy's probes and compresses it."""
        if self.holding:
            raise ValueError("the cache already holds its tokens for compress()")
        for layer in self.layers:
            layer.holding = True

    @property
    def holding(self) -> bool:
        """Whether the cache holds its tokens until :meth:`compress` (see :meth:`hold`)."""
        return self.layers[0].holding

    def compress(self) -> None:
        """End :meth:`hold`: every layer evicts down to its prompt budget by its policy's priorities (what the held
        passes and probes left), then decodes under its decode budget as after any prompt. A policy whose
        priorities compare across layers (``Policy.shares_budget``) first shares the policy layers' budget by one
        selection over all of them (:func:`~kvsieve.engine.plan.shared_budgets`): each layer keeps its share."""
        if not self.holding:
            raise ValueError("compress() ends a hold: call cache.hold() before the passes to compress")
        shared = [layer for layer in self.layers if layer.store is not None and layer.policy.shares_budget()]
        if shared:
            with torch.inference_mode():
                priorities = [keep_scores(layer, layer.store.view(layer.newest)) for layer in shared]
            total = sum(layer.policy.budget for layer in shared)
            for layer, tokens in zip(shared, shared_budgets(priorities, total), strict=True):
                layer.policy = self.plan.set_budget(layer.layer_idx, tokens)
        for layer in self.layers:
            layer.compress_held()
        self.memo.clear()

    def observes_as(self) -> tuple[Hashable, ...] | None:
        """What the layers' policies observe, layer by layer (:meth:`~kvsieve.policies.base.Policy.observes_as`), or
        None where a layer's policy observes like no other (or it has none yet): two caches of equal values, holding
        the same tokens, are left in the same state by the same passes."""
        like = tuple(None if layer.policy is None else layer.policy.observes_as() for layer in self.layers)
        return None if None in like else like

    def adopt_state(self, source: SieveCache) -> None:
        """Take the policy state of ``source``: a cache of the same policy and parameters (any budget), or of
        policies that observe alike (:meth:`~kvsieve.policies.base.Policy.observes_as`, layer by layer), that holds the
        very tokens this one holds, both held (:meth:`hold`; e.g. filled by one shared prompt pass) — what its probes
        observed, without probing again."""
        like = self.observes_as()
        alike = self.plan.layer_policies == source.plan.layer_policies or (
            like is not None and like == source.observes_as()
        )
        if not (self.holding and source.holding and alike):
            raise ValueError("only held caches of policies that observe alike can share their state")
        for mine, theirs in zip(self.layers, source.layers, strict=True):
            a, b = mine.store, theirs.store
            if a.used != b.used or not torch.equal(a.positions[:, :, : a.used], b.positions[:, :, : b.used]):
                raise ValueError("only caches holding the same tokens can share their state")
            for name, state in a.state.items():
                state[:, :, : a.used] = b.state[name][:, :, : b.used]

    @contextmanager
    def probing(self) -> Iterator[SieveCache]:
        """Within the block, forward passes are *probes* of what the cache holds (:meth:`hold`): each layer attends
        a probe's tokens over the held ones and its own, its policy observes that attention, and the probe's tokens
        are then removed — the cache holds and has seen what it held and had seen before, the held tokens' policy
        state updated. A probe needs plain slots (no quantization, position rolling or recording) and is one step
        whatever the stream protocol says (nothing is evicted while held); its outputs are the model's as if its
        tokens followed the held ones."""
        if not self.holding:
            raise ValueError("probes score held tokens: call cache.hold() before the passes to hold")
        first = self.layers[0]
        if isinstance(self.codec, KVQuant) or self.rolling or first.record_past:
            raise ValueError("a probe needs plain slots: no kv_bits quantization, position rolling or recording")
        if self.get_seq_length() == 0:
            raise ValueError("a probe scores held tokens: feed the tokens to hold first")
        for layer in self.layers:
            layer.probing = True
        try:
            yield self
        finally:
            for layer in self.layers:
                layer.probing = False
            self.memo.clear()

    @property
    def stream(self) -> bool:
        """Whether forward passes follow the stream protocol: one forward over a sequence gives exactly the logits of
        feeding it token by token through this cache (see :mod:`kvsieve.engine.stream`)."""
        return self.layers[0].streaming

    @property
    def step_size(self) -> None:
        raise AttributeError("step_size is gone: make_cache(..., stream=True), or `with cache.streaming():`")

    @step_size.setter
    def step_size(self, value: Any) -> None:
        raise AttributeError("step_size is gone: make_cache(..., stream=True), or `with cache.streaming():`")

    @contextmanager
    def streaming(self, on: bool = True) -> Iterator[SieveCache]:
        """Within the block, forward passes follow the stream protocol (``on``) or not."""
        previous = self.stream
        for layer in self.layers:
            layer.streaming = on
        try:
            yield self
        finally:
            for layer in self.layers:
                layer.streaming = previous

    def set_prompt_length(self, tokens: int) -> None:
        """The first forward pass starts with a prompt of ``tokens`` tokens: they are processed at once (a prefill,
        which also resolves a ratio budget), the tokens after them in that pass one at a time, as decode steps.

        transformers' assisted generation and prompt lookup verify their first draft tokens in the prompt's forward
        pass; with this, they evict exactly as plain decoding does (``kvsieve.generate`` sets it)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"the prompt length must be a positive int, got {tokens!r}")
        if self.get_seq_length() > 0:
            raise ValueError("the prompt length is set before the first forward pass (or after reset())")
        for layer in self.layers:
            layer.prompt_tokens = tokens

    def activate_past_recording(self, **kwargs: object) -> None:
        """Record the next steps so that :meth:`crop` can roll them back exactly (transformers calls this before
        assisted generation and prompt lookup). An empty cache must know where the prompt of its first pass ends
        (:meth:`set_prompt_length`): transformers verifies the first draft tokens in that pass, and the cache evicts
        (and can roll back) the tokens after the prompt one at a time. ``kwargs`` (transformers' options for its
        layers, such as the recurrent states a linear-attention layer keeps) go to each layer."""
        if self.get_seq_length() == 0 and self.layers[0].prompt_tokens is None:
            raise ValueError(
                "assisted generation and prompt lookup verify the first draft tokens in the prompt's forward pass; to "
                "evict exactly as plain decoding does, the kvsieve cache must know where the prompt ends: call "
                "cache.set_prompt_length(input_ids.shape[1]) before generate (kvsieve.generate does it)"
            )
        super().activate_past_recording(**kwargs)

    @property
    def rolling(self) -> bool:
        """Whether keys are re-rotated by their rank in the cache (position rolling, see :mod:`kvsieve.engine.rope`)."""
        return self.layers[0].rotary is not None

    def enable_rolling(self, rotary: Rotary) -> None:
        """Switch on position rolling (before the first forward pass)."""
        if any(layer.is_initialized for layer in self.layers):
            raise ValueError("position rolling must be enabled before the cache is used")
        for layer in self.layers:
            layer.rotary = rotary

    def positions(self, layer_idx: int) -> torch.Tensor:
        """``[batch, kv_heads, slots]`` original positions of the tokens held by ``layer_idx`` (-1 = padding)."""
        return self.layers[layer_idx].held_positions()

    def slot_counts(self) -> list[int]:
        """Slots in use per layer."""
        return [0 if layer.store is None else layer.store.held for layer in self.layers]

    def capacities(self) -> list[int]:
        """Slots allocated per layer."""
        return [layer.capacity for layer in self.layers]

    def kv_nbytes(self) -> int:
        """Bytes held by keys and values (allocated buffers)."""
        return sum(layer.kv_nbytes() for layer in self.layers)

    def state_nbytes(self) -> int:
        """Bytes held by positions and policy state."""
        return sum(layer.state_nbytes() for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes held by K/V and policy state together."""
        return self.kv_nbytes() + self.state_nbytes()
