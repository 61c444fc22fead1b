"""RULER's task families, generated offline and deterministically, at lengths counted with the model's tokenizer.

Written from the description in Hsieh et al., 2024 ("RULER: What's the Real Context Size of Your Long-Context
Language Models?", Section 3 and Appendix B); the wording of every template here is kvsieve's own. A sample is a
**context** (an instruction, then the haystack) and a **question** with the **answer prefix** the model continues;
its **answers** are what the scoring looks for (:mod:`kvsieve.ruler.scoring`).

The tasks (RULER's thirteen, its second QA set aside: HotpotQA is not available offline):

========================  ========  ============  ===========  ==========================================
task                      haystack  keys          values       needles
========================  ========  ============  ===========  ==========================================
``niah_single_1``         noise     words         numbers      one
``niah_single_2``         essay     words         numbers      one
``niah_single_3``         essay     words         UUIDs        one
``niah_multikey_1``       essay     words         numbers      four keys, one asked
``niah_multikey_2``       needles   words         numbers      the haystack is distractor needles
``niah_multikey_3``       needles   UUIDs         UUIDs        the haystack is distractor needles
``niah_multivalue``       essay     words         numbers      four values of one key, all asked
``niah_multiquery``       essay     words         numbers      four keys, all asked
``vt``                    noise     variables     numbers      one chain of four hops (five variables)
``cwe``                   —         —             words        10 words × 30 among others × 3
``fwe``                   —         —             coded words  Zipf (α = 2) draws, the top three asked
``qa``                    essays    —             —            one SQuAD passage among distractors
========================  ========  ============  ===========  ==========================================

Choices where the paper leaves room, each fixed here:

- **Haystacks.** *essay*: consecutive sentences of the built-in Wikipedia articles (or a ``--file``), from a seeded
  start, cycling; *noise*: one short repeated line of filler; *needles*: needles of other keys. Needles go between
  sentences (lines), never inside one.
- **Depths.** The needles of a sample are placed at depths (0 = first, 1 = last unit of the haystack) drawn uniformly
  from the sample's seed and sorted; with one needle (and qa's golden passage), the samples of a task are stratified
  over depth: each of the ``n`` samples lands in its own ``[k/n, (k+1)/n)``, the strata dealt to the samples in a
  seeded random order, so that the depths cover the context evenly and any first samples (a run cut short) spread
  over it too.
- **Keys and values.** Word keys are two words of the built-in articles' vocabulary joined by a hyphen, numbers have
  seven digits, UUIDs are version-4 UUIDs drawn from the seed. Variable names are five capital letters.
- **cwe** keeps RULER's frequencies (the 10 common words 30 times each, the others 3 times each; the length is met
  by the number of others; below about 2,400 tokens the common words appear less often: ``CommonWords.frequency``);
  **fwe** draws coded words (random lowercase strings) by rank with probability ∝ rank⁻²,
  and its answers are the three most frequent words as drawn (a draw with a tie at third place is redrawn).
  RULER shows both tasks one solved example in the prompt; here there is none (the instruction states the format).
- **qa**: the golden passage among distractor passages of other items (``Document k:`` each), at a stratified depth.
  The items: SQuAD v1.1 (:func:`kvsieve.corpora.reading.reading_items`) from sample generator 3 on; generator 2 drew
  them from BIG-bench's squad_shifts, which can no longer be fetched (its stored samples are answered as they are).
- **Length.** The largest haystack whose whole prompt (the chat template's turn, context, question, answer prefix:
  the tokens fed, :class:`Prompter`) has at most ``length`` tokens, found by bisection on the number of haystack
  units.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvsieve.policies import Asking
from kvsieve.qa import asking, split_prompt

__all__ = ["GENERATOR", "TASKS", "Prompter", "Sample", "Sources", "generate_samples", "load_samples", "sentences"]

GENERATOR = 3
"""The generator's version: bumped whenever the samples drawn from a seed change (stored samples and answers of
another version are made again). 3: the qa task's items are SQuAD's; 2: BIG-bench squad_shifts' (the other tasks draw
the same samples in both)."""


@dataclass(frozen=True)
class Sample:
    """One generated prompt and what its answer must contain."""

    task: str
    length: int
    """The target: the whole prompt has at most this many tokens."""
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    depths: tuple[float, ...]
    """Where the needles (the golden passage, the chain's links) sit, as fractions of the haystack; empty for
    cwe and fwe."""
    tokens: int
    """The prompt's tokens as :class:`Prompter` counts them."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Sample:
        return cls(**{**row, "answers": tuple(row["answers"]), "depths": tuple(row["depths"])})


def load_samples(path: str | Path) -> list[Sample]:
    """The samples of a ``.jsonl`` file (one :meth:`Sample.to_dict` per line), as ``kvsieve ruler`` writes them."""
    return [Sample.from_dict(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


class Prompter:
    """The tokens a sample's prompt is fed as: the context part (the chat template's header, the context) and the
    question part (the question, the rest of the turn, the assistant's header, the answer prefix), each tokenized on
    its own (:func:`kvsieve.qa.split_prompt`), so that both protocols feed the same tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: bool = True) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template and bool(tokenizer.chat_template)

    def ids(self, context: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
        """Token ids of the context part and of the question part."""
        before, template = split_prompt(self.tokenizer, context, self.chat_template)
        asked = template.format(question=question) + answer_prefix
        special = not self.chat_template  # (a template writes its own special tokens)
        head = self.tokenizer(before, add_special_tokens=special).input_ids
        return head, self.tokenizer(asked, add_special_tokens=False).input_ids

    def asking(self) -> Asking:
        """How a policy's probes ask the model about a context fed as :meth:`ids` feeds it
        (:func:`kvsieve.qa.asking`)."""
        return asking(self.tokenizer, self.chat_template)

    def count(self, context: str, question: str, answer_prefix: str) -> int:
        head, tail = self.ids(context, question, answer_prefix)
        return len(head) + len(tail)


@dataclass(frozen=True)
class Sources:
    """What samples are made of: haystack sentences, a vocabulary of plain words, reading-comprehension items."""

    sentences: Sequence[str]
    words: Sequence[str]
    reading: Sequence[Any] = ()
    """Items with ``passage``, ``question`` and ``answers`` (:func:`kvsieve.corpora.reading.reading_items`)."""


def sentences(text: str, max_words: int = 40) -> list[str]:
    """``text`` as sentences: split after ``.``, ``!`` or ``?`` followed by whitespace, pieces of under three words
    dropped, longer ones (lists, tables) cut every ``max_words`` words so that a haystack can meet a length closely."""
    out = []
    for part in re.split(r"(?<=[.!?])\s+", text):
        words = part.split()
        if len(words) >= 3:
            out += [" ".join(words[i : i + max_words]) for i in range(0, len(words), max_words)]
    return out


def vocabulary(text: str, limit: int = 5000) -> list[str]:
    """The ``limit`` most frequent lowercase alphabetic words of 4–10 letters in ``text`` (ties alphabetical)."""
    counts = Counter(w for w in re.findall(r"\b[a-z]{4,10}\b", text))
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]]


NOISE = "The lake is calm today. The road goes on and on. The clock keeps ticking."


# --- the pieces -------------------------------------------------------------------------------------------------


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word_key(rng: random.Random, words: Sequence[str]) -> str:
    first, second = rng.sample(list(words), 2)
    return f"{first}-{second}"


def _distinct(make: Callable[[], str], n: int, taken: set[str] | None = None) -> list[str]:
    """``n`` distinct values of ``make()`` not in ``taken`` (which is extended)."""
    taken = set() if taken is None else taken
    out: list[str] = []
    while len(out) < n:
        value = make()
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out


def _haystack(kind: str, src: Sources, rng: random.Random) -> Callable[[int], list[str]]:
    """``units(n)``: the first ``n`` units (sentences or lines) of a haystack of ``kind``, from a seeded start."""
    if kind == "noise":
        return lambda n: [NOISE] * n
    start = rng.randrange(len(src.sentences))
    return lambda n: [src.sentences[(start + i) % len(src.sentences)] for i in range(n)]


def _insert(units: list[str], needles: Sequence[str], depths: Sequence[float]) -> list[str]:
    """``units`` with each needle placed before the unit at its depth (in order; depth 1 = after the last)."""
    out = list(units)
    for offset, (needle, depth) in enumerate(zip(needles, depths, strict=True)):
        out.insert(round(depth * len(units)) + offset, needle)
    return out


def _depths(rng: random.Random, count: int, stratum: int, samples: int) -> list[float]:
    """``count`` sorted depths: one in the sample's stratum of ``[0, 1)``, or uniform draws for several."""
    if count == 1:
        return [(stratum + rng.random()) / samples]
    return sorted(rng.random() for _ in range(count))


@dataclass(frozen=True)
class _Draft:
    """A sample before its length is fitted: ``build(n)`` is its context with ``n`` haystack units."""

    build: Callable[[int], str]
    question: str
    answer_prefix: str
    answers: Callable[[int], tuple[str, ...]]
    """The answers with ``n`` haystack units (fwe's depend on the draws kept)."""
    depths: tuple[float, ...]
    unit_tokens: int
    """Roughly the tokens of one unit (for the bisection's first upper bound)."""
    units: int
    """The most units the sources hold."""


# --- needle in a haystack ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Niah:
    haystack: str  # noise | essay | needles
    keys: str  # words | uuids
    values: str  # numbers | uuids
    num_keys: int = 1  # needles of distinct keys in the haystack (besides the "needles" haystack)
    num_values: int = 1  # values of the asked key
    num_queries: int = 1  # keys asked

    def draft(self, src: Sources, rng: random.Random, stratum: int, samples: int, length: int) -> _Draft:
        kind, kinds = ("number", "numbers") if self.values == "numbers" else ("UUID", "UUIDs")
        taken: set[str] = set()
        make_key = (lambda: _word_key(rng, src.words)) if self.keys == "words" else (lambda: _uuid(rng))
        make_value = (lambda: _number(rng)) if self.values == "numbers" else (lambda: _uuid(rng))
        keys = _distinct(make_key, max(self.num_keys, self.num_queries), taken)
        values = {key: _distinct(make_value, self.num_values, taken) for key in keys}
        needles = [f"The secret {kind} for {key} is {value}." for key in keys for value in values[key]]
        order = list(range(len(needles)))
        rng.shuffle(order)
        needles = [needles[i] for i in order]
        depths = _depths(rng, len(needles), stratum, samples)
        asked = keys[: self.num_queries]
        answers = tuple(value for key in asked for value in values[key])
        if self.haystack == "needles":
            count = max(4096, length // 8)  # (a needle has more than 8 tokens)
            others = [
                f"The secret {kind} for {key} is {value}."
                for key, value in zip(
                    _distinct(make_key, count, taken), _distinct(make_value, count, taken), strict=True
                )
            ]
            units = lambda n: others[:n]  # noqa: E731
            unit_tokens, available = 16, count
        else:
            units = _haystack(self.haystack, src, rng)
            unit_tokens, available = (16 if self.haystack == "noise" else 24), 1 << 30  # (they repeat)
        intro = (
            f"Some secret {kinds} are hidden in the text below. Read it carefully and remember them: "
            f"you will be asked about them afterwards."
        )
        listed = _listing(asked)
        if self.num_values > 1 or self.num_queries > 1:
            question = f"What are all the secret {kinds} for {listed} in the text above?"
            prefix = f"The secret {kinds} for {listed} are:"
        else:
            question = f"What is the secret {kind} for {listed} in the text above?"
            prefix = f"The secret {kind} for {listed} is"
        return _Draft(
            build=lambda n: intro + "\n\n" + " ".join(_insert(units(n), needles, depths)),
            question=question,
            answer_prefix=prefix,
            answers=lambda n: answers,
            depths=tuple(depths),
            unit_tokens=unit_tokens,
            units=available,
        )


def _listing(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# --- variable tracking ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VariableTracking:
    hops: int = 4

    def draft(self, src: Sources, rng: random.Random, stratum: int, samples: int, length: int) -> _Draft:
        names = _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), self.hops + 1)
        value = str(rng.randrange(10_000, 100_000))
        links = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
        depths = _depths(rng, len(links), stratum, samples)
        intro = (
            "Variables are assigned values in the text below, some directly and some through other variables. "
            "Follow every assignment: you will be asked which variables hold a given value."
        )
        return _Draft(
            build=lambda n: intro + "\n\n" + " ".join(_insert([NOISE] * n, links, depths)),
            question=f"Which variables in the text above hold the value {value}? Name all of them.",
            answer_prefix=f"The variables that hold the value {value} are:",
            answers=lambda n: tuple(names),
            depths=tuple(depths),
            unit_tokens=16,
            units=1 << 30,
        )


# --- aggregation ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommonWords:
    common: int = 10
    common_freq: int = 30
    rare_freq: int = 3

    def frequency(self, length: int) -> int:
        """How often each common word appears: ``common_freq``, less where the common words alone would take over
        half of ``length`` (about four tokens a list line), never below ``rare_freq + 2``."""
        return max(self.rare_freq + 2, min(self.common_freq, length // (8 * self.common)))

    def draft(self, src: Sources, rng: random.Random, stratum: int, samples: int, length: int) -> _Draft:
        pool = list(src.words)
        rng.shuffle(pool)
        common, rare = pool[: self.common], pool[self.common :]
        freq = self.frequency(length)
        order = rng.random()  # (the list's order)

        def build(n: int) -> str:
            words = [w for w in common for _ in range(freq)]
            words += [w for w in rare[:n] for _ in range(self.rare_freq)]
            random.Random(order).shuffle(words)
            listed = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words))
            return "Below is a numbered list of words. Some words appear many times.\n\n" + listed

        return _Draft(
            build=build,
            question=f"Which {self.common} words appear most often in the list above?",
            answer_prefix=f"The {self.common} words that appear most often are:",
            answers=lambda n: tuple(common),
            depths=(),
            unit_tokens=4 * self.rare_freq,
            units=len(rare),
        )


@dataclass(frozen=True)
class FrequentWords:
    alpha: float = 2.0
    vocab: int = 600
    top: int = 3

    def draft(self, src: Sources, rng: random.Random, stratum: int, samples: int, length: int) -> _Draft:
        coded = _distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 7))), self.vocab)
        weights = [(rank + 1) ** -self.alpha for rank in range(self.vocab)]
        draws = rng.choices(coded, weights, k=1 << 16)

        def top(n: int) -> tuple[str, ...]:
            ranked = Counter(draws[:n]).most_common(self.top + 1)
            if len(ranked) <= self.top or ranked[self.top - 1][1] == ranked[self.top][1]:
                raise _Tie
            return tuple(w for w, _ in ranked[: self.top])

        def build(n: int) -> str:
            return "Below is a text of coded words, separated by dots.\n\n" + " ... ".join(draws[:n])

        return _Draft(
            build=build,
            question=f"Which {self.top} coded words appear most often in the text above?",
            answer_prefix=f"The {self.top} coded words that appear most often are:",
            answers=top,
            depths=(),
            unit_tokens=4,
            units=len(draws),
        )


