"""The ``kvsieve`` command line. Every command prints a readable result, or JSON with ``--json`` (with the result's
:func:`~kvsieve.provenance.provenance` under ``"provenance"``); an error is one line on stderr, or one JSON object on
stdout with ``--json``.

``parser`` builds the arguments, ``commands`` runs them, this module prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvsieve.cli.commands import COMMANDS
from kvsieve.cli.parser import UsageError, build_parser
from kvsieve.fetch import FetchError

__all__ = ["build_parser", "main"]


def _print_human(command: str, result: dict[str, Any]) -> None:
    if command == "compare":
        from kvsieve.evaluation.compare import CompareRow, format_table

        print(f"model {result['model']}, budget {result['budget']}")
        print(format_table([CompareRow(**row) for row in result["rows"]]))
        if result["kernels_compiled"]:
            print(
                f"\nthis run compiled {result['kernels_compiled']} numba kernels (cached on disk: later runs load"
                " them); decode tok/s is timed after each policy's first step, which paid for it"
            )
    elif command == "data":
        from kvsieve.pieces import Fetched, format_table

        print(format_table([Fetched(**row) for row in result["pieces"]]))
    elif command == "policies":
        width = max(len(row["name"]) for row in result["policies"])
        for row in result["policies"]:
            flag = "needs attention" if row["needs_attention"] else "no attention needed"
            flag = "scored by probes" if row["probed"] else "reads queries" if row["needs_queries"] else flag
            params = ", ".join(f"{k}={v}" for k, v in row["params"].items()) or "-"
            memory = "" if row["saves_memory"] else "  [keeps every token: saves no memory]"
            print(f"{row['name']:<{width}} {flag:<20} params: {params}{memory}")
            print(f"{'':{width}} {row['summary']}\n{'':{width}} {row['paper']}")
    elif command == "generate":
        print(result["text"])
        print(
            f"\n[{result['policy']}: budget {result['budget_tokens']} tokens, prompt {result['prompt_tokens']}, "
            f"generated {result['generated_tokens']}, max slots {result['kv_slots_max']}, "
            f"KV {result['kv_bytes'] / 2**20:.2f} MiB]",
            file=sys.stderr,
        )
    elif command == "ask":
        for row in result["answers"]:
            print(f"Q: {row['question']}\nA: {row['answer']}\n")
        saved = f", saved to {result['saved']}" if result["saved"] else ""
        print(
            f"[{result['policy']}: context {result['context_tokens']} tokens compressed to {result['budget_tokens']}, "
            f"max slots {result['kv_slots_max']}, KV {result['kv_bytes'] / 2**20:.2f} MiB{saved}]",
            file=sys.stderr,
        )
    elif command == "needle":
        print(
            f"passkey retrieval, {result['policy']} at budget {result['budget']}, question-{result['question']} "
            "(exact match)"
        )
        for cell in result["cells"]:
            print(f"  length {cell['length']:>6}  depth {cell['depth']:>5.0%}  {cell['correct']}/{cell['trials']}")
    elif command == "bench":
        from kvsieve.benchmarks.report import format_report

        print(format_report(result))
    elif command == "sweep":
        print(result["table"])
        print(f"{result['computed']} cell(s) computed; outputs:", *result["files"].values(), sep="\n  ")
    elif command == "ruler":
        from kvsieve.ruler.report import summary

        print(summary(result["rows"]))
        print("wrote", *result["files"], sep="\n  ")
    elif command == "analyze":
        from kvsieve.analysis.report import markdown

        print(markdown(result))
        print("wrote", *result["files"].values(), sep="\n  ")
    elif command == "reproduce":
        from kvsieve.reproduce.claims import tally

        print(result["table"])
        print(
            f"{tally(result['claims'])} {result['computed']} cell(s) computed, {result['missing']} not finished "
            f"({result['seconds']:.0f} s)",
            *result["files"].values(),
            sep="\n  ",
        )
    else:
        for key, value in result.items():
            print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


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


def _provenance(argv: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The provenance of the command ``argv`` about to run, with the model, device and dtype it was given."""
    from kvsieve.provenance import provenance

    used = {key: getattr(args, key) for key in ("model", "device") if getattr(args, key, None)}
    if hasattr(args, "dtype"):
        used["dtype"] = args.dtype or "float32"
    return provenance(["kvsieve", *argv], **used)


def _run(argv: list[str], as_json: bool) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        if not as_json:
            err.parser.print_usage(sys.stderr)
        return _report(err, err.parser.prog, as_json)
    origin = _provenance(argv, args) if as_json else None  # (taken before the command runs: its date and code)
    try:
        result = COMMANDS[args.command](args)
    except Exception as err:
        if not isinstance(err, _reported_errors()):
            raise
        return _report(err, f"kvsieve {args.command}", as_json)
    if as_json:
        print(json.dumps({**result, "provenance": origin}, indent=2))
    else:
        _print_human(args.command, result)
    return 1 if result.get("missing") else 0  # (kvsieve data: a piece asked for could not be fetched)


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
