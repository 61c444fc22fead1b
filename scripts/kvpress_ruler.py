"""kvsieve's RULER suite beside NVIDIA kvpress: the same samples, the same token ids, question-agnostic on both sides.

    python scripts/kvpress_ruler.py --ruler-out OUT --build-venv            # once: kvpress 0.5.5 in .venv-kvpress
    python scripts/kvpress_ruler.py --ruler-out OUT --tasks niah_single_1 --samples 2
    python scripts/kvpress_ruler.py --ruler-out OUT --samples 2 --report    # the report of the answers stored

``OUT`` is a ``kvsieve ruler --out OUT`` directory: its ``samples/<task>_<length>.jsonl`` are the prompts (the first
``--samples`` of each; ``--tasks`` and ``--lengths`` pick among the files there, by default all of them), and the model
defaults to the one recorded in ``samples/*.settings.json`` (samples the tokenizer counts otherwise are refused). Each
sample is split by :class:`kvsieve.ruler.tasks.Prompter` into the token ids of its context part (the chat template's
header and the context) and of its question part (the question, the rest of the turn, the assistant's header, the
answer prefix), once, in this process; both sides get those very ids (each worker sends back what it fed: the ``ids``
column) and answer greedily up to RULER's token limit of the task (:data:`kvsieve.ruler.predict.MAX_NEW_TOKENS`), scored
by :func:`kvsieve.ruler.scoring.score`.

- **kvsieve**: :func:`kvsieve.ruler.predict.predict` under ``Setting("agnostic", spec, c)``: the context part compressed
  by one forward pass, then the question part fed and the answer decoded with the cache growing without bound.
- **kvpress**: its ``kv-press-text-generation`` pipeline, fed the ids: the pipeline's ``preprocess`` only turns text
  into ids, so the ids go straight to its ``forward`` (``_forward``: the context prefilled through the base model inside
  ``with press(model)``, then the question with positions continuing after the uncompressed context, then greedy
  decoding to EOS or the limit) and ``postprocess``: the pipeline's own code, with a ``DynamicCache`` passed in so that
  the kept tokens can be read afterwards (the pipeline strips the question and answer from it). Each kvpress answer
  also checks that the pipeline's ``preprocess`` of the text (context + ``"\\n\\n"``, question, answer prefix) gives
  the same ids (the ``ids`` column says so where it does not).

Both sides run in their own processes (``scripts/kvpress_worker.py``, its ``ruler`` command, implemented here by
:func:`answer_sample`), with the virtualenvs and worker of ``scripts/kvpress_side_by_side.py``, loading the same
safetensors weights in fp32 on ``--threads`` threads. By default one side runs at a time (which side goes first
alternates from sample to sample); ``--parallel`` runs both at once (as ``scripts/kvpress_qa.py`` does). Per answer:
the seconds of ``predict`` / the pipeline's ``forward`` (prefill, compression, question, decoding), the peak resident
memory of the process during it (Linux: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, so per
sample; the rise is that peak less the resident memory before: what the sample's computation added; elsewhere the
process's peak so far from ``getrusage``) and the context tokens kept (kvsieve: the held positions before the context
part's end, per layer and KV head; kvpress: the cache's length after the pipeline). Before the memory is read, freed
heap memory is handed back to the system (glibc's ``malloc_trim``); the weights are memory-mapped, so each method first
answers once untimed on a short prefix of the first sample (:func:`warm_up`): the pages of the weights and first calls
are not counted in any answer. ``full`` ignores the compression: it is answered once per sample.

**Budget.** Compression ``c`` is kvpress's ``compression_ratio``: it keeps ``int(n·(1−c))`` of the ``n`` context-part
tokens; kvsieve's ratio budget ``1−c`` would round (a token more for some ``n``), so kvsieve gets kvpress's count as a
token budget (the ``kept`` column shows both measured).

**The rows** (kvsieve spec → kvpress press; ``--methods``):

- ``streaming_llm`` → ``StreamingLLMPress``: the same rule (4 sink tokens + the newest), original positions on both
  sides (kvpress without its ``KeyRerotationPress``).
- ``snapkv:window=64,kernel=5`` and ``snapkv:window=64,kernel=5,pooling=mean`` → ``SnapKVPress`` (kvpress's window
  and kernel). Both sides score the non-window tokens by the attention of the last 64 prompt queries (kvpress
  recomputes those queries from the layer's input, sdpa giving no weights) and keep the window. kvpress *averages*
  the scores over the pooling kernel (``avg_pool1d``, the zero padding counted at both ends) for each query head,
  then over the GQA group; kvsieve's default takes the *maximum* over the kernel (the authors' ``maxpool``) of the
  group's sum, equal maxima keeping the newer token — a different rule. Its ``pooling=mean`` is kvpress's: the mean
  is linear, so pooling each head and averaging over the group ranks as pooling the group's sum does.
- ``tova`` → ``TOVAPress``: both score by the last prompt query's attention averaged over all heads of the layer (one
  kept set per layer). kvpress always keeps the last token (scored max + 1), kvsieve (as the paper) does not protect it.
- ``knorm:recent=0`` → ``KnormPress``: both keep the lowest key norms, nothing protected (kvsieve's default protects
  a recent window). kvpress compares fp32 norms of the cached (rotated) keys; kvsieve compares them at float16
  resolution, equal ones keeping the newer token. Where keys repeat (layer 0's keys depend on the token alone, and a
  repeated haystack line repeats its tokens) the norms are equal but for RoPE's round-off: kvpress ranks those by the
  round-off, kvsieve keeps the newest.
- ``h2o`` and ``h2o:recent=0,normalize=true`` → ``ObservedAttentionPress``. From the two sources, ObservedAttention is
  not H2O: (1) it reads the attention weights the attention layer returns, which only the ``eager`` implementation
  materialises (with sdpa they are ``None`` and the press asserts), so the worker switches the model to eager for its
  prefill: a ``[heads, n, n]`` fp32 matrix per layer (14 × 4,096² × 4 B ≈ 0.94 GB on Qwen2.5-0.5B at 4,096 tokens),
  seen in its time and memory; kvsieve's own attention implementation hands the policy its probabilities under any
  model setting. (2) Its score is the attention a token receives *averaged* over the queries that can see it (the sum
  over queries divided by ``n − i``), averaged over the GQA group; H2O (kvsieve's ``h2o``, the authors' code) *sums* it,
  which favours older tokens (seen by more queries). (3) It keeps the top ``int(n·(1−c))`` by score alone; H2O reserves
  a recent window (kvsieve: half the budget). (4) It compresses the prefill once; H2O evicts at every decode step too
  (kvsieve's question-aware protocol), which this question-agnostic protocol does not do on either side. kvsieve's
  ``normalize=true`` divides by the same count (the token's age + 1) and ``recent=0`` drops the window: that row is
  ObservedAttention's rule.
- ``kvzip`` → ``KVzipPress``: both hold the context, feed it again after a request to repeat it, chunk by chunk, and
  score each cached pair by the largest attention any reconstruction query of its KV head's group gives it. kvsieve
  keeps the same count per KV head and layer (the authors' uniform head budgets) and normalises each probe's
  attention over the whole held context; kvpress's default selects over all heads and layers at once and keeps the
  others as masks (see its own docstring for its normalisation). The probe requests are the authors' on both sides.
- ``kvzip:heads=adakv,safeguard=0`` → ``KVzipPress`` as well: kvsieve's KVzip with its selection over heads as well
  as layers, as kvpress's (each layer's share rounded to whole tokens per head; kvsieve holds each head's own count,
  kvpress masks a full-size cache).
- ``keydiff:recent=0`` → ``KeyDiffPress``: both keep the keys least like the mean unit key, nothing protected
  (kvsieve's default protects a recent window); kvsieve compares the similarities at float16 resolution, equal ones
  keeping the newer token.
- ``expected_attention`` → ``ExpectedAttentionPress``: the same rule (the context's queries before RoPE, their mean
  and covariance without the 4 sink positions, the rotation averaged over the next 512 positions, the expected
  attention averaged over the GQA group and weighted by the value norms, the sinks kept). kvpress recomputes the
  queries from the layer's input; kvsieve takes the queries the layer attends with and un-rotates them.
- ``snapkv:window=64,kernel=5,schedule=pyramid`` → ``PyramidKVPress`` (not run by default): SnapKV's rule under
  PyramidKV's layer budgets, an arithmetic sequence from ``2 − 1/β`` times the mean (first layer) to ``1/β`` of it
  (last), ``β = 20``, each layer's whole kept count (window included) on both sides. Where the first layers' shares
  exceed the context, kvpress lowers them to the context less the window and raises the others (kvsieve keeps the
  whole context there and holds the rest for the answer's tokens); where the last layer's share is below the window,
  kvpress falls back to SnapKV's uniform budget and kvsieve refuses the layer budget, so the row needs ``20 × 64``
  kept tokens. kvsieve rounds each share once (every layer at least one token, the remainder to the largest
  fractional parts), kvpress rounds each layer's to the nearest.
- ``snapkv:window=64,kernel=5,pooling=mean,heads=adakv`` → ``AdaKVPress`` over ``SnapKVPress``: both share each
  layer's kept count among its KV heads by SnapKV's scores, each head first keeping its ``max(1, ⌊0.2 · kept⌋)`` best
  (the safeguard), the rest the best over the layer's heads. kvsieve protects the window's tokens (they count in each
  head's share), kvpress scores them at the maximum of the other scores, so ties may fall differently. kvpress masks
  the evicted keys of a full-size cache (its ``kept`` is the context); kvsieve holds each head's own count.
- ``full`` → no press (not run by default): the uncompressed control; both should answer alike.

Other differences between the sides, for every row: kvsieve runs its own attention implementation under transformers
5.24, kvpress sdpa (eager for ObservedAttention) under transformers < 5.3, so logits agree to float round-off only and
a near-tied greedy token can flip; kvpress gathers the kept keys in score order (kvsieve holds slots), which changes
only the order of float sums.

**Output** (``--out``, default ``out/kvpress_ruler``): ``records.jsonl`` (one line per answer: resumable, a rerun
computes only what is missing for the same model, template, ids and limits; each record names the CPU it was answered
on; ``--report`` answers nothing and reports the records stored for the settings given, so a table can pool runs of
different samples or compressions), ``kvpress_ruler.json`` (provenance, settings, versions, git head, the hosts,
records, rows per task and length and over all of them; :mod:`kvsieve.results` renders the latter in
``docs/results/kvpress.md``) and ``kvpress_ruler.md``: over all tasks (their samples pooled) and per task and length,
each row's score on each side (mean ± standard error, %), the share of samples both answered alike (stripped text), mean
seconds per sample, the largest peak RSS and the mean rise, mean kept tokens, whether the ids were the same; the full
cache's score from ``OUT/cells`` when the ruler run computed it; then the answers that differ.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpress_side_by_side import (  # (the sibling script: a script's directory is on its path)
    DYNAMIC,
    SIDES,
    WorkerProcess,
    add_shared_args,
    build_venv,
    checked_model_and_venv,
    git_head,
    venv_python,
    venv_ready,
    write_report,
)
from kvpress_side_by_side import PRESS_NAMES as _PRESS_NAMES

FULL = "full"
PYRAMID = "snapkv:window=64,kernel=5,schedule=pyramid"
"""PyramidKV's row: run when asked (its last layer's share must hold SnapKV's window: see ``MIN_KEPT``)."""
ADAKV = "snapkv:window=64,kernel=5,pooling=mean,heads=adakv"
"""AdaKV's row, over SnapKV's rule as kvpress states it (pooled by the mean)."""
METHODS: dict[str, str] = {
    "streaming_llm": "streaming_llm",
    "snapkv:window=64,kernel=5": "snapkv",
    "snapkv:window=64,kernel=5,pooling=mean": "snapkv",
    "tova": "tova",
    "knorm:recent=0": "knorm",
    "h2o": "observed_attention",
    "h2o:recent=0,normalize=true": "observed_attention",
    "kvzip": "kvzip",
    "kvzip:heads=adakv,safeguard=0": "kvzip",
    "keydiff:recent=0": "keydiff",
    "expected_attention": "expected_attention",
    ADAKV: "adakv_snapkv",
    PYRAMID: "pyramidkv",
    FULL: DYNAMIC,
}
"""kvsieve's policy spec → kvpress's press (see the module docstring)."""
DEFAULT_METHODS = [m for m in METHODS if m not in (FULL, PYRAMID)]
PRESS_NAMES = {
    **_PRESS_NAMES,
    "observed_attention": "ObservedAttentionPress",
    "expected_attention": "ExpectedAttentionPress",
    "kvzip": "KVzipPress",
    "keydiff": "KeyDiffPress",
    "pyramidkv": "PyramidKVPress",
    "adakv_snapkv": "AdaKVPress",
}
"""Press → kvpress's class name."""
EAGER = ("observed_attention",)
"""Presses that read the attention weights the layers return: the model runs ``eager`` attention under them."""
MIN_KEPT = {
    "snapkv:window=64,kernel=5": 64,
    "snapkv:window=64,kernel=5,pooling=mean": 64,
    ADAKV: 64,
    PYRAMID: 20 * 64,
}
"""Rows that need more kept tokens than the default ``DEFAULT_MIN_KEPT``: SnapKV's 64-token window (under PyramidKV's
schedule, in the last layer, which holds 1/20 of the mean)."""
DEFAULT_MIN_KEPT = 5
"""StreamingLLM's and ExpectedAttention's 4 sink tokens, and one more."""
UNCOMPRESSED = (FULL, DYNAMIC)
"""Methods that ignore the compression: answered once per sample (their records and row say compression 0)."""
WARMUP_TOKENS = 256
"""Context tokens of each method's untimed warm-up answer (two answer tokens, at compression 0.5)."""
SAMPLE_FILE = re.compile(r"(?P<task>.+)_(?P<length>\d+)\.jsonl")
DIFFERING_SHOWN = 40
"""Differing answers listed in the markdown at most."""


