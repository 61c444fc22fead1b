"""Decode steps through the eager model vs through ``torch.compile(model.forward, fullgraph=True)``, in one run.

    python scripts/compiled_decode.py --prompt 2048 --budget 512 --steps 48 --rounds 3

For each cache (default: h2o and streaming_llm at the budget, and transformers' ``DynamicCache`` holding every token)
the prompt is prefilled eagerly, then ``--steps`` greedy decode steps are timed through the eager forward and through
the compiled one, in rounds that alternate which goes first (a noisy machine drifts within seconds). The compiled
forward is traced afresh for each cache and warmed up before it is timed: its traces (and their seconds) are reported
apart. Prints the median step of each, their ratio, and whether the greedy tokens are the same (``--out FILE``:
JSON with the provenance, which ``python -m kvsieve.results`` renders in docs/guarantees.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from kvsieve.benchmarks.runner import new_cache, next_token, prompt_tokens
from kvsieve.models import load_model
from kvsieve.provenance import provenance

WARM_UP = 4
"""Decode steps before the timed ones (the first ones evict the prompt down to the budget, or trigger the traces)."""


def decode(model, policy: str, budget: int, ids: torch.Tensor, forward, steps: int) -> tuple[list[float], list[int]]:
    """The prompt ``ids`` prefilled eagerly into a fresh cache, ``WARM_UP`` steps, then ``steps`` timed greedy
    decode steps through ``forward``: seconds per step and the tokens of the first row."""
    cache = new_cache(model, policy, budget)
    seconds, tokens = [], []
    with torch.inference_mode():
        token = next_token(model, cache, ids)
        for i in range(WARM_UP + steps):
            start = time.perf_counter()
            token = next_token(forward, cache, token)
            if i >= WARM_UP:
                seconds.append(time.perf_counter() - start)
                tokens.append(int(token[0, 0]))
    return seconds, tokens


def measure(model, policy: str, budget: int, ids: torch.Tensor, steps: int, rounds: int) -> dict:
    """Eager vs compiled decode steps of ``policy`` (rounds alternating which goes first)."""
    torch._dynamo.reset()
    traces = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model.forward, fullgraph=True, backend=traces)
    start = time.perf_counter()
    decode(model, policy, budget, ids, compiled, 2)  # (the traces: the second makes the step's counters symbolic)
    compile_s = time.perf_counter() - start
    runs: dict[str, list[float]] = {"eager": [], "compiled": []}
    tokens: dict[str, list[int]] = {}
    for r in range(rounds):
        for mode in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            seconds, tokens[mode] = decode(
                model, policy, budget, ids, compiled if mode == "compiled" else model.forward, steps
            )
            runs[mode].append(statistics.median(seconds))
    eager, fast = statistics.median(runs["eager"]), statistics.median(runs["compiled"])
    differ = [i for i, (a, b) in enumerate(zip(tokens["eager"], tokens["compiled"], strict=True)) if a != b]
    return {
        "policy": policy,
        "eager_step_ms": eager * 1e3,
        "compiled_step_ms": fast * 1e3,
        "speedup": eager / fast,
        "traces": traces.frame_count,
        "warm_up_with_traces_s": compile_s,
        "same_tokens": not differ,
        "first_difference": differ[0] if differ else None,
        "rounds_ms": {mode: [s * 1e3 for s in values] for mode, values in runs.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", nargs="+", default=["h2o", "streaming_llm", "dynamic_full"])
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens (real text)")
    parser.add_argument("--budget", type=int, default=512, help="tokens each kvsieve cache holds")
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternating which goes first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help="also write the results as JSON, with their provenance")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    ids = prompt_tokens(tokenizer, args.prompt)[None].to(model.device)
    print(f"{'cache':<16}{'eager ms':>10}{'compiled ms':>13}{'speed-up':>10}{'traces':>8}{'trace s':>9}  tokens")
    results = []
    for policy in args.policies:
        r = measure(model, policy, args.budget, ids, args.steps, args.rounds)
        results.append(r)
        same = "same" if r["same_tokens"] else f"differ from step {r['first_difference']}"
        print(
            f"{r['policy']:<16}{r['eager_step_ms']:>10.1f}{r['compiled_step_ms']:>13.1f}{r['speedup']:>9.2f}x"
            f"{r['traces']:>8}{r['warm_up_with_traces_s']:>9.0f}  {same}",
            flush=True,
        )
    print(f"({args.model}, prompt {args.prompt}, budget {args.budget}, {args.steps} steps x {args.rounds} rounds)")
    if args.out:
        report = {
            "provenance": provenance(["scripts/compiled_decode.py", *argv], model=args.model, device=str(model.device)),
            "settings": vars(args),
            "results": results,
        }
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
