"""The lm-eval model ``kvsieve``: scoring and generation under eviction, against plain forwards and token-by-token
references through the cache; a real lm-eval run through the Python API and the CLI."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from transformers import PreTrainedModel

import kvsieve
from kvsieve.cli import main
from kvsieve.cli.commands import lm_eval_batch_size
from kvsieve.evaluation.lm_eval_model import KVSieveLM

TASK = "kvsieve_copa"
REQUESTS = [
    ("The cat sat on the mat because", " it was tired."),
    ("The cat sat on the mat because", " the mat was warm and soft."),
    ("Water boils at", " one hundred degrees."),
    ("Paris is the capital of France, a country in western Europe whose", " capital is Paris."),
]


@pytest.fixture
def tiny(tiny_lm) -> PreTrainedModel:
    """The tiny random Llama with the real tokenizer's vocabulary (``tiny_lm``)."""
    return tiny_lm[0]


def _lm(model, tokenizer, **kwargs) -> KVSieveLM:
    return KVSieveLM(model=model, tokenizer=tokenizer, batch_size=2, **kwargs)


def _instances(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def _token_pairs(lm: KVSieveLM) -> list[tuple[list[int], list[int]]]:
    return [lm._encode_pair(c, k) for c, k in REQUESTS]


def _logprob(logits: torch.Tensor, continuation: list[int]) -> float:
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(continuation)[:, None]).sum().item()


def _reference(model, context: list[int], continuation: list[int], policy: str, budget: int, prefill: bool) -> float:
    """Feed the request one token at a time through a fresh cache (the context at once when ``prefill``)."""
    cache = kvsieve.make_cache(model, policy, budget)
    ids = torch.tensor([context + continuation])
    first = len(context) if prefill else 1
    with torch.inference_mode():
        logits = [model(ids[:, :first], cache=cache).logits]
        logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(first, ids.shape[1] - 1)]
    return _logprob(torch.cat(logits, dim=1)[0, -len(continuation) :], continuation)


def test_full_loglikelihood_equals_plain_forward(tiny, tokenizer) -> None:
    lm = _lm(tiny, tokenizer, policy="full")
    got = lm.loglikelihood(_instances(REQUESTS))
    with torch.inference_mode():
        expected = [_logprob(tiny(torch.tensor([c + k])).logits[0, len(c) - 1 : -1], k) for c, k in _token_pairs(lm)]
    torch.testing.assert_close([g for g, _ in got], expected, atol=1e-4, rtol=1e-5)
    assert all(isinstance(greedy, bool) for _, greedy in got)


def test_rolling_loglikelihood_streams_the_whole_text(tiny, tokenizer) -> None:
    text = "A rolling log-likelihood scores every token of a text after the prefix token."
    ids = [tokenizer.bos_token_id, *tokenizer.encode(text)]
    with torch.inference_mode():
        expected = _logprob(tiny(torch.tensor([ids])).logits[0, :-1], ids[1:])
        reference = _reference(tiny, ids[:1], ids[1:], "h2o", 6, prefill=False)
    for policy, value in (("full", expected), ("h2o", reference)):
        lm = _lm(tiny, tokenizer, policy=policy, budget=6)
        (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
        assert got == pytest.approx(value, abs=1e-3)
    assert abs(expected - reference) > 1e-2


@pytest.mark.parametrize("protocol", ["stream", "prefill"])
def test_budget_at_least_the_length_equals_full(tiny, tokenizer, protocol) -> None:
    full = _lm(tiny, tokenizer, policy="full")
    h2o = _lm(tiny, tokenizer, policy="h2o", budget=10_000, protocol=protocol)
    pairs = _token_pairs(h2o)
    expected = full.score(pairs, None)
    torch.testing.assert_close(h2o.score(pairs, 64), expected, atol=1e-4, rtol=1e-5)  # a real bounded cache
    torch.testing.assert_close(h2o.loglikelihood(_instances(REQUESTS)), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "local"])
