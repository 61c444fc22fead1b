"""The benchmark harness: the floor cache, run order, figures and their consistency, the eviction-overhead checks,
memory-cap batches, the CLI. No timing assertions: only the relations between the figures are checked."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from kvsieve.benchmarks import (
    bench,
    capacity,
    eviction_overhead,
    grid,
    memory,
    profile,
    report,
    runner,
    stream_engine,
)
from kvsieve.benchmarks.floor import FloorCache
from kvsieve.cli import main
from kvsieve.policies import REGISTRY

REQUIRED = (
    "policy",
    "budget_tokens",
    "prompt_tokens",
    "gen_tokens",
    "batch",
    "prefill_s",
    "decode_tok_s",
    "throughput_tok_s",
    "step_ms_p50",
    "step_ms_p90",
    "peak_rss_mb",
    "kv_bytes",
)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    """A private tiny GQA Llama (the harness switches attention implementations, so no shared fixture)."""
    return tiny_factory("llama_gqa")


def _kv_bytes_per_slot(model) -> int:
    """K/V bytes per token slot and batch row, over all layers."""
    return memory.full_kv_bytes_per_token(model)


# -- the floor -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [5, 20])
def test_floor_holds_budget_tokens_and_the_new_one_in_as_many_slots(tiny, make_ids, prompt):
    """The ring has ``budget + 1`` slots, as an evicting cache at that budget allocates (its held tokens and the new
    one, attended together before it evicts), and holds the newest tokens."""
    budget, steps, batch = 8, 6, 2
    tiny.set_attn_implementation("sdpa")
    floor, full = FloorCache(budget, tiny.config.num_hidden_layers), DynamicCache(config=tiny.config)
    with torch.inference_mode():
        for cache in (floor, full):
            tiny(make_ids(batch, prompt), cache=cache, use_cache=True)
            for t in range(steps):
                tiny(make_ids(batch, 1, seed=10 + t), cache=cache, use_cache=True)
    seen, slots = prompt + steps, budget + 1
    assert floor.get_seq_length() == seen
    assert all(layer.keys.shape[2] == slots == layer.values.shape[2] for layer in floor.layers)
    assert memory.kv_nbytes(floor) == batch * slots * _kv_bytes_per_slot(tiny)
    sieve = kvsieve.make_cache(tiny, "local", budget)
    with torch.inference_mode():
        tiny(make_ids(batch, prompt), cache=sieve)
        tiny(make_ids(batch, 1), cache=sieve)
    assert memory.kv_nbytes(sieve) == memory.kv_nbytes(floor)
    # Layer 0's keys depend only on token and position: the ring holds the newest tokens, position p in slot p % S.
    ring, reference = floor.layers[0].keys, full.layers[0].keys
    for p in range(seen - slots, seen):
        torch.testing.assert_close(ring[:, :, p % slots], reference[:, :, p])


def test_floor_takes_one_prompt_then_single_tokens(tiny, make_ids):
    tiny.set_attn_implementation("sdpa")
    floor = FloorCache(4, tiny.config.num_hidden_layers)
    with torch.inference_mode():
        tiny(make_ids(1, 6), cache=floor, use_cache=True)
        with pytest.raises(ValueError, match="single tokens"):
            tiny(make_ids(1, 2), cache=floor, use_cache=True)


# -- order, grid, ratios -------------------------------------------------------------------------------------------


def test_rounds_alternate_direction():
    assert grid.rounds(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    with pytest.raises(ValueError):
        grid.rounds(["a"], 0)


def test_run_bench_runs_repeats_in_rounds(tiny, make_ids, monkeypatch):
    calls = []

    def fake_round(model, policies, budget_tokens, ids, gen):
        calls.append((list(policies), ids.shape[1]))
        return {p: runner.Run(1.0, [0.1] * (gen - 1), 100, 200, 10, 0, budget_tokens) for p in policies}

    monkeypatch.setattr(grid, "measure_round", fake_round)
    plan = grid.make_plan([(40, 3), (24, 3)], [1], ["h2o"])
    cells, skipped = grid.run_bench(tiny, make_ids(1, 64)[0], plan, budget=8, repeats=2, progress=False)
    assert skipped == []
    order = ["dynamic_full", "floor", "h2o"]
    assert calls == [(order, 32)] + [(o, n) for n in (40, 24) for o in (order, order[::-1])]  # warm-up, then rounds
    assert [(c.prompt_tokens, c.policy) for c in cells] == [(n, p) for n in (40, 24) for p in order]


def test_a_round_prefills_in_turn_then_decodes_in_lockstep(tiny, make_ids, monkeypatch):
    order = []
    next_token = runner.next_token

    def recording(model, cache, ids):
        order.append((type(cache).__name__, ids.shape[1], model.config._attn_implementation))
        return next_token(model, cache, ids)

    monkeypatch.setattr(runner, "next_token", recording)
    runs = runner.measure_round(tiny, ["floor", "h2o", "dynamic_full"], 8, make_ids(1, 20), 4)
    kinds = [("FloorCache", "sdpa"), ("SieveCache", "kvsieve"), ("DynamicCache", "sdpa")]
    assert order == [(c, 20, a) for c, a in kinds] + [(c, 1, a) for c, a in kinds] * 3
    assert [len(r.step_s) for r in runs.values()] == [3, 3, 3]
    assert runs["dynamic_full"].kv_bytes == 23 * _kv_bytes_per_slot(tiny)  # 20 + 3 tokens
    assert all(r.peak_rss >= r.base_rss for r in runs.values())
    with pytest.raises(ValueError, match="once per round"):
        runner.measure_round(tiny, ["h2o", "h2o"], 8, make_ids(1, 20), 4)


def _run(prefill: float, steps: list[float]) -> runner.Run:
    return runner.Run(prefill, steps, 0, 0, 0, 0, 1)


def test_ratios_pair_runs_of_the_same_round():
    point = runner.GridPoint(16, 3, 1)
    runs = {
        "h2o": [_run(1, [1, 1]), _run(10, [1, 1]), _run(4, [1, 1])],
        "floor": [_run(1, [1, 1]), _run(5, [1, 1]), _run(8, [1, 1])],
        "dynamic_full": [_run(1, [2, 2]), _run(1, [2, 2]), _run(1, [4, 4])],
    }
    cell = runner.summarize("h2o", point, 8, runs["h2o"], runs)
    # Per-round prefill ratios 1, 2, 0.5 -> median 1 (the ratio of the medians, 4 / 5, would be 0.8).
    assert cell.ratios["vs_floor"]["prefill_s"] == pytest.approx(1.0)
    assert cell.ratios["vs_dynamic_full"]["step_ms_p50"] == pytest.approx(0.5)
    assert cell.ratios["vs_dynamic_full"]["decode_tok_s"] == pytest.approx(2.0)
    assert set(runner.summarize("floor", point, 8, runs["floor"], runs).ratios) == {"vs_dynamic_full"}


def test_pair_lengths():
    assert grid.pair_lengths([512, 2048], [32, 256]) == [(512, 32), (2048, 256)]
    assert grid.pair_lengths([512, 2048], [8]) == [(512, 8), (2048, 8)]
    assert grid.pair_lengths([64], [4, 8]) == [(64, 4), (64, 8)]
    with pytest.raises(ValueError, match="pair up"):
        grid.pair_lengths([1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match="unknown policy"):
        grid.make_plan([(8, 2)], [1], ["nope"])
    with pytest.raises(ValueError, match="2 generated"):
        grid.make_plan([(8, 1)], [1], ["h2o"])
    with pytest.raises(ValueError, match="batch"):
        grid.make_plan([(8, 2)], [0], ["h2o"])


def test_skip_reason(tiny):
    assert grid.skip_reason(tiny, runner.GridPoint(1000, 25, 1)) is None  # 1024 positions: the last token is not fed
    assert "positions" in grid.skip_reason(tiny, runner.GridPoint(1000, 26, 1))
    assert "memory" in grid.skip_reason(tiny, runner.GridPoint(1000, 2, 10**9))


# -- measured figures ----------------------------------------------------------------------------------------------


def test_cells_fields_and_consistency(tiny, make_ids, tmp_path):
    budget, gen = 8, 4
    plan = grid.make_plan([(24, gen), (40, gen)], [1, 2], ["h2o", "local"])
    cells, skipped = grid.run_bench(tiny, make_ids(1, 64)[0], plan, budget=budget, repeats=2, progress=False)
    assert skipped == []
    assert [c.policy for c in cells[:4]] == ["dynamic_full", "floor", "h2o", "local"]
    per_slot = _kv_bytes_per_slot(tiny)
    for c in cells:
        d = c.to_dict()
        assert all(key in d for key in REQUIRED)
        assert c.repeats == 2
        assert c.step_ms_p50 <= c.step_ms_p90
        assert c.throughput_tok_s == pytest.approx(c.batch * gen / (c.prefill_s + c.decode_s))
        assert c.decode_tok_s == pytest.approx(c.batch * (gen - 1) / c.decode_s)
        assert c.peak_rss_mb >= c.rss_growth_mb >= 0
        held = c.prompt_tokens + gen - 1 if c.policy == "dynamic_full" else budget + 1  # (the floor too)
        assert c.tokens_held == held
        assert c.kv_bytes == c.batch * held * per_slot
        assert (c.state_bytes > 0) == (c.policy in ("h2o", "local"))
        assert set(c.ratios) == {f"vs_{r}" for r in runner.REFERENCES if r != c.policy}
        assert (c.budget_tokens is None) == (c.policy == "dynamic_full")
    full = {(c.prompt_tokens, c.batch): c.kv_bytes for c in cells if c.policy == "dynamic_full"}
    assert full[(40, 1)] > full[(24, 1)] and full[(24, 2)] == 2 * full[(24, 1)]
    png = report.plot_decode(cells, tmp_path / "decode.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_lists_top_ops(tiny, make_ids):
    result = profile.profile_decode(tiny, make_ids(1, 64)[0], budget=8, prompt=24, steps=3, top=5)
    assert result["policy"] == "h2o" and len(result["ops"]) == 5
    shares = [op["self_share"] for op in result["ops"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert any(op["op"].startswith("aten::") for op in result["ops"])


# -- the eviction-overhead checks and the memory model -----------------------------------------------------------------


def _cell(policy, prompt, ratios, budget=512, gen=256, kv_bytes=0, state_bytes=0) -> runner.Cell:
    return runner.Cell(
        policy=policy,
        budget_tokens=None if policy == "dynamic_full" else budget,
        prompt_tokens=prompt,
        gen_tokens=gen,
        batch=1,
        repeats=3,
        prefill_s=1.0,
        decode_s=1.0,
        decode_tok_s=1.0,
        throughput_tok_s=1.0,
        step_ms_p50=1.0,
        step_ms_p90=1.0,
        peak_rss_mb=1000.0,
        rss_growth_mb=prompt / 10,
        kv_bytes=kv_bytes,
        state_bytes=state_bytes,
        tokens_held=budget,
        ratios=ratios,
    )


def _vs(floor_step=1.0, full_decode=1.0, full_prefill=1.0):
    return {
        "vs_floor": {"step_ms_p50": floor_step, "prefill_s": 1.0, "decode_tok_s": 1.0, "throughput_tok_s": 1.0},
        "vs_dynamic_full": {
            "step_ms_p50": 1.0,
            "prefill_s": full_prefill,
            "decode_tok_s": full_decode,
            "throughput_tok_s": 1.0,
        },
    }


def test_eviction_overhead_checks_from_cells():
    full_kv = 8191 * 1000
    cells = [
        _cell("dynamic_full", 7936, {}, kv_bytes=full_kv),
        _cell("h2o", 7936, _vs(1.08, 1.7, 1.14), kv_bytes=512 * 1000 * 101 // 100, state_bytes=5),
        _cell("h2o", 2048, _vs(1.05)),
        _cell("local", 2048, _vs(1.02)),
        _cell("streaming_llm", 2048, _vs(1.03)),
        _cell("local", 256, _vs(9.0), gen=32),  # holds fewer tokens than the budget: no check counts it
    ]
    assert [c.passed for c in eviction_overhead.evaluate_checks(cells)] == [True] * 5 + [None]
    # Quantized slots: their own bound against the floor (1.3x), out of the others' (step, bytes: ~1/4 of plain).
    cells.append(_cell("streaming_llm:kv_bits=4", 2048, _vs(1.25), kv_bytes=4000, state_bytes=5))
    assert [c.passed for c in eviction_overhead.evaluate_checks(cells)] == [True] * 6
    cells[-1].ratios["vs_floor"]["step_ms_p50"] = 1.35
    assert [c.passed for c in eviction_overhead.evaluate_checks(cells)] == [True] * 5 + [False]
    cells.pop()
    cells[1].kv_bytes = 512 * 1000 * 103 // 100
    cells[1].ratios["vs_dynamic_full"]["decode_tok_s"] = 1.5
    cells[4].ratios["vs_floor"]["step_ms_p50"] = 1.05
    assert [c.passed for c in eviction_overhead.evaluate_checks(cells)] == [True, False, True, False, False, None]
    cells[4].ratios["vs_floor"]["step_ms_p50"] = 1.09  # over every policy's bound too
    cells[1].ratios["vs_dynamic_full"]["prefill_s"] = 1.2  # an observing policy's prefill over 1.15x sdpa's
    assert [c.passed for c in eviction_overhead.evaluate_checks(cells)][:3] == [False, False, False]
    cells[1].rss_growth_mb = 2000.0  # 10x the growth at 2048 tokens for 3.9x the tokens: superlinear
    assert eviction_overhead.evaluate_checks(cells)[2].passed is False
    assert [c.passed for c in eviction_overhead.evaluate_checks([])] == [None] * 6


def test_eviction_overhead_preset_runs_its_cells_at_batch_1(tiny):
    plan = eviction_overhead.preset_plan()
    assert [(p.prompt, p.gen, p.batch) for p, _ in plan] == [(512, 32, 1), (2048, 256, 1), (7936, 256, 1)]
    bounded = [name for name, cls in REGISTRY.items() if cls.bounded]
    assert [names for _, names in plan] == [
        ["dynamic_full", "floor", "h2o"],
        ["dynamic_full", "floor", *bounded],
        ["dynamic_full", "floor", *bounded],
    ]
    assert {"local", "streaming_llm", "strided"} <= set(eviction_overhead.POSITIONAL)
    assert {"h2o", "scissorhands", "ahakv", "tova", "snapkv"} <= set(eviction_overhead.OBSERVING)
    assert "knorm" not in eviction_overhead.POSITIONAL + eviction_overhead.OBSERVING
    with pytest.raises(ValueError, match="unknown preset"):
        bench.benchmark(tiny, None, preset="nope")


def test_memory_model_on_synthetic_numbers():
    mib = memory.MIB
    # Growth 300 MiB per row (200 MiB of it K/V: 100 tokens of 2 MiB) plus 100 MiB that does not grow with the batch.
    samples = [memory.MemSample(b, 1000 * mib, (1000 + 100 + 300 * b) * mib, 200 * mib * b, 100) for b in (1, 4)]
    mem = memory.MemoryModel.fit(400 * mib, samples)
    assert mem.kv_bytes_per_token == pytest.approx(2 * mib)
    assert mem.act_bytes_per_seq == pytest.approx(100 * mib)
    assert mem.runtime_bytes == pytest.approx(700 * mib)
    assert mem.peak(10) == pytest.approx((1100 + 3000) * mib)
    assert mem.max_batch(4000 * mib) == 9  # (4000 - 1100) / 300 = 9.67
    assert mem.max_batch(1000 * mib) == 0
    single = memory.MemoryModel.fit(400 * mib, samples[:1])  # one batch size: all growth counts per row
    assert single.act_bytes_per_seq == pytest.approx(200 * mib)
    assert single.max_batch(4000 * mib) == math.floor(3000 / 400)


def test_max_batches_predicts_and_verifies(tiny, make_ids):
    tokens = make_ids(1, 64)[0]
    plan = grid.make_plan([(24, 3)], [1, 2], ["h2o"])
    cells, _ = grid.run_bench(tiny, tokens, plan, budget=8, repeats=1, progress=False)
    cap = (max(c.peak_rss_mb for c in cells) + 16) * memory.MIB
    rows = capacity.max_batches(tiny, tokens, cells, cap, budget=8)
    assert [r["policy"] for r in rows] == ["dynamic_full", "h2o"]
    for row in rows:
        assert row["max_batch"] >= 1 and row["predicted_peak_mb"] <= row["cap_mb"]
        assert isinstance(row["verified"], bool) and row["verified_peak_mb"] > 0
    assert rows[0]["tokens_held"] == 26 and rows[1]["tokens_held"] == 9


# -- CLI -----------------------------------------------------------------------------------------------------------


def test_cli_bench_json(capsys):
    argv = [
        "bench",
        "--json",
        "--prompt-lens",
        "32",
        "--gen-lens",
        "4",
        "--batches",
        "1",
        "--repeats",
        "1",
        "--policies",
        "h2o",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert [c["policy"] for c in result["cells"]] == ["dynamic_full", "floor", "h2o"]
    for c in result["cells"]:
        assert all(key in c for key in REQUIRED)
        assert (c["prompt_tokens"], c["gen_tokens"], c["batch"]) == (32, 4, 1)
    assert len(result["checks"]) == 6
    assert "checks of the eviction-overhead preset:" in report.format_report(result)


# -- the stream-engine preset --------------------------------------------------------------------------------------


def test_stream_engine_pairs_each_policy_with_the_token_by_token_engine_and_full(tiny, make_ids, monkeypatch):
    """Per round: the policy's whole stream, its token-by-token stream, ``full``'s whole stream; the figures are
    medians of the per-round ratios; the check needs 15x from every policy."""
    calls = []
    rates = iter([100.0, 10.0, 200.0, 160.0, 10.0, 400.0, 120.0, 6.0, 150.0, 90.0, 6.0, 100.0])

    warm = stream_engine.BUDGET + 1 + stream_engine.WARM_UP_TOKENS

    def streamed(model, ids, policy, engine):
        calls.append((policy, engine, ids.shape[-1]))
        if ids.shape[-1] == warm:  # (the warm-up: untimed)
            return 0.0, 5.0
        if (policy, engine) == ("full", "whole") or engine == "decode" or ids.shape[-1] == stream_engine.LENGTH:
            return next(rates), 5.0
        return 0.0, 5.0

    monkeypatch.setattr(stream_engine, "_streamed", streamed)
    ids = make_ids(1, stream_engine.LENGTH)[0]
    result = stream_engine.stream_engine(tiny, ids, ["h2o", "local"], repeats=2, progress=False)
    prefix = stream_engine.BUDGET + 1 + stream_engine.DECODE_TOKENS
    full = stream_engine.LENGTH
    h2o = [("h2o", "whole", full), ("h2o", "decode", prefix), ("h2o", "whole", prefix), ("full", "whole", full)]
    local = [(p if p == "full" else "local", e, n) for p, e, n in h2o]
    warm_up = [(name, engine, warm) for name in ("full", "h2o", "local") for engine in ("whole", "decode")]
    assert calls == warm_up + h2o + local + local + h2o  # (the second round in reverse order)
    rows = {row["policy"]: row for row in result["stream_engine"]}
    assert rows["h2o"]["speedup"] == pytest.approx((10 + 15) / 2)  # 100 / 10 then 90 / 6
    assert rows["h2o"]["of_full"] == pytest.approx((0.5 + 0.9) / 2)
    assert rows["local"]["speedup"] == pytest.approx((16 + 20) / 2) and rows["local"]["full_tok_s"] == 275
    assert result["checks"][0]["passed"] is False
    text = report.format_report(result)
    assert "of full" in text and "0.70x" in text


def test_stream_engine_on_a_tiny_model(tiny, make_ids):
    """A real run: both engines give the same perplexity over the tokens both streamed; every rate is positive."""
    ids = make_ids(1, stream_engine.LENGTH)[0]
    result = stream_engine.stream_engine(tiny, ids, ["h2o"], progress=False)
    (row,) = result["stream_engine"]
    assert row["ppl_whole_prefix"] == pytest.approx(row["ppl_decode_prefix"], rel=1e-5)
    assert min(row["whole_tok_s"], row["decode_tok_s"], row["full_tok_s"], row["of_full"]) > 0
