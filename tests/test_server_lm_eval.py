"""lm-eval's own ``local-completions`` model against a live ``kvsieve serve`` on 127.0.0.1 gives the log-likelihoods
and accuracy of the in-process lm-eval model ``kvsieve`` with the same policy, budget and ``protocol=stream``: the
server's defaults (``--policy``, ``--budget``) apply, as lm-eval's requests carry no kv fields."""

from __future__ import annotations

from typing import Any

import pytest
from test_server import NAME, serve  # noqa: F401 (serve: the live-server fixture)

from kvsieve.server.scheduler import KVSpec

TASK = "kvsieve_cause_and_effect_two_sentences"
LIMIT = 8
KEY = "sk-lm-eval-test"


def evaluate(model: Any, model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    import lm_eval

    from kvsieve.evaluation.tasks import task_manager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=task_manager([TASK]),
        limit=LIMIT,
        bootstrap_iters=0,
        log_samples=True,
    )


def per_item(results: dict[str, Any]) -> list[tuple[int, int, float, bool]]:
    """``(doc, choice, log-likelihood, is_greedy)`` of every request lm-eval made."""
    rows = []
    for sample in results["samples"][TASK]:
        for choice, (loglikelihood, greedy) in enumerate(sample["filtered_resps"]):
            rows.append((sample["doc_id"], choice, float(loglikelihood), bool(greedy)))
    return sorted(rows)


@pytest.mark.parametrize(("policy", "budget", "params"), [("h2o", 0.3, {}), ("streaming_llm", 24, {"sink": 4})])
def test_local_completions_against_the_server_equals_the_in_process_model(
    serve,  # noqa: F811
    tiny_lm,
    tiny_dir,
    monkeypatch,
    policy,
    budget,
    params,
) -> None:
    from kvsieve.evaluation.lm_eval_model import KVSieveLM

    model, tokenizer = tiny_lm
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # (what local-completions sends as its bearer token)
    base = serve(defaults=KVSpec(policy, budget, params), api_key=KEY)
    served = evaluate(
        "local-completions",
        {
            "model": NAME,
            "base_url": f"{base}/v1/completions",
            "tokenizer": tiny_dir,
            "tokenizer_backend": "huggingface",
            "max_length": 1024,
            "batch_size": 3,  # (several prompts per request)
            "max_retries": 1,
        },
    )
    local = evaluate(
        KVSieveLM(model=model, tokenizer=tokenizer, policy=policy, budget=budget, protocol="stream", **params)
    )
    got, want = per_item(served), per_item(local)
    assert len(got) == len(want) == 2 * LIMIT
    for (doc, choice, value, greedy), (doc_, choice_, value_, greedy_) in zip(got, want, strict=True):
        assert (doc, choice, greedy) == (doc_, choice_, greedy_)
        assert value == pytest.approx(value_, abs=2e-4)
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"][TASK][metric] == local["results"][TASK][metric]
    full = per_item(evaluate(KVSieveLM(model=model, tokenizer=tokenizer, policy="full", protocol="stream")))
    assert max(abs(a[2] - b[2]) for a, b in zip(got, full, strict=True)) > 1e-2  # (the budget mattered)


def test_lm_evals_own_models_stay_registered_beside_kvsieves() -> None:
    from lm_eval.api.registry import get_model

    import kvsieve.evaluation.lm_eval_model  # noqa: F401  (registers "kvsieve")

    assert get_model("kvsieve").__name__ == "KVSieveLM"
    assert get_model("local-completions").__name__ == "LocalCompletionsAPI"  # (what `kvsieve lm-eval` runs)
