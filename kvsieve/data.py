"""Built-in real text: 106 full English Wikipedia articles, converted from wiki markup to plain prose.

The articles come from a shortened MediaWiki XML dump (``enwiki-latest-pages-articles1.xml-...-shortened``)
shipped as test data inside the ``gensim==4.4.0`` wheel. The wheel is fetched once with ``pip download
--no-deps`` (gensim is never installed), the dump is extracted into ``cache_dir()/"data"``, and the processed
articles are cached there as JSON lines, so later loads are instant and work offline.

Output format of :func:`strip_wiki_markup`: plain paragraphs separated by one blank line. Section headings
are kept as a line of their own (plain text, no ``=`` markers) because they carry meaning for a reader and a
language model; headings of sections that end up empty are dropped. List items keep one line each. Everything
from the first "References" / "See also" / "External links" / "Further reading" / "Notes" / ... heading on
is cut, since those sections are lists of citations and links rather than prose.
"""

from __future__ import annotations

import bz2
import calendar
import html
import json
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvsieve.fetch import FetchError, cache_dir, fetch_members

__all__ = [
    "Article",
    "builtin_text",
    "ensure_data",
    "load_articles",
    "longest_article",
    "read_text",
    "strip_wiki_markup",
]

WIKI_REQUIREMENT = "gensim==4.4.0"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
DUMP_NAME = "enwiki-gensim.xml.bz2"
ARTICLES_NAME = "wiki_articles.jsonl"
# Bump whenever strip_wiki_markup changes output, so stale caches are rebuilt.
FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------------------
# Wiki markup -> plain text
# --------------------------------------------------------------------------------------------------------

# Sections from which on an article is only citations, link lists and navigation.
_CUT_SECTIONS = {
    "references",
    "external links",
    "see also",
    "further reading",
    "notes",
    "footnotes",
    "citations",
    "bibliography",
    "sources",
    "works cited",
    "notes and references",
    "references and notes",
    "external references",
    "other reading",
}
_HEADING_RE = re.compile(r"^[ \t]*(={1,6})[ \t]*(.+?)[ \t]*\1[ \t]*$", re.M)

# Elements removed together with their content (<ref> is handled the same way).
_DROP_ELEMENTS = (
    "ref",
    "references",
    "gallery",
    "math",
    "chem",
    "ce",
    "timeline",
    "syntaxhighlight",
    "source",
    "score",
    "imagemap",
    "graph",
    "hiero",
    "mapframe",
    "maplink",
    "categorytree",
    "templatedata",
    "templatestyles",
    "inputbox",
    "pre",
)
_DROP_OPEN_RE = re.compile(r"<(" + "|".join(_DROP_ELEMENTS) + r")\b([^<>]*?)(/?)>", re.I)
# Tags removed while their inner text is kept (and <br> etc., which have no content).
_KEEP_TAGS = (
    "sub|sup|small|big|span|div|center|blockquote|poem|abbr|s|u|i|b|em|strong|code|tt|font|cite|q|var|kbd|"
    "samp|del|ins|mark|strike|dfn|bdi|bdo|p|li|ul|ol|dl|dt|dd|hr|br|wbr|onlyinclude|noinclude|"
    "includeonly|section|table|tr|td|th|caption|time|data|ruby|rb|rt|rp"
)
_TAG_RE = re.compile(r"</?(" + _KEEP_TAGS + r")\b[^<>]*?/?>", re.I)
_BR_RE = re.compile(r"<br\b[^<>]*>", re.I)
_NOWIKI_RE = re.compile(r"<nowiki\s*/>|<nowiki\s*>(.*?)</nowiki\s*>", re.I | re.S)

