"""Every generation mode of transformers with a kvsieve-attention model: other caches behave as before
``make_cache``, assisted generation and prompt lookup give plain greedy decoding's tokens under eviction (crop
rolls a rejected draft back exactly, and a deferred stop check's extra step), attention weights, stop strings,
several sequences per prompt, misuse."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    QuantizedCache,
    StaticCache,
)
from transformers.cache_utils import SlidingWindowCache

import kvsieve
from kvsieve.engine.layer import SieveLayer
from kvsieve.policies import REGISTRY

NEW = 12


def _sdpa(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``model`` that runs transformers' sdpa, as a model does before any kvsieve cache."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("sdpa")
    return model


def _greedy(model: PreTrainedModel, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)[:, ids.shape[1] :]


def _caches(model: PreTrainedModel) -> dict[str, Any]:
    """Every cache class of transformers (fresh for each generate call), by name."""
    config = model.config
    caches = {
        "dynamic": lambda: {"cache": DynamicCache(config=config)},
        "static": lambda: {"cache": StaticCache(config=config, max_cache_len=64)},
        "static-by-name": lambda: {"cache_implementation": "static"},
        "sliding-window": lambda: {"cache": SlidingWindowCache(config=config, max_cache_len=64)},
        "quantized-fp8": lambda: {"cache": QuantizedCache(backend="fp8", config=config)},
    }
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        del caches["quantized-fp8"]  # (transformers quantizes models with full attention layers only)
    return caches


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3"])
def test_every_other_cache_behaves_as_before_make_cache(name, request, make_ids) -> None:
    model = _sdpa(request.getfixturevalue(name))
    ids = make_ids(2, 10)
    before = {cache: _greedy(model, ids, **make()) for cache, make in _caches(model).items()}
    kvsieve.make_cache(model, "h2o", 4)
    assert model.config._attn_implementation == "kvsieve"
    for cache, make in _caches(model).items():
        assert torch.equal(_greedy(model, ids, **make()), before[cache]), cache


@pytest.mark.slow
def test_quanto_quantized_cache_behaves_as_before_make_cache(llama_gqa, make_ids) -> None:
    """optimum-quanto's QuantizedCache (its kernels compile on first use: slow once)."""
    model = _sdpa(llama_gqa)
    ids = make_ids(2, 10)

    def quanto() -> dict[str, Any]:
        cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=16, residual_length=4)
        return {"cache": cache}

    before = _greedy(model, ids, **quanto())
    kvsieve.make_cache(model, "h2o", 4)
    assert torch.equal(_greedy(model, ids, **quanto()), before)


@pytest.fixture(scope="module")
def assistant() -> PreTrainedModel:
    """Another tiny random Llama with the tiny vocabulary: its drafts are often rejected."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(7)
    return LlamaForCausalLM(config).float().eval()


@pytest.fixture
def count_rollbacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens each ``SieveLayer.crop`` call of layer 0 removed (0 = a commit)."""
    removed: list[int] = []
    crop = SieveLayer.crop

    def spy(self: SieveLayer, tokens_to_remove: int) -> None:
        if self.layer_idx == 0:
            removed.append(-tokens_to_remove)
        crop(self, tokens_to_remove)

    monkeypatch.setattr(SieveLayer, "crop", spy)
    return removed


@pytest.mark.parametrize("policy", [name for name, cls in REGISTRY.items() if not cls.probed])  # (kvzip: refused)
@pytest.mark.parametrize("mode", ["assistant", "prompt-lookup"])
def test_assisted_generation_gives_plain_greedy_tokens(
    policy, mode, llama_gqa, gemma3, assistant, make_ids, count_rollbacks
) -> None:
    """Greedy assisted decoding is lossless: with an evicting cache too, token for token (rejected drafts are
    rolled back, with what their steps evicted)."""
    # A prompt that repeats itself, so that prompt lookup finds drafts.
    ids = make_ids(1, 8).repeat(1, 3)
    budget = 6 if REGISTRY[policy].takes_budget() else None
    for model in (llama_gqa, gemma3):
        plain = _greedy(model, ids, cache=kvsieve.make_cache(model, policy, budget))
        cache = kvsieve.make_cache(model, policy, budget)
        cache.set_prompt_length(ids.shape[1])
        extra = {"assistant_model": assistant} if mode == "assistant" else {"prompt_lookup_num_tokens": 3}
        assert torch.equal(_greedy(model, ids, cache=cache, **extra), plain)
        if REGISTRY[policy].bounded:  # (Gemma's sliding layers keep their window)
            assert all(
                n <= budget for n, layer in zip(cache.slot_counts(), cache.layers, strict=True) if not layer.is_sliding
            )
    assert any(count_rollbacks), "no draft was rejected: the rollback was not exercised"


