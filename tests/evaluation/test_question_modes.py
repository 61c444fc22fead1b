"""Question-aware and question-agnostic evaluation: the passkey grid and the lm-eval model compress the context before
the question (``question="agnostic"``), checked against references built from ``make_cache`` alone; both modes agree
when nothing is evicted; bad modes are refused before anything runs."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.api.instance import Instance

import kvsieve
from kvsieve.api import eos_ids
from kvsieve.cli import main
from kvsieve.data import builtin_text
from kvsieve.evaluation.lm_eval_model import KVSieveLM
from kvsieve.evaluation.needle import answer, build_prompt, run_needle, split_question
from kvsieve.evaluation.sweep import Runner, Settings, run_sweep

BUDGET = 24
REQUESTS = [
    ("The cat sat on the mat because the day had been long and the sun was warm; it", " was tired."),
    ("The cat sat on the mat because the day had been long and the sun was warm; it", " wanted the warm mat."),
    ("Water boils at sea level when it is heated to a temperature of exactly", " one hundred degrees."),
]


@pytest.fixture(scope="module")
def haystack(tokenizer) -> list[int]:
    return tokenizer(builtin_text(min_chars=20000), add_special_tokens=False).input_ids


def _greedy(model, cache, ids: torch.Tensor, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``ids`` (fed in one pass through ``cache``), each but the last fed back."""
    out: list[int] = []
    with torch.inference_mode():
        logits = model(ids, cache=cache, use_cache=True).logits
        while True:
            out.append(int(logits[0, -1].argmax()))
            if len(out) == steps:
                return out
            logits = model(torch.tensor([out[-1:]]), cache=cache, use_cache=True).logits


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_split_tokenizes_as_the_whole_prompt(tokenizer, haystack, depth) -> None:
    prompt = build_prompt(tokenizer, haystack, 120, depth, 12345, offset=50)
    context, question = split_question(prompt)
    assert context + question == prompt and not context[-1].isspace() and question.lstrip().startswith("What")
    parts = tokenizer(context).input_ids + tokenizer(question, add_special_tokens=False).input_ids
    assert parts == tokenizer(prompt).input_ids


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "streaming_llm"])
def test_agnostic_needle_compresses_the_haystack_before_the_question(tiny_lm, haystack, policy) -> None:
    model, tok = tiny_lm
    prompt = build_prompt(tok, haystack, 120, 0.5, 12345, offset=50)
    context, question = split_question(prompt)
    got = answer(model, tok, prompt, policy, BUDGET, "agnostic")

    cache = kvsieve.make_cache(model, policy, BUDGET, decode_budget=None)  # reference from the cache alone
    with torch.inference_mode():
        model(tok(context, return_tensors="pt").input_ids, cache=cache, use_cache=True)
    assert cache.slot_counts() == [BUDGET] * 3  # the haystack alone, compressed
    q = tok(question, add_special_tokens=False, return_tensors="pt").input_ids
    tokens = _greedy(model, cache, q, 8)
    assert cache.slot_counts() == [BUDGET + q.shape[1] + 7] * 3  # the question and the answer: nothing evicted
    eos = eos_ids(model, tok)
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    assert got == tok.decode(tokens[:end], skip_special_tokens=True).strip()
    aware = kvsieve.make_cache(model, policy, BUDGET)  # the aware protocol: the question compressed with it
    with torch.inference_mode():
        model(tok(prompt, return_tensors="pt").input_ids, cache=aware, use_cache=True)
    assert aware.slot_counts() == [BUDGET] * 3


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_needle_modes_agree_when_nothing_is_evicted(tiny_lm, policy) -> None:
    model, tok = tiny_lm
    hay = builtin_text(min_chars=20000)
    grid = {"lengths": [100], "depths": [0.0, 1.0], "trials": 2, "progress": False}
    cells = {
        q: run_needle(model, tok, hay, policy=policy, budget=10_000, question=q, **grid) for q in ("aware", "agnostic")
    }
    assert [c.answers for c in cells["aware"]] == [c.answers for c in cells["agnostic"]]


def _lm(model, tokenizer, **kwargs) -> KVSieveLM:
    return KVSieveLM(model=model, tokenizer=tokenizer, batch_size=2, protocol="prefill", **kwargs)


def _logprob(logits: torch.Tensor, continuation: list[int]) -> float:
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(continuation)[:, None]).sum().item()


@pytest.mark.parametrize("policy", ["h2o", "tova", "knorm"])
def test_agnostic_scoring_compresses_the_context_before_the_continuation(tiny_lm, policy, monkeypatch) -> None:
    model, tok = tiny_lm
    lm = _lm(model, tok, policy=policy, budget=0.5, question="agnostic")
    caches = []
    make = lm._cache
    monkeypatch.setattr(lm, "_cache", lambda budget: caches.append(make(budget)) or caches[-1])
    pairs = [lm._encode_pair(c, k) for c, k in REQUESTS]
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)])
    # each batch's cache: compressed to its budget, then grown by the continuations (right-padded to the longest)
    widths = [max(len(k) for _, k in pairs[:2]), len(pairs[2][1])]
    budgets = [round(0.5 * len(pairs[0][0])), round(0.5 * len(pairs[2][0]))]
    if budgets[0] == budgets[1]:
        widths, budgets = [max(widths)], budgets[:1]
    assert [c.slot_counts() for c in caches] == [[b + w] * 3 for b, w in zip(budgets, widths, strict=True)]
    expected = []
    for context, continuation in pairs:  # reference: one request at a time, from make_cache alone
        budget = lm.request_budget(len(context), len(continuation))
        assert budget == round(0.5 * len(context))  # a ratio of the context
        cache = kvsieve.make_cache(model, policy, budget, decode_budget=None)
        with torch.inference_mode():
            model(torch.tensor([context[:-1]]), cache=cache, use_cache=True)
            assert max(cache.slot_counts()) == budget
            logits = model(torch.tensor([context[-1:] + continuation[:-1]]), cache=cache).logits
        assert max(cache.slot_counts()) == budget + len(continuation)  # nothing after the context is evicted
        expected.append(_logprob(logits[0], continuation))
    torch.testing.assert_close([s for s, _ in got], expected, atol=1e-4, rtol=1e-5)
    aware = _lm(model, tok, policy=policy, budget=0.5).loglikelihood(
        [Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)]
    )
    assert max(abs(a - b) for (a, _), (b, _) in zip(aware, got, strict=True)) > 1e-3
    assert lm.get_model_info()["kvsieve_question"] == "agnostic"


