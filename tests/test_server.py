"""``kvsieve serve`` against the official ``openai`` client and raw HTTP: a live uvicorn server on 127.0.0.1 (a free
port) in a background thread, always stopped. The tiny Llama with the real tokenizer keeps it fast; the greedy
output of every request must be ``kvsieve.generate``'s with the same policy and budget."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import openai
import pytest
import torch
import uvicorn

import kvsieve
from kvsieve.server.app import build_app
from kvsieve.server.decoding import TextStream
from kvsieve.server.memory import reservation
from kvsieve.server.scheduler import KVSpec

NAME = "tiny"
PROMPTS = [
    "The history of the city begins with a small settlement on the river, where traders met every spring",
    "Photosynthesis converts light energy into chemical energy stored in sugar molecules inside the",
    "In 1905 Albert Einstein published four papers that changed physics, among them one on",
    "A recipe for bread: mix flour, water, salt and yeast, knead the dough for ten minutes, then",
]
# (policy, budget, params): int and ratio budgets, positional and attention-observing policies, an unbounded one
MIXED = [
    ("h2o", 12, {}),
    ("h2o", 0.5, {"recent": 3}),
    ("streaming_llm", 10, {"sink": 2}),
    ("scissorhands", 14, {}),
    ("local", 8, {}),
    ("full", None, {}),
    ("tova", 0.4, {}),
    ("knorm", 16, {}),
]


@contextmanager
def running(app) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 at a free port in a thread; its base URL. Stopped on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture
def serve(tiny_lm) -> Iterator[Callable[..., str]]:
    """``serve(**build_app options) -> base URL`` of a live server on the tiny model (stopped after the test)."""
    model, tokenizer = tiny_lm
    with ExitStack() as stack:

        def start(**options) -> str:
            options = {"defaults": KVSpec("h2o", 16, {}), "kv_cap_bytes": 2**30, **options}
            return stack.enter_context(running(build_app(model, tokenizer, model_name=NAME, **options)))

        yield start


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def solo(tiny_lm, prompt: str, policy: str, budget, params: dict, tokens: int) -> str:
    model, tokenizer = tiny_lm
    return kvsieve.generate(model, tokenizer, prompt, policy, budget, tokens, policy_kwargs=params).text


def kv_body(policy: str, budget, params: dict) -> dict:
    return {"kv_policy": policy, "kv_budget": budget, "kv_params": params}


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_completions_chat_and_streams_equal_generate(serve, tiny_lm) -> None:
    base = serve()
    api = client(base)
    assert [m.id for m in api.models.list().data] == [NAME]
    prompt = PROMPTS[0]

    # Non-streaming, the server's defaults (h2o, 16 tokens).
    out = api.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    assert out.choices[0].text == solo(tiny_lm, prompt, "h2o", 16, {}, 20)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 20
    assert out.usage.prompt_tokens == len(tiny_lm[1](prompt).input_ids)
    assert out.kvsieve["policy"] == "h2o" and out.kvsieve["budget_tokens"] == 16
    assert 0 < out.kvsieve["kv_bytes"] == out.kvsieve["kv_bytes_reserved"]  # (the prompt exceeds the budget)

    # extra_body: another policy, a ratio budget (resolved against this prompt), parameters; streamed.
    body = kv_body("streaming_llm", 0.4, {"sink": 2})
    chunks = list(
        api.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body=body)
    )
    text = "".join(c.choices[0].text for c in chunks)
    assert text == solo(tiny_lm, prompt, "streaming_llm", 0.4, {"sink": 2}, 20)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].kvsieve["budget_tokens"] == round(0.4 * out.usage.prompt_tokens)

    # Chat, with the tokenizer's chat template, non-streaming and streaming.
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    templated = tiny_lm[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = solo(tiny_lm, templated, "h2o", 24, {}, 12)
    chat = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0, extra_body={"kv_budget": 24}
    )
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    stream = api.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kv_budget": 24},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_stop_strings_and_seeded_sampling(serve, tiny_lm) -> None:
    api = client(serve())
    prompt = PROMPTS[1]
    full = api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]
    sampled = [
        api.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0.9, top_p=0.9, seed=seed)
        .choices[0]
        .text
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]


def test_text_stream_holds_back_a_possible_stop_string(tokenizer) -> None:
    ids = tokenizer("Hello world, this is the end. More text").input_ids
    text = TextStream(tokenizer, ["the end"], threading.Lock())
    pieces, stopped = [], False
    for token in ids:
        piece, stopped = text.push(token)
        pieces.append(piece)
        assert "the end" not in "".join(pieces)
        if stopped:
            break
    assert stopped and "".join(pieces) == "Hello world, this is "


@pytest.mark.parametrize(
    ("model_name", "policy", "budget", "tokens"),
    [
        ("llama_gqa", "h2o", 8, 30),  # evicts at prefill (a transient prompt-sized buffer) and decoding
        ("llama_gqa", "h2o", 64, 30),  # never evicts: the growth rule
        ("llama_gqa", "full", None, 80),  # grows twice
        ("llama_mha", "scissorhands", 0.5, 20),
        ("gemma3", "streaming_llm", 12, 20),  # sliding layers keep their own window
    ],
)
def test_reservation_is_what_the_cache_holds(tiny_models, make_ids, model_name, policy, budget, tokens) -> None:
    model = tiny_models(model_name, torch.float32)
    ids = make_ids(1, 40)
    cache = kvsieve.make_cache(model, policy, budget)
    cache.resolve(ids.shape[1])
    reserved = reservation(model, cache, ids.shape[1], tokens)
    peak = 0
    with torch.inference_mode():
        step = ids
        for _ in range(tokens - 1):  # (the last token is never fed)
            logits = model(step, past_key_values=cache).logits
            step = logits[:, -1:].argmax(-1)
            peak = max(peak, cache.nbytes())
    assert cache.nbytes() == peak == reserved.steady
    if cache.budget_tokens is not None and cache.budget_tokens + 1 < ids.shape[1]:
        assert reserved.peak > reserved.steady
    else:
        assert reserved.peak == reserved.steady
