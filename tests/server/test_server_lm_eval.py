"""lm-eval's own API models against a live ``kvsieve serve`` on 127.0.0.1 give what the in-process lm-eval model
``kvsieve`` gives with the same policy and budget: ``local-completions`` the log-likelihoods and accuracy under
``protocol=stream``; ``local-chat-completions`` and ``local-completions`` the generations of a ``generate_until``
task under ``protocol=prefill``. The server's defaults (``--policy``, ``--budget``) apply, as lm-eval's requests
carry no kv fields. ``/tokenizer_info`` lets ``local-completions`` tokenize with the server's tokenizer
(``tokenizer_backend=auto``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from test_server import NAME, serve  # noqa: F401 (serve: the live-server fixture)

from kvsieve.server.jobs import KVSpec

TASK = "kvsieve_copa"
LIMIT = 8
KEY = "sk-lm-eval-test"
GENERATE = f"{TASK}_generate"
GENERATE_LIMIT = 4


def evaluate(model: Any, model_args: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """``TASK`` (``LIMIT`` documents) unless ``options`` say otherwise (``tasks``, ``task_manager``, ``limit``...)."""
    import lm_eval

    from kvsieve.evaluation.tasks import task_manager

    options = {"tasks": [TASK], "limit": LIMIT, **options}
    options.setdefault("task_manager", task_manager(options["tasks"]))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, bootstrap_iters=0, log_samples=True, **options)


def generate_task(directory: Path) -> dict[str, Any]:
    """``evaluate`` options for ``GENERATE``: the pack's ``TASK`` as a ``generate_until`` task (the right event
    written out, up to a new line), its config written to ``directory``."""
    from lm_eval.tasks import TaskManager

    from kvsieve.evaluation.tasks import ensure_task_pack

    config = yaml.safe_load((ensure_task_pack() / f"{TASK}.yaml").read_text())
    del config["doc_to_choice"]
    config.update(
        task=GENERATE,
        output_type="generate_until",
        doc_to_target="{{choices[gold]}}",
        generation_kwargs={"until": ["\n"], "max_gen_toks": 12, "do_sample": False, "temperature": 0},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )
    (directory / f"{GENERATE}.yaml").write_text(yaml.safe_dump(config))
    manager = TaskManager(include_path=str(directory), include_defaults=False)
    return {"tasks": [GENERATE], "task_manager": manager, "limit": GENERATE_LIMIT}


def generations(results: dict[str, Any]) -> list[tuple[int, str]]:
    """``(doc, generated text)`` of every document."""
    return sorted((sample["doc_id"], sample["filtered_resps"][0]) for sample in results["samples"][GENERATE])


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


def test_local_chat_completions_generate_until_equals_the_in_process_model(
    serve,  # noqa: F811
    tiny_lm,
    tmp_path,
) -> None:
    """The chat template applied on both sides (lm-eval sends the messages, the server templates them; the in-process
    model templates them itself), greedy. The server prefills a prompt with full attention and compresses it, then
    decodes under eviction: the in-process ``protocol=prefill``. A budget in tokens (a ratio would differ: the server
    resolves it against the prompt, the in-process model against the prompt and ``max_gen_toks``), below the prompts'
    lengths (the in-process model runs ``full`` where nothing would be evicted)."""
    from kvsieve.evaluation.lm_eval_model import KVSieveLM

    model, tokenizer = tiny_lm
    base = serve(defaults=KVSpec("h2o", 32, {}))
    task = generate_task(tmp_path)
    args = {"model": NAME, "base_url": f"{base}/v1/chat/completions", "max_retries": 1}
    served = evaluate("local-chat-completions", args, apply_chat_template=True, **task)
    local = KVSieveLM(model=model, tokenizer=tokenizer, policy="h2o", budget=32, protocol="prefill", batch_size=1)
    want = generations(evaluate(local, apply_chat_template=True, **task))
    got = generations(served)
    assert got == want and len(got) == GENERATE_LIMIT and any(text for _, text in got)
    full = KVSieveLM(model=model, tokenizer=tokenizer, policy="full", batch_size=1)
    assert generations(evaluate(full, apply_chat_template=True, **task)) != got  # (the budget mattered)


def test_local_completions_generate_until_with_the_servers_tokenizer(serve, tiny_lm, tmp_path) -> None:  # noqa: F811
    """``tokenizer_backend=auto`` (lm-eval's default) finds ``/tokenizer_info`` and ``/tokenize``: lm-eval tokenizes
    with the server and sends token ids, several prompts per request. No chat template; as above otherwise."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from kvsieve.evaluation.lm_eval_model import KVSieveLM

    model, tokenizer = tiny_lm
    base = serve(defaults=KVSpec("streaming_llm", 24, {"sink": 4}))
    remote = LocalCompletionsAPI(model=NAME, base_url=f"{base}/v1/completions", batch_size=2, max_retries=1)
    assert remote.tokenizer_backend == "remote" and remote.eot_token_id == tokenizer.eos_token_id
    task = generate_task(tmp_path)
    got = generations(evaluate(remote, **task))
    local = KVSieveLM(model=model, tokenizer=tokenizer, policy="streaming_llm", budget=24, sink=4, protocol="prefill")
    assert got == generations(evaluate(local, **task)) and any(text for _, text in got)


def test_tokenizer_info_is_vllms(serve, tiny_lm) -> None:  # noqa: F811
    """What lm-eval's remote tokenizer reads: the special tokens and the chat template it renders itself."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    tokenizer = tiny_lm[1]
    base = serve(api_key=KEY)
    assert httpx.get(f"{base}/tokenizer_info", timeout=10).status_code == 401
    info = httpx.get(f"{base}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (
        tokenizer.eos_token,
        tokenizer.bos_token,
        tokenizer.pad_token,
    )
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == tokenizer.model_max_length
    assert not [key for key in info if key.endswith("_file") or key == "name_or_path"]  # (no local paths)
    assert check_remote_tokenizer_support(base, auth_token=KEY) and not check_remote_tokenizer_support(base)
    remote = RemoteTokenizer(f"{base}/v1/completions", auth_token=KEY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert remote.apply_chat_template(messages) == rendered
    assert remote.encode(rendered) == tokenizer(rendered, add_special_tokens=False).input_ids
    assert remote.eos_token_id == tokenizer.eos_token_id
