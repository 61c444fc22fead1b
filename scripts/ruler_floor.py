"""The least time a `kvsieve ruler` grid can take on this CPU: its weight matmuls at this host's best matmul speed.

    python scripts/ruler_floor.py docs/results/ruler/qwen2.5-coder-0.5b_4096_cpu --dtypes float32 bfloat16 --out f.json

Counts, from a run's directory (its samples and cells), the tokens each forward pass of the grid's way of answering
(:func:`~kvsieve.ruler.predict.predict_together`) feeds the model: one prompt pass per sample (the fewest: a grid whose
caches do not fit together pays one per group), the question part once per question-agnostic setting, and one decode
step per answer token after the first, for every setting. Each token costs two FLOPs per weight of the model's linear
layers (the output layer's only where a token's logits are computed: the last token of a pass, every decode step); the
prompt pass's causal attention is counted exactly, the attention of the question parts and answers (over caches of 10 to
100 % of the prompt) not at all. Those FLOPs divided by the rate ``torch.nn.functional.linear`` reaches on one core of
this host (each layer's fastest of ten rounds, at the model's own shapes: a prompt's rows for the prompt and question
passes, a decode batch's for the answers) is a floor that no way of answering the grid with these FLOPs beats, whatever
its bookkeeping. ``--timed`` sets beside the floor of the grid's samples of one task the phases of a sample of that task
timed by ``scripts/ruler_cost.py --grid`` (its CPU seconds: seconds × threads). The result also counts the grid's decode
steps by their rows (one step per sample and answer token after the first; its rows are the settings whose answer goes
on). Prints the floor per dtype; ``--out`` writes JSON with its :func:`~kvsieve.provenance.provenance`
(:mod:`kvsieve.results` renders it in the performance notes, ``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from ruler_cost import TASK, fastest  # (the sibling script: a script's directory is on its path)
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from kvsieve.ruler.predict import Setting
from kvsieve.ruler.tasks import Prompter, load_samples

ROUNDS = 10
"""Timed rounds per layer shape; the fastest counts."""


def weights(config: PretrainedConfig) -> tuple[int, int]:
    """The weights of the model's linear layers but its output layer, and those of its output layer (the model
    built on the meta device: nothing is loaded)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body, head.weight.numel()


def model_of(run: Path) -> str:
    """The model a run's cells were answered by (checked: one)."""
    models = {json.loads(cell.read_text())["settings"]["model"] for cell in (run / "cells").glob("*.json")}
    if len(models) != 1:
        raise ValueError(f"{run}: expected the cells of one model, found {sorted(models) or 'no cells'}")
    return models.pop()


def counts(run: Path, prompter: Prompter) -> list[dict]:
    """The grid's forward passes from a run directory, per sample: the prompt's tokens, the question parts' (and
    their rows: one per question-agnostic setting), the decode tokens (every setting's answer tokens after the
    first) and the rows of each decode step (the settings whose answer goes on)."""
    answered: dict[tuple[str, int, int], dict[Setting, int]] = defaultdict(dict)  # (task, length, index) → n
    for cell in sorted((run / "cells").glob("*.json")):
        data = json.loads(cell.read_text())
        s = data["settings"]
        key = Setting(s["protocol"], s["policy"], s["compression"])
        for index, prediction in data["predictions"].items():
            answered[(s["task"], s["length"], int(index))][key] = prediction["answer_tokens"]
    prompts = {}
    for path in sorted((run / "samples").glob("*.jsonl")):
        for sample in load_samples(path):
            if (key := (sample.task, sample.length, sample.index)) in answered:
                head, tail = prompter.ids(sample.context, sample.question, sample.answer_prefix)
                prompts[key] = (len(head), len(tail))
    samples = []
    for key, settings in sorted(answered.items()):
        head, tail = prompts[key]
        agnostic = sum(setting.compresses_context for setting in settings)
        steps = [sum(n - 1 >= step for n in settings.values()) for step in range(1, max(settings.values()))]
        samples.append(
            {
                "sample": list(key),
                "settings": len(settings),
                "prompt": head + tail,
                "question": tail * agnostic,
                "question_rows": agnostic,
                "decode": sum(steps),  # (each step decodes one token of each of its rows)
                "steps": steps,
            }
        )
    return samples


def flops(sample: dict, body: int, head: int, config: PretrainedConfig) -> dict[str, float]:
    """One sample's FLOPs by phase (see the module docstring)."""
    n, queries = sample["prompt"], layer_shapes(config)[0][1]  # (the query heads' width)
    return {
        "prompt": 2 * body * n + 2 * head + 4 * config.num_hidden_layers * queries * n * (n + 1) / 2,  # (QKᵀ, PV)
        "question": 2 * body * sample["question"] + 2 * head * sample["question_rows"],
        "answers": (2 * body + 2 * head) * sample["decode"],
    }


