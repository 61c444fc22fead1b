"""Everything kvsieve fetches, as named pieces: the built-in models and the data sets.

Each piece is fetched on first use by the code that needs it (``kvsieve compare`` fetches the default model and the
Wikipedia text, nothing else), or ahead of time by ``kvsieve data``, which fetches a selection of pieces, goes on
past a piece that fails, and reports what the cache holds and what it could not get, and why (:func:`fetch`).
Where each piece comes from, and its licence: ``docs/data.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsieve.fetch import FetchError

__all__ = ["DATA_PIECES", "MODEL_PIECES", "Fetched", "fetch", "fetcher", "format_table"]

MODEL_PIECES = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
"""The built-in models (:data:`kvsieve.models.BUILTIN_MODELS`), the default first."""
DATA_PIECES: dict[str, str] = {
    "wikipedia": "106 Wikipedia articles: the text of compare, ppl, bench and the RULER haystacks",
    "reading": "SQuAD passages, questions and answers: the RULER qa task",
    "summaries": "XSum articles with reference summaries: kvsieve xsum and the sweep's xsum task",
    "tasks": "the multiple-choice task pack for lm-eval, sweep and reproduce",
}
"""The data pieces and what needs them."""


def fetcher(name: str) -> Callable[[], Path]:
    """The function that fetches piece ``name`` if the cache lacks it and returns where it is cached; a
    :class:`~kvsieve.fetch.FetchError` of one line if it cannot."""
    if name in MODEL_PIECES:
        from kvsieve.models import ensure_model

        return lambda: ensure_model(name)
    if name == "wikipedia":
        from kvsieve.corpora.wikipedia import ensure_data

        return lambda: ensure_data()["wiki_articles"]
    if name == "reading":
        from kvsieve.corpora.reading import fetch_reading

        return fetch_reading
    if name == "summaries":
        from kvsieve.corpora.xsum import fetch_summaries

        return fetch_summaries
    if name == "tasks":
        from kvsieve.evaluation.tasks import ensure_task_pack

        return ensure_task_pack
    raise ValueError(f"unknown piece {name!r}; pieces: {', '.join((*MODEL_PIECES, *DATA_PIECES))}")


@dataclass(frozen=True)
class Fetched:
    """What became of one piece: where it is cached and its size, or why it could not be fetched."""

    piece: str
    path: str | None
    bytes: int
    seconds: float
    error: str | None = None


def _size(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)


def fetch(names: Sequence[str], progress: Callable[[Iterable[str]], Iterable[str]] = iter) -> list[Fetched]:
    """Fetch each piece of ``names`` the cache lacks, in order, going on past one that fails (its error kept).

    ``progress`` wraps the names as they are fetched (a progress bar). Unknown names are a ``ValueError`` before
    anything is fetched."""
    fetchers = {name: fetcher(name) for name in dict.fromkeys(names)}
    done = []
    for name in progress(list(fetchers)):
        start = time.perf_counter()
        path, error = None, None
        try:
            path = fetchers[name]()
        except (FetchError, OSError) as err:
            error = str(err)
        except ImportError as err:  # (the task pack reads its data with the eval extra's pyarrow)
            error = f"needs the Python package {err.name!r}: pip install 'kvsieve[eval]'"
        seconds = time.perf_counter() - start
        done.append(
            Fetched(name, None, 0, seconds, error) if path is None else Fetched(name, str(path), _size(path), seconds)
        )
    return done


def format_table(rows: Sequence[Fetched]) -> str:
    """The pieces as a table: each with its size and where it is cached, or what went wrong."""
    width = max([len("piece"), *(len(r.piece) for r in rows)])
    lines = [f"{'piece':<{width}}  {'status':<7}  {'size':>9}  where / why"]
    for r in rows:
        if r.error is None:
            lines.append(f"{r.piece:<{width}}  {'ok':<7}  {r.bytes / 2**20:>7.1f}MB  {r.path}")
        else:
            lines.append(f"{r.piece:<{width}}  {'MISSING':<7}  {'-':>9}  {r.error}")
    missing = sum(r.error is not None for r in rows)
    held = f"{len(rows) - missing} of {len(rows)} piece(s) in the cache"
    lines.append(held + (f", {missing} missing" if missing else ""))
    return "\n".join(lines)
