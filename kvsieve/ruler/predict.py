"""How RULER samples are answered under a grid's settings: one setting alone (:func:`predict`), a sample's settings
from one prompt pass (:func:`prefill_together`, :func:`predict_together`), and a stream of samples whose answers
are decoded together as they come (:func:`answers`; one sample: :func:`answer`).

**Compression** is kvpress's ratio: the share of the compressed tokens that are dropped (0.75 keeps a quarter). The
kvsieve budget is ``1 - compression`` of those tokens. **Protocols**
(:data:`~kvsieve.evaluation.defaults.QUESTION_MODES`):

- ``agnostic``: the context part (the chat template's header and the context) is compressed by one forward pass
  before the question is known, then the question part is fed and the answer decoded with the cache growing
  without bound (``decode_budget=None``): kvpress's protocol;
- ``aware``: the whole prompt, context and question, is compressed by one forward pass, and the answer is decoded
  with the cache held at that budget (the H2O setting: eviction goes on while decoding).

Both feed the same tokens (:class:`~kvsieve.ruler.tasks.Prompter`). The full cache is computed once per sample and
shown as the ceiling of both protocols (without eviction they compute the same answer). Answers are greedy, up to
RULER's per-task token limits (:data:`MAX_NEW_TOKENS`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from kvsieve.api import compress_context, eos_ids, generated, make_cache, probe_context
from kvsieve.engine.cache import SieveCache
from kvsieve.engine.memory import Reservation, available_memory, recorded_pass_bytes, reservation
from kvsieve.engine.shared import RecordedPass, SharedPrompt, StackedRows
from kvsieve.policies import Asking, get_policy
from kvsieve.qa import asking as qa_asking
from kvsieve.ruler.scoring import score
from kvsieve.ruler.tasks import Sample

__all__ = [
    "FULL",
    "MAX_NEW_TOKENS",
    "Decoding",
    "Prediction",
    "PromptPass",
    "Row",
    "Setting",
    "answer",
    "answers",
    "max_new_tokens",
    "predict",
    "predict_together",
    "prefill_together",
    "setting_groups",
]

MAX_NEW_TOKENS = {"vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
"""Task → the most tokens an answer may have (RULER's limits; needle tasks: 128)."""


@dataclass(frozen=True)
class Setting:
    """One column of the grid: a policy (spec) at a compression under a protocol."""

    protocol: str
    policy: str
    compression: float

    @property
    def key(self) -> str:
        return "full" if self.policy == "full" else f"{self.protocol}_{self.policy}_c{self.compression:g}"

    @property
    def budget(self) -> float | None:
        """The kvsieve budget: the share of the compressed tokens kept (None: the full cache)."""
        return None if self.policy == "full" else round(1.0 - self.compression, 6)

    @property
    def compresses_context(self) -> bool:
        """Whether the setting compresses the context part alone (``agnostic``, a bounded policy), then grows: its
        question part is a forward pass of its own."""
        return self.protocol == "agnostic" and self.policy != "full"


FULL = Setting("aware", "full", 0.0)


def max_new_tokens(task: str) -> int:
    return MAX_NEW_TOKENS.get(task, 128)


@dataclass
class Prediction:
    text: str
    score: float
    answer_tokens: int
    first_token_s: float
    """Seconds from the start to the first answer token: the prefill (with its compression), and for ``agnostic``
    the question part's forward pass."""
    total_s: float
    """Seconds of the work the answer took part in: ``first_token_s``, then every decode step it was a row of (with
    other answers joining, not the prompt passes that ran between its steps)."""


class _FirstToken(BaseStreamer):
    """Notes when ``generate`` emits its first new token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.at = 0, None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def predict(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    head: Sequence[int],
    tail: Sequence[int],
    setting: Setting,
    max_new_tokens: int,
    asking: Asking | None = None,
) -> tuple[str, int, float, float]:
    """The greedy answer to the prompt ``head + tail`` (context part, question part) under ``setting``: its text,
    its tokens, the seconds to its first token and in all (see the module docstring for the protocols; ``asking``:
    how a policy's probes ask about the context, default :func:`kvsieve.qa.asking` of the tokenizer)."""
    device = model.device
    ids = torch.tensor([[*head, *tail]], device=device)
    start = time.perf_counter()
    agnostic = setting.compresses_context
    cache = _cache(model, setting)
    with torch.inference_mode():
        if agnostic:
            cache.resolve(len(head))
            compress_context(model, cache, ids[:, : len(head)], asking or qa_asking(tokenizer))
        else:
            cache.resolve(ids.shape[1])
            cache.set_prompt_length(ids.shape[1])
        streamer = _FirstToken()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            streamer=streamer,
        )
    end = time.perf_counter()
    (text,), (n,) = generated(model, tokenizer, out, ids.shape[1])
    return text.strip(), n, (streamer.at or end) - start, end - start


@dataclass(eq=False)
class Row:
    """One setting's answer in the making: the cache that holds its one row, its tokens so far, and its seconds —
    the work it took part in: its prompt's shared pass (and, ``agnostic``, the batched question part), then each
    decode step it was a row of."""

    setting: Setting
    cache: SieveCache | None
    """(None once the row has left the batch: its cache is freed.)"""
    tokens: list[int]
    limit: int
    first_s: float
    seconds: float
    held: int = 0
    """Bytes its cache holds at most while it decodes (:attr:`~kvsieve.engine.memory.Reservation.steady`; 0:
    not counted)."""


class PromptPass:
    """A prompt's forward pass kept for the groups of settings filled from it one after another
    (:func:`prefill_together`): the first group's caches are filled by the model's pass, recorded
    (:class:`~kvsieve.engine.shared.SharedPrompt`), the next groups' by replaying it — the caches their own pass
    would leave (tested), without the model's layers running again."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.recorded: RecordedPass | None = None
        self.token = -1

    def fill(self, model: PreTrainedModel, ids: torch.Tensor, caches: list[SieveCache], ends: list[int | None]) -> int:
        """Fill ``caches`` from the prompt ``ids`` (cache ``i`` its first ``ends[i]`` tokens, None: all) and return
        the prompt's greedy next token: by the model's pass, recorded, the first time; by replaying it after."""
        if self.recorded is None:
            shared = SharedPrompt(caches, ends, record=True)
            self.token = _next_token(model, ids, shared)
            self.ids, self.recorded = ids, shared.recorded
        elif not torch.equal(ids, self.ids):
            raise ValueError("a prompt pass fills caches of its own prompt only")
        else:
            SharedPrompt(caches, ends).replay(self.recorded)
        return self.token


def _next_token(model: PreTrainedModel, ids: torch.Tensor, cache: SharedPrompt) -> int:
    return int(model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())


def prefill_together(
    model: PreTrainedModel,
    head: Sequence[int],
    tail: Sequence[int],
    settings: Sequence[Setting],
    max_new_tokens: int,
    prompt_pass: PromptPass | None = None,
    asking: Asking | None = None,
) -> list[Row]:
    """The rows of ``settings`` for the prompt ``head + tail`` (context part, question part), each with its first
    token: one forward pass of the prompt fills every setting's cache (:class:`~kvsieve.engine.shared.SharedPrompt`;
    an ``agnostic`` cache takes the context part) — or ``prompt_pass``, for the groups of settings of one prompt
    filled one after another — then the question part is fed to the ``agnostic`` caches as the rows of one batch.
    An ``agnostic`` cache whose policy is scored by probes (``kvzip``) is held through the pass, probed (``asking``:
    see :func:`predict`; the caches whose policies observe alike probed once, the others adopting its state) and
    compressed first; the probes' seconds count in its first token's."""
    device, n = model.device, len(settings)
    ids = torch.tensor([[*head, *tail]], device=device)
    agnostic = [s.compresses_context for s in settings]
    caches = [_cache(model, s) for s in settings]
    ends = [len(head) if a else None for a in agnostic]
    probed = [i for i in range(n) if agnostic[i] and get_policy(settings[i].policy).probed]
    for i in probed:
        caches[i].hold()
    start = time.perf_counter()
    with torch.inference_mode():
        if prompt_pass is None:
            token = _next_token(model, ids, SharedPrompt(caches, ends))
        else:
            token = prompt_pass.fill(model, ids, caches, ends)
        tokens = [token] * n
        first_s = [time.perf_counter() - start] * n
        scored: dict[Hashable, tuple[SieveCache, float]] = {}  # (how it observes → its probed cache, the seconds)
        for i in probed:
            spec = settings[i].policy
            like = caches[i].observes_as()
            key = spec if like is None else like
            if key in scored:
                caches[i].adopt_state(scored[key][0])
            else:
                began = time.perf_counter()
                if asking is None:
                    raise ValueError(f"{spec} asks the model about the context: give prefill_together an asking")
                probe_context(model, caches[i], ids[:, : len(head)], asking)
                scored[key] = caches[i], time.perf_counter() - began
            first_s[i] += scored[key][1]
        for i in probed:
            caches[i].compress()
        asking = [i for i in range(n) if agnostic[i]]
        if asking:
            question = ids[:, len(head) :].expand(len(asking), -1)
            stack = StackedRows([caches[i] for i in asking])
            logits = model(input_ids=question, cache=stack, use_cache=True, logits_to_keep=1).logits[:, -1]
            at = time.perf_counter() - start
            for row, i in enumerate(asking):
                tokens[i], first_s[i] = int(logits[row].argmax()), at
    return [
        Row(setting, cache, [token], max_new_tokens, first, first)
        for setting, cache, token, first in zip(settings, caches, tokens, first_s, strict=True)
    ]


class Decoding:
    """Rows decoded greedily as one batch (:class:`~kvsieve.engine.shared.StackedRows`), whatever their prompts and
    positions: rows join between steps (:meth:`join`) and leave at their end — EOS or their token limit — freeing
    their caches."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model, self.eos = model, eos_ids(model, tokenizer)
        self.rows: list[Row] = []
        self.stack: StackedRows | None = None

    @property
    def held(self) -> int:
        """Bytes the rows' caches hold at most (their :attr:`Row.held`)."""
        return sum(row.held for row in self.rows)

    def ended(self, row: Row) -> bool:
        return len(row.tokens) >= row.limit or row.tokens[-1] in self.eos

    def join(self, rows: Sequence[Row]) -> list[Row]:
        """Take ``rows`` into the batch; those that already ended (at their first token) are returned instead."""
        done = [self.ended(row) for row in rows]
        ended = [row for row, end in zip(rows, done, strict=True) if end]
        staying = [row for row, end in zip(rows, done, strict=True) if not end]
        if staying:
            self.rows += staying
            self.stack = StackedRows([row.cache for row in self.rows])
        return ended

    def step(self) -> list[Row]:
        """One greedy token for every row; the rows that ended, out of the batch."""
        start = time.perf_counter()
        step = torch.tensor([[row.tokens[-1]] for row in self.rows], device=self.model.device)
        with torch.inference_mode():
            out = self.model(input_ids=step, position_ids=self.stack.position_ids(), cache=self.stack, use_cache=True)
        chosen = out.logits[:, -1].max(-1).indices.tolist()  # (argmax's token, 4x faster in bf16 on the CPU)
        seconds = time.perf_counter() - start
        for row, token in zip(self.rows, chosen, strict=True):
            row.tokens.append(token)
            row.seconds += seconds
        done = [self.ended(row) for row in self.rows]
        staying = [i for i, end in enumerate(done) if not end]
        ended = [row for row, end in zip(self.rows, done, strict=True) if end]
        if not staying:
            self.rows, self.stack = [], None
        elif ended:
            self.stack.batch_select_indices(torch.tensor(staying))
            self.rows = [self.rows[i] for i in staying]
        for row in ended:
            row.cache = None  # (freed as it leaves the batch)
        return ended