def rate(rows: int, shapes: list[tuple[int, int]], dtype: torch.dtype) -> float:
    """FLOP/s of ``torch.nn.functional.linear`` on ``rows`` rows through the layers of ``shapes`` (in, out), each
    layer at the fastest of :data:`ROUNDS` rounds."""
    xs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for k, _ in shapes}}
    ws = [torch.randn(n, k, dtype=dtype) / k**0.5 for k, n in shapes]
    work = sum(2 * rows * k * n for k, n in shapes)
    seconds = 0.0
    with torch.inference_mode():
        for w in ws:
            torch.nn.functional.linear(xs[w.shape[1]], w)  # (warm-up)
            seconds += fastest(lambda w=w: torch.nn.functional.linear(xs[w.shape[1]], w), ROUNDS)
    return work / seconds


def layer_shapes(config: PretrainedConfig) -> list[tuple[int, int]]:
    """The (in, out) shapes of one decoder layer's linear layers (a Llama-style layer: q, k, v, o, gate, up, down)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]


def tally(samples: list[dict], body: int, head: int, config: PretrainedConfig, rates: dict) -> dict:
    """Per task and for the whole grid (``grid``): the samples, their tokens by pass, and each phase's TFLOP and
    seconds at each dtype's ``rates`` (dtype → phase → FLOP/s)."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in samples:
        for key in (s["sample"][0], "grid"):
            sums[key]["samples"] += 1
            for tokens in ("prompt", "question", "decode"):
                sums[key][f"{tokens}_tokens"] += s[tokens]
            for phase, work in flops(s, body, head, config).items():
                sums[key][f"{phase}_tflop"] += work / 1e12
                for dtype, r in rates.items():
                    sums[key][f"{phase}_{dtype}_s"] += work / r[phase]
    return {key: {k: rounded(v) for k, v in by.items()} for key, by in sums.items()}


def rounded(value: float) -> float:
    """Three decimals, or three significant digits where three decimals would show a nonzero value as 0 (a tiny
    model's seconds on a fast host)."""
    return round(value, 3) if abs(value) >= 5e-4 else float(f"{value:.3g}")


def timings(path: Path) -> dict:
    """The CPU seconds by phase of the sample a ``scripts/ruler_cost.py --grid`` result timed, per dtype: the shared
    prompt pass, the question parts, the answers, and the full cache's prompt pass alone."""
    cost = json.loads(path.read_text())
    threads = cost["provenance"]["threads"]
    by_dtype = {}
    for r in cost["results"]:
        if "grid" not in r:
            raise ValueError(f"{path}: a ruler_cost.py result without --grid has no phases to set beside the floor")
        full = next(row for row in r["rows"] if row["policy"] == "full")
        g = r["grid"]
        by_dtype[r["dtype"]] = {
            "prompt": g["prefill_s"] * threads,
            "question": g["question_s"] * threads,
            "answers": g["answers_s"] * threads,
            "alone": full["first_token_s"] * threads,
        }
    return {"result": str(path), "task": TASK, "threads": threads, "tokens": cost["results"][0]["length"],
            "cpu_s": by_dtype}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a kvsieve ruler output directory")
    parser.add_argument("--model", help="its model, a built-in name or a directory (default: the cells' model)")
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--timed", type=Path, help="a scripts/ruler_cost.py --grid result to set beside the floor")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    timed = None if args.timed is None else timings(args.timed)
    from kvsieve.models import ensure_model, list_builtin_models, load_tokenizer

    torch.set_num_threads(1)
    model = model_of(args.run)
    source = args.model or model
    source = str(ensure_model(source)) if source in list_builtin_models() else source
    samples = counts(args.run, Prompter(load_tokenizer(source)))
    config = AutoConfig.from_pretrained(source)
    body, head = weights(config)
    rows = {"prompt": round(sum(s["prompt"] for s in samples) / len(samples)), "answers": samples[0]["settings"]}
    shapes = layer_shapes(config)
    rates = {}
    for dtype in args.dtypes:
        prefill = rate(rows["prompt"], shapes, getattr(torch, dtype))
        decoding = rate(rows["answers"], [*shapes, (config.hidden_size, config.vocab_size)], getattr(torch, dtype))
        rates[dtype] = {"prompt": prefill, "question": prefill, "answers": decoding}
    phases = tally(samples, body, head, config, rates)
    for dtype, r in rates.items():
        hours = sum(phases["grid"][f"{p}_{dtype}_s"] for p in ("prompt", "question", "answers")) / 3600
        print(
            f"{dtype}: {r['prompt'] / 1e9:.1f} GFLOP/s on {rows['prompt']} rows, {r['answers'] / 1e9:.1f} on "
            f"{rows['answers']}: the grid's {len(samples)} samples take at least {hours:.2f} CPU-hours"
        )
    if args.out:
        from kvsieve.provenance import provenance

        command = ["scripts/ruler_floor.py", *(sys.argv[1:] if argv is None else argv)]
        result = {
            "run": str(args.run),
            "model": model,
            "settings": rows["answers"],
            "linear_weights": body,
            "output_weights": head,
            "gflops": {d: {p: round(r[p] / 1e9, 1) for p in ("prompt", "answers")} for d, r in rates.items()},
            "rows": rows,
            "phases": phases,
            "steps_by_rows": dict(sorted(Counter(n for s in samples for n in s["steps"]).items())),
            **({"timed": timed} if timed else {}),
            "provenance": provenance(command, model=model, threads=1),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
