"""The command line, through ``kvsieve.cli.main``: listing, usage errors (before any model loads), the commands on
the real default model and real text (``slow``). Policy parameters (``-p``) are in ``test_params.py``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from kvsieve.cli import main
from kvsieve.evaluation.compare import DEFAULT_POLICIES
from kvsieve.policies import REGISTRY


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_policies_lists_every_registered_policy(capsys) -> None:
    rows = _run_json(capsys, "policies")["policies"]
    assert [r["name"] for r in rows] == list(REGISTRY)
    for row in rows:
        assert row["needs_attention"] is REGISTRY[row["name"]].needs_attention
        assert (row["probed"], row["needs_queries"]) == (
            REGISTRY[row["name"]].probed,
            REGISTRY[row["name"]].needs_queries,
        )
        assert row["summary"] and row["paper"]


def test_json_results_say_where_they_come_from(capsys) -> None:
    import torch
    import transformers

    from kvsieve.provenance import CPU_FLAGS

    origin = _run_json(capsys, "policies")["provenance"]
    assert origin["command"] == ["kvsieve", "policies", "--json"]
    assert origin["versions"]["torch"] == torch.__version__
    assert origin["versions"]["transformers"] == transformers.__version__
    assert set(origin["cpu"]["flags"]) <= set(CPU_FLAGS) and origin["cpu"]["cores"] >= 1
    assert origin["threads"] == torch.get_num_threads() and origin["date"].endswith(" UTC")


def test_policies_json_lists_memory_saving(capsys) -> None:
    assert main(["policies", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["policies"]}
    assert set(rows) == set(REGISTRY)
    assert rows["topk_oracle"]["saves_memory"] is False and rows["topk_oracle"]["takes_budget"] is True
    assert rows["full"]["takes_budget"] is False and rows["snapkv"]["saves_memory"] is True
    assert rows["snapkv"]["params"] == {"window": None, "kernel": 7, "pooling": "max"}
    assert all(row["paper"] and row["summary"] for row in rows.values())


KEYS = {"policy", "budget_tokens", "prompt_tokens", "generated_tokens", "text", "kv_slots_max", "kv_bytes"}


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["Hello", "The city lies on the river, and its old town is known for " * 3])
def test_generate(capsys, prompt) -> None:
    out = _run_json(capsys, "generate", "--max-new-tokens", "8", "--budget", "16", prompt)
    assert set(out) >= KEYS
    assert out["policy"] == "h2o" and out["budget_tokens"] == 16
    assert out["prompt_tokens"] >= 1 and 1 <= out["generated_tokens"] <= 8
    assert isinstance(out["text"], str) and out["text"]
    # The cache has seen the prompt and every generated token but the last; it holds at most the budget.
    assert out["kv_slots_max"] == min(16, out["prompt_tokens"] + out["generated_tokens"] - 1)
    assert out["kv_bytes"] > 0


@pytest.mark.slow
def test_ppl(capsys) -> None:
    out = _run_json(capsys, "ppl", "--max-tokens", "96", "--budget", "32", "--policy", "h2o")
    assert out["tokens_scored"] == 95
    assert math.isfinite(out["ppl"]) and out["ppl"] > 1
    assert out["budget_tokens"] == 32 and out["kv_slots_max"] <= 32


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("abc", "neither a token count"),
        ("0", "positive number of tokens, got 0"),
        ("-3", "positive number of tokens, got -3"),
        ("1.5", "ratio must be in (0, 1], got 1.5"),
    ],
)
def test_bad_budget_is_a_usage_error(capsys, budget, message) -> None:
    assert main(["generate", "--budget", budget, "Hello"]) == 2
    err = capsys.readouterr().err
    assert "argument --budget" in err and message in err


NUMBERS = [
    (["generate", "Hi"], "--max-new-tokens", ["0", "-5", "x"]),
    (["ppl"], "--max-tokens", ["0", "-5"]),
    (["ppl"], "--prefill", ["0", "-1"]),
    (["ppl"], "--curve-every", ["0", "-1"]),
    (["compare"], "--max-tokens", ["-5"]),
    (["compare"], "--sample-tokens", ["0"]),
    (["needle"], "--lengths", ["512", "0"]),
    (["needle"], "--depths", ["0.5", "1.5"]),
    (["needle"], "--depths", ["-0.1"]),
    (["needle"], "--depths", ["nan"]),
    (["needle"], "--trials", ["0"]),
    (["bench"], "--prompt-lens", ["0"]),
    (["bench"], "--gen-lens", ["1"]),
    (["bench"], "--batches", ["1", "-4"]),
    (["bench"], "--repeats", ["0"]),
    (["bench"], "--mem-cap-gb", ["0"]),
    (["bench"], "--mem-cap-gb", ["inf"]),
    (["xsum"], "--limit", ["0"]),
    (["xsum"], "--max-new-tokens", ["0"]),
    (["xsum"], "--batch-size", ["0"]),
    (["sweep", "--out", "x"], "--limit", ["0"]),
    (["sweep", "--out", "x"], "--ppl-tokens", ["-1"]),
    (["sweep", "--out", "x"], "--jobs", ["0"]),
    (["sweep", "--out", "x"], "--threads", ["0"]),
]


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(("command", "option", "values"), NUMBERS, ids=[f"{c[0]}{o}" for c, o, _ in NUMBERS])
def test_nonsense_numbers_are_usage_errors(capsys, command, option, values) -> None:
    argv = [*command, option, *values]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("usage: kvsieve ")
    assert err.splitlines()[-1].startswith(f"kvsieve {command[0]}: error: argument {option}: expected ")
    assert main([*argv, "--json"]) == 2
    out, err = capsys.readouterr()
    assert not err and json.loads(out)["type"] == "UsageError"
    assert json.loads(out)["error"].startswith(f"argument {option}: expected ")


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(
    ("argv", "kind", "message"),
    [
        (["generate", "--nope", "Hi"], "UsageError", "unrecognized arguments: --nope"),
        (["sweep"], "UsageError", "the following arguments are required: --out"),
        (["ppl", "--engine", "fast"], "UsageError", "argument --engine: invalid choice: 'fast'"),
        (["generate", "--policy", "nope", "Hi"], "ValueError", "unknown policy 'nope'"),
        (["generate", "-p", "normalize=maybe", "Hi"], "ValueError", "for h2o parameter 'normalize'"),
        (["generate", "--prompt-file", "/no/such/prompt.txt"], "FileNotFoundError", "/no/such/prompt.txt"),
        (["bench", "--prompt-lens", "1", "2", "3", "--gen-lens", "2", "3"], "ValueError", "must pair up"),
    ],
)
def test_json_errors_are_one_object_on_stdout(capsys, argv, kind, message) -> None:
    assert main([*argv, "--json"]) == 2
    out, err = capsys.readouterr()
    assert not err and out.count("\n") == 1
    error = json.loads(out)
    assert set(error) == {"error", "type"} and error["type"] == kind and message in error["error"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and message in err.splitlines()[-1] and "Traceback" not in err


def _python(code: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, **kwargs)


def test_help_and_usage_errors_do_not_import_torch() -> None:
    code = """
