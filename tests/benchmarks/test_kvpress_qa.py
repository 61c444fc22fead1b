"""scripts/kvpress_qa.py and the worker's ``ask``: scoring, agreement, the table, argument errors, what each side is
sent, and the kvsieve worker's answers on a tiny random model. kvpress itself is not installed here (it lives in its
own virtualenv)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from script_support import load_script

from kvsieve.qa import compress, split_prompt

qa_driver = load_script("kvpress_qa")
worker = load_script("kvpress_worker")


def test_cases_are_scored_by_the_needle_rule_or_by_a_substring():
    passkey = qa_driver.Case("passkey", "hay", "What is the pass key?", "12345", 12345)
    assert passkey.correct("The pass key is 12345.") and not passkey.correct("The pass key is 1234 5.")
    assert not passkey.correct("It is 99999, not 12345")  # the first number counts
    einstein = qa_driver.Case("einstein", "text", "Where?", "Ulm")
    assert einstein.correct("He was born in Ulm, in 1879") and not einstein.correct("in Bern")


def _record(case: str, method: str, s: tuple[str, list[int], bool], p: tuple[str, list[int], bool]) -> dict:
    side = lambda a: {"answer": a[0], "tokens": a[1], "correct": a[2]}  # noqa: E731
    return {"case": case, "method": method, "same_ids": True, "kvsieve": side(s), "kvpress": side(p)}


RECORDS = [
    _record("passkey 1024 @0.1 #0", "tova", ("The key is 1.", [5, 6], False), ("The key is 1.", [5, 6], False)),
    _record("passkey 1024 @0.9 #0", "tova", ("It is 42.", [7, 8], True), ("It is 42", [7, 9], True)),
    _record("passkey 1024 @0.9 #1", "tova", ("42", [4], True), ("I do not know", [3], False)),
    _record("einstein 1536", "tova", ("Ulm, 1879", [9], True), ("Bern", [9, 2], False)),
    _record("passkey 1024 @0.1 #0", "full", ("a", [1], False), ("a", [1], False)),
]


def test_agreement_counts_identical_answers_and_first_tokens():
    assert qa_driver.agreement(RECORDS[:4]) == {"same_answer": 0.25, "same_first_token": 0.75, "common_prefix": 1.0}
    assert qa_driver.agreement(RECORDS[4:]) == {"same_answer": 1.0, "same_first_token": 1.0, "common_prefix": 1.0}
    assert [qa_driver.common_prefix(*p) for p in [([1, 2, 3], [1, 2, 4]), ([1], [1, 2]), ([], [5])]] == [2, 1, 0]
    with pytest.raises(ValueError, match="no answers"):
        qa_driver.agreement([])


def test_summary_and_table_per_method():
    rows = qa_driver.summarize(RECORDS, ["tova", "full"])
    tova, full = rows
    assert tova["press"] == "TOVAPress" and full["press"] == "DynamicCache"
    assert tova["passkey"] == {"kvsieve": {"correct": 2, "of": 3}, "kvpress": {"correct": 1, "of": 3}}
    assert (tova["questions"], tova["same_answer"], tova["same_first_token"]) == (4, 0.25, 0.75)
    assert tova["einstein"] == {"kvsieve": ["Ulm, 1879"], "kvpress": ["Bern"]} and full["einstein"]["kvsieve"] == []
    md = qa_driver.markdown_table(rows).splitlines()
    assert md[2] == "| `tova` | TOVAPress | 2/3 / 1/3 | 25% of 4 | 75% of 4 | 1.0 | yes |"
    assert md[3] == "| `full` | DynamicCache | 0/1 / 0/1 | 100% of 1 | 100% of 1 | 1.0 | yes |"
    assert md[-1] == "- `tova`: kvsieve “Ulm, 1879” · kvpress “Bern”"


class FakeWorker:
    """Records what it is sent; answers with the ids it is given at construction."""

    def __init__(self, sent: list, context_ids: list[int], answer: str) -> None:
        self.sent, self.context_ids, self.answer = sent, context_ids, answer

    def send(self, request: dict) -> None:
        self.sent.append(request)

    def receive(self) -> dict:
        return {"answer": self.answer, "tokens": [1, 2], "context_ids": self.context_ids, "question_ids": [3]}


def test_both_sides_are_asked_before_either_answer_is_read_with_the_same_context_part():
    sent: list = []
    workers = {"kvsieve": FakeWorker(sent, [1, 2], "Ulm"), "kvpress": FakeWorker(sent, [1, 2], "Bern")}
    case = qa_driver.Case("einstein 8", "Einstein was born", "Where?", "Ulm")
    record = qa_driver.ask_both(workers, "snapkv:window=64,kernel=5", case, 3, 16)
    assert [r["method"] for r in sent] == ["snapkv:window=64,kernel=5", "snapkv"]
    assert [r["context"] for r in sent] == ["Einstein was born", "Einstein was born\n\n"]
    assert all(r["budget"] == 3 and r["max_new_tokens"] == 16 and r["question"] == "Where?" for r in sent)
    assert record["same_ids"] and record["context_tokens"] == 2
    assert record["kvsieve"]["correct"] and not record["kvpress"]["correct"]
    workers["kvpress"].context_ids = [1, 5]
    assert not qa_driver.ask_both(workers, "full", case, 3, 16)["same_ids"]
    assert sent[-1]["method"] == "dynamic"


def test_budget_is_kvpress_kept_count_of_the_context_part(tokenizer):
    context = "Albert Einstein was born in Ulm. " * 20
    part = tokenizer(split_prompt(tokenizer, context)[0], add_special_tokens=False).input_ids
    assert qa_driver.context_budget(tokenizer, context) == int(len(part) * 0.2)


def _settings(tmp_path: Path, *extra: str) -> object:
    model, venv = tmp_path / "model", tmp_path / "venv"
    return qa_driver.check_args(qa_driver.parse_args(["--model", str(model), "--kvpress-venv", str(venv), *extra]))


def test_default_settings(model_and_venv):
    settings = _settings(model_and_venv)
    assert (settings.length, settings.depths, settings.trials, settings.einstein) == (1024, (0.1, 0.5, 0.9), 2, 1536)
    assert settings.methods == ("full", "streaming_llm", "snapkv:window=64,kernel=5", "knorm:recent=0", "tova")
    assert (settings.max_new_tokens, settings.threads) == (24, 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--length", "100"], "--length must be at least 128"),
        (["--trials", "-1"], "--trials must be at least 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--trials", "0", "--einstein", "0"], "nothing to ask"),
        (["--depths", "0.5", "1.5"], r"--depths must be in \[0, 1\]"),
    ],
)
def test_bad_settings_are_refused(model_and_venv, extra, message):
    with pytest.raises(ValueError, match=message):
        _settings(model_and_venv, *extra)


def test_main_refuses_in_one_line_before_running(model_and_venv, monkeypatch):
    monkeypatch.setattr(qa_driver, "run", lambda settings: pytest.fail("ran"))
    (model_and_venv / "venv" / ".installed").unlink()  # a build that did not finish
    with pytest.raises(SystemExit) as exit_info:
        qa_driver.main(["--model", str(model_and_venv / "model"), "--kvpress-venv", str(model_and_venv / "venv")])
    message = str(exit_info.value.code)
    assert message.startswith("kvpress_qa: error: no kvpress virtualenv at") and "\n" not in message


def test_kvsieve_worker_answers_as_compress_and_ask(tiny_lm, tmp_path):
    model, tok = tiny_lm
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    context, question = "Albert Einstein was born in Ulm in 1879. " * 12, "Where was he born?"
    setup = {"side": "kvsieve", "model": str(tmp_path / "tiny"), "threads": 1, "compression_ratio": 0.8}
    asks = [
        {"do": "ask", "method": m, "context": context, "question": question, "budget": 24, "max_new_tokens": 6}
        for m in ("streaming_llm", "full")
    ]
    out = io.StringIO()
    worker.serve([json.dumps(r) for r in (setup, *asks)], out)
    hello, *replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert hello["side"] == "kvsieve"
    loaded = worker.load(str(tmp_path / "tiny"), 1)  # (the worker's model, to compare the very same weights)
    for policy, reply in zip(("streaming_llm", "full"), replies, strict=True):
        qa = compress(loaded, tok, context, policy, 24)
        assert reply["answer"] == qa.ask(question, max_new_tokens=6)
        assert reply["context_ids"] == qa.context_ids[0].tolist()
        assert reply["question_ids"] == qa.question_ids(question)[0].tolist()
        assert 1 <= len(reply["tokens"]) <= 6  # the answer's tokens, the context's forward pass not among them
        assert tok.decode(reply["tokens"], skip_special_tokens=True).strip() == reply["answer"]