def press_of(method: str) -> str:
    """The kvpress press of a row."""
    return METHODS[method]


def kvpress_kept(tokens: int, compression: float) -> int:
    """Tokens kvpress keeps of ``tokens`` at ``compression`` (its ``compute_n_kept``)."""
    return max(1, int(tokens * (1 - compression)))


# --- settings ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    ruler_out: Path
    groups: tuple[tuple[str, int], ...]
    """The ``(task, length)`` pairs answered."""
    samples: int | None
    """The first this many samples of each task (None: all)."""
    compressions: tuple[float, ...]
    methods: tuple[str, ...]
    model: Path
    model_name: str
    chat_template: bool
    threads: int
    parallel: bool
    venv: Path
    build_venv: bool
    out: Path
    report: bool
    """Answer nothing: the report of the answers stored in ``out`` for these settings."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], conflict_handler="resolve")
    parser.add_argument("--ruler-out", type=Path, required=True, help="a `kvsieve ruler --out` directory (its samples)")
    parser.add_argument("--tasks", nargs="+", help="tasks (default: every task with samples there)")
    parser.add_argument("--lengths", type=int, nargs="+", help="lengths (default: every length with samples there)")
    parser.add_argument("--samples", type=int, help="the first N samples of each task (default: all)")
    parser.add_argument(
        "--compressions", type=float, nargs="+", default=[0.5], help="kvpress compression ratios (default 0.5)"
    )
    parser.add_argument("--parallel", action="store_true", help="run both sides at once (default: one at a time)")
    parser.add_argument(
        "--report",
        action="store_true",
        help="answer nothing: the report of the answers already in --out for these settings (the workers still "
        "start, to say their versions)",
    )
    add_shared_args(parser, list(METHODS), "kvpress_ruler")
    parser.set_defaults(methods=DEFAULT_METHODS)
    parser.add_argument(  # (replaces the shared --model: a built-in name too, default the samples' model)
        "--model", help="built-in model name or local directory (default: the model the samples were made with)"
    )
    return parser.parse_args(argv)


def sample_files(ruler_out: Path) -> dict[tuple[str, int], Path]:
    """``(task, length) → samples/<task>_<length>.jsonl`` of a ``kvsieve ruler`` directory."""
    found = {}
    for path in sorted((ruler_out / "samples").glob("*.jsonl")):
        match = SAMPLE_FILE.fullmatch(path.name)
        if match:
            found[match["task"], int(match["length"])] = path
    return found


def recorded(paths: Sequence[Path]) -> dict[str, Any]:
    """What the samples' ``.settings.json`` record (the model and the chat template), one value each."""
    values: dict[str, set] = {"model": set(), "chat_template": set()}
    for path in paths:
        stamp = path.with_suffix(".settings.json")
        if stamp.is_file():
            stored = json.loads(stamp.read_text())
            for key in values:
                if key in stored:
                    values[key].add(json.dumps(stored[key]))
    for key, seen in values.items():
        if len(seen) > 1:
            raise ValueError(f"the samples were made with different {key} settings: {', '.join(sorted(seen))}")
    return {key: json.loads(next(iter(seen))) for key, seen in values.items() if seen}


