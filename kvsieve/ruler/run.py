"""A RULER grid: tasks × lengths × (protocol, policy, compression), answered sample by sample, resumable. How a
sample is answered under its settings, and what the compressions and protocols are: :mod:`kvsieve.ruler.predict`.

**Files** in ``OUT``: ``samples/<task>_<length>.jsonl`` (the generated samples, so that another tool can be fed the
identical prompts), ``cells/<task>_<length>_<setting>.json`` (each sample's answer, score and timings, with the
settings they were computed with: a cell computed with other settings is computed again), and the report
(:mod:`kvsieve.ruler.report`). The samples are taken in turn — the first sample of every task, then the second of each,
… — every setting of a sample from one prompt pass, the next sample's answers joining the batch while a sample's
longest answers finish (:func:`~kvsieve.ruler.predict.answers`), and a cell file is rewritten as each answer ends: an
interrupted run loses only the answers still being decoded and a rerun computes only what is missing. Runs
whose tasks or lengths do not overlap can share ``OUT`` at once: each ``(task, length)`` has files of its own, each
written whole (a temporary file renamed).

**On Ray** (``kvsieve ruler --ray [ADDRESS]``; :mod:`kvsieve.evaluation.ray_sweep` for the options and the cluster):
this process makes or reads the samples and their prompt tokens, then each sample with settings still to answer is one
task that answers it under those settings (:func:`~kvsieve.ruler.predict.answer`: as in this process, but without
the next sample's answers joining its batch) and returns its answers; this process writes them into the cell files as
the tasks finish. A worker loads the grid's model (``grid.model``: a built-in name or a local directory, which the
nodes need as for a sweep) in ``grid.dtype`` once per process. A sample whose task still fails after its retries
stores nothing (a rerun computes it): the others are written, then :class:`SamplesFailed` names the failed ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.evaluation.defaults import QUESTION_MODES
from kvsieve.policies import REGISTRY, get_policy
from kvsieve.ruler.predict import FULL, Setting, Unit, answer, answers
from kvsieve.ruler.tasks import (
    GENERATOR,
    TASKS,
    Prompter,
    Sample,
    Sources,
    generate_samples,
    load_samples,
    sentences,
    vocabulary,
)

if TYPE_CHECKING:
    from kvsieve.evaluation.ray_sweep import RayOptions

__all__ = [
    "GridSettings",
    "SamplesFailed",
    "default_policies",
    "grid_settings",
    "haystack_name",
    "run_ruler",
    "sources",
]

DEFAULT_COMPRESSIONS = (0.25, 0.5, 0.75, 0.9)
DEFAULT_LENGTHS = (4096,)
DEFAULT_SAMPLES = 25
QUICK: dict[str, Any] = {
    "lengths": (1024,),
    "samples": 2,
    "policies": ("full", "h2o", "snapkv", "streaming_llm"),
    "compressions": (0.5,),
}
"""``kvsieve ruler --quick``: a small grid, minutes on the default model."""


def default_policies() -> list[str]:
    """Every registered policy but the references that save no memory and take a budget (``topk_oracle``, an
    oracle that keeps every token and narrows each query's attention to its budget: give it by name)."""
    return [name for name, policy in REGISTRY.items() if policy.bounded or not policy.takes_budget()]


def sources(file: str | Path | None = None, with_reading: bool = True, generator: int = GENERATOR) -> Sources:
    """The samples' sources: the essay haystack from ``file`` (default: the built-in Wikipedia articles), the
    vocabulary of the built-in articles, and (``with_reading``) the reading items of sample generator ``generator``
    (none for generator 2: BIG-bench squad_shifts can no longer be fetched)."""
    from kvsieve.corpora.reading import reading_items
    from kvsieve.data import load_articles, read_text

    wiki = "\n\n".join(a.text for a in load_articles())
    hay = sentences(read_text(file)) if file else sentences(wiki)
    if not hay:
        raise ValueError(f"{file} holds no sentences to build a haystack from")
    return Sources(hay, vocabulary(wiki), reading_items() if with_reading and generator >= 3 else ())


def haystack_name(file: str | Path | None) -> str:
    """``wikipedia``, or the file's name and the first 16 hex digits of its SHA-256 (what the cells are keyed by)."""
    if not file:
        return "wikipedia"
    from kvsieve.data import read_text

    digest = hashlib.sha256(read_text(file).encode()).hexdigest()[:16]
    return f"{Path(file).name}:{digest}"


def grid_settings(policies: Sequence[str], compressions: Sequence[float], protocols: Sequence[str]) -> list[Setting]:
    """The full cache once (for the policies without a budget: ``full``), then every protocol × policy with a budget
    × compression (``topk_oracle`` too: a budget narrows its attention; question-aware only, since it chooses keys
    knowing each query, the question's too; a policy scored by probes, ``kvzip``: question-agnostic only, since it
    compresses a context before any question; checked: known policies and protocols, compressions in (0, 1))."""
    for protocol in protocols:
        if protocol not in QUESTION_MODES:
            raise ValueError(f"protocol must be one of {', '.join(QUESTION_MODES)}, got {protocol!r}")
    for compression in compressions:
        if not 0.0 < compression < 1.0:
            raise ValueError(f"a compression is a share of tokens dropped, in (0, 1); got {compression}")
    budgeted = [p for p in policies if get_policy(p).takes_budget()]
    narrowing = [p for p in budgeted if get_policy(p).narrows]
    if narrowing and "aware" not in protocols:
        raise ValueError(
            f"{narrowing[0]} chooses keys knowing each query, the question's too: it has question-aware cells only "
            "(add the protocol aware)"
        )
    probed = [p for p in budgeted if get_policy(p).probed]
    if probed and "agnostic" not in protocols:
        raise ValueError(
            f"{probed[0]} compresses a context before the question is known: it has question-agnostic cells only "
            "(add the protocol agnostic)"
        )
    settings = [FULL] if len(budgeted) < len(policies) or not policies else []
    settings += [
        Setting(q, p, c)
        for q in protocols
        for p in budgeted
        for c in compressions
        if (q == "aware" or p not in narrowing) and (q == "agnostic" or p not in probed)
    ]
    return settings


@dataclass(frozen=True)
class GridSettings:
    """What a cell's answers depend on besides the cell: a cell stored with other settings is computed again."""

    model: str
    dtype: str
    seed: int
    haystack: str
    """``wikipedia`` or the text file's name and SHA-256."""
    chat_template: bool = True
    generator: int = GENERATOR
    """The sample generator's version (:data:`~kvsieve.ruler.tasks.GENERATOR`)."""


@functools.lru_cache(maxsize=1)
def _worker_model(name: str, dtype: str, device: str | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A Ray worker's model and tokenizer, loaded once per process (its tasks share them)."""
    from kvsieve.models import load_model

    return load_model(name, device=device, dtype=dtype)


def _sample_task(
    grid: GridSettings,
    device: str | None,
    threads: int,
    sample: Sample,
    prompt: tuple[Sequence[int], Sequence[int]],
    settings: Sequence[Setting],
    kv_memory: int | None = None,
) -> dict[str, dict[str, Any]]:
    """A Ray task: setting key → ``sample``'s answer (see :func:`~kvsieve.ruler.predict.answer`), on the grid's
    model."""
    torch.set_num_threads(threads)
    model, tokenizer = _worker_model(grid.model, grid.dtype, device)
    asking = Prompter(tokenizer, grid.chat_template).asking()
    return {setting.key: p for setting, p in answer(model, tokenizer, sample, prompt, settings, kv_memory, asking)}


class SamplesFailed(RuntimeError):
    """Samples whose Ray task failed after its retries: nothing is stored for them (a rerun computes them)."""

    def __init__(self, failed: Sequence[tuple[Sample, BaseException]]) -> None:
        names = ", ".join(f"{sample.task} {sample.length} #{sample.index}" for sample, _ in failed)
        error = failed[0][1]
        super().__init__(
            f"{len(failed)} sample(s) failed after their retries, nothing stored for them (a rerun computes them): "
            f"{names}; the first error: {type(error).__name__}: {error}"
        )
        self.failed = list(failed)


@dataclass
class _Cell:
    path: Path
    settings: dict[str, Any]
    predictions: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path, settings: dict[str, Any]) -> _Cell:
        """The cell stored at ``path`` if it was computed with ``settings``, else an empty one."""
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls(path, settings)
        if stored.get("settings") != settings:
            return cls(path, settings)
        return cls(path, settings, {int(k): v for k, v in stored["predictions"].items()})

    def write(self) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps({"settings": self.settings, "predictions": self.predictions}, indent=1))
        partial.replace(self.path)


