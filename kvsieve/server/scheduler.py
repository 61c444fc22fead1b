"""The server's worker: one thread owns the model, admits requests against the KV memory cap and decodes the running
ones together (continuous batching), one token each per step.

Each request gets its own :class:`~kvsieve.engine.cache.SieveCache`, made from its own policy spec and budget (a
ratio budget resolved against its own prompt), and is prefilled alone: what it keeps is exactly what
``kvsieve.generate`` keeps on its prompt alone. A step prefills admitted requests (up to ``prefill_tokens``), then
decodes every running batch one token (one forward pass per batch, each row at its own position), then lets the new
requests join a batch of caches made alike (same policy, parameters and budget in tokens:
:meth:`~kvsieve.engine.cache.SieveCache.join`) or start one. Requests with different policies or budgets decode
in different batches, one forward pass each. A request that asks for the log-probabilities of its prompt (``echo``
with ``logprobs``) is prefilled under the stream protocol (eviction from its first token, as the lm-eval model
``kvsieve`` scores with ``protocol=stream``), every position's logits kept; one with ``max_tokens=0`` ends there.
A request leaves at the step after it ends or its client goes: its
rows are dropped (``batch_select_indices``). A request for ``n`` choices is prefilled once and its cache forked into
``n`` rows (``batch_repeat_interleave``), each sampled on its own; the rows join a batch together.

Before serving, :meth:`Scheduler.warm_up` runs the default policy once over a prompt longer than its budget, so that
compiling kernels and first-use allocations are not paid by the first request; a step that compiles anyway (another
policy's first use) counts its kernels in ``kvsieve_kernels_compiled`` and leaves the decode rate as it was.

Admission: a request's bytes are known before it runs (:mod:`kvsieve.engine.memory`). Requests are admitted in
arrival order while the reservations of the running ones plus the next one's peak (times its rows: all or none)
stay within the cap and at most ``max_batch`` rows run; the others wait in a bounded queue; past it,
:class:`Overloaded` (HTTP 429).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.api import eos_ids, make_cache
from kvsieve.engine.cache import SieveCache
from kvsieve.engine.compiled import compilations
from kvsieve.engine.memory import reservation
from kvsieve.evaluation.compare import greedy_continue
from kvsieve.policies import get_policy, resolve_spec
from kvsieve.server.decoding import Sampler, TextStream, TokenLogprob, token_logprobs
from kvsieve.server.jobs import Delta, Event, Failed, Finished, Job, KVSpec, Overloaded, RequestError, Scored
from kvsieve.server.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Batch:
    """Running jobs decoded together: the rows of one cache, in the jobs' order. ``key``: what a job must share to
    join (see :meth:`Scheduler._place`)."""

    key: str
    cache: SieveCache
    jobs: list[Job]


class Scheduler:
    """Owns the model in one worker thread (see the module docstring). ``start()`` before ``submit``.

    A step prefills admitted requests up to ``prefill_tokens`` prompt tokens (at least one request), so that the
    running requests' next token waits for at most about that much prefill."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        kv_cap_bytes: int,
        max_batch: int,
        max_queue: int,
        metrics: Metrics,
        prefill_tokens: int = 512,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.kv_cap_bytes, self.max_batch, self.max_queue = kv_cap_bytes, max_batch, max_queue
        self.prefill_tokens = prefill_tokens
        self.metrics = metrics
        self.tokenizer_lock = threading.Lock()  # (a fast tokenizer is not safe to use from two threads at once)
        self.eos = eos_ids(model, tokenizer)
        config = model.config.get_text_config()
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._batches: list[Batch] = []
        self._unprefilled: deque[Job] = deque()  # admitted, waiting for their prefill
        self._held = 0
        self._steps = 0
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
        samplers: Sequence[Sampler],
        stop: list[str],
        emits: Sequence[Callable[[Event], None]],
        *,
        logprobs: int | None = None,
        echo: bool = False,
        stop_ids: frozenset[int] | None = None,
    ) -> Job:
        """A job for ``prompt`` with its cache made and its bytes computed, a row per sampler (each row's events go
        to its emit; the rows are :attr:`Job.rows`); a :class:`RequestError` for an unknown policy, a bad parameter
        or budget, or a request that exceeds the model's positions or whose rows could never fit the cap or a batch.
        ``logprobs``: report the generated tokens' log-probabilities (and the top ``logprobs``); ``echo``: score the
        prompt too (then ``max_tokens`` may be 0); ``stop_ids``: the tokens that end it (default: EOS)."""
        n = len(samplers)
        if not 1 <= n <= self.max_batch or len(emits) != n:
            raise RequestError(f"n must be between 1 and the server's batch of {self.max_batch} rows", "n")
        if not prompt:
            raise RequestError("the prompt is empty", "prompt")
        if max_tokens < (0 if echo else 1):
            raise RequestError("max_tokens must be at least 1 (0 only to score the prompt: echo)", "max_tokens")
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
        if get_policy(spec.policy).probed:
            raise RequestError(
                f"{get_policy(spec.policy).name} compresses a context by passes of its own before any question: not "
                "available for a request's prompt (compress the context with kvsieve.compress)",
                "kv_policy",
            )
        try:
            cache = make_cache(self.model, spec.policy, spec.budget, **spec.params)
            cache.resolve(len(prompt))
        except ValueError as err:
            raise RequestError(str(err), "kv_budget") from None
        reserved = reservation(self.model, cache, len(prompt), max(max_tokens, 1))
        if n * reserved.peak > self.kv_cap_bytes:
            rows = "" if n == 1 else f"{n} × "
            raise RequestError(
                f"this request needs {rows}{reserved.peak} bytes of KV cache, more than the server's cap of "
                f"{self.kv_cap_bytes}: lower kv_budget, max_tokens or n",
                "kv_budget" if reserved.peak > self.kv_cap_bytes else "n",
            )
        ends = frozenset(self.eos if stop_ids is None else stop_ids)
        text = functools.partial(TextStream, self.tokenizer, stop, self.tokenizer_lock)
        pairs = zip(samplers, emits, strict=True)
        rows = [
            Job(prompt, spec, None, reserved, max_tokens, sampler, text(sampler.min_tokens), emit)
            for sampler, emit in pairs
        ]
        for row in rows:
            row.logprobs, row.echo, row.stop_ids = logprobs, echo, ends
            row.budget_tokens, row.rows = cache.budget_tokens, rows
        rows[0].cache = cache
        return rows[0]

    def submit(self, *jobs: Job) -> None:
        """Queue ``jobs`` (from :meth:`new_job`, with their rows) all or none (the worker admits each when it fits):
        :class:`Overloaded` if the queue has no room for them all, a :class:`RequestError` if it never can."""
        if len(jobs) > self.max_queue:
            raise RequestError(f"at most {self.max_queue} prompts per request (the server's queue)", "prompt")
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise Overloaded(self.retry_after())
            self._waiting.extend(jobs)
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
                "kv_bytes_held": self._held,
                "kv_bytes_cap": self.kv_cap_bytes,
            }

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def warm_up(self, spec: KVSpec, steps: int = 4) -> tuple[float, int]:
        """Run ``spec`` once (outside any request and its metrics) over a prompt longer than its budget, then
        ``steps`` decode steps at the budget; returns the seconds it took and the kernels it compiled."""
        started, compiled = time.perf_counter(), compilations()
        budget = spec.budget
        length = budget + 8 if isinstance(budget, int) else 64
        length = min(length, (self.max_positions or length + steps) - steps)
        prompt = torch.full((1, length), self.tokenizer.eos_token_id or 0, device=self.model.device)
        cache = make_cache(self.model, spec.policy, budget, **spec.params)
        cache.resolve(length)
        with torch.inference_mode():
            self.model(input_ids=prompt[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
        greedy_continue(self.model, cache, prompt[:, -1:], steps)
        compiled = compilations() - compiled
        self.metrics.kernels_compiled.inc(compiled)
        return time.perf_counter() - started, compiled

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
        for row in [*(row for job in self._waiting for row in job.rows), *self._running]:
            row.emit(Failed("the server is shutting down"))
        self._waiting.clear()
        self._running.clear()
        self._unprefilled.clear()

    # -- the worker ---------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as err:  # (a bug outside a forward pass: the running requests fail, the server goes on)
                logger.exception("scheduler step failed")
                for job in self._running:
                    if not job.done:
                        job.emit(Failed(f"the server failed: {type(err).__name__}: {err}"))
                        self._end(job, "error")
                self._batches = []
                self._retire()

    def _step(self) -> None:
        """Admit, prefill the admitted jobs, decode every batch one token, place the new jobs in batches."""
        self._retire()  # (rows of requests whose clients have gone leave before the step)
        self._steps += 1
        with self._cond:
            self._unprefilled.extend(self._admit())
        admitted, budget = [], self.prefill_tokens
        while self._unprefilled and (not admitted or len(self._unprefilled[0].prompt) <= budget):
            admitted.append(job := self._unprefilled.popleft())
            budget -= len(job.prompt)
        started, compiled = time.perf_counter(), compilations()
        tokens = 0
        for job in admitted:
            if self._stopping:  # (stop() fails what is left)
                return
            if all(row.done for row in job.rows):  # (cancelled while it waited for its prefill)
                continue
            ids = torch.tensor([job.prompt], device=self.model.device)
            if job.echo:  # (scored as the lm-eval model's stream protocol: eviction from the first token)
                with job.cache.streaming(True):
                    self._run(job.cache, job.rows, ids, None, score=True)
            else:
                self._run(job.cache, job.rows, ids, None)
            tokens += len(job.rows)
            with self._cond:
                for row in job.rows:
                    if not row.done:
                        self._reserved[row] = row.reserved.steady  # (the prefill's transient buffer is gone)
        for batch in self._batches:
            if self._stopping:
                return
            jobs = batch.jobs
            ids = torch.tensor([[job.generated[-1]] for job in jobs], device=self.model.device)
            positions = torch.tensor([[job.position] for job in jobs], device=self.model.device)
            self._run(batch.cache, jobs, ids, positions)
            self.metrics.batch_rows.observe(len(jobs))
            tokens += len(jobs)
        for job in admitted:
            if not all(row.done for row in job.rows):
                self._place(job)
        seconds = time.perf_counter() - started
        self._step_seconds = 0.9 * self._step_seconds + 0.1 * seconds
        compiled = compilations() - compiled
        if compiled:  # (the step paid for first use: not a decode rate)
            self.metrics.kernels_compiled.inc(compiled)
        else:
            self.metrics.decode_rate.set(tokens / seconds if seconds > 0 else 0)
        self._retire()

    def _admit(self) -> list[Job]:
        """Move waiting jobs to running, in arrival order, while they fit (under the lock)."""
        admitted = []
        for job in [job for job in self._waiting if all(row.cancelled.is_set() for row in job.rows)]:
            self._waiting.remove(job)
            for row in job.rows:
                self._end(row, "cancelled")
        while self._waiting and len(self._running) + len(self._waiting[0].rows) <= self.max_batch:
            job = self._waiting[0]
            if sum(self._reserved.values()) + len(job.rows) * job.reserved.peak > self.kv_cap_bytes:
                break
            self._waiting.popleft()
            self._running.extend(job.rows)
            self._reserved.update((row, row.reserved.peak) for row in job.rows)
            admitted.append(job)
            self.metrics.admitted.inc(len(job.rows))
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.running.set(len(self._running))
        self.metrics.kv_reserved.set(sum(self._reserved.values()))
        return admitted

    def _place(self, job: Job) -> None:
        """After its prefill: ``job``'s rows join a running batch of caches made alike, or start one. Its rows, padded
        to the batch's slots, must stay within its reservation: a request whose every layer holds ``budget + 1`` slots
        once it evicts joins any batch of its layout; any other (``full``, or too short to fill its budget: slots
        that grow with the tokens fed) only one started in the same step with the same prompt length and
        ``max_tokens`` (the same slots at every step)."""
        reserved = job.reserved
        key = (
            reserved.layout if reserved.fixed else repr((reserved.layout, len(job.prompt), job.max_tokens, self._steps))
        )
        rows = job.rows
        batch = next((b for b in self._batches if b.key == key and len(b.jobs) + len(rows) <= self.max_batch), None)
        if batch is None:
            self._batches.append(Batch(key, job.cache, list(rows)))
        else:
            batch.cache.join(job.cache)
            batch.jobs.extend(rows)
        job.cache = None

    def _run(
        self,
        cache: SieveCache,
        jobs: list[Job],
        ids: torch.Tensor,
        positions: torch.Tensor | None,
        score: bool = False,
    ) -> None:
        """One forward pass of ``jobs``' rows of ``cache``: each job's last token, or (``positions`` None) the
        prompt of one row that ``jobs`` share, its cache then forked into a row each; each job gets its next token.
        ``score``: the prompt is scored from every position's logits first."""
        try:
            with torch.inference_mode():
                keep = 0 if score else 1
                out = self.model(
                    input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=keep
                )
            logits = out.logits[:, -1].float()
            if positions is None:  # (a prompt prefilled: counted once, whatever its rows)
                self.metrics.prompt_tokens.inc(len(jobs[0].prompt))
                self.metrics.ttft.observe(time.perf_counter() - jobs[0].arrived)
                if len(jobs) > 1:
                    cache.batch_repeat_interleave(len(jobs))
                    logits = logits.expand(len(jobs), -1)
            held = cache.nbytes() // len(jobs)
            if score:
                prompt = jobs[0].prompt
                scored = token_logprobs(out.logits[0, :-1], prompt[1:], jobs[0].logprobs or 0)
                for job in jobs:
                    job.emit(Scored((TokenLogprob(prompt[0], None), *scored)))
                if jobs[0].max_tokens == 0:
                    for job in jobs:
                        if not job.done:
                            self._score_only(job, held)
                    return
            del out
            for job, row in zip(jobs, logits, strict=True):
                if job.done:  # (a row of a prompt cancelled before its prefill: dropped after the step)
                    continue
                token = job.sampler(row)
                entry = None if job.logprobs is None else token_logprobs(row[None], [token], job.logprobs)[0]
                self._emit(job, token, held, entry)
        except Exception as err:  # a request never takes the server down (a failed batch fails its requests)
            logger.exception("generation failed")
            for job in jobs:
                if not job.done:
                    job.emit(Failed(f"generation failed: {type(err).__name__}: {err}"))
                    self._end(job, "error")

    def _score_only(self, job: Job, held: int) -> None:
        """End a job that only scores its prompt (``max_tokens=0``)."""
        job.peak = max(job.peak, held)
        job.emit(Finished("length", len(job.prompt), 0, job.kv_report()))
        self._end(job, "length")

    def _emit(self, job: Job, token: int, held: int, logprob: TokenLogprob | None = None) -> None:
        """Hand out ``job``'s next token (and its log-probability); end it at EOS, a stop string or
        ``max_tokens``."""
        job.generated.append(token)
        job.peak = max(job.peak, held)
        if logprob is not None:
            job.pending.append(logprob)
        piece, stopped = job.text.push(token)
        self.metrics.generation_tokens.inc()
        reason = (
            "stop" if stopped or token in job.stop_ids else "length" if len(job.generated) >= job.max_tokens else None
        )
        if reason is not None:
            piece += job.text.flush()
        if piece or (reason is not None and job.pending):
            job.emit(Delta(piece, tuple(job.pending)))
            job.pending.clear()
        if reason is not None:
            job.emit(Finished(reason, len(job.prompt), len(job.generated), job.kv_report()))
            self._end(job, reason)

    def _end(self, job: Job, reason: str) -> None:
        job.done = True
        if all(row.done for row in job.rows):
            job.rows[0].cache = None  # (a prompt's cache not in a batch: freed with its last row)
        self.metrics.finished.labels(reason).inc()

    def _retire(self) -> None:
        """Drop the rows of the jobs that ended or were cancelled (and the batches left empty); record the bytes
        held."""
        for job in self._running:
            if job.cancelled.is_set() and not job.done:
                self._end(job, "cancelled")
        for batch in self._batches:
            keep = [i for i, job in enumerate(batch.jobs) if not job.done]
            if 0 < len(keep) < len(batch.jobs):
                batch.cache.batch_select_indices(torch.tensor(keep, device=self.model.device))
            batch.jobs = [batch.jobs[i] for i in keep]
        with self._cond:
            self._batches = [batch for batch in self._batches if batch.jobs]
            self._running = [job for job in self._running if not job.done]
            for job in [job for job in self._reserved if job.done]:
                del self._reserved[job]
            self.metrics.running.set(len(self._running))
            self.metrics.kv_reserved.set(sum(self._reserved.values()))
            self._held = sum(batch.cache.nbytes() for batch in self._batches)
            self.metrics.held(self._held)
