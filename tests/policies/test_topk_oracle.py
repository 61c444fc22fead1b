"""topk_oracle equals an eager attention whose queries see their own step's tokens and the top-k logits of the
earlier ones, keeps every token, shares a prompt pass, and needs a budget and no decode budget."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from policy_runs import reference_mask
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import kvsieve
from kvsieve.engine.shared import SharedPrompt
from kvsieve.policies import REGISTRY


def _topk_attention(k: int):
    """Eager attention: each query sees its step's tokens (causally) and its top ``k`` keys of the earlier steps."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        logits = (query @ keys.transpose(-1, -2) * scaling).masked_fill(~attention_mask, float("-inf"))
        earlier = logits.shape[-1] - query.shape[2]
        past = logits[..., :earlier]
        top = past.topk(min(k, earlier), dim=-1).indices
        chosen = torch.zeros_like(past, dtype=torch.bool).scatter(-1, top, True)
        keep = torch.cat([chosen, torch.ones_like(logits[..., earlier:], dtype=torch.bool)], dim=-1)
        out = F.softmax(logits.masked_fill(~(keep & attention_mask), float("-inf")), dim=-1) @ values
        return out.transpose(1, 2), None

    return attention


def _feed(model, cache, steps: list[torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(ids, cache=cache, use_cache=True).logits.float() for ids in steps], dim=1)


@pytest.mark.parametrize("k", [5, 14])  # (14: over half the keys of every row but the first few; found as the rest)
def test_topk_oracle_equals_masked_eager_attention_and_keeps_everything(llama_gqa, stream, make_ids, k) -> None:
    prompt, steps = make_ids(2, 16), 8
    AttentionInterface.register("topk_ref", _topk_attention(k))
    AttentionMaskInterface.register("topk_ref", reference_mask)
    ref_model = copy.deepcopy(llama_gqa)  # (its own copy: the attention implementation changes)
    ref_model.set_attn_implementation("topk_ref")
    reference = stream(ref_model, DynamicCache(config=ref_model.config), prompt, steps)
    cache = kvsieve.make_cache(llama_gqa, "topk_oracle", k)
    logits = stream(llama_gqa, cache, prompt, steps)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    assert cache.slot_counts() == [16 + steps] * len(cache.layers)
    assert cache.layers[0].policy.budget == k and not REGISTRY["topk_oracle"].bounded
    full = stream(llama_gqa, kvsieve.make_cache(llama_gqa, "full"), prompt, steps)
    torch.testing.assert_close(logits[:, :16], full[:, :16], atol=1e-5, rtol=0)  # (a prompt: nothing earlier)
    assert not torch.allclose(logits, full, atol=1e-2)  # the narrowing really changes the attention
    # A step of several tokens over a cache that holds some: its own tokens in full, the earlier ones narrowed.
    feeds = [make_ids(2, 16), make_ids(2, 6, seed=2), make_ids(2, 1, seed=3)]
    reference = _feed(ref_model, DynamicCache(config=ref_model.config), feeds)
    torch.testing.assert_close(
        _feed(llama_gqa, kvsieve.make_cache(llama_gqa, "topk_oracle", k), feeds), reference, atol=1e-4, rtol=0
    )


def test_a_shared_prompt_fills_topk_oracle_as_its_own_pass(llama_gqa, make_ids) -> None:
    """A prompt is not narrowed: a shared pass leaves topk_oracle's cache as its own pass does, decode and all."""
    prompt, nxt = make_ids(2, 16), make_ids(2, 1, seed=2)
    alone, shared = (kvsieve.make_cache(llama_gqa, "topk_oracle", 5) for _ in range(2))
    with torch.inference_mode():
        want = [llama_gqa(ids, cache=alone, use_cache=True).logits for ids in (prompt, nxt)]
        got = [llama_gqa(prompt, cache=SharedPrompt([shared, kvsieve.make_cache(llama_gqa, "h2o", 6)])).logits]
        got.append(llama_gqa(nxt, cache=shared, use_cache=True).logits)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_topk_oracle_takes_no_decode_budget(llama_gqa) -> None:
    with pytest.raises(ValueError, match="topk_oracle takes no decode_budget"):
        kvsieve.make_cache(llama_gqa, "topk_oracle", 5, decode_budget=None)


def test_topk_oracle_needs_a_budget(llama_gqa) -> None:
    with pytest.raises(ValueError, match="topk_oracle: budget must be a positive number"):
        kvsieve.make_cache(llama_gqa, "topk_oracle", None)
