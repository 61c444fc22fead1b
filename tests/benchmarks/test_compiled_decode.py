"""scripts/compiled_decode.py: eager and compiled decode steps of a tiny model, the same greedy tokens, two traces,
and the report rendered for the docs."""

from __future__ import annotations

import json

import pytest
import torch
from script_support import load_script

from kvsieve.results import render_file

script = load_script("compiled_decode")


@pytest.mark.slow
def test_compiled_decode_reports_both_modes_and_renders(tiny_dir, tmp_path, capsys) -> None:
    out = tmp_path / "compiled.json"
    argv = ["--model", tiny_dir, "--policies", "h2o", "dynamic_full", "--prompt", "40", "--budget", "16"]
    script.main([*argv, "--steps", "3", "--rounds", "2", "--out", str(out)])
    torch._dynamo.reset()
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["results"]] == ["h2o", "dynamic_full"]
    for r in report["results"]:
        assert r["same_tokens"] and r["first_difference"] is None
        assert r["traces"] == 2  # (the counters, or the DynamicCache's length, made symbolic at the second)
        assert len(r["rounds_ms"]["eager"]) == len(r["rounds_ms"]["compiled"]) == 2
        assert r["speedup"] == pytest.approx(r["eager_step_ms"] / r["compiled_step_ms"])
    assert report["provenance"]["command"][0] == "scripts/compiled_decode.py"
    page = render_file(out)
    assert "| `h2o` |" in page and "| `dynamic_full` |" in page and "2 in " in page
    assert "scripts/compiled_decode.py" in page
    assert "h2o" in capsys.readouterr().out
