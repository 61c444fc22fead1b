"""How a RULER sample is answered under a grid's settings: one setting alone (:func:`predict`), many at once
(:func:`predict_together`), a sample's settings in groups whose caches fit (:func:`answer`).

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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from kvsieve.api import eos_ids, generated, make_cache
from kvsieve.engine.cache import SieveCache
from kvsieve.engine.memory import available_memory, reservation
from kvsieve.engine.shared import SharedPrompt, StackedRows
from kvsieve.policies import get_policy
from kvsieve.ruler.scoring import score
from kvsieve.ruler.tasks import Sample

__all__ = [
    "FULL",
    "MAX_NEW_TOKENS",
    "Prediction",
    "Setting",
    "answer",
    "max_new_tokens",
    "predict",
    "predict_together",
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
) -> tuple[str, int, float, float]:
    """The greedy answer to the prompt ``head + tail`` (context part, question part) under ``setting``: its text,
    its tokens, the seconds to its first token and in all (see the module docstring for the protocols)."""
    device = model.device
    ids = torch.tensor([[*head, *tail]], device=device)
    start = time.perf_counter()
    agnostic = setting.compresses_context
    cache = _cache(model, setting)
    with torch.inference_mode():
        if agnostic:
            cache.resolve(len(head))
            model(input_ids=ids[:, : len(head)], cache=cache, use_cache=True, logits_to_keep=1)
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


def predict_together(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    head: Sequence[int],
    tail: Sequence[int],
    settings: Sequence[Setting],
    max_new_tokens: int,
) -> list[tuple[str, int, float, float]]:
    """:func:`predict` for each of ``settings`` at once, with the same answers (tested): one forward pass of the
    prompt fills every setting's cache (:class:`~kvsieve.engine.shared.SharedPrompt`; an ``agnostic`` cache takes the
    context part), the question part is fed to the ``agnostic`` caches as the rows of one batch, and the answers of
    all settings are decoded together as the rows of one batch (:class:`~kvsieve.engine.shared.StackedRows`), each row
    leaving it at its end. Each setting's seconds are those of the work it waited for: its first token after the
    shared pass (and, ``agnostic``, the batched question part), its answer when its row ended. Policies that narrow
    attention have a prompt pass of their own: :func:`predict` them."""
    device, n = model.device, len(settings)
    ids = torch.tensor([[*head, *tail]], device=device)
    agnostic = [s.compresses_context for s in settings]
    caches = [_cache(model, s) for s in settings]
    eos = eos_ids(model, tokenizer)
    start = time.perf_counter()
    with torch.inference_mode():
        shared = SharedPrompt(caches, [len(head) if a else None for a in agnostic])
        last = model(input_ids=ids, cache=shared, use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = [[int(last[0].argmax())] for _ in settings]
        first_s = [time.perf_counter() - start] * n
        asking = [i for i in range(n) if agnostic[i]]
        if asking:
            question = ids[:, len(head) :].expand(len(asking), -1)
            stack = StackedRows([caches[i] for i in asking])
            logits = model(input_ids=question, cache=stack, use_cache=True, logits_to_keep=1).logits[:, -1]
            at = time.perf_counter() - start
            for row, i in enumerate(asking):
                tokens[i], first_s[i] = [int(logits[row].argmax())], at
        total_s = [0.0] * n

        def running(i: int) -> bool:
            return len(tokens[i]) < max_new_tokens and tokens[i][-1] not in eos

        live = [i for i in range(n) if running(i)]
        for i in set(range(n)) - set(live):
            total_s[i] = first_s[i]
        stack = StackedRows([caches[i] for i in live]) if live else None
        while live:
            step = torch.tensor([[tokens[i][-1]] for i in live], device=device)
            logits = model(input_ids=step, cache=stack, use_cache=True).logits[:, -1]
            at = time.perf_counter() - start
            for row, i in enumerate(live):
                tokens[i].append(int(logits[row].argmax()))
            staying = [row for row, i in enumerate(live) if running(i)]
            for row, i in enumerate(live):
                if row not in staying:
                    total_s[i], caches[i] = at, None  # (its cache is freed as it leaves the batch)
            if staying and len(staying) < len(live):
                stack.batch_select_indices(torch.tensor(staying))
            live = [live[row] for row in staying]
    out = []
    for i in range(n):
        (text,), (count,) = generated(model, tokenizer, torch.tensor([tokens[i]]), 0)
        out.append((text.strip(), count, first_s[i], total_s[i]))
    return out


def _cache(model: PreTrainedModel, setting: Setting) -> SieveCache:
    """The cache ``setting`` answers with (see the module docstring for the protocols)."""
    growth = {"decode_budget": None} if setting.compresses_context else {}  # (agnostic: the answer never evicts)
    return make_cache(model, setting.policy, setting.budget, **growth)


def setting_groups(
    model: PreTrainedModel,
    settings: Sequence[Setting],
    prompt: tuple[Sequence[int], Sequence[int]],
    max_new_tokens: int,
    kv_memory: int | None,
) -> list[list[Setting]]:
    """``settings`` in order, in groups whose caches hold together at most ``kv_memory`` bytes for ``prompt``
    (context part, question part) and an answer of ``max_new_tokens`` (each cache's most,
    :func:`~kvsieve.engine.memory.reservation`, its prompt pass's buffer included): :func:`answer` answers each
    group with one prompt pass. A setting that needs more than ``kv_memory`` alone is a group of its own; None: one
    group."""
    if kv_memory is None:
        return [list(settings)]
    head, tail = prompt
    groups: list[list[Setting]] = []
    used = 0
    for setting in settings:
        context = setting.compresses_context
        fed, more = (len(head), len(tail) + max_new_tokens) if context else (len(head) + len(tail), max_new_tokens)
        need = reservation(model, _cache(model, setting), fed, more).peak
        if not groups or used + need > kv_memory:
            groups.append([])
            used = 0
        groups[-1].append(setting)
        used += need
    return groups


def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sample: Sample,
    prompt: tuple[Sequence[int], Sequence[int]],
    settings: Sequence[Setting],
    kv_memory: int | None = None,
) -> Iterator[tuple[Setting, dict[str, Any]]]:
    """``sample``'s answers to its ``prompt`` (context part, question part) under each of ``settings``, each as a
    cell stores it (text, score, tokens, timings): what this process and a Ray task compute alike. The settings
    whose policy does not narrow attention are answered together (:func:`predict_together`), in groups whose caches
    fit ``kv_memory`` bytes (:func:`setting_groups`; default: half the memory free on the model's device), the
    others one by one (:func:`predict`), each handed over as it is made."""
    limit = max_new_tokens(sample.task)
    together = [s for s in settings if not get_policy(s.policy).narrows]
    if kv_memory is None:
        free = available_memory(model.device)
        kv_memory = None if free is None else free // 2
    answers = [
        predicted
        for group in setting_groups(model, together, prompt, limit, kv_memory)
        for predicted in predict_together(model, tokenizer, *prompt, group, limit)
    ]
    alone = ((s, predict(model, tokenizer, *prompt, s, limit)) for s in settings if s not in together)
    for setting, (text, n, first, total_s) in chain(zip(together, answers, strict=True), alone):
        yield setting, asdict(Prediction(text, score(sample.task, text, sample.answers), n, first, total_s))
