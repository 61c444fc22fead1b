"""The HTTP side of ``kvsieve serve``: OpenAI-compatible routes over the :class:`~kvsieve.server.scheduler.Scheduler`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as server-sent events in OpenAI's chunk format
with ``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /tokenize``,
``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's: what lm-eval's ``tokenizer_backend=auto`` or ``remote``
tokenizes with). Errors are OpenAI's JSON
(``{"error": {"message", "type", "param"}}``): 400 for a request the server cannot run as asked, 401 without the API
key (when the server has one), 404 for an unknown model, 413 for a body over the limit, 429 with ``Retry-After``
when the queue is full.

Both take ``n`` (choices per prompt: the prompt prefilled once, its cache forked into ``n`` rows, row ``i`` sampled
with ``seed + i`` as vLLM does; usage counts each prompt once). Completions take a list of prompts (``n`` choices
each, prompt-major: choice ``p * n + i``; usage summed), ``logprobs`` (each generated token's
log-probability and the top ``logprobs``) and ``echo``; ``echo`` with ``logprobs`` scores the prompt as the lm-eval
model ``kvsieve`` does with ``protocol=stream`` (the request's policy, its ratio budget of the whole prompt, eviction
from the first token): lm-eval's ``local-completions`` model gets the log-likelihoods the in-process model computes.
Chat takes ``logprobs`` and ``top_logprobs``. Both take OpenAI's ``presence_penalty`` and ``frequency_penalty`` and
vLLM's ``repetition_penalty``, ``ignore_eos``, ``min_tokens`` and ``stop_token_ids``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from functools import cache
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine.budget import parse_budget
from kvsieve.server.decoding import Sampler, TokenLogprob
from kvsieve.server.jobs import Event, Job, KVSpec, Overloaded, RequestError
from kvsieve.server.metrics import Metrics
from kvsieve.server.responses import APIError, collect, error_response, report, stream
from kvsieve.server.scheduler import Scheduler
from kvsieve.server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationFields,
    TokenizeRequest,
)
from kvsieve.server.security import DEFAULT_MAX_BODY_MB, Guard

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions
CHAT_MAX_TOKENS = 512  # (OpenAI's chat default is the rest of the context; the server needs a bound to reserve KV)

logger = logging.getLogger(__name__)


def build_app(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name: str,
    defaults: KVSpec,
    kv_cap_bytes: int,
    max_batch: int = 16,
    max_queue: int = 64,
    prefill_tokens: int = 512,
    api_key: str | None = None,
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20),
) -> FastAPI:
    """The server's app: one :class:`Scheduler` owning ``model``, started and stopped with the app. ``api_key``:
    every path but ``/health`` needs ``Authorization: Bearer <api_key>``; a body over ``max_body_bytes`` is a 413
    (:mod:`kvsieve.server.security`)."""
    metrics = Metrics(kv_cap_bytes)
    scheduler = Scheduler(
        model,
        tokenizer,
        kv_cap_bytes=kv_cap_bytes,
        max_batch=max_batch,
        max_queue=max_queue,
        metrics=metrics,
        prefill_tokens=prefill_tokens,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        seconds, compiled = scheduler.warm_up(defaults)
        logger.info("warmed up %s in %.1f s (%d kernels compiled)", defaults.policy, seconds, compiled)
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="kvsieve", lifespan=lifespan)
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        on_reject=lambda reason: metrics.rejected.labels(reason).inc(),
    )
    app.state.scheduler = scheduler
    created = int(time.time())
    vocab = len(tokenizer)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels("invalid").inc()
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"][1:]) or None
        if error["type"] == "json_invalid":
            message = f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}"
        elif error["type"] == "extra_forbidden":
            message = f"unsupported parameter: {field}"
        elif error["type"] == "missing":
            message = f"missing required parameter: {field}"
        else:
            message = f"invalid {field}: {error['msg']}"
        return error_response(400, message, field, "invalid_request_error")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.rejected.labels("invalid").inc()
        return error_response(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        metrics.rejected.labels("queue_full").inc()
        return error_response(429, str(exc), None, "rate_limit_error", **{"Retry-After": str(exc.retry_after)})

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", None, "server_error")

    def start(
        body: GenerationFields, prompts: list[list[int]], default_tokens: int, *, logprobs: int | None, score: bool
    ) -> tuple[list[Job], asyncio.Queue[tuple[int, Event]]]:
        """Check ``body``, make a job per prompt (``n`` rows each) and queue them all; every row, and the queue their
        events arrive in, each with its choice's index (``prompt * n + row``). ``score``: the prompts are scored
        (echo)."""
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server runs {model_name!r}", "model")
        if any(not 0 <= t < vocab for prompt in prompts for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
            raise APIError(400, f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        limit = body.token_limit() if isinstance(body, ChatRequest) else body.max_tokens
        if limit is not None and body.min_tokens > limit:
            raise APIError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({limit})", "min_tokens")
        stop_ids = frozenset(body.stop_token_ids or ()) | (frozenset() if body.ignore_eos else scheduler.eos)
        spec = request_spec(body, defaults)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def emitter(index: int) -> Callable[[Event], None]:
            def emit(event: Event) -> None:
                with suppress(RuntimeError):  # (the event loop has closed: nobody is listening)
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))

            return emit

        jobs, n = [], body.n
        try:
            for index, prompt in enumerate(prompts):
                tokens = limit
                if tokens is None:
                    room = default_tokens if scheduler.max_positions is None else scheduler.max_positions - len(prompt)
                    tokens = max(1, min(default_tokens, room))
                samplers = [
                    Sampler(
                        body.temperature,
                        body.top_p,
                        None if body.seed is None else body.seed + row,
                        presence_penalty=body.presence_penalty,
                        frequency_penalty=body.frequency_penalty,
                        repetition_penalty=body.repetition_penalty,
                        prompt=prompt,
                        min_tokens=body.min_tokens,
                        suppressed=sorted(stop_ids),
                    )
                    for row in range(n)
                ]
                job = scheduler.new_job(
                    prompt,
                    spec,
                    tokens,
                    samplers,
                    body.stop,
                    [emitter(index * n + row) for row in range(n)],
                    logprobs=logprobs,
                    echo=score,
                    stop_ids=stop_ids,
                )
                jobs.append(job)
            scheduler.submit(*jobs)
        except RequestError as err:
            raise APIError(400, str(err), err.param) from None
        return [row for job in jobs for row in job.rows], events

    def encode(text: str, special: bool) -> list[int]:
        with scheduler.tokenizer_lock:
            return tokenizer(text, add_special_tokens=special).input_ids

    def decode(ids: list[int]) -> str:
        with scheduler.tokenizer_lock:
            return tokenizer.decode(ids)

    @cache
    def piece(token: int) -> str:
        """A token's own text (what a log-probability entry names it by)."""
        return decode([token])

    def completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
        """OpenAI's completions ``logprobs`` object; ``text_offset`` counts from ``offset``."""
        tokens = [piece(entry.token) for entry in entries]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
        top: list[dict[str, float] | None] = []
        for entry, token in zip(entries, tokens, strict=True):
            if entry.logprob is None:
                top.append(None)
            else:
                ranked = {piece(i): logprob for i, logprob in entry.top}
                ranked.setdefault(token, entry.logprob)  # (the chosen token is always there, as vLLM does)
                top.append(ranked)
        logprobs = [entry.logprob for entry in entries]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """OpenAI's chat ``logprobs`` object: ``content``, an entry per token."""

        def item(token: int, logprob: float | None) -> dict[str, Any]:
            text = piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(*t) for t in e.top]} for e in entries]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response:
        metrics.requests.labels("completions").inc()
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 only scores the prompt: set echo (and logprobs)", "max_tokens")
        prompts = [encode(p, True) if isinstance(p, str) else list(p) for p in body.prompt]
        score = body.echo and (body.logprobs is not None or body.max_tokens == 0)
        jobs, events = start(body, prompts, COMPLETION_MAX_TOKENS, logprobs=body.logprobs, score=score)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        meta["model"] = model_name
        given = zip(body.prompt, prompts, strict=True)
        heads = [
            (p if isinstance(p, str) else decode(ids)) if body.echo else "" for p, ids in given for _ in range(body.n)
        ]
        offsets = [0] * len(heads)

        def choice(index: int, text: str, entries: Sequence[TokenLogprob], reason: str | None) -> dict[str, Any]:
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(entries, offsets[index])
                offsets[index] += sum(len(token) for token in logprobs["tokens"])
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

        if body.stream:
            opening = [] if score else [choice(i, head, (), None) for i, head in enumerate(heads) if head]
            return stream(jobs, events, meta, choice, body, opening, heads)
        outcomes = await collect(jobs, events)
        choices = [
            choice(i, heads[i] + out.text, [*out.prompt, *out.tokens] if body.echo else out.tokens, out.end.reason)
            for i, out in enumerate(outcomes)
        ]
        return JSONResponse({**meta, "choices": choices, **report(outcomes, body.n)})

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest) -> Response:
        metrics.requests.labels("chat").inc()
        if not tokenizer.chat_template:
            raise APIError(400, f"the model {model_name!r} has no chat template: use /v1/completions", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        with scheduler.tokenizer_lock:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        jobs, events = start(body, [encode(text, False)], CHAT_MAX_TOKENS, logprobs=logprobs, score=False)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time())}
        meta["model"] = model_name
        if body.stream:
            opened: set[int] = set()  # (the choices whose first chunk, with the role, went out)

            def delta(index: int, text: str, entries: Sequence[TokenLogprob], reason: str | None) -> dict[str, Any]:
                first = index not in opened
                opened.add(index)
                content = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
                scored = chat_logprobs(entries) if logprobs is not None and entries else None
                return {"index": index, "delta": content, "logprobs": scored, "finish_reason": reason}

            chunk_meta = {**meta, "object": "chat.completion.chunk"}
            return stream(jobs, events, chunk_meta, delta, body, [], [""] * body.n)
        outcomes = await collect(jobs, events)
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(out.tokens) if logprobs is not None else None,
                "finish_reason": out.end.reason,
            }
            for index, out in enumerate(outcomes)
        ]
        return JSONResponse({**meta, "choices": choices, **report(outcomes, body.n)})

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server runs {model_name!r}", "model")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the token ids of a prompt, or of chat messages through the chat template."""
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt or messages", "prompt")
        if body.messages is not None:
            if not tokenizer.chat_template:
                raise APIError(400, f"the model {model_name!r} has no chat template", "messages")
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            with scheduler.tokenizer_lock:
                text = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=body.add_generation_prompt, tokenize=False
                )
            tokens = encode(text, bool(body.add_special_tokens))
        else:
            tokens = encode(body.prompt or "", body.add_special_tokens is not False)
        return {"count": len(tokens), "max_model_len": scheduler.max_positions, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's: the text of token ids."""
        check_model(body.model)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": decode(body.tokens)}

    info = tokenizer_info(tokenizer)

    @app.get("/tokenizer_info")
    async def served_tokenizer_info() -> dict[str, Any]:
        """vLLM's: the tokenizer's configuration (see :func:`tokenizer_info`)."""
        return info

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": model_name, "object": "model", "created": created, "owned_by": "kvsieve"}
        return {"object": "list", "data": [entry]}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = scheduler.alive
        return JSONResponse({"status": "ok" if ok else "down", **scheduler.snapshot()}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


def tokenizer_info(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What vLLM's ``/tokenizer_info`` serves: the tokenizer's ``init_kwargs`` (special tokens as their text, no
    file paths), its class, chat template and special tokens."""

    def plain(value: Any) -> Any:
        if hasattr(value, "content"):  # (an AddedToken)
            return value.content
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, str | int | float | bool) else str(value)

    config = {k: v for k, v in tokenizer.init_kwargs.items() if not k.endswith("_file") and k != "name_or_path"}
    specials = {name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return plain(
        {
            **config,
            **specials,
            "model_max_length": tokenizer.model_max_length,
            "chat_template": tokenizer.chat_template,
            "tokenizer_class": type(tokenizer).__name__,
        }
    )


def request_spec(body: GenerationFields, defaults: KVSpec) -> KVSpec:
    """The request's cache: its ``kv_*`` fields over the server's defaults (``kv_policy`` alone drops the default
    parameters, which belong to the default policy)."""
    try:
        budget = defaults.budget if body.kv_budget is None else parse_budget(body.kv_budget)
    except ValueError as err:
        raise APIError(400, str(err), "kv_budget") from None
    params = body.kv_params if body.kv_params is not None else {} if body.kv_policy else defaults.params
    return KVSpec(body.kv_policy or defaults.policy, budget, dict(params))