def _finished(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, row: Row) -> tuple[str, int, float, float]:
    """A row's answer as :func:`predict` returns it: text, tokens, seconds to its first token and in all."""
    (text,), (count,) = generated(model, tokenizer, torch.tensor([row.tokens]), 0)
    return text.strip(), count, row.first_s, row.seconds


def predict_together(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    head: Sequence[int],
    tail: Sequence[int],
    settings: Sequence[Setting],
    max_new_tokens: int,
    asking: Asking | None = None,
) -> list[tuple[str, int, float, float]]:
    """:func:`predict` for each of ``settings`` at once, with the same answers (tested): their rows from one prompt
    pass (:func:`prefill_together`), decoded as one batch (:class:`Decoding`), in the order of ``settings``."""
    decoding = Decoding(model, tokenizer)
    rows = prefill_together(model, head, tail, settings, max_new_tokens, asking=asking or qa_asking(tokenizer))
    decoding.join(rows)
    while decoding.rows:
        decoding.step()
    return [_finished(model, tokenizer, row) for row in rows]


def _cache(model: PreTrainedModel, setting: Setting) -> SieveCache:
    """The cache ``setting`` answers with (see the module docstring for the protocols)."""
    growth = {"decode_budget": None} if setting.compresses_context else {}  # (agnostic: the answer never evicts)
    return make_cache(model, setting.policy, setting.budget, **growth)


