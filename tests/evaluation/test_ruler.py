"""RULER (:mod:`kvsieve.ruler`): the task generators on the real tokenizer and the built-in text (length, answers
recoverable from the context, hand-checked needle placement, determinism), the scoring, the grid of settings, the
resumable runner and its report on a tiny model, and the two protocols of ``predict``."""

from __future__ import annotations

import copy
import csv
import json
import math
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import kvsieve
import kvsieve.ruler.predict as ruler_predict
from kvsieve.cli import main
from kvsieve.corpora.reading import reading_items
from kvsieve.data import load_articles
from kvsieve.engine.memory import recorded_pass_bytes, reservation
from kvsieve.policies import REGISTRY
from kvsieve.ruler.predict import (
    FULL,
    PromptPass,
    Setting,
    answer,
    answers,
    predict,
    predict_together,
    prefill_together,
    setting_groups,
)
from kvsieve.ruler.report import by_depth, write_report
from kvsieve.ruler.run import GridSettings, default_policies, grid_settings, run_ruler
from kvsieve.ruler.scoring import mean_and_stderr, plus_minus, score
from kvsieve.ruler.tasks import (
    NOISE,
    TASKS,
    CommonWords,
    Prompter,
    Sample,
    Sources,
    generate_samples,
    load_samples,
    sentences,
    vocabulary,
)

LENGTH = 2048
COUNT = 3
NEEDLE = re.compile(r"The secret (?:number|UUID) for (\S+) is (\S+)\.")
UUID4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
ESSAY = ["niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"]


@pytest.fixture(scope="module")
def sources() -> Sources:
    """The built-in articles' sentences and vocabulary, and the 1,000 SQuAD items (803 passages)."""
    text = "\n\n".join(a.text for a in load_articles())
    return Sources(sentences(text), vocabulary(text), reading_items())


@pytest.fixture(scope="module")
def prompter(tokenizer) -> Prompter:
    return Prompter(tokenizer)


@pytest.fixture(scope="module")
def generated(prompter, sources) -> dict[str, list[Sample]]:
    """Each task's samples at ``LENGTH`` (seed 0), made once for the module."""
    return {task: generate_samples(task, LENGTH, COUNT, prompter, sources) for task in TASKS}


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _haystack(sample: Sample) -> str:
    """The context without its instruction (every task puts one paragraph before the haystack)."""
    return sample.context.split("\n\n", 1)[1]


def _essay_units(sample: Sample, sents: list[str]) -> tuple[int, int]:
    """The haystack of an essay sample, needles taken out, as consecutive source sentences: (first index, count)."""
    body = _haystack(sample)
    for needle in [m.group(0) for m in NEEDLE.finditer(body)]:
        body = body.replace(" " + needle, "", 1) if " " + needle in body else body.replace(needle + " ", "", 1)
    for start in (i for i, s in enumerate(sents) if body.startswith(s)):
        joined, count = sents[start], 1
        while len(joined) < len(body):
            joined += " " + sents[(start + count) % len(sents)]
            count += 1
        if joined == body:
            return start, count
    raise AssertionError("the haystack is not consecutive source sentences")


def _unit_tokens(task: str, sample: Sample, tokenizer, sources: Sources) -> int:
    """Tokens of the haystack unit that did not fit (an upper bound where the next one is not known)."""
    hay = _haystack(sample)
    if task in ESSAY:
        start, count = _essay_units(sample, list(sources.sentences))
        return _tokens(tokenizer, " " + sources.sentences[(start + count) % len(sources.sentences)])
    if task in ("niah_single_1", "vt"):
        return _tokens(tokenizer, " " + NOISE)
    if task in ("niah_multikey_2", "niah_multikey_3"):
        return max(_tokens(tokenizer, " " + m.group(0)) for m in NEEDLE.finditer(hay))
    if task == "cwe":  # three more lines of one rare word, numbered after the list's last
        lines = hay.splitlines()
        return 3 * max(_tokens(tokenizer, f"\n{len(lines) + 3}. {line.split('. ', 1)[1]}") for line in lines)
    if task == "fwe":
        return max(_tokens(tokenizer, " ... " + w) for w in hay.split(" ... "))
    assert task == "qa"
    passages = {item.passage for item in sources.reading}
    return max(_tokens(tokenizer, f"\n\nDocument 99:\n{p}") for p in passages)


# --- the generators ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_fill_the_length_up_to_one_haystack_unit(task, generated, prompter, tokenizer, sources) -> None:
    """The prompt has at most ``LENGTH`` tokens, and one more unit of its haystack would not have fit (a few tokens
    of slack: the tokens of a unit depend a little on its neighbours)."""
    for index, sample in enumerate(generated[task]):
        assert (sample.task, sample.length, sample.index) == (task, LENGTH, index)
        assert prompter.count(sample.context, sample.question, sample.answer_prefix) == sample.tokens
        head, tail = prompter.ids(sample.context, sample.question, sample.answer_prefix)
        assert len(head) + len(tail) == sample.tokens
        assert sample.tokens <= LENGTH
        unit = _unit_tokens(task, sample, tokenizer, sources)
        assert sample.tokens + unit > LENGTH - 4, (sample.index, sample.tokens, unit)
        # so, in absolute terms: a unit is at most a 40-word sentence piece or a UUID needle (under 100 tokens), for
        # qa a passage (the longest of the 803: 711 tokens)
        assert LENGTH - sample.tokens < (720 if task == "qa" else 100)


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah") or t == "qa"])
def test_niah_and_qa_answers_are_in_the_context(task, generated, sources) -> None:
    for sample in generated[task]:
        assert sample.answers
        assert all(answer in sample.context for answer in sample.answers)
        assert len(sample.depths) >= 1 and all(0 <= d < 1 for d in sample.depths)
        if task == "qa":  # the golden passage is one document, at its depth among the distractors
            golden = [
                i
                for i in sources.reading
                if sample.question.endswith(f"Question: {i.question}") and i.answers == sample.answers
            ]
            docs = re.split(r"\n\nDocument \d+:\n", sample.context)[1:]
            (at,) = [k for k, doc in enumerate(docs) if any(doc == i.passage for i in golden)]
            assert at == round(sample.depths[0] * (len(docs) - 1)) and len(set(docs)) == len(docs)
            continue
        needles = dict(NEEDLE.findall(sample.context))
        asked = [key for key in needles if key in sample.question]
        values = [m.group(2) for m in NEEDLE.finditer(sample.context) if m.group(1) in asked]
        assert sorted(values) == sorted(sample.answers)  # the asked keys' needles hold exactly the answers


