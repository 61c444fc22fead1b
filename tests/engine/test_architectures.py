"""Every architecture kvsieve supports gives transformers' own results; every feature it does not implement is
refused before anything is computed (never a silently different answer).

Tiny random configs of each architecture; the reference is the model's eager attention over a ``DynamicCache``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask

import kvsieve
import kvsieve.engine.attention as attention
from kvsieve.architectures import EXACT, REFUSED
from kvsieve.policies.h2o import H2O

VOCAB = 96

UNSUPPORTED = {
    "jetmoe": "did not receive the keys",  # transforms cached keys after cache.update()
    "bloom": "cannot switch to a custom attention",  # ALiBi, its own attention code
    "falcon_h1": r"layer types \['hybrid'\]",
    "qwen3_next": r"layer types \['linear_attention'\]",
    "llama4_text": r"layer types \['chunked_attention'\]",
}
"""What each refused architecture's error says (:data:`kvsieve.architectures.REFUSED`, the same names)."""


def test_the_refused_architectures_are_the_ones_the_package_states() -> None:
    assert sorted(UNSUPPORTED) == sorted(REFUSED)


SIZES = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "max_position_embeddings": 256, "n_embd": 64,
    "n_layer": 4, "n_head": 4, "n_positions": 256, "n_inner": 128, "ffn_dim": 128, "num_local_experts": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "sliding_window": 8, "initializer_range": 0.2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "rotary_dim": 8,
}  # fmt: skip


def tiny_model(model_type: str, **overrides: Any) -> PreTrainedModel:
    """A seeded tiny random model of ``model_type`` in fp32, eval mode, with its default attention."""
    config = AutoConfig.for_model(model_type)
    for name, value in {**SIZES, **overrides}.items():
        if hasattr(config, name):
            setattr(config, name, value)
    if model_type in ("phi", "stablelm", "gpt_neox", "persimmon"):
        config.partial_rotary_factor = 0.5
    if getattr(config, "layer_types", None):
        pattern = config.layer_types
        with contextlib.suppress(AttributeError):  # (derived from other fields in some configs)
            config.layer_types = [pattern[i % len(pattern)] for i in range(config.num_hidden_layers)]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random norm weights, so that heads and layers differ
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param), alpha=0.3)
    return model.float().eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of two rows (12 and 9 real tokens) and its mask."""
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def _run(model: PreTrainedModel, cache: Any, steps: int = 3) -> torch.Tensor:
    """Prefill the batch, then ``steps`` fixed tokens one at a time; the logits of the real rows' tokens."""
    ids, mask = _inputs()
    logits = []
    with torch.inference_mode():
        for t in range(steps + 1):
            out = model(ids, attention_mask=mask, cache=cache).logits
            logits.append(out.float())
            ids = torch.full((2, 1), 3 + t)
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
    real = torch.cat([_inputs()[1], torch.ones(2, steps, dtype=torch.long)], dim=1).bool()
    return torch.cat(logits, dim=1)[real]


