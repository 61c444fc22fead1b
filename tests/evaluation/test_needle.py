"""Passkey retrieval: prompt construction, scoring, the heat map."""

from __future__ import annotations

import pytest

from kvsieve.data import builtin_text
from kvsieve.evaluation.needle import (
    NEEDLE,
    QUESTION,
    NeedleCell,
    build_prompt,
    passkey_found,
    passkey_prompts,
    plot_needle,
    run_needle,
)


def test_prompt_has_the_needle_at_the_requested_depth_and_about_the_length(tokenizer):
    hay = tokenizer(builtin_text(min_chars=20000), add_special_tokens=False).input_ids
    for depth in (0.0, 0.5, 1.0):
        prompt = build_prompt(tokenizer, hay, 300, depth, 12345, offset=100)
        needle_at = prompt.index(NEEDLE.format(key=12345))
        assert prompt.endswith(QUESTION)
        assert abs(len(tokenizer(prompt, add_special_tokens=False).input_ids) - 300) <= 4
        share = needle_at / len(prompt)
        assert abs(share - depth) < 0.1, (depth, share)
    with pytest.raises(ValueError, match="too short"):
        build_prompt(tokenizer, hay, 20, 0.5, 12345, offset=0)


@pytest.mark.slow
def test_full_cache_finds_a_late_needle_and_a_tiny_local_window_loses_an_early_one(real_model, tmp_path):
    model, tok = real_model
    hay = builtin_text(min_chars=20000)
    found = run_needle(model, tok, hay, lengths=[200], depths=[0.0, 1.0], trials=2, policy="full", progress=False)
    lost = run_needle(model, tok, hay, lengths=[200], depths=[0.0], trials=2, policy="local", budget=16, progress=False)
    assert sum(c.correct for c in found) >= 3
    assert lost[0].correct == 0
    assert all(len(c.answers) == 2 for c in [*found, *lost])
    png = plot_needle(found + lost, tmp_path / "needle.png")
    assert png.stat().st_size > 1000


def test_bad_grid_arguments_are_rejected(tiny_lm):
    model, tok = tiny_lm
    with pytest.raises(ValueError, match="depths"):
        run_needle(model, tok, "text " * 500, lengths=[100], depths=[1.5], progress=False)
    with pytest.raises(ValueError, match="at least one"):
        run_needle(model, tok, "text " * 500, lengths=[], progress=False)
    assert NeedleCell(100, 0.5, 4, 3, []).accuracy == 0.75


def test_passkey_prompts_are_seeded_in_grid_order_with_distinct_keys(tokenizer):
    hay = builtin_text(min_chars=20000)
    grid = list(passkey_prompts(tokenizer, hay, [200, 300], [0.0, 1.0], 2, seed=3))
    assert [(n, d) for n, d, _, _ in grid] == [(n, d) for n in (200, 300) for d in (0.0, 1.0) for _ in range(2)]
    assert len({key for _, _, key, _ in grid}) == 8
    assert all(NEEDLE.format(key=key) in prompt for _, _, key, prompt in grid)
    assert list(passkey_prompts(tokenizer, hay, [200, 300], [0.0, 1.0], 2, seed=3)) == grid
    assert next(passkey_prompts(tokenizer, hay, [200], [0.0], 1, seed=4))[2] != grid[0][2]


def test_passkey_found_is_the_first_number():
    assert passkey_found("The pass key is 12345.", 12345)
    assert not passkey_found("2. The pass key is 12345", 12345)
    assert not passkey_found("no number", 12345) and not passkey_found("123456", 12345)


def test_each_grid_point_is_a_cell_of_its_trials_even_when_repeated(tiny_lm):
    model, tok = tiny_lm
    cells = run_needle(model, tok, builtin_text(min_chars=20000), [100], [0.5, 0.5], 2, "full", progress=False)
    assert [(c.depth, c.trials, len(c.answers)) for c in cells] == [(0.5, 2, 2), (0.5, 2, 2)]
