"""Layer budget schedules: exact sums, shapes, validation, the profiled statistic and its cache, the CLI option."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

import kvsieve
from kvsieve import profiling
from kvsieve.cli import build_parser, main
from kvsieve.engine.schedules import pyramid, ramp, split_budget
from kvsieve.policies import Observation, Slots
from kvsieve.profiling import Coverage, CoverageParams, profile


def _budgets(cache: kvsieve.SieveCache) -> list[int | None]:
    return cache.budgets


def test_split_budget_rounds_deterministically_to_the_exact_total() -> None:
    assert split_budget(10, [1, 1, 1]) == [10, 10, 10]
    # 1 each, then 27 shared 1:2:3 = 4.5, 9, 13.5: the spare token goes to the lower of the tied remainders
    assert split_budget(10, [1, 2, 3]) == [6, 10, 14]
    assert split_budget(10, [1, 1, 2]) == [8, 8, 14]
    for budget in (1, 2, 7, 64):
        for weights in (ramp(30), ramp(30)[::-1], [0.01, 5.0, 1.0], [1e-9, 1.0], [0.3] * 7):
            out = split_budget(budget, weights)
            assert sum(out) == len(weights) * budget and min(out) >= 1


@pytest.mark.parametrize(("budget", "weights"), [(0, [1.0]), (4, []), (4, [0.0, 1.0]), (4, [math.nan, 1.0])])
def test_split_budget_rejects_bad_input(budget, weights) -> None:
    with pytest.raises(ValueError, match=r"budget must be|weights must be"):
        split_budget(budget, weights)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [("uniform", [10, 10, 10]), ("increasing", [6, 10, 14]), ("pyramid", [19, 10, 1]), ([1, 1, 2], [8, 8, 14])],
)
def test_schedules_share_the_same_total(llama_gqa, stream, make_ids, schedule, expected) -> None:
    cache = kvsieve.make_cache(llama_gqa, "h2o", 10, schedule=schedule)
    assert _budgets(cache) == expected
    stream(llama_gqa, cache, make_ids(2, 30), 5)
    assert cache.slot_counts() == expected


def test_ramp_shapes() -> None:
    assert ramp(1) == [1.0]
    assert ramp(3) == [1.0, 2.0, 3.0]
    weights = ramp(30)
    assert all(a < b for a, b in itertools.pairwise(weights))
    for budget in (1, 3, 100):
        increasing, falling = split_budget(budget, weights), split_budget(budget, pyramid(30))
        assert increasing == sorted(increasing) and falling == sorted(falling, reverse=True)
    assert split_budget(100, weights)[0] < 60 and split_budget(100, weights)[-1] > 140  # about B/2 to 3B/2


@pytest.mark.parametrize(("layers", "budget"), [(24, 2048), (24, 1024), (30, 410), (2, 100)])
def test_pyramid_is_pyramidkvs_arithmetic_sequence(layers, budget) -> None:
    """PyramidKV (§3.3): the last layer holds k_total / (β·m), the first 2·k_total / m minus that, the others in
    arithmetic sequence between; the same total as the uniform budget, each layer within two tokens of the formula
    (every layer first gets one token, then the rounding)."""
    k_total, beta = layers * budget, 20
    top = k_total / (beta * layers)
    bottom = 2 * k_total / layers - top
    paper = [bottom - (bottom - top) / (layers - 1) * i for i in range(layers)]
    ours = split_budget(budget, pyramid(layers))
    assert sum(ours) == k_total
    assert all(abs(a - b) < 2 for a, b in zip(ours, paper, strict=True))
    assert pyramid(1) == [1.0]


def test_ratio_budget_is_split_when_resolved(llama_gqa, stream, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "streaming_llm", 0.5, schedule="increasing", sink=2)
    stream(llama_gqa, cache, make_ids(1, 20), 3)
    assert cache.budget_tokens == 10
    assert [layer.policy.budget for layer in cache.layers] == [6, 10, 14]


def test_only_policy_layers_share_the_budget(gemma3) -> None:
    cache = kvsieve.make_cache(gemma3, "h2o", 10, schedule="increasing")
    # layers: sliding, full, sliding, full; 20 tokens shared 1:3 by the two full layers
    assert _budgets(cache) == [7, 6, 7, 14]


def test_a_layer_budget_the_policy_cannot_use_is_a_clear_error(llama_gqa, stream, make_ids) -> None:
    message = r"layer 2 gets 1 tokens under the layer schedule: streaming_llm: sink \(4\) must be smaller"
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, "streaming_llm", 5, schedule="pyramid", sink=4)
    cache = kvsieve.make_cache(llama_gqa, "streaming_llm", 0.25, schedule="pyramid", sink=4)
    with pytest.raises(ValueError, match=message):
        stream(llama_gqa, cache, make_ids(1, 20), 0)
    assert not any(layer.is_initialized for layer in cache.layers)  # nothing was written


def test_bad_schedules(llama_gqa) -> None:
    with pytest.raises(ValueError, match="unknown layer schedule 'steep'"):
        kvsieve.make_cache(llama_gqa, "h2o", 10, schedule="steep")
    with pytest.raises(ValueError, match=r"a weight per policy layer \(3\), not 2"):
        kvsieve.make_cache(llama_gqa, "h2o", 10, schedule=[1.0, 2.0])
    with pytest.raises(ValueError, match="no tokenizer saved with the model"):
        kvsieve.make_cache(llama_gqa, "h2o", 10, schedule="profiled")


def test_full_ignores_the_schedule_and_topk_oracle_follows_it(llama_gqa) -> None:
    assert _budgets(kvsieve.make_cache(llama_gqa, "full", None, schedule="pyramid")) == [None] * 3
    assert _budgets(kvsieve.make_cache(llama_gqa, "topk_oracle", 10, schedule="pyramid")) == [19, 10, 1]


# --------------------------------------------------------------------------------------------------------------------
# profiled
# --------------------------------------------------------------------------------------------------------------------


def test_coverage_statistic() -> None:
    """Rows needing 3 of 4 keys and 1 of 2 keys for 90 % of their attention; padding and early rows are ignored."""
    coverage = Coverage(None, CoverageParams(start=5))
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.95, 0.05, 0, 0], [0.9, 0.1, 0, 0], [0, 0, 0, 0]])
    key_pos = torch.tensor([0, 1, 7, 8]).view(1, 1, 4)  # rows 2 and 3 (positions 6, 4) see the first two keys
    obs = Observation(
        probs=2 * probs.view(1, 1, 4, 4),  # a GQA group of 2 query heads, summed
        logits=torch.zeros(1, 1, 2, 4, 4),
        query_pos=torch.tensor([[9, 6, 4, -1]]),
        step_rows=4,
        key_pos=key_pos,
    )
    empty = torch.zeros(1, 1, 4, 0)
    coverage.observe(Slots(pos=key_pos, state={}, last=torch.tensor([9]), keys=empty, values=empty), obs)
    assert coverage.count == 2
    assert coverage.value == pytest.approx((3 / 4 + 1 / 2) / 2)


@pytest.fixture
def profiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty profile cache."""
    monkeypatch.setattr(profiling, "cache_dir", lambda: tmp_path)
    return tmp_path / "profiles"