class _Tie(Exception):
    """Two words tie for the last answer place: the sample is drawn again."""


# --- question answering -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadingQA:
    def draft(self, src: Sources, rng: random.Random, stratum: int, samples: int, length: int) -> _Draft:
        if len(src.reading) < 2:
            raise ValueError(
                "the qa task needs reading-comprehension items: sample generator 2's (BIG-bench squad_shifts) can no "
                f"longer be fetched, its stored samples are answered as they are; generator {GENERATOR} draws SQuAD's"
            )
        golden = src.reading[rng.randrange(len(src.reading))]
        others = list(dict.fromkeys(item.passage for item in src.reading if item.passage != golden.passage))
        rng.shuffle(others)
        depth = (stratum + rng.random()) / samples

        def build(n: int) -> str:
            passages = _insert(others[:n], [golden.passage], [depth])
            docs = "\n\n".join(f"Document {i + 1}:\n{p}" for i, p in enumerate(passages))
            return "Answer the question at the end from the documents below.\n\n" + docs

        return _Draft(
            build=build,
            question=f"Answer from the documents above, in a few words. Question: {golden.question}",
            answer_prefix="Answer:",
            answers=lambda n: tuple(golden.answers),
            depths=(depth,),
            unit_tokens=160,
            units=len(others),
        )


