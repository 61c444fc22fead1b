"""Who may call ``kvsieve serve`` and how much it reads: the API key (401 on every path but ``/health``), the body
limit (413 from ``Content-Length`` or from a streamed body, before parsing) and the warning for a server exposed
without a key; against a live server on 127.0.0.1 with the official client and raw HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from test_server import NAME, metric, serve  # noqa: F401 (serve: the live-server fixture)

from kvsieve.server.security import bearer_matches, exposure_warning, is_loopback

KEY = "sk-test-0123456789"
GOOD = {"model": NAME, "prompt": "Hello there", "max_tokens": 2, "temperature": 0}


def test_every_path_but_health_needs_the_key(serve) -> None:  # noqa: F811
    base = serve(api_key=KEY)
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/health").status_code == 200  # (a load balancer's check needs no key)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
                got = http.request(method, path, headers=headers, json=GOOD)
                assert got.status_code == 401, (method, path, headers)
                assert got.headers["www-authenticate"] == "Bearer"
                error = got.json()["error"]
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
                assert "API key" in error["message"] and "\n" not in error["message"]
        # Refused before the body is parsed: not even a 400 for invalid JSON.
        assert (
            http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}).status_code == 401
        )
        auth = {"Authorization": f"Bearer {KEY}"}
        assert http.post("/v1/completions", json=GOOD, headers=auth).status_code == 200
        assert http.get("/metrics", headers={"authorization": f"bearer {KEY}"}).status_code == 200  # (any case)
        refused = http.get("/metrics", headers=auth).text
    assert 'kvsieve_requests_rejected_total{reason="unauthorized"} 13.0' in refused

    right = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert right.completions.create(**GOOD).usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-other", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_a_server_without_a_key_serves_anyone(serve) -> None:  # noqa: F811
    base = serve()
    assert httpx.get(f"{base}/v1/models", timeout=60).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer x"}, timeout=60).status_code == 200


def test_bearer_matches() -> None:
    key = KEY.encode()
    assert bearer_matches(f"Bearer {KEY}".encode(), key) and bearer_matches(f"bearer  {KEY} ".encode(), key)
    for header in (None, b"", KEY.encode(), b"Bearer", b"Bearer ", f"Bearer {KEY}x".encode(), f"Token {KEY}".encode()):
        assert not bearer_matches(header, key), header


def chunked(body: bytes, size: int = 500) -> Iterator[bytes]:
    """``body`` as a generator: httpx sends it chunked, without a Content-Length."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def test_a_body_over_the_limit_is_413_before_parsing(serve) -> None:  # noqa: F811
    limit = 4000
    base = serve(max_body_bytes=limit)
    small = httpx.Request("POST", "/", json=GOOD).content
    big = httpx.Request("POST", "/", json={**GOOD, "prompt": "word " * 1000}).content
    assert len(small) < limit < len(big)
    json_type = {"content-type": "application/json"}
    with httpx.Client(base_url=base, timeout=60) as http:
        for content, headers in ((big, json_type), (chunked(big), json_type), (b"x" * (limit + 1), json_type)):
            got = http.post("/v1/completions", content=content, headers=headers)
            assert got.status_code == 413, got.text
            error = got.json()["error"]
            assert error["code"] == "request_too_large" and f"{limit} bytes" in error["message"]
        streamed = http.post("/v1/completions", content=chunked(small, 7), headers=json_type)  # (under the limit)
        assert streamed.status_code == 200 and streamed.json()["usage"]["completion_tokens"] == 2
        assert http.post("/v1/completions", content=small, headers=json_type).status_code == 200
    assert metric(base, 'kvsieve_requests_rejected_total{reason="too_large"}') == 3


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        *[("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True)],
        *[("0.0.0.0", False), ("::", False), ("192.168.1.4", False), ("example.org", False)],
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    assert (exposure_warning(host, None) is None) is loopback
    assert exposure_warning(host, KEY) is None


@pytest.fixture
def fake_serve(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``kvsieve serve`` without a model or a socket: what it passed to ``build_app`` and ``uvicorn.run``."""
    import uvicorn

    import kvsieve.cli.commands as commands
    import kvsieve.server.app as app

    seen: dict[str, Any] = {}
    monkeypatch.setattr(commands, "load_model_of", lambda args: ("model", "tokenizer"))
    monkeypatch.setattr(app, "build_app", lambda model, tokenizer, **options: seen.update(options) or "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: seen.update(run=options))
    monkeypatch.delenv("KVSIEVE_API_KEY", raising=False)
    return seen


def test_serve_warns_when_exposed_without_a_key_and_passes_key_and_limit(fake_serve, monkeypatch, capsys) -> None:
    from kvsieve.cli import main

    assert main(["serve", "--host", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: serving on 0.0.0.0 without an API key")
    assert fake_serve["api_key"] is None and fake_serve["max_body_bytes"] == 16 * 2**20
    assert fake_serve["run"]["host"] == "0.0.0.0"

    assert main(["serve", "--host", "0.0.0.0", "--api-key", KEY, "--max-body-mb", "0.5"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert fake_serve["api_key"] == KEY and fake_serve["max_body_bytes"] == 2**19

    monkeypatch.setenv("KVSIEVE_API_KEY", "from-env")
    assert main(["serve", "--host", "0.0.0.0"]) == 0
    assert "warning" not in capsys.readouterr().err and fake_serve["api_key"] == "from-env"
    assert main(["serve", "--api-key", KEY]) == 0 and fake_serve["api_key"] == KEY  # (the option wins)

    monkeypatch.delenv("KVSIEVE_API_KEY")
    assert main(["serve"]) == 0  # (127.0.0.1: no warning)
    assert "warning" not in capsys.readouterr().err and fake_serve["api_key"] is None
    assert main(["serve", "--max-body-mb", "0"]) == 2