def test_vt_chain_links_the_value_to_every_answer(generated) -> None:
    for sample in generated["vt"]:
        links = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", sample.context)
        assert len(links) == 5 and len(sample.answers) == 5 and len(sample.depths) == 5
        value = re.search(r"hold the value (\d+)\?", sample.question).group(1)
        holds, grew = {value}, True
        while grew:
            before = len(holds)
            holds |= {name for name, source in links if source.removeprefix("VAR ") in holds}
            grew = len(holds) > before
        assert holds - {value} == set(sample.answers)
        assert all(f"VAR {name} =" in sample.context for name in sample.answers)


def test_cwe_answers_are_the_words_listed_most_often(generated) -> None:
    freq = CommonWords().frequency(LENGTH)
    assert freq == 25  # min(30, 2048 // 80)
    for sample in generated["cwe"]:
        lines = _haystack(sample).splitlines()
        assert [int(line.split(". ")[0]) for line in lines] == list(range(1, len(lines) + 1))
        words = [line.split(". ", 1)[1] for line in lines]
        counts = Counter(words)
        spread = [i / len(words) for i, word in enumerate(words) if word in sample.answers]
        assert min(spread) < 0.1 and max(spread) > 0.9  # shuffled through the list
        assert len(sample.answers) == 10
        assert all(counts[word] == freq for word in sample.answers)
        assert {n for word, n in counts.items() if word not in sample.answers} == {3}
        assert sample.depths == ()


def test_fwe_answers_are_the_three_most_frequent_coded_words(generated) -> None:
    for sample in generated["fwe"]:
        counts = Counter(_haystack(sample).split(" ... ")).most_common()
        assert all(re.fullmatch(r"[a-z]{4,7}", w) for w, _ in counts)
        assert counts[2][1] > counts[3][1]  # no tie for the third place
        assert set(sample.answers) == {w for w, _ in counts[:3]} and len(sample.answers) == 3


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_are_deterministic_in_the_seed(task, generated, prompter, sources) -> None:
    again = generate_samples(task, LENGTH, COUNT, prompter, sources, seed=0)
    assert again == generated[task]
    other = generate_samples(task, LENGTH, COUNT, prompter, sources, seed=1)
    assert all(a.context != b.context for a, b in zip(other, again, strict=True))
    assert [Sample.from_dict(json.loads(json.dumps(s.to_dict()))) for s in again] == again


def test_bad_generator_arguments_are_refused(prompter, sources) -> None:
    with pytest.raises(ValueError, match="unknown RULER task 'niah_single_9'"):
        generate_samples("niah_single_9", LENGTH, 1, prompter, sources)
    with pytest.raises(ValueError, match="length 60 is too short"):
        generate_samples("niah_single_2", 60, 1, prompter, sources)
    with pytest.raises(ValueError, match="samples must be positive"):
        generate_samples("vt", LENGTH, 0, prompter, sources)
    with pytest.raises(ValueError, match="reading-comprehension items"):
        generate_samples("qa", LENGTH, 1, prompter, Sources(sources.sentences, sources.words))


# --- hand-checked needles ---------------------------------------------------------------------------------------


def test_single_needle_sits_at_its_depth_and_depths_are_stratified(prompter, sources) -> None:
    made = generate_samples("niah_single_2", LENGTH, 10, prompter, sources, seed=3)
    strata = [int(sample.depths[0] * 10) for sample in made]
    assert sorted(strata) == list(range(10))  # (one sample a tenth of the context)
    assert strata != list(range(10))  # (dealt in a random order: the first samples spread over the context)
    assert max(strata[:3]) - min(strata[:3]) >= 3
    for i, sample in enumerate(made):
        (depth,) = sample.depths
        hay = _haystack(sample)
        (needle,) = [m.group(0) for m in NEEDLE.finditer(hay)]
        assert needle.endswith(f" is {sample.answers[0]}.")
        # in units: the needle stands before unit round(depth * count)
        sents = list(sources.sentences)
        start, count = _essay_units(sample, sents)
        before = hay[: hay.index(needle)].rstrip()
        prefixes = [" ".join(sents[(start + k) % len(sents)] for k in range(j)) for j in range(count + 1)]
        assert prefixes.index(before) == round(depth * count)
        # in characters: within a few percent (sentences differ in length)
        assert abs(hay.index(needle) / len(hay) - depth) < 0.08, (i, depth, hay.index(needle) / len(hay))


def test_multikey_1_has_four_keys_one_asked(generated) -> None:
    for sample in generated["niah_multikey_1"]:
        found = NEEDLE.findall(sample.context)
        assert len(found) == 4 and len({key for key, _ in found}) == 4 and len(sample.depths) == 4
        assert all(re.fullmatch(r"[a-z]+-[a-z]+", key) and re.fullmatch(r"\d{7}", v) for key, v in found)
        asked = [(key, value) for key, value in found if key in sample.question]
        assert len(asked) == 1 and sample.answers == (asked[0][1],)
        assert sample.answer_prefix == f"The secret number for {asked[0][0]} is"
        assert list(sample.depths) == sorted(sample.depths)


def test_multiquery_asks_four_keys_and_multivalue_four_values(generated) -> None:
    for sample in generated["niah_multiquery"]:
        keys = re.findall(r"[a-z]+-[a-z]+", sample.question)
        assert len(set(keys)) == 4 and len(sample.answers) == 4 == len(set(sample.answers))
        needles = dict(NEEDLE.findall(sample.context))
        assert sorted(needles[key] for key in keys) == sorted(sample.answers)
    for sample in generated["niah_multivalue"]:
        found = NEEDLE.findall(sample.context)
        assert len(found) == 4 and len({key for key, _ in found}) == 1 and found[0][0] in sample.question
        assert sorted(v for _, v in found) == sorted(sample.answers) and len(set(sample.answers)) == 4


