"""Where the time and memory of a RULER answer go on this machine: prefill, compression, answer; fp32 vs bf16.

    python scripts/ruler_cost.py --model qwen2.5-coder-0.5b --lengths 4096 --dtypes float32 bfloat16
    python scripts/ruler_cost.py --model qwen2.5-coder-0.5b --lengths 16384 32768 --policies full h2o
    python scripts/ruler_cost.py --model qwen2.5-coder-0.5b --lengths 4096 --grid --out cost.json

Each (length, dtype) runs in a fresh process (so that its peak resident memory is its own): one ``niah_single_2``
sample of the length (seed 0, the built-in articles) answered greedily under each policy at ``--compression``, the
question-agnostic protocol (``kvsieve.ruler.predict.predict``): ``first_token_s`` is the context's forward pass with the
policy's observation and eviction (the full cache: none) plus the question part's, ``answer_s`` the decoding of the
``tokens`` after the first; each policy answers a short prompt first, so that no compilation or warm-up is timed.
``--grid`` then answers the sample under every setting of the default grid (every default policy at the default
compressions, both protocols, and the full cache) together, as ``kvsieve ruler`` does
(:func:`~kvsieve.ruler.predict.answer`): the shared prompt pass, the question parts of the agnostic settings (one
batch), the answers (one batch), against the policies timed alone above (their mean time per setting × the grid's
settings), with each of its forward passes recorded: the prompt passes, and the answers' decode steps by the rows
still decoding, each set of steps beside as many steps of the model with transformers' own cache at as many rows
(a short cache, no eviction). ``peak_rss_gib`` is the process's peak resident memory (model included). Prints a
table and writes JSON with its :func:`~kvsieve.provenance.provenance` (``--out``; :mod:`kvsieve.results` renders it
in the performance notes, ``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

TASK = "niah_single_2"
"""The task whose first sample (seed 0) is timed."""


def measure(
    model_name: str, length: int, dtype: str, policies: list[str], compression: float, grid: bool = False
) -> dict:
    import kvsieve
    from kvsieve.ruler import predict, run
    from kvsieve.ruler.tasks import Prompter, generate_samples

    model, tokenizer = kvsieve.load_model(model_name, dtype=dtype)
    prompter = Prompter(tokenizer)
    (sample,) = generate_samples(TASK, length, 1, prompter, run.sources(with_reading=False), seed=0)
    head, tail = prompter.ids(sample.context, sample.question, sample.answer_prefix)
    rows = []
    for policy in policies:
        setting = predict.FULL if policy == "full" else predict.Setting("agnostic", policy, compression)
        predict.predict(model, tokenizer, head[:256], tail, setting, 2)  # (warm-up: compiled kernels are not timed)
        text, tokens, first_s, total_s = predict.predict(model, tokenizer, head, tail, setting, 32)
        rows.append(
            {
                "policy": policy,
                "first_token_s": round(first_s, 2),
                "answer_s": round(total_s - first_s, 2),
                "tokens": tokens,
                "correct": sample.answers[0] in text,
                "answer": text,
            }
        )
    result = {"length": len(head) + len(tail), "dtype": dtype, "rows": rows}
    if grid:
        result["grid"] = measure_grid(model, tokenizer, sample, (head, tail), rows, compression)
    result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # (KiB on Linux)
    return result


def measure_grid(model, tokenizer, sample, prompt, alone: list[dict], compression: float) -> dict:
    """The whole default grid of one sample answered together (``kvsieve.ruler.predict.answer``), by phase, against the
    settings timed alone above (their mean time × the grid's settings; how many of their answers are the same)."""
    from kvsieve.ruler import predict, run

    head, tail = prompt
    settings = run.grid_settings(run.default_policies(), run.DEFAULT_COMPRESSIONS, ["agnostic", "aware"])
    predict.predict_together(model, tokenizer, head[:256], tail, settings, 2)  # (warm-up)
    with forward_passes(model) as passes:
        answers = dict(predict.answer(model, tokenizer, sample, prompt, settings))
    steps, spent = Counter(), Counter()  # (rows → decode steps, their seconds)
    for rows, tokens, seconds in passes:
        if tokens == 1:
            steps[rows] += 1
            spent[rows] += seconds
    plain = {rows: plain_step(model, rows) for rows in steps}
    first = {s.protocol: a["first_token_s"] for s, a in answers.items() if s.policy != "full"}
    total = max(a["total_s"] for a in answers.values())
    per_setting = sum(r["first_token_s"] + r["answer_s"] for r in alone) / len(alone)
    timed = {
        s.policy: a["text"]
        for s, a in answers.items()
        if s == predict.FULL or (s.key.startswith("agnostic") and s.compression == compression)
    }
    same = [r["answer"] == timed[r["policy"]] for r in alone if r["policy"] in timed]  # (agnostic ones, as above)
    return {
        "settings": len(settings),
        "prefill_s": round(first["aware"], 1),
        "question_s": round(first["agnostic"] - first["aware"], 1),
        "answers_s": round(total - max(a["first_token_s"] for a in answers.values()), 1),
        "total_s": round(total, 1),
        "alone_s": round(per_setting * len(settings), 1),
        "speedup": round(per_setting * len(settings) / total, 1),
        "correct": sum(a["score"] == 1.0 for a in answers.values()),
        "same_as_alone": f"{sum(same)} of {len(same)}",
        "prompt_passes": sum(1 for rows, tokens, _ in passes if rows == 1 and tokens > 1),
        "decode_steps": [
            {"rows": rows, "steps": n, "seconds": round(spent[rows], 2), "plain_s": round(n * plain[rows], 2)}
            for rows, n in sorted(steps.items())
        ],
    }


@contextmanager
def forward_passes(model) -> Iterator[list[tuple[int, int, float]]]:
    """Records each forward pass of ``model`` while open: its rows, its tokens per row, its seconds."""
    passes, started = [], []
    pre = model.register_forward_pre_hook(lambda _m, _a, _k: started.append(time.perf_counter()), with_kwargs=True)

    def done(_m, _a, kwargs, _out) -> None:
        rows, tokens = kwargs["input_ids"].shape
        passes.append((rows, tokens, time.perf_counter() - started.pop()))

    post = model.register_forward_hook(done, with_kwargs=True)
    try:
        yield passes
    finally:
        pre.remove()
        post.remove()


def plain_step(model, rows: int, rounds: int = 3) -> float:
    """Seconds of one decode step of ``rows`` rows with transformers' own cache over a 64-token prompt (no eviction,
    a short cache: the step's cost beside its attention), the fastest of ``rounds``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.ones((rows, 64), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return fastest(lambda: model(input_ids=ids[:, :1], cache=cache, use_cache=True), rounds)


def fastest(call: Callable[[], object], rounds: int) -> float:
    """Seconds of the fastest of ``rounds`` calls of ``call``."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--policies", nargs="+", default=["full", "h2o", "snapkv", "streaming_llm", "tova"])
    parser.add_argument("--compression", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--grid", action="store_true", help="also answer the default grid's settings together")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        length, dtype = args.child.split(",")
        torch.set_num_threads(args.threads)
        result = measure(args.model, int(length), dtype, args.policies, args.compression, args.grid)
        print(json.dumps(result))
        return
    from kvsieve.provenance import provenance

    origin = provenance(["scripts/ruler_cost.py", *sys.argv[1:]], model=args.model, threads=args.threads)
    results = []
    for length in args.lengths:
        for dtype in args.dtypes:
            cmd = [sys.executable, __file__, "--child", f"{length},{dtype}", "--threads", str(args.threads)]
            cmd += ["--model", args.model, "--policies", *args.policies, "--compression", str(args.compression)]
            cmd += ["--grid"] if args.grid else []
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(result)
            print(f"{result['length']} tokens, {dtype}: peak RSS {result['peak_rss_gib']} GiB")
            for row in [*result["rows"], *([result["grid"]] if "grid" in result else [])]:
                print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": results, "provenance": origin}, indent=1))


if __name__ == "__main__":
    main()