def _need(
    model: PreTrainedModel, setting: Setting, prompt: tuple[Sequence[int], Sequence[int]], limit: int
) -> Reservation:
    """The most ``setting``'s cache holds for ``prompt`` (context part, question part) and an answer of ``limit``
    tokens (:func:`~kvsieve.engine.memory.reservation`: ``peak`` while its prompt is fed, ``steady`` after)."""
    head, tail = prompt
    fed, more = (len(head), len(tail) + limit) if setting.compresses_context else (len(head) + len(tail), limit)
    return reservation(model, _cache(model, setting), fed, more)


def setting_groups(
    model: PreTrainedModel,
    settings: Sequence[Setting],
    prompt: tuple[Sequence[int], Sequence[int]],
    max_new_tokens: int,
    kv_memory: int | None,
) -> list[list[Setting]]:
    """``settings`` in order, in groups whose caches hold together at most ``kv_memory`` bytes for ``prompt``
    (context part, question part) and an answer of ``max_new_tokens`` (each cache's most while its prompt is fed,
    its prompt pass's buffer included; where they take several groups, with the recording of the prompt's one
    model pass, which the groups after the first replay: :class:`PromptPass`). A setting that needs more than
    ``kv_memory`` alone is a group of its own; None: one group."""
    if kv_memory is None:
        return [list(settings)]
    needs = [_need(model, s, prompt, max_new_tokens).peak for s in settings]
    return _packed(settings, needs, kv_memory, recorded_pass_bytes(model, len(prompt[0]) + len(prompt[1])))


