"""``logprobs``, ``echo`` and lists of prompts on ``kvsieve serve`` (a live server on 127.0.0.1, the official client
and raw HTTP): a scored prompt equals the lm-eval model ``kvsieve``'s log-likelihoods under the same policy and
budget (``protocol=stream``), generated tokens' log-probabilities equal those of ``model.generate`` through the same
cache, and each prompt of a list gets the choice it would get alone."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from test_server import NAME, PROMPTS, client, kv_body, serve, solo  # noqa: F401 (serve: the live-server fixture)

import kvsieve
from kvsieve.evaluation.lm_eval_model import KVSieveLM

PAIRS = [(prompt, " and that is how the story goes on.") for prompt in PROMPTS]
# (policy, budget, params): ratio and token budgets, observing and positional policies, quantized slots, no eviction
SPECS = [
    ("h2o", 0.5, {}),
    ("streaming_llm", 6, {"sink": 2}),
    ("tova", 0.4, {}),
    ("scissorhands", 8, {}),
    ("h2o", 0.6, {"kv_bits": 4, "group_size": 8}),
    ("full", None, {}),
]


def in_process(tiny_lm, policy: str, budget, params: dict) -> KVSieveLM:
    model, tokenizer = tiny_lm
    return KVSieveLM(model=model, tokenizer=tokenizer, policy=policy, budget=budget or 1.0, protocol="stream", **params)


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's ``local-completions`` reading of an echoed choice (``parse_logprobs``)."""
    logprobs = choice["logprobs"]
    scored, top = logprobs["token_logprobs"][ctxlen:-1], logprobs["top_logprobs"][ctxlen:-1]
    return sum(scored), all(lp == max(t.values()) for lp, t in zip(scored, top, strict=True))


@pytest.mark.parametrize(("policy", "budget", "params"), SPECS)
def test_echoed_logprobs_equal_the_lm_eval_models(serve, tiny_lm, policy, budget, params) -> None:  # noqa: F811
    base = serve()
    lm = in_process(tiny_lm, policy, budget, params)
    pairs = [lm._encode_pair(c, k) for c, k in PAIRS]
    expected = lm._loglikelihood_tokens([((c, k), *pair) for (c, k), pair in zip(PAIRS, pairs, strict=True)])
    body = {
        "model": NAME,
        "prompt": [c + k for c, k in pairs],  # (lm-eval's request: token ids, echo, one token, the top one)
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
        **kv_body(policy, budget, params),
    }
    out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert [choice["index"] for choice in out["choices"]] == list(range(len(pairs)))
    got = [lm_eval_parse(choice, len(c)) for choice, (c, _) in zip(out["choices"], pairs, strict=True)]
    for (value, greedy), (want, want_greedy) in zip(got, expected, strict=True):
        assert value == pytest.approx(want, abs=2e-4) and greedy == want_greedy
    lengths = [len(c + k) for c, k in pairs]
    assert out["usage"] == {
        "prompt_tokens": sum(lengths),
        "completion_tokens": len(pairs),
        "total_tokens": sum(lengths) + len(pairs),
    }
    assert [kv["budget_tokens"] for kv in out["kvsieve"]] == [
        None if budget is None else round(budget * n) if isinstance(budget, float) else budget for n in lengths
    ]
    if policy != "full":  # (the budget changed the scores: the comparison above can fail)
        full = in_process(tiny_lm, "full", None, {})._loglikelihood_tokens(
            [((c, k), *pair) for (c, k), pair in zip(PAIRS, pairs, strict=True)]
        )
        assert max(abs(v - f) for (v, _), (f, _) in zip(got, full, strict=True)) > 1e-2


