"""Wiki markup to plain prose, walking the node tree ``mwparserfromhell`` parses (:func:`strip_wiki_markup`).

Output format: plain paragraphs separated by one blank line. Section headings are kept as a line of their own
(plain text, no ``=`` markers) because they carry meaning for a reader and a language model; headings of sections
that end up empty are dropped. List items keep one line each. Everything from the first "References" / "See also" /
"External links" / "Further reading" / "Notes" / ... heading on is cut, since those sections are lists of citations
and links rather than prose. Inline templates keep their text; infoboxes, navigation boxes, tables, references,
files and categories go; links become their labels.
"""

from __future__ import annotations

import calendar
import re

import mwparserfromhell
from mwparserfromhell.nodes import (
    Argument,
    Comment,
    ExternalLink,
    Heading,
    HTMLEntity,
    Node,
    Tag,
    Template,
    Text,
    Wikilink,
)
from mwparserfromhell.wikicode import Wikicode

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
# Elements removed together with their content; any other HTML tag leaves its content.
_DROP_ELEMENTS = {
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
}
_DROP_NAMESPACES = {"file", "image", "category", "media"}
_LANG_CODE_RE = re.compile(r"[a-z]{2,3}(?:-[a-z]+)*")
_PIPE_TRICK_RE = re.compile(r"\s*\(.*?\)\s*$|,.*$")
# Left in text by unbalanced markup, or markup the parser leaves to the text: behaviour switches, bold/italic.
_STRAY_RE = re.compile(r"\{\{|\}\}|\[\[|\]\]|__[A-Z]+__")
_QUOTES_RE = re.compile(r"'{2,}")

_SPACES_RE = re.compile(r"[ \t\u00a0\u2009\u202f\u200a\u2002\u2003]+")
_EMPTY_PARENS_RE = re.compile(r"\(\s*[,;:]?\s*\)|\[\s*\]")
_OPEN_PAREN_PUNCT_RE = re.compile(r"\(\s*(?:[,;:]\s*)+")
_PUNCT_PAREN_CLOSE_RE = re.compile(r"(?:\s*[,;:])+\s*\)")
_SPACE_BEFORE_PUNCT_RE = re.compile(r" +([,.;:!?)\]])")
_DOUBLE_PUNCT_RE = re.compile(r"([,;])(?:\s*[,;])+")
_ALNUM_RE = re.compile(r"[^\W_]")

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
# Templates without arguments that stand for a character.
_SIMPLE_CHARS = {
    "'": "'",
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
    rendered to their text.

    Bold/italic quotes are not parsed as tags (``skip_style_tags``): mwparserfromhell loses a ``<ref>``
    holding an unclosed ``''`` and what follows it; runs of quotes are dropped from the text instead.
    """
    code = mwparserfromhell.parse(text.replace("\r\n", "\n").replace("\r", "\n"), skip_style_tags=True)
    for i, node in enumerate(code.nodes):
        if isinstance(node, Heading) and _render(node.title).strip().lower() in _CUT_SECTIONS:
            del code.nodes[i:]
            break
    return _assemble(_render(code))


def _render(code: Wikicode | None) -> str:
    """The plain text of a piece of wikicode."""
    if code is None:
        return ""
    pieces: list[str] = []
    line_start = True
    for node in code.nodes:
        definition = isinstance(node, Tag) and node.wiki_markup == ":" and not line_start
        piece = ":" if definition else _render_node(node)  # "; term : definition" keeps its colon
        if piece:
            line_start = piece.endswith("\n")
        pieces.append(piece)
    return "".join(pieces)


def _render_node(node: Node) -> str:
    match node:
        case Text():
            return _QUOTES_RE.sub(_quote_run, _STRAY_RE.sub("", node.value))
        case Wikilink():
            return _render_link(node)
        case ExternalLink(brackets=True):
            return _render(node.title).lstrip()
        case ExternalLink():  # a bare URL stays
            return str(node.url)
        case Template():
            return _render_template(node)
        case Tag():
            return _render_tag(node)
        case Heading():
            return f"\n{_HEAD}{node.level}{_HEAD}{_render(node.title)}\n"
        case HTMLEntity():
            return node.normalize()
        case Argument():
            return _render(node.default)
        case Comment():
            return ""
    raise TypeError(f"unexpected wikicode node {type(node).__name__}")


def _quote_run(m: re.Match[str]) -> str:
    """Bold/italic markers vanish; four quotes after a letter are an apostrophe plus bold, as in MediaWiki."""
    start = m.start()
    return "'" if len(m.group()) == 4 and start and m.string[start - 1].isalnum() else ""


def _render_tag(node: Tag) -> str:
    name = str(node.tag).strip().lower()
    if node.wiki_markup:  # a table "{| ... |}" ends the paragraph; list markers and "----" vanish
        return "\n" if name == "table" else ""
    if name in _DROP_ELEMENTS:
        return ""
    if name == "br":
        return "\n"
    if name == "nowiki":
        return str(node.contents or "")
    return _render(node.contents)


def _render_link(node: Wikilink) -> str:
    """``[[target|label]]`` -> label; files, categories and interlanguage links vanish."""
    target = _render(node.title).strip()
    prefix, colon, _ = target.partition(":")
    if colon and not target.startswith(":"):
        if prefix.strip().lower() in _DROP_NAMESPACES:
            return ""
        if node.text is None and _LANG_CODE_RE.fullmatch(prefix.strip()):  # e.g. [[de:Anarchismus]]
            return ""
    if node.text is not None:
        if label := _render(node.text).strip():
            return label
        # "pipe trick": [[Paris, Texas|]] -> Paris ; [[Pipe (computing)|]] -> Pipe
        return _PIPE_TRICK_RE.sub("", target.lstrip(":").split(":", 1)[-1])
    target = target.lstrip(":")
    return target[1:] if target.startswith("#") else target


def _render_template(node: Template) -> str:
    """The plain text of an inline template (most templates render to nothing)."""
    key = _render(node.name).strip().replace("_", " ").lower().removeprefix("template:")
    if not node.params:
        return _SIMPLE_CHARS.get(key, "")
    if key not in _RENDERED and not key.startswith("lang-"):
        return ""
    numbered: dict[int, str] = {}  # MediaWiki numbering: unnamed args count 1, 2, ...; "2=x" sets one
    named: dict[str, str] = {}
    for param in node.params:
        name, value = _render(param.name).strip().lower(), _render(param.value).strip()
        if name.isdigit():
            numbered[int(name)] = value
        else:
            named[name] = value
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
