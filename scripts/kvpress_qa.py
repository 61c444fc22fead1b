"""Compress once, ask: kvsieve's question-agnostic mode beside kvpress's pipeline, answers and accuracy.

    python scripts/kvpress_qa.py --build-venv       # once: kvpress 0.5.5 in its own .venv-kvpress
    python scripts/kvpress_qa.py                    # 3 depths × 2 passkey trials (1,024 tokens) + the Einstein question

Each context is compressed before its question is known, on both sides, in their own processes
(``scripts/kvpress_worker.py``, the virtualenvs of ``scripts/kvpress_side_by_side.py``) loading the same safetensors
weights in fp32: kvpress's ``kv-press-text-generation`` pipeline (``pipe(context, question=..., press=...)``) and
``kvsieve.compress(...).ask(question)``, both greedy for ``--max-new-tokens``. Both lay out the chat template's user
turn as ``context + question``: kvsieve's ``compress`` puts ``"\\n\\n"`` at the end of the context part, so kvpress
gets ``context + "\\n\\n"`` as its context, and both feed the very same token ids (checked on every question: the
``same ids`` column). The contexts: passkey prompts of ``kvsieve needle`` (``--length`` tokens, ``--depths`` ×
``--trials``, the same seeded keys and offsets; the question is the prompt's last line, "What is the pass key?
Answer: the pass key is number"), and the first ``--einstein`` tokens of the built-in "Albert Einstein" article asked
"When and where was Einstein born?" (correct: the answer names Ulm).

Each method keeps 20 % of the context part (template included): kvpress's ``compression_ratio=0.8`` keeps
``int(n·0.2)`` tokens, kvsieve gets that many. kvsieve's settings are those that reproduce kvpress's rule
(``snapkv:window=64,kernel=5``: kvpress's observation window and pooling kernel; ``knorm:recent=0``: nothing
protected); ``full`` (kvsieve) against the pipeline without a press is the uncompressed reference. Per method: passkey
accuracy on each side, and over all questions the share of identical answers (stripped text), of identical first
answer tokens, and the mean number of leading answer tokens both sides share.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpress_side_by_side import (  # (the sibling script: a script's directory is on its path)
    COMPRESSION_RATIO,
    DYNAMIC,
    PRESS_NAMES,
    SIDES,
    WorkerProcess,
    add_shared_args,
    build_venv,
    checked_model_and_venv,
    git_head,
    kept_tokens,
    venv_python,
    venv_ready,
    write_report,
)

METHODS: dict[str, str] = {
    "full": DYNAMIC,
    "streaming_llm": "streaming_llm",
    "snapkv:window=64,kernel=5": "snapkv",
    "knorm:recent=0": "knorm",
    "tova": "tova",
}
"""kvsieve's policy spec (kvpress's rule) → kvpress's press (``dynamic``: none)."""
EINSTEIN = "Albert Einstein"
EINSTEIN_QUESTION = "When and where was Einstein born?"
EINSTEIN_ANSWER = "Ulm"


@dataclass(frozen=True)
class Case:
    """One context and its question; ``key``: the passkey (scored by ``kvsieve needle``'s rule), else the answer
    must contain ``expected``."""

    name: str
    context: str
    question: str
    expected: str
    key: int | None = None

    def correct(self, answer: str) -> bool:
        from kvsieve.evaluation.needle import passkey_found

        return passkey_found(answer, self.key) if self.key is not None else self.expected in answer