def test_profile_is_measured_once_cached_and_reproducible(tiny_lm, wiki_text, profiles, monkeypatch) -> None:
    model, tokenizer = tiny_lm
    weights = profile(model, tokenizer, text=wiki_text, tokens=128)
    assert len(weights) == 3 and all(0 < w <= 1 for w in weights)
    files = list(profiles.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["weights"] == weights

    def no_measuring(*args, **kwargs) -> None:
        raise AssertionError("the profile was measured again")

    with monkeypatch.context() as patch:
        patch.setattr(Coverage, "observe", no_measuring)
        assert profile(model, tokenizer, text=wiki_text, tokens=128) == weights
    files[0].unlink()
    assert profile(model, tokenizer, text=wiki_text, tokens=128) == weights  # measured again: same numbers
    profile(model, tokenizer, text=wiki_text[5000:], tokens=128)
    assert len(list(profiles.glob("*.json"))) == 2  # another text is another profile
    cache = kvsieve.make_cache(model, "h2o", 20, schedule=weights)
    assert _budgets(cache) == split_budget(20, weights)


def test_cli_schedule_option(tiny_lm, wiki_text, profiles, tmp_path, capsys) -> None:
    for command in ("generate", "ppl", "compare"):
        assert build_parser().parse_args([command, "--schedule", "pyramid"]).schedule == "pyramid"
    model, tokenizer = tiny_lm
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text(wiki_text)
    args = ["ppl", "--model", str(tmp_path / "tiny"), "--file", str(text), "--max-tokens", "64", "--json"]
    assert main([*args, "--budget", "16", "--schedule", "pyramid"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_slots_max"] == 30  # 48 tokens shared 1.95:1:0.05 -> 30, 16, 2
    assert main([*args, "--budget", "16", "--schedule", "profiled"]) == 0
    (saved,) = profiles.glob("*.json")  # measured with the model's own tokenizer on the built-in text
    weights = json.loads(saved.read_text())["weights"]
    assert json.loads(capsys.readouterr().out)["kv_slots_max"] == max(split_budget(16, weights))