def _reference(model: PreTrainedModel) -> torch.Tensor:
    """The same run with the model's eager attention over a DynamicCache."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return _run(model, DynamicCache(config=model.config))
    finally:
        model.set_attn_implementation(implementation)


@pytest.mark.parametrize("model_type", list(EXACT))
def test_full_equals_the_models_own_attention_and_every_argument_is_known(model_type, monkeypatch) -> None:
    model = tiny_model(model_type)
    expected = _reference(model)
    passed: set[str] = set()

    def spy(module, query, mask, kwargs):
        passed.update(kwargs)
        return attention_args(module, query, mask, kwargs)

    attention_args = attention.attention_args
    monkeypatch.setattr(attention, "attention_args", spy)
    got = _run(model, kvsieve.make_cache(model, "full", None))
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    # Every attention argument the architecture passes is one kvsieve knows: implemented, or neutral when its value
    # passes the test. A new argument (a new transformers feature) fails here until someone classifies it.
    unknown = passed - attention.IMPLEMENTED_ARGUMENTS - set(attention.NEUTRAL_ARGUMENTS)
    assert not unknown, f"{model_type} passes attention arguments kvsieve does not know: {sorted(unknown)}"
    cache = kvsieve.make_cache(model, "h2o", 6)
    assert torch.isfinite(_run(model, cache)).all()
    assert max(cache.slot_counts()) <= 7


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED))
def test_unsupported_architectures_are_refused_before_anything_is_cached(model_type) -> None:
    model = tiny_model(model_type)
    cache = None
    with pytest.raises(kvsieve.UnsupportedModelError, match=UNSUPPORTED[model_type]), torch.inference_mode():
        cache = kvsieve.make_cache(model, "h2o", 6)
        model(_inputs()[0], cache=cache)
    assert cache is None or cache.get_seq_length() == 0


def test_softcapping_and_sinks_reach_the_output_and_the_policy(monkeypatch) -> None:
    """Gemma 2's logit soft-capping (1.0: a strong cap) and GPT-OSS's attention sinks, with a policy that observes:
    the logits are the eager ones, and the probabilities the policy sees are the model's, over the tokens only."""
    observed = []
    observe = H2O.observe
    monkeypatch.setattr(H2O, "observe", lambda self, slots, obs: (observed.append(obs), observe(self, slots, obs)))
    for model_type, overrides in (("gemma2", {"attn_logit_softcapping": 1.0}), ("gpt_oss", {})):
        model = tiny_model(model_type, **overrides)
        ids, mask = _inputs()
        implementation = model.config._attn_implementation
        model.set_attn_implementation("eager")
        with torch.inference_mode():
            expected = model(ids, attention_mask=mask, output_attentions=True)
        model.set_attn_implementation(implementation)
        observed.clear()
        with torch.inference_mode():
            got = model(ids, attention_mask=mask, cache=kvsieve.make_cache(model, "h2o", 64))
        real = mask.bool()
        torch.testing.assert_close(got.logits[real], expected.logits[real], atol=1e-5, rtol=1e-5)
        full_layers = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
        for obs, layer in zip(observed, full_layers, strict=True):
            eager = expected.attentions[layer]  # [B, Hq, q, kv]
            summed = eager.view(2, obs.probs.shape[1], -1, *eager.shape[2:]).sum(dim=2)
            torch.testing.assert_close(obs.probs[0], summed[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(obs.probs[1][:, 3:, 3:], summed[1][:, 3:, 3:], atol=1e-5, rtol=1e-5)
        rows = observed[0].probs[0].sum(dim=-1)
        if model_type == "gpt_oss":  # the sinks take a share: each query head's probabilities sum to less than 1
            assert (rows < 2 - 1e-3).all()
        else:
            torch.testing.assert_close(rows, torch.full_like(rows, 2.0))


def test_a_model_keeps_its_own_attention_for_other_caches() -> None:
    """After make_cache, a DynamicCache runs the model's own implementation: eager for Gemma 2 (sdpa cannot
    soft-cap), sdpa for Llama; a model built with "kvsieve" directly that cannot run sdpa switches to eager."""
    gemma2 = tiny_model("gemma2", attn_logit_softcapping=1.0)
    assert gemma2.config._attn_implementation == "eager"
    expected = _run(gemma2, DynamicCache(config=gemma2.config))
    kvsieve.make_cache(gemma2, "h2o", 6)
    assert gemma2.config._attn_implementation == "kvsieve_eager"
    torch.testing.assert_close(_run(gemma2, DynamicCache(config=gemma2.config)), expected, atol=0, rtol=0)
    llama = tiny_model("llama")
    kvsieve.make_cache(llama, "h2o", 6)
    assert llama.config._attn_implementation == "kvsieve"
    kvsieve.register()
    gemma2.set_attn_implementation("kvsieve")  # sdpa fallback: a silently wrong answer is refused
    with pytest.raises(kvsieve.UnsupportedModelError, match="softcap, which sdpa ignores or refuses"):
        _run(gemma2, DynamicCache(config=gemma2.config))
    assert kvsieve.use_kvsieve_attention(gemma2) == "kvsieve_eager"


def _unknown_argument(model: PreTrainedModel) -> dict[str, Any]:
    return {"foo": torch.ones(1)}


def _not_causal(model: PreTrainedModel) -> dict[str, Any]:
    return {"is_causal": False}


def _dropout(model: PreTrainedModel) -> dict[str, Any]:
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    return {}


def _bidirectional(model: PreTrainedModel) -> dict[str, Any]:
    model.config.is_causal = False
    return {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_unknown_argument, r"passes the attention argument foo=a tensor of shape \(1,\)"),
        (_not_causal, "uses bidirectional attention"),  # (transformers builds a bidirectional mask for it)
        (_dropout, r"dropout=0.1 \(the model is in training mode"),
        (_bidirectional, "uses bidirectional attention"),
    ],
    ids=["unknown-argument", "not-causal", "dropout", "bidirectional"],
)
def test_unimplemented_attention_features_are_refused_and_leave_the_cache_untouched(change, message) -> None:
    model = tiny_model("llama")
    cache = kvsieve.make_cache(model, "h2o", 0.5)
    kwargs = change(model)
    ids, mask = _inputs()
    with pytest.raises(kvsieve.UnsupportedModelError, match=message), torch.inference_mode():
        model(ids, attention_mask=mask, cache=cache, **kwargs)
    assert cache.get_seq_length() == 0 and cache.budget_tokens is None  # (the ratio is resolved again)
    fresh = tiny_model("llama")
    expected = _run(fresh, kvsieve.make_cache(fresh, "h2o", 0.5))
    torch.testing.assert_close(_run(fresh, cache), expected, atol=0, rtol=0)  # the refused cache is as good as new


def test_masks_kvsieve_does_not_implement_are_refused() -> None:
    """Masks are built by transformers' own masking utilities: extra mask functions and chunked attention reach
    the kvsieve mask and are refused at the first layer that uses them."""
    model = tiny_model("llama")
    embeds = torch.zeros(1, 5, 64)
    cache = kvsieve.make_cache(model, "h2o", 4)
    extra = create_causal_mask(
        config=model.config,
        inputs_embeds=embeds,
        attention_mask=None,
        cache=cache,
        or_mask_function=lambda b, h, q, kv: kv == 0,
    )
    assert "extra mask function" in extra.unsupported
    model.config.attention_chunk_size = 4
    chunked = create_chunked_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, cache=cache)
    assert "chunked attention" in chunked.unsupported
    plain = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, cache=cache)
    assert plain.unsupported is None and plain.window is None
    # Without a kvsieve cache the mask is the fallback's own (a tensor or None, as sdpa would build it).
    dense = create_causal_mask(
        config=model.config, inputs_embeds=embeds, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]), cache=None
    )
    assert isinstance(dense, torch.Tensor) and dense.shape == (1, 1, 5, 5)


def test_a_mask_window_without_a_window_argument_is_applied() -> None:
    """PhiMoE builds sliding-window masks but passes no sliding_window to its attention: the mask's window holds."""
    model = tiny_model("phimoe")
    assert model.config.sliding_window == 8
    torch.testing.assert_close(
        _run(model, kvsieve.make_cache(model, "full", None)), _reference(model), atol=2e-4, rtol=1e-4
    )
