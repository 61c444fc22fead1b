"""Tests for kvsieve.corpora.wikipedia (wiki markup to prose, the built-in articles) and kvsieve.data."""

from __future__ import annotations

import bz2
import json
import re

import pytest

from kvsieve import data
from kvsieve.corpora import wikipedia
from kvsieve.corpora.wikipedia import (
    Article,
    builtin_text,
    ensure_data,
    load_articles,
    longest_article,
    strip_wiki_markup,
)
from kvsieve.data import read_text
from kvsieve.fetch import FetchError

# --------------------------------------------------------------------------------------------------------
# strip_wiki_markup: one rule per test, on handwritten snippets
# --------------------------------------------------------------------------------------------------------


def test_nested_templates_and_infobox_are_removed() -> None:
    text = (
        "{{Infobox country\n| name = Foo {{nowrap|bar {{small|baz}}}}\n| capital = [[Qux]]\n"
        "| image = {{Flag|X}}\n}}\n"
        "'''Foo''' is a country.{{citation needed|date=May 2016}} It is small.{{sfn|Smith|2001|p=3}}"
    )
    assert strip_wiki_markup(text) == "Foo is a country. It is small."


def test_unbalanced_braces_do_not_swallow_the_article() -> None:
    out = strip_wiki_markup("First paragraph.}}\n\nSecond {{broken paragraph.\n\nThird paragraph.")
    assert "First paragraph." in out
    assert "Third paragraph." in out
    assert "{{" not in out and "}}" not in out


def test_inline_templates_keep_their_text() -> None:
    out = strip_wiki_markup(
        "It is {{convert|1300|mi|km}} long, called {{lang|fr|la rivière}}, "
        "{{as of|2010|lc=y}} home to {{nowrap|1=E = mc2}} fans{{ndash}}mostly."
    )
    assert out == "It is 1300 mi long, called la rivière, as of 2010 home to E = mc2 fans–mostly."


def test_tables_are_removed_including_nested_tables_and_templates() -> None:
    text = (
        "Before.\n"
        '{| class="wikitable"\n|-\n! Header !! {{abbr|H2|Header two}}\n|-\n| cell ||\n'
        '{| class="inner"\n| inner cell\n|}\n'
        "| after inner\n|}\n"
        "After."
    )
    assert strip_wiki_markup(text) == "Before.\n\nAfter."


def test_template_closing_with_empty_last_parameter_is_not_a_table_end() -> None:
    # "|}}" at a line start closes the template; it is not a table end followed by a stray "}".
    assert strip_wiki_markup("{{Infobox\n| a = b\n|}}\nProse here.") == "Prose here."


def test_refs_are_removed_in_all_forms() -> None:
    text = (
        'Alpha.<ref name="a">{{cite web|url=http://x.org|title=T}}</ref> Beta.<ref name="a" /> '
        "Gamma.<ref>Plain\nmulti-line [[note]].</ref> Delta.<REF group=n>n</REF>\n\n<references />"
    )
    assert strip_wiki_markup(text) == "Alpha. Beta. Gamma. Delta."


def test_comments_and_html_tags() -> None:
    text = (
        "Water is H<sub>2</sub>O<!-- hidden\nmulti-line comment -->, see <span style='x'>this</span>.<br />"
        "Next line<math chem>\\ce{H2O}</math>.\n<gallery>\nFile:A.jpg|caption\n</gallery>\n"
        "Energy <math>E = mc^2</math> is conserved."
    )
    assert strip_wiki_markup(text) == "Water is H2O, see this.\nNext line.\n\nEnergy is conserved."


def test_file_image_and_category_links_with_nested_links_are_removed() -> None:
    text = (
        "[[File:x.jpg|thumb|A [[link]] caption with [[Foo|bar]] and {{small|more}}]]"
        "Text starts here.[[Image:y.png|left|200px|Another [[nested|link]]]]\n"
        "[[Category:Things]] [[de:Dinge]]"
    )
    assert strip_wiki_markup(text) == "Text starts here."


def test_internal_links_become_their_label() -> None:
    text = "A [[target|label]], a [[plain]], [[bus]]es, a [[#Section|jump]], [[:Category:Foo|cat link]]."
    assert strip_wiki_markup(text) == "A label, a plain, buses, a jump, cat link."


