"""Budgets by phase (prompt / decoding), compress-once-ask-many (:mod:`kvsieve.qa`) and saved contexts."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvsieve
from kvsieve.cli import main
from kvsieve.qa import asking, split_prompt

PHASE_POLICIES = ["h2o", "scissorhands", "snapkv", "streaming_llm", "knorm", "tova", "ahakv"]


def _feed(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``ids`` fed in one forward pass through ``cache``."""
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits


def _feed_one_by_one(model, cache, ids: torch.Tensor, slots: list[int] | None = None) -> torch.Tensor:
    logits = []
    for i in range(ids.shape[1]):
        logits.append(_feed(model, cache, ids[:, i : i + 1]))
        if slots is not None:
            slots.append(max(cache.slot_counts()))
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("policy", PHASE_POLICIES)
def test_prompt_is_compressed_to_budget_then_cache_grows_to_decode_budget(llama_gqa, make_ids, policy) -> None:
    prompt, tail = make_ids(2, 24, seed=1), make_ids(2, 12, seed=2)
    cache = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=14)
    _feed(llama_gqa, cache, prompt)
    assert cache.slot_counts() == [8, 8, 8] and cache.decode_budget_tokens == 14
    slots: list[int] = []
    _feed_one_by_one(llama_gqa, cache, tail, slots)
    assert max(slots) == 14 and min(slots[6:]) > 8  # (scissorhands and knorm drop several at once)
    assert slots[:6] == list(range(9, 15))  # nothing evicted while there is room


@pytest.mark.parametrize("policy", PHASE_POLICIES)
def test_stream_continuation_respects_the_decode_budget(llama_gqa, make_ids, policy) -> None:
    """A continuation fed in one stream-protocol pass (scanned runs) is the token-by-token one under the phase's
    limit."""
    prompt, tail = make_ids(1, 24, seed=3), make_ids(1, 20, seed=4)
    one = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=12)
    _feed(llama_gqa, one, prompt)
    expected = _feed_one_by_one(llama_gqa, one, tail)
    streamed = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=12)
    _feed(llama_gqa, streamed, prompt)
    with streamed.streaming():
        got = _feed(llama_gqa, streamed, tail)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert streamed.slot_counts() == one.slot_counts()
    for layer in range(3):
        assert torch.equal(streamed.positions(layer).sort(-1).values, one.positions(layer).sort(-1).values)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "streaming_llm", "knorm"])
def test_unbounded_decode_budget_is_prefill_only_compression(llama_gqa, make_ids, policy) -> None:
    prompt, tail = make_ids(2, 24, seed=5), make_ids(2, 10, seed=6)
    one_pass = kvsieve.make_cache(llama_gqa, policy, 8)  # (the continuation attends before any eviction)
    _feed(llama_gqa, one_pass, prompt)
    expected = _feed(llama_gqa, one_pass, tail)
    grow = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=None)
    _feed(llama_gqa, grow, prompt)
    assert grow.slot_counts() == [8, 8, 8]
    torch.testing.assert_close(_feed_one_by_one(llama_gqa, grow, tail), expected, rtol=1e-5, atol=1e-5)
    assert grow.slot_counts() == [18, 18, 18]
    at_once = kvsieve.make_cache(llama_gqa, policy, 8, decode_budget=None)
    _feed(llama_gqa, at_once, prompt)
    torch.testing.assert_close(_feed(llama_gqa, at_once, tail), expected, rtol=1e-5, atol=1e-5)


def test_unbounded_decoding_observes_nothing(llama_gqa, make_ids, monkeypatch) -> None:
    """Once the cache may grow without bound nothing is evicted again: the policy is not asked to observe."""
    cache = kvsieve.make_cache(llama_gqa, "h2o", 8, decode_budget=None)
    _feed(llama_gqa, cache, make_ids(1, 16, seed=7))
    observed = []
    policy_cls = type(cache.layers[0].policy)
    monkeypatch.setattr(policy_cls, "observe", lambda self, slots, obs: observed.append(1))
    _feed_one_by_one(llama_gqa, cache, make_ids(1, 4, seed=8))
    assert observed == []


