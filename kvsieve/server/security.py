"""Who may call the server and how much it reads: an ASGI middleware in front of every route.

With an API key, every path but ``/health`` answers 401 unless the request carries ``Authorization: Bearer KEY``
(compared in constant time). A body longer than ``max_body_bytes`` answers 413 before anything parses it: at once
from its ``Content-Length``, else as soon as the bytes streamed in pass the limit. Both are OpenAI's error JSON.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key (a load balancer's health check)."""
DEFAULT_MAX_BODY_MB = 16.0
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server reachable from other machines that anyone may call (None when it is not)."""
    if api_key or is_loopback(host):
        return None
    return (
        f"warning: serving on {host} without an API key: anyone who can reach this address may use the model "
        "(set --api-key or KVSIEVE_API_KEY)"
    )


def bearer_matches(header: bytes | None, api_key: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (the key compared in constant time)."""
    if header is None:
        return False
    scheme, _, token = header.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key)


class Guard:
    """The ASGI middleware (see the module docstring). ``on_reject(reason)`` counts a refusal (``unauthorized``,
    ``too_large``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        on_reject: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        open_path = self.api_key is None or scope["path"] in OPEN_PATHS
        if not open_path and not bearer_matches(headers.get(b"authorization"), self.api_key):
            self.on_reject("unauthorized")
            message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
            await refuse(send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        body = bytearray()
        while True:  # (the whole body, counted as it streams in; replayed to the app below)
            message = await receive()
            if message["type"] != "http.request":
                return  # (the client went away)
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # (http.disconnect: a streaming response notices that its client has gone)

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        self.on_reject("too_large")
        message = f"the request body is larger than the server's limit of {self.max_body_bytes} bytes"
        await refuse(send, 413, message, "request_too_large")


async def refuse(
    send: Send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer OpenAI's error JSON with ``status``."""
    payload = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    body = json.dumps(payload).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
