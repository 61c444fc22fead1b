"""scripts/ruler_overlap.py: the grid's first samples answered one at a time and with the next samples joining give
the same answers from as many prompt passes in fewer decode steps; the comparison renders for the docs."""

from __future__ import annotations

import copy
import json

import torch
from script_support import load_script, provenance_of

import kvsieve.ruler.predict as ruler_predict
from kvsieve.results import render_file

script = load_script("ruler_overlap")


def test_both_arms_answer_alike_and_joining_takes_fewer_steps(tiny_lm, monkeypatch) -> None:
    model, tok = tiny_lm
    model = copy.deepcopy(model).to(torch.float64)  # (round-off cannot decide a near-tie)
    monkeypatch.setattr(ruler_predict, "max_new_tokens", lambda task: 3 + len(task) % 3)
    work = script.units(tok, 200, 3)
    assert [(s.task, s.index) for s, *_ in work] == [("niah_single_1", 0), ("niah_single_2", 0), ("niah_single_3", 0)]
    assert len(work[0][2]) == 141  # (the default grid)
    alone, alone_texts = script.arm(model, tok, work, together=False, kv_memory=10**12)
    joined, joined_texts = script.arm(model, tok, work, together=True, kv_memory=10**12)
    assert alone_texts == joined_texts and len(alone_texts) == 3 * 141
    assert alone["prompt_passes"] == joined["prompt_passes"] == 3 + 3  # (and kvzip's probe of each sample)
    assert joined["decode_steps"] < alone["decode_steps"] and joined["rows_per_step"] > alone["rows_per_step"]
    assert alone["correct"] == joined["correct"]


def test_the_comparison_renders(tmp_path) -> None:
    arm = {
        "seconds": 100.0,
        "prompt_passes": 2,
        "prompt_s": 30.0,
        "question_s": 10.0,
        "decode_steps": 300,
        "decode_s": 55.0,
        "few_row_steps": 120,
        "few_row_s": 20.0,
        "rows_per_step": 40.0,
        "correct": 150,
    }
    result = {
        "length": 4096,
        "dtype": "float32",
        "samples": ["vt #0", "qa #0"],
        "settings": 113,
        "kv_memory_gib": 9.5,
        "order": ["one_at_a_time", "together"],
        "one_at_a_time": arm,
        "together": arm | {"seconds": 80.0, "decode_steps": 180, "few_row_steps": 3},
        "answers": 226,
        "same_text": 220,
        "speedup": 1.25,
        "peak_rss_gib": 7.0,
    }
    provenance = provenance_of("scripts/ruler_overlap.py", "--samples", "2")
    (tmp_path / "o.json").write_text(json.dumps({"results": [result], "provenance": provenance}))
    page = render_file(tmp_path / "o.json")
    assert "**1.25× faster** with the next samples joining; 220 of the 226 answers" in page
    assert "| decode steps | 300 | 180 |" in page and "| steps of at most 8 rows | 120 | 3 |" in page
    assert "|  | one sample at a time | the next samples joining |" in page
