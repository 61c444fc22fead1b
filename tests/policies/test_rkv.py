"""R-KV against its rule computed literally from eager attention over a plain ``DynamicCache``; its bulk compression
while decoding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvsieve


def _reference_scores(model, ids: torch.Tensor, window: int, kernel: int, mix: float, threshold: float):
    """Per layer ``[B, H, n]``: each prompt token's score ``mix·I − (1 − mix)·R`` (paper §3), from the eager
    attention of the prompt's last ``window`` queries (one query head per KV head: the group's maximum is the
    head's logits) and the cached keys, one (row, head) at a time."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    cache = DynamicCache(config=eager.config)
    with torch.inference_mode():
        out = eager(input_ids=ids, cache=cache, use_cache=True, output_attentions=True)
    n = ids.shape[1]
    older = n - window  # (positions 0 .. n - window - 1 are scored; the window is kept)
    scores = []
    for layer, att in enumerate(out.attentions):  # [B, H, n, n]
        keys = cache.layers[layer].keys.double()
        z = torch.empty(att.shape[0], att.shape[1], older, dtype=torch.float64)
        for b in range(att.shape[0]):
            for h in range(att.shape[1]):
                probs = att[b, h, -window:, :older].double()
                importance = (probs / probs.sum(dim=-1, keepdim=True)).mean(dim=0)
                importance = F.max_pool1d(importance[None, None], kernel, 1, kernel // 2)[0, 0]
                unit = keys[b, h] / keys[b, h].norm(dim=-1, keepdim=True)
                sim = unit @ unit.T
                sim.fill_diagonal_(0.0)
                for i in range(n):
                    similar = [j for j in range(n) if sim[i, j] > threshold]
                    if similar:
                        sim[i, max(similar)] = 0.0
                redundancy = sim.mean(dim=0).softmax(dim=0)[:older]
                z[b, h] = mix * importance - (1 - mix) * redundancy
        scores.append(z)
    return scores


@pytest.mark.parametrize("params", [{}, {"window": 3, "kernel": 1, "mix": 0.5, "threshold": 0.2}])
def test_rkv_keeps_the_window_and_the_highest_scores_of_its_rule(tiny_models, make_ids, params) -> None:
    model = tiny_models("llama_mha", torch.float64)
    budget, ids = 12, make_ids(2, 30)
    cache = kvsieve.make_cache(model, "rkv", budget, **params)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    policy = cache.layers[0].policy
    p = policy.params
    reference = _reference_scores(model, ids, policy.window, p.kernel, p.mix, p.threshold)
    n = ids.shape[1]
    for layer, z in zip(cache.layers, reference, strict=True):
        held = layer.held_positions()
        for b in range(2):
            for h in range(z.shape[1]):
                kept = set(held[b, h].tolist())
                window = set(range(n - policy.window, n))
                assert window <= kept and len(kept) == budget
                scored = kept - window
                evicted = set(range(n - policy.window)) - scored
                lowest_kept = min(z[b, h, sorted(scored)].tolist())
                assert all(z[b, h, e] <= lowest_kept + 1e-9 for e in evicted)


def test_rkv_compresses_in_bulk_while_decoding(llama_gqa, make_ids, stream) -> None:
    """A prompt is compressed to the budget; then each time a decode step fills the cache, ``buffer`` tokens go at
    once, so the cache never holds more than the budget between steps and refills for ``buffer`` steps."""
    budget, buffer = 16, 5
    cache = kvsieve.make_cache(llama_gqa, "rkv", budget, buffer=buffer, window=4)
    counts = []
    stream(llama_gqa, cache, make_ids(2, 24), 15, on_step=lambda: counts.append(max(cache.slot_counts())))
    cycle = list(range(budget + 1 - buffer, budget + 1))  # (12 .. 16: a step that leaves 17 keeps 12)
    assert counts == [budget, *cycle, *cycle, *cycle]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rkv:window=13", "window must be in"),
        ("rkv:buffer=10,window=4", "buffer must be in"),
        ("rkv:mix=1.5", "mix must be in"),
        ("rkv:kernel=4", "kernel must be a positive odd number"),
        ("rkv:threshold=nan", "threshold must be a cosine similarity"),
    ],
)
def test_rkv_parameters_are_checked(llama_gqa, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, spec, 12).resolve(20)


def test_rkv_scores_the_same_with_the_similarities_in_row_blocks(llama_gqa, make_ids, monkeypatch) -> None:
    """The keys' similarity matrix is computed in blocks of rows (bounded memory): blocks of 7 rows keep what one
    block keeps."""
    from kvsieve.policies import rkv

    kept = []
    for rows in (1024, 7):
        monkeypatch.setattr(rkv, "ROWS", rows)
        cache = kvsieve.make_cache(llama_gqa, "rkv", 12)
        with torch.inference_mode():
            llama_gqa(input_ids=make_ids(2, 40), cache=cache, use_cache=True)
        kept.append([layer.held_positions().sort(dim=-1).values for layer in cache.layers])
    assert all(map(torch.equal, *kept))