def samples_for(
    out: Path,
    task: str,
    length: int,
    count: int,
    prompter: Prompter,
    sources: Callable[[], Sources],
    grid: GridSettings,
) -> list[Sample]:
    """The samples of ``(task, length)``: generated once and stored in ``out/samples`` with what they depend on (the
    count and the grid's model, seed, haystack and template), read back while that is unchanged."""
    path = out / "samples" / f"{task}_{length}.jsonl"
    stamp = path.with_suffix(".settings.json")
    key = {"count": count, "model": grid.model, "seed": grid.seed, "haystack": grid.haystack}
    key |= {"chat_template": grid.chat_template, "generator": grid.generator}
    if path.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == key:
        return load_samples(path)
    made = generate_samples(task, length, count, prompter, sources(), grid.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s.to_dict(), ensure_ascii=False) + "\n" for s in made))
    stamp.write_text(json.dumps(key))
    return made


def run_ruler(
    model: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    out: str | Path,
    sources: Callable[[], Sources],
    grid: GridSettings,
    tasks: Sequence[str] = tuple(TASKS),
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    settings: Sequence[Setting] = (FULL,),
    samples: int = DEFAULT_SAMPLES,
    progress: bool = True,
    ray: RayOptions | None = None,
    device: str | None = None,
    kv_memory: int | None = None,
) -> Path:
    """Answer every sample of every ``(task, length)`` under every setting not stored yet in ``out`` (see the module
    docstring); the directory. ``sources()`` gives what samples are made of, called once if samples are to be made
    (stored samples need none). ``ray``: answer the samples as Ray tasks on ``grid.model`` loaded on ``device`` by
    each worker (``model`` is unused, may be None); raises :class:`SamplesFailed` after the others are stored if
    samples failed. ``kv_memory``: the bytes the caches of the answers decoded together may hold (see
    :func:`~kvsieve.ruler.predict.answers`; default: half the memory free on the model's device)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; tasks: {', '.join(TASKS)}")
    if samples <= 0 or not lengths or not settings:
        raise ValueError("need at least one length, one setting and one sample")
    out = Path(out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    prompter = Prompter(tokenizer, grid.chat_template)
    sources = functools.cache(sources)
    stored = asdict(grid) | {"samples": samples}
    todo = []
    for task in tasks:
        for length in lengths:
            here = stored | {"task": task, "length": length}
            cells = {s: _Cell.open(out / "cells" / f"{task}_{length}_{s.key}.json", here | asdict(s)) for s in settings}
            todo.append((task, length, cells))

    def units() -> Iterator[tuple[Sample, tuple[list[int], list[int]], dict[Setting, _Cell]]]:
        """Each sample with settings still to answer: the sample, its prompt tokens, the cells lacking it. Sample 0
        of every ``(task, length)``, then sample 1 of each, …: a run cut short covers every task (samples are made or
        read at the start, a ``(task, length)`` at a time)."""
        open_cells = [t for t in todo if not all(len(c.predictions) >= samples for c in t[2].values())]
        made = [samples_for(out, task, length, samples, prompter, sources, grid) for task, length, _ in open_cells]
        for index in range(samples):
            for (_, _, cells), sample in zip(open_cells, (m[index] for m in made), strict=True):
                lacking = {s: c for s, c in cells.items() if sample.index not in c.predictions}
                if lacking:
                    yield sample, prompter.ids(sample.context, sample.question, sample.answer_prefix), lacking

    total = sum(samples - len(c.predictions) for *_, cells in todo for c in cells.values())
    # (answers end in bursts, a sample's short ones together: the time left is estimated from the run's mean rate)
    with tqdm(total=total, desc="ruler", unit="answer", smoothing=0, disable=not progress) as bar:
        if ray is None:
            taken: list[tuple[Sample, dict[Setting, _Cell]]] = []

            def taking() -> Iterator[Unit]:
                for sample, prompt, cells in units():
                    bar.set_postfix_str(f"{sample.task} {sample.length} #{sample.index}")
                    taken.append((sample, cells))
                    yield sample, prompt, list(cells)

            for index, setting, prediction in answers(model, tokenizer, taking(), kv_memory, prompter.asking()):
                sample, cells = taken[index]
                cells[setting].predictions[sample.index] = prediction
                cells[setting].write()
                bar.update()
        else:
            _answer_on_ray(list(units()), grid, device, ray, bar, kv_memory)
    return out


def _answer_on_ray(
    units: Sequence[tuple[Sample, tuple[list[int], list[int]], dict[Setting, _Cell]]],
    grid: GridSettings,
    device: str | None,
    options: RayOptions,
    bar: tqdm,
    kv_memory: int | None = None,
) -> None:
    """Each unit (sample, prompt, cells lacking it) as one Ray task; its answers written into its cells as it
    finishes; :class:`SamplesFailed` at the end if tasks failed."""
    from kvsieve.evaluation import ray_sweep

    if not units:
        return  # (no Ray is started for a complete grid)
    calls = [(grid, device, options.threads, sample, prompt, list(cells), kv_memory) for sample, prompt, cells in units]
    failed: list[tuple[Sample, BaseException]] = []

    def running(n: int) -> None:
        bar.set_postfix(running=n, failed=len(failed))

    with closing(ray_sweep.ray_tasks(_sample_task, calls, options, running)) as finished:
        for index, answers, error in finished:
            sample, _, cells = units[index]
            if error is not None:
                failed.append((sample, error))
                continue
            for setting, cell in cells.items():
                cell.predictions[sample.index] = answers[setting.key]
                cell.write()
            bar.update(len(cells))
    if failed:
        raise SamplesFailed(failed)