def test_multikey_3_keys_and_values_are_uuids(generated) -> None:
    for sample in generated["niah_multikey_3"]:
        found = NEEDLE.findall(sample.context)
        assert len(found) > 10  # the haystack is needles of other keys
        assert all(re.fullmatch(UUID4, key) and re.fullmatch(UUID4, value) for key, value in found)
        (key,) = re.findall(UUID4, sample.question)
        assert dict(found)[key] == sample.answers[0] and len(sample.answers) == 1
        assert len({k for k, _ in found}) == len(found)  # distinct keys: one needle answers the question


# --- scoring ----------------------------------------------------------------------------------------------------


def test_score_is_the_share_of_answers_found_ignoring_case() -> None:
    assert score("niah_multivalue", "a 1 b 2", ["1", "2", "3", "4"]) == 0.5
    assert score("niah_single_1", "The number is 1234567.", ["1234567"]) == 1.0
    assert score("vt", "vars: abcde, FGHIJ", ["ABCDE", "fghij", "KLMNO"]) == pytest.approx(2 / 3)
    assert score("cwe", "nothing here", ["alpha", "beta"]) == 0.0
    assert score("qa", "It was in PARIS in 1900", ["the city of Paris", "paris", "1901"]) == 1.0  # any one
    assert score("qa", "It was in Lyon", ["paris", "1901"]) == 0.0
    with pytest.raises(ValueError, match="at least one expected answer"):
        score("vt", "anything", [])


def test_mean_and_stderr_by_hand() -> None:
    mean, se = mean_and_stderr([1, 0, 1, 0])  # deviations ±0.5: sample variance 4 · 0.25 / 3 = 1/3
    assert mean == 50.0 and se == pytest.approx(100 * math.sqrt((1 / 3) / 4))
    mean, se = mean_and_stderr([1.0, 0.5, 0.0])  # variance 0.25, stderr sqrt(0.25 / 3)
    assert mean == pytest.approx(50.0) and se == pytest.approx(100 * math.sqrt(0.25 / 3))
    assert mean_and_stderr([0.75]) == (75.0, None)  # (one score has no standard error)
    assert plus_minus(75.0, None) == "75.0 ± –" and plus_minus(2 / 3 * 100, 4.21, 0) == "67 ± 4"
    with pytest.raises(ValueError, match="no scores"):
        mean_and_stderr([])


# --- the grid ---------------------------------------------------------------------------------------------------


def test_grid_is_full_once_then_protocol_policy_compression() -> None:
    got = grid_settings(["full", "h2o", "snapkv"], [0.25, 0.5], ["agnostic", "aware"])
    expected = [FULL] + [
        Setting(q, p, c) for q in ("agnostic", "aware") for p in ("h2o", "snapkv") for c in (0.25, 0.5)
    ]
    assert got == expected and len({s.key for s in got}) == 9
    assert grid_settings(["h2o"], [0.5], ["aware"]) == [Setting("aware", "h2o", 0.5)]
    assert grid_settings(["full"], [0.5], ["aware", "agnostic"]) == [FULL]
    assert (FULL.key, FULL.budget) == ("full", None)
    assert (Setting("agnostic", "h2o", 0.75).key, Setting("agnostic", "h2o", 0.75).budget) == (
        "agnostic_h2o_c0.75",
        0.25,
    )
    assert Setting("aware", "snapkv", 0.9).budget == 0.1


def test_default_policies_are_all_but_the_oracle() -> None:
    """Every registered policy but the reference that saves no memory (topk_oracle); 141 settings at the default
    compressions under both protocols (kvzip's question-agnostic only)."""
    assert default_policies() == [name for name in REGISTRY if name != "topk_oracle"]
    assert len(grid_settings(default_policies(), [0.25, 0.5, 0.75, 0.9], ["agnostic", "aware"])) == 141


def test_a_policy_with_a_budget_but_no_bound_gets_its_own_question_aware_settings() -> None:
    # (topk_oracle keeps every token but attends to its budget's worth: a setting of its own, not the full cache;
    # it chooses keys knowing each query, the question's too: no question-agnostic cells)
    both = grid_settings(["h2o", "topk_oracle"], [0.5], ["agnostic", "aware"])
    assert both == [Setting("agnostic", "h2o", 0.5), Setting("aware", "h2o", 0.5), Setting("aware", "topk_oracle", 0.5)]
    with pytest.raises(ValueError, match=r"topk_oracle chooses keys knowing each query.*question-aware cells only"):
        grid_settings(["topk_oracle"], [0.5], ["agnostic"])
    # (kvzip compresses a context before any question: question-agnostic cells only)
    assert grid_settings(["kvzip", "h2o"], [0.5], ["agnostic", "aware"]) == [
        Setting("agnostic", "kvzip", 0.5),
        Setting("agnostic", "h2o", 0.5),
        Setting("aware", "h2o", 0.5),
    ]
    with pytest.raises(ValueError, match=r"kvzip compresses a context before .*question-agnostic cells only"):
        grid_settings(["kvzip"], [0.5], ["aware"])


def test_sources_too_small_for_the_length_are_an_error_not_a_hang(prompter) -> None:
    small = Sources(sentences(NOISE * 5), [f"word{chr(97 + i)}{chr(97 + j)}" for i in range(5) for j in range(5)])
    with pytest.raises(ValueError, match=r"sources fill .* fewer than the length 8192"):
        generate_samples("cwe", 8192, 1, prompter, small)


def test_needle_haystack_grows_with_the_length(prompter, sources) -> None:
    (sample,) = generate_samples("niah_multikey_2", 80_000, 1, prompter, sources)
    assert 79_000 < sample.tokens <= 80_000


@pytest.mark.parametrize(
    ("policies", "compressions", "protocols", "message"),
    [
        (["h2o"], [0.5], ["blind"], "protocol must be one of aware, agnostic, got 'blind'"),
        (["h2o"], [0.0], ["aware"], r"in \(0, 1\); got 0.0"),
        (["h2o"], [1.0], ["aware"], r"in \(0, 1\); got 1.0"),
        (["no_such_policy"], [0.5], ["aware"], "unknown policy 'no_such_policy'"),
    ],
)
def test_bad_grid_is_refused(policies, compressions, protocols, message) -> None:
    with pytest.raises(ValueError, match=message):
        grid_settings(policies, compressions, protocols)