def test_external_links() -> None:
    text = "See [http://example.org the site] and [https://example.org/a?b=c]. Visit [//x.org relative one]."
    assert strip_wiki_markup(text) == "See the site and. Visit relative one."


def test_bold_and_italic_quotes_are_removed_but_apostrophes_stay() -> None:
    text = "'''Bold''', ''italic'', '''''both''''' and the author's ''[[Book]]''."
    assert strip_wiki_markup(text) == "Bold, italic, both and the author's Book."


def test_headings_become_plain_lines_and_empty_sections_are_dropped() -> None:
    text = "Lead.\n== History ==\nOld times.\n===Empty sub===\n== Geography ==\n=== Rivers ===\nWet.\n"
    text += "== Empty =="
    assert strip_wiki_markup(text) == "Lead.\n\nHistory\n\nOld times.\n\nGeography\n\nRivers\n\nWet."


@pytest.mark.parametrize("title", ["References", "See also", "External links", "Further reading", "Notes"])
def test_trailing_list_sections_are_cut(title: str) -> None:
    text = f"Prose.\n\n== {title} ==\n* [[Something]]\n== Later ==\nMore.\n[[Category:X]]"
    assert strip_wiki_markup(text) == "Prose."


def test_list_markers_magic_words_and_entities() -> None:
    text = (
        "__NOTOC__\nIntro&nbsp;text &ndash; with &amp; entities&#8212;here.\n"
        "* first item\n** nested item\n# numbered\n: indented\n; term"
    )
    out = strip_wiki_markup(text)
    assert out == "Intro text – with & entities—here.\nfirst item\nnested item\nnumbered\nindented\nterm"


def test_paragraphs_are_separated_by_one_blank_line() -> None:
    text = "First  paragraph   here.\n\n\n\n{{template}}\n\n\nSecond\tparagraph.\n   \n"
    assert strip_wiki_markup(text) == "First paragraph here.\n\nSecond paragraph."


def test_empty_parentheses_left_by_removed_pronunciations_are_cleaned() -> None:
    text = "'''Andorra''' ({{IPAc-en|æ|n}}; {{IPA-ca|ənˈdorə|lang}}), officially the Principality."
    assert strip_wiki_markup(text) == "Andorra, officially the Principality."


def test_definition_lists_keep_the_colon_between_term_and_definition() -> None:
    text = "; Balanced design: equal cells.\n; Blocking : a schedule.\n:; nested: term"
    assert strip_wiki_markup(text) == "Balanced design: equal cells.\nBlocking: a schedule.\nnested: term"


def test_unclosed_italics_inside_a_ref_do_not_leak_the_ref() -> None:
    # Parsed as style tags, the unclosed '' would swallow </ref> and the sentence after it.
    assert strip_wiki_markup("A.<ref>''X.</ref> B ''a'' b.") == "A. B a b."


def test_quotes_next_to_templates_and_tags() -> None:
    text = "''Eagle''{{'}}s ascent, the angle ''θ''<sub>''i''</sub>, the ''[[Republic (Plato)|''Republic'']]''."
    assert strip_wiki_markup(text) == "Eagle's ascent, the angle θi, the Republic."


def test_nowiki_content_is_literal() -> None:
    assert strip_wiki_markup("Type <nowiki>[[not a link]]</nowiki> here.") == "Type [[not a link]] here."


def test_deeply_nested_and_large_input_is_fast() -> None:
    nested = "{{a|" * 2000 + "x" + "}}" * 2000
    assert strip_wiki_markup(f"Start. {nested} End.") == "Start. End."
    # 630 kB in a few seconds (mwparserfromhell builds its node tree in Python, ~10x the old hand parser).
    big = ("Some [[link|text]] with {{tmpl|x}} and ''italics''.<ref>r</ref>\n" * 10_000).strip()
    assert strip_wiki_markup(big).count("Some text with and italics.") == 10_000


# --------------------------------------------------------------------------------------------------------
# Parsing a dump and caching, on a small handwritten dump (offline, temporary cache)
# --------------------------------------------------------------------------------------------------------

_TINY_DUMP = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">
  <siteinfo><sitename>Wikipedia</sitename></siteinfo>
  <page><title>Redirect page</title><ns>0</ns><id>1</id><redirect title="Target" />
    <revision><id>1</id><text xml:space="preserve">#REDIRECT [[Target]]</text></revision></page>
  <page><title>Target</title><ns>0</ns><id>2</id>
    <revision><id>2</id><text xml:space="preserve">'''Target''' is a [[thing|thing]].&lt;ref&gt;x&lt;/ref&gt;
