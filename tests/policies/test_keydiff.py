"""KeyDiff against its rule applied literally to the held keys, one (row, head) at a time."""

from __future__ import annotations

import pytest
import torch

import kvsieve


def _naive_keydiff(keys: torch.Tensor, pos: list[int], budget: int, recent: int) -> set[int]:
    """The positions one (row, head) keeps: the ``recent`` newest, then the least cosine-similar to the mean of the
    unit keys (float16 resolution, newer first among equals)."""
    newest = max(pos)
    unit = [k / k.norm() for k in keys.double()]
    anchor = sum(unit) / len(unit)
    similarity = {p: float(torch.dot(u, anchor / anchor.norm())) for p, u in zip(pos, unit, strict=True)}
    protected = {p for p in pos if p > newest - recent}
    others = sorted(
        (p for p in pos if p not in protected),
        key=lambda p: (float(torch.tensor(-similarity[p]).to(torch.float16)), p),
        reverse=True,
    )
    return protected | set(others[: budget - len(protected)])


@pytest.mark.parametrize("recent", [0, 3])
def test_keydiff_keeps_the_keys_least_like_the_mean(llama_gqa, make_ids, recent) -> None:
    budget = 10
    ids = make_ids(2, 24)
    seen = kvsieve.make_cache(llama_gqa, "full")
    with torch.inference_mode():
        llama_gqa(input_ids=ids, cache=seen, use_cache=True)
    cache = kvsieve.make_cache(llama_gqa, "keydiff", budget, recent=recent)
    with torch.inference_mode():
        llama_gqa(input_ids=ids, cache=cache, use_cache=True)
    for full, layer in zip(seen.layers, cache.layers, strict=True):
        pos = full.held_positions()
        keys = full.keys[:, :, : pos.shape[-1]]
        held = layer.held_positions()
        for b in range(2):
            for h in range(keys.shape[1]):
                expected = _naive_keydiff(keys[b, h], pos[b, h].tolist(), budget, recent)
                assert set(held[b, h].tolist()) == expected


def test_keydiff_recent_is_checked(llama_gqa) -> None:
    with pytest.raises(ValueError, match="recent must be in"):
        kvsieve.make_cache(llama_gqa, "keydiff:recent=11", 10).resolve(20)


def test_keydiff_decode_steps_evict_one_by_the_rule(llama_gqa, make_ids, stream) -> None:
    """Through decode steps: each new token joins the held ones and the least distinct goes (the anchor recomputed
    over the tokens held at that step). In the first layer, whose keys depend on the tokens alone (a later layer's
    keys of the decode tokens depend on what the layers before held), against the full cache's keys."""
    budget, recent, steps = 10, 2, 12
    full = kvsieve.make_cache(llama_gqa, "full")
    stream(llama_gqa, full, make_ids(1, 20), steps)
    cache = kvsieve.make_cache(llama_gqa, "keydiff", budget, recent=recent)
    stream(llama_gqa, cache, make_ids(1, 20), steps)
    keys = full.layers[0].keys[0, :, : 20 + steps]  # (the full cache holds every token, at its position's slot)
    for h in range(keys.shape[0]):
        held = _naive_keydiff(keys[h, :20], list(range(20)), budget, recent)
        for p in range(20, 20 + steps):
            held = _naive_keydiff(keys[h, sorted(held | {p})], sorted(held | {p}), budget, recent)
        assert set(cache.layers[0].held_positions()[0, h].tolist()) == held
