"""scripts/ruler_floor.py: the passes of a `kvsieve ruler` grid counted from its directory, their FLOPs by hand,
and the report rendered for the docs."""

from __future__ import annotations

import json

import pytest
from script_support import load_script
from transformers import LlamaConfig

import kvsieve.ruler.predict as ruler_predict
from kvsieve.results import render_file
from kvsieve.ruler.predict import Setting
from kvsieve.ruler.run import GridSettings, grid_settings, run_ruler, sources
from kvsieve.ruler.tasks import Prompter

script = load_script("ruler_floor")


def test_flops_by_hand() -> None:
    config = LlamaConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=4, vocab_size=10,
    )  # fmt: skip
    body, head = script.weights(config)
    assert (body, head) == (2 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16), 10 * 8) == (1152, 80)
    sample = {"prompt": 3, "question": 4, "question_rows": 2, "decode": 5}
    assert script.flops(sample, body, head, config) == {
        "prompt": 2 * 1152 * 3 + 2 * 80 + 4 * 2 * 8 * (1 + 2 + 3),  # (query i attends i keys: 6 pairs a layer)
        "question": 2 * 1152 * 4 + 2 * 80 * 2,
        "answers": (2 * 1152 + 2 * 80) * 5,
    }


def test_a_grid_is_counted_from_its_cells_and_rendered(tiny_lm, tiny_dir, tmp_path, monkeypatch, capsys) -> None:
    model, tokenizer = tiny_lm
    monkeypatch.setattr(ruler_predict, "max_new_tokens", lambda task: 4)
    settings = grid_settings(["full", "h2o"], [0.5], ["agnostic", "aware"])
    grid = GridSettings(model=tiny_dir, dtype="float32", seed=0, haystack="wikipedia")
    run = tmp_path / "run"
    got = lambda: sources(with_reading=False)  # noqa: E731
    run_ruler(model, tokenizer, run, got, grid, ["niah_single_2", "vt"], [256], settings, 2, progress=False)

    samples = {tuple(s["sample"]): s for s in script.counts(run, Prompter(tokenizer))}
    assert sorted(samples) == [("niah_single_2", 256, 0), ("niah_single_2", 256, 1), ("vt", 256, 0), ("vt", 256, 1)]
    stored = {}
    for path in (run / "samples").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            stored[(r["task"], r["length"], r["index"])] = r["tokens"]
    decoded, answered = dict.fromkeys(samples, 0), {key: [] for key in samples}
    for path in (run / "cells").glob("*.json"):
        cell = json.loads(path.read_text())
        for index, p in cell["predictions"].items():
            decoded[(cell["settings"]["task"], 256, int(index))] += p["answer_tokens"] - 1
            answered[(cell["settings"]["task"], 256, int(index))].append(p["answer_tokens"])
    for key, s in samples.items():
        assert s["settings"] == 3 and s["question_rows"] == 1  # (the full cache, and h2o under each protocol)
        assert s["prompt"] == stored[key]  # (the tokens the generator counted)
        assert 0 < s["question"] < s["prompt"] // 2
        assert s["decode"] == decoded[key] == sum(s["steps"])
        longest = max(answered[key])
        assert len(s["steps"]) == longest - 1  # (a step per answer token after the first, for the longest answer)
        assert s["steps"] == [sum(n > step for n in answered[key]) for step in range(1, longest)]

    cost = tmp_path / "cost.json"  # (a scripts/ruler_cost.py --grid result, two threads)
    rows = [{"policy": "full", "first_token_s": 3.0}, {"policy": "h2o", "first_token_s": 4.0}]
    grid = {"prefill_s": 5.0, "question_s": 1.5, "answers_s": 7.25}
    cost.write_text(json.dumps({"results": [{"length": 250, "dtype": "float32", "rows": rows, "grid": grid}],
                                "provenance": {"threads": 2}}))  # fmt: skip
    out = tmp_path / "floor.json"
    script.main([str(run), "--dtypes", "float32", "--timed", str(cost), "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["model"] == tiny_dir and report["rows"]["answers"] == 3
    grid_sums = report["phases"]["grid"]
    assert grid_sums["samples"] == 4 and grid_sums["decode_tokens"] == sum(decoded.values())
    assert grid_sums["prompt_tokens"] == sum(stored.values())
    assert report["phases"]["vt"]["samples"] == 2
    assert all(grid_sums[f"{p}_float32_s"] > 0 for p in ("prompt", "question", "answers"))
    page = render_file(out)
    hours = sum(grid_sums[f"{p}_float32_s"] for p in ("prompt", "question", "answers")) / 3600
    assert "| **the grid (4 samples)** |  | " in page and f"**{hours:.2f}** |" in page
    assert f"| {sum(stored.values()):,} |" in page and "scripts/ruler_floor.py" in page
    assert "at least" in capsys.readouterr().out
    steps = sum(len(s["steps"]) for s in samples.values())
    assert sum(report["steps_by_rows"].values()) == steps and f"The answers' {steps:,} decode steps" in page
    assert f"| 1 to 3 | {steps:,} |" in page  # (three settings: every step decodes 1 to 3 rows)
    task = report["phases"]["niah_single_2"]
    assert report["timed"]["cpu_s"]["float32"] == {"prompt": 10.0, "question": 3.0, "answers": 14.5, "alone": 6.0}
    floor = f"{task['answers_float32_s'] / 2:.1f}"
    assert f"| the answers | {floor} | 14.5 |" in page and "alone took 6.0 in float32 CPU seconds" in page
    assert "A `niah_single_2` sample of 250 tokens" in page and "the grid's 2 `niah_single_2` samples" in page


def test_a_tiny_phase_is_not_rounded_to_zero() -> None:
    assert [script.rounded(v) for v in (0.0, 1234.56789, 0.0123456, 0.000123456)] == [0.0, 1234.568, 0.012, 0.000123]


def test_cells_of_two_models_are_refused(tmp_path) -> None:
    (tmp_path / "cells").mkdir()
    for i, model in enumerate(["a", "b"]):
        (tmp_path / "cells" / f"{i}.json").write_text(json.dumps({"settings": {"model": model}}))
    with pytest.raises(ValueError, match="the cells of one model"):
        script.model_of(tmp_path)


def test_a_setting_compresses_the_context_alone_only_agnostic_and_bounded() -> None:
    assert Setting("agnostic", "h2o", 0.5).compresses_context
    assert not Setting("aware", "h2o", 0.5).compresses_context
    assert not Setting("agnostic", "full", 0.0).compresses_context
    assert Setting("agnostic", "dynamic_full", 0.5).compresses_context
