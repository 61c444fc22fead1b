"""topk_oracle equals an eager attention masked to the top-k logits of each query, keeps every token, and needs a
budget."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from policy_runs import reference_mask
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import kvsieve
from kvsieve.policies import REGISTRY


def _topk_attention(k: int):
    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        logits = (query @ keys.transpose(-1, -2) * scaling).masked_fill(~attention_mask, float("-inf"))
        top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
        keep = torch.zeros_like(attention_mask.expand_as(logits)).scatter(-1, top, True) & attention_mask
        out = F.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1) @ values
        return out.transpose(1, 2), None

    return attention


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
    assert not torch.allclose(logits, full, atol=1e-2)  # the narrowing really changes the attention


def test_topk_oracle_needs_a_budget(llama_gqa) -> None:
    with pytest.raises(ValueError, match="topk_oracle: budget must be a positive number"):
        kvsieve.make_cache(llama_gqa, "topk_oracle", None)