# --- the runner and the report on a tiny model ------------------------------------------------------------------

RUN_TASKS = ["niah_single_1", "vt"]
RUN_LENGTH = 256
RUN_SAMPLES = 2


def _count_predict(monkeypatch) -> list[tuple[str, int]]:
    """Settings answered, by ``predict`` or ``prefill_together``, as (setting key, prompt tokens), still computing."""
    calls: list[tuple[str, int]] = []
    alone, together = predict, prefill_together  # (the originals, whatever a test patched in)

    def counted(model, tokenizer, head, tail, setting, max_new_tokens):
        calls.append((setting.key, len(head) + len(tail)))
        return alone(model, tokenizer, head, tail, setting, max_new_tokens)

    def counted_together(model, head, tail, settings, max_new_tokens, prompt_pass=None, asking=None):
        calls.extend((setting.key, len(head) + len(tail)) for setting in settings)
        return together(model, head, tail, settings, max_new_tokens, prompt_pass, asking)

    monkeypatch.setattr(ruler_predict, "predict", counted)
    monkeypatch.setattr(ruler_predict, "prefill_together", counted_together)
    return calls


def test_run_is_resumable_and_reported(tiny_lm, sources, tmp_path, monkeypatch) -> None:
    model, tok = tiny_lm
    monkeypatch.setattr(ruler_predict, "max_new_tokens", lambda task: 3)  # (a random model: the answers are noise)
    settings = grid_settings(["full", "h2o", "streaming_llm"], [0.5], ["agnostic", "aware"])
    assert len(settings) == 5
    grid = GridSettings(model="tiny", dtype="float32", seed=0, haystack="wikipedia")

    made_from = []  # (the sources are asked for only where samples are to be made, once a run)

    def get_sources() -> Sources:
        made_from.append(1)
        return sources

    def run() -> None:
        args = (RUN_TASKS, [RUN_LENGTH], settings, RUN_SAMPLES)
        run_ruler(model, tok, tmp_path, get_sources, grid, *args, progress=False)

    calls = _count_predict(monkeypatch)
    run()
    assert len(calls) == len(RUN_TASKS) * RUN_SAMPLES * len(settings) and made_from == [1]
    cells = {p.name: json.loads(p.read_text()) for p in (tmp_path / "cells").glob("*.json")}
    assert sorted(cells) == sorted(f"{t}_{RUN_LENGTH}_{s.key}.json" for t in RUN_TASKS for s in settings)
    for name, cell in cells.items():
        assert sorted(cell["predictions"]) == ["0", "1"], name
        assert cell["settings"]["seed"] == 0 and cell["settings"]["samples"] == RUN_SAMPLES
        for p in cell["predictions"].values():
            assert 0 <= p["score"] <= 1 and 1 <= p["answer_tokens"] <= 3 and 0 < p["first_token_s"] <= p["total_s"]
    for task in RUN_TASKS:  # the stored samples are the generated ones, whose prompts were fed
        stored = [Sample.from_dict(json.loads(line)) for line in (tmp_path / "samples" / f"{task}_256.jsonl").open()]
        made = generate_samples(task, RUN_LENGTH, RUN_SAMPLES, Prompter(tok), sources, seed=0)
        assert stored == made
        assert {n for key, n in calls if key == "full"} >= {s.tokens for s in made}

    # a rerun computes nothing
    def refuse(*args, **kwargs):
        raise AssertionError("predict was called on a complete grid")

    monkeypatch.setattr(ruler_predict, "predict", refuse)
    monkeypatch.setattr(ruler_predict, "prefill_together", refuse)
    run()
    assert made_from == [1]

    # one answer deleted: exactly that one is computed again; a cell stored with other settings: all of it
    path = tmp_path / "cells" / "vt_256_aware_h2o_c0.5.json"
    cell = json.loads(path.read_text())
    kept = cell["predictions"]["0"]
    del cell["predictions"]["1"]
    path.write_text(json.dumps(cell))
    other = tmp_path / "cells" / "niah_single_1_256_full.json"
    stale = json.loads(other.read_text())
    stale["settings"]["seed"] = 7
    other.write_text(json.dumps(stale))
    calls = _count_predict(monkeypatch)
    run()
    assert sorted(key for key, _ in calls) == ["aware_h2o_c0.5", "full", "full"]
    assert json.loads(path.read_text())["predictions"]["0"] == kept
    assert sorted(json.loads(path.read_text())["predictions"]) == ["0", "1"]
    assert json.loads(other.read_text())["settings"]["seed"] == 0
    assert made_from == [1]  # the stored samples were fed again

    # the report: set known scores in the cells, then check the rows, the tables and the plots
    for i, p in enumerate(sorted((tmp_path / "cells").glob("*.json"))):
        cell = json.loads(p.read_text())
        cell["predictions"]["0"]["score"] = 1.0
        cell["predictions"]["1"]["score"] = (i % 3) / 2
        p.write_text(json.dumps(cell))
    _check_report(tmp_path, settings)


