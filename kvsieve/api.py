"""The user-facing API: build an evicting cache for a model, and generate with one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine.attention import use_kvsieve_attention
from kvsieve.engine.budget import Budget
from kvsieve.engine.cache import SieveCache, layer_types
from kvsieve.engine.plan import SAME, DecodeBudget
from kvsieve.engine.quant import kv_quant
from kvsieve.engine.schedules import schedule_weights
from kvsieve.policies import Asking, Policy, resolve_spec
from kvsieve.profiling import profile

__all__ = [
    "Generation",
    "compress_context",
    "eos_ids",
    "generate",
    "generated",
    "make_cache",
    "probe_context",
    "use_kvsieve_attention",
]


def make_cache(
    model: PreTrainedModel,
    policy: str | type[Policy] = "h2o",
    budget: Budget | None = 0.2,
    *,
    rolling: bool = False,
    stream: bool = False,
    schedule: str | Sequence[float] = "uniform",
    decode_budget: DecodeBudget = SAME,
    kv_bits: int | None = None,
    group_size: int | None = None,
    residual: int | None = None,
    kernels: str = "auto",
    **policy_kwargs: Any,
) -> SieveCache:
    """An evicting cache for ``model``: use it as ``cache`` in ``generate`` or a forward loop.

    ``budget``: tokens (int) or a ratio of the prompt length (float in (0, 1]); ignored by ``full``.
    ``policy``: a name or a spec (``"h2o:recent=0"``, see :mod:`kvsieve.policies`). ``policy_kwargs``: the
    policy's parameters (see ``kvsieve policies``). Sliding-window layers (e.g. Gemma 3's
    local layers) keep their own window; the policy and budget apply to the global layers. ``rolling=True`` assigns
    RoPE positions by rank within the cache (StreamingLLM-style), so streams can run past the model's
    ``max_position_embeddings``. ``stream=True``: every forward pass follows the stream protocol, one forward over a
    sequence giving exactly the logits of feeding it token by token (``with cache.streaming():`` for a few passes
    only; see :mod:`kvsieve.engine.stream`). ``schedule`` shares the budget among the policy layers, same total
    (``uniform``, ``increasing``, ``pyramid``, ``profiled`` or explicit per-layer weights; see
    :mod:`kvsieve.engine.schedules`). ``decode_budget``: budgets by phase: the prompt (the first forward pass, or
    its first tokens: ``cache.set_prompt_length``) is compressed to ``budget``, then the cache may grow up to
    ``decode_budget`` tokens per layer (tokens or a ratio of the prompt, at least ``budget``; ``None``: unbounded
    growth, i.e. prefill-only compression; default ``"budget"``: the cache never grows). ``kv_bits`` (8, 4 or 2;
    default None: as the model computes them) stores keys and values as packed codes, ``group_size`` channels per
    float16 scale/zero (default 32), the ``residual`` newest tokens of each row also exactly (default 16; see
    :mod:`kvsieve.engine.quant`); any policy. ``kernels``: ``"auto"`` (default) runs the compiled CPU loops
    (numba, the ``fast`` extra) where a policy's rule has one, ``"torch"`` the policies' torch code only — the same
    decisions (tested), as on a GPU (see :mod:`kvsieve.engine.compiled`). Switches the model to kvsieve's attention
    implementation (see :func:`use_kvsieve_attention`).
    """
    given = {"kv_bits": kv_bits, "group_size": group_size, "residual": residual}
    given = {key: value for key, value in given.items() if value is not None}
    cls, kwargs, schedule, quant_keys = resolve_spec(policy, {**policy_kwargs, **given}, schedule)
    quant = kv_quant(**quant_keys)
    params = cls.Params(**kwargs)
    weights = None
    if cls.takes_budget():
        n_layers = layer_types(model).count("full_attention")
        weights = schedule_weights(schedule, n_layers, lambda: profile(model))
    cache = SieveCache.for_model(
        model,
        cls,
        params,
        budget,
        weights,
        rolling=rolling,
        stream=stream,
        decode_budget=decode_budget,
        quant=quant,
        kernels=kernels,
    )
    use_kvsieve_attention(model)
    return cache


def compress_context(
    model: PreTrainedModel,
    cache: SieveCache,
    input_ids: torch.Tensor,
    asking: Asking | None = None,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 1,
) -> torch.Tensor:
    """Fill the empty ``cache`` with a context, ``input_ids`` ``[B, n]`` (left-padded where ``attention_mask`` says),
    compressed to its budget; returns the logits of its last ``logits_to_keep`` tokens ``[B, logits_to_keep,
    vocab]`` (0: of all).

    Under a policy scored by probes of its own (``kvzip``) the context is held whole, each row's probes
    (:meth:`~kvsieve.policies.base.Policy.probes`, written as ``asking`` says) are fed as probe passes (the rows'
    ``j``-th probes left-padded into one) and the cache is then compressed (:meth:`SieveCache.hold`); otherwise
    the context's forward pass compresses it, as any prompt."""
    if cache.get_seq_length() != 0:
        raise ValueError("compress_context fills an empty cache (make one, or reset() it)")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
    cache.plan.resolve(input_ids.shape[1])
    probed = cache.plan.probed
    if probed is not None and asking is None:
        raise ValueError(f"{probed.name} needs to know how to ask the model about the context (asking=)")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    fed = {"attention_mask": mask, "position_ids": positions, "logits_to_keep": logits_to_keep}
    with torch.inference_mode():
        if probed is None:
            return model(input_ids=input_ids, cache=cache, use_cache=True, **fed).logits
        cache.hold()
        try:
            logits = model(input_ids=input_ids, cache=cache, use_cache=True, **fed).logits
            probe_context(model, cache, input_ids, asking, mask)
        except BaseException:
            cache.reset()  # (nothing half-done: the cache is empty again)
            raise
        cache.compress()
    return logits