def resolve_model(name: str) -> Path:
    """The safetensors directory of a built-in model name, a local ``.gguf`` file or a local directory."""
    from kvsieve.models import BUILTIN_MODELS, ensure_gguf, ensure_model

    if name in BUILTIN_MODELS:
        return Path(ensure_model(name))
    if name.lower().endswith(".gguf") and Path(name).is_file():
        return Path(ensure_gguf(name))
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    raise ValueError(f"model {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a local directory")


def check_args(args: argparse.Namespace) -> Settings:
    """The run's settings, or a ``ValueError`` saying what is wrong (before anything runs)."""
    samples_dir = args.ruler_out / "samples"
    files = sample_files(args.ruler_out)
    if not files:
        raise ValueError(f"no samples in {samples_dir} (`kvsieve ruler --out {args.ruler_out}` writes them)")
    groups = tuple(
        (t, n)
        for t, n in files
        if (args.tasks is None or t in args.tasks) and (args.lengths is None or n in args.lengths)
    )
    wanted = [(t, None) for t in args.tasks or ()] + [(None, n) for n in args.lengths or ()]
    if args.tasks and args.lengths:
        wanted = [(t, n) for t in args.tasks for n in args.lengths]
    missing = [(t, n) for t, n in wanted if not any(t in (None, g) and n in (None, m) for g, m in groups)]
    if missing:
        have = ", ".join(f"{t}_{n}" for t, n in files)
        names = ", ".join(t if n is None else f"length {n}" if t is None else f"{t} at {n}" for t, n in missing)
        raise ValueError(f"no samples for {names} in {samples_dir} (there: {have})")
    if args.samples is not None:
        if args.samples < 1:
            raise ValueError(f"--samples must be at least 1, got {args.samples}")
        for key in groups:
            held = sum(1 for line in files[key].read_text().splitlines() if line.strip())
            if held < args.samples:
                raise ValueError(f"{files[key]} holds {held} samples, fewer than --samples {args.samples}")
    for c in args.compressions:
        if not 0.0 < c < 1.0:
            raise ValueError(f"a compression is the share of the context dropped, in (0, 1); got {c}")
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    stored = recorded([files[g] for g in groups])
    name = args.model if args.model is not None else stored.get("model")
    if name is None:
        raise ValueError(f"the samples in {samples_dir} record no model: pass --model")
    args.model = resolve_model(str(name))
    model = checked_model_and_venv(args)
    return Settings(
        args.ruler_out,
        groups,
        args.samples,
        tuple(dict.fromkeys(args.compressions)),
        tuple(dict.fromkeys(args.methods)),
        model,
        str(name),
        bool(stored.get("chat_template", True)),
        args.threads,
        args.parallel,
        args.kvpress_venv,
        args.build_venv,
        args.out,
        args.report,
    )


