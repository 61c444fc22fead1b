"""Quantized slots (:mod:`kvsieve.engine.quant`): the codes, the bytes, exactness against references, every path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsieve
from kvsieve.engine.quant import KVQuant, dequantize, kv_quant, quantize, recent
from kvsieve.policies import REGISTRY, Policy, Slots


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    groups=st.integers(1, 4),
    group=st.sampled_from([4, 8, 16]),
    spread=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_is_within_half_a_step(bits, groups, group, spread, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn((2, 3, 5, groups * group), generator=gen) * spread).float()
    x[0, 0, 0] = 7.0  # a constant vector: the scale floored
    codes, scale, zero = quantize(x, bits, group)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == groups * group * bits // 8
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape[-1] == groups
    back = dequantize(codes, scale, zero, bits, torch.float32)
    step = scale.float().repeat_interleave(group, dim=-1)
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-6 * x.abs()).all()
    assert (back[0, 0, 0] - 7).abs().max() < 1e-2


def test_codes_use_every_level_and_pack_in_order() -> None:
    x = torch.arange(16, dtype=torch.float32).view(1, 1, 1, 16)
    codes, scale, zero = quantize(x, 4, 16)
    assert -1e-3 < zero.item() <= 0 and 1 <= scale.item() < 1.002  # (rounded down and up to float16)
    assert codes.flatten().tolist() == [i | (i + 8) << 4 for i in range(8)]  # planar, the first in the low bits


def _plain_reference(model, ids, policy, budget, residual, bits, group):
    """Token by token through a plain (float64) cache whose tokens are replaced by their quantize → dequantize round
    trip once they are ``residual`` positions old: what quantized slots must compute."""
    cache = kvsieve.make_cache(model, policy, budget)
    logits = []
    with torch.inference_mode():
        for t in range(ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], cache=cache).logits)
            aged = t + 1 - residual  # the next query reads the token at `aged` dequantized
            if aged < 0:
                continue
            for layer in cache.layers:
                store = layer.store
                at = (store.positions[:, :, : store.used] == aged)[..., None]
                for name in ("keys", "values"):
                    held = store.kv[name][:, :, : store.used]
                    back = dequantize(*quantize(held, bits, group), bits, held.dtype)
                    held.copy_(torch.where(at, back, held))
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("policy", ["full", "h2o", "streaming_llm", "knorm"])
@pytest.mark.parametrize(("bits", "residual"), [(4, 1), (2, 5), (8, 3)])
def test_quantized_slots_equal_the_round_tripped_reference(tiny_models, make_ids, policy, bits, residual) -> None:
    model = tiny_models("llama_gqa", torch.float64)
    ids = make_ids(2, 40)
    expected = _plain_reference(model, ids, policy, 12, residual, bits, 8)
    cache = kvsieve.make_cache(model, policy, 12, kv_bits=bits, group_size=8, residual=residual)
    with torch.inference_mode():
        got = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(ids.shape[1])], 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("policy", sorted(name for name, cls in REGISTRY.items() if not cls.probed))
def test_one_pass_streaming_equals_token_by_token(tiny_models, make_ids, policy) -> None:
    whole, steps = _whole_and_steps(tiny_models("llama_gqa", torch.float64), make_ids(2, 48), policy, bits=4)
    torch.testing.assert_close(whole[0], steps[0], rtol=0, atol=1e-10)
    for a, b in zip(whole[1], steps[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("bits", "residual"), [(4, 4), (2, 1)])
def test_a_prompt_then_single_tokens_equals_token_by_token(tiny_models, make_ids, bits, residual) -> None:
    """Without eviction, a prompt in one pass and single tokens after it read what token-by-token feeding reads: the
    prompt's tokens coded at once, the single tokens' codes deferred (Residual.coded) and made from the ring."""
    model, ids = tiny_models("llama_gqa", torch.float64), make_ids(2, 50)

    def run(prompt: int) -> torch.Tensor:
        cache = kvsieve.make_cache(model, "full", None, kv_bits=bits, group_size=8, residual=residual)
        with torch.inference_mode():
            out = [model(ids[:, :prompt], cache=cache).logits]
            out += [model(ids[:, t : t + 1], cache=cache).logits for t in range(prompt, ids.shape[1])]
        return torch.cat(out, dim=1)

    torch.testing.assert_close(run(30), run(1), rtol=0, atol=1e-10)


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o"])
def test_rolled_positions_stream_exactly(tiny_models, make_ids, policy) -> None:
    whole, steps = _whole_and_steps(tiny_models("llama_gqa", torch.float64), make_ids(2, 40), policy, 4, rolling=True)
    torch.testing.assert_close(whole[0], steps[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_sliding_window_layers_stream_exactly(tiny_models, make_ids, policy) -> None:
    whole, steps = _whole_and_steps(tiny_models("gemma3", torch.float64), make_ids(2, 40), policy, 4)
    torch.testing.assert_close(whole[0], steps[0], rtol=0, atol=1e-10)


class _ValueNorm(Policy):
    """Keeps the tokens whose values have the lowest norm (ties, e.g. one token id at two positions in the first
    layer, to the newest): reads ``slots.values`` at every eviction."""

    name = "value_norm"

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        return slots.pos * 1e-6 - slots.values.norm(dim=-1)


def test_a_policy_reading_slot_values_must_declare_it(tiny_models, make_ids, monkeypatch) -> None:
    """``Policy.reads_kv``: a scan over quantized slots gives a policy that does not declare it the slots dequantized
    only (not the residual's exact copies), so its decisions differ from token by token."""
    model, ids = tiny_models("llama_gqa", torch.float64), make_ids(2, 48)
    monkeypatch.setattr(_ValueNorm, "reads_kv", True)
    whole, steps = _whole_and_steps(model, ids, _ValueNorm, bits=2)
    torch.testing.assert_close(whole[0], steps[0], rtol=0, atol=1e-10)
    monkeypatch.setattr(_ValueNorm, "reads_kv", False)
    whole, steps = _whole_and_steps(model, ids, _ValueNorm, bits=2)
    assert not all(torch.equal(a, b) for a, b in zip(whole[1], steps[1], strict=True))


def _whole_and_steps(model, ids, policy, bits, rolling=False):
    """(logits, kept positions per layer) of one-pass streaming and of token-by-token feeding."""

    def run(stream: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cache = kvsieve.make_cache(
            model, policy, 14, kv_bits=bits, group_size=8, residual=6, stream=stream, rolling=rolling
        )
        with torch.inference_mode():
            if stream:
                logits = model(ids, cache=cache).logits
            else:
                steps = range(ids.shape[1])
                logits = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in steps], 1)
        return logits, [layer.held_positions().sort(dim=-1).values for layer in cache.layers]

    return run(True), run(False)


