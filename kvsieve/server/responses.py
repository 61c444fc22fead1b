"""What ``kvsieve serve`` answers: OpenAI's error JSON, and a request's jobs' events turned into a response,
collected (one JSON body) or streamed (server-sent events in OpenAI's chunk format)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from kvsieve.server.decoding import TokenLogprob
from kvsieve.server.jobs import Delta, Event, Finished, Job, Scored
from kvsieve.server.schemas import GenerationFields


class APIError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None, kind: str, **headers: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers or None)


def usage(ends: Sequence[Finished], n: int) -> dict[str, int]:
    """OpenAI's usage, summed over a request's choices (``n`` per prompt: its prompt counted once)."""
    prompt = sum(end.prompt_tokens for end in ends) // n
    completion = sum(end.completion_tokens for end in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class Outcome:
    """What one prompt of a request gave: its text, its prompt's and generated tokens' log-probabilities (when
    asked) and its end."""

    pieces: list[str] = field(default_factory=list)
    prompt: tuple[TokenLogprob, ...] = ()
    tokens: list[TokenLogprob] = field(default_factory=list)
    ended: Finished | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def end(self) -> Finished:
        assert self.ended is not None
        return self.ended


def report(outcomes: Sequence[Outcome], n: int) -> dict[str, Any]:
    """The response's usage and kvsieve fields (the cache of its one choice, or a list: one per choice)."""
    kv = [out.end.kv for out in outcomes]
    return {"usage": usage([out.end for out in outcomes], n), "kvsieve": kv[0] if len(kv) == 1 else kv}


async def collect(jobs: Sequence[Job], events: asyncio.Queue[tuple[int, Event]]) -> list[Outcome]:
    """What each job gave once all ended; a 500 if one failed."""
    outcomes = [Outcome() for _ in jobs]
    left = len(jobs)
    try:
        while left:
            index, event = await events.get()
            out = outcomes[index]
            if isinstance(event, Scored):
                out.prompt = event.logprobs
            elif isinstance(event, Delta):
                out.pieces.append(event.text)
                out.tokens.extend(event.logprobs)
            elif isinstance(event, Finished):
                out.ended = event
                left -= 1
            else:
                raise APIError(500, event.message, None, "server_error")
        return outcomes
    finally:
        for job in jobs:
            job.cancel()  # (a no-op once it ended; frees its rows if the handler was cancelled)


Choice = Callable[[int, str, Sequence[TokenLogprob], str | None], dict[str, Any]]
"""``(index, text, log-probabilities, finish reason)`` → a choice of a chunk."""


def stream(
    jobs: Sequence[Job],
    events: asyncio.Queue[tuple[int, Event]],
    meta: dict[str, Any],
    choice: Choice,
    body: GenerationFields,
    opening: list[dict[str, Any]],
    heads: list[str],
) -> StreamingResponse:
    """Server-sent events: the ``opening`` choices, a chunk per scored prompt (its text ``heads[i]``) and per piece
    of text, each prompt's last with its finish reason (and its kvsieve fields), a usage chunk if
    ``stream_options.include_usage``, then ``[DONE]``. A client that goes away cancels the jobs."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def sse(payload: Any) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def chunks() -> AsyncIterator[str]:
        ends: list[Finished] = []
        try:
            for opened in opening:
                yield sse({**meta, "choices": [opened]})
            while len(ends) < len(jobs):
                index, event = await events.get()
                if isinstance(event, Scored):
                    yield sse({**meta, "choices": [choice(index, heads[index], event.logprobs, None)]})
                elif isinstance(event, Delta):
                    yield sse({**meta, "choices": [choice(index, event.text, event.logprobs, None)]})
                elif isinstance(event, Finished):
                    ends.append(event)
                    yield sse({**meta, "choices": [choice(index, "", (), event.reason)], "kvsieve": event.kv})
                else:
                    yield sse({"error": {"message": event.message, "type": "server_error", "param": None}})
                    break
            else:
                if include_usage:
                    yield sse({**meta, "choices": [], "usage": usage(ends, body.n)})
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancel()

    return StreamingResponse(chunks(), media_type="text/event-stream")