_BRACE_TOKEN_RE = re.compile(r"\{\{|\}\}|^[ \t]*\{\||^[ \t]*\|\}(?!\})", re.M)
_LINK_TOKEN_RE = re.compile(r"\[\[|\]\]")
_EXT_LINK_RE = re.compile(r"\[(?:[a-z+.-]+:)?//[^\s\[\]<>\"]+(?:[ \t]+([^\]\n]*))?\]", re.I)
_MAGIC_RE = re.compile(r"__[A-Z]+__")
_QUOTES_RE = re.compile(r"'{2,}")
_LIST_MARK_RE = re.compile(r"^[ \t]*[*#:;]+[ \t]*", re.M)
_SPACES_RE = re.compile(r"[ \t\u00a0\u2009\u202f\u200a\u2002\u2003]+")
_EMPTY_PARENS_RE = re.compile(r"\(\s*[,;:]?\s*\)|\[\s*\]")
_OPEN_PAREN_PUNCT_RE = re.compile(r"\(\s*(?:[,;:]\s*)+")
_PUNCT_PAREN_CLOSE_RE = re.compile(r"(?:\s*[,;:])+\s*\)")
_SPACE_BEFORE_PUNCT_RE = re.compile(r" +([,.;:!?)\]])")
_DOUBLE_PUNCT_RE = re.compile(r"([,;])(?:\s*[,;])+")
_NAMED_ARG_RE = re.compile(r"\s*([\w-]+(?: [\w-]+)*)\s*=")
_ALNUM_RE = re.compile(r"[^\W_]")
_ARG_TOKEN_RE = re.compile(r"\[\[|\]\]|\|")
_STRAY_RE = re.compile(r"\{\{|\}\}|\[\[|\]\]")
_LANG_CODE_RE = re.compile(r"[a-z]{2,3}(?:-[a-z]+)*")
_DROP_NAMESPACES = {"file", "image", "category", "media"}

# Placeholders protecting <nowiki> content from further parsing (Unicode private use area).
_NOWIKI_CHARS = "[]{}|'<>=*#:;_&"
_NOWIKI_HIDE = str.maketrans({c: chr(0xF000 + i) for i, c in enumerate(_NOWIKI_CHARS)})
_NOWIKI_SHOW = str.maketrans({chr(0xF000 + i): c for i, c in enumerate(_NOWIKI_CHARS)})

_HEAD = "\x01"  # marks a heading line during post-processing: "\x01<level>\x01<text>"

_UNIT_NAMES = {
    "km2": "km²",
    "m2": "m²",
    "sqmi": "sq mi",
    "sqft": "sq ft",
    "C": "°C",
    "F": "°F",
    "K": "K",
    "km/h": "km/h",
    "mph": "mph",
    "m3": "m³",
    "cuft": "cu ft",
}
_UNIT_SCALES = {"e3": "thousand", "e6": "million", "e9": "billion"}
_RANGE_WORDS = {"-", "–", "to", "and", "or", "by", "x", "×", "+", "to(-)", "and(-)", "+/-", "±"}
_SIMPLE_CHARS = {
    "'": "'",
    "''": "",
    "·": " · ",
    "dot": " · ",
    "middot": " · ",
    "•": " • ",
    "ndash": "–",
    "mdash": "—",
    "snd": " – ",
    "spnd": " – ",
    "spaced ndash": " – ",
    "spaced en dash": " – ",
    "spd": " – ",
    "en dash": "–",
    "em dash": "—",
    "nbsp": " ",
    "thinsp": " ",
    "-": "",
    "!": "|",
    "=": "=",
}
# Inline templates whose (first / last / joined) positional argument is text that belongs to the sentence.
_FIRST_ARG = {
    "nowrap",
    "nobr",
    "small",
    "smaller",
    "big",
    "larger",
    "large",
    "resize",
    "sc",
    "smallcaps",
    "small caps",
    "em",
    "strong",
    "abbr",
    "flag",
    "flagcountry",
    "flagu",
    "nihongo",
    "vanchor",
    "anchor",
    "mvar",
    "math",
    "sub",
    "sup",
    "keypress",
    "ipa",
    "visible anchor",
    "not a typo",
    "sic",
    "nastaliq",
    "script",
    "linktext",
    "var",
    "code",
    "tt",
    "mono",
    "center",
    "bigger",
    "highlight",
    "underline",
    "uline",
    "strikethrough",
    "s",
    "nowrap begin",
    "ill",
    "interlanguage link",
    "interlanguage link multi",
    "proper name",
    "ship",
}
_LAST_ARG = {"lang", "transl", "transliteration", "lang-rtl", "rtl-lang"}
_JOIN_ARGS = {"chem", "chem2", "hlist", "flatlist", "plainlist", "unbulleted list", "ubl", "bulleted list"}
_QUOTE_TEMPLATES = {"quote", "blockquote", "cquote", "quotation", "quote box"}
_MONTHS = {str(i) for i in range(1, 13)} | {f"{i:02d}" for i in range(1, 10)}
_RENDERED = _FIRST_ARG | _LAST_ARG | _JOIN_ARGS | _QUOTE_TEMPLATES
_RENDERED |= {"convert", "cvt", "as of", "asof", "circa", "c.", "frac", "val", "angbr", "angle bracket"}