def probe_context(
    model: PreTrainedModel,
    cache: SieveCache,
    input_ids: torch.Tensor,
    asking: Asking,
    attention_mask: torch.Tensor | None = None,
) -> None:
    """Feed the probes of ``cache``'s policy for the context it holds (:meth:`SieveCache.hold`), ``input_ids``
    ``[B, n]`` as it was fed (left-padded where ``attention_mask`` says): each row's ``j``-th probes, left-padded
    into one pass, placed after the row's own tokens (:meth:`SieveCache.probing`)."""
    cache.plan.resolve(input_ids.shape[1])
    probed = cache.plan.probed
    if probed is None:
        raise ValueError(f"{cache.policy_name} has no probes: its cache is compressed as the context is fed")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
    rows = [probed.probes(ids[keep.bool()].tolist(), asking) for ids, keep in zip(input_ids, mask, strict=True)]
    with torch.inference_mode(), cache.probing():
        for j in range(max(map(len, rows))):
            ids, probe_mask = _left_padded([row[j] if j < len(row) else [] for row in rows], input_ids)
            full = torch.cat([mask, probe_mask], dim=1)
            at = (full.cumsum(-1) - 1).clamp(min=0)[:, mask.shape[1] :]
            model(input_ids=ids, attention_mask=full, position_ids=at, cache=cache, logits_to_keep=1)


def _left_padded(rows: Sequence[Sequence[int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of token ids left-padded to the longest (with token 0) as ``[B, L]``, and their mask."""
    width = max(map(len, rows))
    ids = like.new_zeros((len(rows), width))
    mask = like.new_zeros((len(rows), width))
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=ids.dtype)
            mask[i, width - len(row) :] = 1
    return ids, mask


RESERVED_GENERATE_KWARGS = frozenset({"input_ids", "attention_mask", "cache", "past_key_values", "max_new_tokens"})
"""``model.generate`` arguments that :func:`generate` sets itself (``past_key_values``: the name of ``cache`` before
transformers 5.24)."""


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
    cache = make_cache(model, policy, budget, schedule=schedule, **(policy_kwargs or {}))
    enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left").to(model.device)
    prompt_len = enc["input_ids"].shape[1]
    cache.resolve(prompt_len)  # (a ratio budget: against the padded prompt, so invalid splits fail before any work)
    # The prompt is the first pass's first tokens: assisted generation and prompt lookup add draft tokens to it.
    cache.set_prompt_length(prompt_len)
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs.setdefault("tokenizer", tokenizer)  # (stop strings and assistants with their own tokenizer)
    if tokenizer.pad_token_id is not None:
        generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    with torch.inference_mode():
        out = model.generate(**enc, cache=cache, max_new_tokens=max_new_tokens, **generate_kwargs)
    texts, lengths = generated(model, tokenizer, out, prompt_len, generate_kwargs.get("eos_token_id"))
    per_prompt = out.shape[0] // len(batch)  # (num_return_sequences: the sequences of each prompt in a row)
    return Generation(
        texts=texts,
        prompt_tokens=[n for n in enc["attention_mask"].sum(-1).tolist() for _ in range(per_prompt)],
        generated_tokens=lengths,
        budget_tokens=cache.budget_tokens,
        cache=cache,
    )


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, ids: int | list[int] | None = None) -> set[int]:
    """The EOS ids generation stops at: ``ids`` (an ``eos_token_id`` passed to generate), else the model's."""
    if ids is None and model.generation_config is not None:
        ids = model.generation_config.eos_token_id
    if ids is None:
        ids = tokenizer.eos_token_id
    return set(ids if isinstance(ids, list) else [] if ids is None else [ids])


def generated(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: torch.Tensor,
    prompt_length: int,
    eos_token_id: int | list[int] | None = None,
) -> tuple[list[str], list[int]]:
    """What ``model.generate`` added after the ``prompt_length`` tokens of each row of ``out``: the texts and the
    numbers of tokens, each up to and including its first EOS (:func:`eos_ids`; padding after it is not counted)."""
    eos = eos_ids(model, tokenizer, eos_token_id)
    rows = out[:, prompt_length:].tolist()
    lengths = [next((i + 1 for i, token in enumerate(row) if token in eos), len(row)) for row in rows]
    texts = [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, lengths, strict=True)]
    return texts, lengths
