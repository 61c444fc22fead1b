"""``kvsieve analyze``: each analysis's core against hand-computed values, the policy analyses on tiny models, and
each subcommand once on the real model with a short text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import kvsieve
from kvsieve.analysis import ANALYSES
from kvsieve.analysis.attention import accumulated, map_layers
from kvsieve.analysis.kept import held_steps, positions, recall, recall_rows
from kvsieve.analysis.maps import MIN_KEYS, fit_power_law, row_entropy, row_sparsity
from kvsieve.analysis.persistence import persistence_ratio
from kvsieve.cli import main


def _uniform(n: int) -> torch.Tensor:
    """``[n, n]`` causal attention with each row uniform over its keys."""
    return torch.ones(n, n).tril() / torch.arange(1, n + 1)[:, None]


def test_row_sparsity_of_constructed_rows() -> None:
    n = MIN_KEYS + 1  # rows 19 (20 keys) and 20 (21 keys) are counted
    peaked = torch.zeros(n, n)
    peaked[:, 0] = 1  # rows with fewer than 20 keys: all mass on the first key (left out, or the result changes)
    peaked[19] = 0
    peaked[19, [7, 3, 12]] = torch.tensor([0.6, 0.3, 0.09])
    small = [j for j in range(20) if j not in (7, 3, 12)]
    peaked[19, small] = 0.01 / 17  # 17 keys below 1 % of the maximum (0.006)
    peaked[20] = 1 / 21
    stats = row_sparsity(torch.stack([peaked, _uniform(n)]))
    # Top 1/5/10/20 % of 20 keys = 1, 1, 2, 4 keys; of 21 keys = 1, 2, 3, 5 (ceil).
    row19 = [0.6, 0.6, 0.9, 0.99 + 0.01 / 17, 17 / 20]
    uniform19 = [1 / 20, 1 / 20, 2 / 20, 4 / 20, 0]
    row20 = [1 / 21, 2 / 21, 3 / 21, 5 / 21, 0]  # (uniform in both heads)
    expected = [((a + b) / 2 + c) / 2 for a, b, c in zip(row19, uniform19, row20, strict=True)]
    assert stats.tolist() == pytest.approx(expected, abs=1e-6)


def test_power_law_fit_recovers_the_exponent() -> None:
    ranks = torch.arange(1, 1001, dtype=torch.float64)
    assert fit_power_law(ranks**-1.3) == pytest.approx((1.3, 1.0), abs=1e-9)
    # Zipf's law, sampled: 200,000 draws of 1,000 types with p(r) ∝ 1/r, counted, in no particular order.
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(1 / ranks, 200_000, replacement=True, generator=gen), minlength=1000)
    exponent, r2 = fit_power_law(counts[torch.randperm(1000, generator=gen)])
    assert exponent == pytest.approx(1.0, abs=0.05)
    assert r2 > 0.99


def test_accumulated_attention_sums_the_columns_and_averages_heads() -> None:
    second = torch.eye(3)
    assert accumulated(torch.stack([_uniform(3), second])).tolist() == pytest.approx(
        [(1 + 1 / 2 + 1 / 3 + 1) / 2, (1 / 2 + 1 / 3 + 1) / 2, (1 / 3 + 1) / 2]
    )


def test_persistence_ratio_of_a_constructed_pattern() -> None:
    # l = 8, t = 4, α = 1/4. A query's own token (the diagonal) never counts.
    rows = [
        [1.0],
        [0.5, 0.5],  # S(0→4) gets 0
        [0.1, 0.8, 0.1],  # 1
        [0.1, 0.1, 0.1, 0.7],  # nothing (the diagonal)
        [0.3, 0, 0, 0.1, 0.6],  # S(4→8) gets 0
        [0.05, 0.05, 0.05, 0.05, 0.5, 0.3],  # 4
        [0.1, 0.2, 0.1, 0.1, 0.1, 0.1, 0.3],  # nothing (0.2 < α)
        [0, 0, 0, 0, 0, 0.25, 0.25, 0.5],  # 5 and 6 (α exactly)
    ]
    head = torch.zeros(8, 8)
    for i, row in enumerate(rows):
        head[i, : len(row)] = torch.tensor(row)
    # Uniform rows: row 4 gives 1/5 < α, so S(4→8) is empty and the ratio undefined.
    ratio, early, size = persistence_ratio(torch.stack([head, _uniform(8)]))
    assert ratio[0].item() == pytest.approx(1 / 4)  # {0, 1} ∩ {0, 4, 5, 6}
    assert early[0].item() == 1  # ... over the tokens before t: {0}
    assert math.isnan(ratio[1].item()) and math.isnan(early[1].item())
    assert size.tolist() == [4, 0]


def test_entropy_of_uniform_rows_is_ln_i() -> None:
    n = 50
    entropy = row_entropy(torch.stack([_uniform(n), _uniform(n)]))
    assert entropy.tolist() == pytest.approx([math.log(i) for i in range(1, n + 1)], abs=1e-5)
    assert row_entropy(torch.eye(n)[None]).abs().max().item() == 0  # one-hot rows


def test_recall_rows_counts_what_each_query_could_see() -> None:
    # One KV head (two query heads), 4 tokens; token 1 was last held after step 1, so queries 0-2 saw it, query 3
    # did not; the others were held throughout.
    weights = torch.stack([_uniform(4), _uniform(4)])
    weights[0, 3] = torch.tensor([0.1, 0.4, 0.2, 0.3])
    recall_of = recall_rows(weights, torch.tensor([[3, 1, 3, 3]]))
    torch.testing.assert_close(recall_of, torch.tensor([[1, 1, 1, 0.6], [1, 1, 1, 0.75]]))


def test_map_layers_gives_the_eager_attention_and_restores_the_implementation(tiny_factory, make_ids) -> None:
    llama_gqa = tiny_factory("llama_gqa")  # (its own copy: the test switches its attention implementation)
    ids = make_ids(1, 12)
    before = llama_gqa.config._attn_implementation
    maps = map_layers(llama_gqa, ids, lambda layer, w: (layer, w.clone()))
    assert llama_gqa.config._attn_implementation == before
    assert [layer for layer, _ in maps] == [0, 1, 2]
    llama_gqa.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            expected = llama_gqa(ids, output_attentions=True).attentions
    finally:
        llama_gqa.set_attn_implementation(before)
    for (_, got), want in zip(maps, expected, strict=True):
        torch.testing.assert_close(got, want[0])


@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "streaming_llm"])
def test_recall_rows_hide_exactly_what_the_policy_evicted(llama_gqa, make_ids, policy) -> None:
    """What recall_rows hides from each query (given held_steps) = the columns the kvsieve cache's own attention is
    zero on, streaming the same tokens one at a time: no mass of the cache's attention is hidden, and as many keys
    are hidden as it has zeros."""
    n, budget = 24, 6
    ids = make_ids(1, n)
    held = held_steps(llama_gqa, kvsieve.make_cache(llama_gqa, policy, budget), ids, budget)
    cache = kvsieve.make_cache(llama_gqa, policy, budget)
    rows = torch.zeros(len(held), 4, n, n)  # [layer, query head, query, key]: the cache's attention
    with torch.inference_mode():
        llama_gqa(ids[:, :budget], cache=cache)
        for i in range(budget, n):
            attentions = llama_gqa(ids[:, i : i + 1], cache=cache, output_attentions=True).attentions
            for layer, attention in enumerate(attentions):
                rows[layer, :, i, : i + 1] = attention[0, :, 0]
    ones = torch.ones(4, n, n).tril()
    for layer, last in enumerate(held):
        assert torch.equal(recall_rows(rows[layer], last)[:, budget:], torch.ones(4, n - budget))
        hidden = 1 - recall_rows(ones, last)[:, budget:]
        zeros = (rows[layer, :, budget:] == 0).sum(-1) - torch.arange(n - 1 - budget, -1, -1)  # (future keys)
        assert torch.equal(hidden, zeros.float())
    assert sum((1 - recall_rows(ones, last)).sum() for last in held) > 0  # something was evicted


def test_recall_is_one_for_full_and_less_for_a_small_budget(llama_gqa, make_ids) -> None:
    result = recall(llama_gqa, make_ids(1, 40), ["full", "h2o"], budget=4, progress=True)
    full, h2o = result.policies
    assert result.first_step == result.budget_tokens == 4
    assert full.mean == 1.0 and full.loss == 0.0
    assert set(full.per_layer) == {1.0} and set(full.curve) == {1.0}
    assert len(full.curve) == 36 and len(h2o.per_layer) == 3
    assert 0 < h2o.mean < 1 and h2o.loss == pytest.approx(1 - h2o.mean)
    assert max(h2o.curve) <= 1


def test_positions_counts_every_kept_token(llama_gqa, make_ids) -> None:
    n, budget = 40, 8  # 20 bins of 2 positions
    result = positions(llama_gqa, make_ids(1, n), ["h2o", "streaming_llm", "full"], budget=budget, progress=True)
    h2o, streaming, full = result.policies
    assert (result.layers, result.kv_heads) == (3, 2)
    assert h2o.kept == sum(h2o.counts) == budget * 3 * 2
    assert full.kept == sum(full.counts) == n * 3 * 2 and set(full.counts) == {12}
    # streaming_llm keeps the 4 sink tokens (bins 0-1) and the 4 most recent (bins 18-19) in each layer and head.
    assert streaming.counts == [12, 12] + [0] * 16 + [12, 12]
    assert result.bin_edges == list(range(0, 41, 2))
    assert result.accumulated is not None and sum(result.accumulated) == pytest.approx(n, rel=1e-5)
    assert positions(llama_gqa, make_ids(1, n), ["streaming_llm"], budget=budget).accumulated is None


# -- the command line, on the real model ----------------------------------------------------------------------


def _analyze(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, *argv: str) -> dict:
    out = tmp_path / name
    assert main(["analyze", name, "--max-tokens", "64", "--out", str(out), *argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["analysis"] == name and result["tokens"] == 64
    assert result["files"] == {"png": str(out / f"{name}.png"), "markdown": str(out / f"{name}.md")}
    assert (out / f"{name}.png").stat().st_size > 10_000
    assert (out / f"{name}.md").read_text().startswith(f"# {name}: ")
    return result


@pytest.mark.slow
def test_cli_sparsity(capsys, tmp_path) -> None:
    result = _analyze(capsys, tmp_path, "sparsity")
    means = list(result["mean_top_mass"].values())
    assert means == sorted(means) and means[0] > 0 and means[-1] <= 1
    assert len(result["near_zero"]) == 30 and all(0 <= v <= 1 for v in result["near_zero"])
    assert result["rows"] == 64 - MIN_KEYS + 1


@pytest.mark.slow
def test_cli_powerlaw(capsys, tmp_path) -> None:
    result = _analyze(capsys, tmp_path, "powerlaw")
    assert result["exponent"] > 0 and 0 < result["r2"] <= 1 and len(result["layer_exponents"]) == 30
    assert result["sorted_mean"] == sorted(result["sorted_mean"], reverse=True)
    assert sum(result["sorted_mean"]) == pytest.approx(64, rel=1e-4)  # every query row holds mass 1


@pytest.mark.slow
def test_cli_persistence(capsys, tmp_path) -> None:
    result = _analyze(capsys, tmp_path, "persistence")
    assert (result["t"], result["map_layer"]) == (32, 15)
    pairs = list(zip(result["ratio"], result["early_ratio"], strict=True))
    assert len(pairs) == 30 and all(0 <= r <= e <= 1 for r, e in pairs)


@pytest.mark.slow
def test_cli_positions(capsys, tmp_path) -> None:
    result = _analyze(capsys, tmp_path, "positions", "--policies", "h2o", "streaming_llm", "--budget", "16")
    assert [p["policy"] for p in result["policies"]] == ["h2o", "streaming_llm"]
    assert all(sum(p["counts"]) == 16 * 30 * 3 for p in result["policies"])
    assert len(result["accumulated"]) == 64


@pytest.mark.slow
def test_cli_entropy(capsys, tmp_path) -> None:
    result = _analyze(capsys, tmp_path, "entropy")
    assert result["mean"][0] == pytest.approx(0, abs=1e-6)  # the first row has one key
    assert result["uniform"][63] == pytest.approx(math.log(64))
    assert all(0 <= h <= u + 1e-5 for h, u in zip(result["mean"], result["uniform"], strict=True))


@pytest.mark.slow
def test_cli_recall(capsys, tmp_path) -> None:
    result = _analyze(capsys, tmp_path, "recall", "--policies", "full", "h2o", "--budget", "0.25")
    full, h2o = result["policies"]
    assert result["budget_tokens"] == 16 and full["mean"] == 1.0 and 0 < h2o["mean"] < 1


@pytest.mark.slow
def test_cli_prints_the_markdown_summary(capsys, tmp_path) -> None:
    assert main(["analyze", "entropy", "--max-tokens", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# entropy: {ANALYSES['entropy']}")
    assert "model smollm2-135m" in out and str(tmp_path / "entropy.md") in out


@pytest.mark.usefixtures("no_model")
def test_cli_unknown_policy_fails_before_loading(capsys) -> None:
    assert main(["analyze", "recall", "--policies", "h2o", "nope", "--json"]) == 2
    assert "nope" in json.loads(capsys.readouterr().out)["error"]