def test_set_prompt_length_starts_decoding_in_the_first_pass(llama_gqa, make_ids) -> None:
    ids = make_ids(1, 30, seed=9)
    split = kvsieve.make_cache(llama_gqa, "h2o", 8, decode_budget=12)
    split.set_prompt_length(20)
    got = _feed(llama_gqa, split, ids)
    apart = kvsieve.make_cache(llama_gqa, "h2o", 8, decode_budget=12)
    expected = torch.cat([_feed(llama_gqa, apart, ids[:, :20]), _feed_one_by_one(llama_gqa, apart, ids[:, 20:])], 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert split.slot_counts() == apart.slot_counts() == [12, 12, 12]


def test_ratio_decode_budget_resolves_against_the_prompt(llama_gqa, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "h2o", 0.25, decode_budget=0.5)
    _feed(llama_gqa, cache, make_ids(1, 40, seed=10))
    assert (cache.budget_tokens, cache.decode_budget_tokens) == (10, 20)
    _feed_one_by_one(llama_gqa, cache, make_ids(1, 14, seed=11))
    assert cache.slot_counts() == [20, 20, 20]


@pytest.mark.parametrize(
    ("budget", "decode_budget", "message"),
    [
        (8, 4, r"decode_budget \(4 tokens\) must be at least the budget \(8 tokens\)"),
        (8, "more", "decode_budget must be tokens, a ratio, None or 'budget'"),
        (8, -3, "positive"),
        (8, 1.5, r"ratio must be in \(0, 1\]"),
    ],
)
def test_bad_decode_budget_is_refused_before_any_work(llama_gqa, budget, decode_budget, message) -> None:
    with pytest.raises(ValueError, match=message):
        kvsieve.make_cache(llama_gqa, "h2o", budget, decode_budget=decode_budget)


def test_ratio_decode_budget_below_budget_fails_at_the_prompt(llama_gqa, make_ids) -> None:
    cache = kvsieve.make_cache(llama_gqa, "h2o", 0.5, decode_budget=0.25)
    with pytest.raises(ValueError, match="must be at least the budget"):
        _feed(llama_gqa, cache, make_ids(1, 40, seed=12))


def test_sliding_layers_keep_their_window_while_policy_layers_grow(gemma3, make_ids) -> None:
    cache = kvsieve.make_cache(gemma3, "h2o", 6, decode_budget=None)
    _feed(gemma3, cache, make_ids(1, 20, seed=13))
    _feed_one_by_one(gemma3, cache, make_ids(1, 10, seed=14))
    window = gemma3.config.sliding_window - 1
    assert cache.slot_counts() == [window, 16, window, 16]


CONTEXT = (
    "Albert Einstein was born in Ulm, in the Kingdom of Württemberg, on 14 March 1879. His family moved to Munich, "
    "where his father and uncle founded an electrical engineering company. He later studied in Zurich and worked at "
    "the patent office in Bern, where he wrote the papers of his miracle year, 1905. "
) * 3
QUESTIONS = ["Where was Einstein born?", "When did he write his miracle year papers?", "Who founded the company?"]


def _greedy(model, cache, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens after ``ids`` fed in one pass through ``cache``, then one token per step."""
    logits, out = _feed(model, cache, ids), []
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        logits = _feed(model, cache, torch.tensor([[out[-1]]]))
    return out


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "streaming_llm"])
def test_answers_are_greedy_decoding_over_the_context_compressed_before_the_question(tiny_lm, policy) -> None:
    model, tokenizer = tiny_lm
    qa = kvsieve.compress(model, tokenizer, CONTEXT, policy=policy, budget=24)
    assert qa.cache.slot_counts() == [24, 24, 24]
    cache = kvsieve.make_cache(model, policy, 24, decode_budget=None)
    _feed(model, cache, qa.context_ids)
    expected = _greedy(model, cache, qa.question_ids(QUESTIONS[0]), 6)
    eos = tokenizer.eos_token_id
    expected = expected[: expected.index(eos) + 1] if eos in expected else expected
    assert qa.ask(QUESTIONS[0], max_new_tokens=6) == tokenizer.decode(expected, skip_special_tokens=True).strip()


@pytest.mark.parametrize(
    ("policy", "decode_budget"),
    [("h2o", None), ("h2o", 0.3), ("scissorhands", 0.3), ("streaming_llm", 0.27), ("kvzip:chunk=40", None)],
)
def test_many_questions_equal_each_asked_alone_and_never_change_the_context(tiny_lm, policy, decode_budget) -> None:
    """Batched questions (padding between context and question) answer as each asked alone, with the question part
    kept whole or evicted (a bounded decode budget)."""
    model, tokenizer = tiny_lm
    kwargs = {"policy": policy, "budget": 0.25, "decode_budget": decode_budget}
    qa = kvsieve.compress(model, tokenizer, CONTEXT, **kwargs)
    before, seen = [qa.cache.positions(i).clone() for i in range(3)], qa.cache.get_seq_length()
    answers = qa.ask(QUESTIONS, max_new_tokens=8)
    alone = [kvsieve.compress(model, tokenizer, CONTEXT, **kwargs).ask(q, 8, batch_size=1) for q in QUESTIONS]
    assert answers == alone and len(answers) == 3 and qa.ask(QUESTIONS, 8, batch_size=2) == alone
    ids, mask = qa.batch(QUESTIONS)
    assert (mask.sum(1) - qa.context_tokens).tolist() == [qa.question_ids(q).shape[1] for q in QUESTIONS]
    batched = qa.cache_copy()
    batched.batch_repeat_interleave(3)
    n = qa.context_tokens
    positions = (mask.cumsum(-1) - 1)[:, n:]  # (what generate derives from the mask)
    with torch.no_grad():
        logits = model(ids[:, n:], attention_mask=mask, position_ids=positions, cache=batched).logits[:, -1]
    for row, question in enumerate(QUESTIONS):
        alone_logits = _feed(model, qa.cache_copy(), qa.question_ids(question))[0, -1]
        torch.testing.assert_close(logits[row], alone_logits, rtol=1e-4, atol=1e-4)  # (summation order)
    assert qa.cache.get_seq_length() == seen == qa.context_tokens
    assert all(torch.equal(qa.cache.positions(i), held) for i, held in enumerate(before))
    assert qa.ask(QUESTIONS[0], max_new_tokens=8) == answers[0]  # (asked again: the same)


def test_probes_ask_as_the_question_part_does(tokenizer) -> None:
    """kvzip's probes follow the context as a question would: the request, then the end of the user's turn and the
    assistant's header as the chat template writes them (nothing after the request without a template)."""
    template = split_prompt(tokenizer, "CONTEXT")[1]
    ask = asking(tokenizer)
    assert tokenizer.decode(ask.turn_end) == template.format(question="")
    assert ask.encode("Repeat it.") == tokenizer("Repeat it.", add_special_tokens=False).input_ids
    assert asking(tokenizer, chat_template=False).turn_end == []


def test_prompt_split_follows_the_chat_template(tokenizer) -> None:
    context_part, template = split_prompt(tokenizer, "CONTEXT {x}")
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": "CONTEXT {x}\n\nQ?"}], tokenize=False, add_generation_prompt=True
    )
    assert context_part + template.format(question="Q?") == whole
    assert context_part.endswith("CONTEXT {x}\n\n")


@pytest.mark.parametrize(
    "policy", ["h2o", "scissorhands", "streaming_llm", "h2o:kv_bits=4,group_size=8,residual=4", "kvzip:chunk=40"]
)
def test_saved_context_answers_exactly_like_the_original(tiny_lm, tmp_path, policy) -> None:
    model, tokenizer = tiny_lm
    qa = kvsieve.compress(model, tokenizer, CONTEXT, policy=policy, budget=0.3, decode_budget=0.4)
    path = qa.save(tmp_path / "ctx.safetensors")
    loaded = kvsieve.load_context(path, model, tokenizer)
    assert loaded.spec == qa.spec and torch.equal(loaded.context_ids, qa.context_ids)
    assert loaded.cache.slot_counts() == qa.cache.slot_counts()
    question = qa.question_ids(QUESTIONS[1])
    tail = torch.tensor([[5, 17, 300, 42] * 8])  # (past the decode budget: eviction resumes alike)
    original, restored = qa.cache_copy(), loaded.cache_copy()
    for ids in (question, tail):
        assert torch.equal(_feed(model, original, ids), _feed(model, restored, ids))
    for layer in range(3):
        assert torch.equal(original.positions(layer), restored.positions(layer))
    assert loaded.ask(QUESTIONS, max_new_tokens=6) == qa.ask(QUESTIONS, max_new_tokens=6)


def test_loading_into_another_model_or_format_is_refused(tiny_lm, llama_gqa, tmp_path) -> None:
    model, tokenizer = tiny_lm
    path = kvsieve.compress(model, tokenizer, CONTEXT, budget=16).save(tmp_path / "ctx.safetensors")
    with pytest.raises(ValueError, match="differs in config and weights"):
        kvsieve.load_context(path, llama_gqa, tokenizer)
    with pytest.raises(ValueError, match="differs in dtype"):
        kvsieve.load_context(path, copy.deepcopy(model).to(torch.float64), tokenizer)
    tensors, header = _read(path)
    save_file(tensors, tmp_path / "old.safetensors", metadata={"kvsieve_context": json.dumps({**header, "format": 99})})
    with pytest.raises(ValueError, match="in format 99; this kvsieve reads format 1"):
        kvsieve.load_context(tmp_path / "old.safetensors", model, tokenizer)
    del header["layers"]
    save_file(tensors, tmp_path / "cut.safetensors", metadata={"kvsieve_context": json.dumps(header)})
    with pytest.raises(ValueError, match="its header misses layers"):
        kvsieve.load_context(tmp_path / "cut.safetensors", model, tokenizer)
    save_file(tensors, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="not a kvsieve saved context"):
        kvsieve.load_context(tmp_path / "plain.safetensors", model, tokenizer)
    (tmp_path / "junk").write_text("junk")
    with pytest.raises(ValueError, match="not a safetensors file"):
        kvsieve.load_context(tmp_path / "junk", model, tokenizer)


def _read(path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["kvsieve_context"])  # noqa: SIM118


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context": "  "}, "context must be a non-empty string"),
        ({"budget": 0}, "budget must be a positive number"),
        ({"policy": "nope"}, "nope"),
        ({"decode_budget": 4, "budget": 8}, "must be at least the budget"),
    ],
)
def test_compress_refuses_bad_arguments(tiny_lm, kwargs, message) -> None:
    model, tokenizer = tiny_lm
    with pytest.raises((ValueError, KeyError), match=message):
        kvsieve.compress(model, tokenizer, **{"context": CONTEXT, **kwargs})


