"""Quantized slots from the command line and the evaluation layers: ``--kv-bits`` (with ``--group-size`` and
``--kv-residual``) on every command that builds a cache, refused before any model loads when wrong, reaching the
cache (a tiny local model), kept by sweeps at 100 %, bench and lm-eval's model arguments."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from script_support import load_script

from kvsieve.api import make_cache
from kvsieve.benchmarks import profile
from kvsieve.benchmarks.memory import held_kv_bytes
from kvsieve.cli import main
from kvsieve.engine.quant import KVQuant
from kvsieve.evaluation.lm_eval_model import KVSieveLM
from kvsieve.policies import join_spec, split_spec, with_spec_keys

COMMANDS = [
    ["generate", "Hi"],
    ["ask", "--context", "ctx.txt", "-q", "Who?"],
    ["ppl"],
    ["compare"],
    ["needle"],
    ["bench"],
    ["xsum"],
    ["sweep", "--out", "x"],
    ["serve"],
]
IDS = [c[0] for c in COMMANDS]
TINY = ["--group-size", "8"]  # (the tiny models' heads have 16 channels: the default groups of 32 do not fit)


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_unsupported_bits_are_usage_errors(capsys, command) -> None:
    assert main([*command, "--kv-bits", "3"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"kvsieve {command[0]}: error: argument --kv-bits: invalid choice: 3 (choose from 2, 4, 8)"
    assert main([*command, "--kv-residual", "-1"]) == 2
    assert "argument --kv-residual: expected an integer >= 0" in capsys.readouterr().err


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--group-size", "8"], "--group-size and --kv-residual apply to quantized slots only: give --kv-bits too"),
        (["--kv-bits", "2", "--group-size", "6"], "group_size must be a multiple of 4 for 2-bit codes"),
    ],
    ids=["no-bits", "group"],
)
def test_bad_quantization_is_one_line_before_the_model_loads(capsys, command, options, message) -> None:
    assert main([*command, *options]) == 2
    out, err = capsys.readouterr()
    assert not out and err == f"kvsieve {command[0]}: error: {message}\n"


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--policy", "h2o:kv_bits=4", "--kv-bits", "4", "Hi"],
        ["compare", "--policies", "full", "h2o:kv_bits=8", "--kv-bits", "4"],
        ["bench", "--policies", "h2o:kv_bits=8", "--kv-bits", "4"],
        ["sweep", "--out", "x", "--policies", "h2o:kv_bits=8", "--kv-bits", "4"],
    ],
    ids=lambda argv: argv[0],
)
def test_bits_given_twice_are_refused(capsys, argv) -> None:
    assert main(argv) == 2
    assert "kv_bits given both in 'h2o:kv_bits=" in capsys.readouterr().err


@pytest.mark.usefixtures("no_model")
def test_help_states_the_quantization_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    defaults = {f.name: f.default for f in dataclasses.fields(KVQuant)}
    assert f"channels per scale/zero pair (default {defaults['group_size']})" in help_text
    assert f"newest tokens of each row also kept exactly (default {defaults['residual']})" in help_text


@pytest.mark.usefixtures("no_model")
def test_a_saved_context_keeps_its_own_quantization(capsys, tmp_path) -> None:
    assert main(["ask", "--load", str(tmp_path / "ctx.safetensors"), "-q", "Who?", "--kv-bits", "4"]) == 2
    assert "keeps the quantization it was compressed with" in capsys.readouterr().err


def test_spec_keys_are_added_and_joined() -> None:
    assert join_spec("h2o", {}) == "h2o"
    assert with_spec_keys("ahakv:sgs=false", {"kv_bits": 4}) == "ahakv:sgs=false,kv_bits=4"
    assert with_spec_keys(" h2o ", {}) == " h2o "  # (nothing to add: the spec as given)
    assert split_spec(with_spec_keys("h2o", {"kv_bits": 2, "residual": 0})) == (
        "h2o",
        {"kv_bits": "2", "residual": "0"},
    )
    with pytest.raises(ValueError, match=r"residual given both in 'h2o:residual=3' and as -r"):
        with_spec_keys("h2o:residual=3", {"residual": 4}, "as -r")


def test_generate_holds_the_real_bytes_of_quantized_slots(capsys, tiny_dir) -> None:
    common = ["generate", "--model", str(tiny_dir), "--budget", "8", "--max-new-tokens", "6", "The river town"]
    plain = _json(capsys, *common)
    quant = _json(capsys, *common, "--kv-bits", "4", *TINY, "--kv-residual", "4")
    assert plain["policy"] == "h2o" and quant["policy"] == "h2o:kv_bits=4,group_size=8,residual=4"
    assert quant["generated_tokens"] == plain["generated_tokens"] == 6
    slots = _slots(plain["kv_bytes"])
    assert slots >= 8 and quant["kv_bytes"] == _quant_bytes(slots, 4, residual=4)


def _slots(plain_bytes: int) -> int:
    """The slots per row a plain cache of the tiny Llama allocated (3 layers × 2 KV heads × 16 fp32 channels)."""
    slots, rest = divmod(plain_bytes, 3 * 2 * 16 * 4 * 2)
    assert not rest
    return slots


def _quant_bytes(slots: int, bits: int, residual: int) -> int:
    """The tiny Llama's quantized K/V bytes per batch row, written out: codes, float16 scale/zero per group of 8, the
    fp32 ring and its int64 mark (3 layers, 2 KV heads, keys and values of 16 channels)."""
    codes = slots * 16 * bits // 8
    scales = slots * (16 // 8) * 2 * 2
    ring = (residual + 1) * 16 * 4 if residual else 0
    return 3 * (2 * 2 * (codes + scales + ring) + (8 if residual else 0))


@pytest.mark.parametrize(("bits", "residual"), [(8, 0), (4, 32), (2, 5)])
def test_predicted_bytes_equal_the_cache(tiny_lm, make_ids, bits, residual) -> None:
    model, _ = tiny_lm
    cache = make_cache(model, "h2o", 16, kv_bits=bits, group_size=8, residual=residual)
    with torch.inference_mode():
        model(make_ids(2, 40), cache=cache)
    slots = max(cache.capacities())
    predicted = held_kv_bytes(model, slots, cache.codec, batch=2)
    assert cache.kv_nbytes() == predicted == 2 * _quant_bytes(slots, bits, residual)


def test_ppl_flag_equals_the_spec_and_differs_from_plain(capsys, tiny_dir) -> None:
    common = ["ppl", "--model", str(tiny_dir), "--max-tokens", "48", "--budget", "16"]
    flag = _json(capsys, *common, "--kv-bits", "2", *TINY)
    spec = _json(capsys, *common, "--policy", "h2o:kv_bits=2,group_size=8")
    plain = _json(capsys, *common)
    assert flag["policy"] == spec["policy"] == "h2o:kv_bits=2,group_size=8" and plain["policy"] == "h2o"
    assert flag["ppl"] == spec["ppl"] and flag["kv_bytes"] == spec["kv_bytes"]
    assert flag["ppl"] != plain["ppl"] and flag["tokens_scored"] == plain["tokens_scored"] == 47


def test_compare_names_each_row_by_its_spec(capsys, tiny_dir) -> None:
    argv = ["compare", "--model", str(tiny_dir), "--max-tokens", "48", "--budget", "16", "--sample-tokens", "2"]
    out = _json(capsys, *argv, "--policies", "full", "h2o", "--kv-bits", "8", *TINY)
    rows = {r["policy"]: r for r in out["rows"]}
    assert list(rows) == ["full:kv_bits=8,group_size=8", "h2o:kv_bits=8,group_size=8"]
    assert rows["full:kv_bits=8,group_size=8"]["ppl_vs_full"] == 1
    mixed = _json(capsys, *argv, "--policies", "full", "h2o", "h2o:kv_bits=2,group_size=8")
    assert [r["policy"] for r in mixed["rows"]] == ["full", "h2o", "h2o:kv_bits=2,group_size=8"]
    assert mixed["rows"][1]["ppl"] != mixed["rows"][2]["ppl"]


def test_sweep_keeps_the_quantization_at_100_percent(capsys, tiny_dir, tmp_path) -> None:
    argv = ["sweep", "--model", str(tiny_dir), "--out", str(tmp_path), "--ppl-tokens", "48", "--budgets", "0.5", "1.0"]
    out = _json(capsys, *argv, "--policies", "full", "h2o", "--kv-bits", "4", *TINY)
    spec = "full:kv_bits=4,group_size=8"
    got = {(r["policy"], r["budget_label"]): r for r in out["rows"]}
    assert got["h2o:kv_bits=4,group_size=8", "50%"]["computed_as"] == "h2o:kv_bits=4,group_size=8"
    assert {got[key]["computed_as"] for key in got if key[1] == "100%" or key[0] == spec} == {spec}
    plain = {(r["policy"], r["budget_label"]): r for r in _json(capsys, *argv, "--policies", "full")["rows"]}
    assert plain["full", "100%"]["computed_as"] == "full"
    assert plain["full", "100%"]["ppl"] != got[spec, "100%"]["ppl"]


def test_bench_checks_quantized_cells_against_the_floor_apart(capsys, tiny_dir) -> None:
    # (the checks are the eviction-overhead preset's, at budget 512: a prompt just past it)
    argv = ["bench", "--model", str(tiny_dir), "--prompt-lens", "520", "--gen-lens", "4", "--batches", "1"]
    spec = "h2o:kv_bits=4,group_size=8,residual=8"
    out = _json(capsys, *argv, "--budget", "512", "--repeats", "1", "--policies", "h2o", spec)
    cells = {c["policy"]: c for c in out["cells"]}
    assert set(cells) == {"dynamic_full", "floor", "h2o", spec}
    quant = cells[spec]
    assert quant["budget_tokens"] == 512 and quant["ratios"]["vs_floor"]["step_ms_p50"] > 0
    assert quant["kv_bytes"] == _quant_bytes(_slots(cells["h2o"]["kv_bytes"]), 4, 8)  # real bytes, not dequantized
    checks = {c["check"].split(" (")[0]: c for c in out["checks"]}
    check = checks["decode step of quantized slots"]
    assert "kv_bits=4" in check["measured"]
    assert check["passed"] is (quant["ratios"]["vs_floor"]["step_ms_p50"] <= 1.3)  # (the quantized cell alone)
    for name, check in checks.items():
        if name != "decode step of quantized slots":
            assert "kv_bits" not in check["measured"], name


def test_profile_takes_a_quantized_spec(tiny_factory, make_ids) -> None:
    tiny = tiny_factory("llama_gqa")  # (a private copy: the profiler switches its attention implementation)
    spec = "streaming_llm:kv_bits=2,group_size=8"
    result = profile.profile_decode(tiny, make_ids(1, 64)[0], policy=spec, budget=8, prompt=24, steps=3, top=5)
    assert result["policy"] == spec and len(result["ops"]) == 5


def test_lm_eval_model_arguments_quantize_every_cache(tiny_lm) -> None:
    model, tokenizer = tiny_lm
    lm = KVSieveLM(model=model, tokenizer=tokenizer, policy="h2o", kv_bits="4", group_size="8")
    assert lm._cache(None).codec == KVQuant(4, 8) and lm._cache(12).codec == KVQuant(4, 8)
    full = KVSieveLM(model=model, tokenizer=tokenizer, policy="full:kv_bits=2,group_size=8")
    assert full._cache(None).codec == KVQuant(2, 8)
    with pytest.raises(ValueError, match="kv_bits must be one of 2, 4, 8"):
        KVSieveLM(model=model, tokenizer=tokenizer, policy="h2o", kv_bits="3")


# -- the measurement scripts' own parts -------------------------------------------------------------------------------


def test_quanto_bytes_are_codes_scale_and_shift() -> None:
    side = load_script("quantized_cache_side_by_side")
    layer = side.MeasuredQuantoLayer(nbits=4, q_group_size=32, residual_length=32, axis_key=0, axis_value=0)
    x = torch.randn(1, 3, 64, 64)
    keys, values = layer._quantize(x, 0), layer._quantize(2 * x, 0)
    groups = x.numel() // 32
    one = x.numel() // 2 + groups * 4 * 2  # 4-bit codes; float32 scale and shift per group of 32
    assert side.tensor_nbytes(keys) == side.tensor_nbytes(values) == one
    assert layer.nbytes() == 2 * one  # (no exact window yet)
    assert (keys.dequantize() - x).abs().max() < (x.amax() - x.amin()) / 15


def test_grid_table_and_claim() -> None:
    grid = load_script("quant_grid")
    ppl = {("full", 1.0): 20.0, ("full:kv_bits=4", 1.0): 20.2, ("h2o", 0.2): 21.0, ("h2o:kv_bits=4", 0.2): 21.3}
    rows = [{"policy": p, "budget": b, "ppl": v} for (p, b), v in ppl.items()]
    table = grid.grid_tables(rows, ["h2o"], [0.2], [4])
    assert table == {("full", 1.0): {None: 20.0, 4: 20.2}, ("h2o", 0.2): {None: 21.0, 4: 21.3}}
    assert "| h2o | 20% | 21.000 | 21.300 (+1.4 %) |" in grid.markdown_grid(table, [4], 512)
    assert grid.claim(table).endswith("21.300 vs 21.000 (+1.43 %): holds")
    table["h2o", 0.2][4] = 21.5
    assert grid.claim(table).endswith("(+2.38 %): does NOT hold")
    del table["h2o", 0.2]
    assert grid.claim(table).endswith("not measured")
