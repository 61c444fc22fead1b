"""The user-facing API: build an evicting cache for a model, and generate with one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine.attention import UnsupportedModelError, fallback_of, register
from kvsieve.engine.budget import Budget, check_budget
from kvsieve.engine.cache import PolicyPlan, SieveCache
from kvsieve.engine.rope import Rotary
from kvsieve.engine.schedules import schedule_weights
from kvsieve.policies import NoParams, Policy, get_policy
from kvsieve.policies.local import Local


def use_kvsieve_attention(model: PreTrainedModel) -> str:
    """Switch ``model`` to kvsieve's attention implementation and return its name.

    Over a kvsieve cache it attends over the kept slots; over any other cache it runs the model's own implementation
    (the one it had: ``sdpa``, ``eager``, ...; for a model built with ``"kvsieve"`` directly, transformers' default
    for it), so the model behaves with a ``DynamicCache``, ``StaticCache``, ... exactly as before.
    """
    _require_model(model)
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


def _require_model(model: Any) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")


def _layer_types(model: PreTrainedModel) -> list[str]:
    _require_model(model)
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


def make_cache(
    model: PreTrainedModel,
    policy: str | type[Policy] = "h2o",
    budget: Budget | None = 0.2,
    *,
    rolling: bool = False,
    schedule: str | Sequence[float] = "uniform",
    **policy_kwargs: Any,
) -> SieveCache:
    """An evicting cache for ``model``: use it as ``past_key_values`` in ``generate`` or a forward loop.

    ``budget``: tokens (int) or a ratio of the prompt length (float in (0, 1]); ignored by ``full``.
    ``policy_kwargs``: the policy's parameters (see ``kvsieve policies``). Sliding-window layers (e.g. Gemma 3's
    local layers) keep their own window; the policy and budget apply to the global layers. ``rolling=True`` assigns
    RoPE positions by rank within the cache (StreamingLLM-style), so streams can run past the model's
    ``max_position_embeddings``. ``schedule`` shares the budget among the policy layers, same total (``uniform``,
    ``increasing``, ``pyramid``, ``profiled`` or explicit per-layer weights; see :mod:`kvsieve.engine.schedules`).
    Switches the model to kvsieve's attention implementation (see :func:`use_kvsieve_attention`).
    """
    cls = get_policy(policy)
    params = cls.make_params(**policy_kwargs)
    types = _layer_types(model)
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if "sliding_attention" in types and not window:
        raise UnsupportedModelError(f"{type(model).__name__} has sliding layers but no sliding_window in its config")
    layers = [(cls, params, None) if t == "full_attention" else (Local, NoParams(), window - 1) for t in types]
    takes_budget = cls.takes_budget()
    weights = schedule_weights(schedule, model, types.count("full_attention")) if takes_budget else None
    plan = PolicyPlan(layers, budget if takes_budget else None, weights)
    rotary = Rotary.from_config(model.config.get_text_config()) if rolling else None
    use_kvsieve_attention(model)
    cache = SieveCache(plan, [t == "sliding_attention" for t in types])
    if rotary is not None:
        cache.enable_rolling(rotary)
    return cache


RESERVED_GENERATE_KWARGS = frozenset({"input_ids", "attention_mask", "past_key_values", "max_new_tokens"})
"""``model.generate`` arguments that :func:`generate` sets itself."""


@dataclass
class Generation:
    """Result of :func:`generate`."""

    texts: list[str]
    """Generated continuations (prompt excluded): one per prompt, or ``num_return_sequences`` per prompt in a row."""
    prompt_tokens: list[int]
    """The prompt's tokens (padding excluded), one entry per text."""
    generated_tokens: list[int]
    budget_tokens: int | None
    cache: SieveCache = field(repr=False)

    @property
    def text(self) -> str:
        """The continuation of the first (or only) prompt."""
        return self.texts[0]


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: str | list[str],
    policy: str | type[Policy] = "h2o",
    budget: Budget | None = 0.2,
    max_new_tokens: int = 64,
    policy_kwargs: dict[str, Any] | None = None,
    schedule: str | Sequence[float] = "uniform",
    **generate_kwargs: Any,
) -> Generation:
    """Generate from one prompt or a batch (left-padded) with the KV cache held to ``budget``.

    A ratio budget is a share of the padded prompt length; ``schedule`` shares it among layers (see
    :func:`make_cache`). Greedy decoding unless ``generate_kwargs`` say otherwise (e.g. ``do_sample=True``).
    """
    batch = [prompts] if isinstance(prompts, str) else list(prompts)
    if not batch or any(not isinstance(p, str) or not p for p in batch):
        raise ValueError("prompts must be a non-empty string or a non-empty list of non-empty strings")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens!r}")
    reserved = sorted(RESERVED_GENERATE_KWARGS & generate_kwargs.keys())
    if reserved:
        raise ValueError(f"kvsieve.generate sets {', '.join(reserved)} itself; pass the prompts and max_new_tokens")
    if budget is not None:
        check_budget(budget)
    enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left").to(model.device)
    prompt_len = enc["input_ids"].shape[1]
    cache = make_cache(model, policy, budget, schedule=schedule, **(policy_kwargs or {}))
    # The prompt is the first pass's first tokens: assisted generation and prompt lookup add draft tokens to it.
    cache.set_prompt_length(prompt_len)
    if isinstance(budget, float) and cache.plan.budget is not None:
        # Resolve now against the padded prompt, so invalid splits fail before any work.
        cache.plan.resolve(prompt_len)
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs.setdefault("tokenizer", tokenizer)  # (stop strings and assistants with their own tokenizer)
    if tokenizer.pad_token_id is not None:
        generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    with torch.inference_mode():
        out = model.generate(**enc, past_key_values=cache, max_new_tokens=max_new_tokens, **generate_kwargs)
    new = out[:, prompt_len:]
    eos = _eos_ids(model, tokenizer, generate_kwargs.get("eos_token_id"))
    lengths = [_length_until_eos(row, eos) for row in new.tolist()]
    per_prompt = out.shape[0] // len(batch)  # (num_return_sequences: the sequences of each prompt in a row)
    return Generation(
        texts=[
            tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(new.tolist(), lengths, strict=True)
        ],
        prompt_tokens=[n for n in enc["attention_mask"].sum(-1).tolist() for _ in range(per_prompt)],
        generated_tokens=lengths,
        budget_tokens=cache.budget_tokens,
        cache=cache,
    )


def _eos_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, ids: int | list[int] | None = None
) -> set[int]:
    """The EOS ids generation stops at: ``ids`` (an ``eos_token_id`` passed to generate), else the model's."""
    if ids is None and model.generation_config is not None:
        ids = model.generation_config.eos_token_id
    if ids is None:
        ids = tokenizer.eos_token_id
    return set(ids if isinstance(ids, list) else [] if ids is None else [ids])


def _length_until_eos(row: list[int], eos: set[int]) -> int:
    """Generated tokens up to and including the first EOS (padding after it is not counted)."""
    for i, tok in enumerate(row):
        if tok in eos:
            return i + 1
    return len(row)