@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "streaming_llm", "snapkv"])
@pytest.mark.parametrize("residual", [0, 3])
def test_assisted_generation_with_quantized_slots_gives_plain_greedy_tokens(
    policy, residual, llama_gqa, assistant, make_ids, count_rollbacks
) -> None:
    """The same with 4-bit slots: a rejected draft's rollback restores the codes and the exact residual ring too."""
    ids = make_ids(1, 8).repeat(1, 3)
    quant = {"kv_bits": 4, "group_size": 8, "residual": residual}
    plain = _greedy(llama_gqa, ids, cache=kvsieve.make_cache(llama_gqa, policy, 6, **quant))
    for extra in ({"assistant_model": assistant}, {"prompt_lookup_num_tokens": 3}):
        cache = kvsieve.make_cache(llama_gqa, policy, 6, **quant)
        cache.set_prompt_length(ids.shape[1])
        assert torch.equal(_greedy(llama_gqa, ids, cache=cache, **extra), plain)
    assert any(count_rollbacks), "no draft was rejected: the rollback was not exercised"


def test_assisted_generation_needs_to_know_where_the_prompt_ends(llama_gqa, make_ids, assistant) -> None:
    ids = make_ids(1, 10)
    with pytest.raises(ValueError, match=r"call cache.set_prompt_length\(input_ids.shape\[1\]\)"):
        _greedy(llama_gqa, ids, cache=kvsieve.make_cache(llama_gqa, "h2o", 4), assistant_model=assistant)
    with pytest.raises(ValueError, match=r"call cache.set_prompt_length"):  # (any policy: drafts are rolled back)
        _greedy(llama_gqa, ids, cache=kvsieve.make_cache(llama_gqa, "full", None), prompt_lookup_num_tokens=2)
    cache = kvsieve.make_cache(llama_gqa, "h2o", 4)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="the prompt length must be a positive int"):
            cache.set_prompt_length(bad)


def _state(cache: kvsieve.SieveCache) -> list[tuple[torch.Tensor, ...]]:
    """Everything a cache holds, per layer: positions, keys, values and policy state of the held tokens."""
    out = []
    for i, layer in enumerate(cache.layers):
        store = layer.store
        order = store.positions[:, :, : store.used].argsort(dim=-1)
        held = [*store.kv.values(), *store.state.values()]
        out.append(
            (cache.positions(i).sort(dim=-1).values, *(t[:, :, : store.used].gather(2, _wide(order, t)) for t in held))
        )
        out[-1] = (*out[-1], torch.tensor([layer.get_seq_length()]))
    return out


def _wide(index: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return index.view(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])


