"""``kvsieve serve`` against the official ``openai`` client and raw HTTP: a live uvicorn server on 127.0.0.1 (a free
port) in a background thread, always stopped. The tiny Llama with the real tokenizer keeps it fast; the greedy
output of every request must be ``kvsieve.generate``'s with the same policy and budget."""

from __future__ import annotations

import asyncio
import re
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
from kvsieve.engine.memory import reservation
from kvsieve.server.app import build_app
from kvsieve.server.decoding import TextStream
from kvsieve.server.jobs import KVSpec

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
    ("h2o", 12, {"kv_bits": 4, "group_size": 8}),  # (h2o at 12 above, unquantized: never in one batch)
    ("full", None, {}),
    ("tova", 0.4, {}),
    ("knorm", 16, {}),
    ("snapkv:heads=adakv", 12, {}),  # (each head its own count: packed slots, joined and selected in batches)
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


def test_text_stream_looks_for_stop_strings_from_min_tokens_on(tokenizer) -> None:
    """As vLLM: a stop string that ended before ``min_tokens`` tokens were out does not stop the text; the next does."""
    ids = tokenizer("Hello world, this is the end. More text, the end again").input_ids
    first = next(n for n in range(len(ids)) if "the end" in tokenizer.decode(ids[:n]))
    cases = ((0, "Hello world, this is "), (first + 1, "Hello world, this is the end. More text, "))
    for min_tokens, expected in cases:
        text = TextStream(tokenizer, ["the end"], threading.Lock(), min_tokens)
        pieces, stopped = [], False
        for token in ids:
            piece, stopped = text.push(token)
            pieces.append(piece)
            if stopped:
                break
        assert stopped and "".join(pieces) == expected, min_tokens