def _packed(settings: Sequence[Setting], needs: Sequence[int], kv_memory: int, recording: int) -> list[list[Setting]]:
    """``settings`` in order, in groups whose ``needs`` (bytes) sum to at most ``kv_memory``, less the ``recording``
    of the prompt pass that the groups after the first replay (held until the last is filled) where there are
    several; a setting that needs more alone is a group of its own."""
    groups = _fitted(settings, needs, kv_memory)
    return groups if len(groups) == 1 else _fitted(settings, needs, kv_memory - recording)


def _fitted(settings: Sequence[Setting], needs: Sequence[int], kv_memory: int) -> list[list[Setting]]:
    groups: list[list[Setting]] = []
    used = 0
    for setting, need in zip(settings, needs, strict=True):
        if not groups or used + need > kv_memory:
            groups.append([])
            used = 0
        groups[-1].append(setting)
        used += need
    return groups


Unit = tuple[Sample, tuple[Sequence[int], Sequence[int]], Sequence[Setting]]
"""A sample, its prompt (context part, question part) and the settings to answer it under."""


def answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    units: Iterable[Unit],
    kv_memory: int | None = None,
    asking: Asking | None = None,
) -> Iterator[tuple[int, Setting, dict[str, Any]]]:
    """Each unit's answers, as ``(unit index, setting, cell)`` — a cell as stored: text, score, tokens, timings —
    handed over as each answer ends. The units are taken in order, one group of settings at a time: a group is
    the settings of a unit whose caches fit ``kv_memory`` bytes (:func:`setting_groups`; default: half the memory
    free on the model's device), filled by the unit's prompt pass (:func:`prefill_together`; its next groups
    replay it, :class:`PromptPass`, whose recording counts against ``kv_memory`` until they are filled) and
    joining the answers being decoded (:class:`Decoding`). A group is taken as soon as its caches fit beside
    those of the answers being decoded (where the memory free cannot be read: once those are all done), so that
    the next samples' answers fill the batch while a sample's longest answers finish. Units are read only when
    their turn comes. ``asking``: how a policy's probes ask about a context (default: :func:`kvsieve.qa.asking` of
    the tokenizer, with its chat template)."""
    asking = asking or qa_asking(tokenizer)
    if kv_memory is None:
        free = available_memory(model.device)
        kv_memory = None if free is None else free // 2
    decoding = Decoding(model, tokenizer)
    owner: dict[int, tuple[int, Sample]] = {}  # (id of a row being decoded → its unit's index and sample)

    def handed(rows: Sequence[Row]) -> Iterator[tuple[int, Setting, dict[str, Any]]]:
        for row in rows:
            index, sample = owner.pop(id(row))
            yield index, row.setting, _cell(sample, *_finished(model, tokenizer, row))

    for index, (sample, prompt, settings) in enumerate(units):
        limit = max_new_tokens(sample.task)
        needs = {s: _need(model, s, prompt, limit) for s in settings}
        recording = recorded_pass_bytes(model, len(prompt[0]) + len(prompt[1]))
        if kv_memory is None:  # (no bound: one group)
            groups = [list(settings)] if settings else []
        else:
            groups = _packed(settings, [needs[s].peak for s in settings], kv_memory, recording)
        # (the groups after the first replay its pass: kept until the last is filled)
        prompt_pass = PromptPass() if len(groups) > 1 else None
        for number, group in enumerate(groups):
            need = sum(needs[s].peak for s in group) + (0 if prompt_pass is None else recording)
            while decoding.rows and (kv_memory is None or decoding.held + need > kv_memory):
                yield from handed(decoding.step())
            rows = prefill_together(model, *prompt, group, limit, prompt_pass, asking)
            if number == len(groups) - 1:
                prompt_pass = None
            for row in rows:
                row.held = needs[row.setting].steady
                owner[id(row)] = index, sample
            yield from handed(decoding.join(rows))
    while decoding.rows:
        yield from handed(decoding.step())


def _cell(sample: Sample, text: str, n: int, first_s: float, total_s: float) -> dict[str, Any]:
    """An answer to ``sample`` as a cell stores it (:class:`Prediction`)."""
    return asdict(Prediction(text, score(sample.task, text, sample.answers), n, first_s, total_s))


def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sample: Sample,
    prompt: tuple[Sequence[int], Sequence[int]],
    settings: Sequence[Setting],
    kv_memory: int | None = None,
    asking: Asking | None = None,
) -> Iterator[tuple[Setting, dict[str, Any]]]:
    """:func:`answers` of one sample: ``(setting, cell)`` as each answer ends (what a Ray task computes)."""
    for _, setting, cell in answers(model, tokenizer, [(sample, prompt, settings)], kv_memory, asking):
        yield setting, cell
