"""scripts/kvpress_ruler.py and the worker's ``ruler`` command: the mapping, argument errors, the ids both sides are
sent, the order they are asked in, the summary and report from fixed records, and the kvsieve worker's answers on a
tiny random model. kvpress itself is not installed here (it lives in its own virtualenv)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from script_support import load_script

from kvsieve.qa import SEPARATOR
from kvsieve.ruler.predict import FULL, predict
from kvsieve.ruler.tasks import Prompter, Sample

ruler = load_script("kvpress_ruler")
qa_driver = load_script("kvpress_qa")
worker = load_script("kvpress_worker")


# --- the mapping ------------------------------------------------------------------------------------------------


def test_rows_map_kvsieve_specs_to_presses():
    assert ruler.METHODS == {
        "streaming_llm": "streaming_llm",
        "snapkv:window=64,kernel=5": "snapkv",
        "snapkv:window=64,kernel=5,pooling=mean": "snapkv",
        "tova": "tova",
        "knorm:recent=0": "knorm",
        "h2o": "observed_attention",
        "h2o:recent=0,normalize=true": "observed_attention",
        "kvzip": "kvzip",
        "kvzip:heads=adakv,safeguard=0": "kvzip",
        "keydiff:recent=0": "keydiff",
        "expected_attention": "expected_attention",
        "snapkv:window=64,kernel=5,pooling=mean,heads=adakv": "adakv_snapkv",
        "snapkv:window=64,kernel=5,schedule=pyramid": "pyramidkv",
        "full": "dynamic",
    }
    assert all(qa_driver.METHODS[m] == ruler.METHODS[m] for m in qa_driver.METHODS if m in ruler.METHODS)
    assert list(ruler.METHODS)[:-2] == ruler.DEFAULT_METHODS  # PyramidKV's and full only when asked
    assert ruler.press_of("h2o") == "observed_attention"
    names = {ruler.PRESS_NAMES[ruler.press_of(m)] for m in ruler.METHODS}
    assert names == {
        "StreamingLLMPress", "SnapKVPress", "TOVAPress", "KnormPress", "ObservedAttentionPress", "KVzipPress",
        "KeyDiffPress", "ExpectedAttentionPress", "AdaKVPress", "PyramidKVPress", "DynamicCache",
    }  # fmt: skip
    assert ruler.EAGER == ("observed_attention",)


def test_kvsieve_gets_the_token_count_kvpress_keeps():
    assert ruler.kvpress_kept(4003, 0.5) == 2001  # (kvsieve's ratio budget: round(2001.5) = 2002)
    assert ruler.kvpress_kept(4096, 0.75) == 1024 and ruler.kvpress_kept(3, 0.9) == 1
    setting = ruler.kvsieve_setting("snapkv:window=64,kernel=5", 0.5, 2001)
    assert setting.budget == 2001 and setting.protocol == "agnostic" and setting.compression == 0.5
    assert setting.key == "agnostic_snapkv:window=64,kernel=5_c0.5"
    assert ruler.kvsieve_setting("full", 0.5, 10) is FULL


# --- arguments --------------------------------------------------------------------------------------------------


def _write_samples(path: Path, count: int, stamp: dict | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"index": i}) + "\n" for i in range(count)))
    if stamp is not None:
        path.with_suffix(".settings.json").write_text(json.dumps(stamp))


@pytest.fixture
def ruler_dir(model_and_venv: Path) -> Path:
    """A ruler output directory (``ruler``) beside the model and kvpress virtualenv of ``model_and_venv``:
    niah_single_1 at 1024 (3 samples) and 2048 (1), vt at 1024 (2), made with ``model``."""
    stamp = {"count": 3, "model": str(model_and_venv / "model"), "seed": 0, "chat_template": True}
    samples = model_and_venv / "ruler" / "samples"
    _write_samples(samples / "niah_single_1_1024.jsonl", 3, stamp)
    _write_samples(samples / "niah_single_1_2048.jsonl", 1, stamp)
    _write_samples(samples / "vt_1024.jsonl", 2, stamp | {"count": 2})
    return model_and_venv


def _settings(root: Path, *extra: str) -> object:
    args = ["--ruler-out", str(root / "ruler"), "--kvpress-venv", str(root / "venv"), *extra]
    return ruler.check_args(ruler.parse_args(args))


def test_default_settings_come_from_the_samples(ruler_dir):
    settings = _settings(ruler_dir)
    assert settings.groups == (("niah_single_1", 1024), ("niah_single_1", 2048), ("vt", 1024))
    assert settings.samples is None and settings.compressions == (0.5,)
    assert settings.methods == tuple(ruler.DEFAULT_METHODS) and settings.threads == 1 and not settings.parallel
    assert settings.model == ruler_dir / "model" and settings.chat_template
    assert settings.out.parts[-2:] == ("out", "kvpress_ruler")
    chosen = _settings(ruler_dir, "--tasks", "vt", "--samples", "2", "--compressions", "0.25", "0.9", "--parallel")
    assert (chosen.groups, chosen.samples, chosen.compressions) == ((("vt", 1024),), 2, (0.25, 0.9))
    assert chosen.parallel
    assert _settings(ruler_dir, "--methods", "tova", "full").methods == ("tova", "full")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tasks", "qa", "vt"], r"no samples for qa in .*samples \(there: niah_single_1_1024, niah_single_1_2048, "),
        (["--tasks", "vt", "--lengths", "2048"], "no samples for vt at 2048 in"),
        (["--lengths", "8192", "1024"], "no samples for length 8192 in"),
        (["--samples", "0"], "--samples must be at least 1, got 0"),
        (["--samples", "2"], r"niah_single_1_2048\.jsonl holds 1 samples, fewer than --samples 2"),
        (["--compressions", "0.5", "1"], r"in \(0, 1\); got 1\.0"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--model", "no-such-model"], "'no-such-model' is neither a built-in model"),
    ],
)
def test_bad_settings_are_refused(ruler_dir, extra, message):
    with pytest.raises(ValueError, match=message):
        _settings(ruler_dir, *extra)


def test_missing_samples_model_or_venv_are_refused(ruler_dir, tmp_path):
    with pytest.raises(ValueError, match=r"no samples in .*nothing/samples \(`kvsieve ruler --out"):
        ruler.check_args(ruler.parse_args(["--ruler-out", str(tmp_path / "nothing")]))
    stamp = ruler_dir / "ruler" / "samples" / "vt_1024.settings.json"
    stamp.write_text(json.dumps({"model": "other", "chat_template": True}))
    with pytest.raises(ValueError, match="made with different model settings"):
        _settings(ruler_dir)
    for path in (ruler_dir / "ruler" / "samples").glob("*.settings.json"):
        path.unlink()  # (samples of an old run: nothing recorded)
    with pytest.raises(ValueError, match="record no model: pass --model"):
        _settings(ruler_dir)
    assert _settings(ruler_dir, "--model", str(ruler_dir / "model")).model == ruler_dir / "model"
    (ruler_dir / "venv" / ".installed").unlink()
    with pytest.raises(ValueError, match="pass --build-venv to create it"):
        _settings(ruler_dir, "--model", str(ruler_dir / "model"))


def test_main_refuses_in_one_line_before_running(ruler_dir, monkeypatch):
    monkeypatch.setattr(ruler, "run", lambda *args: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exit_info:
        ruler.main(
            ["--ruler-out", str(ruler_dir / "ruler"), "--kvpress-venv", str(ruler_dir / "venv"), "--samples", "9"]
        )
    message = str(exit_info.value.code)
    assert message.startswith("kvpress_ruler: error: ") and "fewer than --samples 9" in message and "\n" not in message


# --- what each side is sent -------------------------------------------------------------------------------------


def _sample(prompter: Prompter, index: int, hay: int, length: int = 4096) -> Sample:
    context = "Some numbers are hidden below.\n\n" + "The lake is calm today. " * hay + "The secret number is 1234567."
    question, prefix = "What is the secret number?", "The secret number is"
    tokens = prompter.count(context, question, prefix)
    return Sample("niah_single_1", length, index, context, question, prefix, ("1234567",), (1.0,), tokens)


@pytest.fixture
def real_ruler_dir(ruler_dir, tokenizer) -> Path:
    """``ruler_dir`` with two real niah_single_1 samples at 4096 (short ones, counted with the default tokenizer)."""
    prompter = Prompter(tokenizer)
    path = ruler_dir / "ruler" / "samples" / "niah_single_1_4096.jsonl"
    path.write_text("".join(json.dumps(_sample(prompter, i, 40 + 10 * i).to_dict()) + "\n" for i in range(2)))
    path.with_suffix(".settings.json").write_text(json.dumps({"model": str(ruler_dir / "model")}))
    return ruler_dir


def test_plan_splits_each_sample_as_the_ruler_run_does(real_ruler_dir, tokenizer):
    settings = _settings(
        real_ruler_dir, "--tasks", "niah_single_1", "--lengths", "4096", "--compressions", "0.5", "0.25"
    )
    items = ruler.plan(settings, tokenizer)
    assert [i.sample.index for i in items] == [0, 1]
    for item in items:
        s = item.sample
        assert (item.head, item.tail) == Prompter(tokenizer).ids(s.context, s.question, s.answer_prefix)
        assert item.text == (s.context + SEPARATOR, s.question, s.answer_prefix) and item.max_new_tokens == 128
    assert items[0].digest != items[1].digest and len(items[0].digest) == 16
    assert (
        len(
            ruler.plan(
                _settings(real_ruler_dir, "--tasks", "niah_single_1", "--lengths", "4096", "--samples", "1"), tokenizer
            )
        )
        == 1
    )


def test_plan_refuses_another_tokenizer_or_too_few_kept_tokens(real_ruler_dir, tokenizer):
    path = real_ruler_dir / "ruler" / "samples" / "niah_single_1_4096.jsonl"
    args = ("--tasks", "niah_single_1", "--lengths", "4096")
    with pytest.raises(
        ValueError, match=r"keeps \d+ of the \d+ context tokens of niah_single_1_4096 #0: snapkv:window=64"
    ):
        ruler.plan(_settings(real_ruler_dir, *args, "--compressions", "0.9"), tokenizer)
    assert ruler.plan(_settings(real_ruler_dir, *args, "--compressions", "0.9", "--methods", "tova"), tokenizer)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["tokens"] += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        ValueError, match=r"niah_single_1_4096 #1 has \d+ tokens with the tokenizer of .*pass the --model"
    ):
        ruler.plan(_settings(real_ruler_dir, *args), tokenizer)


def test_both_sides_get_the_same_ids_budget_and_limit(real_ruler_dir, tokenizer):
    settings = _settings(real_ruler_dir, "--tasks", "niah_single_1", "--lengths", "4096")
    item = ruler.plan(settings, tokenizer)[0]
    jobs = ruler.jobs(settings, item, 0.5)
    assert jobs["kvsieve"] == list(ruler.METHODS)[:-2]
    assert jobs["kvpress"] == [
        "streaming_llm", "snapkv", "tova", "knorm", "observed_attention", "kvzip", "keydiff", "expected_attention",
        "adakv_snapkv",
    ]  # fmt: skip
    sent = {side: ruler.request(item, 0.5, jobs[side][1]) for side in ("kvsieve", "kvpress")}
    assert sent["kvsieve"]["method"] == "snapkv:window=64,kernel=5" and sent["kvpress"]["method"] == "snapkv"
    assert sent["kvsieve"] | {"method": None} == sent["kvpress"] | {"method": None}
    request = sent["kvpress"]
    assert (request["context_ids"], request["question_ids"]) == (item.head, item.tail)
    assert request["budget"] == int(len(item.head) * 0.5) and request["max_new_tokens"] == 128
    full = _settings(
        real_ruler_dir, "--tasks", "niah_single_1", "--methods", "full", "tova", "--compressions", "0.5", "0.75"
    )
    assert ruler.jobs(full, item, 0.5) == {"kvsieve": ["full", "tova"], "kvpress": ["dynamic", "tova"]}
    assert ruler.jobs(full, item, 0.75) == {"kvsieve": ["tova"], "kvpress": ["tova"]}  # (full once)
    key = ruler.record_key(full, item, 0.75, "kvpress", "dynamic")
    assert key["compression"] == 0.0 and key["ids"] == item.digest and key["index"] == 0


class FakeWorker:
    """Records what it is sent in a shared log; answers with the method it was asked."""

    def __init__(self, side: str, log: list) -> None:
        self.side, self.log, self.pending = side, log, []

    def send(self, request: dict) -> None:
        self.log.append(("send", self.side, request["method"]))
        self.pending.append(request)

    def receive(self) -> dict:
        self.log.append(("receive", self.side))
        return {"method": self.pending.pop(0)["method"]}

    def ask(self, request: dict) -> dict:
        self.send(request)
        return self.receive()


@pytest.mark.parametrize("parallel", [False, True])
def test_sides_alternate_one_at_a_time_or_both_at_once(parallel):
    log, answers = [], []
    workers = {side: FakeWorker(side, log) for side in ("kvsieve", "kvpress")}
    queues = {"kvsieve": ["a", "b"], "kvpress": ["x", "y", "z"]}
    ruler.run_queues(
        workers, queues, ("kvpress", "kvsieve"), parallel, lambda side, m: {"method": m}, lambda *a: answers.append(a)
    )
    assert queues == {"kvsieve": ["a", "b"], "kvpress": ["x", "y", "z"]}  # (left as they were)
    assert [(side, m) for side, m, _ in answers] == [
        ("kvpress", "x"), ("kvsieve", "a"), ("kvpress", "y"), ("kvsieve", "b"), ("kvpress", "z"),
    ]  # fmt: skip
    sends = [entry for entry in log if entry[0] == "send"]
    if parallel:
        assert log[:4] == [
            ("send", "kvpress", "x"),
            ("send", "kvsieve", "a"),
            ("receive", "kvpress"),
            ("receive", "kvsieve"),
        ]
    else:
        assert log[:4] == [
            ("send", "kvpress", "x"),
            ("receive", "kvpress"),
            ("send", "kvsieve", "a"),
            ("receive", "kvsieve"),
        ]
    assert len(sends) == 5


# --- summary and report -----------------------------------------------------------------------------------------


CPU = {"name": "Intel(R) Xeon(R) Processor", "flags": ["avx2", "avx512f"], "cores": 2}


def _rec(
    index: int, side: str, method: str, answer: str, score: float, seconds: float, kept: int = 50, c=0.5,
    task: str = "niah_single_1",
) -> dict:  # fmt: skip
    key = {"task": task, "length": 4096, "index": index, "compression": c, "side": side, "method": method}
    return {
        "key": key, "answer": answer, "answer_tokens": 3, "seconds": seconds, "rss_peak_mib": 2000.0 + seconds,
        "rss_rise_mib": 10.0 * seconds, "kept": kept, "kept_min": kept, "score": score, "same_ids": True,
        "pipeline_ids": True if side == "kvpress" else None, "cpu": CPU,
    }  # fmt: skip


RECORDS = [
    _rec(0, "kvsieve", "tova", "1234567.", 1.0, 2.0),
    _rec(0, "kvpress", "tova", "1234567.", 1.0, 4.0),
    _rec(1, "kvsieve", "tova", "7654321.", 1.0, 4.0),
    _rec(1, "kvpress", "tova", "42.", 0.0, 6.0, kept=51),
    _rec(0, "kvpress", "expected_attention", "1234567.", 1.0, 3.0),
    _rec(1, "kvpress", "expected_attention", "9.", 0.0, 3.0),
    _rec(0, "kvsieve", "expected_attention", "1234567.", 1.0, 2.0),
    _rec(1, "kvsieve", "expected_attention", "9.", 0.0, 2.0),
    _rec(0, "kvsieve", "full", "1234567.", 1.0, 5.0, kept=100, c=0.0),
    _rec(0, "kvpress", "dynamic", "1234567.", 1.0, 5.0, kept=100, c=0.0),
    _rec(1, "kvsieve", "full", "7654321.", 1.0, 5.0, kept=100, c=0.0),  # (kvpress has not answered #1)
]


def test_summary_pairs_the_samples_both_sides_answered():
    rows = ruler.summarize(RECORDS, [("niah_single_1", 4096)], [0.5, 0.75], ["full", "tova", "expected_attention"])
    full, tova, expected = rows  # (nothing at 0.75; full once, at compression 0)
    assert (full["compression"], full["samples"], full["press"], full["same_answer"]) == (0.0, 1, "DynamicCache", 1.0)
    assert (tova["compression"], tova["samples"], tova["same_answer"], tova["same_kept"]) == (0.5, 2, 0.5, False)
    assert tova["kvsieve"] == {
        "score": 100.0, "stderr": 0.0, "seconds": 3.0, "rss_peak_mib": 2004.0, "rss_rise_mib": 30.0, "kept": 50.0,
    }  # fmt: skip
    assert (tova["kvpress"]["score"], tova["kvpress"]["stderr"]) == (50.0, 50.0)
    assert tova["same_ids"] and tova["pipeline_ids"]
    assert (expected["kvsieve"]["score"], expected["kvsieve_spec"]) == (50.0, "expected_attention")
    assert expected["same_answer"] == 1.0
    assert (expected["samples"], expected["kvpress"]["score"], expected["press"]) == (2, 50.0, "ExpectedAttentionPress")


OTHER_TASK = [
    _rec(0, "kvsieve", "tova", "blue", 0.0, 8.0, task="qa"),
    _rec(0, "kvpress", "tova", "blue", 0.0, 2.0, task="qa"),
    _rec(0, "kvpress", "expected_attention", "red", 1.0, 1.0, task="qa") | {"cpu": CPU | {"name": "AMD EPYC"}},
    _rec(0, "kvsieve", "expected_attention", "red", 1.0, 1.0, task="qa"),
]
GROUPS = [("niah_single_1", 4096), ("qa", 4096)]


def test_overview_pools_the_samples_of_every_task():
    rows = ruler.overview([*RECORDS, *OTHER_TASK], GROUPS, [0.5], ["tova", "expected_attention"])
    tova, expected = rows
    assert (tova["tasks"], tova["samples"], tova["same_answer"], tova["compression"]) == (2, 3, 2 / 3, 0.5)
    assert tova["kvsieve"]["score"] == pytest.approx(200 / 3) and tova["kvpress"]["score"] == pytest.approx(100 / 3)
    assert (tova["kvsieve"]["seconds"], tova["kvpress"]["seconds"]) == (pytest.approx(14 / 3), 4.0)
    assert (expected["tasks"], expected["samples"], expected["same_answer"]) == (2, 3, 1.0)
    per_task = ruler.summarize([*RECORDS, *OTHER_TASK], GROUPS, [0.5], ["tova"])
    assert [(r["task"], r["tasks"], r["samples"]) for r in per_task] == [("niah_single_1", 1, 2), ("qa", 1, 1)]
    assert ruler.hosts([*RECORDS, *OTHER_TASK]) == {
        "Intel(R) Xeon(R) Processor (avx2, avx512f)": 14, "AMD EPYC (avx2, avx512f)": 1,
    }  # fmt: skip


def _result(tmp_path: Path, records: list[dict], groups: list, methods: list[str]) -> dict:
    return {
        "model": "qwen2.5-coder-0.5b", "ruler_out": str(tmp_path), "threads": 1, "parallel": False, "git": "abc1234",
        "versions": {"kvsieve": {"kvsieve": "0.1.0"}, "kvpress": {"kvpress": "0.5.5", "transformers": "5.2.0"}},
        "full_cache": ruler.full_cache(tmp_path, records), "hosts": ruler.hosts(records),
        "overview": ruler.overview(records, groups, [0.5], methods),
        "rows": ruler.summarize(records, groups, [0.5], methods), "differing": ruler.differing(records),
    }  # fmt: skip


def test_report_over_several_tasks_and_its_rendering(tmp_path):
    result = _result(tmp_path, [*RECORDS, *OTHER_TASK], GROUPS, ["tova", "expected_attention"])
    md = ruler.markdown(result).splitlines()
    assert md[3] == (
        "Answered on Intel(R) Xeon(R) Processor (avx2, avx512f): 14 answers; AMD EPYC (avx2, avx512f): 1 answers."
    )
    first = md.index("## All 2 tasks and lengths (their samples pooled)")
    assert md[first + 4].startswith("| `tova` | TOVAPress | 0.5 | 66.7 ± 33.3 | 33.3 ± 33.3 | 67% of 3 | 4.7 / 4.0 |")
    assert md.index("## qa, 4096 tokens (1 sample)") > md.index("## niah_single_1, 4096 tokens (2 samples)") > first
    one_task = _result(tmp_path, RECORDS, GROUPS[:1], ["tova"])
    assert not any(line.startswith("## All") for line in ruler.markdown(one_task).splitlines())

    from kvsieve.provenance import provenance
    from kvsieve.results import render_file

    result["provenance"] = provenance(["scripts/kvpress_ruler.py", "--samples", "1"], model="qwen2.5-coder-0.5b")
    (tmp_path / "kvpress_ruler.json").write_text(json.dumps(result))
    text = render_file(tmp_path / "kvpress_ruler.json").splitlines()
    assert "kvpress side: kvpress 0.5.5, transformers 5.2.0. Answered on Intel(R) Xeon(R) Processor" in text[0]
    assert text[2].startswith("| kvsieve | kvpress | c | tasks / samples | score kvsieve % |")
    assert text[4] == "| `tova` | TOVAPress | 0.5 | 2 / 3 | 66.7 ± 33.3 | 33.3 ± 33.3 | 2 of 3 | 4.7 / 4.0 | 47 / 40 |"
    assert text[5] == (
        "| `expected_attention` | ExpectedAttentionPress | 0.5 | 2 / 3 | 66.7 ± 33.3 | 66.7 ± 33.3 | 3 of 3 "
        "| 1.7 / 2.3 | 17 / 23 |"
    )
    assert text[-1].startswith("*`scripts/kvpress_ruler.py --samples 1` · qwen2.5-coder-0.5b · ")


def test_report_from_fixed_records(tmp_path):
    cells = tmp_path / "cells"
    cells.mkdir()
    predictions = {str(i): {"text": "x", "score": s} for i, s in enumerate([1.0, 0.0, 1.0])}
    (cells / "niah_single_1_4096_full.json").write_text(json.dumps({"settings": {}, "predictions": predictions}))
    result = _result(tmp_path, RECORDS, [("niah_single_1", 4096)], ["tova", "expected_attention"])
    rows = result["rows"]
    assert result["full_cache"] == {"niah_single_1_4096": {"score": 50.0, "stderr": 50.0, "samples": 2}}
    assert result["differing"] == [
        {"task": "niah_single_1", "length": 4096, "index": 1, "compression": 0.5, "method": "tova",
         "kvsieve": "7654321.", "kvpress": "42."},
    ]  # fmt: skip
    md = ruler.markdown(result).splitlines()
    assert md[2].startswith("Model `qwen2.5-coder-0.5b`, fp32, 1 thread(s) a side, one side at a time;")
    assert md[2].endswith("git `abc1234`; kvsieve 0.1.0; kvpress 0.5.5, transformers 5.2.0.")
    assert "## niah_single_1, 4096 tokens (2 samples; full cache in the ruler run: 50.0 ± 50.0)" in md
    tova = "| `tova` | TOVAPress | 0.5 | 100.0 ± 0.0 | 50.0 ± 50.0 | 50% of 2 | 3.0 / 5.0 | 2,004 / 2,006 | 30 / 50 |"
    assert f"{tova} 50 / 50.5 | same |" in md
    assert (
        "| `expected_attention` | ExpectedAttentionPress | 0.5 | 50.0 ± 50.0 | 50.0 ± 50.0 | 100% of 2 | 2.0 / 3.0 "
        "| 2,002 / 2,003 | 20 / 30 | 50 / 50 | same |"
    ) in md
    assert md[-1] == "- niah_single_1_4096 #1 c=0.5 `tova`: kvsieve “7654321.” · kvpress “42.”"
    rows[0]["same_ids"], rows[0]["pipeline_ids"] = False, False
    assert ruler.table_rows(rows)[0][-1] == "DIFFER (pipeline's own ids differ)"


def test_records_score_the_answer_and_check_the_ids_fed(real_ruler_dir, tokenizer):
    settings = _settings(real_ruler_dir, "--tasks", "niah_single_1", "--lengths", "4096")
    item = ruler.plan(settings, tokenizer)[0]
    reply = {
        "answer": "It is 1234567.", "answer_tokens": 6, "seconds": 1.5, "rss_peak_mib": 900.0, "rss_rise_mib": 4.0,
        "kept": 30, "kept_min": 30, "context_ids": item.head, "question_ids": item.tail, "pipeline_ids": True,
    }  # fmt: skip
    key = ruler.record_key(settings, item, 0.5, "kvpress", "tova")
    record = ruler.make_record(key, item, reply, CPU)
    assert record["score"] == 1.0 and record["same_ids"] and record["pipeline_ids"] and record["key"] == key
    assert record["cpu"] == CPU
    assert not ruler.make_record(key, item, reply | {"question_ids": item.tail[:-1]}, CPU)["same_ids"]
    assert ruler.make_record(key, item, reply | {"answer": "42"}, CPU)["score"] == 0.0
    out = tmp = real_ruler_dir / "records.jsonl"
    tmp.write_text(json.dumps(record) + "\n")
    assert ruler.load_records(out) == {json.dumps(key, sort_keys=True): record}


def test_measured_sees_what_runs_inside():
    into: dict = {}
    with ruler.measured(into):
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB
        block += 1
    assert into["seconds"] > 0 and into["rss_peak_mib"] > 64
    assert into["rss_rise_mib"] is None or into["rss_rise_mib"] >= 60


# --- the kvsieve worker -----------------------------------------------------------------------------------------


def test_kvsieve_worker_answers_as_predict(tiny_lm, tmp_path):
    model, tok = tiny_lm
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    prompter = Prompter(tok)
    sample = _sample(prompter, 0, 30)
    head, tail = prompter.ids(sample.context, sample.question, sample.answer_prefix)
    item = ruler.Item(sample, head, tail, (sample.context + SEPARATOR, sample.question, sample.answer_prefix), 6)
    methods = ["streaming_llm", "snapkv:window=64,kernel=5", "full"]
    setup = {"side": "kvsieve", "model": str(tmp_path / "tiny"), "threads": 1, "compression_ratio": 0.5}
    out = io.StringIO()
    worker.serve([json.dumps(r) for r in (setup, *(ruler.request(item, 0.5, m) for m in methods))], out)
    hello, *replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert hello["side"] == "kvsieve"
    loaded = worker.load(str(tmp_path / "tiny"), 1)  # (the worker's model, to compare the very same weights)
    budget = len(head) // 2
    for method, reply in zip(methods, replies, strict=True):
        text, n, _, _ = predict(loaded, tok, head, tail, ruler.kvsieve_setting(method, 0.5, budget), 6)
        assert (reply["answer"], reply["answer_tokens"]) == (text, n)
        assert (reply["context_ids"], reply["question_ids"]) == (head, tail)
        kept = len(head) if method == "full" else budget
        assert reply["kept"] == reply["kept_min"] == kept
        assert reply["seconds"] > 0 and reply["rss_peak_mib"] > 0 and "pipeline_ids" not in reply


class SilentWorker:
    """A worker that says its versions and fails if it is asked anything."""

    def __init__(self, python: Path, setup: dict, threads: int, log: Path) -> None:
        self.hello = {"versions": {setup["side"]: "1.0"}}

    def send(self, request: dict) -> None:
        pytest.fail(f"asked {request['method']}")

    ask = send

    def receive(self) -> dict:
        pytest.fail("waited for an answer")

    def close(self) -> None:
        pass


def test_report_answers_nothing_and_reports_what_is_stored(real_ruler_dir, tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = ("--tasks", "niah_single_1", "--lengths", "4096", "--methods", "tova", "--out", str(out))
    settings = _settings(real_ruler_dir, *args, "--report")
    assert settings.report and not _settings(real_ruler_dir, *args).report
    first, second = ruler.plan(settings, tokenizer)
    reply = {
        "answer": "1234567.", "answer_tokens": 3, "seconds": 1.0, "rss_peak_mib": 900.0, "rss_rise_mib": 4.0,
        "kept": 30, "kept_min": 30, "context_ids": first.head, "question_ids": first.tail, "pipeline_ids": True,
    }  # fmt: skip
    stored = [ruler.make_record(ruler.record_key(settings, first, 0.5, side, "tova"), first, reply, CPU)
              for side in ("kvsieve", "kvpress")]  # fmt: skip
    out.mkdir()
    lines = "".join(json.dumps(r) + "\n" for r in stored)
    (out / "records.jsonl").write_text(lines)
    monkeypatch.setattr(ruler, "WorkerProcess", SilentWorker)
    result = ruler.run(settings, [first, second], ["--report"])  # (the second sample has no answers: none asked)
    assert result["records"] == stored and (out / "records.jsonl").read_text() == lines
    assert [(r["samples"], r["kvsieve"]["score"]) for r in result["rows"]] == [(1, 100.0)]
    assert result["versions"] == {"kvsieve": {"kvsieve": "1.0"}, "kvpress": {"kvpress": "1.0"}}