@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "streaming_llm", "knorm", "ahakv"])
def test_crop_rolls_back_exactly_what_was_fed_since_recording(policy, llama_gqa, make_ids) -> None:
    prompt, more = make_ids(2, 9), make_ids(2, 5, seed=3)
    reference = kvsieve.make_cache(llama_gqa, policy, 5)
    with torch.inference_mode():
        llama_gqa(prompt, cache=reference)
        for t in range(2):  # the two tokens that stay, fed as plain decode steps
            llama_gqa(more[:, t : t + 1], cache=reference)
        cache = kvsieve.make_cache(llama_gqa, policy, 5)
        llama_gqa(prompt, cache=cache)
        cache.activate_past_recording()
        llama_gqa(more[:, :3], cache=cache)  # two steps' worth of tokens, then a third...
        llama_gqa(more[:, 3:], cache=cache)  # ...and two more, without a crop in between
        cache.crop(-3)
    for held, expected in zip(_state(cache), _state(reference), strict=True):
        for a, b in zip(held, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # (projections of 3 tokens vs 1: float noise)
    with torch.inference_mode():  # and the cache goes on as the reference does
        torch.testing.assert_close(
            llama_gqa(more[:, 2:3], cache=cache).logits,
            llama_gqa(more[:, 2:3], cache=reference).logits,
        )


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "snapkv"])
def test_a_deferred_stop_check_undoes_its_extra_step(policy, llama_gqa, make_ids) -> None:
    """What transformers' deferred stop check (on mps, since 5.25) does to a cache it returns: past recording with
    its options after the prompt, ``crop(0)`` after each step, one step too many, ``crop(-1)``, ``record_past``
    switched off. The cache then holds what plain decoding holds, and goes on as it does."""
    prompt, steps = make_ids(2, 9), make_ids(2, 5, seed=3)
    reference, cache = kvsieve.make_cache(llama_gqa, policy, 5), kvsieve.make_cache(llama_gqa, policy, 5)
    with torch.inference_mode():
        llama_gqa(prompt, cache=reference)
        for t in range(4):
            llama_gqa(steps[:, t : t + 1], cache=reference)
        llama_gqa(prompt, cache=cache)
        cache.activate_past_recording(recurrent_states_to_keep=1)
        for t in range(5):  # (the fifth: the step the check reports its stop one step late after)
            llama_gqa(steps[:, t : t + 1], cache=cache)
            if t < 4:
                cache.crop(0)
        cache.crop(-1)
        for layer in cache.layers:
            layer.record_past = False
    for held, expected in zip(_state(cache), _state(reference), strict=True):
        for a, b in zip(held, expected, strict=True):
            torch.testing.assert_close(a, b)
    with torch.inference_mode():
        torch.testing.assert_close(
            llama_gqa(steps[:, 4:], cache=cache).logits, llama_gqa(steps[:, 4:], cache=reference).logits
        )


def test_crop_refuses_what_it_cannot_roll_back(llama_gqa, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "h2o", 4)
    with torch.inference_mode():
        llama_gqa(make_ids(1, 6), cache=cache)
        with pytest.raises(ValueError, match="pass minus the number of tokens to remove"):
            cache.crop(3)
        cache.crop(0)  # nothing recorded: nothing to commit
        with pytest.raises(ValueError, match="rolls back only the 0 token"):
            cache.crop(-1)
        cache.activate_past_recording()
        llama_gqa(make_ids(1, 2), cache=cache)
        with pytest.raises(ValueError, match="rolls back only the 2 token"):
            cache.crop(-3)
        cache.crop(-2)
    assert cache.get_seq_length() == 6
    fresh = kvsieve.make_cache(llama_gqa, "h2o", 4)
    fresh.set_prompt_length(6)
    fresh.activate_past_recording()
    with torch.inference_mode():
        llama_gqa(make_ids(1, 8), cache=fresh)
    with pytest.raises(ValueError, match="rolls back only the 2 token"):
        fresh.crop(-3)
    fresh.crop(-2)
    assert fresh.get_seq_length() == 6


