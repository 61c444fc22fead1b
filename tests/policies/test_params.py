"""Policy parameters, in one place: each is checked against its ``Params`` annotation (as a Python value or as
command-line text), then against the budget and the other parameters when the policy is built; one clear
``ValueError`` naming the policy and the parameter, through every entry point (the policy classes, ``make_cache``,
the command line's ``-p``, lm-eval's ``model_args``)."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

import pytest
from lm_eval.utils import simple_parse_args_string

import kvsieve
from kvsieve.cli import build_parser, main
from kvsieve.cli.arguments import checked_params
from kvsieve.evaluation.lm_eval_model import KVSieveLM
from kvsieve.policies import REGISTRY, resolve_spec
from kvsieve.policies.ahakv import AhaKV
from kvsieve.policies.h2o import H2O, H2OParams
from kvsieve.policies.scissorhands import Scissorhands

BUDGET = 10

# -- types: every parameter of every policy against its annotation --------------------------------------------------

# Values of each annotated type: accepted (given → stored) and refused, as Python values and as command-line text.
GOOD: dict[type, list[tuple[Any, Any]]] = {
    bool: [(True, True), (False, False), ("true", True), ("FALSE", False), ("1", True), ("0", False)],
    int: [(3, 3), ("3", 3), ("-2", -2)],
    float: [(1, 1.0), (0.25, 0.25), ("0.25", 0.25), ("1", 1.0)],
}
BAD: dict[type, list[Any]] = {
    bool: [1, 0, 2.5, "abc", "yes", "2", ""],
    int: [True, 2.5, 2.0, "2.5", "abc", "true", ""],
    float: [True, False, "abc", "true", ""],
}
NONE = [None, "none", "NULL"]
PARAMS = [
    (name, f.name, typing.get_type_hints(cls.Params)[f.name])
    for name, cls in REGISTRY.items()
    for f in dataclasses.fields(cls.Params)
]


def _cases(kind: Any) -> tuple[list[tuple[Any, Any]], list[Any]]:
    """(accepted (given, stored) pairs, refused values) for a parameter annotated ``kind``."""
    args = typing.get_args(kind)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else kind
    if typing.get_origin(base) is typing.Literal:
        good, bad = [(c, c) for c in typing.get_args(base)], [1, True, "nope", ""]
    else:
        good, bad = GOOD[base], BAD[base]
    return (good + [(v, None) for v in NONE], bad) if optional else (good, bad + NONE)


def test_params_walk_covers_every_kind() -> None:
    kinds = {kind for _, _, kind in PARAMS}
    assert {bool, int, float, int | None} <= kinds
    assert any(typing.get_origin(kind) is typing.Literal for _, _, kind in PARAMS)


@pytest.mark.parametrize(("policy", "name", "kind"), PARAMS, ids=[f"{p}-{n}" for p, n, _ in PARAMS])
def test_params_are_checked_against_their_annotations(policy, name, kind) -> None:
    cls = REGISTRY[policy]
    good, bad = _cases(kind)
    for value, expected in good:
        stored = getattr(cls.make_params(**{name: value}), name)
        assert stored == expected and type(stored) is type(expected), (value, stored)
    pattern = rf"^invalid value .* for {re.escape(policy)} parameter '{name}' \(expected .+\)$"
    for value in bad:
        with pytest.raises(ValueError, match=pattern):
            cls.make_params(**{name: value})


@pytest.mark.parametrize(
    ("policy", "kwargs", "message"),
    [
        ("h2o", {"normalize": "abc"}, "invalid value 'abc' for h2o parameter 'normalize' (expected true/false)"),
        ("h2o", {"recent": 1.5}, "invalid value 1.5 for h2o parameter 'recent' (expected an integer or none)"),
        ("h2o", {"recent_ratio": True}, "invalid value True for h2o parameter 'recent_ratio' (expected a number)"),
        (
            "h2o",
            {"transform": "square"},
            "invalid value 'square' for h2o parameter 'transform' (expected one of identity, sqrt, log)",
        ),
        (
            "streaming_llm",
            {"sink": "2.5"},
            "invalid value '2.5' for streaming_llm parameter 'sink' (expected an integer)",
        ),
        ("local", {"sink": 4}, "policy 'local' has no parameter(s) sink (parameters: none)"),
    ],
)
def test_params_errors_say_what_is_expected(policy, kwargs, message) -> None:
    with pytest.raises(ValueError) as err:
        REGISTRY[policy].make_params(**kwargs)
    assert str(err.value) == message


def test_h2o_params_built_directly_still_check_the_transform() -> None:
    with pytest.raises(ValueError, match="h2o: transform must be one of identity, sqrt, log"):
        H2O(8, H2OParams(transform="square"))


# -- values: checked against the budget and each other when the policy is built -------------------------------------


@pytest.mark.parametrize(
    ("policy", "params", "name"),
    [
        ("scissorhands", {"window": 0}, "window"),
        ("scissorhands", {"drop": 0}, "drop"),
        ("scissorhands", {"drop": BUDGET + 1}, "drop"),
        ("scissorhands", {"recent": BUDGET, "drop": 2}, "recent"),
        ("scissorhands", {"recent": -1}, "recent"),
        ("ahakv", {"recent": BUDGET + 1}, "recent"),
        ("ahakv", {"recent": 0}, "recent"),
        ("ahakv", {"kernel": 4}, "kernel"),
        ("ahakv", {"kernel": 0}, "kernel"),
        ("h2o", {"recent": BUDGET + 1}, "recent"),
    ],
)
def test_invalid_params_raise_naming_the_parameter(policy, params, name) -> None:
    with pytest.raises(ValueError, match=rf"{policy}: {name}\b"):
        REGISTRY[policy](BUDGET, REGISTRY[policy].make_params(**params))


def test_small_budgets_get_valid_defaults() -> None:
    for budget in (1, 2, 5):
        for cls in (Scissorhands, AhaKV):
            policy = cls(budget)
            assert 0 <= policy.recent <= budget


# -- entry points: make_cache, the command line's -p, lm-eval's model_args ------------------------------------------


@pytest.mark.parametrize(
    ("policy", "kwargs", "message"),
    [
        ("strided", {"recent": 9}, "strided: recent must be in"),
        ("strided", {"stride": 0}, "strided: stride must be >= 1"),
        ("fixed", {"block": 9}, "fixed: block must be in"),
        ("fixed", {"block": 4, "summary": 5}, "fixed: summary must be in"),
        ("random", {"recent": 9}, "random: recent must be in"),
        ("snapkv", {"window": 9}, "snapkv: window must be in"),
        ("snapkv", {"kernel": 4}, "snapkv: kernel must be a positive odd number"),
        ("knorm", {"recent": -1}, "knorm: recent must be in"),
        ("streaming_llm", {"sink": True}, "invalid value True for streaming_llm parameter 'sink'"),
        ("h2o", {"normalize": "false", "recent": "abc"}, "invalid value 'abc' for h2o parameter 'recent'"),
    ],
)
def test_bad_params(llama_gqa, policy, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, policy, 8, **kwargs)


@pytest.mark.parametrize(
    ("policy", "kwargs", "message"),
    [
        ("h2o", {"recent": 9}, r"h2o: recent window \(9\) is larger than the budget \(8\)"),
        ("streaming_llm", {"sink": 8}, r"streaming_llm: sink \(8\) must be smaller than the budget \(8\)"),
        ("nope", {}, "unknown policy 'nope'; available: full, "),
        ("h2o", {"recnt": 2}, r"policy 'h2o' has no parameter\(s\) recnt \(parameters: .*recent"),
    ],
)
def test_bad_policy_or_params(llama_gqa, policy, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, policy, 8, **kwargs)


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
    kwargs = checked_params(build_parser().parse_args(argv))
    assert kwargs == {"normalize": False, "recent": None, "recent_ratio": 1.0, "transform": "log"}
    assert type(kwargs["recent_ratio"]) is float


@pytest.mark.slow
def test_invalid_policy_parameter_exits_2(capsys) -> None:
    """Checked against the budget once the model is loaded (the real default model)."""
    assert main(["generate", "--budget", "8", "-p", "recent=9", "Hello"]) == 2
    assert "recent window (9) is larger than the budget (8)" in capsys.readouterr().err


def _lm(model, tokenizer, **kwargs) -> KVSieveLM:
    return KVSieveLM(model=model, tokenizer=tokenizer, batch_size=2, **kwargs)


def test_model_args_policy_params_are_parsed_by_their_type(tiny_lm) -> None:
    tiny, tokenizer = tiny_lm
    converted = simple_parse_args_string("normalize=false,recent=none,recent_ratio=1,transform=log")  # as lm-eval does
    lm = _lm(tiny, tokenizer, policy="h2o", **converted)
    assert lm.policy_kwargs == {"normalize": False, "recent": None, "recent_ratio": 1.0, "transform": "log"}
    assert _lm(tiny, tokenizer, policy="h2o", recent="8", normalize="TRUE").policy_kwargs == {
        "recent": 8,
        "normalize": True,
    }
    for bad in ("normalize=maybe", "recent=2.5", "recent=true"):
        with pytest.raises(ValueError, match=rf"for h2o parameter '{bad.split('=')[0]}'"):
            _lm(tiny, tokenizer, policy="h2o", **simple_parse_args_string(bad))


# -- policy specs: "name:key=value,..." wherever a policy is named -------------------------------------------------


def test_a_spec_carries_parameters_and_a_schedule(llama_gqa) -> None:
    cls, params, schedule, quant = resolve_spec(" ahakv: sgs=false , recent=3,schedule=increasing,kv_bits=4")
    assert (cls, params, schedule, quant) == (AhaKV, {"sgs": False, "recent": 3}, "increasing", {"kv_bits": "4"})
    from_spec = kvsieve.make_cache(llama_gqa, "h2o:recent=0,schedule=increasing", 12)
    from_kwargs = kvsieve.make_cache(llama_gqa, "h2o", 12, schedule="increasing", recent=0)
    uniform = kvsieve.make_cache(llama_gqa, "h2o", 12)
    for cache in (from_spec, from_kwargs, uniform):
        cache.resolve(20)
    assert from_spec.plan.layer_policies[-1][1] == from_kwargs.plan.layer_policies[-1][1] == H2OParams(recent=0)
    assert from_spec.budgets == from_kwargs.budgets != uniform.budgets


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ahakv:sgs", "bad policy spec"),
        ("ahakv:sgs=true,sgs=false", "bad policy spec"),
        ("ahakv:colour=red", "has no parameter(s) colour"),
        ("ahakv:sgs=maybe", "invalid value 'maybe' for ahakv parameter 'sgs'"),
        ("nothing:recent=1", "unknown policy 'nothing'"),
        ("h2o:schedule=sideways", "unknown layer schedule 'sideways'"),
    ],
)
def test_bad_specs_are_one_line_errors_before_a_model_loads(spec: str, message: str, capsys) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_spec(spec)
    assert main(["generate", "--policy", spec, "--model", "/nonexistent", "Hello"]) == 2  # before loading anything
    assert message.split("(")[0] in capsys.readouterr().err


def test_a_parameter_given_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="recent given both"):
        resolve_spec("h2o:recent=3", {"recent": 4})
    args = build_parser().parse_args(["generate", "--policy", "h2o:recent=3", "-p", "recent=4", "--prompt", "x"])
    with pytest.raises(ValueError, match="recent given both"):
        checked_params(args)


def test_lm_eval_model_args_take_a_spec(tiny_lm) -> None:
    model, tokenizer = tiny_lm
    lm = KVSieveLM(model=model, tokenizer=tokenizer, policy="scissorhands:window=7,schedule=pyramid", budget=16)
    assert (lm.policy, lm.policy_kwargs, lm.schedule) == (Scissorhands, {"window": 7}, "pyramid")
    assert lm._cache(16).plan.layer_policies[-1][1].window == 7
