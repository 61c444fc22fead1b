"""H2O: against a naive eager attention that applies it literally, and its variants (transform, normalize,
heavy-only) against a naive reference replayed on the recorded observations (see ``policy_runs``)."""

from __future__ import annotations

import copy
import math
from functools import partial
from typing import Any

import pytest
import torch
from policy_runs import (
    BUDGET,
    PROMPT,
    Call,
    Kept,
    Reference,
    keep_recent_and_best,
    record,
    recorder,
    reference_mask,
    replay,
    softmax,
)
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import kvsieve


class NaiveH2O:
    """H2O applied literally, inside an eager attention function run over a plain ``DynamicCache``.

    The cache holds every token; this class keeps, per (layer, row, KV head), the set of positions H2O keeps and
    their accumulated scores, and masks the others out of the attention.
    """

    def __init__(self, budget: int, recent: int) -> None:
        self.budget, self.recent = budget, recent
        self.kept: dict[int, list[list[set[int]]]] = {}
        self.score: dict[int, list[list[dict[int, float]]]] = {}

    def attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor,
        scaling: float,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        bsz, q_heads, q_len, _ = query.shape
        kv_heads, n = key.shape[1], key.shape[2]
        group = q_heads // kv_heads
        layer = module.layer_idx
        kept = self.kept.setdefault(layer, [[set() for _ in range(kv_heads)] for _ in range(bsz)])
        score = self.score.setdefault(layer, [[{} for _ in range(kv_heads)] for _ in range(bsz)])
        keep_mask = torch.zeros(bsz, kv_heads, 1, n, dtype=torch.bool)
        for b in range(bsz):
            for h in range(kv_heads):
                kept[b][h].update(range(n - q_len, n))
                keep_mask[b, h, 0, sorted(kept[b][h])] = True
        assert attention_mask.dtype == torch.bool and attention_mask.shape == (bsz, 1, q_len, n)
        allowed = attention_mask & keep_mask.repeat_interleave(group, dim=1)
        k = key.float().repeat_interleave(group, dim=1)
        v = value.float().repeat_interleave(group, dim=1)
        logits = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out = torch.matmul(probs, v)
        summed = probs.view(bsz, kv_heads, group, q_len, n).sum(dim=2).double().tolist()
        for b in range(bsz):
            for h in range(kv_heads):
                for p in kept[b][h]:
                    score[b][h][p] = score[b][h].get(p, 0.0) + sum(summed[b][h][i][p] for i in range(q_len))
                self._evict(kept[b][h], score[b][h], last=n - 1, prompt=q_len > 1)
        return out.transpose(1, 2).to(query.dtype), None

    def _evict(self, kept: set[int], score: dict[int, float], last: int, prompt: bool) -> None:
        if len(kept) <= self.budget:
            return
        recent = {p for p in kept if p > last - self.recent}
        others = sorted(kept - recent, key=lambda p: score[p], reverse=True)
        # After the prompt: the recent window + the heavy best-scored others; at a decode step: one victim.
        evicted = others[self.budget - len(recent) :] if prompt else others[-1:]
        for p in evicted:
            kept.remove(p)
            del score[p]

    def positions(self, layer: int) -> list[list[set[int]]]:
        return [[set(s) for s in row] for row in self.kept[layer]]


@pytest.mark.parametrize("model_name", ["llama_mha", "llama_gqa"])
def test_h2o_matches_naive_reference(model_name, request, stream, make_ids) -> None:
    model = request.getfixturevalue(model_name)
    budget, recent, steps = 10, 4, 32
    ref = NaiveH2O(budget, recent)
    AttentionInterface.register("h2o_ref", ref.attention)
    AttentionMaskInterface.register("h2o_ref", reference_mask)
    ref_model = copy.deepcopy(model)  # (its own copy: the attention implementation changes)
    ref_model.set_attn_implementation("h2o_ref")
    n_layers = model.config.num_hidden_layers

    ref_kept: list[Kept] = []
    prompt = make_ids(2, 24)
    ref_logits = stream(
        ref_model,
        DynamicCache(config=ref_model.config),
        prompt,
        steps,
        on_step=lambda: ref_kept.append([ref.positions(i) for i in range(n_layers)]),
    )

    cache = kvsieve.make_cache(model, "h2o", budget, recent=recent)
    kept: list[Kept] = []
    logits = stream(model, cache, prompt, steps, on_step=recorder(cache, kept))
    assert len(kept) == len(ref_kept) == steps + 1
    for step, (got, expected) in enumerate(zip(kept, ref_kept, strict=True)):
        assert got == expected, f"kept positions differ after step {step}"
        assert all(len(s) == budget for layer in got for row in layer for s in row)
    # In every layer, rows and heads keep different sets: the comparison really is per (row, KV head).
    assert all(len({frozenset(s) for row in layer for s in row}) > 1 for layer in kept[-1])
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


TRANSFORMS = {"identity": lambda z: z, "sqrt": lambda z: math.sqrt(z + 1), "log": lambda z: math.log(z + 1)}


class H2OReference(Reference):
    def __init__(self, budget: int, group: int, recent: int, transform: str, normalize: bool) -> None:
        super().__init__(budget, group)
        self.recent, self.h, self.normalize = recent, TRANSFORMS[transform], normalize

    def row(self, call: Call, b: int, h: int, r: int) -> None:
        allowed = call.allowed[b][h][r]
        for g in range(self.group):
            probs = softmax(call.logits[b][h][g][r], allowed)
            for s, p in enumerate(call.pos[b][h]):
                if allowed[s]:
                    self.score[p] += self.h(1) - self.h(1 - probs[s])

    def keep(self, present: set[int], last: int, n_keep: int) -> set[int]:
        def key(p: int) -> float:  # with normalize: the mean over the rows that have seen the token
            return self.score[p] / (last - p + 1 if self.normalize else 1)

        return keep_recent_and_best(present, last, n_keep, self.recent, key)


@pytest.mark.parametrize(
    "params",
    [{}, {"transform": "sqrt"}, {"transform": "log", "recent": 2}, {"normalize": True}, {"recent": 0}],
    ids=["plain", "sqrt", "log", "normalize", "heavy-only"],
)
def test_h2o_variants_match_reference(llama_gqa, stream, monkeypatch, params) -> None:
    run = record(llama_gqa, stream, monkeypatch, "h2o", **params)
    recent = params.get("recent", BUDGET // 2)
    make = partial(H2OReference, BUDGET, 2, recent, params.get("transform", "identity"), params.get("normalize", False))
    replay(run, make, lambda state: state["score"])


H2O_VARIANTS = {
    "sqrt": {"transform": "sqrt"},
    "log": {"transform": "log"},
    "normalize": {"normalize": True},
    "heavy-only": {"recent": 0},
}


def test_h2o_variants_change_decisions(llama_gqa, stream, monkeypatch) -> None:
    """Each variant keeps other tokens than plain H2O somewhere; heavy-only evicts a token in its own step."""
    plain = record(llama_gqa, stream, monkeypatch, "h2o").slots
    runs = {
        name: record(llama_gqa, stream, monkeypatch, "h2o", **params).slots for name, params in H2O_VARIANTS.items()
    }
    assert all(slots != plain for slots in runs.values())
    # Row 0 is not padded: its token of decode step s is at position PROMPT - 1 + s.
    assert any(
        PROMPT - 1 + step not in head
        for step, layers in enumerate(runs["heavy-only"][1:], start=1)
        for layer in layers
        for head in layer[0]
    )