@dataclass(frozen=True)
class Settings:
    length: int
    depths: tuple[float, ...]
    trials: int
    einstein: int
    seed: int
    max_new_tokens: int
    threads: int
    methods: tuple[str, ...]
    model: Path
    venv: Path
    build_venv: bool
    out: Path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024, help="passkey prompt tokens (default 1024)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="needle depths (0–1)")
    parser.add_argument("--trials", type=int, default=2, help="passkey prompts per depth (default 2)")
    parser.add_argument(
        "--einstein", type=int, default=1536, help="tokens of the Einstein article asked about (0: none; default 1536)"
    )
    parser.add_argument("--seed", type=int, default=0, help="passkeys and haystack offsets (default 0)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="answer tokens at most (default 24)")
    add_shared_args(parser, METHODS, "kvpress_qa")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> Settings:
    """The run's settings, or a ``ValueError`` saying what is wrong (before anything runs)."""
    for name, value, least in (
        ("--length", args.length, 128),
        ("--trials", args.trials, 0),
        ("--einstein", args.einstein, 0),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--threads", args.threads, 1),
    ):
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if args.trials == 0 and args.einstein == 0:
        raise ValueError("nothing to ask: --trials and --einstein are both 0")
    if any(not 0.0 <= d <= 1.0 for d in args.depths):
        raise ValueError(f"--depths must be in [0, 1], got {args.depths}")
    model = checked_model_and_venv(args)
    return Settings(
        args.length,
        tuple(args.depths),
        args.trials,
        args.einstein,
        args.seed,
        args.max_new_tokens,
        args.threads,
        tuple(dict.fromkeys(args.methods)),
        model,
        args.kvpress_venv,
        args.build_venv,
        args.out,
    )


def cases(settings: Settings, tokenizer: Any) -> list[Case]:
    """The passkey prompts (``kvsieve needle``'s, split before the question) and the Einstein question."""
    from kvsieve.corpora.wikipedia import load_articles
    from kvsieve.data import builtin_text
    from kvsieve.evaluation.needle import QUESTION, passkey_prompts, split_question

    found = []
    grid = passkey_prompts(
        tokenizer, builtin_text(), [settings.length], settings.depths, settings.trials, settings.seed
    )
    for i, (length, depth, key, prompt) in enumerate(grid):
        context, _ = split_question(prompt)
        found.append(Case(f"passkey {length} @{depth:g} #{i % settings.trials}", context, QUESTION, str(key), key))
    if settings.einstein:
        article = next(a for a in load_articles() if a.title == EINSTEIN)
        ids = tokenizer(f"= {article.title} =\n\n{article.text}", add_special_tokens=False).input_ids
        text = tokenizer.decode(ids[: settings.einstein])
        found.append(Case(f"einstein {settings.einstein}", text, EINSTEIN_QUESTION, EINSTEIN_ANSWER))
    return found


def context_budget(tokenizer: Any, context: str) -> int:
    """kvpress's kept count for the context part kvsieve's ``compress`` feeds for ``context``."""
    from kvsieve.qa import split_prompt

    part, _ = split_prompt(tokenizer, context)
    return kept_tokens(len(tokenizer(part, add_special_tokens=False).input_ids))


def ask_both(
    workers: dict[str, WorkerProcess], method: str, case: Case, budget: int, max_new_tokens: int
) -> dict[str, Any]:
    """One question on both sides at once (each worker runs while the other does); the record of both answers."""
    from kvsieve.qa import SEPARATOR

    contexts = {"kvsieve": case.context, "kvpress": case.context + SEPARATOR}  # (the same context part, see docs)
    methods = {"kvsieve": method, "kvpress": METHODS[method]}
    for side in SIDES:
        request = {"method": methods[side], "context": contexts[side], "question": case.question, "budget": budget}
        workers[side].send({"do": "ask", **request, "max_new_tokens": max_new_tokens})
    replies = {side: workers[side].receive() for side in SIDES}
    s, p = replies["kvsieve"], replies["kvpress"]
    record = {"case": case.name, "method": method, "budget": budget}
    record["same_ids"] = s["context_ids"] == p["context_ids"] and s["question_ids"] == p["question_ids"]
    record["context_tokens"] = len(s["context_ids"])
    for side, reply in replies.items():
        record[side] = {"answer": reply["answer"], "tokens": reply["tokens"], "correct": case.correct(reply["answer"])}
    return record


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def agreement(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Shares of the questions both sides answered with the same (stripped) text and with the same first token, and
    the mean number of leading answer tokens they share."""
    if not records:
        raise ValueError("no answers to compare")
    pairs = [(r["kvsieve"], r["kvpress"]) for r in records]
    return {
        "same_answer": statistics.fmean(a["answer"] == b["answer"] for a, b in pairs),
        "same_first_token": statistics.fmean(a["tokens"][:1] == b["tokens"][:1] for a, b in pairs),
        "common_prefix": statistics.fmean(common_prefix(a["tokens"], b["tokens"]) for a, b in pairs),
    }


def summarize(records: Sequence[dict[str, Any]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """One row per method: passkey accuracy on each side, agreement over all its questions, the Einstein answers."""
    rows = []
    for method in methods:
        mine = [r for r in records if r["method"] == method]
        passkey = [r for r in mine if r["case"].startswith("passkey")]
        row: dict[str, Any] = {"method": method, "press": PRESS_NAMES[METHODS[method]], "questions": len(mine)}
        row["passkey"] = {
            side: {"correct": sum(r[side]["correct"] for r in passkey), "of": len(passkey)} for side in SIDES
        }
        row |= agreement(mine)
        row["same_ids"] = all(r["same_ids"] for r in mine)
        row["einstein"] = {
            side: [r[side]["answer"] for r in mine if r["case"].startswith("einstein")] for side in SIDES
        }
        rows.append(row)
    return rows


COLUMNS = (
    "kvsieve",
    "kvpress",
    "passkey found (kvsieve / kvpress)",
    "same answer",
    "same 1st token",
    "same leading tokens (mean)",
    "same ids",
)


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The table's cells (one list per row, as ``COLUMNS``)."""
    cells = []
    for row in rows:
        found = " / ".join(f"{row['passkey'][side]['correct']}/{row['passkey'][side]['of']}" for side in SIDES)
        same = [f"{row[key]:.0%} of {row['questions']}" for key in ("same_answer", "same_first_token")]
        prefix = f"{row['common_prefix']:.1f}"
        cells.append([row["method"], row["press"], found, *same, prefix, "yes" if row["same_ids"] else "no"])
    return cells


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, then each method's Einstein answers."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join([f"`{c[0]}`", *c[1:]]) + " |" for c in table_rows(rows)]
    answers = [
        f"- `{row['method']}`: kvsieve “{s}” · kvpress “{p}”"
        for row in rows
        for s, p in zip(row["einstein"]["kvsieve"], row["einstein"]["kvpress"], strict=True)
    ]
    return "\n".join(lines + ([f"\n{EINSTEIN_QUESTION}", *answers] if answers else []))


def run(settings: Settings) -> dict[str, Any]:
    """Every case × method on both sides; the result (settings, versions, records, rows)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if settings.build_venv and not venv_ready(settings.venv):
        build_venv(settings.venv)
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    asked = cases(settings, tokenizer)
    pythons = {"kvsieve": Path(sys.executable), "kvpress": venv_python(settings.venv)}
    settings.out.mkdir(parents=True, exist_ok=True)
    start, records = time.perf_counter(), []
    with contextlib.ExitStack() as stack:
        workers = {}
        for side in SIDES:
            setup = {"side": side, "model": str(settings.model), "threads": settings.threads}
            log = settings.out / f"{side}_worker.log"
            workers[side] = WorkerProcess(
                pythons[side], {**setup, "compression_ratio": COMPRESSION_RATIO}, settings.threads, log
            )
            stack.callback(workers[side].close)
        with tqdm(total=len(asked) * len(settings.methods), desc="kvsieve | kvpress", unit="question") as bar:
            for case in asked:
                budget = context_budget(tokenizer, case.context)
                for method in settings.methods:
                    bar.set_postfix_str(f"{case.name} {method}")
                    records.append(ask_both(workers, method, case, budget, settings.max_new_tokens))
                    bar.update()
    return {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
        "compression_ratio": COMPRESSION_RATIO,
        "wall_s": time.perf_counter() - start,
        "versions": {side: workers[side].hello["versions"] for side in SIDES},
        "git": git_head(),
        "records": records,
        "rows": summarize(records, settings.methods),
    }


def main(argv: Sequence[str] | None = None) -> None:
    try:
        settings = check_args(parse_args(argv))
    except ValueError as e:
        sys.exit(f"kvpress_qa: error: {e}")
    result = run(settings)
    table = markdown_table(result["rows"])
    write_report(settings.out, "kvpress_qa", result, table)
    print(table)
    print(f"written to {settings.out}")


if __name__ == "__main__":
    main()