def test_protocols_equal_their_token_by_token_references_and_differ(tiny, tokenizer, policy) -> None:
    budget = 5
    scores = {}
    for protocol in ("stream", "prefill"):
        lm = _lm(tiny, tokenizer, policy=policy, protocol=protocol)
        pairs = _token_pairs(lm)
        scores[protocol] = [s for s, _ in lm.score(pairs, budget)]
        expected = [_reference(tiny, c, k, policy, budget, protocol == "prefill") for c, k in pairs]
        torch.testing.assert_close(scores[protocol], expected, atol=1e-4, rtol=1e-5)
    assert max(abs(a - b) for a, b in zip(scores["stream"], scores["prefill"], strict=True)) > 1e-2


def test_ratio_budgets_are_resolved_per_request(tiny, tokenizer) -> None:
    lm = _lm(tiny, tokenizer, policy="h2o", budget=0.25)
    assert [lm.evicting_budget(n) for n in (40, 100, 8)] == [10, 25, 2]
    assert _lm(tiny, tokenizer, policy="h2o", budget=1.0).evicting_budget(40) is None  # 100 % never evicts
    assert _lm(tiny, tokenizer, policy="h2o", budget="20%").budget == 0.2
    tokens = _lm(tiny, tokenizer, policy="local", budget=64)
    assert (tokens.evicting_budget(40), tokens.evicting_budget(100)) == (None, 64)
    assert _lm(tiny, tokenizer, policy="full", budget=0.1).evicting_budget(100) is None
    with pytest.raises(ValueError, match="protocol"):
        _lm(tiny, tokenizer, protocol="chunked")
    with pytest.raises(ValueError, match="recent"):
        _lm(tiny, tokenizer, policy="local", recent=3)


def test_generation_streams_the_prompt_and_decodes_under_the_budget(tiny, tokenizer, monkeypatch) -> None:
    prompt, max_new, ratio = "One two three four five six seven eight nine ten eleven twelve", 6, 0.3
    lm = _lm(tiny, tokenizer, policy="h2o", budget=ratio)
    caches = []
    make = lm._cache
    monkeypatch.setattr(lm, "_cache", lambda budget: caches.append(make(budget)) or caches[-1])
    text = lm.generate([prompt], {"until": [], "max_gen_toks": max_new})[0]

    ids = lm.tok_encode(prompt)
    budget = round(ratio * (len(ids) + max_new))
    assert caches[0].budget_tokens == budget and max(caches[0].slot_counts()) <= budget
    cache = kvsieve.make_cache(tiny, "h2o", budget)  # reference: every token fed on its own, greedy decoding
    tokens, out = list(ids), []
    with torch.inference_mode():
        for t in range(len(ids) + max_new - 1):
            logits = tiny(torch.tensor([tokens[t : t + 1]]), cache=cache).logits
            if t >= len(ids) - 1:
                tokens.append(int(logits[0, -1].argmax()))
                out.append(tokens[-1])
    assert text == tokenizer.decode(out, skip_special_tokens=True)

    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = lm.generate([prompt], {"until": [stop], "max_gen_toks": max_new})[0]
    assert cut == text.split(stop)[0]


def test_generation_drops_the_oldest_context_tokens_beyond_the_positions(tiny, tokenizer, monkeypatch) -> None:
    lm = _lm(tiny, tokenizer, policy="h2o", budget=0.5)
    fed = []
    monkeypatch.setattr(lm, "_generate", lambda prompts, *args: fed.extend(prompts) or [""] * len(prompts))
    long, short = " ".join(str(i) for i in range(1500)), "A short prompt"
    lm.generate([long, short], {"until": [], "max_gen_toks": 8})
    ids = lm.tok_encode(long)
    assert lm.max_length == 1024 and len(ids) > lm.max_length
    assert sorted(fed, key=len) == [lm.tok_encode(short), ids[-(lm.max_length - 8) :]]
    with pytest.raises(ValueError, match="no room for a context"):
        lm.generate([short], {"until": [], "max_gen_toks": lm.max_length})


