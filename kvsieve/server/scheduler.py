"""The server's worker: one thread owns the model, admits requests against the KV memory cap and decodes the running
ones together, one token each per step.

Each request has its own :class:`~kvsieve.engine.cache.SieveCache` (batch 1), made from its own policy spec and
budget (a ratio budget resolved against its own prompt): its tokens are exactly those of ``kvsieve.generate`` on
its prompt alone. A step prefills the requests admitted since the last one, each alone, then feeds every running
request its last token (one forward per request: the engine cannot join rows into a running cache, so requests
with different prompts, policies or budgets are stepped in turn). A request leaves when it ends or its client has
gone; its cache is dropped then.

Admission: a request's bytes are known before it runs (:mod:`kvsieve.server.memory`). Requests are admitted in
arrival order while the reservations of the running ones plus the next one's peak stay within the cap and fewer
than ``max_batch`` run; the others wait in a bounded queue; past it, :class:`Overloaded` (HTTP 429).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.api import eos_ids, make_cache
from kvsieve.engine.budget import Budget
from kvsieve.engine.cache import SieveCache
from kvsieve.policies import get_policy, resolve_spec
from kvsieve.server.decoding import Sampler, TextStream
from kvsieve.server.memory import Reservation, reservation
from kvsieve.server.metrics import Metrics

logger = logging.getLogger(__name__)


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
    """New text of a running request."""

    text: str


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


Event = Delta | Finished | Failed


@dataclass(eq=False)
class Job:
    """One request, from admission to its last token."""

    prompt: list[int]
    spec: KVSpec
    cache: SieveCache | None
    """Dropped when the job ends (its rows are freed then)."""
    reserved: Reservation
    max_tokens: int
    sampler: Sampler
    text: TextStream
    emit: Callable[[Event], None]
    """Hands an event to the request's HTTP handler (from the worker thread)."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    held: int = 0
    """Bytes its cache holds now."""
    peak: int = 0
    done: bool = False

    def __post_init__(self) -> None:
        self.budget_tokens = self.cache.budget_tokens

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