def strip_wiki_markup(text: str) -> str:
    """Convert MediaWiki markup to plain prose: paragraphs separated by one blank line.

    Templates, tables, references, files/categories, HTML comments and markup are removed; links become
    their label; headings become a plain line; sections from "References"/"See also"/... on are cut.
    A few inline templates that carry sentence text (``convert``, ``lang``, ``nowrap``, dashes ...) are
    rendered to their text. Nesting is handled with explicit stacks, so the cost is linear in the input.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _cut_trailing_sections(text)
    text = _remove_comments(text)
    text = _NOWIKI_RE.sub(lambda m: (m.group(1) or "").translate(_NOWIKI_HIDE), text)
    text = _drop_elements(text)
    text = _replace_templates_and_tables(text)
    text = _replace_links(text)
    text = _EXT_LINK_RE.sub(lambda m: m.group(1) or "", text)
    text = _BR_RE.sub("\n", text)
    text = _TAG_RE.sub("", text)
    text = _MAGIC_RE.sub("", text)
    text = _QUOTES_RE.sub(_quote_run, text)
    text = _STRAY_RE.sub("", text)
    text = _HEADING_RE.sub(lambda m: f"\n{_HEAD}{len(m.group(1))}{_HEAD}{m.group(2)}\n", text)
    text = _LIST_MARK_RE.sub("", text)
    text = html.unescape(text).translate(_NOWIKI_SHOW)
    return _assemble(text)


def _quote_run(m: re.Match[str]) -> str:
    """Bold/italic markers vanish; four quotes after a letter are an apostrophe plus bold, as in MediaWiki."""
    start = m.start()
    return "'" if len(m.group()) == 4 and start and m.string[start - 1].isalnum() else ""


def _cut_trailing_sections(text: str) -> str:
    for m in _HEADING_RE.finditer(text):
        title = _QUOTES_RE.sub("", m.group(2)).strip().lower()
        if title in _CUT_SECTIONS:
            return text[: m.start()]
    return text


def _remove_comments(text: str) -> str:
    out: list[str] = []
    pos = 0
    while (start := text.find("<!--", pos)) != -1:
        out.append(text[pos:start])
        end = text.find("-->", start + 4)
        if end == -1:  # MediaWiki: an unterminated comment runs to the end of the page
            pos = len(text)
            break
        pos = end + 3
    out.append(text[pos:])
    return "".join(out)


def _drop_elements(text: str) -> str:
    """Remove ``<ref>``, ``<math>``, ``<gallery>``, ... elements with their content (not nested)."""
    out: list[str] = []
    pos = 0
    closers: dict[str, re.Pattern[str]] = {}
    while m := _DROP_OPEN_RE.search(text, pos):
        out.append(text[pos : m.start()])
        pos = m.end()
        if m.group(3) or m.group(2).rstrip().endswith("/"):  # self-closing, e.g. <ref name="x" />
            continue
        name = m.group(1).lower()
        closer = closers.setdefault(name, re.compile(rf"</{name}\s*>", re.I))
        if end := closer.search(text, pos):
            pos = end.end()
        # An unclosed element: drop only the opening tag rather than the rest of the article.
    out.append(text[pos:])
    return "".join(out)


def _replace_templates_and_tables(text: str) -> str:
    """Remove tables ``{| ... |}`` and templates ``{{ ... }}`` (nested), rendering a few inline templates."""
    stack: list[tuple[str, list[str]]] = [("", [])]  # (opening token, pieces)
    pos = 0
    for m in _BRACE_TOKEN_RE.finditer(text):
        token = m.group().strip()
        stack[-1][1].append(text[pos : m.start()])
        pos = m.end()
        if token in ("{{", "{|"):
            stack.append((token, []))
            continue
        opener = "{{" if token == "}}" else "{|"
        depth = next((i for i in range(len(stack) - 1, 0, -1) if stack[i][0] == opener), 0)
        if depth == 0:  # a closer without opener: keep it as text (cleaned up later)
            stack[-1][1].append(token if token == "}}" else "")
            continue
        while len(stack) > depth + 1:  # unclosed openers inside the closed construct: fold them in
            inner_open, inner = stack.pop()
            stack[-1][1].append(inner_open + "".join(inner))
        _, pieces = stack.pop()
        stack[-1][1].append(_render_template("".join(pieces)) if opener == "{{" else "\n")
    stack[-1][1].append(text[pos:])
    while len(stack) > 1:  # unclosed at the end of the text: keep as text
        inner_open, inner = stack.pop()
        stack[-1][1].append(inner_open + "".join(inner))
    return "".join(stack[0][1])


def _split_args(body: str) -> list[str]:
    """Split a template body on ``|`` outside ``[[...]]`` links."""
    parts: list[str] = []
    depth = 0
    start = 0
    for m in _ARG_TOKEN_RE.finditer(body):
        token = m.group()
        if token == "[[":
            depth += 1
        elif token == "]]":
            depth = max(depth - 1, 0)
        elif depth == 0:
            parts.append(body[start : m.start()])
            start = m.end()
    parts.append(body[start:])
    return parts


def _render_template(body: str) -> str:
    """The plain text of an inline template (most templates render to nothing)."""
    name, _, rest = body.partition("|")
    key = name.strip().replace("_", " ").lower().removeprefix("template:")
    if not rest:
        return _SIMPLE_CHARS.get(key, "")
    if key not in _RENDERED and not key.startswith("lang-"):
        return ""
    numbered: dict[int, str] = {}  # MediaWiki numbering: unnamed args count 1, 2, ...; "2=x" sets one
    named: dict[str, str] = {}
    unnamed = 0
    for arg in _split_args(rest):
        if m := _NAMED_ARG_RE.match(arg):
            arg_name, value = m.group(1).lower(), arg[m.end() :].strip()
            if arg_name.isdigit():
                numbered[int(arg_name)] = value
            else:
                named[arg_name] = value
        else:
            unnamed += 1
            numbered[unnamed] = arg.strip()
    args = [numbered[i] for i in sorted(numbered)]
    first = args[0] if args else ""
    if key in ("convert", "cvt"):
        return _render_convert(args)
    if key in ("as of", "asof"):  # {{as of|2010|5|1}} -> "As of 1 May 2010"
        month = calendar.month_name[int(args[1])] if len(args) > 1 and args[1] in _MONTHS else ""
        date = " ".join(p for p in (args[2] if len(args) > 2 and month else "", month, first) if p)
        return f"{'as of' if named.get('lc') else 'As of'} {date}".strip()
    if key in ("circa", "c."):
        return f"c. {first}".strip()
    if key == "frac":
        return " ".join([*args[:-2], "/".join(args[-2:])])
    if key == "val":
        return " ".join(p for p in (first, named.get("u", "")) if p)
    if key in ("angbr", "angle bracket"):
        return f"⟨{first}⟩"
    if key in _JOIN_ARGS:
        return ("" if key.startswith("chem") else ", ").join(args)
    if key in _QUOTE_TEMPLATES:  # block quotations become paragraphs of their own
        return f"\n{named.get('text', first)}\n"
    if key in _LAST_ARG:
        return args[-1] if len(args) > 1 else ""
    return first  # _FIRST_ARG and {{lang-xx|text}}


def _render_convert(args: list[str]) -> str:
    if not args:
        return ""
    if len(args) >= 4 and args[1] in _RANGE_WORDS:
        sep = "–" if args[1] in ("-", "–", "to(-)", "and(-)") else f" {args[1]} "
        value, unit = f"{args[0]}{sep}{args[2]}", args[3]
    else:
        value, unit = args[0], args[1] if len(args) > 1 else ""
    if unit[:2] in _UNIT_SCALES:  # e.g. "e6acre" = million acres
        unit = f"{_UNIT_SCALES[unit[:2]]} {_UNIT_NAMES.get(unit[2:], unit[2:])}"
    unit = _UNIT_NAMES.get(unit, unit)
    return f"{value} {unit}".strip()


def _replace_links(text: str) -> str:
    """Replace ``[[target|label]]`` by its label; drop files, categories and interlanguage links (nested)."""
    stack: list[list[str]] = [[]]
    pos = 0
    for m in _LINK_TOKEN_RE.finditer(text):
        stack[-1].append(text[pos : m.start()])
        pos = m.end()
        if m.group() == "[[":
            stack.append([])
        elif len(stack) > 1:
            inner = "".join(stack.pop())
            stack[-1].append(_render_link(inner))
        # else: a stray "]]" is dropped
    stack[-1].append(text[pos:])
    while len(stack) > 1:  # unclosed "[[": keep the text, drop the brackets
        inner = "".join(stack.pop())
        stack[-1].append(inner)
    return "".join(stack[0])


def _render_link(inner: str) -> str:
    target, pipe, label = inner.partition("|")
    target = target.strip()
    prefix, colon, _ = target.partition(":")
    if colon and not target.startswith(":"):
        ns = prefix.strip().lower()
        if ns in _DROP_NAMESPACES:
            return ""
        if not pipe and _LANG_CODE_RE.fullmatch(prefix.strip()):  # interlanguage, e.g. [[de:Anarchismus]]
            return ""
    if pipe:
        label = label.strip()
        if label:
            return label
        # "pipe trick": [[Paris, Texas|]] -> Paris ; [[Pipe (computing)|]] -> Pipe
        target = re.sub(r"\s*\(.*?\)\s*$|,.*$", "", target.lstrip(":").split(":", 1)[-1])
        return target
    target = target.lstrip(":")
    return target[1:] if target.startswith("#") else target


def _assemble(text: str) -> str:
    """Normalise whitespace and punctuation; paragraphs separated by one blank line; drop empty sections."""
    blocks: list[tuple[int, str]] = []  # (heading level or 0 for prose, text)
    para: list[str] = []

    def flush() -> None:
        if para:
            blocks.append((0, "\n".join(para)))
            para.clear()

    for raw in text.split("\n"):
        line = _SPACES_RE.sub(" ", raw).strip()
        if line.startswith(_HEAD):
            flush()
            _, level, title = line.split(_HEAD, 2)
            blocks.append((int(level), _clean_line(title)))
            continue
        line = _clean_line(line)
        if not _ALNUM_RE.search(line) or (line.startswith(("|", "!")) and "|" in line[1:]):
            flush()  # blank line, punctuation left over from removed formulas, or a row of a broken table
            continue
        para.append(line)
    flush()
    kept: list[str] = []
    next_level = 1  # level of the block after the current one (prose counts as deeper than any heading)
    for level, content in reversed(blocks):
        if level and (next_level <= level or not content):
            continue  # a heading whose section is empty
        kept.append(content)
        next_level = level if level else 99
    return "\n\n".join(reversed(kept))


def _clean_line(line: str) -> str:
    line = _SPACES_RE.sub(" ", line)
    line = _OPEN_PAREN_PUNCT_RE.sub("(", line)
    line = _PUNCT_PAREN_CLOSE_RE.sub(")", line)
    line = _EMPTY_PARENS_RE.sub("", line)
    line = _DOUBLE_PUNCT_RE.sub(r"\1", line)
    line = _SPACE_BEFORE_PUNCT_RE.sub(r"\1", line)
    return _SPACES_RE.sub(" ", line).strip()


# --------------------------------------------------------------------------------------------------------
# Articles
# --------------------------------------------------------------------------------------------------------


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
        fetch_members(WIKI_REQUIREMENT, {WIKI_MEMBER: target})
    except FetchError as exc:
        raise FetchError(
            f"kvsieve's built-in Wikipedia text is not cached at {target} and could not be fetched from the "
            f"{WIKI_REQUIREMENT} wheel on PyPI. Run `kvsieve data` once with access to PyPI "
            f"(or set KVSIEVE_CACHE to a cache that has it). Cause: {exc}"
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
    header = {"format_version": FORMAT_VERSION, "source": f"{WIKI_REQUIREMENT}:{WIKI_MEMBER}"}
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


def ensure_data() -> dict[str, Path]:
    """Fetch and process all data this module owns; return ``{"wiki_dump": ..., "wiki_articles": ...}``."""
    load_articles()
    return {"wiki_dump": _dump_path(), "wiki_articles": _data_dir() / ARTICLES_NAME}
