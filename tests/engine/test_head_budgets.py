"""Budgets by head: AdaKV's shares (``heads=adakv``), each (row, KV head) at its own count in packed slots."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ASKING
from transformers import AttentionInterface, DynamicCache

import kvsieve
from kvsieve import make_cache
from kvsieve.policies.adakv import adakv_kept

BUDGET = 12
PROMPT = 40


def _prompts(batch: int = 2, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randint(0, 100, (batch, PROMPT))


def _generate(model, cache, ids, mask=None, new=8) -> torch.Tensor:
    mask = torch.ones_like(ids) if mask is None else mask
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("safeguard", [0.0, 0.2, 1.0])
def test_adakv_selection_is_the_papers(safeguard):
    """Each head keeps its ``max(1, ⌊α · keep⌋)`` best slots; the rest of the row's ``H · keep`` are the best over
    all heads: every other kept slot scores at least every slot left."""
    torch.manual_seed(0)
    scores = torch.rand(3, 4, 30)
    real = torch.rand(3, 4, 30) > 0.1
    real[:, :, :10] = True
    keep = torch.tensor([8, 5, 10])
    kept = adakv_kept(scores, real, keep, safeguard)
    assert not bool((kept & ~real).any())
    assert kept.sum(dim=(1, 2)).tolist() == (4 * keep).tolist()
    for b in range(3):
        safe = max(1, int(keep[b] * safeguard)) if safeguard > 0 else 0
        best = torch.where(real[b], scores[b], -1.0).topk(safe, dim=-1).indices if safe else None
        rest = kept[b].clone()
        if best is not None:
            assert bool(kept[b].gather(-1, best).all())
            rest.scatter_(-1, best, False)
        if bool(rest.any()):
            left = real[b] & ~kept[b]
            assert float(scores[b][rest].min()) >= float(scores[b][left].max())


def test_uniform_scores_keep_uniform_counts():
    """With the safeguard at 1 each head keeps exactly its own best ``keep``: the uniform rule."""
    scores = torch.rand(2, 3, 20)
    real = torch.ones(2, 3, 20, dtype=torch.bool)
    kept = adakv_kept(scores, real, torch.tensor([6, 6]), 1.0)
    assert kept.sum(dim=-1).eq(6).all()
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(-1, scores.topk(6, dim=-1).indices, True))


@pytest.mark.parametrize(
    ("model", "policy"),
    [
        ("llama_mha", "snapkv"),
        ("llama_gqa", "h2o"),
        ("llama_gqa", "expected_attention"),
        ("llama_gqa", "snapkv:kv_bits=4,group_size=8,residual=4"),
        ("llama_mha", "h2o:kv_bits=8,group_size=8"),
    ],
)
def test_full_safeguard_decodes_as_the_uniform_budget(tiny_models, model, policy):
    """``safeguard=1`` gives every head the uniform count: the packed slots (plain or quantized), their single-slot
    writes and per-head victims decode the same tokens as the uniform layout, in a left-padded batch, in as many
    bytes."""
    llm = tiny_models(model, torch.float32)
    ids = _prompts()
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    reference = make_cache(llm, policy, budget=BUDGET, kernels="torch")
    uniform = _generate(llm, reference, ids, mask)
    name, _, params = policy.partition(":")
    cache = make_cache(llm, f"{name}:heads=adakv,safeguard=1,{params}".rstrip(","), budget=BUDGET, kernels="torch")
    assert torch.equal(_generate(llm, cache, ids, mask), uniform)
    assert cache.kv_nbytes() == reference.kv_nbytes()
    assert cache.layers[0].store.layout is not None


def _held(store):
    """Positions of the tokens each (row, head) holds (the stale slot's victim left out)."""
    pos = store.positions[:, :, : store.used].clone()
    if store.stale is not None:
        pos.scatter_(2, store.stale, -1)
    return pos


def test_heads_hold_their_own_counts_in_their_own_bytes(llama_mha):
    """Under AdaKV the heads keep different counts; each layer's bytes are the sum of the (row, head) counts, plus
    one slot each for the next token, however many the largest holds; the counts hold through decoding."""
    cache = make_cache(llama_mha, "snapkv:heads=adakv,safeguard=0", budget=BUDGET, kernels="torch")
    ids = _prompts()
    _generate(llama_mha, cache, ids, new=6)
    uneven = False
    for layer in cache.layers:
        store = layer.store
        counts = store.counts
        assert counts.sum(dim=-1).tolist() == [4 * BUDGET] * 2  # (the layer's budget, shared)
        uneven |= bool((counts != BUDGET).any())
        assert torch.equal((_held(store) >= 0).sum(dim=-1), counts)
        slot = 2 * store.head_dim * store.dtype.itemsize
        assert store.kv["keys"].shape[0] == int((counts + 1).sum())
        assert layer.kv_nbytes() == int((counts + 1).sum()) * slot
        assert layer.kv_nbytes() < 2 * 4 * (int(counts.max()) + 1) * slot  # (not heads × the largest)
    assert uneven
    assert cache.kv_nbytes() == sum(layer.kv_nbytes() for layer in cache.layers)


def test_held_keys_are_the_tokens_own(llama_mha):
    """Every key a head holds, read from the packed slots, is the key of the token at its position: as a full cache
    over the same tokens has it (in the first layer; in every layer for the prompt's tokens, whose keys no eviction
    has changed yet)."""
    cache = make_cache(llama_mha, "h2o:heads=adakv", budget=BUDGET, kernels="torch")
    ids = _prompts()
    new = _generate(llama_mha, cache, ids, new=5)
    full = DynamicCache()
    with torch.no_grad():
        llama_mha(torch.cat([ids, new], dim=1), cache=full)
    for i, layer in enumerate(cache.layers):
        pos = _held(layer.store)
        keys = layer.keys
        reference = full.layers[i].keys
        real = (pos >= 0) & ((pos < PROMPT) | (i == 0))
        expected = reference.gather(2, pos.clamp(min=0)[..., None].expand_as(keys))
        assert torch.allclose(keys[real], expected[real], atol=1e-5)
        assert int(pos.max()) == PROMPT + 3  # (positions from 0; the last generated token is not fed)


def _positions_held(layer, seen: int) -> torch.Tensor:
    """``[B, H, seen]``: whether each (row, head) holds the token at each position."""
    held = layer.held_positions()
    counted = torch.zeros(*held.shape[:2], seen, dtype=torch.long).scatter_add_(
        2, held.clamp(min=0), (held >= 0).long()
    )
    return counted > 0


def _only(allowed: list[torch.Tensor]):
    """An attention function over a full cache that lets each layer's heads see only ``allowed[layer]``
    ``[B, H_kv, keys]``: the statement of attention under per-head budgets, eager and unfused."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        logits = (query @ keys.transpose(-1, -2)) * scaling
        seen = allowed[module.layer_idx].repeat_interleave(group, 1)[:, :, None, : keys.shape[2]]
        return (logits.masked_fill(~seen, float("-inf")).softmax(-1) @ values).transpose(1, 2), None

    return attention


@pytest.mark.parametrize("spec", ["snapkv:heads=adakv,safeguard=0", "h2o:heads=adakv"])
def test_each_head_attends_to_its_own_tokens(llama_gqa, spec):
    """Decode steps over the packed slots give the logits of a full cache whose heads each see only the tokens
    kvsieve holds for them (and the new token), layer by layer, in a batch."""
    ids = _prompts()
    cache = make_cache(llama_gqa, spec, budget=BUDGET, kernels="torch")
    reference = copy.deepcopy(llama_gqa)
    reference.set_attn_implementation("sdpa")
    full = DynamicCache()
    allowed: list[torch.Tensor] = []
    AttentionInterface.register("kvsieve_test_heads", _only(allowed))
    with torch.no_grad():
        llama_gqa(ids, cache=cache)
        reference(ids, cache=full)
        reference.set_attn_implementation("kvsieve_test_heads")
        for step in range(4):
            seen = PROMPT + step
            allowed[:] = [_positions_held(layer, seen + 1) for layer in cache.layers]
            for mask in allowed:
                mask[:, :, seen] = True  # (the new token)
            token = torch.tensor([[7 + step], [20 + step]])
            got = llama_gqa(token, cache=cache).logits
            want = reference(token, cache=full).logits
            assert torch.allclose(got, want, atol=1e-5), step
    assert any(bool((layer.store.counts != BUDGET).any()) for layer in cache.layers)


def test_rows_decode_as_alone(llama_mha):
    """Shares are per row: a left-padded row decodes as it does alone."""
    ids = _prompts()
    short = ids[1:, 7:]
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    spec = "snapkv:heads=adakv"
    batch = _generate(llama_mha, make_cache(llama_mha, spec, budget=BUDGET, kernels="torch"), ids, mask)
    alone = _generate(llama_mha, make_cache(llama_mha, spec, budget=BUDGET, kernels="torch"), short)
    first = _generate(llama_mha, make_cache(llama_mha, spec, budget=BUDGET, kernels="torch"), ids[:1])
    assert torch.equal(batch[1:], alone)
    assert torch.equal(batch[:1], first)


@pytest.mark.parametrize("short", [8, 12])
def test_a_row_that_fits_the_budget_shares_it_when_it_grows_past(llama_gqa, short):
    """A left-padded row whose prompt fits the budget is not compressed: each of its heads grows to the budget,
    then the row shares it, as alone; the other row's shares are its own (float64: round-off cannot decide)."""
    model = llama_gqa
    ids = _prompts()
    mask = torch.ones_like(ids)
    mask[1, : PROMPT - short] = 0
    spec = "tova:heads=adakv"
    batch_cache = make_cache(model, spec, budget=BUDGET, kernels="torch")
    batch = _generate(model, batch_cache, ids, mask, new=10)
    alone = _generate(model, make_cache(model, spec, budget=BUDGET, kernels="torch"), ids[1:, PROMPT - short :], new=10)
    assert torch.equal(batch[1:], alone)
    for layer in batch_cache.layers:
        assert int(layer.store.counts[1].sum()) == 2 * BUDGET
        assert torch.equal((_held(layer.store) >= 0).sum(dim=-1), layer.store.counts)


@pytest.mark.parametrize("growth", [4, None])
def test_each_head_grows_by_the_decode_budget(llama_mha, growth):
    """With a decode budget each (row, head) may hold its share plus the growth (``decode_budget=None``: every
    token after the prompt is kept), in packed slots of its own."""
    decode_budget = None if growth is None else BUDGET + growth
    cache = make_cache(llama_mha, "snapkv:heads=adakv", budget=BUDGET, decode_budget=decode_budget, kernels="torch")
    new = 9
    _generate(llama_mha, cache, _prompts(), new=new)
    for layer in cache.layers:
        store = layer.store
        grown = store.counts + (new - 1 if growth is None else growth)
        assert torch.equal((_held(store) >= 0).sum(dim=-1), grown)
        if growth is not None:
            assert layer.kv_nbytes() == int((grown + 1).sum()) * 2 * store.head_dim * store.dtype.itemsize


def test_a_step_of_several_tokens_repacks(llama_mha):
    """A step of several tokens after the shares (a question after a compressed context) unpacks the layer, and its
    eviction packs it again, each head back at its count."""
    cache = make_cache(llama_mha, "snapkv:heads=adakv", budget=BUDGET, kernels="torch")
    ids = _prompts()
    with torch.no_grad():
        llama_mha(ids, cache=cache)
        counts = [layer.store.counts.clone() for layer in cache.layers]
        llama_mha(_prompts(seed=2)[:, :5], cache=cache)
    for layer, before in zip(cache.layers, counts, strict=True):
        assert layer.store.layout is not None
        assert torch.equal(layer.store.counts, before)
        assert torch.equal((_held(layer.store) >= 0).sum(dim=-1), before)


@pytest.mark.parametrize("spec", ["snapkv:heads=adakv", "snapkv:heads=adakv,kv_bits=4,group_size=8,residual=4"])
def test_saved_and_restored(llama_mha, spec):
    """A saved cache whose heads keep their own counts is restored packed, and decodes the same tokens."""
    ids = _prompts()
    cache = make_cache(llama_mha, spec, budget=BUDGET, kernels="torch")
    with torch.no_grad():
        llama_mha(ids, cache=cache)
    tensors, counters = cache.export()
    restored = make_cache(llama_mha, spec, budget=BUDGET, kernels="torch")
    restored.restore(tensors, counters, PROMPT)
    assert restored.kv_nbytes() == cache.kv_nbytes()
    step = torch.full((2, 1), 5)
    with torch.no_grad():
        a = llama_mha(step, cache=cache).logits
        b = llama_mha(step, cache=restored).logits
    assert torch.allclose(a, b, atol=1e-5)
    for mine, theirs in zip(cache.layers, restored.layers, strict=True):
        assert torch.equal(mine.store.counts, theirs.store.counts)


@pytest.mark.parametrize("decode_budget", [BUDGET + 4, None])
def test_saved_while_growing_and_restored(llama_mha, decode_budget):
    """Saved after decode steps that grew each head past its share (a decode budget, or none), a cache is restored
    with every token it held, and decodes the same logits as the one saved, step after step."""
    ids = _prompts()
    caches = [make_cache(llama_mha, "snapkv:heads=adakv", BUDGET, decode_budget=decode_budget) for _ in range(2)]
    with torch.no_grad():
        llama_mha(ids, cache=caches[0])
        for t in range(3):
            llama_mha(torch.full((2, 1), 5 + t), cache=caches[0])
        caches[1].restore(*caches[0].export(), PROMPT)
        for mine, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
            assert torch.equal(_positions_held(mine, PROMPT + 3), _positions_held(theirs, PROMPT + 3))
            assert torch.equal(mine.store.counts, theirs.store.counts)
        for t in range(6):
            step = torch.full((2, 1), 9 + t)
            a, b = (llama_mha(step, cache=cache).logits for cache in caches)
            assert torch.allclose(a, b, atol=1e-5), t


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("streaming_llm:heads=adakv", {}, "per-slot scores"),
        ("scissorhands:heads=adakv", {}, "per-slot scores"),
        ("full:heads=adakv", {}, "keeps everything"),
        ("h2o:heads=adakv", {"rolling": True}, "position rolling"),
        ("h2o:heads=every", {}, "unknown heads rule"),
        ("h2o:heads=adakv,safeguard=2", {}, "safeguard must be in"),
    ],
)
def test_refused_before_anything_runs(llama_mha, spec, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_cache(llama_mha, spec, budget=BUDGET, **kwargs)


def test_kvzip_shares_its_layer_budgets_by_head(llama_gqa):
    """KVzip's selection over layers gives each layer its budget; AdaKV then shares each among the layer's heads."""
    ids = _prompts(batch=1)
    cache = make_cache(llama_gqa, "kvzip:heads=adakv", budget=BUDGET, kernels="torch")
    kvsieve.compress_context(llama_gqa, cache, ids, ASKING)
    for layer in cache.layers:
        counts = layer.store.counts
        assert int(counts.sum()) == counts.shape[1] * layer.policy.budget
        assert torch.equal((_held(layer.store) >= 0).sum(dim=-1), counts)
    assert sum(layer.policy.budget for layer in cache.layers) == len(cache.layers) * BUDGET


@pytest.mark.parametrize("prompt", [8, PROMPT])
def test_compiled_loops_before_the_shares_change_nothing(llama_gqa, prompt):
    """Before a row shares its budget the compiled decode steps may run (every slot visible); their victim gives way
    to the shares, and the tokens are those of the policies' torch code."""
    ids = _prompts()[:, :prompt]
    tokens = [
        _generate(llama_gqa, make_cache(llama_gqa, "snapkv:heads=adakv", budget=BUDGET, kernels=kernels), ids, new=12)
        for kernels in ("torch", "auto")
    ]
    assert torch.equal(*tokens)


@pytest.mark.parametrize(
    ("model", "spec", "dtype"),
    [
        ("llama_gqa", "snapkv:heads=adakv", torch.float32),
        ("llama_mha", "h2o:heads=adakv,safeguard=0", torch.float32),
        ("llama_gqa", "expected_attention:heads=adakv", torch.float32),
        ("llama_gqa", "h2o:heads=adakv", torch.float64),
    ],
)
def test_decode_steps_read_packed_slots_where_they_lie(tiny_models, monkeypatch, model, spec, dtype):
    """On the CPU with the compiled loops, a decode step attends the packed slots where they lie, gathering no
    head to the largest's width (but for a policy that reads keys or values), and decodes the tokens of the
    gathered slots' torch code, in a left-padded batch."""
    from kvsieve.engine import step
    from kvsieve.engine.storage import HeadLayout

    llm = tiny_models(model, dtype)
    ids = _prompts()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    reference = _generate(llm, make_cache(llm, spec, budget=BUDGET, kernels="torch"), ids, mask, new=12)
    packed, gathers = [], []
    attend, unpacked = step.packed_attention, HeadLayout.unpacked
    monkeypatch.setattr(step, "packed_attention", lambda *a, **k: packed.append(1) or attend(*a, **k))
    monkeypatch.setattr(HeadLayout, "unpacked", lambda *a, **k: gathers.append(1) or unpacked(*a, **k))
    assert torch.equal(
        _generate(llm, make_cache(llm, spec, budget=BUDGET, kernels="auto"), ids, mask, new=12), reference
    )
    assert len(packed) >= 11 * llm.config.num_hidden_layers  # (every decode step after the shares)
    reads_kv = spec.startswith("expected_attention")
    assert (len(gathers) >= len(packed)) == reads_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_attention_is_the_gathered_slots_attention(llama_gqa, dtype):
    """The packed loops' output and observation equal the explicit attention over the slots gathered to the largest
    head's width (the statement they stand for), for each row and head of a batch whose heads hold different
    counts."""
    from kvsieve.engine.slot_attention import (
        AttentionArgs,
        Visibility,
        observed_attention,
        observing,
        packed_attention,
    )
    from kvsieve.engine.storage import PackedView

    llm = llama_gqa.to(dtype)
    try:
        cache = make_cache(llm, "snapkv:heads=adakv,safeguard=0", budget=BUDGET, kernels="torch")
        _generate(llm, cache, _prompts(), new=3)
    finally:
        llama_gqa.float()
    store = cache.layers[1].store
    assert bool((store.counts != store.counts[:1, :1]).any())
    view = PackedView(store, cache.layers[1].newest)
    torch.manual_seed(3)
    query = torch.randn(2, 4, 1, store.head_dim, dtype=dtype)
    query_pos = view.last[:, None] + 1
    seen = []
    out = packed_attention(query, view, query_pos, 0.125, observing(seen.append, view.pos, query_pos))[0]
    keys, values = store.decoded()
    args = AttentionArgs(scaling=0.125)
    expected = observed_attention(query, keys, values, view.pos, query_pos, args, Visibility(), seen.append)[0]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 1e-12}
    torch.testing.assert_close(out, expected, **tol)
    ours, theirs = seen
    torch.testing.assert_close(ours.probs, theirs.probs, **tol)
    torch.testing.assert_close(ours.logits, theirs.logits, **tol)
    assert torch.equal(ours.allowed, theirs.allowed)


@pytest.mark.parametrize("spec", ["snapkv:heads=adakv", "h2o+strided:heads=adakv"])
def test_compiled_victims_over_holes_are_the_policys(tiny_models, monkeypatch, spec):
    """Where a decode step reads gathered slots (bf16: no packed loops) its victims come from the compiled loops,
    which never take a head's free slot: the tokens and the slots each head holds are those of the torch code."""
    from kvsieve.engine import eviction

    llm = tiny_models("llama_gqa", torch.bfloat16)
    ids = _prompts()
    held, compiled = {}, []
    victims = eviction.compiled_victims
    monkeypatch.setattr(eviction, "compiled_victims", lambda *a: compiled.append(victims(*a)) or compiled[-1])
    for kernels in ("torch", "auto"):
        cache = make_cache(llm, spec, budget=BUDGET, kernels=kernels)
        held[kernels] = _generate(llm, cache, ids, new=12), [_held(layer.store) for layer in cache.layers]
        assert cache.layers[0].store.layout is not None
    assert torch.equal(held["torch"][0], held["auto"][0])
    assert sum(v is not None for v in compiled) >= 10 * llm.config.num_hidden_layers
    for a, b in zip(held["torch"][1], held["auto"][1], strict=True):
        assert torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)