import sys
import kvsieve
from kvsieve.cli import main
assert main(["generate", "--max-new-tokens", "0", "Hi"]) == 2
for argv in (["--help"], ["generate", "--help"], ["bench", "--help"]):
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code == 0
light = ("kvsieve.benchmarks", "kvsieve.benchmarks.defaults")  # the parser's defaults, no heavy imports
heavy = ("torch", "transformers", "kvsieve.api", "kvsieve.benchmarks")
print(sorted(m for m in sys.modules if m.startswith(heavy) and m not in light))
"""
    assert _python(code).stdout.splitlines()[-1] == "[]"


def test_first_public_name_used_registers_the_attention() -> None:
    code = """
import kvsieve
from transformers import AttentionInterface
print("kvsieve" in AttentionInterface(), kvsieve.POLICIES["h2o"].name, "kvsieve" in AttentionInterface())
"""
    assert _python(code).stdout.split() == ["False", "h2o", "True"]


def test_a_closed_stdout_is_no_traceback() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsieve.cli", "policies"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()  # the reader goes away before the output (`kvsieve policies | head -2`)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "BrokenPipeError" not in err and "Traceback" not in err


@pytest.mark.slow
def test_ppl_on_a_text_shorter_than_the_budget_says_so(capsys, tmp_path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("A short text.")
    assert main(["ppl", "--file", str(text), "--budget", "64"]) == 2
    err = capsys.readouterr().err
    assert "the text has " in err and " tokens and the budget is 64: nothing would be evicted" in err
    assert "prefill must be" not in err


@pytest.mark.slow
def test_compare_is_the_demo(capsys) -> None:
    out = _run_json(capsys, "compare", "--max-tokens", "80", "--budget", "24", "--sample-tokens", "8")
    rows = {r["policy"]: r for r in out["rows"]}
    assert list(rows) == list(DEFAULT_POLICIES)
    assert rows["full"]["ppl_vs_full"] == 1
    assert all(math.isfinite(r["ppl"]) and r["tokens_scored"] == 79 for r in rows.values())
    for name, row in rows.items():
        if REGISTRY[name].bounded:
            assert row["kv_mib"] < rows["full"]["kv_mib"], name
            assert row["kv_slots_max"] <= 24
