"""scripts/ruler_cost.py: the forward passes of a grid recorded, the plain model's step beside them, and the grid's
decode steps rendered for the docs."""

from __future__ import annotations

import json

import torch
from script_support import load_script, provenance_of

from kvsieve.results import render_file

script = load_script("ruler_cost")


def test_each_forward_pass_is_recorded_with_its_rows_and_tokens(tiny_lm) -> None:
    model, _ = tiny_lm
    with torch.inference_mode(), script.forward_passes(model) as passes:
        model(input_ids=torch.ones((3, 7), dtype=torch.long))
        model(input_ids=torch.ones((2, 1), dtype=torch.long))
    assert [(rows, tokens) for rows, tokens, _ in passes] == [(3, 7), (2, 1)]
    assert all(seconds > 0 for *_, seconds in passes)
    model(input_ids=torch.ones((1, 2), dtype=torch.long))  # (the hooks are gone once closed)
    assert len(passes) == 2
    assert 0 < script.plain_step(model, 4, rounds=2) < 10


def test_a_grid_renders_its_decode_steps_beside_the_plain_model(tmp_path) -> None:
    grid = {
        "settings": 3, "prefill_s": 2.0, "question_s": 1.0, "answers_s": 3.0, "total_s": 6.0, "alone_s": 18.0,
        "speedup": 3.0, "correct": 1, "prompt_passes": 1,
        "decode_steps": [{"rows": 1, "steps": 5, "seconds": 1.2, "plain_s": 1.0},
                         {"rows": 3, "steps": 2, "seconds": 1.7, "plain_s": 0.5}],
    }  # fmt: skip
    rows = [{"policy": "full", "first_token_s": 2.0, "answer_s": 0.5, "tokens": 4, "correct": True}]
    result = {"length": 100, "dtype": "float32", "rows": rows, "grid": grid, "peak_rss_gib": 1.0}
    provenance = provenance_of("scripts/ruler_cost.py", "--grid")
    (tmp_path / "c.json").write_text(json.dumps({"results": [result], "provenance": provenance}))
    page = render_file(tmp_path / "c.json")
    assert "1 prompt pass(es); the answers' 7 decode steps" in page
    assert "| 1 | 5 | 1.2 | 1.0 |" in page and "| 3 | 2 | 1.7 | 0.5 |" in page