def test_generator_2_samples_are_answered_without_its_reading_items(tiny_lm, sources, tmp_path, monkeypatch) -> None:
    """Generator 2's qa items (BIG-bench squad_shifts) can no longer be fetched: its stored samples are answered as
    they are, and a qa sample it would have to make is a one-line error; generator 3 makes qa samples from SQuAD."""
    import kvsieve.corpora.reading as reading
    import kvsieve.ruler.run as ruler_run

    model, tok = tiny_lm
    monkeypatch.setattr(ruler_predict, "max_new_tokens", lambda task: 2)
    settings = grid_settings(["full"], [0.5], ["aware"])
    old = GridSettings(model="tiny", dtype="float32", seed=0, haystack="wikipedia", generator=2)
    run_ruler(model, tok, tmp_path, lambda: sources, old, ["qa", "vt"], [1024], settings, 1, progress=False)
    stored = (tmp_path / "samples" / "qa_1024.jsonl").read_text()
    for cell in (tmp_path / "cells").glob("*.json"):
        cell.unlink()

    def gone() -> list:
        raise AssertionError("generator 2's stored samples need no reading items")

    monkeypatch.setattr(reading, "reading_items", gone)
    got = lambda: ruler_run.sources(with_reading=True, generator=2)  # noqa: E731 (what kvsieve ruler passes)
    run_ruler(model, tok, tmp_path, got, old, ["qa", "vt"], [1024], settings, 1, progress=False)
    assert (tmp_path / "samples" / "qa_1024.jsonl").read_text() == stored
    assert len(json.loads((tmp_path / "cells" / "qa_1024_full.json").read_text())["predictions"]) == 1
    with pytest.raises(ValueError, match=r"sample generator 2's .* can no longer be fetched"):
        run_ruler(model, tok, tmp_path, got, old, ["qa"], [1024], settings, 2, progress=False)

    monkeypatch.setattr(reading, "reading_items", lambda: list(sources.reading))
    new = GridSettings(model="tiny", dtype="float32", seed=0, haystack="wikipedia")
    assert new.generator == 3
    got = lambda: ruler_run.sources(with_reading=True)  # noqa: E731
    run_ruler(model, tok, tmp_path / "new", got, new, ["qa"], [1024], settings, 1, progress=False)
    (sample,) = load_samples(tmp_path / "new" / "samples" / "qa_1024.jsonl")
    assert any(item.passage in sample.context and item.question in sample.question for item in sources.reading)


def test_runs_on_disjoint_tasks_share_one_out(tiny_lm, sources, tmp_path, monkeypatch) -> None:
    """Two runs at once on different tasks into one directory store what one run of both tasks stores."""
    model, tok = tiny_lm
    monkeypatch.setattr(ruler_predict, "max_new_tokens", lambda task: 3)
    settings = grid_settings(["full", "h2o"], [0.5], ["agnostic"])
    grid = GridSettings(model="tiny", dtype="float32", seed=0, haystack="wikipedia")

    def run(out: Path, tasks: list[str]) -> None:
        run_ruler(model, tok, out, lambda: sources, grid, tasks, [RUN_LENGTH], settings, RUN_SAMPLES, progress=False)

    def stored(out: Path) -> dict[str, Any]:
        cells = {p.name: json.loads(p.read_text()) for p in (out / "cells").glob("*.json")}
        answers = {n: {i: (p["text"], p["score"]) for i, p in c["predictions"].items()} for n, c in cells.items()}
        samples = {p.name: p.read_text() for p in (out / "samples").iterdir()}
        return {"settings": {n: c["settings"] for n, c in cells.items()}, "answers": answers, "samples": samples}

    run(tmp_path / "one", RUN_TASKS)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda task: run(tmp_path / "shared", [task]), RUN_TASKS))
    assert sorted(p.name for p in (tmp_path / "shared" / "cells").iterdir()) == sorted(
        f"{t}_{RUN_LENGTH}_{s.key}.json" for t in RUN_TASKS for s in settings
    )  # (no temporary file left)
    assert stored(tmp_path / "shared") == stored(tmp_path / "one")


def _check_report(out, settings) -> None:
    result = write_report(out, title="tiny")
    rows = json.loads((out / "results.json").read_text())
    assert rows == result["rows"] and len(rows) == len(RUN_TASKS) * len(settings)
    with open(out / "results.csv") as f:
        assert [r["score"] for r in csv.DictReader(f)] == [str(r["score"]) for r in rows]
    by_cell = {}
    for row in rows:
        key = "full" if row["policy"] == "full" else f"{row['protocol']}_{row['policy']}_c{row['compression']:g}"
        scores = [
            p["score"]
            for p in json.loads((out / "cells" / f"{row['task']}_256_{key}.json").read_text())["predictions"].values()
        ]
        mean = sum(scores) / len(scores)
        se = math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1) / len(scores))
        assert row["score"] == pytest.approx(100 * mean, abs=0.005) and row["stderr"] == pytest.approx(
            100 * se, abs=0.005
        )
        assert row["samples"] == 2 and row["protocol"] == ("both" if key == "full" else row["protocol"])
        by_cell[row["task"], key] = row
    md = (out / "results.md").read_text()
    assert md.startswith("# tiny\n")
    for protocol in ("agnostic", "aware"):
        section = md.split(f"## 256 tokens, question-{protocol}\n")[1].split("\n## ")[0]
        average, per_task = section.split("### compression 0.5 (per task)")
        rows_named = {line.split(" | ")[0][2:]: line for line in average.splitlines() if line.startswith("| ")}
        per_task_named = {line.split(" | ")[0][2:]: line for line in per_task.splitlines() if line.startswith("| ")}
        for policy in ("full", "h2o", "streaming_llm"):
            key = "full" if policy == "full" else f"{protocol}_{policy}_c0.5"
            got = [by_cell[t, key] for t in RUN_TASKS]
            mean = sum(r["score"] for r in got) / len(got)
            se = math.sqrt(sum(r["stderr"] ** 2 for r in got)) / len(got)
            name = "full (ceiling)" if policy == "full" else policy
            assert rows_named[name] == f"| {name} | {mean:.1f} ± {se:.1f} |", rows_named[name]
            cells = " | ".join(f"{r['score']:.0f} ± {r['stderr']:.0f}" for r in got)
            assert per_task_named[policy] == f"| {policy} | {cells} |"
        assert per_task_named["policy"] == "| policy | niah_single_1 | vt |"
    plots = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert plots == sorted(
        f"{kind}_256_{q}{c}.png"
        for q in ("agnostic", "aware")
        for kind, c in (("score", ""), ("tasks", "_c0.5"), ("depth", "_c0.5"))  # (niah_single_1: a single needle)
    )
    for p in (out / "plots").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


# --- predict's protocols ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny64(tiny_lm):
    model, tok = tiny_lm
    return copy.deepcopy(model).to(torch.float64), tok


@pytest.fixture(scope="module")
def prompt_ids(tiny64, sources) -> tuple[list[int], list[int]]:
    _, tok = tiny64
    (sample,) = generate_samples("niah_single_1", 200, 1, Prompter(tok), sources)
    return Prompter(tok).ids(sample.context, sample.question, sample.answer_prefix)


