"""vLLM's sampling extras on ``kvsieve serve`` (a live server on 127.0.0.1): penalties equal ``model.generate``
with the same processors through the same cache, ``stop_token_ids``, ``ignore_eos`` and ``min_tokens`` end (or do
not end) generation where they say; ``/tokenize`` and ``/detokenize`` as vLLM serves them."""

from __future__ import annotations

import httpx
import pytest
import torch
from test_server import NAME, PROMPTS, client, serve, solo  # noqa: F401 (serve: the live-server fixture)
from transformers import LogitsProcessor, LogitsProcessorList

import kvsieve


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (those after ``prompt_length``)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_length :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores)


def greedy(tiny_lm, prompt: str, tokens: int, **generate_kwargs) -> str:
    model, tokenizer = tiny_lm
    return kvsieve.generate(model, tokenizer, prompt, "h2o", 16, tokens, **generate_kwargs).text


def test_penalties_equal_generate_with_the_same_processors(serve, tiny_lm) -> None:  # noqa: F811
    _, tokenizer = tiny_lm
    base = serve()
    api = client(base)
    prompt = PROMPTS[0]  # (its greedy continuation comes back to tokens seen: a repetition penalty changes it)
    plain = greedy(tiny_lm, prompt, 24)
    length = len(tokenizer(prompt).input_ids)
    cases = [
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({"frequency_penalty": 1.5}, {"logits_processor": LogitsProcessorList([OpenAIPenalties(length, 0, 1.5)])}),
        ({"presence_penalty": 2.0}, {"logits_processor": LogitsProcessorList([OpenAIPenalties(length, 2.0, 0)])}),
    ]
    for fields, generate_kwargs in cases:
        expected = greedy(tiny_lm, prompt, 24, **generate_kwargs)
        assert expected != plain, fields  # (the penalty changes the output: the comparison can fail)
        penalties = {k: v for k, v in fields.items() if k != "repetition_penalty"}
        out = api.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={k: v for k, v in fields.items() if k == "repetition_penalty"},
            **penalties,
        )
        assert out.choices[0].text == expected, fields
    with httpx.Client(base_url=base, timeout=60) as http:
        for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
            got = http.post("/v1/completions", json={"model": NAME, "prompt": prompt, field: value})
            assert got.status_code == 400 and got.json()["error"]["param"] == field


def test_stop_token_ids_ignore_eos_and_min_tokens(serve, tiny_lm) -> None:  # noqa: F811
    model, tokenizer = tiny_lm
    prompt = PROMPTS[1]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    cache = kvsieve.make_cache(model, "h2o", 16)
    cache.set_prompt_length(ids.shape[1])
    with torch.inference_mode():
        tokens = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    stop = tokens[4]
    first = tokens.index(stop)  # (the first time it comes)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}

    def run(http: httpx.Client, **fields) -> dict:
        got = http.post("/v1/completions", json={**body, **fields})
        assert got.status_code == 200, got.text
        return got.json()

    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = stop  # (the server reads EOS when it starts: this token is EOS there)
    try:
        base = serve()
    finally:
        model.generation_config.eos_token_id = eos
    with httpx.Client(base_url=base, timeout=60) as http:
        ended = run(http)
        assert ended["usage"]["completion_tokens"] == first + 1 and ended["choices"][0]["finish_reason"] == "stop"
        assert ended["choices"][0]["text"] == tokenizer.decode(tokens[: first + 1], skip_special_tokens=True)
        ignoring = run(http, ignore_eos=True)
        assert ignoring["usage"]["completion_tokens"] == 12 and ignoring["choices"][0]["finish_reason"] == "length"
        assert ignoring["choices"][0]["text"] == tokenizer.decode(tokens)
        # stop_token_ids: another token ends it too (EOS ignored here, so only that one).
        other = tokens[2]
        by_id = run(http, ignore_eos=True, stop_token_ids=[other])
        assert by_id["usage"]["completion_tokens"] == tokens.index(other) + 1
        assert by_id["choices"][0]["finish_reason"] == "stop"
        # min_tokens: EOS cannot come before min_tokens tokens.
        late = run(http, min_tokens=first + 2)
        assert late["usage"]["completion_tokens"] >= first + 3  # (EOS at the earliest as the (first + 3)th token)
        assert not late["choices"][0]["text"].startswith(ended["choices"][0]["text"])
        for fields, param in (({"min_tokens": 13}, "min_tokens"), ({"stop_token_ids": [10**9]}, "stop_token_ids")):
            got = http.post("/v1/completions", json={**body, **fields})
            assert got.status_code == 400 and got.json()["error"]["param"] == param


def test_tokenize_and_detokenize(serve, tiny_lm) -> None:  # noqa: F811
    _, tokenizer = tiny_lm
    base = serve()
    text = "Hello there, river town."
    messages = [{"role": "user", "content": "Name three rivers."}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with httpx.Client(base_url=base, timeout=60) as http:
        got = http.post("/tokenize", json={"model": NAME, "prompt": text}).json()
        assert got["tokens"] == tokenizer(text).input_ids and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == 1024
        chat = http.post("/tokenize", json={"messages": messages}).json()
        assert chat["tokens"] == tokenizer(templated, add_special_tokens=False).input_ids
        assert http.post("/detokenize", json={"model": NAME, "tokens": got["tokens"]}).json() == {"prompt": text}
        for path, body, status, param in (
            ("/tokenize", {"prompt": text, "messages": messages}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"model": "gpt-4", "prompt": text}, 404, "model"),
            ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ):
            answer = http.post(path, json=body)
            assert answer.status_code == status and answer.json()["error"]["param"] == param, (path, body)


@pytest.mark.parametrize("seed", [3])
def test_sampling_with_penalties_is_seeded(serve, seed) -> None:  # noqa: F811
    api = client(serve())
    kwargs = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.8, "seed": seed}
    runs = [api.completions.create(**kwargs, frequency_penalty=1.0).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]
