"""The HTTP side of ``kvsieve serve``: OpenAI-compatible routes over the :class:`~kvsieve.server.scheduler.Scheduler`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as server-sent events in OpenAI's chunk format
with ``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Errors are OpenAI's JSON
(``{"error": {"message", "type", "param"}}``): 400 for a request the server cannot run as asked, 404 for an unknown
model, 429 with ``Retry-After`` when the queue is full.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine.budget import parse_budget
from kvsieve.server.decoding import Sampler
from kvsieve.server.metrics import Metrics
from kvsieve.server.scheduler import (
    Delta,
    Event,
    Finished,
    Job,
    KVSpec,
    Overloaded,
    RequestError,
    Scheduler,
)
from kvsieve.server.schemas import ChatRequest, CompletionRequest, GenerationFields

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions
CHAT_MAX_TOKENS = 512  # (OpenAI's chat default is the rest of the context; the server needs a bound to reserve KV)

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None, kind: str, **headers: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers or None)


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
) -> FastAPI:
    """The server's app: one :class:`Scheduler` owning ``model``, started and stopped with the app."""
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

    def start(body: GenerationFields, prompt: list[int], default_tokens: int) -> tuple[Job, asyncio.Queue[Event]]:
        """Check ``body``, make its job and queue it; the queue its events arrive in."""
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server runs {model_name!r}", "model")
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        limit = body.token_limit() if isinstance(body, ChatRequest) else body.max_tokens
        if limit is None and scheduler.max_positions is not None:
            default_tokens = max(1, min(default_tokens, scheduler.max_positions - len(prompt)))
        spec = request_spec(body, defaults)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            with suppress(RuntimeError):  # (the event loop has closed: nobody is listening)
                loop.call_soon_threadsafe(events.put_nowait, event)

        sampler = Sampler(body.temperature, body.top_p, body.seed)
        try:
            job = scheduler.new_job(prompt, spec, limit or default_tokens, sampler, body.stop, emit)
        except RequestError as err:
            raise APIError(400, str(err), err.param) from None
        scheduler.submit(job)
        return job, events

    def encode(text: str, special: bool) -> list[int]:
        with scheduler.tokenizer_lock:
            return tokenizer(text, add_special_tokens=special).input_ids

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response:
        metrics.requests.labels("completions").inc()
        prompt = encode(body.prompt, True) if isinstance(body.prompt, str) else list(body.prompt)
        job, events = start(body, prompt, COMPLETION_MAX_TOKENS)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        meta["model"] = model_name

        def choice(text: str, reason: str | None) -> dict[str, Any]:
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        if body.stream:
            return stream(job, events, meta, choice, body)
        text, end = await collect(job, events)
        return JSONResponse({**meta, "choices": [choice(text, end.reason)], **report(end)})

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest) -> Response:
        metrics.requests.labels("chat").inc()
        if not tokenizer.chat_template:
            raise APIError(400, f"the model {model_name!r} has no chat template: use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        with scheduler.tokenizer_lock:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        job, events = start(body, encode(text, False), CHAT_MAX_TOKENS)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time())}
        meta["model"] = model_name
        if body.stream:
            first = [True]

            def delta(text: str, reason: str | None) -> dict[str, Any]:
                piece = {"role": "assistant", "content": text} if first[0] else {"content": text} if text else {}
                first[0] = False
                return {"index": 0, "delta": piece, "finish_reason": reason}

            return stream(job, events, {**meta, "object": "chat.completion.chunk"}, delta, body)
        text, end = await collect(job, events)
        message = {"role": "assistant", "content": text}
        choices = [{"index": 0, "message": message, "finish_reason": end.reason}]
        return JSONResponse({**meta, "choices": choices, **report(end)})

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


def request_spec(body: GenerationFields, defaults: KVSpec) -> KVSpec:
    """The request's cache: its ``kv_*`` fields over the server's defaults (``kv_policy`` alone drops the default
    parameters, which belong to the default policy)."""
    try:
        budget = defaults.budget if body.kv_budget is None else parse_budget(body.kv_budget)
    except ValueError as err:
        raise APIError(400, str(err), "kv_budget") from None
    params = body.kv_params if body.kv_params is not None else {} if body.kv_policy else defaults.params
    return KVSpec(body.kv_policy or defaults.policy, budget, dict(params))


def usage(end: Finished) -> dict[str, int]:
    total = end.prompt_tokens + end.completion_tokens
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens, "total_tokens": total}


def report(end: Finished) -> dict[str, Any]:
    """The response's usage and kvsieve fields."""
    return {"usage": usage(end), "kvsieve": end.kv}


async def collect(job: Job, events: asyncio.Queue[Event]) -> tuple[str, Finished]:
    """The whole text of a job and its end; a 500 if it failed."""
    pieces = []
    try:
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                pieces.append(event.text)
            elif isinstance(event, Finished):
                return "".join(pieces), event
            else:
                raise APIError(500, event.message, None, "server_error")
    finally:
        job.cancel()  # (a no-op once it ended; frees its rows if the handler was cancelled)


def stream(
    job: Job,
    events: asyncio.Queue[Event],
    meta: dict[str, Any],
    choice: Callable[[str, str | None], dict[str, Any]],
    body: GenerationFields,
) -> StreamingResponse:
    """Server-sent events: a chunk per piece of text, the last with the finish reason (and the kvsieve fields), a
    usage chunk if ``stream_options.include_usage``, then ``[DONE]``. A client that goes away cancels the job."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def sse(payload: Any) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def chunks() -> AsyncIterator[str]:
        try:
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    yield sse({**meta, "choices": [choice(event.text, None)]})
                elif isinstance(event, Finished):
                    yield sse({**meta, "choices": [choice("", event.reason)], "kvsieve": event.kv})
                    if include_usage:
                        yield sse({**meta, "choices": [], "usage": usage(event)})
                    break
                else:
                    yield sse({"error": {"message": event.message, "type": "server_error", "param": None}})
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()

    return StreamingResponse(chunks(), media_type="text/event-stream")
