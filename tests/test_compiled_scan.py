"""The compiled scan (kvsieve.engine.compiled): the same decisions as the torch scan, where it applies."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from kvsieve.engine import compiled
from kvsieve.policies import REGISTRY
from kvsieve.policies.base import FixedPriority, LowMarks, ScoreRule
from kvsieve.policies.h2o import H2O

pytestmark = pytest.mark.skipif(compiled.numba is None, reason="numba (the `fast` extra) is not installed")


def _streamed(model, ids, policy, budget, mask=None, **kwargs):
    """One stream-protocol forward over ``ids``: its logits and every layer's held positions (sorted)."""
    cache = kvsieve.make_cache(model, policy, budget, stream=True, **kwargs)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, cache=cache).logits
    layers = model.config.num_hidden_layers
    return logits, [cache.positions(i).sort(dim=-1).values for i in range(layers)]


def _both(model, ids, policy, budget, monkeypatch, mask=None, **kwargs):
    """The stream with the compiled loop (and, for each run it decided, whether padding was held) and with the
    torch scan."""
    runs = []
    loop = compiled._score_rule
    monkeypatch.setattr(compiled, "_score_rule", lambda *args: runs.append(bool(args[4].any())) or loop(*args))
    marks = compiled._low_marks
    monkeypatch.setattr(compiled, "_low_marks", lambda *args: runs.append(False) or marks(*args))
    fixed = compiled._fixed_priority
    monkeypatch.setattr(compiled, "_fixed_priority", lambda *args: runs.append(False) or fixed(*args))
    fast = _streamed(model, ids, policy, budget, mask, **kwargs)
    monkeypatch.setattr(compiled, "ENABLED", False)
    slow = _streamed(model, ids, policy, budget, mask, **kwargs)
    monkeypatch.setattr(compiled, "ENABLED", True)
    return fast, slow, runs


@pytest.mark.parametrize(
    ("policy", "model_name", "dtype", "budget", "params"),
    [
        ("h2o", "llama_gqa", torch.float32, 9, {}),
        ("h2o", "llama_gqa", torch.float32, 24, {"recent": 0}),
        ("h2o", "llama_mha", torch.float32, 16, {"recent_ratio": 1.0}),
        ("h2o", "llama_gqa", torch.float64, 12, {}),
        ("h2o", "gemma3", torch.float32, 10, {}),
        ("tova", "llama_gqa", torch.float32, 9, {}),
        ("tova", "llama_gqa", torch.float32, 14, {"per_head": True}),
        ("tova", "llama_mha", torch.float64, 11, {}),
        ("h2o+local", "llama_gqa", torch.float32, 9, {}),
        ("h2o+local", "llama_mha", torch.float32, 20, {"heavy_ratio": 0.2}),
        ("scissorhands", "llama_gqa", torch.float32, 12, {}),
        ("scissorhands", "llama_gqa", torch.float32, 16, {"window": 7, "drop": 1, "recent": 0}),
        ("scissorhands", "llama_mha", torch.float64, 10, {"threshold": "paper", "drop": 3}),
        ("knorm", "llama_gqa", torch.float32, 12, {}),
        ("knorm", "llama_gqa", torch.float32, 9, {"recent": 0}),
        ("knorm", "llama_mha", torch.float64, 14, {"drop": 4, "recent": 3}),
    ],
)
def test_the_compiled_loop_streams_as_the_torch_scan(
    tiny_models, make_ids, monkeypatch, policy, model_name, dtype, budget, params
) -> None:
    """Every policy that states a rule, in fp32 and fp64, GQA or not, a batch of two: the same kept tokens and
    logits, decided by the loop in every scanned run."""
    model = tiny_models(model_name, dtype)
    ids = make_ids(2, 160)
    (fast_logits, fast_kept), (slow_logits, slow_kept), runs = _both(model, ids, policy, budget, monkeypatch, **params)
    assert all(map(torch.equal, fast_kept, slow_kept))
    assert torch.equal(fast_logits, slow_logits)
    if model_name != "gemma3":  # (its sliding layers are not scanned: the window)
        assert len(runs) >= model.config.num_hidden_layers * 2


@pytest.mark.parametrize(("policy", "params"), [("h2o", {}), ("tova", {}), ("h2o+local", {}), ("h2o", {"recent": 0})])
def test_left_padded_batches_stream_the_same_with_the_compiled_loop(llama_gqa, make_ids, monkeypatch, policy, params):
    """Padding slots go first, padding queries observe nothing and see every slot: as in the torch scan."""
    mask = torch.ones(2, 140, dtype=torch.long)
    mask[1, :7] = 0
    (fast_logits, fast_kept), (slow_logits, slow_kept), runs = _both(
        llama_gqa, make_ids(2, 140), policy, 9, monkeypatch, mask=mask, **params
    )
    assert len(runs) >= 3 * 2 and any(runs)  # (padding held in some)
    assert all(map(torch.equal, fast_kept, slow_kept))
    assert torch.equal(fast_logits, slow_logits)


def test_the_torch_scan_decides_where_no_rule_applies(llama_gqa, make_ids, monkeypatch) -> None:
    """An h2o variant whose rule is not an accumulated sum: the loop never runs, and the results are the torch
    scan's."""
    fast, slow, runs = _both(llama_gqa, make_ids(2, 120), "h2o", 9, monkeypatch, transform="sqrt")
    assert not runs
    assert torch.equal(fast[0], slow[0])


def test_only_policies_with_such_a_rule_state_it() -> None:
    rules = {name: cls(16).scan_rule() for name, cls in REGISTRY.items() if cls.bounded}
    assert rules.pop("h2o") == ScoreRule(accumulate=True, recent=8)
    assert rules.pop("tova") == ScoreRule(accumulate=False, across_heads=True)
    assert rules.pop("h2o+local") == ScoreRule(accumulate=True, recent=8)
    assert rules.pop("scissorhands") == LowMarks(window=100, recent=9, drop=8, by_step=False)
    assert rules.pop("knorm") == FixedPriority(recent=8, drop=1)
    assert set(rules.values()) == {None}
    assert H2O(16, H2O.make_params(normalize=True)).scan_rule() is None
    assert H2O(16, H2O.make_params(recent=3)).scan_rule() == ScoreRule(accumulate=True, recent=3)
