"""kvsieve side by side with NVIDIA kvpress: speed, KV bytes and the tokens each keeps, on the same model and text.

    python scripts/kvpress_side_by_side.py --build-venv          # once: kvpress 0.5.5 in its own .venv-kvpress
    python scripts/kvpress_side_by_side.py --quick              # 512-token prompt, 32 decode steps, 2 rounds
    python scripts/kvpress_side_by_side.py                      # 2,048-token prompt, 256 decode steps, 3 rounds

kvpress is never a dependency of kvsieve: it needs transformers < 5.3, so it lives in its own virtualenv
(``--build-venv`` makes it: torch==2.13.0 CPU first, then kvpress==0.5.5 with torch and transformers < 5.3 held by a
constraint). Each side runs in its own process (``scripts/kvpress_worker.py``, with kvsieve's python or kvpress's),
kept alive for the whole run, loading the same safetensors weights (the built-in SmolLM2-135M-Instruct copy) in fp32
on the same number of threads, and gets the same token ids (one built-in Wikipedia article). The runs alternate: a
method's kvsieve run and its kvpress run back to back, the side going first alternating from one method to the next,
the methods in reverse order in odd rounds; within a pair, the two sides' decode steps alternate one by one (as
``kvsieve bench`` runs its policies in lockstep), so a slow spell of this shared machine falls on both alike.
Figures are medians over rounds, ratios medians of the per-round ratios (kvsieve / kvpress) of those pairs.

Each method keeps 20 %: kvpress's ``compression_ratio=0.8`` keeps ``int(L·(1−0.8))`` tokens, and kvsieve gets that
many as its budget (its ratio budget 0.2 would round: one token more at 2,048). Per method: prefill time, median
decode step, K/V bytes after ``steps`` decode steps (kvpress compresses the prompt only, so its cache grows by a token
per step; kvsieve's stays at the budget), and the agreement of the kept sets after the prefill: the Jaccard index of
the positions each keeps, per layer and KV head (kvsieve's ``cache.positions(layer)``; kvpress's kept keys matched to
the prompt's keys). ``dynamic`` is transformers' ``DynamicCache`` on each side (the transformers versions differ).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "kvpress_worker.py"
DEFAULT_VENV = ROOT / ".venv-kvpress"
KVPRESS_REQUIREMENT = "kvpress==0.5.5"
TORCH_REQUIREMENT = "torch==2.13.0"
CONSTRAINTS = (TORCH_REQUIREMENT, "transformers<5.3")
COMPRESSION_RATIO = 0.8
"""kvpress's setting for keeping 20 % (the share it removes)."""
MIN_CONTEXT = 512
"""Shortest prompt: SnapKV's window of 64 must fit kvpress's prompt and kvsieve's budget (20 % of it)."""
WARMUP = 512
"""Prompt tokens of each method's untimed warm-up run."""

DYNAMIC = "dynamic"
METHODS: dict[str, str] = {
    DYNAMIC: DYNAMIC,
    "streaming_llm": "streaming_llm",
    "snapkv": "snapkv",
    "snapkv:window=64,kernel=5": "snapkv",
    "knorm": "knorm",
    "knorm:recent=0": "knorm",
    "tova": "tova",
}
"""kvsieve's method (a policy spec: the default, or the parameters that reproduce kvpress's setting) → kvpress's."""
PRESS_NAMES = {
    DYNAMIC: "DynamicCache",
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
}
SIDES = ("kvsieve", "kvpress")


@dataclass(frozen=True)
class Settings:
    context: int
    steps: int
    rounds: int
    threads: int
    methods: tuple[str, ...]
    model: Path
    venv: Path
    build_venv: bool
    out: Path

    @property
    def budget(self) -> int:
        """Tokens kept after the prefill."""
        return kept_tokens(self.context)

    @property
    def presses(self) -> list[str]:
        """The kvpress methods to run (each once, whatever kvsieve settings are compared with it)."""
        return list(dict.fromkeys(METHODS[m] for m in self.methods))