def test_full_is_one_setting_whatever_the_protocol(tiny64, prompt_ids) -> None:
    model, tok = tiny64
    head, tail = prompt_ids
    full = predict(model, tok, head, tail, FULL, 6)
    assert full[1] == 6 and full[0]
    assert predict(model, tok, head, tail, Setting("agnostic", "full", 0.0), 6)[:2] == full[:2]
    # agnostic with nothing dropped: the context fed alone, then the question continues it, is the full answer
    assert predict(model, tok, head, tail, Setting("agnostic", "h2o", 0.0), 6)[:2] == full[:2]
    out = model.generate(input_ids=torch.tensor([[*head, *tail]]), max_new_tokens=6, do_sample=False)
    assert tok.decode(out[0, len(head) + len(tail) :], skip_special_tokens=True).strip() == full[0]


@pytest.mark.parametrize("protocol", ["agnostic", "aware"])
def test_bounded_cache_sizes_by_protocol(tiny64, prompt_ids, monkeypatch, protocol) -> None:
    """agnostic: the context is compressed to half of itself, then the question and the answer are all kept;
    aware: the whole prompt is compressed to half and the cache stays there while decoding."""
    model, tok = tiny64
    head, tail = prompt_ids
    made, at_generate = [], []
    real_make, real_generate = ruler_predict.make_cache, model.generate
    monkeypatch.setattr(ruler_predict, "make_cache", lambda *a, **k: made.append(real_make(*a, **k)) or made[-1])
    monkeypatch.setattr(model, "generate", lambda **k: at_generate.append(made[0].slot_counts()) or real_generate(**k))
    _, n, first, total = predict(model, tok, head, tail, Setting(protocol, "h2o", 0.5), 6)
    assert n == 6 and 0 < first <= total
    (cache,) = made
    if protocol == "agnostic":
        assert math.floor(0.5 * len(head)) <= cache.budget_tokens <= math.ceil(0.5 * len(head))
        assert at_generate == [[cache.budget_tokens] * 3]  # the context alone, compressed
        assert cache.slot_counts() == [cache.budget_tokens + len(tail) + n - 1] * 3
    else:
        budget = round(0.5 * (len(head) + len(tail)))
        assert at_generate == [[0, 0, 0]] and cache.budget_tokens == budget
        assert cache.slot_counts() == [budget] * 3


