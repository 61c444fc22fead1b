"""The command line, through ``kvsieve.cli.main`` (real default model, real text)."""

from __future__ import annotations

import json
import math

import pytest

from kvsieve.cli import _policy_kwargs, build_parser, main
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
        assert row["summary"] and row["paper"]


KEYS = {"policy", "budget_tokens", "prompt_tokens", "generated_tokens", "text", "kv_slots_max", "kv_bytes"}


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
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--budget", budget, "Hello"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --budget" in err and message in err


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails the test: the command must stop before."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvsieve.models.load_model", refuse)


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["generate", "--policy", "streaming_llm", "-p", "sink=abc", "Hello"],
            "'abc' for streaming_llm parameter 'sink'",
        ),
        (["ppl", "-p", "normalize=maybe"], "'maybe' for h2o parameter 'normalize' (expected true/false)"),
        (["needle", "-p", "recent=2.5"], "'2.5' for h2o parameter 'recent' (expected an integer or none)"),
        (["xsum", "-p", "transform=square"], "'square' for h2o parameter 'transform' (expected one of identity, "),
        (["generate", "--policy", "local", "-p", "sink=4", "Hello"], "policy 'local' has no parameter(s) sink"),
    ],
)
def test_ill_typed_policy_parameter_is_one_line_before_the_model_loads(capsys, argv, message) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvsieve {argv[0]}: error: ") and err.count("\n") == 1
    assert message in err


def test_policy_parameters_are_parsed_by_their_type() -> None:
    argv = ["generate", "-p", "normalize=FALSE", "-p", "recent=none", "-p", "recent_ratio=1", "-p", "transform=log"]
    kwargs = _policy_kwargs(build_parser().parse_args(argv))
    assert kwargs == {"normalize": False, "recent": None, "recent_ratio": 1.0, "transform": "log"}
    assert type(kwargs["recent_ratio"]) is float


def test_invalid_policy_parameter_exits_2(capsys) -> None:
    assert main(["generate", "--budget", "8", "-p", "recent=9", "Hello"]) == 2
    assert "recent window (9) is larger than the budget (8)" in capsys.readouterr().err


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