# --- the samples and what each side is sent --------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One sample, as both sides are fed it."""

    sample: Any
    """:class:`kvsieve.ruler.tasks.Sample`."""
    head: list[int]
    """The context part's ids."""
    tail: list[int]
    """The question part's ids."""
    text: tuple[str, str, str]
    """What kvpress's pipeline would be given as text: the context (with kvsieve's separator), question, prefix."""
    max_new_tokens: int

    @property
    def digest(self) -> str:
        """The ids' SHA-256 (first 16 hex digits): a record answers these ids."""
        return hashlib.sha256(json.dumps([self.head, self.tail]).encode()).hexdigest()[:16]


def plan(settings: Settings, tokenizer: Any) -> list[Item]:
    """Every sample to answer, split into ids by :class:`~kvsieve.ruler.tasks.Prompter`; a ``ValueError`` where the
    tokenizer is not the samples' (their recorded token counts differ) or a compression keeps too few tokens."""
    from kvsieve.qa import SEPARATOR
    from kvsieve.ruler.predict import max_new_tokens
    from kvsieve.ruler.tasks import Prompter, load_samples

    prompter = Prompter(tokenizer, settings.chat_template)
    files = sample_files(settings.ruler_out)
    items = []
    for task, length in settings.groups:
        for sample in load_samples(files[task, length])[: settings.samples]:
            head, tail = prompter.ids(sample.context, sample.question, sample.answer_prefix)
            if len(head) + len(tail) != sample.tokens:
                raise ValueError(
                    f"{task}_{length} #{sample.index} has {len(head) + len(tail)} tokens with the tokenizer of "
                    f"{settings.model_name}, {sample.tokens} when it was made: pass the --model that made them"
                )
            for c in settings.compressions:
                for method in settings.methods:
                    need = MIN_KEPT.get(method, DEFAULT_MIN_KEPT) if method != FULL else 1
                    if kvpress_kept(len(head), c) < need:
                        raise ValueError(
                            f"compression {c:g} keeps {kvpress_kept(len(head), c)} of the {len(head)} context "
                            f"tokens of {task}_{length} #{sample.index}: {method} needs {need}"
                        )
            text = (sample.context + SEPARATOR, sample.question, sample.answer_prefix)
            items.append(Item(sample, head, tail, text, max_new_tokens(task)))
    return items


def request(item: Item, compression: float, method: str) -> dict[str, Any]:
    """A worker's ``ruler`` command: the same ids, budget and limit on both sides; only ``method`` differs."""
    return {
        "do": "ruler",
        "method": method,
        "context_ids": item.head,
        "question_ids": item.tail,
        "compression": compression,
        "budget": kvpress_kept(len(item.head), compression),
        "max_new_tokens": item.max_new_tokens,
        "text": list(item.text),
    }


def record_key(settings: Settings, item: Item, compression: float, side: str, method: str) -> dict[str, Any]:
    """What an answer depends on (a stored record with another key is computed again)."""
    s = item.sample
    return {
        "model": str(settings.model),
        "chat_template": settings.chat_template,
        "task": s.task,
        "length": s.length,
        "index": s.index,
        "ids": item.digest,
        "max_new_tokens": item.max_new_tokens,
        "compression": 0.0 if method in UNCOMPRESSED else compression,
        "side": side,
        "method": method,
    }