@pytest.mark.parametrize("model_name", ["llama_mha", "gemma3"])
def test_prompt_then_decode_with_padding_matches_unpadded_rows(tiny_models, make_ids, model_name) -> None:
    """A left-padded batch decodes each row as it would alone (quantized slots hold padding, then evict it)."""
    model = tiny_models(model_name, torch.float64)
    long, short = make_ids(1, 30, seed=3), make_ids(1, 22, seed=4)
    batch = torch.cat([long, torch.cat([torch.zeros((1, 8), dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :8] = 0

    def decode(ids, attention_mask, steps=12):
        cache = kvsieve.make_cache(model, "h2o", 16, kv_bits=4, group_size=8, residual=4)
        out = []
        with torch.inference_mode():
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            out.append(model(ids, attention_mask=attention_mask, position_ids=positions, cache=cache).logits)
            for i in range(steps):
                nxt = torch.full((ids.shape[0], 1), 5 + i)
                attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=1)
                positions = attention_mask.sum(-1, keepdim=True) - 1
                out.append(model(nxt, attention_mask=attention_mask, position_ids=positions, cache=cache).logits)
        out[0] = out[0][:, -1:]
        return torch.cat(out, dim=1)

    together = decode(batch, mask)
    torch.testing.assert_close(together[:1], decode(long, torch.ones_like(long)), rtol=0, atol=1e-9)
    torch.testing.assert_close(together[1:], decode(short, torch.ones_like(short)), rtol=0, atol=1e-9)


@pytest.mark.parametrize(("bits", "residual"), [(8, 0), (4, 8), (2, 16)])
def test_bytes_are_codes_scales_and_residual(tiny_models, make_ids, bits, residual) -> None:
    model = tiny_models("llama_gqa", torch.float32)
    budget, group = 20, 8
    cache = kvsieve.make_cache(model, "h2o", budget, kv_bits=bits, group_size=group, residual=residual)
    with torch.inference_mode():
        model(make_ids(2, 50), cache=cache)
        model(make_ids(2, 1, seed=9), cache=cache)
    batch, heads, dim = 2, 2, 16
    per_slot = dim * bits // 8 + 2 * (dim // group) * 2  # codes + float16 scale and zero (key and value alike)
    ring = (residual + 1) * dim * 4 if residual else 0  # exact fp32 copies (+ the padding slot)
    predicted = 2 * batch * heads * ((budget + 1) * per_slot + ring)  # keys and values; budget + the spare slot
    predicted += batch * 8 if residual else 0  # (the residual's mark: where tokens without codes begin)
    for layer in cache.layers:
        store = layer.store
        assert layer.kv_nbytes() == predicted
        held = sum(t.nbytes for t in store.kv.values()) + (0 if store.residual is None else store.residual.nbytes)
        assert held == predicted
    plain = kvsieve.make_cache(model, "h2o", budget)
    with torch.inference_mode():
        model(make_ids(2, 50), cache=plain)
    assert cache.kv_nbytes() < plain.kv_nbytes()


def test_policies_read_dequantized_slots_with_the_residual_exact(tiny_models, make_ids, monkeypatch) -> None:
    model = tiny_models("llama_gqa", torch.float64)
    seen = []  # (what the policy's own observe is handed: the torch code only)
    cache = kvsieve.make_cache(model, "ahakv", 10, kv_bits=2, group_size=8, residual=3, kernels="torch")
    layer = cache.layers[1]
    with torch.inference_mode():
        model(make_ids(1, 20), cache=cache)
        policy = layer.policy
        observe = policy.observe

        def spy(slots, obs):
            seen.append(slots)
            return observe(slots, obs)

        policy.observe = spy
        model(make_ids(1, 1, seed=5), cache=cache)
    slots = seen[-1]
    store = layer.store
    dequantized = store.codec.decode(store.kv, slots.pos.shape[-1], torch.float64)[1]
    fresh = recent(slots.pos, slots.last, 3)
    assert fresh.sum() == 3 * slots.pos.shape[1]  # the 3 newest positions, in every head
    assert torch.equal(slots.values[~fresh], dequantized[~fresh])
    assert not torch.equal(slots.values[fresh], dequantized[fresh])  # (2 bits: the exact copies differ)


def test_generation_join_and_batch_operations_keep_quantized_rows(tiny_lm) -> None:
    model, tokenizer = tiny_lm
    prompts = ["The cat sat on the mat and looked at the door.", "A long way from home, she walked."]
    together = kvsieve.generate(model, tokenizer, prompts, "h2o:kv_bits=4,group_size=8", 10, max_new_tokens=8)
    alone = [kvsieve.generate(model, tokenizer, p, "h2o:kv_bits=4,group_size=8", 10, max_new_tokens=8) for p in prompts]
    assert together.texts == [one.text for one in alone]
    beams = kvsieve.generate(model, tokenizer, prompts[0], "h2o", 10, 6, {"kv_bits": 8, "group_size": 8}, num_beams=3)
    assert beams.generated_tokens[0] > 0
    a, b = (kvsieve.make_cache(model, "h2o", 8, kv_bits=4, group_size=8) for _ in range(2))
    with torch.inference_mode():
        for cache, n in ((a, 12), (b, 15)):
            model(torch.arange(3, 3 + n)[None], cache=cache)
    a.join(b)
    assert a.layers[0].held_positions().shape[0] == 2
    plain = kvsieve.make_cache(model, "h2o", 8)
    with torch.inference_mode():
        model(torch.arange(3, 15)[None], cache=plain)
    with pytest.raises(ValueError, match="quantization"):
        plain.join(b)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_bits": 3}, "kv_bits must be one of 2, 4, 8"),
        ({"kv_bits": 4, "group_size": 12}, "does not divide the model's head dimension 16"),
        ({"kv_bits": 4, "group_size": 0}, "group_size must be an integer >= 1"),
        ({"kv_bits": 4, "residual": -1}, "residual must be an integer >= 0"),
        ({"group_size": 8}, "give kv_bits too"),
        ({"kv_bits": "four"}, "kv_bits must be an integer"),
    ],
)
def test_bad_quantization_is_refused_before_any_work(llama_gqa, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, "h2o", 8, **kwargs)


def test_spec_keys_and_arguments(llama_gqa) -> None:
    from_spec = kvsieve.make_cache(llama_gqa, "h2o:kv_bits=2,group_size=4,residual=0", 8)
    assert from_spec.codec == KVQuant(2, 4, 0) == kv_quant("2", "4", "0")
    assert kvsieve.make_cache(llama_gqa, "h2o", 8, kv_bits=8, group_size=16).codec == KVQuant(8, 16, 16)
    assert kvsieve.make_cache(llama_gqa, "h2o", 8).codec == kvsieve.make_cache(llama_gqa, "h2o:kv_bits=none", 8).codec
    with pytest.raises(ValueError, match="kv_bits given both"):
        kvsieve.make_cache(llama_gqa, "h2o:kv_bits=4", 8, kv_bits=4)


@pytest.mark.parametrize("policy", ["h2o", "ahakv", "tova", "snapkv", "streaming_llm"])
def test_padded_batch_streams_as_fed_token_by_token(tiny_models, make_ids, policy) -> None:
    """4-bit slots, a row with 5 left-padding tokens streamed over 60 tokens, then a 20-token continuation whose
    second row ends in 6 padding tokens: the scanned runs hold padding (ahakv reads the slots' values) and give the
    logits and kept positions of feeding each token alone."""
    model, ids = tiny_models("llama_gqa", torch.float64), make_ids(2, 80)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[1, -6:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def run(spans: list[slice]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cache = kvsieve.make_cache(model, policy, 14, kv_bits=4, group_size=8, residual=6, stream=True)
        with torch.inference_mode():
            logits = [
                model(
                    ids[:, span],
                    attention_mask=mask[:, : span.stop],
                    position_ids=positions[:, span],
                    cache=cache,
                ).logits
                for span in spans
            ]
        return torch.cat(logits, dim=1), [layer.held_positions().sort(dim=-1).values for layer in cache.layers]

    whole, kept = run([slice(0, 60), slice(60, 80)])
    steps, kept_steps = run([slice(t, t + 1) for t in range(80)])
    real = mask.bool()
    torch.testing.assert_close(whole[real], steps[real], rtol=0, atol=1e-10)
    for a, b in zip(kept, kept_steps, strict=True):
        assert torch.equal(a, b)
