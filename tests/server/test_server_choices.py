"""``n`` choices per prompt on a live ``kvsieve serve``: the prompt prefilled once and its cache forked into ``n`` rows,
row ``i`` sampled with ``seed + i`` (vLLM's rule), choices indexed prompt-major, usage counting each prompt once, and
the ``n`` rows admitted together within the KV cap."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import httpx
import openai
import pytest
from test_server import NAME, PROMPTS, client, kv_body, metric, serve, solo  # noqa: F401 (serve: the fixture)

import kvsieve
from kvsieve.engine.memory import reservation


@pytest.mark.parametrize(
    ("policy", "budget", "params"), [("h2o", 16, {}), ("h2o", 12, {"kv_bits": 4, "group_size": 8}), ("full", None, {})]
)
def test_greedy_choices_are_the_single_answer_and_indexed_prompt_major(serve, tiny_lm, policy, budget, params) -> None:  # noqa: F811
    api = client(serve())
    body = kv_body(policy, budget, params)
    want = [solo(tiny_lm, prompt, policy, budget, params, 12) for prompt in PROMPTS[:2]]
    out = api.completions.create(model=NAME, prompt=PROMPTS[:2], n=3, max_tokens=12, temperature=0, extra_body=body)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [want[0]] * 3 + [want[1]] * 3
    prompt_tokens = sum(len(tiny_lm[1](p).input_ids) for p in PROMPTS[:2])
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 6 * 12)
    assert len(out.kvsieve) == 6 and len({kv["kv_bytes"] for kv in out.kvsieve}) <= 2  # (a row's bytes, per prompt)
    scored = api.completions.create(
        model=NAME, prompt=PROMPTS[0], n=2, max_tokens=0, echo=True, logprobs=1, temperature=0, extra_body=body
    )
    assert [c.text for c in scored.choices] == [PROMPTS[0]] * 2
    assert scored.choices[0].logprobs.token_logprobs == scored.choices[1].logprobs.token_logprobs
    assert scored.usage.prompt_tokens == len(tiny_lm[1](PROMPTS[0]).input_ids) and scored.usage.completion_tokens == 0

    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    single = api.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, extra_body=body)
    chat = api.chat.completions.create(model=NAME, messages=messages, n=2, max_tokens=8, temperature=0, extra_body=body)
    assert [c.message.content for c in chat.choices] == [single.choices[0].message.content] * 2
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.prompt_tokens == single.usage.prompt_tokens
    assert chat.usage.completion_tokens == 2 * single.usage.completion_tokens


def test_seeded_choices_are_the_solo_requests_of_the_derived_seeds_streamed_or_not(serve) -> None:  # noqa: F811
    api = client(serve())
    prompt, sampled = PROMPTS[1], {"max_tokens": 16, "temperature": 0.9, "top_p": 0.9}
    solos = [api.completions.create(model=NAME, prompt=prompt, seed=7 + i, **sampled).choices[0].text for i in range(3)]
    texts = [c.text for c in api.completions.create(model=NAME, prompt=prompt, n=3, seed=7, **sampled).choices]
    assert texts == solos and len(set(texts)) == 3
    again = api.completions.create(model=NAME, prompt=prompt, n=3, seed=7, **sampled)
    assert [c.text for c in again.choices] == texts

    streamed: dict[int, str] = defaultdict(str)
    ends = {}
    chunks = api.completions.create(
        model=NAME, prompt=prompt, n=3, seed=7, stream=True, stream_options={"include_usage": True}, **sampled
    )
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason is not None:
                ends[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens == again.usage.prompt_tokens  # (counted once)
            assert chunk.usage.completion_tokens == again.usage.completion_tokens
    assert [streamed[i] for i in range(3)] == texts and sorted(ends) == [0, 1, 2]

    messages = [{"role": "user", "content": "Tell me a story."}]
    solo_chat = [
        api.chat.completions.create(model=NAME, messages=messages, seed=3 + i, **sampled).choices[0].message.content
        for i in range(2)
    ]
    roles: dict[int, list[str | None]] = defaultdict(list)
    content: dict[int, str] = defaultdict(str)
    for chunk in api.chat.completions.create(model=NAME, messages=messages, n=2, seed=3, stream=True, **sampled):
        for choice in chunk.choices:
            roles[choice.index].append(choice.delta.role)
            content[choice.index] += choice.delta.content or ""
    assert [content[0], content[1]] == solo_chat
    assert all(r[0] == "assistant" and set(r[1:]) <= {None} for r in roles.values())  # (the role once per choice)


def test_the_rows_of_a_request_are_reserved_together_within_the_cap(serve, tiny_lm) -> None:  # noqa: F811
    model, tokenizer = tiny_lm
    prompt = PROMPTS[0]
    one = reservation(model, kvsieve.make_cache(model, "h2o", 16), len(tokenizer(prompt).input_ids), 24).peak
    cap = 3 * one  # (one request of three rows at a time: the second waits)
    base = serve(kv_cap_bytes=cap, max_batch=4, max_queue=8)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, "n": 3}
    seen = {"held": 0.0, "reserved": 0.0, "queued": 0.0}
    names = {
        "held": "kvsieve_kv_bytes_held ",
        "reserved": "kvsieve_kv_bytes_reserved ",
        "queued": "kvsieve_queue_depth ",
    }

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            requests = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
            while not all(r.done() for r in requests):
                for line in (await http.get("/metrics")).text.splitlines():
                    for key, name in names.items():
                        if line.startswith(name):
                            seen[key] = max(seen[key], float(line.split()[-1]))
                await asyncio.sleep(0.005)
            return [r.result() for r in requests]

    slow = model.register_forward_pre_hook(lambda module, args: time.sleep(0.005))  # (the requests overlap)
    try:
        outs = asyncio.run(main())
    finally:
        slow.remove()
    assert [o.status_code for o in outs] == [200, 200]
    assert all(len({c["text"] for c in o.json()["choices"]}) == 1 for o in outs)
    assert 0 < seen["held"] <= seen["reserved"] <= cap and seen["queued"] > 0
    assert 0 < metric(base, "kvsieve_kv_bytes_held_max") <= cap
    assert metric(base, "kvsieve_requests_admitted_total") == 6

    with httpx.Client(base_url=base, timeout=60) as http:
        for extra, param in (
            ({"n": 4}, "n"),  # (four rows never fit the cap, one does)
            ({"n": 5}, "n"),  # (more rows than the server's batch)
            ({"n": 0}, "n"),
            ({"n": 129}, "n"),
            ({"kv_policy": "full", "max_tokens": 900}, "kv_budget"),  # (not even one row fits)
        ):
            got = http.post("/v1/completions", json={**body, **extra})
            assert got.status_code == 400 and got.json()["error"]["param"] == param, (extra, got.text)
        assert http.post("/v1/completions", json=body).status_code == 200  # (still serving)


def test_a_closed_stream_of_several_choices_frees_every_row(serve, tiny_lm) -> None:  # noqa: F811
    base = serve(max_batch=4)
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 900, "n": 3, "stream": True, "temperature": 0.8}
    slow = tiny_lm[0].register_forward_pre_hook(lambda module, args: time.sleep(0.005))
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
            deadline = time.monotonic() + 20
            while (state := http.get("/health").json())["running"]:
                assert time.monotonic() < deadline, state
                time.sleep(0.02)
    finally:
        slow.remove()
    assert state["kv_bytes_held"] == 0 and state["kv_bytes_reserved"] == 0
    assert metric(base, 'kvsieve_requests_finished_total{reason="cancelled"}') == 3
    assert isinstance(
        client(base).completions.create(model=NAME, prompt="Hi", n=2, max_tokens=3), openai.types.Completion
    )