def test_the_echoed_logprobs_object(serve, tiny_lm) -> None:  # noqa: F811
    model, tokenizer = tiny_lm
    base = serve()
    prompt = PROMPTS[2]
    ids = tokenizer(prompt).input_ids
    body = {"model": NAME, "prompt": prompt, "temperature": 0, "logprobs": 2, "echo": True, "kv_policy": "full"}
    out = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 0}, timeout=60).json()
    (choice,) = out["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt and out["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids] and "".join(logprobs["tokens"]) == prompt
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(ids))]
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    torch.testing.assert_close(
        torch.tensor(logprobs["token_logprobs"][1:]), reference.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    )
    for top, row, token in zip(logprobs["top_logprobs"][1:], reference, ids[1:], strict=True):
        values, best = row.topk(2)
        expected = {tokenizer.decode([int(i)]): float(v) for i, v in zip(best, values, strict=True)}
        expected.setdefault(tokenizer.decode([token]), float(row[token]))  # (the prompt's token is always listed)
        assert top.keys() == expected.keys() and list(top.values()) == pytest.approx(list(expected.values()), 1e-4)

    # With tokens generated after the echo: the prompt's entries, then the completion's, offsets running on.
    more = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 5}, timeout=60).json()["choices"][0]
    assert more["text"].startswith(prompt) and len(more["logprobs"]["tokens"]) == len(ids) + 5
    assert more["logprobs"]["token_logprobs"][: len(ids)] == pytest.approx(logprobs["token_logprobs"], abs=1e-5)
    assert more["text"] == "".join(more["logprobs"]["tokens"])
    # Streamed: the prompt's chunk first (its text and entries), then the completion's.
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "max_tokens": 5, "stream": True}) as events:
        chunks = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"] == prompt
    assert "".join(c["choices"][0]["text"] for c in chunks) == more["text"]
    entries = [c["choices"][0]["logprobs"] for c in chunks]
    assert [t for e in entries for t in e["tokens"]] == more["logprobs"]["tokens"]
    assert [o for e in entries for o in e["text_offset"]] == more["logprobs"]["text_offset"]
    # Echo without logprobs: the text alone.
    plain = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": None, "max_tokens": 5}, timeout=60).json()
    assert plain["choices"][0]["text"] == more["text"] and plain["choices"][0]["logprobs"] is None


def generate_logprobs(tiny_lm, prompt: str, policy: str, budget, tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``model.generate`` through a kvsieve cache and their log-probabilities."""
    model, tokenizer = tiny_lm
    cache = kvsieve.make_cache(model, policy, budget)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    cache.set_prompt_length(ids.shape[1])
    with torch.inference_mode():
        out = model.generate(
            ids, cache=cache, max_new_tokens=tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    new = out.sequences[0, ids.shape[1] :].tolist()
    logits = torch.stack(out.logits)[:, 0].float().log_softmax(-1)
    return new, logits.gather(-1, torch.tensor(new)[:, None])[:, 0].tolist()


def test_generated_tokens_logprobs_streamed_and_not(serve, tiny_lm) -> None:  # noqa: F811
    _, tokenizer = tiny_lm
    api = client(serve())
    prompt = PROMPTS[0]
    tokens, expected = generate_logprobs(tiny_lm, prompt, "h2o", 16, 12)
    out = api.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(
        len(top) in (3, 4) and lp == max(top.values())
        for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    )  # (greedy: the chosen one is the top one)
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(12)]
    chunks = list(
        api.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3, stream=True)
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert [t for s in streamed for t in s.tokens] == logprobs.tokens
    assert [lp for s in streamed for lp in s.token_logprobs] == pytest.approx(logprobs.token_logprobs, abs=1e-6)
    assert [o for s in streamed for o in s.text_offset] == logprobs.text_offset
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text

    # Chat: logprobs.content, top_logprobs entries each.
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    chat = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:
        assert entry.top_logprobs[0].logprob == entry.logprob and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
    stream = api.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    entries = [e for c in stream for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]
    plain = api.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def test_a_list_of_prompts_gets_a_choice_each(serve, tiny_lm) -> None:  # noqa: F811
    _, tokenizer = tiny_lm
    base = serve()
    api = client(base)
    specs = kv_body("streaming_llm", 0.5, {"sink": 2})
    expected = [solo(tiny_lm, p, "streaming_llm", 0.5, {"sink": 2}, 10) for p in PROMPTS]
    out = api.completions.create(model=NAME, prompt=PROMPTS, max_tokens=10, temperature=0, extra_body=specs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and [c.text for c in out.choices] == expected
    lengths = [len(tokenizer(p).input_ids) for p in PROMPTS]
    assert out.usage.prompt_tokens == sum(lengths) and out.usage.completion_tokens == 40
    assert [kv["budget_tokens"] for kv in out.kvsieve] == [round(0.5 * n) for n in lengths]
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    by_ids = api.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0, extra_body=specs)
    assert [c.text for c in by_ids.choices] == expected
    stream = api.completions.create(
        model=NAME,
        prompt=PROMPTS,
        max_tokens=10,
        temperature=0,
        extra_body=specs,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons = [""] * 4, [None] * 4
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == expected and reasons == ["length"] * 4
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-1].usage.prompt_tokens == sum(lengths)
    # One prompt in a list: a single choice, and the kvsieve field is its cache as for a plain prompt.
    one = api.completions.create(model=NAME, prompt=[PROMPTS[0]], max_tokens=10, temperature=0, extra_body=specs)
    assert one.choices[0].text == expected[0] and one.kvsieve["policy"] == "streaming_llm"