def make_record(key: dict[str, Any], item: Item, reply: dict[str, Any], cpu: dict[str, Any]) -> dict[str, Any]:
    """One answer's record: its key, the answer and its score, what was measured, whether the ids fed were sent, and
    the host's CPU (:func:`kvsieve.provenance.cpu`: a resumed run's records may come from several hosts)."""
    from kvsieve.ruler.scoring import score

    fields = ("answer", "answer_tokens", "seconds", "rss_peak_mib", "rss_rise_mib", "kept", "kept_min")
    record = {
        "key": key,
        **{k: reply[k] for k in fields},
        "score": score(item.sample.task, reply["answer"], item.sample.answers),
    }
    record["same_ids"] = reply["context_ids"] == item.head and reply["question_ids"] == item.tail
    record["pipeline_ids"] = reply.get("pipeline_ids")
    record["cpu"] = cpu
    return record


def jobs(settings: Settings, item: Item, compression: float) -> dict[str, list[str]]:
    """Each side's methods for one sample and compression: kvsieve's specs, kvpress's presses (each once; ``full``
    only with the first compression)."""
    methods = [m for m in settings.methods if m != FULL or compression == settings.compressions[0]]
    return {"kvsieve": methods, "kvpress": list(dict.fromkeys(press_of(m) for m in methods))}


def run_queues(
    workers: dict[str, Any],
    queues: dict[str, list[str]],
    order: Sequence[str],
    parallel: bool,
    make: Callable[[str, str], dict[str, Any]],
    done: Callable[[str, str, dict[str, Any]], None],
) -> None:
    """Ask each side its methods in turn, the sides alternating in ``order``: one at a time, or (``parallel``) both
    sides' next methods sent before either answer is read; ``done(side, method, reply)`` after each answer."""
    queues = {side: list(q) for side, q in queues.items()}
    while any(queues.values()):
        turn = [(side, queues[side].pop(0)) for side in order if queues.get(side)]
        if parallel:
            for side, method in turn:
                workers[side].send(make(side, method))
            for side, method in turn:
                done(side, method, workers[side].receive())
        else:
            for side, method in turn:
                done(side, method, workers[side].ask(make(side, method)))


def warm_up(workers: dict[str, Any], item: Item, compression: float, methods: dict[str, Sequence[str]]) -> None:
    """Each side's ``methods`` answer once, untimed and unrecorded, on the first ``WARMUP_TOKENS`` context tokens of
    ``item`` (or twice the most kept tokens a row needs, ``MIN_KEPT``) at compression 0.5 (the whole context at
    ``compression`` if it is shorter), two answer tokens: the weights are paged in and first calls done before
    anything is measured."""
    need = (MIN_KEPT.get(m, DEFAULT_MIN_KEPT) for m in methods.get("kvsieve", ()))
    tokens = max([WARMUP_TOKENS, *(2 * n for n in need)])
    short = len(item.head) > tokens
    warm = dataclasses.replace(item, head=item.head[:tokens], max_new_tokens=2)
    for side in SIDES:
        for method in methods.get(side, ()):
            workers[side].ask(request(warm, 0.5 if short else compression, method))


def load_records(path: Path) -> dict[str, dict[str, Any]]:
    """The records stored in ``path`` by their key."""
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {json.dumps(r["key"], sort_keys=True): r for r in records}


# --- the worker's side (runs under either virtualenv: kvsieve and kvpress are imported where they are needed) ----


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M)[1])