TASKS: dict[str, Any] = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": Niah("needles", "words", "numbers"),
    "niah_multikey_3": Niah("needles", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", num_values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", num_keys=4, num_queries=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
    "qa": ReadingQA(),
}
"""Task name → its generator (see the module docstring's table)."""


# --- fitting the length -----------------------------------------------------------------------------------------


def _fit(draft: _Draft, prompter: Prompter, length: int) -> tuple[int, int]:
    """The most haystack units whose prompt has at most ``length`` tokens, and those tokens."""

    def tokens(n: int) -> int:
        return prompter.count(draft.build(n), draft.question, draft.answer_prefix)

    if tokens(1) > length:
        raise ValueError(f"length {length} is too short for the task's instruction, needles and question")
    low, high = 1, min(draft.units, max(2, 2 * length // max(1, draft.unit_tokens)))
    while high < draft.units and tokens(high) <= length:  # (the estimate was short: widen)
        low, high = high, min(draft.units, 2 * high)
    if tokens(high) <= length:
        raise ValueError(f"the task's sources fill {tokens(high)} tokens at most, fewer than the length {length}")
    while high - low > 1:
        mid = (low + high) // 2
        if tokens(mid) <= length:
            low = mid
        else:
            high = mid
    return low, tokens(low)


def generate_samples(
    task: str, length: int, samples: int, prompter: Prompter, sources: Sources, seed: int = 0
) -> list[Sample]:
    """``samples`` samples of ``task`` whose prompts have at most ``length`` tokens (as close as the haystack's units
    allow), drawn from ``seed``: the same arguments give the same samples."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; tasks: {', '.join(TASKS)}")
    if samples <= 0:
        raise ValueError(f"samples must be positive, got {samples}")
    strata = list(range(samples))
    random.Random(f"{seed}/{task}/{length}/strata").shuffle(strata)
    out = []
    for index in range(samples):
        rng = random.Random(f"{seed}/{task}/{length}/{index}")
        while True:
            draft = TASKS[task].draft(sources, rng, strata[index], samples, length)
            units, tokens = _fit(draft, prompter, length)
            try:
                answers = draft.answers(units)
            except _Tie:
                continue
            break
        out.append(
            Sample(
                task=task,
                length=length,
                index=index,
                context=draft.build(units),
                question=draft.question,
                answer_prefix=draft.answer_prefix,
                answers=answers,
                depths=draft.depths,
                tokens=tokens,
            )
        )
    return out
