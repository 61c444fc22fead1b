"""Position rolling: keys re-rotated by their rank in the cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvsieve
from kvsieve.engine.rope import Rotary, ranks


def _model(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def test_ranks_order_valid_slots_and_zero_empty_ones():
    pos = torch.tensor([[[7, -1, 3, 12, 5]]])
    assert ranks(pos).tolist() == [[[2, 0, 0, 3, 1]]]


def test_rotation_inverts_and_composes():
    rot = Rotary(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    x = torch.randn(1, 2, 5, 8)
    p = torch.arange(5).view(1, 1, 5).expand(1, 2, 5)
    assert torch.allclose(rot.rotate(rot.rotate(x, p), -p), x, atol=1e-6)
    assert torch.allclose(rot.rotate(rot.rotate(x, p), p + 3), rot.rotate(x, 2 * p + 3), atol=1e-5)


@pytest.mark.parametrize("first", [0, 4_000, 32_000])
def test_averaged_rotation_is_the_mean_of_the_rotations(first):
    """The closed form of the rotation averaged over ``count`` consecutive positions equals the mean of the
    rotations at each of them (computed in float64), for the head sizes and bases of real models."""
    for dim, base in ((64, 10_000.0), (128, 1_000_000.0)):
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim))
        x = torch.randn(2, 3, dim, dtype=torch.float64)
        starts = torch.tensor([first, first + 17])
        got = Rotary(inv_freq.float()).averaged(x.float(), starts, 512).double()
        for b, start in enumerate(starts.tolist()):
            angles = (start + torch.arange(512, dtype=torch.float64))[:, None] * inv_freq
            cos, sin = (torch.cat([f(angles).mean(0)] * 2) for f in (torch.cos, torch.sin))
            half = dim // 2
            turned = torch.cat([-x[b, :, half:], x[b, :, :half]], dim=-1)
            torch.testing.assert_close(got[b], x[b] * cos + turned * sin, atol=1e-4, rtol=0)


@torch.no_grad()
def test_rolling_without_eviction_changes_nothing():
    model = _model(2)
    ids = torch.randint(0, 101, (2, 30))
    plain = model(ids, cache=kvsieve.make_cache(model, "full")).logits
    rolled = model(ids, cache=kvsieve.make_cache(model, "full", rolling=True)).logits
    torch.testing.assert_close(rolled, plain, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rolling_streaming_llm_sees_kept_tokens_at_consecutive_positions():
    # One layer: each token's K/V depends on the token alone, so the rolled cache must give, for the last token,
    # exactly the logits of a fresh forward over [sinks + recent window + token] at positions 0..12.
    model = _model(1)
    ids = torch.randint(0, 101, (1, 40))
    cache = kvsieve.make_cache(model, "streaming_llm", 12, sink=2, rolling=True, stream=True)
    logits = model(ids, cache=cache).logits
    kept = [0, 1, *range(29, 40)]  # before token 39: 2 sinks + tokens 29..38; then token 39 itself
    ref = model(ids[:, kept], cache=DynamicCache()).logits
    torch.testing.assert_close(logits[:, -1], ref[:, -1], atol=1e-5, rtol=1e-5)
    # Without rolling the positions differ, and so do the logits.
    plain = kvsieve.make_cache(model, "streaming_llm", 12, sink=2, stream=True)
    assert not torch.allclose(model(ids, cache=plain).logits[:, -1], ref[:, -1], atol=1e-3)


@torch.no_grad()
def test_rolling_streams_past_max_position_embeddings():
    model = _model(2)
    ids = torch.randint(0, 101, (1, 200))  # > max_position_embeddings = 64
    cache = kvsieve.make_cache(model, "h2o", 16, rolling=True, stream=True)
    logits = model(ids, cache=cache).logits
    assert torch.isfinite(logits).all()
    assert max(cache.slot_counts()) <= 16
    assert cache.rolling


def test_rolling_rejects_models_with_several_rotary_embeddings_and_late_enabling():
    model = _model(1)
    cache = kvsieve.make_cache(model, "local", 8)
    with torch.no_grad():
        model(torch.randint(0, 101, (1, 4)), cache=cache)
    with pytest.raises(ValueError, match="before the cache is used"):
        cache.enable_rolling(Rotary.from_config(model.config))
    model.config.rope_parameters = {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e4}}
    with pytest.raises(kvsieve.UnsupportedModelError, match="one rotary embedding"):
        Rotary.from_config(model.config)