def test_ask_refuses_bad_arguments(tiny_lm) -> None:
    model, tokenizer = tiny_lm
    qa = kvsieve.compress(model, tokenizer, CONTEXT, budget=16)
    for bad, message in [([], "non-empty"), ("", "non-empty"), ([QUESTIONS[0], " "], "non-empty")]:
        with pytest.raises(ValueError, match=message):
            qa.ask(bad)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        qa.ask(QUESTIONS, batch_size=0)
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        qa.ask(QUESTIONS[0], max_new_tokens=0)
    for name in ("cache", "past_key_values"):
        with pytest.raises(ValueError, match=f"sets {name} itself"):
            qa.ask(QUESTIONS[0], **{name: None})


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ask", "-q", "Who?"], "one of the arguments --context --load is required"),
        (["ask", "--context", "a.txt"], "the following arguments are required: --question"),
        (["ask", "--context", "a.txt", "--load", "b", "-q", "Who?"], "not allowed with argument"),
        (["ask", "--context", "/no/such.txt", "-q", "Who?"], "/no/such.txt"),
        (["ask", "--load", "/no/such.safetensors", "-q", "Who?"], "no saved context at /no/such.safetensors"),
        (["ask", "--context", "CTX", "-q", " "], "every --question must be non-empty"),
        (["ask", "--context", "CTX", "-q", "Who?", "--decode-budget", "lots"], "argument --decode-budget"),
        (["ask", "--context", "CTX", "-q", "Who?", "--policy", "nope"], "unknown policy 'nope'"),
        (["ask", "--context", "CTX", "-q", "Who?", "--batch-size", "0"], "argument --batch-size"),
    ],
)
def test_ask_command_refuses_bad_arguments_before_loading_a_model(capsys, tmp_path, argv, message) -> None:
    (tmp_path / "ctx.txt").write_text(CONTEXT)
    argv = [str(tmp_path / "ctx.txt") if arg == "CTX" else arg for arg in argv]
    assert main([*argv, "--json"]) == 2
    error = json.loads(capsys.readouterr().out)
    assert message in error["error"]


@pytest.mark.slow
def test_ask_command_on_the_real_model_saves_and_loads_the_context(capsys, tmp_path) -> None:
    (tmp_path / "ctx.txt").write_text(CONTEXT)
    saved = tmp_path / "ctx.safetensors"
    asked = ["-q", QUESTIONS[0], "-q", QUESTIONS[1], "--max-new-tokens", "12", "--json", "--device", "cpu"]
    assert main(["ask", "--context", str(tmp_path / "ctx.txt"), "--budget", "0.5", "--save", str(saved), *asked]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["budget_tokens"] == round(first["context_tokens"] / 2) == first["kv_slots_max"]
    assert first["decode_budget_tokens"] is None and first["saved"] == str(saved)
    assert [row["question"] for row in first["answers"]] == QUESTIONS[:2]
    assert "Ulm" in first["answers"][0]["answer"]
    assert main(["ask", "--load", str(saved), *asked]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["answers"] == first["answers"] and again["context_tokens"] == first["context_tokens"]