@contextlib.contextmanager
def measured(into: dict[str, Any]) -> Iterator[None]:
    """Seconds, peak resident memory and its rise over the memory before (MiB) of what runs inside, into ``into``
    (see the module docstring). Freed heap memory is handed back to the system first (glibc's ``malloc_trim``), so
    that the memory before is what the process holds live."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        before = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # (resets the peak: VmHWM)
        per_sample = True
    except (OSError, TypeError):
        per_sample = False
    start = time.perf_counter()
    yield
    into["seconds"] = time.perf_counter() - start
    if per_sample:
        peak = _status_kib("VmHWM")
        into |= {"rss_peak_mib": peak / 1024, "rss_rise_mib": (peak - before) / 1024}
    else:
        into |= {"rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_rise_mib": None}


@functools.cache
def _token_setting() -> type:
    from kvsieve.ruler.predict import Setting

    @dataclass(frozen=True)
    class TokenSetting(Setting):
        """A setting whose budget is a token count (kvpress's kept count), not the ratio ``1 - compression``."""

        tokens: int = 0

        @property
        def budget(self) -> int:
            return self.tokens

    return TokenSetting


def kvsieve_setting(spec: str, compression: float, tokens: int) -> Any:
    """The :class:`~kvsieve.ruler.predict.Setting` :func:`~kvsieve.ruler.predict.predict` runs: question-agnostic
    ``spec`` at ``compression`` keeping ``tokens`` (``full``: the full cache)."""
    from kvsieve.ruler.predict import FULL as FULL_SETTING

    return FULL_SETTING if spec == FULL else _token_setting()("agnostic", spec, compression, tokens)


def kept_context(cache: Any, context: int) -> tuple[int, int]:
    """The most and fewest context positions (below ``context``) a kvsieve cache holds, over layers and KV heads."""
    counts = []
    for i in range(len(cache.layers)):
        held = cache.positions(i)
        counts += ((held >= 0) & (held < context)).sum(-1).flatten().tolist()
    return max(counts), min(counts)


def kvsieve_answer(model: Any, command: dict[str, Any]) -> dict[str, Any]:
    """kvsieve's answer: :func:`kvsieve.ruler.predict.predict`, the cache read afterwards through a forward hook."""
    from kvpress_worker import load_tokenizer
    from transformers.cache_utils import Cache

    from kvsieve.ruler.predict import predict

    head, tail = command["context_ids"], command["question_ids"]
    setting = kvsieve_setting(command["method"], command["compression"], command["budget"])
    tokenizer, caches, reply = load_tokenizer(model), [], {}

    def seen(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        caches.extend(v for v in kwargs.values() if isinstance(v, Cache))

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        with measured(reply):
            text, n, _, _ = predict(model, tokenizer, head, tail, setting, command["max_new_tokens"])
    finally:
        hook.remove()
    kept, kept_min = kept_context(caches[0], len(head))
    return reply | {"answer": text, "answer_tokens": n, "kept": kept, "kept_min": kept_min} | _fed(head, tail)


def _fed(head: list[int], tail: list[int]) -> dict[str, Any]:
    return {"context_ids": head, "question_ids": tail}


@contextlib.contextmanager
def attention(model: Any, implementation: str | None) -> Iterator[None]:
    """The model on ``implementation`` inside (None: unchanged), back on sdpa (the worker's) after."""
    if implementation is None:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


def kvpress_answer(model: Any, command: dict[str, Any]) -> dict[str, Any]:
    """kvpress's answer: its pipeline's ``forward`` and ``postprocess`` on the ids (see the module docstring)."""
    import kvpress
    import torch
    from kvpress_worker import greedy_tokens, load_tokenizer
    from transformers import DynamicCache, pipeline

    method, ratio = command["method"], command["compression"]
    if method != DYNAMIC and method not in PRESS_NAMES:
        raise ValueError(f"unknown press {method!r}; expected one of {', '.join(PRESS_NAMES)}")
    if method == "adakv_snapkv":  # (AdaKV over SnapKV, at the ratio of the press it wraps)
        press = kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    else:
        press = None if method == DYNAMIC else getattr(kvpress, PRESS_NAMES[method])(compression_ratio=ratio)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=load_tokenizer(model))
    head, tail = command["context_ids"], command["question_ids"]
    context, question, prefix = command["text"]
    text_ids = pipe.preprocess(context, questions=[question], answer_prefix=prefix, max_context_length=int(1e10))
    same = text_ids["context_ids"][0].tolist() == head and text_ids["questions_ids"][0][0].tolist() == tail
    inputs = {"context_ids": torch.tensor([head]), "questions_ids": [torch.tensor([tail])]}
    cache, reply = DynamicCache(), {}
    with attention(model, "eager" if method in EAGER else None), greedy_tokens(model) as tokens, measured(reply):
        outputs = pipe.forward(inputs, press=press, max_new_tokens=command["max_new_tokens"], cache=cache)
        answer = pipe.postprocess(outputs, single_question=True)["answer"]
    kept = [cache.get_seq_length(i) for i in range(len(cache))]
    reply |= {"answer": answer.strip(), "answer_tokens": len(tokens), "kept": max(kept), "kept_min": min(kept)}
    return reply | {"pipeline_ids": same} | _fed(head, tail)


def answer_sample(side: str, model: Any, command: dict[str, Any]) -> dict[str, Any]:
    """The worker's ``ruler`` command (``scripts/kvpress_worker.py``): one sample's ``context_ids`` then
    ``question_ids`` under ``method`` (kvsieve: a policy spec, at ``budget`` tokens; kvpress: a press, at
    ``compression``), greedy up to ``max_new_tokens``. Answer: ``answer`` (stripped), ``answer_tokens`` (an EOS
    included), ``seconds``, ``rss_peak_mib``, ``rss_rise_mib``, ``kept`` and ``kept_min`` (context tokens held, most
    and fewest over layers and heads), the ids fed, and on the kvpress side ``pipeline_ids``: whether its pipeline's
    ``preprocess`` of ``text`` gives those ids."""
    return (kvsieve_answer if side == "kvsieve" else kvpress_answer)(model, command)


# --- summary and report -----------------------------------------------------------------------------------------


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def side_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One side's figures over its records (None: none)."""
    from kvsieve.ruler.scoring import mean_and_stderr

    if not records:
        return None
    mean, stderr = mean_and_stderr([r["score"] for r in records])
    return {
        "score": mean,
        "stderr": stderr,
        "seconds": statistics.fmean(r["seconds"] for r in records),
        "rss_peak_mib": max(r["rss_peak_mib"] for r in records),
        "rss_rise_mib": _mean([r["rss_rise_mib"] for r in records]),
        "kept": statistics.fmean(r["kept"] for r in records),
    }


def _paired(
    found: dict[tuple, dict[int, dict[str, Any]]], groups: Sequence[tuple[str, int]], c: float, method: str
) -> dict[str, Any] | None:
    """One row over ``groups`` (pooled): the samples both sides answered for ``method`` at ``c``; None where there are
    none."""
    at = 0.0 if method in UNCOMPRESSED else c
    spec, press = method, press_of(method)
    pairs, tasks = [], 0
    for task, length in groups:
        s = found.get((task, length, at, "kvsieve", spec), {})
        p = found.get((task, length, at, "kvpress", press), {})
        indexes = sorted(s.keys() & p.keys())
        pairs += [(s[i], p[i]) for i in indexes]
        tasks += bool(indexes)
    if not pairs:
        return None
    row: dict[str, Any] = {"compression": at, "method": method, "kvsieve_spec": spec, "press": PRESS_NAMES[press]}
    row |= {"samples": len(pairs), "tasks": tasks}
    row["kvsieve"] = side_summary([a for a, _ in pairs])
    row["kvpress"] = side_summary([b for _, b in pairs])
    row["same_answer"] = statistics.fmean(a["answer"] == b["answer"] for a, b in pairs)
    row["same_kept"] = all(a["kept"] == b["kept"] for a, b in pairs)
    row["same_ids"] = all(r["same_ids"] for pair in pairs for r in pair)
    row["pipeline_ids"] = all(b["pipeline_ids"] for _, b in pairs)
    return row


def _found(records: Sequence[dict[str, Any]]) -> dict[tuple, dict[int, dict[str, Any]]]:
    found: dict[tuple, dict[int, dict[str, Any]]] = {}
    for r in records:
        k = r["key"]
        found.setdefault((k["task"], k["length"], k["compression"], k["side"], k["method"]), {})[k["index"]] = r
    return found


def _wanted(compressions: Sequence[float], methods: Sequence[str]) -> Iterator[tuple[float, str]]:
    """Each compression and method of a table (an uncompressed method once, with the first compression)."""
    for c in compressions:
        for method in methods:
            if method not in UNCOMPRESSED or c == compressions[0]:
                yield c, method


def summarize(
    records: Sequence[dict[str, Any]],
    groups: Sequence[tuple[str, int]],
    compressions: Sequence[float],
    methods: Sequence[str],
) -> list[dict[str, Any]]:
    """One row per task, length, compression and method, over the samples both sides answered."""
    found = _found(records)
    rows = []
    for task, length in groups:
        for c, method in _wanted(compressions, methods):
            row = _paired(found, [(task, length)], c, method)
            if row is not None:
                rows.append({"task": task, "length": length, **row})
    return rows


def overview(
    records: Sequence[dict[str, Any]],
    groups: Sequence[tuple[str, int]],
    compressions: Sequence[float],
    methods: Sequence[str],
) -> list[dict[str, Any]]:
    """One row per compression and method over every task and length at once (the samples pooled; ``tasks``: how
    many of ``groups`` contributed)."""
    found = _found(records)
    rows = (_paired(found, groups, c, method) for c, method in _wanted(compressions, methods))
    return [row for row in rows if row is not None]


def hosts(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Each host the records were answered on (:func:`kvsieve.provenance.host`) → how many answers, most first."""
    from kvsieve.provenance import host

    return dict(collections.Counter(host(r["cpu"]) for r in records).most_common())


def differing(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answers of a kvsieve spec and of its press that differ on a sample (in the order of ``records``): task,
    length, index, compression, the kvsieve spec, both answers."""
    kvpress = {}
    for r in records:
        k = r["key"]
        if k["side"] == "kvpress":
            kvpress[k["task"], k["length"], k["index"], k["compression"], k["method"]] = r
    out = []
    for r in records:
        k = r["key"]
        if k["side"] != "kvsieve":
            continue
        other = kvpress.get((k["task"], k["length"], k["index"], k["compression"], METHODS[k["method"]]))
        if other is not None and other["answer"] != r["answer"]:
            where = {key: k[key] for key in ("task", "length", "index", "compression")}
            out.append(where | {"method": k["method"], "kvsieve": r["answer"], "kvpress": other["answer"]})
    return out


COLUMNS = (
    "kvsieve",
    "kvpress",
    "c",
    "score kvsieve",
    "score kvpress",
    "same answer",
    "s / sample",
    "peak RSS MiB",
    "RSS rise MiB",
    "kept",
    "ids",
)


def _pair(row: dict[str, Any], fmt: Callable[[dict[str, Any]], str]) -> str:
    s, p = row["kvsieve"], row["kvpress"]
    return f"{fmt(s) if s else '—'} / {fmt(p)}"


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The table's cells (one list per row, as ``COLUMNS``)."""
    from kvsieve.ruler.scoring import plus_minus

    cells = []
    for row in rows:
        score = {side: row[side] and plus_minus(row[side]["score"], row[side]["stderr"]) for side in SIDES}
        same = "—" if row["same_answer"] is None else f"{row['same_answer']:.0%} of {row['samples']}"
        ids = "same" if row["same_ids"] else "DIFFER"
        if not row["pipeline_ids"]:
            ids += " (pipeline's own ids differ)"
        cells.append(
            [
                f"`{row['kvsieve_spec']}`" if row["kvsieve_spec"] else "—",
                row["press"],
                f"{row['compression']:g}" if row["compression"] else "—",
                score["kvsieve"] or "—",
                score["kvpress"],
                same,
                _pair(row, lambda x: f"{x['seconds']:.1f}"),
                _pair(row, lambda x: _mib(x["rss_peak_mib"])),
                _pair(row, lambda x: _mib(x["rss_rise_mib"])),
                _pair(row, lambda x: f"{x['kept']:g}"),
                ids,
            ]
        )
    return cells


def _table(rows: Sequence[dict[str, Any]]) -> list[str]:
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] + [
        "| " + " | ".join(c) + " |" for c in table_rows(rows)
    ]


def markdown(result: dict[str, Any]) -> str:
    """The report: a header (with the hosts), the table over all tasks where there are several, then per task and
    length its table (and the full cache's score from the ruler run's cells, if any), then the answers that
    differ."""
    from kvsieve.provenance import answered_on
    from kvsieve.ruler.scoring import plus_minus

    versions = "; ".join(", ".join(f"{k} {v}" for k, v in result["versions"][s].items()) for s in SIDES)
    mode = "both sides at once" if result["parallel"] else "one side at a time"
    lines = [
        "# kvsieve vs kvpress on RULER (question-agnostic)",
        "",
        f"Model `{result['model']}`, fp32, {result['threads']} thread(s) a side, {mode}; samples from "
        f"`{result['ruler_out']}`; git `{result['git']}`; {versions}.",
        f"Answered on {answered_on(result['hosts'])}.",
        "Scores in % (± standard error); kvsieve / kvpress in the paired columns; `kept`: context tokens kept (mean).",
    ]
    rows = result["rows"]
    groups = dict.fromkeys((r["task"], r["length"]) for r in rows)
    if len(groups) > 1:
        lines += ["", f"## All {len(groups)} tasks and lengths (their samples pooled)", "", *_table(result["overview"])]
    for task, length in groups:
        mine = [r for r in rows if (r["task"], r["length"]) == (task, length)]
        ceiling = result["full_cache"].get(f"{task}_{length}")
        note = f"; full cache in the ruler run: {plus_minus(ceiling['score'], ceiling['stderr'])}" if ceiling else ""
        n = max(r["samples"] for r in mine)
        lines += ["", f"## {task}, {length} tokens ({n} sample{'s' * (n != 1)}{note})", "", *_table(mine)]
    differ = result["differing"]
    if differ:
        lines += ["", f"## Answers that differ ({len(differ)})", ""]
        lines += [
            f"- {d['task']}_{d['length']} #{d['index']} c={d['compression']:g} `{d['method']}`: "
            f"kvsieve “{d['kvsieve']}” · kvpress “{d['kvpress']}”"
            for d in differ[:DIFFERING_SHOWN]
        ]
        if len(differ) > DIFFERING_SHOWN:
            lines.append(f"- … {len(differ) - DIFFERING_SHOWN} more in the JSON")
    return "\n".join(lines)


def full_cache(ruler_out: Path, records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``<task>_<length>`` → the full cache's score in the ruler run (``cells/<task>_<length>_full.json``) over the
    samples answered here, where it was computed for all of them."""
    from kvsieve.ruler.scoring import mean_and_stderr

    asked: dict[str, set[int]] = {}
    for r in records:
        asked.setdefault(f"{r['key']['task']}_{r['key']['length']}", set()).add(r["key"]["index"])
    out = {}
    for group, indexes in asked.items():
        path = ruler_out / "cells" / f"{group}_full.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            predictions = json.loads(path.read_text())["predictions"]
            if all(str(i) in predictions for i in indexes):
                mean, stderr = mean_and_stderr([predictions[str(i)]["score"] for i in sorted(indexes)])
                out[group] = {"score": mean, "stderr": stderr, "samples": len(indexes)}
    return out


# --- the run ----------------------------------------------------------------------------------------------------


def run(settings: Settings, items: Sequence[Item], command: Sequence[str]) -> dict[str, Any]:
    """Every item × compression × method not stored yet on both sides; the result (its provenance, settings,
    versions, hosts, records, rows per task and over all tasks). ``command``: the arguments it was run with."""
    from tqdm import tqdm

    from kvsieve.provenance import cpu, provenance

    here = cpu()

    if settings.build_venv and not venv_ready(settings.venv):
        build_venv(settings.venv)
    settings.out.mkdir(parents=True, exist_ok=True)
    path = settings.out / "records.jsonl"
    stored = load_records(path)
    wanted: list[tuple[Item, float, dict[str, list[str]]]] = []
    for item in items:
        for c in settings.compressions:
            todo = {
                side: [
                    m
                    for m in methods
                    if not settings.report
                    and json.dumps(record_key(settings, item, c, side, m), sort_keys=True) not in stored
                ]
                for side, methods in jobs(settings, item, c).items()
            }
            wanted.append((item, c, todo))
    pythons = {"kvsieve": Path(sys.executable), "kvpress": venv_python(settings.venv)}
    start = time.perf_counter()
    with contextlib.ExitStack() as stack, path.open("a") as sink:
        workers = {}
        for side in SIDES:
            setup = {"side": side, "model": str(settings.model), "threads": settings.threads}
            setup["compression_ratio"] = settings.compressions[0]  # (the worker's own commands; unused by ``ruler``)
            log = settings.out / f"{side}_worker.log"
            workers[side] = WorkerProcess(pythons[side], setup, settings.threads, log)
            stack.callback(workers[side].close)
        total = sum(len(q) for *_, todo in wanted for q in todo.values())
        if total:
            warm_up(
                workers,
                items[0],
                settings.compressions[0],
                {s: sorted({m for *_, t in wanted for m in t[s]}) for s in SIDES},
            )
        with tqdm(total=total, desc="kvsieve | kvpress", unit="answer") as bar:
            for n, (item, c, todo) in enumerate(wanted):

                def done(side: str, method: str, reply: dict[str, Any], item: Item = item, c: float = c) -> None:
                    key = record_key(settings, item, c, side, method)
                    record = make_record(key, item, reply, here)
                    stored[json.dumps(key, sort_keys=True)] = record
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    bar.update()

                s = item.sample
                bar.set_postfix_str(f"{s.task}_{s.length} #{s.index} c={c:g}")
                order = SIDES if n % 2 == 0 else SIDES[::-1]
                run_queues(
                    workers, todo, order, settings.parallel, lambda side, m, it=item, c=c: request(it, c, m), done
                )
        versions = {side: workers[side].hello["versions"] for side in SIDES}
    keys = [json.dumps(record_key(settings, item, c, side, m), sort_keys=True) for item, c, _ in wanted
            for side, methods in jobs(settings, item, c).items() for m in methods]  # fmt: skip
    records = [stored[k] for k in keys if k in stored]  # (this run's, in the order asked)
    details = {"model": settings.model_name, "dtype": "float32", "threads": settings.threads}
    return {
        "provenance": provenance(["scripts/kvpress_ruler.py", *command], **details),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
        "model": settings.model_name,
        "ruler_out": str(settings.ruler_out),
        "threads": settings.threads,
        "parallel": settings.parallel,
        "wall_s": time.perf_counter() - start,
        "versions": versions,
        "git": git_head(),
        "full_cache": full_cache(settings.ruler_out, records),
        "hosts": hosts(records),
        "overview": overview(records, settings.groups, settings.compressions, settings.methods),
        "rows": summarize(records, settings.groups, settings.compressions, settings.methods),
        "differing": differing(records),
        "records": records,
    }


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        settings = check_args(parse_args(argv))
        from transformers import AutoTokenizer

        items = plan(settings, AutoTokenizer.from_pretrained(settings.model))
    except ValueError as e:
        sys.exit(f"kvpress_ruler: error: {e}")
    result = run(settings, items, argv)
    report = markdown(result)
    write_report(settings.out, "kvpress_ruler", result, report)
    print(report)
    print(f"written to {settings.out}")


if __name__ == "__main__":
    main()
