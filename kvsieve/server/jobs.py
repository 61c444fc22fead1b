"""What the server's worker runs and hands back: a request's cache settings (:class:`KVSpec`), each row of a request
(:class:`Job`), the events a request's HTTP handler receives (:data:`Event`), and the errors a request may get before
it runs (:class:`RequestError`: a 400, :class:`Overloaded`: a 429)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsieve.engine.budget import Budget
from kvsieve.engine.cache import SieveCache
from kvsieve.engine.memory import Reservation
from kvsieve.server.decoding import Sampler, TextStream, TokenLogprob


class Overloaded(Exception):
    """The queue is full: try again after ``retry_after`` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is at its KV memory cap and its queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class RequestError(ValueError):
    """A request the server cannot run as asked; ``param``: the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class KVSpec:
    """A request's cache: policy (name or spec), budget (tokens, a ratio of the prompt, or None) and parameters."""

    policy: str
    budget: Budget | None
    params: dict[str, Any]


@dataclass(frozen=True)
class Delta:
    """New text of a running request, and the log-probabilities of the tokens generated since the last delta (when
    the request asked for them)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Scored:
    """The log-probabilities of a request's prompt tokens (``echo`` with ``logprobs``), the first one's None."""

    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Finished:
    """A request ended: ``reason`` is ``stop`` (EOS or a stop string) or ``length``."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    kv: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """A request failed while running (the server goes on)."""

    message: str


Event = Scored | Delta | Finished | Failed


@dataclass(eq=False)
class Job:
    """One row of a request (a choice of one prompt), from admission to its last token."""

    prompt: list[int]
    spec: KVSpec
    cache: SieveCache | None
    """The prompt's cache, held by its first row until it joins a batch or every row ended."""
    reserved: Reservation
    max_tokens: int
    sampler: Sampler
    text: TextStream
    emit: Callable[[Event], None]
    """Hands an event to the request's HTTP handler (from the worker thread)."""
    logprobs: int | None = None
    """Report each generated token's log-probability and the top ``logprobs`` (None: none)."""
    echo: bool = False
    """Score the prompt (under the stream protocol) before generating: a :class:`Scored` event."""
    stop_ids: frozenset[int] = frozenset()
    """Tokens that end it (EOS unless ``ignore_eos``, and ``stop_token_ids``)."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    pending: list[TokenLogprob] = field(default_factory=list)
    """Log-probabilities of generated tokens not handed out yet (their text may be held back)."""
    peak: int = 0
    """The most bytes its cache held after a step (in a batch: the batch's bytes over its rows)."""
    done: bool = False
    budget_tokens: int | None = None
    rows: list[Job] = field(default_factory=list)
    """Every row of its prompt, this one included (``n`` > 1: forked from one prefill); the first is queued."""

    def __post_init__(self) -> None:
        self.rows = self.rows or [self]

    @property
    def position(self) -> int:
        """The position of the token fed next (the last generated one)."""
        return len(self.prompt) + len(self.generated) - 1

    def cancel(self) -> None:
        """The client has gone: the worker drops the request at its next step."""
        self.cancelled.set()

    def kv_report(self) -> dict[str, Any]:
        """What the response reports about the request's cache."""
        return {
            "policy": self.spec.policy,
            "budget": self.spec.budget,
            "budget_tokens": self.budget_tokens,
            "kv_bytes": self.peak,
            "kv_bytes_reserved": self.reserved.steady,
        }