def kept_tokens(prompt: int) -> int:
    """Tokens kvpress keeps of a ``prompt``-token prefill at ``COMPRESSION_RATIO`` (its ``compute_n_kept``)."""
    return max(1, int(prompt * (1 - COMPRESSION_RATIO)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run: 512-token prompt, 32 steps, 2 rounds")
    parser.add_argument("--context", type=int, help="prompt tokens (default 2048; 512 with --quick)")
    parser.add_argument("--steps", type=int, help="decode steps after the prefill (default 256; 32 with --quick)")
    parser.add_argument("--rounds", type=int, help="rounds, each running both sides once (default 3; 2 with --quick)")
    add_shared_args(parser, METHODS, "kvpress")
    return parser.parse_args(argv)


def add_shared_args(parser: argparse.ArgumentParser, methods: Sequence[str], out: str) -> None:
    """The arguments every side-by-side script takes: threads, its ``methods``, the model, kvpress's virtualenv and
    the output directory (``out/<out>``)."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side (default 1)")
    parser.add_argument(
        "--methods", nargs="+", choices=list(methods), default=list(methods), help="the rows to run (default all)"
    )
    parser.add_argument("--model", type=Path, help="model directory (default: the built-in smollm2-135m copy)")
    parser.add_argument("--kvpress-venv", type=Path, default=DEFAULT_VENV, help="kvpress's virtualenv")
    parser.add_argument("--build-venv", action="store_true", help="create the kvpress virtualenv if it is missing")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / out, help="where the JSON and table go")


def check_args(args: argparse.Namespace) -> Settings:
    """The run's settings, or a ``ValueError`` saying what is wrong (before anything runs)."""
    quick = args.quick
    context = args.context if args.context is not None else 512 if quick else 2048
    steps = args.steps if args.steps is not None else 32 if quick else 256
    rounds = args.rounds if args.rounds is not None else 2 if quick else 3
    if context < MIN_CONTEXT:
        raise ValueError(f"--context must be at least {MIN_CONTEXT} (SnapKV's 64-token window), got {context}")
    for name, value in (("--steps", steps), ("--rounds", rounds), ("--threads", args.threads)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    model = checked_model_and_venv(args)
    limit = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    if limit is not None and context + steps > limit:
        raise ValueError(f"--context + --steps ({context + steps}) exceed the model's {limit} positions")
    methods = tuple(dict.fromkeys(args.methods))
    return Settings(context, steps, rounds, args.threads, methods, model, args.kvpress_venv, args.build_venv, args.out)


def checked_model_and_venv(args: argparse.Namespace) -> Path:
    """The model directory of :func:`add_shared_args`' arguments, once it and kvpress's virtualenv (unless it is to
    be built) are checked; a ``ValueError`` otherwise."""
    model = args.model if args.model is not None else default_model_dir()
    if not (model / "config.json").is_file():
        raise ValueError(f"no model at {model} (a directory with config.json and safetensors weights)")
    if not args.build_venv and not venv_ready(args.kvpress_venv):
        raise ValueError(
            f"no kvpress virtualenv at {args.kvpress_venv}; pass --build-venv to create it ({KVPRESS_REQUIREMENT})"
        )
    return model


def default_model_dir() -> Path:
    """The built-in model's converted safetensors copy (fetched and converted once by kvsieve)."""
    from kvsieve.models import ensure_model

    return Path(ensure_model("smollm2-135m"))


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_ready(venv: Path) -> bool:
    """Whether ``venv`` was built completely (its stamp is written last)."""
    return (venv / ".installed").is_file() and venv_python(venv).is_file()


def build_venv(venv: Path) -> None:
    """kvpress in its own virtualenv: torch first (the CPU build kvsieve uses), then kvpress with torch and
    transformers held by a constraint (an unpinned torch would pull a CUDA build)."""
    print(f"building {venv} ({KVPRESS_REQUIREMENT}, {TORCH_REQUIREMENT})", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(CONSTRAINTS) + "\n")
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH_REQUIREMENT], check=True)
    subprocess.run([*pip, KVPRESS_REQUIREMENT, "-c", str(constraints)], check=True)
    (venv / ".installed").touch()


def prompt_ids(model: Path, context: int) -> list[int]:
    """``context`` token ids of one built-in Wikipedia article (kvsieve bench's prompt text)."""
    from transformers import AutoTokenizer

    from kvsieve.benchmarks.runner import prompt_tokens

    return prompt_tokens(AutoTokenizer.from_pretrained(model), context).tolist()


class WorkerProcess:
    """One side's worker process (``scripts/kvpress_worker.py``), kept alive for the whole run: set up (model
    loaded, methods warmed up) by ``setup``, then asked for one run at a time."""

    def __init__(self, python: Path, setup: dict[str, Any], threads: int, log: Path) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.side, self.log = setup["side"], log
        with log.open("w") as stderr:
            self.process = subprocess.Popen(
                [str(python), str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                cwd=ROOT,
            )
        self.hello = self.ask(setup)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request line; its reply."""
        self.send(request)
        return self.receive()

    def send(self, request: dict[str, Any]) -> None:
        """Send one request line (its reply: :meth:`receive`; the other side's worker may run meanwhile)."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any]:
        """The reply to the request sent last."""
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side} worker failed:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        """End the process (end of its input), killed if it does not end within a minute."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def setup_request(settings: Settings, ids: list[int], side: str) -> dict[str, Any]:
    """The first line a side's worker gets."""
    return {
        "side": side,
        "model": str(settings.model),
        "ids": ids,
        "threads": settings.threads,
        "methods": list(settings.methods) if side == "kvsieve" else settings.presses,
        "budget": settings.budget,
        "compression_ratio": COMPRESSION_RATIO,
        "warmup": min(WARMUP, settings.context),
    }


def schedule(methods: Sequence[str], rounds: int) -> list[tuple[int, str, tuple[str, str]]]:
    """The pairs of runs in order, ``(round, kvsieve method, sides in order)``: the side going first alternates from
    one method to the next, the methods in reverse order in odd rounds."""
    plan = []
    for r in range(rounds):
        for i, method in enumerate(methods if r % 2 == 0 else methods[::-1]):
            plan.append((r, method, SIDES if (r + i) % 2 == 0 else SIDES[::-1]))
    return plan


def run_pair(
    workers: dict[str, WorkerProcess], method: str, order: tuple[str, str], steps: int, kept: bool, tick: Any
) -> dict[str, dict[str, Any]]:
    """One method on both sides in lockstep: the two prefills back to back, then one decode step of each in turn
    (the first alternating), so that a slow spell of the machine falls on both alike; each side's run."""
    names = {"kvsieve": method, "kvpress": METHODS[method]}
    for side in order:
        workers[side].ask({"do": "start", "method": names[side], "kept": kept})
    tick()
    for i in range(steps):
        for side in order if i % 2 == 0 else order[::-1]:
            workers[side].ask({"do": "step"})
        tick()
    return {side: workers[side].ask({"do": "finish"}) for side in order}


def jaccard(a: Sequence[int], b: Sequence[int]) -> float:
    """|a ∩ b| / |a ∪ b| of two position sets (1 for two empty sets)."""
    sa, sb = set(a), set(b)
    union = len(sa | sb)
    return len(sa & sb) / union if union else 1.0


def kept_agreement(kvsieve: list[list[list[int]]], kvpress: list[list[list[int]]]) -> dict[str, Any]:
    """Jaccard per layer and KV head of two kept sets; its mean, min and per-layer means."""
    if len(kvsieve) != len(kvpress) or any(len(a) != len(b) for a, b in zip(kvsieve, kvpress, strict=False)):
        raise ValueError("the two kept sets have different layer/head shapes")
    per_head = [[jaccard(a, b) for a, b in zip(la, lb, strict=True)] for la, lb in zip(kvsieve, kvpress, strict=True)]
    flat = [j for layer in per_head for j in layer]
    return {
        "mean": statistics.fmean(flat),
        "min": min(flat),
        "per_layer": [statistics.fmean(layer) for layer in per_head],
        "per_head": per_head,
    }


def summarize(runs: list[dict[str, dict[str, dict[str, Any]]]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """One row per kvsieve method from the runs of each round (``runs[round][method][side]``): medians over
    rounds, ratios kvsieve / kvpress as medians of per-round ratios, the kept-set agreement from the first round
    that recorded it."""
    rows = []
    for method in methods:
        pairs = [(r[method]["kvsieve"], r[method]["kvpress"]) for r in runs]
        row: dict[str, Any] = {"method": method, "press": PRESS_NAMES[METHODS[method]], "rounds": len(pairs)}
        for i, side in enumerate(SIDES):
            side_runs = [pair[i] for pair in pairs]
            row[side] = {
                "prefill_s": statistics.median(r["prefill_s"] for r in side_runs),
                "step_ms": statistics.median(r["step_ms"] for r in side_runs),
                "kv_bytes": side_runs[-1]["kv_bytes"],
                "extra_bytes": side_runs[-1]["extra_bytes"],
                "slots": side_runs[-1]["slots"],
            }
        row["ratio"] = {
            key: statistics.median(a[key] / b[key] for a, b in pairs) for key in ("prefill_s", "step_ms", "kv_bytes")
        }
        kept = [(a["kept"], b["kept"]) for a, b in pairs if "kept" in a and "kept" in b]
        row["kept"] = kept_agreement(*kept[0]) if kept else None
        rows.append(row)
    return rows


COLUMNS = (
    "kvsieve",
    "kvpress",
    "prefill s (kvsieve / kvpress)",
    "ratio",
    "step ms",
    "ratio",
    "KV MiB after decode",
    "Jaccard mean (min)",
)


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The table's cells (one list per row, as ``COLUMNS``)."""
    mib = 2**20
    cells = []
    for row in rows:
        s, p, ratio, kept = row["kvsieve"], row["kvpress"], row["ratio"], row["kept"]
        cells.append(
            [
                row["method"],
                row["press"],
                f"{s['prefill_s']:.2f} / {p['prefill_s']:.2f}",
                f"{ratio['prefill_s']:.2f}×",
                f"{s['step_ms']:.1f} / {p['step_ms']:.1f}",
                f"{ratio['step_ms']:.2f}×",
                f"{s['kv_bytes'] / mib:.2f} / {p['kv_bytes'] / mib:.2f}",
                "" if kept is None else f"{kept['mean']:.3f} ({kept['min']:.3f})",
            ]
        )
    return cells


def text_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table, columns padded."""
    body = [list(COLUMNS), *table_rows(rows)]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in body)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join([f"`{c[0]}`", *c[1:]]) + " |" for c in table_rows(rows)]
    return "\n".join(lines)


def run(settings: Settings) -> dict[str, Any]:
    """Both sides, their runs alternating (see :func:`schedule`); the result (settings, versions, rows)."""
    from tqdm import tqdm

    if settings.build_venv and not venv_ready(settings.venv):
        build_venv(settings.venv)
    ids = prompt_ids(settings.model, settings.context)
    pythons = {"kvsieve": Path(sys.executable), "kvpress": venv_python(settings.venv)}
    settings.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, dict[str, dict[str, Any]]]] = [
        {m: {} for m in settings.methods} for _ in range(settings.rounds)
    ]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        workers = {}
        for side in SIDES:
            print(f"starting the {side} worker (model load, warm-up)", file=sys.stderr, flush=True)
            log = settings.out / f"{side}_worker.log"
            workers[side] = WorkerProcess(pythons[side], setup_request(settings, ids, side), settings.threads, log)
            stack.callback(workers[side].close)
        plan = schedule(settings.methods, settings.rounds)
        with tqdm(total=len(plan) * (settings.steps + 1), desc="side by side", unit="step") as bar:
            for r, method, order in plan:
                bar.set_postfix_str(f"round {r + 1} {method}")
                runs[r][method] = run_pair(workers, method, order, settings.steps, r == 0, bar.update)
    return {
        "context": settings.context,
        "steps": settings.steps,
        "rounds": settings.rounds,
        "threads": settings.threads,
        "budget_tokens": settings.budget,
        "compression_ratio": COMPRESSION_RATIO,
        "model": str(settings.model),
        "load_avg_1min_at_start": load,
        "wall_s": time.perf_counter() - start,
        "versions": {side: workers[side].hello["versions"] for side in SIDES},
        "git": git_head(),
        "rows": summarize(runs, settings.methods),
    }


def git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip()


def main(argv: Sequence[str] | None = None) -> None:
    try:
        settings = check_args(parse_args(argv))
    except ValueError as e:
        sys.exit(f"kvpress_side_by_side: error: {e}")
    result = run(settings)
    header = (
        f"{settings.context}-token prompt, {settings.steps} decode steps, {settings.budget} tokens kept, "
        f"{settings.threads} thread(s), {settings.rounds} rounds (medians); kvsieve / kvpress"
    )
    write_report(settings.out, "kvpress_side_by_side", result, f"{header}\n\n{markdown_table(result['rows'])}")
    print(header)
    print(text_table(result["rows"]))
    print(f"written to {settings.out}")


def write_report(out: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    """``result`` as ``out/<name>.json`` and ``markdown`` as ``out/<name>.md``."""
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown + "\n")


if __name__ == "__main__":
    main()