@pytest.mark.parametrize(
    ("model_name", "policy", "budget", "tokens"),
    [
        ("llama_gqa", "h2o", 8, 30),  # evicts at prefill (a transient prompt-sized buffer) and decoding
        ("llama_gqa", "h2o", 64, 30),  # never evicts: the growth rule
        ("llama_gqa", "full", None, 80),  # grows twice
        ("llama_mha", "scissorhands", 0.5, 20),
        ("gemma3", "streaming_llm", 12, 20),  # sliding layers keep their own window
        ("llama_gqa", "h2o:kv_bits=4,group_size=8,residual=4", 8, 30),  # quantized slots
        ("llama_mha", "full:kv_bits=2,group_size=4", None, 20),
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
            logits = model(step, cache=cache).logits
            step = logits[:, -1:].argmax(-1)
            peak = max(peak, cache.nbytes())
    assert cache.nbytes() == peak == reserved.steady
    if cache.budget_tokens is not None and cache.budget_tokens + 1 < ids.shape[1]:
        assert reserved.peak > reserved.steady
    else:
        assert reserved.peak == reserved.steady


@pytest.mark.parametrize(
    "policy",
    ["snapkv:heads=adakv", "h2o:heads=adakv,safeguard=0", "h2o:heads=adakv,safeguard=0,kv_bits=4,group_size=8"],
)
def test_reservation_bounds_heads_of_their_own_counts(tiny_models, make_ids, policy) -> None:
    """Budgets by head: the keys and values are the uniform budget's bytes exactly; positions and state are
    bounded by one head holding the layer's budget."""
    model = tiny_models("llama_mha", torch.float32)
    ids = make_ids(1, 40)
    cache = kvsieve.make_cache(model, policy, 8)
    uniform = kvsieve.make_cache(model, re.sub(r"heads=adakv,?|safeguard=0,?", "", policy).rstrip(",:"), 8)
    reserved = reservation(model, cache, ids.shape[1], 30)
    with torch.inference_mode():
        for c in (cache, uniform):
            step = ids
            for _ in range(29):
                step = model(step, cache=c).logits[:, -1:].argmax(-1)
                assert c.nbytes() <= reserved.steady
    assert cache.kv_nbytes() == uniform.kv_nbytes()
    assert cache.state_nbytes() > uniform.state_nbytes()  # (the heads' counts differ: a longer slot axis)


def test_streams_with_mixed_policies_equal_their_solo_runs_under_the_cap(serve, tiny_lm) -> None:
    cap = 120_000  # (bytes: a few of these requests at once, so that the others queue)
    runs = [(prompt, *spec) for spec in MIXED for prompt in PROMPTS[:2]]
    base = serve(kv_cap_bytes=cap, max_batch=len(runs), max_queue=len(runs))
    expected = [solo(tiny_lm, prompt, policy, budget, params, 24) for prompt, policy, budget, params in runs]
    seen = {"held": 0.0, "reserved": 0.0, "queued": 0.0}

    async def watch(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=base) as http:
            while not done.is_set():
                text = (await http.get("/metrics")).text
                for line in text.splitlines():
                    for key, name in (("held", "kvsieve_kv_bytes_held"), ("reserved", "kvsieve_kv_bytes_reserved")):
                        if line.startswith(name + " "):
                            seen[key] = max(seen[key], float(line.split()[-1]))
                    if line.startswith("kvsieve_queue_depth "):
                        seen["queued"] = max(seen["queued"], float(line.split()[-1]))
                await asyncio.sleep(0.01)

    async def one(api: openai.AsyncOpenAI, prompt: str, policy: str, budget, params: dict) -> str:
        stream = await api.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body=kv_body(policy, budget, params),
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        try:
            return await asyncio.gather(*(one(api, *run) for run in runs))
        finally:
            done.set()
            await watcher

    slow = tiny_lm[0].register_forward_pre_hook(lambda module, args: time.sleep(0.005))  # (requests overlap)
    try:
        texts = asyncio.run(main())
    finally:
        slow.remove()
    for run, text, want in zip(runs, texts, expected, strict=True):
        assert text == want, run
    assert 0 < seen["held"] <= cap and seen["reserved"] <= cap
    assert seen["queued"] > 0  # the cap held requests back
    assert 0 < metric(base, "kvsieve_kv_bytes_held_max") <= cap
    assert metric(base, "kvsieve_kv_bytes_held") == 0
    assert metric(base, "kvsieve_requests_admitted_total") == len(runs)
    # Requests of one policy and budget in tokens decoded together (continuous batching).
    assert metric(base, "kvsieve_decode_batch_rows_sum") > metric(base, "kvsieve_decode_batch_rows_count")


def wait_for(base: str, ok: Callable[[dict], bool], seconds: float = 20) -> dict:
    """Poll /health until ``ok`` holds for its JSON."""
    deadline = time.monotonic() + seconds
    while True:
        state = httpx.get(f"{base}/health", timeout=10).json()
        if ok(state):
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.02)


def test_a_cancelled_stream_frees_its_rows_and_a_full_queue_gets_429(serve, tiny_lm) -> None:
    model, tokenizer = tiny_lm
    ids = tokenizer(PROMPTS[0]).input_ids
    one = reservation(model, kvsieve.make_cache(model, "h2o", 16), len(ids), 900).peak
    base = serve(kv_cap_bytes=one, max_batch=4, max_queue=1)  # one request runs, one waits
    slow = model.register_forward_pre_hook(lambda module, args: time.sleep(0.01))  # (900 steps: time to act)
    try:
        check_cancel_and_queue(base, one)
    finally:
        slow.remove()


def check_cancel_and_queue(base: str, one: int) -> None:
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True}
    results: list[httpx.Response] = []
    queued = {**body, "stream": False, "max_tokens": 5}
    waiting = threading.Thread(
        target=lambda: results.append(httpx.post(f"{base}/v1/completions", json=queued, timeout=60))
    )
    with httpx.Client(base_url=base, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as first:
        lines = first.iter_lines()  # (kept: dropping the iterator closes the connection)
        assert next(lines).startswith("data: ")  # running
        waiting.start()
        wait_for(base, lambda s: s["waiting"] == 1 and s["running"] == 1)
        refused = http.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
    # The first stream is closed mid-way: its rows go at the next step, and the queued request runs.
    waiting.join(timeout=60)
    assert results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 5
    state = wait_for(base, lambda s: s["running"] == 0)
    assert state["kv_bytes_held"] == 0 and state["kv_bytes_reserved"] == 0
    assert metric(base, 'kvsieve_requests_finished_total{reason="cancelled"}') == 1
    assert metric(base, "kvsieve_generation_tokens_total") < 900
    assert metric(base, 'kvsieve_requests_rejected_total{reason="queue_full"}') == 1


def test_every_bad_request_gets_its_4xx_and_the_server_keeps_serving(serve) -> None:
    base = serve(kv_cap_bytes=200_000, max_queue=16)
    good = {"model": NAME, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    cases = [
        ({**good, "kv_policy": "nope"}, 400, "kv_policy"),
        ({**good, "kv_policy": "kvzip"}, 400, "kv_policy"),  # (it compresses a context by passes of its own)
        ({**good, "kv_budget": 0}, 400, "kv_budget"),
        ({**good, "kv_budget": 1.5}, 400, "kv_budget"),
        ({**good, "kv_budget": "lots"}, 400, "kv_budget"),
        ({**good, "kv_params": {"bogus": 1}}, 400, "kv_params"),
        ({**good, "kv_policy": "streaming_llm", "kv_budget": 4, "kv_params": {"sink": 8}}, 400, "kv_budget"),
        ({**good, "kv_policy": "full", "max_tokens": 900}, 400, "kv_budget"),  # more bytes than the cap
        ({**good, "prompt": [5] * 1020, "max_tokens": 10}, 400, "max_tokens"),  # past the model's 1024 positions
        ({**good, "prompt": [10**9]}, 400, "prompt"),
        ({**good, "prompt": ""}, 400, "prompt"),
        ({**good, "prompt": ["a", ""]}, 400, "prompt"),
        ({**good, "prompt": [[5, 6], []]}, 400, "prompt"),
        ({**good, "prompt": ["a", [5]]}, 400, "prompt"),
        ({**good, "prompt": ["a"] * 17}, 400, "prompt"),  # (more prompts than the queue holds)
        ({**good, "n": 0}, 400, "n"),
        ({**good, "n": 129}, 400, "n"),
        ({**good, "logprobs": 21}, 400, "logprobs"),
        ({**good, "logprobs": -1}, 400, "logprobs"),
        ({**good, "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({**good, "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
        ({**good, "best_of": 3}, 400, "best_of"),
        ({**good, "tools": []}, 400, "tools"),
        ({**good, "max_tokens": 0}, 400, "max_tokens"),  # (0 only with echo: scoring the prompt)
        ({**good, "temperature": 3}, 400, "temperature"),
        ({**good, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({k: v for k, v in good.items() if k != "prompt"}, 400, "prompt"),
        ({**good, "model": "gpt-4"}, 404, "model"),
    ]
    with httpx.Client(base_url=base, timeout=60) as http:
        for body, status, param in cases:
            got = http.post("/v1/completions", json=body)
            assert got.status_code == status, (body, got.text)
            error = got.json()["error"]
            assert error["param"] == param and error["message"] and error["type"], (body, error)
        for path, raw in (("/v1/completions", b'{"model": "tiny", "prompt": '), ("/v1/chat/completions", b"[1, 2")):
            got = http.post(path, content=raw, headers={"content-type": "application/json"})
            assert got.status_code == 400 and "not valid JSON" in got.json()["error"]["message"]
        for body, param in (
            ({**chat, "messages": []}, "messages"),
            ({**chat, "functions": []}, "functions"),
            ({**chat, "top_logprobs": 2}, "top_logprobs"),  # (without logprobs: true)
            ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ):
            got = http.post("/v1/chat/completions", json=body)
            assert got.status_code == 400 and got.json()["error"]["param"] == param
        got = http.post("/v1/chat/completions", json={**chat, "messages": [{"role": "robot", "content": "x"}]})
        assert got.status_code == 400 and got.json()["error"]["param"].startswith("messages.0.role")
        assert http.post("/v1/completions", json=good).status_code == 200
        assert http.get("/health").json()["status"] == "ok"
    assert metric(base, 'kvsieve_requests_rejected_total{reason="invalid"}') == len(cases) + 7


def test_full_requests_admitted_together_decode_in_one_batch(serve, tiny_lm) -> None:
    model, tokenizer = tiny_lm
    prompts = [f"Question number {n} is about rivers" for n in (3, 4, 5)]
    assert len({len(tokenizer(p).input_ids) for p in prompts}) == 1  # (the same prompt length: the same slots)
    expected = [solo(tiny_lm, p, "full", None, {}, 10) for p in prompts]
    blocker = [7] * 300  # (a long full request that holds the whole cap while it runs: the others queue)
    cap = reservation(model, kvsieve.make_cache(model, "full", None), len(blocker), 600).peak
    base = serve(kv_cap_bytes=cap)
    first = {"model": NAME, "prompt": blocker, "max_tokens": 600, "stream": True, "kv_policy": "full"}

    async def main() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=first) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                queued = [
                    asyncio.create_task(
                        api.completions.create(
                            model=NAME, prompt=p, max_tokens=10, temperature=0, extra_body={"kv_policy": "full"}
                        )
                    )
                    for p in prompts
                ]
                while (await http.get("/health")).json()["waiting"] < len(prompts):
                    await asyncio.sleep(0.01)
            # The blocker's client has gone: its rows are freed and the three queued requests start in one step.
            outs = await asyncio.gather(*queued)
        return [out.choices[0].text for out in outs]

    slow = model.register_forward_pre_hook(lambda module, args: time.sleep(0.005))  # (the blocker outlasts the rest)
    try:
        texts = asyncio.run(main())
    finally:
        slow.remove()
    assert texts == expected
    assert metric(base, 'kvsieve_decode_batch_rows_bucket{le="2.0"}') < metric(base, "kvsieve_decode_batch_rows_count")


def test_serve_refuses_bad_arguments_before_loading_a_model(no_model, capsys) -> None:
    from kvsieve.cli import main

    assert main(["serve", "--schedule", "increasing"]) == 2
    assert "shares budgets uniformly" in capsys.readouterr().err
    assert main(["serve", "--policy", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["serve", "--kv-memory-gb", "0"]) == 2


@pytest.mark.slow
def test_real_model_greedy_output_equals_generate(real_model, wiki_text) -> None:
    model, tokenizer = real_model
    prompt = wiki_text[:1500]
    expected = kvsieve.generate(model, tokenizer, prompt, "h2o", 0.2, 24).text
    with running(
        build_app(model, tokenizer, model_name=NAME, defaults=KVSpec("full", None, {}), kv_cap_bytes=2**30)
    ) as base:
        out = client(base).completions.create(
            model=NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body={"kv_policy": "h2o", "kv_budget": 0.2}
        )
    assert out.choices[0].text == expected
    assert out.kvsieve["kv_bytes"] == out.kvsieve["kv_bytes_reserved"]


def test_the_server_warms_up_before_serving_and_times_no_compiling_step_as_decoding(serve, monkeypatch) -> None:
    from kvsieve.server import scheduler

    calls = iter(range(0, 10_000, 3))  # (every call finds 3 more kernels compiled: each step "compiles")
    monkeypatch.setattr(scheduler, "compilations", lambda: next(calls))
    base = serve()
    warm = metric(base, "kvsieve_kernels_compiled_total")
    assert warm == 3  # (the warm-up, before any request)
    assert metric(base, "kvsieve_generation_tokens_total") == 0 and metric(base, "kvsieve_prompt_tokens_total") == 0
    client(base).completions.create(model=NAME, prompt="The river town", max_tokens=4)
    assert metric(base, "kvsieve_kernels_compiled_total") > warm
    assert metric(base, "kvsieve_decode_tokens_per_second") == 0  # (every step compiled: no decode rate set)


@pytest.mark.parametrize("spec", [KVSpec("h2o", 1020, {}), KVSpec("snapkv", 0.5, {}), KVSpec("full", None, {})])
def test_warm_up_takes_any_default_within_the_models_positions(tiny_lm, spec) -> None:
    from kvsieve.server.metrics import Metrics
    from kvsieve.server.scheduler import Scheduler

    model, tokenizer = tiny_lm
    metrics = Metrics(2**30)
    work = Scheduler(model, tokenizer, kv_cap_bytes=2**30, max_batch=4, max_queue=4, metrics=metrics)
    seconds, compiled = work.warm_up(spec)  # (1020 tokens: the tiny model has 1024 positions)
    assert seconds > 0 and compiled >= 0
    assert b"kvsieve_generation_tokens_total 0.0" in metrics.exposition()  # (no request's metrics)
