"""What decoding the next samples' answers beside a sample's longest ones saves on a RULER grid.

    python scripts/ruler_overlap.py --model qwen2.5-coder-0.5b --length 4096 --samples 4 --dtypes float32 bfloat16

The first ``--samples`` samples a ``kvsieve ruler`` run takes (sample 0 of each task in turn, seed 0, the built-in
articles), each under every setting of the default grid (every default policy at the default compressions, both
protocols, and the full cache), answered twice in one process per dtype: one sample at a time
(:func:`~kvsieve.ruler.predict.answer` per sample, as a Ray task answers its sample) and as the run answers them
(:func:`~kvsieve.ruler.predict.answers`: a sample's settings from one prompt pass, the next sample's rows joining the
batch as soon as their caches fit beside those still decoding). The two orders alternate between dtypes (the first
dtype answers one at a time first). Each arm's forward passes are recorded: the prompt passes, the question parts and
the decode steps by rows. Prints a table and writes JSON with its :func:`~kvsieve.provenance.provenance` (``--out``;
:mod:`kvsieve.results` renders it in the performance notes, ``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from ruler_cost import forward_passes  # (the sibling script: a script's directory is on its path)

ARMS = ("one_at_a_time", "together")


def units(tokenizer, length: int, count: int) -> list:
    """The first ``count`` units (sample, prompt, settings) a default ``kvsieve ruler`` run takes at ``length``."""
    from kvsieve.ruler import run
    from kvsieve.ruler.tasks import TASKS, Prompter, generate_samples

    prompter, sources = Prompter(tokenizer), run.sources()
    settings = run.grid_settings(run.default_policies(), run.DEFAULT_COMPRESSIONS, ["agnostic", "aware"])
    order = [(task, i) for i in range(-(-count // len(TASKS))) for task in TASKS][:count]
    needed = {task: i + 1 for task, i in order}  # (samples are made a task at a time, as a run makes them)
    made = {task: generate_samples(task, length, n, prompter, sources, seed=0) for task, n in needed.items()}
    return [
        (s, prompter.ids(s.context, s.question, s.answer_prefix), settings)
        for s in (made[task][i] for task, i in order)
    ]


def arm(model, tokenizer, work: list, together: bool, kv_memory: int) -> tuple[dict, dict]:
    """One arm: its figures, and each answer's text by (unit, setting key)."""
    from kvsieve.ruler import predict

    start = time.perf_counter()
    with forward_passes(model) as passes:
        if together:
            done = list(predict.answers(model, tokenizer, work, kv_memory))
        else:
            done = [
                (i, s, cell)
                for i, unit in enumerate(work)
                for s, cell in predict.answer(model, tokenizer, *unit, kv_memory)
            ]
    seconds = time.perf_counter() - start
    steps = [(rows, s) for rows, tokens, s in passes if tokens == 1]
    figures = {
        "seconds": round(seconds, 1),
        "prompt_passes": sum(1 for rows, tokens, _ in passes if rows == 1 and tokens > 1),
        "prompt_s": round(sum(s for rows, tokens, s in passes if rows == 1 and tokens > 1), 1),
        "question_s": round(sum(s for rows, tokens, s in passes if rows > 1 and tokens > 1), 1),
        "decode_steps": len(steps),
        "decode_s": round(sum(s for _, s in steps), 1),
        "few_row_steps": sum(1 for rows, _ in steps if rows <= 8),
        "few_row_s": round(sum(s for rows, s in steps if rows <= 8), 1),
        "rows_per_step": round(sum(rows for rows, _ in steps) / max(1, len(steps)), 1),
        "correct": sum(cell["score"] == 1.0 for *_, cell in done),
    }
    return figures, {(i, s.key): cell["text"] for i, s, cell in done}


def measure(model_name: str, length: int, dtype: str, count: int, first: str, kv_memory_gb: float | None) -> dict:
    import kvsieve
    from kvsieve.engine.memory import available_memory
    from kvsieve.ruler import predict

    model, tokenizer = kvsieve.load_model(model_name, dtype=dtype)
    work = units(tokenizer, length, count)
    _, (head, tail), settings = work[0]
    predict.predict_together(model, tokenizer, head[:256], tail, settings, 2)  # (warm-up)
    kv_memory = int(kv_memory_gb * 2**30) if kv_memory_gb else available_memory(model.device) // 2
    result = {"length": length, "dtype": dtype, "samples": [f"{s.task} #{s.index}" for s, *_ in work]}
    result |= {"settings": len(settings), "kv_memory_gib": round(kv_memory / 2**30, 1), "order": []}
    texts = {}
    for name in sorted(ARMS, key=lambda a: a != first):
        result[name], texts[name] = arm(model, tokenizer, work, name == "together", kv_memory)
        result["order"].append(name)
    a, b = (texts[name] for name in ARMS)
    result["answers"] = len(a)
    result["same_text"] = sum(a[k] == b[k] for k in a)
    result["speedup"] = round(result["one_at_a_time"]["seconds"] / result["together"]["seconds"], 2)
    result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-memory-gb", type=float, help="the caches' bound (default: half the memory free)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        dtype, first = args.child.split(",")
        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.model, args.length, dtype, args.samples, first, args.kv_memory_gb)))
        return
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    from kvsieve.provenance import provenance

    origin = provenance(["scripts/ruler_overlap.py", *sys.argv[1:]], model=args.model, threads=args.threads)
    results = []
    for n, dtype in enumerate(args.dtypes):
        cmd = [sys.executable, __file__, "--child", f"{dtype},{ARMS[n % 2]}", "--threads", str(args.threads)]
        cmd += ["--model", args.model, "--length", str(args.length), "--samples", str(args.samples)]
        cmd += ["--kv-memory-gb", str(args.kv_memory_gb)] if args.kv_memory_gb else []
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"{dtype}: {', '.join(result['samples'])}; {result['settings']} settings each")
        for name in result["order"]:
            print(f"  {name}: " + "  ".join(f"{k}={v}" for k, v in result[name].items()))
        print(f"  together {result['speedup']}x faster; {result['same_text']} of {result['answers']} texts the same")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": results, "provenance": origin}, indent=1))


if __name__ == "__main__":
    main()
