"""KVzip: its scores and kept tokens against the reconstruction probes run literally through eager attention over a
plain ``DynamicCache``; the hold/probe contract of the engine; what is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ASKING
from transformers import DynamicCache

import kvsieve
from kvsieve.api import probe_context
from kvsieve.policies.kvzip import KVzip, KVzipParams


def _reference_scores(model, ids: torch.Tensor, probes: list[list[int]]) -> list[torch.Tensor]:
    """Per layer ``[B, Hkv, n]``: each context token's largest probability from any probe query of its group."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    context = DynamicCache(config=eager.config)
    with torch.inference_mode():
        eager(input_ids=ids, cache=context, use_cache=True)
        n, scores = ids.shape[1], None
        for probe in probes:
            out = eager(
                input_ids=torch.tensor([probe]),
                cache=copy.deepcopy(context),
                use_cache=True,
                output_attentions=True,
            )
            per_layer = []
            for att in out.attentions:  # [B, Hq, q, n + q]
                bsz, hq, q, _ = att.shape
                kv = model.config.num_key_value_heads
                per_layer.append(att[..., :n].reshape(bsz, kv, hq // kv, q, n).amax(dim=(2, 3)))
            if scores is not None:
                per_layer = [torch.maximum(a, b) for a, b in zip(scores, per_layer, strict=True)]
            scores = per_layer
    return scores


@pytest.mark.parametrize("chunk", [16, 100])
def test_kvzip_keeps_the_top_reconstruction_scores(llama_gqa, make_ids, chunk) -> None:
    ids, budget = make_ids(1, 40), 10
    probes = KVzip(budget, KVzipParams(chunk=chunk, overlap=3)).probes(ids[0].tolist(), ASKING)
    assert len(probes) == -(-40 // chunk)
    reference = _reference_scores(llama_gqa, ids, probes)
    cache = kvsieve.make_cache(llama_gqa, f"kvzip:chunk={chunk},overlap=3,layers=each", budget, decode_budget=None)
    kvsieve.compress_context(llama_gqa, cache, ids, ASKING)
    assert cache.get_seq_length() == 40 and not cache.holding
    for i, expected in enumerate(reference):
        layer = cache.layers[i]
        pos = layer.held_positions()
        assert pos.shape[-1] == budget and layer.capacity == budget + 1  # (the held context's buffers are freed)
        best = expected.topk(budget, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(pos.sort(dim=-1).values, best)
        held = layer.held_state()["score"]
        torch.testing.assert_close(held, expected.gather(-1, pos), rtol=1e-4, atol=1e-6)


def test_kvzip_shares_the_budget_among_layers_by_one_selection(llama_gqa, make_ids) -> None:
    """By default one selection over all layers: each layer keeps its share of the model's budget (the average of
    its heads' counts among the model's top scores), each head its top that many; the bytes held are those of the
    budgets, whose sum is the model's."""
    ids, budget = make_ids(2, 40), 10
    probes = [KVzip(budget).probes(row.tolist(), ASKING) for row in ids]
    reference = [torch.cat(scores) for scores in zip(*(_reference_scores(llama_gqa, ids[b : b + 1], probes[b])
                                                       for b in range(2)), strict=True)]  # fmt: skip
    cache = kvsieve.make_cache(llama_gqa, "kvzip", budget, decode_budget=None)
    kvsieve.compress_context(llama_gqa, cache, ids, ASKING)
    budgets = cache.budgets
    assert sum(budgets) == 3 * budget and len(set(budgets)) > 1
    flat = torch.cat([scores.flatten() for scores in reference])
    threshold = flat.topk(3 * budget * 2 * 2).values[-1]
    for layer, expected, tokens in zip(cache.layers, reference, budgets, strict=True):
        share = float((expected >= threshold).sum()) / 4  # (its count among the model's top, per row and head)
        assert abs(tokens - share) <= 1
        pos = layer.held_positions()
        assert pos.shape[-1] == tokens and layer.capacity == tokens + 1
        assert torch.equal(pos.sort(dim=-1).values, expected.topk(tokens, dim=-1).indices.sort(dim=-1).values)
    uniform = kvsieve.make_cache(llama_gqa, "kvzip:layers=each", budget, decode_budget=None)
    kvsieve.compress_context(llama_gqa, uniform, ids, ASKING)
    assert cache.kv_nbytes() == uniform.kv_nbytes()  # (the same slots in all: moved between layers)


def test_kvzip_selects_over_heads_and_layers_with_budgets_by_head(llama_gqa, make_ids) -> None:
    """``heads=adakv,safeguard=0``: one selection over every head of every layer. Each layer keeps its share of the
    model's top scores (rounded to whole tokens per head), its heads the layer's best that many, each (head) its own
    count in real memory."""
    ids, budget = make_ids(1, 40), 10
    reference = _reference_scores(llama_gqa, ids, KVzip(budget).probes(ids[0].tolist(), ASKING))
    cache = kvsieve.make_cache(llama_gqa, "kvzip:heads=adakv,safeguard=0", budget, decode_budget=None)
    kvsieve.compress_context(llama_gqa, cache, ids, ASKING)
    flat = torch.cat([scores.flatten() for scores in reference])
    threshold = flat.topk(3 * budget * 2).values[-1]
    uneven = False
    for layer, expected in zip(cache.layers, reference, strict=True):
        kept = layer.held_positions()[0]
        best = expected[0].flatten().topk(2 * layer.policy.budget).indices
        chosen = torch.zeros(2 * 40, dtype=torch.bool).scatter_(0, best, True).view(2, 40)
        for head in range(2):
            assert torch.equal(kept[head][kept[head] >= 0].sort().values, chosen[head].nonzero().flatten())
        assert abs(int(chosen.sum()) - int((expected >= threshold).sum())) <= 2
        uneven |= bool(chosen.sum(dim=-1).unique().numel() > 1)
    assert uneven and sum(cache.budgets) == 3 * budget


def test_kvzip_probes_quote_the_chunk_before() -> None:
    policy = KVzip(5, KVzipParams(chunk=4, overlap=2))
    probes = policy.probes(list(range(100, 110)), ASKING)
    first, second, third = probes
    assert first == [*ASKING.encode("Repeat the previous context exactly."), 6, 7, 100, 101, 102, 103]
    request = ASKING.encode("Repeat the part of the previous context exactly, starting with")
    assert second == [*request, 102, 103, 6, 7, 104, 105, 106, 107]
    assert third == [*request, 106, 107, 6, 7, 108, 109]
    assert KVzip(5, KVzipParams(chunk=4, overlap=0)).probes(list(range(8)), ASKING)[1][: len(request) + 1] == [
        *request,
        6,
    ]


def test_kvzip_batch_rows_are_scored_as_alone(llama_gqa, make_ids) -> None:
    # (each layer at the budget: a shared budget's shares are chosen over all the rows of a batch together)
    long, short = make_ids(1, 30, seed=3), make_ids(1, 22, seed=4)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 8, dtype=long.dtype), short], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    batch = kvsieve.make_cache(llama_gqa, "kvzip:chunk=12,layers=each", 8, decode_budget=None)
    kvsieve.compress_context(llama_gqa, batch, ids, ASKING, mask)
    for row, alone_ids in enumerate([long, short]):
        alone = kvsieve.make_cache(llama_gqa, "kvzip:chunk=12,layers=each", 8, decode_budget=None)
        kvsieve.compress_context(llama_gqa, alone, alone_ids, ASKING)
        for a, b in zip(batch.layers, alone.layers, strict=True):
            assert torch.equal(a.held_positions()[row].sort(-1).values, b.held_positions()[0].sort(-1).values)
            torch.testing.assert_close(
                a.held_state()["score"][row].sort(-1).values, b.held_state()["score"][0].sort(-1).values
            )


def test_a_probe_leaves_the_held_tokens_and_the_count_seen(llama_gqa, make_ids) -> None:
    ids = make_ids(1, 20)
    cache = kvsieve.make_cache(llama_gqa, "h2o", 8)
    cache.hold()
    with torch.inference_mode():
        llama_gqa(input_ids=ids, cache=cache, use_cache=True)
        before = [(layer.held_positions().clone(), layer.held_state()["score"].clone()) for layer in cache.layers]
        assert all(pos.shape[-1] == 20 for pos, _ in before)  # (held: nothing evicted)
        assert all(not score.any() for _, score in before)  # (a held prompt is not observed)
        with cache.probing():
            llama_gqa(input_ids=make_ids(1, 6, seed=9), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 20
    for layer, (pos, score) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.held_positions(), pos)
        assert (layer.held_state()["score"] > score).any()  # (the probe's attention was observed)
    cache.compress()
    assert [layer.held_positions().shape[-1] for layer in cache.layers] == [8] * 3


def test_kvzip_is_refused_where_no_probe_can_run(llama_gqa, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "kvzip", 8)
    with pytest.raises(ValueError, match=r"kvsieve\.compress_context"), torch.inference_mode():
        llama_gqa(input_ids=make_ids(1, 12), cache=cache, use_cache=True)
    cache = kvsieve.make_cache(llama_gqa, "kvzip", 8)
    with pytest.raises(ValueError, match="asking="):
        kvsieve.compress_context(llama_gqa, cache, make_ids(1, 12))
    assert cache.get_seq_length() == 0
    with pytest.raises(ValueError, match=r"call cache\.hold"), cache.probing():
        pass
    quantized = kvsieve.make_cache(llama_gqa, "kvzip", 8, kv_bits=4, group_size=8)
    with pytest.raises(ValueError, match="plain slots"):
        kvsieve.compress_context(llama_gqa, quantized, make_ids(1, 12), ASKING)
    assert quantized.get_seq_length() == 0 and not quantized.holding
    with pytest.raises(ValueError, match="overlap"):
        kvsieve.make_cache(llama_gqa, "kvzip:chunk=4,overlap=5", 8).resolve(12)


def test_one_probing_serves_the_selections_that_follow(llama_gqa, make_ids) -> None:
    """``kvzip`` and ``kvzip:heads=adakv`` observe the probes alike: a held cache of one adopts the other's probed
    state and keeps what probing it itself keeps; policies that observe otherwise cannot share it."""
    ids = make_ids(1, 40)
    probed = kvsieve.make_cache(llama_gqa, "kvzip", 10, decode_budget=None)
    kvsieve.compress_context(llama_gqa, alone := kvsieve.make_cache(llama_gqa, "kvzip:heads=adakv", 10), ids, ASKING)
    adopting = kvsieve.make_cache(llama_gqa, "kvzip:heads=adakv", 10)
    other = kvsieve.make_cache(llama_gqa, "kvzip:chunk=16", 10)
    for cache in (probed, adopting, other):
        cache.hold()
        with torch.inference_mode():
            llama_gqa(input_ids=ids, cache=cache, use_cache=True)
    probe_context(llama_gqa, probed, ids, ASKING)
    with torch.inference_mode():
        adopting.adopt_state(probed)
        with pytest.raises(ValueError, match="observe alike"):
            other.adopt_state(probed)
        adopting.compress()
    for mine, theirs in zip(adopting.layers, alone.layers, strict=True):
        assert torch.equal(mine.store.counts, theirs.store.counts)
        assert torch.equal(mine.held_positions(), theirs.held_positions())
