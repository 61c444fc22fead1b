"""scripts/ruler_replay.py: a sample's groups of settings filled by a model pass each or by replaying the first
group's pass hold the same tokens, with one model pass of the prompt; the comparison renders for the docs."""

from __future__ import annotations

import copy
import json

import torch
from script_support import load_script, provenance_of

from kvsieve.results import render_file
from kvsieve.ruler import run
from kvsieve.ruler.tasks import Prompter, generate_samples

script = load_script("ruler_replay")
ruler_cost = load_script("ruler_cost")


def test_replayed_groups_hold_what_their_own_passes_leave(tiny_lm) -> None:
    model, tok = tiny_lm
    model = copy.deepcopy(model).to(torch.float64)
    prompter = Prompter(tok)
    (sample,) = generate_samples(script.TASK, 200, 1, prompter, run.sources(with_reading=False), seed=0)
    prompt = prompter.ids(sample.context, sample.question, sample.answer_prefix)
    settings = run.grid_settings(["full", "h2o", "snapkv", "streaming_llm"], [0.5, 0.9], ["agnostic", "aware"])
    groups = script.groups_of(settings, 3)
    assert [len(g) for g in groups] == [5, 5, 3] and [s for g in groups for s in g] == settings
    arms = {}
    for replay in (False, True):
        with ruler_cost.forward_passes(model) as passes:
            arms[replay] = script.fill(model, prompt, groups, replay)
        prompt_passes = sum(1 for rows, tokens, _ in passes if tokens == len(prompt[0]) + len(prompt[1]))
        assert prompt_passes == (1 if replay else 3)
    (_, own, none), (_, replayed, recorded) = arms[False], arms[True]
    assert none == 0 and recorded > 0 and len(own) == len(replayed) == len(settings)
    for a, b in zip(own, replayed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_comparison_renders(tmp_path) -> None:
    result = {
        "length": 4066,
        "dtype": "float32",
        "settings": 113,
        "groups": [57, 56],
        "rounds": 2,
        "passes": {"group_s": [26.1, 18.6], "total_s": 44.7},
        "replay": {"group_s": [24.4, 8.8], "total_s": 33.3},
        "later_speedup": 2.11,
        "speedup": 1.34,
        "recorded_gib": 0.21,
        "same_caches": 113,
        "peak_rss_gib": 4.1,
    }
    provenance = provenance_of("scripts/ruler_replay.py", "--groups", "2")
    (tmp_path / "r.json").write_text(json.dumps({"result": result, "provenance": provenance}))
    page = render_file(tmp_path / "r.json")
    assert "the later groups **2.11× faster** replaying the first group's pass, all groups 1.34×" in page
    assert "| a model pass per group | 26.1 | 18.6 | 44.7 |" in page
    assert "| group 1 (57 settings) s | group 2 (56 settings) s |" in page
    assert "113 of the 113 caches hold the same tokens" in page
