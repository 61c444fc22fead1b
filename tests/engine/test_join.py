"""``SieveCache.join``: rows prefilled alone and joined into one batch decode exactly as each row alone (float64,
so that round-off, which differs between a batch and a row alone, cannot decide a near-tie)."""

from __future__ import annotations

import pytest
import torch

import kvsieve

POLICIES = [
    ("h2o", 6, {}),
    ("streaming_llm", 6, {"sink": 2}),
    ("scissorhands", 6, {}),
    ("tova", 6, {}),
    ("local", 5, {}),
    ("knorm", 7, {}),
    ("snapkv:heads=adakv", 6, {}),
    ("h2o:heads=adakv", 6, {}),
    ("full", None, {}),
]


@pytest.mark.parametrize("model_name", ["llama_gqa", "gemma3"])
@pytest.mark.parametrize(("policy", "budget", "params"), POLICIES)
def test_joined_rows_decode_as_alone(tiny_models, make_ids, model_name, policy, budget, params) -> None:
    model = tiny_models(model_name, torch.float64)
    lengths, steps = (11, 4, 7), 9  # (a prompt shorter than the budget: its row is padded until it fills)
    prompts = [make_ids(1, n, seed=i) for i, n in enumerate(lengths)]
    feeds = make_ids(len(lengths), steps, seed=9)
    alone, caches = [], []
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            cache = kvsieve.make_cache(model, policy, budget, **params)
            model(prompt, cache=cache)
            caches.append(cache)
            solo = kvsieve.make_cache(model, policy, budget, **params)
            model(prompt, cache=solo)
            alone.append(torch.cat([model(feeds[row : row + 1, t : t + 1], cache=solo).logits for t in range(steps)]))
        # Join the first two, decode two steps, then join the third (a request arriving at a step boundary).
        batch = caches[0]
        batch.join(caches[1])
        rows, position = [0, 1], torch.tensor(lengths)
        got = {row: [] for row in range(len(lengths))}
        for t in range(steps):
            if t == 2:
                batch.join(caches[2])
                rows.append(2)
            ids = torch.stack([feeds[row, t - (2 if row == 2 else 0)] for row in rows])[:, None]
            positions = torch.stack([position[row] for row in rows])[:, None]
            logits = model(ids, position_ids=positions, cache=batch).logits
            for i, row in enumerate(rows):
                got[row].append(logits[i])
                position[row] += 1
            if t == 5:  # the first row leaves: its rows are dropped
                batch.batch_select_indices(torch.tensor([1, 2]))
                rows.remove(0)
    for row, want in enumerate(alone):
        n = len(got[row])
        torch.testing.assert_close(torch.cat(got[row]), want[:n].squeeze(1), rtol=1e-9, atol=1e-9, msg=f"row {row}")


def test_only_caches_made_alike_join(tiny_models, make_ids) -> None:
    model = tiny_models("llama_gqa", torch.float32)
    a, b = kvsieve.make_cache(model, "h2o", 6), kvsieve.make_cache(model, "h2o", 7)
    with torch.inference_mode():
        model(make_ids(1, 9), cache=a)
        model(make_ids(1, 9), cache=b)
    with pytest.raises(ValueError, match="made alike"):
        a.join(b)
