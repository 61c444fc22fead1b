"""Text for kvsieve's commands: local text files, and the built-in Wikipedia corpus.

The corpus lives in :mod:`kvsieve.corpora.wikipedia`; its public names are re-exported here.
"""

from __future__ import annotations

from pathlib import Path

from kvsieve.corpora.wikipedia import (
    Article,
    builtin_text,
    ensure_data,
    load_articles,
    longest_article,
    strip_wiki_markup,
)

__all__ = [
    "Article",
    "builtin_text",
    "ensure_data",
    "load_articles",
    "longest_article",
    "read_text",
    "strip_wiki_markup",
]


def read_text(path: str | Path) -> str:
    """Read a local text file as UTF-8 (undecodable bytes replaced).

    Raises ``FileNotFoundError`` if ``path`` does not exist (or is not a file) and ``ValueError`` if the
    file is empty or only whitespace.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        kind = "is a directory, not a text file" if p.is_dir() else "does not exist"
        raise FileNotFoundError(f"text file not found: {str(p)!r} {kind}")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file is empty: {str(p)!r}")
    return text
