"""Sweeps (resumable cells, outputs, 100 % = full) and XSum ROUGE."""

from __future__ import annotations

import json

import pytest

from kvsieve.evaluation import sweep
from kvsieve.evaluation.summarization import rouge, xsum_prompt
from kvsieve.evaluation.sweep import Cell, Runner, Settings, plot_metric, run_sweep

TASKS = ["ppl", "social_iqa"]
POLICIES = ["full", "local", "h2o"]
BUDGETS = [0.1, 0.5, 1.0]


@pytest.fixture
def fake_runner(monkeypatch) -> list[Cell]:
    """Replace the computation by a fake metric; return the list of computed cells."""
    calls: list[Cell] = []

    def run(self, cell: Cell) -> dict[str, float]:
        calls.append(cell)
        value = 1.0 if cell.policy == "full" else cell.budget + len(cell.policy) / 10
        return {metric: value for metric in sweep.task_metrics(cell.task)} | {"n": self.settings.limit or 0}

    monkeypatch.setattr(Runner, "run", run)
    return calls


def test_sweep_is_resumable_and_writes_tables_and_plots(tmp_path, fake_runner) -> None:
    first = run_sweep(tmp_path, TASKS, POLICIES, BUDGETS, settings=Settings(limit=3), progress=False)
    # per task: full once (shared by every full cell and every 100 % cell) + 2 budgets × 2 bounded policies
    assert first.computed == len(fake_runner) == 2 * (1 + 2 * 2)
    assert len(list((tmp_path / "cells").glob("*.json"))) == first.computed

    second = run_sweep(tmp_path, TASKS, POLICIES, BUDGETS, settings=Settings(limit=3), progress=False)
    assert second.computed == 0 and len(fake_runner) == first.computed
    assert second.rows == first.rows

    rows = json.loads((tmp_path / "results.json").read_text())
    assert len(rows) == len(TASKS) * len(POLICIES) * len(BUDGETS)
    at_full = {r["policy"]: r for r in rows if r["task"] == "social_iqa" and r["budget"] == 1.0}
    assert at_full["h2o"]["computed_as"] == "full" and at_full["h2o"]["acc"] == at_full["full"]["acc"] == 1.0
    assert (tmp_path / "results.csv").read_text().count("\n") == len(rows) + 1
    table = (tmp_path / "results.md").read_text()
    assert "### social_iqa: acc (n = 3)" in table and "| h2o | 10.3" not in table and "| h2o | 0.400 |" in table
    for name in ("ppl_ppl", "social_iqa_acc", "social_iqa_acc_norm"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000

    lines = plot_metric(rows, "social_iqa", "acc").axes[0].get_lines()
    assert [line.get_label() for line in lines] == POLICIES
    assert list(lines[2].get_xdata()) == [10.0, 50.0, 100.0]


def test_other_settings_or_new_cells_are_computed(tmp_path, fake_runner) -> None:
    run_sweep(tmp_path, ["ppl"], ["h2o"], [0.1], settings=Settings(limit=3), progress=False)
    run_sweep(tmp_path, ["ppl"], ["h2o"], [0.1, 0.2], settings=Settings(limit=3), progress=False)
    run_sweep(tmp_path, ["ppl"], ["h2o"], [0.1], settings=Settings(limit=5), progress=False)
    assert [(c.budget, n) for c, n in zip(fake_runner, [3, 3, 5], strict=True)] == [(0.1, 3), (0.2, 3), (0.1, 5)]
    run_sweep(tmp_path, ["ppl"], ["h2o"], [0.1], settings=Settings(limit=5, dtype="bfloat16"), progress=False)
    assert len(fake_runner) == 4  # another dtype is another result


def test_cells_written_before_a_setting_existed_count_as_its_default(tmp_path, fake_runner) -> None:
    run_sweep(tmp_path, ["ppl"], ["h2o"], [0.1], settings=Settings(limit=3), progress=False)
    (cell,) = (tmp_path / "cells").glob("*.json")
    record = json.loads(cell.read_text())
    del record["settings"]["dtype"]
    cell.write_text(json.dumps(record))
    run_sweep(tmp_path, ["ppl"], ["h2o"], [0.1], settings=Settings(limit=3), progress=False)
    assert len(fake_runner) == 1


def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(tmp_path, fake_runner, monkeypatch) -> None:
    run = Runner.run

    def failing(self, cell: Cell) -> dict[str, float]:
        if cell.policy == "local":
            raise ValueError("budget too small")
        return run(self, cell)

    monkeypatch.setattr(Runner, "run", failing)
    result = run_sweep(tmp_path, ["ppl"], ["local", "h2o"], [0.1], progress=False)
    assert [r.get("error") for r in result.rows] == ["ValueError: budget too small", None]
    assert "| local | error |" in result.table and "| h2o | 0.40 |" in result.table
    calls = len(fake_runner)
    assert run_sweep(tmp_path, ["ppl"], ["local", "h2o"], [0.1], progress=False).computed == 1  # the failed one
    assert len(fake_runner) == calls  # (it failed again before reaching the fake metric)
    report = run_sweep(tmp_path, ["ppl"], ["local", "h2o"], [0.1], progress=False, compute=False)
    assert [r.get("error") for r in report.rows] == ["ValueError: budget too small", None]


def test_report_computes_nothing_and_shows_missing_cells(tmp_path, fake_runner) -> None:
    run_sweep(tmp_path, ["social_iqa"], ["full", "h2o"], [0.1], settings=Settings(limit=3), progress=False)
    calls = len(fake_runner)
    result = run_sweep(
        tmp_path, ["social_iqa"], ["full", "h2o"], [0.1, 0.5], settings=Settings(limit=3), progress=False, compute=False
    )
    assert result.computed == 0 and len(fake_runner) == calls
    assert [r.get("missing", False) for r in result.rows] == [False, False, False, True]
    assert "| h2o | 0.400 | — |" in result.table
    lines = plot_metric(result.rows, "social_iqa", "acc").axes[0].get_lines()
    assert list(lines[1].get_xdata()) == [10.0]  # no point for the missing cell


def test_cells_at_full_budget_or_with_full_are_computed_as_full() -> None:
    assert Cell("ppl", "h2o", 1.0).computed_as() == Cell("ppl", "full", 1.0)
    assert Cell("ppl", "full", 0.2).computed_as() == Cell("ppl", "full", 1.0)
    assert Cell("ppl", "h2o", 0.2).computed_as() == Cell("ppl", "h2o", 0.2)
    assert Cell("ppl", "h2o", 1).computed_as() == Cell("ppl", "h2o", 1)  # one token is not 100 %
    with pytest.raises(ValueError, match="unknown policy"):
        run_sweep("unused", ["ppl"], ["nope"], [0.1], progress=False)


def test_rouge_scores() -> None:
    assert rouge(["the cat sat"], ["the cat sat"]) == {"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0}
    assert rouge(["a dog ran"], ["the cat sat"])["rouge1"] == 0.0
    scores = rouge(["the cat sat on a mat", "dogs bark"], ["the cat sat", "dogs bark loudly"])
    assert 0 < scores["rouge2"] < scores["rouge1"] < 100


def test_xsum_prompt_uses_the_chat_template(tokenizer) -> None:
    prompt = xsum_prompt(tokenizer, "Some article.")
    assert "Summarize the following article in one sentence.\n\nSome article." in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_xsum_prompt_cuts_the_end_of_an_article_too_long_for_the_positions(tokenizer) -> None:
    article = " ".join(f"Sentence {i} of a long article." for i in range(400))
    whole = xsum_prompt(tokenizer, article)
    assert xsum_prompt(tokenizer, article, len(tokenizer.encode(whole))) == whole
    cut = xsum_prompt(tokenizer, article, 500)
    assert len(tokenizer.encode(cut)) <= 500 < len(tokenizer.encode(whole))
    assert "Summarize the following article in one sentence.\n\nSentence 0 of a long article." in cut
    assert cut.endswith("<|im_start|>assistant\n") and "Sentence 399 " not in cut


@pytest.mark.slow
def test_xsum_rouge_on_two_articles_under_eviction(real_model) -> None:
    from kvsieve.evaluation.lm_eval_model import KVSieveLM
    from kvsieve.evaluation.summarization import evaluate_xsum

    model, tokenizer = real_model
    result = evaluate_xsum(KVSieveLM(model=model, tokenizer=tokenizer, policy="h2o", budget=0.2), 2, 12)
    assert result.articles == 2 and len(result.samples) == 2
    assert all(s["summary"] and "\n" not in s["summary"] for s in result.samples)
    assert 0 < result.rouge1 <= 100 and 0 <= result.rouge2 <= result.rouge1