@pytest.mark.slow
def test_simple_evaluate_by_model_name_on_a_cached_pack_task() -> None:
    import lm_eval

    from kvsieve.evaluation.tasks import task_manager

    results = lm_eval.simple_evaluate(
        model="kvsieve",
        model_args="pretrained=smollm2-135m,policy=h2o,budget=0.2,protocol=stream,device=cpu",
        tasks=[TASK],
        task_manager=task_manager([TASK]),
        limit=10,
        bootstrap_iters=0,
    )
    row = results["results"][TASK]
    assert 0.0 <= row["acc,none"] <= 1.0 and 0.0 <= row["acc_norm,none"] <= 1.0
    assert results["n-samples"][TASK]["effective"] == 10
    assert results["config"]["kvsieve_policy"] == "h2o"
    assert results["configs"][TASK]["num_fewshot"] == 5


@pytest.mark.slow
def test_cli_runs_lm_eval_with_the_kvsieve_model(tiny, tokenizer, tmp_path, capsys) -> None:
    tiny.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    args = f"pretrained={tmp_path / 'tiny'},policy=streaming_llm,budget=0.1,sink=2"
    code = main(["lm-eval", "--model", "kvsieve", "--model_args", args, "--tasks", TASK, "--limit", "3"])
    assert code == 0
    table = capsys.readouterr().out
    assert TASK in table and "acc" in table
    assert "batch_size: 8" in table  # (lm-eval's own default is 1)
    assert lm_eval_batch_size(["--tasks", TASK]) == ["--tasks", TASK, "--batch_size", "8"]
    for given in (["--batch_size", "2"], ["--batch_size=2"], ["-b", "2"], ["--config", "run.yaml"]):
        assert lm_eval_batch_size(given) == given


def test_budget_of_the_context_streams_shared_contexts_once(tiny, tokenizer, monkeypatch) -> None:
    lm = _lm(tiny, tokenizer, policy="h2o", budget=0.5, budget_of="context")
    pairs = _token_pairs(lm)
    assert [lm.request_budget(len(c), len(k)) for c, k in pairs] == [round(0.5 * len(c)) for c, _ in pairs]
    per_request = _lm(tiny, tokenizer, policy="h2o", budget=0.5)
    assert per_request.request_budget(len(pairs[0][0]), len(pairs[0][1])) == round(0.5 * sum(map(len, pairs[0])))
    assert lm.request_budget(40, 1) == 20 and lm.request_budget(40, 50) == 20
    assert _lm(tiny, tokenizer, policy="h2o", budget=0.99, budget_of="context").request_budget(40, 1) is None
    contexts_fed, results = [], []
    for model_lm in (lm, per_request):
        fed: list[list[int]] = []  # the rows of every first forward pass (the contexts)
        forward = model_lm._forward

        def recording(cache, rows, past, keep=0, forward=forward, fed=fed):
            fed.extend(rows if past is None else [])
            return forward(cache, rows, past, keep)

        monkeypatch.setattr(model_lm, "_forward", recording)
        results.append(model_lm.loglikelihood(_instances(REQUESTS)))
        contexts_fed.append(len(fed))
    assert contexts_fed == [3, 4]  # one stream for the two choices of "The cat sat ...", not two
    expected = [_reference(tiny, c, k, "h2o", round(0.5 * len(c)), prefill=False) for c, k in pairs]
    torch.testing.assert_close([s for s, _ in results[0]], expected, atol=1e-4, rtol=1e-5)
    assert lm.get_model_info()["kvsieve_budget_of"] == "context"
    with pytest.raises(ValueError, match="budget_of"):
        _lm(tiny, tokenizer, budget_of="prompt")
    with pytest.raises(ValueError, match="agnostic"):
        _lm(tiny, tokenizer, protocol="prefill", question="agnostic", budget_of="request")
