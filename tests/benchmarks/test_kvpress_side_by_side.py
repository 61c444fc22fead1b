"""scripts/kvpress_side_by_side.py and its worker: the pure parts (Jaccard, summaries, tables, requests, argument
errors, matching kept keys) and the kvsieve worker's JSON on a tiny random model. kvpress itself is not installed
here (it lives in its own virtualenv)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from script_support import load_script

driver = load_script("kvpress_side_by_side")
worker = load_script("kvpress_worker")


def test_jaccard():
    assert driver.jaccard([1, 2, 3], [2, 3, 4]) == pytest.approx(2 / 4)
    assert driver.jaccard([5, 6], [6, 5]) == 1.0
    assert driver.jaccard([1], [2]) == 0.0
    assert driver.jaccard([], []) == 1.0


def test_kept_agreement_per_layer_and_head():
    kvsieve = [[[0, 1], [0, 1]], [[0, 1], [2, 3]]]
    kvpress = [[[0, 1], [0, 2]], [[0, 1], [0, 1]]]
    agreement = driver.kept_agreement(kvsieve, kvpress)
    assert agreement["per_head"] == [[1.0, pytest.approx(1 / 3)], [1.0, 0.0]]
    assert agreement["per_layer"] == [pytest.approx(2 / 3), 0.5]
    assert agreement["mean"] == pytest.approx((2 + 1 / 3) / 4)
    assert agreement["min"] == 0.0
    with pytest.raises(ValueError, match="shapes"):
        driver.kept_agreement(kvsieve, kvpress[:1])


def _run(prefill: float, step: float, kv: int, kept: list | None = None) -> dict:
    run = {"prefill_s": prefill, "step_ms": step, "kv_bytes": kv, "extra_bytes": 0, "slots": kv // 8}
    return run if kept is None else {**run, "kept": kept}


def _runs() -> list[dict]:
    """Three rounds: kvsieve ran two knorm settings, each paired with a KnormPress run."""
    kept_s, kept_p = [[[0, 1, 2]]], [[[1, 2, 3]]]
    rounds = []
    for i, (s, p) in enumerate([(1.0, 2.0), (3.0, 2.0), (2.0, 8.0)]):
        kept = i == 0
        rounds.append(
            {
                "knorm": {
                    "kvsieve": _run(s, 10 * s, 800, kept_s if kept else None),
                    "kvpress": _run(p, 10 * p, 1600, kept_p if kept else None),
                },
                "knorm:recent=0": {
                    "kvsieve": _run(s, 10 * s, 800, kept_p if kept else None),
                    "kvpress": _run(p, 10 * p, 1600, kept_p if kept else None),
                },
            }
        )
    return rounds


def test_summarize_takes_medians_and_per_round_ratios():
    rows = driver.summarize(_runs(), ["knorm", "knorm:recent=0"])
    assert [r["method"] for r in rows] == ["knorm", "knorm:recent=0"]
    knorm = rows[0]
    assert knorm["press"] == "KnormPress"
    assert knorm["kvsieve"]["prefill_s"] == 2.0 and knorm["kvpress"]["prefill_s"] == 2.0
    assert knorm["kvsieve"]["step_ms"] == 20.0
    # per-round ratios 0.5, 1.5, 0.25: their median, not the ratio of the medians (1.0)
    assert knorm["ratio"]["prefill_s"] == 0.5
    assert knorm["ratio"]["kv_bytes"] == 0.5
    assert knorm["kept"]["mean"] == pytest.approx(0.5)
    assert rows[1]["kept"]["mean"] == 1.0  # the kvpress-matching setting, against the same press run


def test_tables_have_a_line_per_row():
    rows = driver.summarize(_runs(), ["knorm", "knorm:recent=0"])
    text = driver.text_table(rows).splitlines()
    assert len(text) == 3 and text[0].startswith("kvsieve")
    assert "0.50×" in text[1] and "0.500 (0.500)" in text[1]
    md = driver.markdown_table(rows).splitlines()
    assert len(md) == 4 and md[1].startswith("|---")
    assert md[3].startswith("| `knorm:recent=0` | KnormPress | 2.00 / 2.00 |")


def _settings(tmp_path: Path, **over) -> object:
    args = driver.parse_args(["--model", str(tmp_path / "model"), "--kvpress-venv", str(tmp_path / "venv")])
    for key, value in over.items():
        setattr(args, key, value)
    return driver.check_args(args)


def test_settings_full_and_quick(model_and_venv):
    full = _settings(model_and_venv)
    assert (full.context, full.steps, full.rounds, full.threads) == (2048, 256, 3, 1)
    assert full.budget == 409  # kvpress: int(2048 · (1 − 0.8)); kvsieve's round(0.2 · 2048) would be 410
    assert full.presses == ["dynamic", "streaming_llm", "snapkv", "knorm", "tova"]
    quick = _settings(model_and_venv, quick=True, steps=8)
    assert (quick.context, quick.steps, quick.rounds, quick.budget) == (512, 8, 2, 102)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"context": 256}, "--context must be at least 512"),
        ({"steps": 0}, "--steps must be at least 1"),
        ({"rounds": 0}, "--rounds must be at least 1"),
        ({"threads": 0}, "--threads must be at least 1"),
        ({"steps": 300}, r"--context \+ --steps \(2348\) exceed the model's 2304 positions"),
    ],
)
def test_bad_settings_are_refused(model_and_venv, over, message):
    with pytest.raises(ValueError, match=message):
        _settings(model_and_venv, **over)


def test_missing_model_or_venv_is_refused(model_and_venv):
    with pytest.raises(ValueError, match="no model at"):
        _settings(model_and_venv, model=model_and_venv / "nothing")
    (model_and_venv / "venv" / ".installed").unlink()  # a build that did not finish
    with pytest.raises(ValueError, match="pass --build-venv to create it"):
        _settings(model_and_venv)
    assert _settings(model_and_venv, build_venv=True).build_venv


def test_main_refuses_in_one_line_before_running(model_and_venv, monkeypatch):
    monkeypatch.setattr(driver, "run", lambda settings: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exit_info:
        driver.main(["--model", str(model_and_venv / "model"), "--kvpress-venv", str(model_and_venv / "v"), "--quick"])
    message = str(exit_info.value.code)
    assert message.startswith("kvpress_side_by_side: error: no kvpress virtualenv at") and "\n" not in message


def test_schedule_alternates_the_side_going_first_and_the_method_order():
    kvs, kvp = ("kvsieve", "kvpress"), ("kvpress", "kvsieve")
    assert driver.schedule(["a", "b", "c"], 2) == [
        (0, "a", kvs), (0, "b", kvp), (0, "c", kvs),
        (1, "c", kvp), (1, "b", kvs), (1, "a", kvp),
    ]  # fmt: skip


class FakeWorker:
    def __init__(self, side: str, log: list) -> None:
        self.side, self.log = side, log

    def ask(self, request: dict) -> dict:
        self.log.append((self.side, request.get("method", request["do"])))
        return {"side": self.side} if request["do"] == "finish" else {}


def test_run_pair_steps_both_sides_in_lockstep():
    log, ticks = [], []
    workers = {side: FakeWorker(side, log) for side in ("kvsieve", "kvpress")}
    order = ("kvpress", "kvsieve")
    runs = driver.run_pair(workers, "snapkv:window=64,kernel=5", order, 3, True, lambda: ticks.append(len(log)))
    assert runs == {"kvpress": {"side": "kvpress"}, "kvsieve": {"side": "kvsieve"}}
    assert log == [
        ("kvpress", "snapkv"), ("kvsieve", "snapkv:window=64,kernel=5"),
        ("kvpress", "step"), ("kvsieve", "step"),
        ("kvsieve", "step"), ("kvpress", "step"),
        ("kvpress", "step"), ("kvsieve", "step"),
        ("kvpress", "finish"), ("kvsieve", "finish"),
    ]  # fmt: skip
    assert ticks == [2, 4, 6, 8]  # after the prefills, then after each pair of steps


def test_setup_requests_share_ids_and_settings(model_and_venv):
    settings = _settings(model_and_venv, quick=True, methods=["knorm", "knorm:recent=0", "tova"])
    kvsieve, kvpress = (driver.setup_request(settings, [5, 6, 7], side) for side in ("kvsieve", "kvpress"))
    assert kvsieve["methods"] == ["knorm", "knorm:recent=0", "tova"] and kvpress["methods"] == ["knorm", "tova"]
    for request in (kvsieve, kvpress):
        assert request["ids"] == [5, 6, 7] and request["budget"] == 102 and request["compression_ratio"] == 0.8
        assert request["threads"] == 1 and request["warmup"] == 512


def test_match_positions_recovers_gathered_rows():
    reference = torch.randn(2, 50, 8)
    index = torch.tensor([[3, 7, 49, 0], [10, 11, 12, 40]])
    kept = reference.gather(1, index[..., None].expand(-1, -1, 8))
    assert worker.match_positions(kept, reference) == [[0, 3, 7, 49], [10, 11, 12, 40]]
    kept[1, 2] += 1e-6  # no longer a copy of any prompt key
    with pytest.raises(RuntimeError, match="no copy of a prompt key"):
        worker.match_positions(kept, reference)


def test_kvsieve_worker_json_on_a_tiny_model(tiny_factory, tmp_path):
    tiny_factory("llama_gqa").save_pretrained(tmp_path / "tiny")
    ids = torch.randint(3, 128, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    methods = ["dynamic", "streaming_llm", "knorm:recent=0", "snapkv:window=64,kernel=5", "tova"]
    setup = {
        "side": "kvsieve",
        "model": str(tmp_path / "tiny"),
        "ids": ids,
        "threads": 1,
        "methods": methods,
        "budget": 102,
        "compression_ratio": 0.8,
        "warmup": 512,
    }
    lines = [json.dumps(setup)]
    for m in methods:
        start = {"do": "start", "method": m, "kept": m != "tova"}
        lines += [json.dumps(c) for c in (start, {"do": "step"}, {"do": "step"}, {"do": "step"}, {"do": "finish"})]
    out = io.StringIO()
    worker.serve(lines, out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(replies) == 1 + 5 * len(methods)
    hello, runs = replies[0], dict(zip(methods, replies[5::5], strict=True))
    assert all(r == {} for r in replies[2::5] + replies[3::5] + replies[4::5])
    assert [r["prefill_s"] for r in replies[1::5]] == [r["prefill_s"] for r in runs.values()]
    assert hello["side"] == "kvsieve" and hello["threads"] == 1
    assert set(hello["versions"]) == {"kvsieve", "torch", "transformers"}
    per_slot = 2 * 3 * 2 * 16 * 4  # K and V, 3 layers, 2 KV heads of dim 16, fp32
    assert runs["dynamic"]["slots"] == 512 + 3 and runs["dynamic"]["kv_bytes"] == (512 + 3) * per_slot
    assert "kept" not in runs["dynamic"] and "kept" not in runs["tova"]
    for name in methods[1:]:
        run = runs[name]
        assert run["prefill_s"] > 0 and run["step_ms"] > 0 and run["steps"] == 3 and run["extra_bytes"] > 0
        assert run["slots"] == 103 and run["kv_bytes"] == 103 * per_slot  # the budget (+ the stale slot), held
    for name in methods[1:-1]:
        kept = runs[name]["kept"]
        assert len(kept) == 3 and all(len(layer) == 2 for layer in kept)
        assert all(len(head) == 102 and head == sorted(head) for layer in kept for head in layer)
    assert all(head == [0, 1, 2, 3, *range(414, 512)] for layer in runs["streaming_llm"]["kept"] for head in layer)
