"""scripts/serve_soak.py: a short run against ``kvsieve serve`` on the tiny model (its report's invariants), and how it
classifies answers."""

from __future__ import annotations

import json
from types import ModuleType

import httpx
import pytest
from script_support import load_script

from kvsieve.results import render_file


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    return load_script("serve_soak")


def test_a_short_soak_accounts_for_every_request_and_drains_on_sigterm(soak, tiny_dir, tmp_path) -> None:
    out = tmp_path / "soak.json"
    policies = ["h2o", "snapkv", "streaming_llm", "tova", "full", "h2o:kv_bits=4,group_size=8"]
    argv = ["--model", tiny_dir, "--requests", "40", "--concurrency", "4", "--max-tokens", "16", "--out", str(out)]
    argv += ["--policies", *policies, "--malformed", "0.2", "--disconnect", "0.4", "--multiple", "0.2"]
    argv += ["--kv-memory-gb", "0.01"]  # (10 MiB: a few of the longest prompts at once)
    assert soak.main(argv) == 0
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert requests["sent"] == 40 and requests["failures"] == []
    results = requests["by_result"]
    assert results["ok"] > 0 and results["refused"] == requests["malformed"] > 0 and results["disconnected"] > 0
    assert requests["several_choices"] > 0 and requests["streamed"] > 0
    assert 0 < report["prompt_tokens"]["p50"] <= report["prompt_tokens"]["max"] <= 2048  # (the tiny model's window)
    checks = report["checks"]
    assert checks.pop("rss_flat") is None  # (a run this short is not judged)
    assert all(checks.values()) and report["ok"], checks
    kv = report["kv_bytes"]
    assert 0 < kv["held_max"] <= kv["cap"] == int(0.01 * 2**30) and kv["reserved_max_polled"] <= kv["cap"]
    shutdown = report["shutdown"]
    assert shutdown["running_at_signal"] > 0 and shutdown["completed"] == shutdown["streams"]
    rss = report["rss_mib"]
    # (the RSS may fall after the start: the warm-up's and the end's readings are among those after warm-up)
    assert rss["start"] > 0 and 0 < rss["warm"] <= rss["max_after_warm"] and 0 < rss["end"] <= rss["max_after_warm"]
    assert report["throughput"]["tokens_per_s"] > 0 and report["latency_s"]["p50"] <= report["latency_s"]["p99"]
    assert report["health_polls"]["failed"] == 0 and report["provenance"]["command"][0] == "scripts/serve_soak.py"
    warm = report["warm_up"]  # (the longest prompt per policy, answered before the load)
    assert warm["requests"] == len(policies) and set(warm["statuses"]) == {200}
    assert warm["prompt_tokens"] >= report["prompt_tokens"]["max"]
    page = render_file(out)
    assert f"| requests | {requests['sent']:,} in " in page and "- `none_lost`: passes" in page
    assert "- `rss_flat`: not judged" in page and "scripts/serve_soak.py --model" in page


@pytest.mark.parametrize(
    ("malformed", "status", "message", "result"),
    [
        ("broken JSON", 400, "the body is not valid JSON", "refused"),
        ("unknown model", 404, "no such model", "refused"),
        ("unknown field", 500, "internal error", "failed"),  # (a malformed body must get a 4xx)
        (None, 429, "queue full", "overloaded"),
        (None, 400, "this request needs 3 × 10 bytes of KV cache, more than the server's cap of 20", "over_cap"),
        (None, 400, "the prompt is empty", "failed"),  # (a valid request refused)
        (None, 503, "down", "failed"),
    ],
)
def test_answers_are_classified(soak, malformed, status, message, result) -> None:
    plan = soak.Plan("/v1/completions", {"model": "m", "prompt": [5]}, malformed=malformed)
    response = httpx.Response(status, json={"error": {"message": message}})
    assert soak.refusal(plan, response, 0.0).result == result


def test_an_answer_missing_a_choice_or_its_end_fails(soak) -> None:
    plan = soak.Plan("/v1/completions", {"model": "m", "prompt": [5], "n": 2})
    usage = {"completion_tokens": 4}
    both = [{"index": 0, "finish_reason": "length"}, {"index": 1, "finish_reason": "stop"}]
    assert soak.answered(plan, {"choices": both, "usage": usage}, 0.0).result == "ok"
    assert soak.answered(plan, {"choices": both[:1], "usage": usage}, 0.0).result == "failed"
    unfinished = [both[0], {"index": 1, "finish_reason": None}]
    assert soak.answered(plan, {"choices": unfinished, "usage": usage}, 0.0).result == "failed"


@pytest.mark.parametrize("long", [0.0, 0.5])
def test_prompts_are_typical_but_for_the_long_fraction(soak, long) -> None:
    """Prompts are at most ``--typical`` tokens long but for the ``--long`` fraction, drawn up to the window less the
    completion and the chat margin."""
    args = soak.parse(["--typical", "100", "--long", str(long), "--malformed", "0", "--policies", "full"])
    mix = soak.Mix(args, "m", 4096, list(range(8192)), "x" * 40000, chat=False)
    lengths = [mix.plan().prompt_tokens for _ in range(400)]
    assert min(lengths) >= 8 and max(lengths) <= 4096 - args.max_tokens - soak.CHAT_MARGIN
    long_ones = sum(length > 100 for length in lengths)
    assert long_ones == 0 if long == 0 else 100 < long_ones < 300


def _polls(beyond: list[float], held: list[float]) -> list[dict]:
    pairs = enumerate(zip(beyond, held, strict=True))
    return [{"t": float(t), "rss_mib": b + h, "held": h * 2**20} for t, (b, h) in pairs]


def test_memory_is_flat_when_only_the_kv_held_and_brief_spikes_move_it(soak) -> None:
    """RSS that follows the KV bytes held, with a prefill's brief spike, is flat; memory beyond the KV that grows
    over the run is not."""
    held = [50.0 + 400.0 * (t % 20 < 5) for t in range(100)]
    beyond = [1300.0] * 100
    beyond[90] = 1800.0  # (a long prompt's prefill)
    flat = soak.memory(_polls(beyond, held))
    assert flat["flat"] is True and flat["growth_after_warm"] > 0.05 and flat["beyond_kv_growth"] == 0.0
    leaking = soak.memory(_polls([1300.0 + 2.0 * t for t in range(100)], held))
    assert leaking["flat"] is False and leaking["beyond_kv_growth"] > 0.05
    assert soak.memory(_polls([1300.0] * 20, held[:20]))["flat"] is None  # (20 s: too short to judge)