== See also ==
* [[Other]]</text></revision></page>
  <page><title>Wikipedia:Policy</title><ns>4</ns><id>3</id>
    <revision><id>3</id><text xml:space="preserve">Project page.</text></revision></page>
  <page><title>Lowercase redirect</title><ns>0</ns><id>4</id>
    <revision><id>4</id><text xml:space="preserve">#redirect [[Target]]</text></revision></page>
  <page><title>Second</title><ns>0</ns><id>5</id>
    <revision><id>5</id>
      <text xml:space="preserve">A longer second article &amp;nbsp;text.</text></revision></page>
</mediawiki>
"""


@pytest.fixture
def tiny_cache(tmp_path, monkeypatch):
    """A temporary cache holding a tiny dump; fetching is made to fail so nothing goes online."""
    (tmp_path / "data").mkdir()
    with bz2.open(tmp_path / "data" / wikipedia.DUMP_NAME, "wt", encoding="utf-8") as f:
        f.write(_TINY_DUMP)
    monkeypatch.setattr(wikipedia, "cache_dir", lambda: tmp_path)

    def no_fetch(*args, **kwargs):
        raise AssertionError("must not fetch when the dump is cached")

    monkeypatch.setattr(wikipedia, "fetch_members", no_fetch)
    return tmp_path


def test_load_articles_parses_dump_skips_redirects_and_other_namespaces(tiny_cache) -> None:
    articles = load_articles()
    assert articles == [
        Article("Target", "Target is a thing."),
        Article("Second", "A longer second article text."),
    ]
    assert load_articles(min_chars=20) == [articles[1]]


def test_load_articles_writes_a_jsonl_cache_and_reuses_it(tiny_cache) -> None:
    load_articles()
    cache = tiny_cache / "data" / wikipedia.ARTICLES_NAME
    lines = cache.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0])["articles"] == 2
    assert json.loads(lines[1]) == {"title": "Target", "text": "Target is a thing."}
    assert not list(cache.parent.glob("*.partial"))
    # Later calls read the cache: with the dump gone they still work.
    (tiny_cache / "data" / wikipedia.DUMP_NAME).unlink()
    assert [a.title for a in load_articles()] == ["Target", "Second"]


def test_stale_or_corrupt_cache_is_rebuilt(tiny_cache) -> None:
    cache = tiny_cache / "data" / wikipedia.ARTICLES_NAME
    cache.write_text('{"format_version": -1, "articles": 1}\n{"title": "Old", "text": "old"}\n')
    assert [a.title for a in load_articles()] == ["Target", "Second"]
    cache.write_text("not json\n")
    assert [a.title for a in load_articles()] == ["Target", "Second"]
    # A cache written by the previous converter (the hand-written parser, format 1) is rebuilt too.
    cache.write_text('{"format_version": 1, "articles": 1}\n{"title": "Old", "text": "old"}\n')
    assert [a.title for a in load_articles()] == ["Target", "Second"]
    assert json.loads(cache.read_text().splitlines()[0])["format_version"] == wikipedia.FORMAT_VERSION


def test_builtin_text_formats_and_selects_from_tiny_dump(tiny_cache) -> None:
    full = builtin_text()
    assert full == "= Target =\n\nTarget is a thing.\n\n= Second =\n\nA longer second article text."
    assert builtin_text(min_chars=20) == "= Second =\n\nA longer second article text."
    assert builtin_text(min_chars=10_000) == full  # nothing that long: fall back to everything
    assert longest_article().title == "Second"


def test_ensure_data_returns_existing_paths(tiny_cache) -> None:
    paths = ensure_data()
    assert set(paths) == {"wiki_dump", "wiki_articles"}
    assert all(p.is_file() and p.parent == tiny_cache / "data" for p in paths.values())


def test_offline_fetch_failure_raises_fetch_error_with_instructions(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(wikipedia, "cache_dir", lambda: tmp_path)

    def offline(*args, **kwargs):
        raise FetchError("could not download 'gensim==4.4.0' from PyPI (pip exit code 1).")

    monkeypatch.setattr(wikipedia, "fetch_members", offline)
    with pytest.raises(FetchError, match=r"kvsieve data.*PyPI|PyPI.*kvsieve data"):
        load_articles()
    assert not (tmp_path / "data" / wikipedia.ARTICLES_NAME).exists()


# --------------------------------------------------------------------------------------------------------
# The real built-in articles (downloads the gensim wheel into the user cache once)
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_articles() -> list[Article]:
    return load_articles()


# Markup that must not survive in any article, by kind.
_RESIDUE = {
    "template": r"\{\{|\}\}",
    "link": r"\[\[|\]\]",
    "external link": r"\[(?:https?:)?//",
    "ref": r"<ref|</ref",
    "table": r"\{\||\|\}",
    "bold/italic": r"''",
    "entity": r"&#?\w+;",
    "heading": r"==",
    "comment": r"<!--|-->",
    "html tag": r"</?[a-zA-Z][a-zA-Z0-9]*[\s/>]",
    "magic word": r"__[A-Z]+__",
    "list marker": r"(?m)^[*#]",
}


def test_real_articles_have_no_markup_residue(real_articles) -> None:
    assert len(real_articles) == 106
    found = {kind: [a.title for a in real_articles if re.search(p, a.text)] for kind, p in _RESIDUE.items()}
    assert found == {kind: [] for kind in _RESIDUE}


def test_real_articles_are_clean_prose(real_articles) -> None:
    assert len(real_articles) == 106
    titles = [a.title for a in real_articles]
    assert titles[:3] == ["Anarchism", "Autism", "Albedo"]
    assert len(set(titles)) == len(titles)
    for article in real_articles:
        for token in ("{{", "}}", "[[", "]]", "<ref", "{|", "|}", "'''", "&nbsp;", "<!--"):
            assert token not in article.text, (article.title, token)
        assert not re.search(r"^\s*[*#]|^==", article.text, re.M), article.title
        assert "\n\n\n" not in article.text and article.text == article.text.strip()
    total = sum(len(a.text) for a in real_articles)
    assert 2_000_000 < total < 4_000_000
    assert sum(len(a.text) >= 20_000 for a in real_articles) >= 50


def test_real_article_content(real_articles) -> None:
    by_title = {a.title: a.text for a in real_articles}
    anarchism = by_title["Anarchism"]
    assert anarchism.startswith("Anarchism is a political philosophy that advocates self-governed societies")
    assert "\n\nHistory\n\n" in anarchism  # section headings are kept as plain lines
    assert "References" not in anarchism.split("\n")  # the reference section is cut
    assert "E = mc2" in by_title["Albert Einstein"]  # {{nowrap|1=...}} is rendered
    assert by_title["Alabama"].startswith("Alabama is a state located in the southeastern region")


def test_builtin_text_is_long_and_deterministic(real_articles) -> None:
    text = builtin_text(min_chars=20_000)
    assert len(text) >= 20_000
    assert text.startswith("= Anarchism =\n\nAnarchism is a political philosophy")
    assert builtin_text(min_chars=20_000) == text
    full = builtin_text()
    assert full == builtin_text()
    assert len(full) > sum(len(a.text) for a in real_articles)
    assert full.count("\n\n= ") == len(real_articles) - 1
    longest = longest_article()
    assert len(longest.text) == max(len(a.text) for a in real_articles)
    assert builtin_text(min_chars=len(longest.text)) == f"= {longest.title} =\n\n{longest.text}"


# --------------------------------------------------------------------------------------------------------
# kvsieve.data: read_text, and the corpus under its old names
# --------------------------------------------------------------------------------------------------------


def test_kvsieve_data_reexports_the_corpus() -> None:
    names = ("Article", "builtin_text", "ensure_data", "load_articles", "longest_article", "strip_wiki_markup")
    assert all(getattr(data, name) is getattr(wikipedia, name) for name in names)


def test_read_text_reads_utf8_and_replaces_bad_bytes(tmp_path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes("héllo ".encode() + b"\xff world")
    assert read_text(path) == "héllo \ufffd world"
    assert read_text(str(path)) == "héllo \ufffd world"


def test_read_text_missing_file_names_the_path(tmp_path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        read_text(missing)
    with pytest.raises(FileNotFoundError, match="directory"):
        read_text(tmp_path)


@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_read_text_empty_file_raises_value_error(tmp_path, content: str) -> None:
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match="empty"):
        read_text(path)