def test_output_attentions_are_the_kept_tokens_attention_by_column(llama_gqa, make_ids) -> None:
    ids = make_ids(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    eager = copy.deepcopy(llama_gqa)
    eager.set_attn_implementation("eager")
    with torch.inference_mode():
        expected = eager(ids, attention_mask=mask, output_attentions=True).attentions
        got = llama_gqa(
            ids,
            attention_mask=mask,
            cache=kvsieve.make_cache(llama_gqa, "full", None),
            output_attentions=True,
        ).attentions
    real = mask.bool()
    for a, b in zip(got, expected, strict=True):  # (padding queries' rows are not compared: never used)
        torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=1e-6, rtol=1e-5)
    cache = kvsieve.make_cache(llama_gqa, "h2o", 4)
    with torch.inference_mode():
        llama_gqa(ids, attention_mask=mask, cache=cache)
        held = [cache.positions(i).clone() for i in range(3)]
        step = llama_gqa(
            make_ids(2, 1, seed=5),
            attention_mask=torch.cat([mask, mask.new_ones(2, 1)], dim=1),
            cache=cache,
            output_attentions=True,
        ).attentions
    for layer, weights in enumerate(step):
        assert weights.shape == (2, 4, 1, 10)
        torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2, 4, 1))
        for row, pad in enumerate((0, 2)):
            for head in range(4):
                columns = {*(held[layer][row, head // 2] + pad).tolist(), 9}  # the kept tokens and the new one
                nonzero = set(weights[row, head, 0].nonzero().flatten().tolist())
                assert nonzero <= columns


def test_generate_passes_stop_strings_and_counts_prompts_per_sequence(tiny_factory, tokenizer) -> None:
    model = tiny_factory("llama_gqa", vocab=len(tokenizer))
    prompt = "The history of the city begins with"
    plain = kvsieve.generate(model, tokenizer, prompt, policy="h2o", budget=4, max_new_tokens=12)
    stop = plain.text[len(plain.text) // 2 :][:3]
    stopped = kvsieve.generate(model, tokenizer, prompt, policy="h2o", budget=4, max_new_tokens=12, stop_strings=[stop])
    assert stopped.text.endswith(stop) or stop in stopped.text
    assert len(stopped.text) < len(plain.text)
    several = kvsieve.generate(
        model, tokenizer, [prompt, "Hi"], policy="h2o", budget=4, max_new_tokens=4, do_sample=True,
        num_return_sequences=3,
    )  # fmt: skip
    assert several.prompt_tokens == [len(tokenizer(prompt).input_ids)] * 3 + [len(tokenizer("Hi").input_ids)] * 3
    assert len(several.texts) == len(several.generated_tokens) == 6
    for name in ("cache", "past_key_values"):  # (its name before transformers 5.24)
        with pytest.raises(ValueError, match=rf"kvsieve\.generate sets {name} itself"):
            kvsieve.generate(model, tokenizer, prompt, **{name: DynamicCache()})


def test_a_cache_serves_one_model(llama_gqa, make_ids, tiny_factory) -> None:
    cache = kvsieve.make_cache(llama_gqa, "h2o", 4)
    config = copy.deepcopy(llama_gqa.config)
    config.num_hidden_layers = 4
    deeper = LlamaForCausalLM._from_config(config, attn_implementation="kvsieve").eval()
    with pytest.raises(ValueError, match="made for a model of 3 layers, not 4"), torch.inference_mode():
        deeper(make_ids(1, 5), cache=cache)
    assert cache.get_seq_length() == 0  # refused at the first layer: nothing cached
    cache = kvsieve.make_cache(llama_gqa, "h2o", 4)
    with torch.inference_mode():
        llama_gqa(make_ids(1, 5), cache=cache)
    mha = tiny_factory("llama_mha")
    with pytest.raises(ValueError, match="holds 2 KV heads of dim 16, the model gives 4"), torch.inference_mode():
        mha(make_ids(1, 1), cache=cache)


def test_generated_counts_each_row_up_to_its_first_eos(tiny_lm) -> None:
    from kvsieve.api import generated

    model, tokenizer = tiny_lm
    words = tokenizer(" river town", add_special_tokens=False).input_ids
    pad = tokenizer.pad_token_id
    out = torch.tensor([[7, 7, *words, 2, pad, pad], [7, 7, *words, words[0], 2, 2], [7, 7, *words, words[0], 5, 6]])
    texts, lengths = generated(model, tokenizer, out, prompt_length=2, eos_token_id=2)
    assert lengths == [len(words) + 1, len(words) + 2, len(words) + 3]  # (the EOS counted, padding after it not)
    assert texts[0] == tokenizer.decode(words, skip_special_tokens=True)
    assert generated(model, tokenizer, out, 2, eos_token_id=[5, 2])[1][2] == len(words) + 2