def test_settings_answered_together_as_alone(tiny64, prompt_ids, sources, monkeypatch) -> None:
    """One shared prompt pass, the question parts batched and the answers decoded as one batch give every setting
    the answer it gets alone (float64: round-off cannot decide a near-tie), a narrowing policy's too."""
    model, tok = tiny64
    head, tail = prompt_ids
    policies = ["full", "h2o", "tova", "snapkv", "scissorhands", "ahakv", "streaming_llm", "knorm", "topk_oracle"]
    policies += ["kvzip", "kvzip:chunk=64", "kvzip:heads=adakv", "keydiff", "expected_attention"]
    shared = grid_settings(policies, [0.25, 0.9], ["agnostic", "aware"])
    assert Setting("aware", "topk_oracle", 0.9) in shared
    probings = []
    probe = ruler_predict.probe_context
    monkeypatch.setattr(ruler_predict, "probe_context", lambda *a: probings.append(1) or probe(*a))
    got = predict_together(model, tok, head, tail, shared, 6)
    assert len(probings) == 2  # (once per way of observing the probes: kvzip:heads=adakv adopts kvzip's state)
    for setting, (text, n, first, total_s) in zip(shared, got, strict=True):
        assert (text, n) == predict(model, tok, head, tail, setting, 6)[:2], setting.key
        assert 0 < first <= total_s
    (sample,) = generate_samples("niah_single_1", 200, 1, Prompter(tok), sources)
    monkeypatch.setattr(ruler_predict, "max_new_tokens", lambda task: 6)
    answered = dict(answer(model, tok, sample, (head, tail), shared))
    assert sorted(answered, key=shared.index) == shared
    for setting, (text, n, *_) in zip(shared, got, strict=True):
        assert (answered[setting]["text"], answered[setting]["answer_tokens"]) == (text, n)
    # Grouped by the memory their caches may hold: one model pass replayed for each group, the same answers.
    assert setting_groups(model, shared, (head, tail), 6, None) == [shared]
    assert setting_groups(model, shared, (head, tail), 6, 1) == [[s] for s in shared]  # (each needs more)
    whole = sum(
        reservation(model, kvsieve.make_cache(model, s.policy, s.budget), len(head) + len(tail), 6).peak for s in shared
    )
    groups = setting_groups(model, shared, (head, tail), 6, whole // 3)
    assert 3 <= len(groups) < len(shared) and [s for group in groups for s in group] == shared
    recording = recorded_pass_bytes(model, len(head) + len(tail))  # (held beside every group until the last)
    for group in groups:
        assert sum(ruler_predict._need(model, s, (head, tail), 6).peak for s in group) + recording <= whole // 3
    calls = []
    together = ruler_predict.prefill_together
    monkeypatch.setattr(ruler_predict, "prefill_together", lambda *a: calls.append(len(a[3])) or together(*a))
    passes = []  # (the lengths of the model's forward passes)
    counting = model.register_forward_pre_hook(
        lambda module, args, kwargs: passes.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        grouped = dict(answer(model, tok, sample, (head, tail), shared, kv_memory=whole // 3))
    finally:
        counting.remove()
    assert calls == [len(group) for group in groups]
    assert passes.count(len(head) + len(tail)) == 1  # (one model pass of the prompt: the other groups replay it)
    kept = PromptPass()
    prefill_together(model, head, tail, shared[:1], 2, kept)
    with pytest.raises(ValueError, match="caches of its own prompt only"):
        prefill_together(model, head, tail[:-1], shared[:1], 2, kept)
    assert {s: (a["text"], a["answer_tokens"]) for s, a in grouped.items()} == {
        s: (answered[s]["text"], answered[s]["answer_tokens"]) for s in shared
    }


NIAH_VT = [("niah_single_1", 180), ("niah_single_1", 230), ("vt", 260)]


def test_samples_answers_decoded_together_as_alone(tiny64, sources, monkeypatch) -> None:
    """Several samples' answers in one batch — the next sample's rows joining while a sample's longest answers
    finish, rows at different positions — are each setting's answer alone (float64); a sample is taken only when its
    caches fit beside those being decoded: a memory bound of one sample's caches keeps these apart."""
    model, tok = tiny64
    prompter = Prompter(tok)
    made = [generate_samples(task, n, 1, prompter, sources)[0] for task, n in NIAH_VT]
    settings = grid_settings(["full", "h2o", "snapkv", "streaming_llm"], [0.5], ["agnostic", "aware"])
    limits = {"niah_single_1": 7, "vt": 4}
    monkeypatch.setattr(ruler_predict, "max_new_tokens", limits.get)
    units = [(s, prompter.ids(s.context, s.question, s.answer_prefix), settings) for s in made]
    assert len({len(head) + len(tail) for _, (head, tail), _ in units}) == 3  # (different positions)
    want = {
        (i, setting): predict(model, tok, *prompt, setting, limits[sample.task])[:2]
        for i, (sample, prompt, _) in enumerate(units)
        for setting in settings
    }
    steps, step = [], ruler_predict.Decoding.step

    def watched(self):  # (the samples each step's rows belong to, by their prompt's length)
        steps.append({row.cache.get_seq_length() - len(row.tokens) + 1 for row in self.rows})
        return step(self)

    monkeypatch.setattr(ruler_predict.Decoding, "step", watched)
    got = {(i, s): (cell["text"], cell["answer_tokens"]) for i, s, cell in answers(model, tok, units, 10**12)}
    assert got == want
    assert any(len(prompts) > 1 for prompts in steps)  # (rows of two samples in one step)
    one = max(sum(ruler_predict._need(model, s, prompt, 7).peak for s in settings) for _, prompt, _ in units)
    steps.clear()
    got = {(i, s): (cell["text"], cell["answer_tokens"]) for i, s, cell in answers(model, tok, units, one)}
    assert got == want and steps and all(len(prompts) == 1 for prompts in steps)


@pytest.mark.slow
def test_real_model_finds_a_needle_that_a_tiny_window_loses(real_model, sources, tmp_path) -> None:
    """SmolLM2 with the full cache reads the number back; StreamingLLM keeping a tenth of the context (its start
    and its end) loses a needle from the middle."""
    model, tok = real_model
    grid = GridSettings(model="smollm2-135m", dtype="float32", seed=2, haystack="wikipedia")
    lossy = Setting("agnostic", "streaming_llm", 0.9)
    run_ruler(model, tok, tmp_path, lambda: sources, grid, ["niah_single_1"], [512], [FULL, lossy], 1, progress=False)
    (sample,) = [
        Sample.from_dict(json.loads(line)) for line in (tmp_path / "samples" / "niah_single_1_512.jsonl").open()
    ]
    assert 0.3 < sample.depths[0] < 0.7  # (seed 2: 0.52)
    full = json.loads((tmp_path / "cells" / "niah_single_1_512_full.json").read_text())["predictions"]["0"]
    assert sample.answers[0] in full["text"] and full["score"] == 1.0
    lost = json.loads((tmp_path / "cells" / f"niah_single_1_512_{lossy.key}.json").read_text())["predictions"]["0"]
    assert lost["score"] == 0.0
    write_report(tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| full (ceiling) | 100.0 ± – |" in md and "| streaming_llm | 0.0 ± – |" in md  # (one sample: no error)


def test_report_compares_a_task_on_the_samples_every_setting_answered(tmp_path) -> None:
    cells = tmp_path / "cells"
    cells.mkdir()

    def cell(name: str, policy: str, scores: dict[str, float]) -> None:
        settings = {"task": "vt", "length": 256, "protocol": "aware", "policy": policy, "compression": 0.5}
        predictions = {i: {"score": v, "first_token_s": 1.0, "total_s": 2.0} for i, v in scores.items()}
        (cells / name).write_text(json.dumps({"settings": settings, "predictions": predictions}))

    cell("vt_256_full.json", "full", {"0": 1.0, "1": 1.0, "2": 0.0})
    cell("vt_256_aware_h2o_c0.5.json", "h2o", {"0": 0.0, "1": 1.0})  # (sample 2 not answered yet)
    rows = {r["policy"]: r for r in write_report(tmp_path)["rows"]}
    assert (rows["full"]["samples"], rows["full"]["score"]) == (2, 100.0)
    assert (rows["h2o"]["samples"], rows["h2o"]["score"]) == (2, 50.0)


def test_a_full_only_grid_reports_its_ceiling(tmp_path) -> None:
    (tmp_path / "cells").mkdir()
    for task, scores in (("vt", [1.0, 0.0]), ("qa", [1.0, 1.0])):
        settings = {"task": task, "length": 512, "protocol": "aware", "policy": "full", "compression": 0.0}
        predictions = {str(i): {"score": v, "first_token_s": 1.0, "total_s": 2.0} for i, v in enumerate(scores)}
        (tmp_path / "cells" / f"{task}_512_full.json").write_text(
            json.dumps({"settings": settings, "predictions": predictions})
        )
    write_report(tmp_path, title="ceiling")
    md = (tmp_path / "results.md").read_text()
    assert "## 512 tokens, the full cache (the ceiling)" in md
    assert "| score % | 100 ± 0 | 50 ± 50 | 75.0 ± 25.0 |" in md


def test_single_needles_are_scored_by_their_depth(tmp_path) -> None:
    """``by_depth`` pools the single-needle tasks' answers by the needle's depth bin, over the samples every setting
    answered; other tasks are not in it; the report writes ``depths.csv`` and a heat map per compression."""
    (tmp_path / "cells").mkdir()
    (tmp_path / "samples").mkdir()
    depths = {"niah_single_1": [0.05, 0.95, 0.5], "niah_single_2": [0.1, 0.99], "vt": [0.1, 0.9]}
    for task, at in depths.items():
        lines = [json.dumps(Sample(task, 512, i, "c", "q", "a", ("1",), (d,), 500).to_dict()) for i, d in enumerate(at)]
        (tmp_path / "samples" / f"{task}_512.jsonl").write_text("\n".join(lines) + "\n")
    grid = {
        ("full", "aware", 0.0): {"niah_single_1": [1, 1, 1], "niah_single_2": [1, 1], "vt": [1, 1]},
        # (sample 2 of niah_single_1 not answered yet: not counted anywhere)
        ("streaming_llm", "agnostic", 0.5): {"niah_single_1": [0, 1], "niah_single_2": [1, 1], "vt": [0, 0]},
    }
    for (policy, protocol, compression), by_task in grid.items():
        for task, scores in by_task.items():
            settings = {"task": task, "length": 512, "protocol": protocol, "policy": policy, "compression": compression}
            predictions = {str(i): {"score": v, "first_token_s": 1.0, "total_s": 2.0} for i, v in enumerate(scores)}
            name = f"{task}_{protocol}_{policy}.json"
            (tmp_path / "cells" / name).write_text(json.dumps({"settings": settings, "predictions": predictions}))
    rows = by_depth(tmp_path)
    got = {(r["policy"], r["depth_from"]): (r["samples"], r["score"]) for r in rows}
    # by hand, 5 bins: depths 0.05 and 0.1 → bin 0; 0.95 and 0.99 → bin 4 (vt is not a single needle)
    assert got == {
        ("full", 0.0): (2, 100.0),
        ("full", 0.8): (2, 100.0),
        ("streaming_llm", 0.0): (2, 50.0),
        ("streaming_llm", 0.8): (2, 100.0),
    }
    assert {r["protocol"] for r in rows if r["policy"] == "full"} == {"both"}
    files = write_report(tmp_path)["files"]
    assert str(tmp_path / "depths.csv") in files and str(tmp_path / "plots" / "depth_512_agnostic_c0.5.png") in files
    with open(tmp_path / "depths.csv") as f:
        assert len(list(csv.DictReader(f))) == 4


def _write_cells(out: Path, grid: list[tuple[str, str, float, dict[str, list[int]]]]) -> None:
    """Cells of a 512-token grid: (policy, protocol, compression, task → the samples' scores) each."""
    (out / "cells").mkdir()
    for policy, protocol, compression, by_task in grid:
        for task, scores in by_task.items():
            settings = {"task": task, "length": 512, "protocol": protocol, "policy": policy, "compression": compression}
            predictions = {str(i): {"score": v, "first_token_s": 1.0, "total_s": 2.0} for i, v in enumerate(scores)}
            name = f"{task}_{protocol}_{policy}_{compression}.json"
            (out / "cells" / name).write_text(json.dumps({"settings": settings, "predictions": predictions}))


def test_overview_puts_every_protocol_and_compression_of_a_length_in_one_table(tmp_path) -> None:
    from kvsieve.results import render

    grid = [("full", "aware", 0.0, {"vt": [1, 1], "qa": [1, 0]})]
    grid += [
        ("h2o", "agnostic", 0.5, {"vt": [1, 0], "qa": [0, 0]}),
        ("h2o", "aware", 0.5, {"vt": [1, 1], "qa": [1, 0]}),
    ]
    _write_cells(tmp_path, grid)
    # by hand: full 100 ± 0 and 50 ± 50 → 75 ± 25; h2o agnostic 50 ± 50 and 0 ± 0 → 25 ± 25; aware as full
    page = render("<!-- results: . overview -->\n<!-- /results -->", tmp_path)
    assert (
        "512 tokens, average over 2 task(s), score % ± standard error; the full cache (the ceiling): **75.0 ± 25.0**"
        in page
    )
    assert "| policy | agnostic 0.5 | aware 0.5 |\n|---|---:|---:|\n| h2o | 25.0 ± 25.0 | 75.0 ± 25.0 |\n" in page
    assert "###" not in page  # (the summary's headings are not there)


def test_leaders_rank_the_policies_of_each_protocol_and_compression(tmp_path) -> None:
    from kvsieve.results import render

    grid = [("full", "aware", 0.0, {"vt": [1, 1], "qa": [1, 0]})]
    grid += [
        ("h2o", "agnostic", 0.5, {"vt": [1, 0], "qa": [0, 0]}),  # 25 ± 25
        ("tova", "agnostic", 0.5, {"vt": [1, 1], "qa": [1, 0]}),  # 75 ± 25
        ("h2o", "agnostic", 0.75, {"vt": [0, 0], "qa": [0, 0]}),  # 0 ± 0, alone at 0.75
        ("tova", "agnostic", 0.75, {"vt": [1, 1]}),  # (no qa row: no average)
    ]
    _write_cells(tmp_path, grid)
    page = render("<!-- results: . leaders -->\n<!-- /results -->", tmp_path)
    head = "512 tokens, question-agnostic, average score % over 2 task(s) ± standard error; the full cache:"
    assert head + " **75.0 ± 25.0**." in page
    assert "| dropped | #1 | #2 | #3 |\n|---|---|---|---|\n" in page
    assert "| 50% | `tova` 75.0 ± 25.0 | `h2o` 25.0 ± 25.0 | – |\n" in page
    assert "| 75% | `h2o` 0.0 ± 0.0 | – | – |\n" in page


@pytest.mark.slow
def test_cli_quick_grid_then_report_only(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "ruler"
    argv = ["ruler", "--quick", "--out", str(out), "--tasks", "niah_single_1", "--samples", "1", "--policies"]
    assert main([*argv, "full", "streaming_llm", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {(r["policy"], r["protocol"], r["compression"], r["samples"]) for r in result["rows"]} == {
        ("full", "both", 0.0, 1),
        ("streaming_llm", "agnostic", 0.5, 1),
        ("streaming_llm", "aware", 0.5, 1),
    }
    assert all(r["length"] == 1024 for r in result["rows"])

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvsieve.models.load_model", refuse)
    assert main(["ruler", "--out", str(out), "--report", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == result["rows"]
    assert main(["ruler", "--out", str(out), "--compressions", "1.5", "--json"]) == 2  # (one line, nothing run)
    assert "error" in json.loads(capsys.readouterr().out)