def test_agnostic_scoring_equals_full_when_the_budget_holds_the_context(tiny_lm) -> None:
    model, tok = tiny_lm
    lm = _lm(model, tok, policy="h2o", budget=10_000, question="agnostic")
    pairs = [lm._encode_pair(c, k) for c, k in REQUESTS]
    expected = _lm(model, tok, policy="full").score(pairs, None)
    torch.testing.assert_close(lm.score(pairs, 64), expected, atol=1e-4, rtol=1e-5)  # a real bounded cache
    assert _lm(model, tok, policy="h2o", budget=1.0, question="agnostic").request_budget(40, 5) is None


def test_agnostic_generation_compresses_the_prompt_but_its_last_token(tiny_lm, monkeypatch) -> None:
    model, tok = tiny_lm
    prompt, max_new = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen", 6
    lm = _lm(model, tok, policy="h2o", budget=0.4, question="agnostic")
    caches = []
    make = lm._cache
    monkeypatch.setattr(lm, "_cache", lambda budget: caches.append(make(budget)) or caches[-1])
    text = lm.generate([prompt], {"until": [], "max_gen_toks": max_new})[0]
    ids = lm.tok_encode(prompt)
    budget = round(0.4 * len(ids))
    assert caches[0].budget_tokens == budget
    assert max(caches[0].slot_counts()) == budget + max_new  # the last prompt token and max_new - 1 decoded

    cache = kvsieve.make_cache(model, "h2o", budget, decode_budget=None)
    with torch.inference_mode():
        model(torch.tensor([ids[:-1]]), cache=cache, use_cache=True)
    tokens = _greedy(model, cache, torch.tensor([ids[-1:]]), max_new)
    assert text == tok.decode(tokens, skip_special_tokens=True)


def test_bad_question_modes_are_refused_before_anything_runs(tiny_lm, tmp_path, capsys) -> None:
    model, tok = tiny_lm
    with pytest.raises(ValueError, match="question must be one of aware, agnostic, got 'blind'"):
        run_needle(model, tok, "text " * 500, lengths=[100], question="blind", progress=False)
    with pytest.raises(ValueError, match="question must be one of"):
        KVSieveLM(model=model, tokenizer=tok, question="blind")
    with pytest.raises(ValueError, match="needs the prefill protocol, not 'stream'"):
        KVSieveLM(model=model, tokenizer=tok, question="agnostic")
    lm = _lm(model, tok, policy="h2o", question="agnostic")
    with pytest.raises(ValueError, match="loglikelihood_rolling"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("Some text.",), 0)])
    for settings, tasks, message in (
        (Settings(question="blind"), ["social_iqa"], "question must be one of"),
        (Settings(question="agnostic"), ["social_iqa"], "needs the prefill protocol"),
        (Settings(question="agnostic", protocol="prefill"), ["social_iqa", "ppl"], "ppl task has no question"),
    ):
        with pytest.raises(ValueError, match=message):
            run_sweep(tmp_path / "sweep", tasks, ["h2o"], [0.2], settings=settings, progress=False)
    assert not (tmp_path / "sweep").exists()


@pytest.mark.usefixtures("no_model")
def test_cli_question_flags_are_checked_before_a_model_loads(capsys, tmp_path) -> None:
    assert main(["needle", "--question", "blind", "--json"]) == 2
    assert "argument --question: invalid choice: 'blind'" in json.loads(capsys.readouterr().out)["error"]
    assert main(["sweep", "--out", str(tmp_path), "--tasks", "social_iqa", "--question", "agnostic"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the prefill protocol" in err
    assert main(["xsum", "--question", "agnostic", "--json"]) == 2
    assert "needs the prefill protocol" in json.loads(capsys.readouterr().out)["error"]


def test_sweep_computes_its_cells_in_the_settings_question_mode(tiny_lm, tmp_path, monkeypatch) -> None:
    made: list[str] = []

    class Recorder:
        def __init__(self, **kwargs: object) -> None:
            made.append(str(kwargs["question"]))

    monkeypatch.setattr("kvsieve.evaluation.lm_eval_model.KVSieveLM", Recorder)
    monkeypatch.setattr(Runner, "loaded", property(lambda self: tiny_lm))
    monkeypatch.setattr(Runner, "_lm_eval", lambda self, lm, name: {"acc": 0.5, "acc_norm": 0.5, "n": 1})
    for question in ("agnostic", "aware", "agnostic"):
        settings = Settings(protocol="prefill", question=question)
        run_sweep(tmp_path, ["social_iqa"], ["h2o"], [0.2], settings=settings, progress=False)
    assert made == ["agnostic", "aware", "agnostic"]  # another mode is another result
    (cell,) = (tmp_path / "cells").glob("*.json")
    assert json.loads(cell.read_text())["settings"]["question"] == "agnostic"
