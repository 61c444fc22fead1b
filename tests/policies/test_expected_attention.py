"""Expected Attention against its formula applied literally: the queries before RoPE read from the model's query
projection, the rotation averaged as matrices, the expectation summed key by key in float64."""

from __future__ import annotations

import math

import pytest
import torch

import kvsieve


def _rotation(pos: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """The ``[D, D]`` RoPE matrix at ``pos`` (``x·cos + rotate_half(x)·sin``)."""
    half = inv_freq.shape[0]
    angles = pos * inv_freq.double()
    cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
    rotate_half = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    rotate_half[:half, half:] = -torch.eye(half, dtype=torch.float64)
    rotate_half[half:, :half] = torch.eye(half, dtype=torch.float64)
    return torch.diag(cos) + torch.diag(sin) @ rotate_half


def _expected_kept(model, ids, budget, future, sinks) -> list[torch.Tensor]:
    """Per layer ``[B, Hkv, budget]``: the positions Expected Attention keeps of a prompt, computed literally."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    captured = {}
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out))
        for i, layer in enumerate(model.model.layers)
    ]
    full = kvsieve.make_cache(model, "full")
    try:
        with torch.inference_mode():
            model(input_ids=ids, cache=full, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    inv_freq = model.model.rotary_emb.inv_freq
    n = ids.shape[1]
    average = sum(_rotation(t, inv_freq) for t in range(n, n + future)) / future
    scaling = dim**-0.5
    kept = []
    for i, layer in enumerate(full.layers):
        plain = captured[i].double().view(ids.shape[0], n, heads, dim)[:, sinks:] * scaling  # [B, n', Hq, D]
        keys, values = layer.keys[:, :, :n].double(), layer.values[:, :, :n].double()
        scores = torch.zeros(ids.shape[0], kv_heads, n, dtype=torch.float64)
        for b in range(ids.shape[0]):
            for h in range(heads):
                x = plain[b, :, h]
                mean, centered = x.mean(0), x - x.mean(0)
                cov = centered.T @ centered / x.shape[0]
                mu, sigma = average @ mean, average @ cov @ average.T
                k = keys[b, h // (heads // kv_heads)]
                logits = torch.stack([k[j] @ mu + 0.5 * k[j] @ sigma @ k[j] for j in range(n)])
                scores[b, h // (heads // kv_heads)] += logits.softmax(0) / (heads // kv_heads)
        scores = scores * values.norm(dim=-1)
        scores[..., :sinks] = math.inf
        kept.append(scores.topk(budget, dim=-1).indices.sort(dim=-1).values)
    return kept


@pytest.mark.parametrize(("future", "sinks"), [(512, 4), (7, 0)])
def test_expected_attention_keeps_the_tokens_of_the_formula(llama_gqa, make_ids, future, sinks) -> None:
    ids, budget = make_ids(2, 24), 9
    expected = _expected_kept(llama_gqa, ids, budget, future, sinks)
    cache = kvsieve.make_cache(llama_gqa, "expected_attention", budget, future=future, sinks=sinks)
    with torch.inference_mode():
        llama_gqa(input_ids=ids, cache=cache, use_cache=True)
    for layer, kept in zip(cache.layers, expected, strict=True):
        assert torch.equal(layer.held_positions().sort(dim=-1).values, kept)


def test_expected_attention_is_refused_where_it_cannot_read_positions(llama_gqa) -> None:
    with pytest.raises(ValueError, match="no position rolling"):
        kvsieve.make_cache(llama_gqa, "expected_attention", 8, rolling=True)
    with pytest.raises(ValueError, match="sinks must be in"):
        kvsieve.make_cache(llama_gqa, "expected_attention", 4).resolve(20)
    for epsilon in ("nan", "inf", "-1"):
        with pytest.raises(ValueError, match="epsilon must be a finite number >= 0"):
            kvsieve.make_cache(llama_gqa, f"expected_attention:epsilon={epsilon}", 8).resolve(20)