class Scheduler:
    """Owns the model in one worker thread (see the module docstring). ``start()`` before ``submit``."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        kv_cap_bytes: int,
        max_batch: int,
        max_queue: int,
        metrics: Metrics,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.kv_cap_bytes, self.max_batch, self.max_queue = kv_cap_bytes, max_batch, max_queue
        self.metrics = metrics
        self.tokenizer_lock = threading.Lock()  # (a fast tokenizer is not safe to use from two threads at once)
        self.eos = eos_ids(model, tokenizer)
        config = model.config.get_text_config()
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._reserved: dict[Job, int] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._step_seconds = 0.05  # (a running mean, for Retry-After)

    # -- the HTTP side ------------------------------------------------------------------------------------------

    def new_job(
        self,
        prompt: list[int],
        spec: KVSpec,
        max_tokens: int,
        sampler: Sampler,
        stop: list[str],
        emit: Callable[[Event], None],
    ) -> Job:
        """A job for ``prompt`` with its cache made and its bytes computed; a :class:`RequestError` for an unknown
        policy, a bad parameter or budget, or a request that exceeds the model's positions or could never fit the
        cap."""
        if not prompt:
            raise RequestError("the prompt is empty", "prompt")
        if self.max_positions is not None and len(prompt) + max_tokens > self.max_positions:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) exceed the model's "
                f"{self.max_positions} positions",
                "max_tokens",
            )
        try:
            get_policy(spec.policy)
        except ValueError as err:
            raise RequestError(str(err), "kv_policy") from None
        try:
            schedule = resolve_spec(spec.policy, spec.params)[2]
        except ValueError as err:
            raise RequestError(str(err), "kv_params" if spec.params else "kv_policy") from None
        if schedule == "profiled":
            raise RequestError("the profiled layer schedule runs the model: not available in the server", "kv_policy")
        try:
            cache = make_cache(self.model, spec.policy, spec.budget, **spec.params)
            cache.resolve(len(prompt))
        except ValueError as err:
            raise RequestError(str(err), "kv_budget") from None
        reserved = reservation(self.model, cache, len(prompt), max_tokens)
        if reserved.peak > self.kv_cap_bytes:
            raise RequestError(
                f"this request needs {reserved.peak} bytes of KV cache, more than the server's cap of "
                f"{self.kv_cap_bytes}: lower kv_budget or max_tokens",
                "kv_budget",
            )
        text = TextStream(self.tokenizer, stop, self.tokenizer_lock)
        return Job(prompt, spec, cache, reserved, max_tokens, sampler, text, emit)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (the worker admits it when it fits); :class:`Overloaded` if the queue is full."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(self.retry_after())
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def retry_after(self) -> int:
        """Seconds until a request that is queued now may be admitted: a rough estimate, at least 1."""
        mean_tokens = sum(j.max_tokens - len(j.generated) for j in self._running) / max(1, len(self._running))
        return max(1, round(mean_tokens * self._step_seconds))

    def snapshot(self) -> dict[str, int]:
        """Requests waiting and running, bytes reserved and held."""
        with self._cond:
            return {
                "waiting": len(self._waiting),
                "running": len(self._running),
                "kv_bytes_reserved": sum(self._reserved.values()),
                "kv_bytes_held": sum(job.held for job in self._running),
                "kv_bytes_cap": self.kv_cap_bytes,
            }

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvsieve-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the worker; requests still queued or running fail."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        for job in [*self._waiting, *self._running]:
            job.emit(Failed("the server is shutting down"))
        self._waiting.clear()
        self._running.clear()

    # -- the worker ---------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    return
                admitted = self._admit()
            started = time.perf_counter()
            for job in admitted:
                self._advance(job)
                with self._cond:
                    self._reserved[job] = job.reserved.steady  # (the prefill's transient buffer is gone)
            tokens = len(admitted)
            for job in self._running:
                if job not in admitted and not job.done:
                    self._advance(job)
                    tokens += 1
            seconds = time.perf_counter() - started
            self._step_seconds = 0.9 * self._step_seconds + 0.1 * seconds
            self.metrics.decode_rate.set(tokens / seconds if seconds > 0 else 0)
            self._retire()

    def _admit(self) -> list[Job]:
        """Move waiting jobs to running, in arrival order, while they fit (under the lock)."""
        admitted = []
        for job in [job for job in self._waiting if job.cancelled.is_set()]:
            self._waiting.remove(job)
            self._end(job, "cancelled")
        while self._waiting and len(self._running) < self.max_batch:
            job = self._waiting[0]
            if sum(self._reserved.values()) + job.reserved.peak > self.kv_cap_bytes:
                break
            self._waiting.popleft()
            self._running.append(job)
            self._reserved[job] = job.reserved.peak
            admitted.append(job)
            self.metrics.admitted.inc()
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.running.set(len(self._running))
        self.metrics.kv_reserved.set(sum(self._reserved.values()))
        return admitted

    def _advance(self, job: Job) -> None:
        """Feed ``job`` its prompt (first step) or its last token, and hand out the next token."""
        if job.cancelled.is_set():
            self._end(job, "cancelled")
            return
        try:
            first = not job.generated
            ids = job.prompt if first else job.generated[-1:]
            input_ids = torch.tensor([ids], device=self.model.device)
            with torch.inference_mode():
                out = self.model(input_ids=input_ids, past_key_values=job.cache, use_cache=True, logits_to_keep=1)
            token = job.sampler(out.logits[0, -1].float())
            job.generated.append(token)
            job.held = job.cache.nbytes()
            job.peak = max(job.peak, job.held)
            piece, stopped = job.text.push(token)
        except Exception as err:  # a request never takes the server down
            logger.exception("request failed")
            job.emit(Failed(f"generation failed: {type(err).__name__}: {err}"))
            self._end(job, "error")
            return
        if first:
            self.metrics.prompt_tokens.inc(len(job.prompt))
            self.metrics.ttft.observe(time.perf_counter() - job.arrived)
        self.metrics.generation_tokens.inc()
        reason = "stop" if stopped or token in self.eos else "length" if len(job.generated) >= job.max_tokens else None
        if reason is not None:
            piece += job.text.flush()
        if piece:
            job.emit(Delta(piece))
        if reason is not None:
            job.emit(Finished(reason, len(job.prompt), len(job.generated), job.kv_report()))
            self._end(job, reason)

    def _end(self, job: Job, reason: str) -> None:
        job.done, job.cache, job.held = True, None, 0
        self.metrics.finished.labels(reason).inc()

    def _retire(self) -> None:
        """Drop the jobs that ended (their caches with them) and record the bytes held."""
        with self._cond:
            self._running = [job for job in self._running if not job.done]
            for job in [job for job in self._reserved if job.done]:
                del self._reserved[job]
            self.metrics.running.set(len(self._running))
            self.metrics.kv_reserved.set(sum(self._reserved.values()))
            self.metrics.held(sum(job.held for job in self._running))
