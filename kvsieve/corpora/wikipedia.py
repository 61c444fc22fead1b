"""Built-in real text: 106 full English Wikipedia articles, converted from wiki markup to plain prose.

The articles come from a shortened MediaWiki XML dump (``enwiki-latest-pages-articles1.xml-...-shortened``)
shipped as test data inside the ``gensim==4.4.0`` wheel (one wheel, by its tags and SHA-256, whatever the host). The
wheel is fetched once with ``pip download --no-deps`` (gensim is never installed), the dump is extracted into
``cache_dir()/"data"``, and the processed articles are cached there as JSON lines, so later loads are instant and
work offline. Licence: Wikipedia's text, CC BY-SA (gensim itself is LGPL-2.1).

The markup is turned into prose by :func:`kvsieve.corpora.wikitext.strip_wiki_markup` (``mwparserfromhell``).
"""

from __future__ import annotations

import bz2
import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvsieve.corpora.wikitext import strip_wiki_markup
from kvsieve.fetch import Distribution, FetchError, cache_dir, fetch_members

__all__ = [
    "Article",
    "builtin_text",
    "ensure_data",
    "load_articles",
    "longest_article",
    "strip_wiki_markup",
]

WIKI_WHEEL = Distribution(
    "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
)
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
DUMP_NAME = "enwiki-gensim.xml.bz2"
ARTICLES_NAME = "wiki_articles.jsonl"
# Bump whenever strip_wiki_markup changes its output, so that stale caches are rebuilt.
FORMAT_VERSION = 2


@dataclass(frozen=True)
class Article:
    """One Wikipedia article as plain text."""

    title: str
    text: str


def _data_dir() -> Path:
    return cache_dir() / "data"


def _dump_path() -> Path:
    """The raw bz2 XML dump, fetched from the gensim wheel if it is not cached yet."""
    target = _data_dir() / DUMP_NAME
    if target.exists():
        return target
    try:
        fetch_members(WIKI_WHEEL, {WIKI_MEMBER: target})
    except FetchError as exc:
        raise FetchError(
            f"the built-in Wikipedia text is not cached at {target} and could not be fetched "
            f"(`kvsieve data --only wikipedia` with access to PyPI, or a KVSIEVE_CACHE that has it): {exc}"
        ) from exc
    return target


def _iter_pages(path: Path) -> Iterator[tuple[str, str]]:
    """Yield ``(title, wikitext)`` of the main-namespace, non-redirect pages of a MediaWiki XML dump."""
    with bz2.open(path, "rb") as stream:
        for _, elem in ET.iterparse(stream, events=("end",)):
            if elem.tag.rsplit("}", 1)[-1] != "page":
                continue
            ns_uri = elem.tag[: elem.tag.index("}") + 1] if elem.tag.startswith("{") else ""
            title = elem.findtext(f"{ns_uri}title") or ""
            namespace = (elem.findtext(f"{ns_uri}ns") or "0").strip()
            text = elem.findtext(f"{ns_uri}revision/{ns_uri}text") or ""
            redirect = elem.find(f"{ns_uri}redirect") is not None or text.lstrip()[:9].upper() == "#REDIRECT"
            elem.clear()
            if namespace == "0" and not redirect:
                yield title, text


def _write_atomic(path: Path, data: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(data, encoding="utf-8")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def _read_cache(path: Path) -> list[Article] | None:
    """The cached articles, or None if the cache is missing, stale or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            header = json.loads(f.readline())
            if header.get("format_version") != FORMAT_VERSION:
                return None
            articles = [Article(**json.loads(line)) for line in f if line.strip()]
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return articles if len(articles) == header.get("articles") else None


def _build_cache(path: Path) -> list[Article]:
    dump = _dump_path()
    articles = [Article(title, strip_wiki_markup(wikitext)) for title, wikitext in _iter_pages(dump)]
    header = {"format_version": FORMAT_VERSION, "source": f"{WIKI_WHEEL.requirement}:{WIKI_MEMBER}"}
    header["articles"] = len(articles)
    lines = [json.dumps(header)]
    lines += [json.dumps({"title": a.title, "text": a.text}, ensure_ascii=False) for a in articles]
    _write_atomic(path, "\n".join(lines) + "\n")
    return articles


def load_articles(min_chars: int = 0) -> list[Article]:
    """The built-in Wikipedia articles as plain text in dump order (those with ``len(text) >= min_chars``).

    The first call fetches the dump (if needed) and processes it; the result is cached as JSON lines in
    ``cache_dir()/"data"/"wiki_articles.jsonl"`` (header line first). Raises ``FetchError`` when the dump
    is not cached and PyPI cannot be reached.
    """
    path = _data_dir() / ARTICLES_NAME
    articles = _read_cache(path)
    if articles is None:
        articles = _build_cache(path)
    return [a for a in articles if len(a.text) >= min_chars]


def _format(article: Article) -> str:
    return f"= {article.title} =\n\n{article.text}"


def builtin_text(min_chars: int | None = None) -> str:
    """A deterministic long real text for perplexity runs.

    Without ``min_chars``: all articles in dump order, each as ``"= Title =\\n\\ntext"``, joined with
    ``"\\n\\n"``. With ``min_chars``: the first article (dump order) whose text has at least ``min_chars``
    characters, in the same ``"= Title ="`` format; if none is that long, the full concatenation (which may
    itself be shorter than ``min_chars`` only if ``min_chars`` exceeds the whole corpus).
    """
    articles = load_articles()
    if min_chars is not None:
        for article in articles:
            if len(article.text) >= min_chars:
                return _format(article)
    return "\n\n".join(_format(a) for a in articles)


def longest_article() -> Article:
    """The built-in article with the longest plain text (the first one on ties)."""
    return max(load_articles(), key=lambda a: len(a.text))


def ensure_data() -> dict[str, Path]:
    """Fetch and process all data this module owns; return ``{"wiki_dump": ..., "wiki_articles": ...}``."""
    load_articles()
    return {"wiki_dump": _dump_path(), "wiki_articles": _data_dir() / ARTICLES_NAME}
