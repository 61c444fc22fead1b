"""``kvsieve serve --ray --replicas N``: replicas of the server on Ray Serve behind one OpenAI endpoint.

One ``kvsieve serve --ray --replicas 2`` on a local Ray (a loopback-only network namespace, as evaluation/test_ray.py
runs Ray: tests/ray_support.py) is driven by this file run as a script in that namespace, with the official
``openai`` client: its greedy answers (completions and chat, streamed and not) must be the in-process server's,
requests must spread over both replicas (each response names its replica's PID in ``X-Kvsieve-Replica-Pid``), each
replica's ``/metrics`` must show its KV held within the cap, and a replica killed mid-run (SIGKILL) must cost no
unstreamed request (the ``openai`` client retries the proxy's 500 on the other replica) while its streams end with
an error event, nothing hanging. Everything started is killed at the end, also on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from ray_support import TIMEOUT_S, free_port, in_loopback, two_nodes

from kvsieve.cli import main

slow = pytest.mark.slow  # (starts Ray: about 1.5 minutes on the shared 2-core machine)

NAME = "tiny"
BUDGET = 16
PROMPTS = [
    "The history of the city begins with a small settlement on the river, where traders met every spring",
    "Photosynthesis converts light energy into chemical energy stored in sugar molecules inside the",
    "In 1905 Albert Einstein published four papers that changed physics, among them one on",
    "A recipe for bread: mix flour, water, salt and yeast, knead the dough for ten minutes, then",
]
CHAT = [{"role": "user", "content": "Name three rivers of Europe and the seas they flow into."}]
SHORT, LONG = 24, 160  # completion tokens: the answers and spread phases; the fault phase (in flight when killed)
STOPPED = "the replica serving this request stopped"


# --- the expected answers: the in-process server -------------------------------------------------------------


@pytest.fixture(scope="module")
def in_process(tiny_dir) -> dict[str, Any]:
    """The in-process server's greedy answers (``build_app`` on the model ``--model`` loads, one torch thread as a
    replica has) and the KV bytes a request reserves."""
    import openai
    import torch
    from fastapi.testclient import TestClient

    from kvsieve.models import load_model
    from kvsieve.server.app import build_app
    from kvsieve.server.jobs import KVSpec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = load_model(tiny_dir, device="cpu")
        app = build_app(model, tokenizer, model_name=NAME, defaults=KVSpec("h2o", BUDGET, {}), kv_cap_bytes=2**30)
        with TestClient(app) as http:
            api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
            found = _answers(api)
            long = [api.completions.create(model=NAME, prompt=p, max_tokens=LONG, temperature=0) for p in PROMPTS]
    finally:
        torch.set_num_threads(threads)
    return {**found, "long": [out.choices[0].text for out in long]}


def _answers(api: Any) -> dict[str, Any]:
    """Completions and chat, unstreamed and streamed, greedy; their texts, PIDs of the replicas and reserved bytes."""
    found: dict[str, Any] = {"pids": []}
    raw = api.completions.with_raw_response.create(model=NAME, prompt=PROMPTS[0], max_tokens=SHORT, temperature=0)
    out = raw.parse()
    found["completion"], found["reserved"] = out.choices[0].text, out.kvsieve["kv_bytes_reserved"]
    found["pids"].append(raw.headers.get("x-kvsieve-replica-pid"))
    raw = api.completions.with_raw_response.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=SHORT, temperature=0, stream=True
    )
    found["completion_stream"] = "".join(chunk.choices[0].text for chunk in raw.parse() if chunk.choices)
    found["pids"].append(raw.headers.get("x-kvsieve-replica-pid"))
    raw = api.chat.completions.with_raw_response.create(model=NAME, messages=CHAT, max_tokens=SHORT, temperature=0)
    found["chat"] = raw.parse().choices[0].message.content
    found["pids"].append(raw.headers.get("x-kvsieve-replica-pid"))
    raw = api.chat.completions.with_raw_response.create(
        model=NAME, messages=CHAT, max_tokens=SHORT, temperature=0, stream=True
    )
    found["chat_stream"] = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    found["pids"].append(raw.headers.get("x-kvsieve-replica-pid"))
    found["spread"] = [
        api.completions.create(model=NAME, prompt=p, max_tokens=SHORT, temperature=0).choices[0].text for p in PROMPTS
    ]
    return found


# --- the scenario, run as a script in the loopback namespace -------------------------------------------------


def _start_server(argv: list[str], log: Path) -> subprocess.Popen[str]:
    """``kvsieve serve`` with ``argv``, once it says it serves (its stderr goes on into ``log``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsieve.cli", "serve", *argv], stderr=subprocess.PIPE, text=True, bufsize=1
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        with open(log, "w") as out:
            for line in proc.stderr:
                out.write(line)
                out.flush()
                lines.append(line)
                if line.startswith("kvsieve serve:"):
                    ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(TIMEOUT_S * 2.5) or proc.poll() is not None:
        proc.kill()
        raise RuntimeError("kvsieve serve did not start:\n" + "".join(lines[-30:]))
    return proc


def _metrics(base: str, want: int, seen: dict[str, dict[str, float]], avoid: set[str] = frozenset()) -> None:
    """GET /metrics until ``want`` replicas (PIDs not in ``avoid``) answered, into ``seen`` (PID → metric → value)."""
    import httpx

    deadline = time.monotonic() + TIMEOUT_S
    while len(set(seen) - avoid) < want and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{base}/metrics", timeout=10)
            if response.status_code == 200:
                values = {}
                for line in response.text.splitlines():
                    if re.match(r"kvsieve_kv_bytes_(held_max|cap) ", line):
                        name, value = line.split()
                        values[name] = float(value)
                seen[response.headers["x-kvsieve-replica-pid"]] = values
        time.sleep(0.2)


def _concurrently(calls: list[Any]) -> list[Any]:
    """Every call of ``calls`` in a thread of its own; their results (an exception as a value), each joined within
    the clients' timeout."""
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except Exception as err:
            results[index] = err

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 2)
    return [{"hung": True} if thread.is_alive() else result for thread, result in zip(threads, results, strict=True)]


def _fault(api: Any) -> dict[str, Any]:
    """Streams and unstreamed requests in flight on both replicas; the replica of the first stream that has text
    is killed (SIGKILL). What each request got, and how long."""
    victim: list[int] = []
    streaming = threading.Event()

    def plain(prompt: str) -> Any:
        start = time.monotonic()
        raw = api.completions.with_raw_response.create(model=NAME, prompt=prompt, max_tokens=LONG, temperature=0)
        text = raw.parse().choices[0].text
        pid = raw.headers.get("x-kvsieve-replica-pid")
        return {"text": text, "pid": pid, "retries": raw.retries_taken, "seconds": time.monotonic() - start}

    def streamed(prompt: str) -> Any:
        start, pieces, pid, error = time.monotonic(), [], None, None
        try:
            raw = api.completions.with_raw_response.create(
                model=NAME, prompt=prompt, max_tokens=LONG, temperature=0, stream=True
            )
            pid = raw.headers.get("x-kvsieve-replica-pid")
            for chunk in raw.parse():
                pieces.append(chunk.choices[0].text if chunk.choices else "")
                if len(pieces) >= 3 and not streaming.is_set():
                    victim.append(int(pid))
                    streaming.set()
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        return {"text": "".join(pieces), "pid": pid, "error": error, "seconds": time.monotonic() - start}

    def killer() -> None:
        if streaming.wait(TIMEOUT_S):
            os.kill(victim[0], signal.SIGKILL)

    kill = threading.Thread(target=killer, daemon=True)
    kill.start()
    calls = [lambda p=p: streamed(p) for p in PROMPTS] + [lambda p=p: plain(p) for p in PROMPTS * 2]
    results = _concurrently(calls)
    kill.join(1)
    results = [{"error": f"{type(r).__name__}: {r}"} if isinstance(r, Exception) else r for r in results]
    return {"victim": str(victim[0]) if victim else None, "streams": results[:4], "plain": results[4:]}


def scenario(args: dict[str, Any]) -> dict[str, Any]:
    """``kvsieve serve --ray --replicas 2`` on a new local Ray (in this namespace), driven as the module docstring
    says; at the end Ctrl-C (SIGINT) must stop it."""
    import openai

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["--model", args["model"], "--served-name", NAME, "--policy", "h2o", "--budget", str(BUDGET)]
    argv += ["--port", str(port), "--kv-memory-gb", repr(args["cap"] / 2**30), *args["ray"]]
    found: dict[str, Any] = {}
    started = time.monotonic()
    server = _start_server(argv, Path(args["work"]) / "serve.log")
    found["start_seconds"] = time.monotonic() - started
    try:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        found["answers"] = _answers(api)

        def spread(prompt: str) -> tuple[str, str, str]:
            raw = api.completions.with_raw_response.create(model=NAME, prompt=prompt, max_tokens=SHORT, temperature=0)
            return (
                raw.parse().choices[0].text,
                raw.headers["x-kvsieve-replica-pid"],
                raw.headers["x-kvsieve-replica-node"],
            )

        results = _concurrently([lambda p=p: spread(p) for p in PROMPTS * 4])
        found["spread"] = [r[:2] if isinstance(r, tuple) else (repr(r), None) for r in results]
        found["nodes"] = {r[1]: r[2] for r in results if isinstance(r, tuple)}
        seen: dict[str, dict[str, float]] = {}
        _metrics(base, 2, seen)
        found["metrics"] = seen
        if args.get("fault"):
            retrying = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=2, timeout=TIMEOUT_S)
            found["fault"] = _fault(retrying)
            after: dict[str, dict[str, float]] = {}
            waited = time.monotonic()
            _metrics(base, 1, after, avoid={found["fault"]["victim"], *seen})  # Serve starts a new replica
            found["replaced"] = {"pids": sorted(set(after) - set(seen)), "seconds": time.monotonic() - waited}
    finally:
        stopping = time.monotonic()
        server.send_signal(signal.SIGINT)
        try:
            found["exit"] = {"code": server.wait(TIMEOUT_S / 2), "seconds": time.monotonic() - stopping}
        except subprocess.TimeoutExpired:
            server.kill()
            found["exit"] = {"code": None}
        (Path(args["work"]) / "found.json").write_text(json.dumps(found, indent=1))  # (for a failure's reader)
    return found


def cluster(args: dict[str, Any]) -> dict[str, Any]:
    """A head and a second node of one CPU each (``ray start``), then the scenario with ``--ray HOST:PORT``: the two
    replicas (one CPU each) on the two nodes."""
    started = time.monotonic()
    with two_nodes() as address:
        cluster_seconds = time.monotonic() - started
        return {**scenario({**args, "ray": ["--ray", address, "--replicas", "2"]}), "cluster_seconds": cluster_seconds}


# --- the tests ------------------------------------------------------------------------------------------------


def _run(name: str, args: dict[str, Any]) -> dict[str, Any]:
    run = in_loopback([sys.executable, __file__, name, json.dumps(args)], timeout=TIMEOUT_S * 4)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.splitlines()[-1])
    return found


def _cap(in_process: dict[str, Any]) -> int:
    """A KV cap that admits three of the test's requests at once on a replica (they reserve the same bytes)."""
    return int(in_process["reserved"] * 3.5)


@pytest.fixture(scope="module")
def local(tiny_dir, in_process, tmp_path_factory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("serve_ray")
    args = {"work": str(work), "model": tiny_dir, "cap": _cap(in_process), "fault": True}
    return _run("local", {**args, "ray": ["--ray", "--replicas", "2"]})


def _same_answers(found: dict[str, Any], in_process: dict[str, Any]) -> None:
    for key in ("completion", "completion_stream", "chat", "chat_stream"):
        assert found[key] == in_process[key], key
    assert found["completion"] == found["completion_stream"] and found["chat"] == found["chat_stream"]


@slow
def test_replicas_answer_as_the_in_process_server(local, in_process) -> None:
    _same_answers(local["answers"], in_process)
    assert [text for text, _ in local["spread"]] == in_process["spread"] * 4


@slow
def test_requests_spread_over_both_replicas(local) -> None:
    pids = {pid for _, pid in local["spread"]}
    assert len(pids) == 2 and all(pid.isdigit() for pid in pids)
    assert {pid for pid in local["answers"]["pids"]} <= pids
    assert set(local["metrics"]) == pids  # (each replica's own /metrics, reached through the proxy)


@slow
def test_each_replica_holds_its_kv_within_the_cap(local, in_process) -> None:
    cap = _cap(in_process)
    for pid, values in local["metrics"].items():
        assert values["kvsieve_kv_bytes_cap"] == cap, pid
        # several requests held at once (16 requests, 8 a replica, 3 admitted at a time), never past the cap
        assert 2 * in_process["reserved"] <= values["kvsieve_kv_bytes_held_max"] <= cap, (pid, values)


@slow
def test_a_killed_replica_costs_no_unstreamed_request_and_ends_its_streams_with_an_error(local, in_process) -> None:
    fault, expected = local["fault"], in_process["long"] * 2
    victim = fault["victim"]
    assert victim is not None and victim in local["metrics"]
    # unstreamed: every one answered in full, those of the dead replica by the other (the openai client retried)
    retried = [r for r in fault["plain"] if r.get("retries")]
    assert [r.get("text") for r in fault["plain"]] == expected, fault["plain"]
    assert retried and all(r["pid"] != victim for r in fault["plain"])
    # streamed: the dead replica's end with the proxy's error event, the other replica's complete
    for result, text in zip(fault["streams"], in_process["long"], strict=True):
        if result["pid"] == victim:
            assert result["error"] == f"APIError: {STOPPED}" and text.startswith(result["text"]), result
        else:
            assert result["error"] is None and result["text"] == text, result
    assert any(r["pid"] == victim for r in fault["streams"])
    # nothing hung: each request ended within the clients' timeout
    assert all(r["seconds"] < TIMEOUT_S for r in fault["plain"] + fault["streams"])
    # Serve replaced the dead replica; Ctrl-C stopped the server
    assert len(local["replaced"]["pids"]) == 1, local["replaced"]
    assert local["exit"]["code"] == 0


@slow
def test_a_two_node_cluster_serves_a_replica_on_each_node(tiny_dir, in_process, tmp_path) -> None:
    args = {"work": str(tmp_path), "model": tiny_dir, "cap": _cap(in_process)}
    found = _run("cluster", args)
    _same_answers(found["answers"], in_process)
    assert [text for text, _ in found["spread"]] == in_process["spread"] * 4
    pids = {pid for _, pid in found["spread"]}
    assert len(pids) == 2 and set(found["nodes"]) == pids
    assert len(set(found["nodes"].values())) == 2  # (Ray's node ids: one replica on each node)
    assert found["exit"]["code"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "2"], "--replicas needs --ray"),
        (["--gpus-per-replica", "1"], "--gpus-per-replica needs --ray"),
        (["--cpus-per-replica", "2"], "--cpus-per-replica needs --ray"),
        (["--ray", "--replicas", "0"], "expected a positive integer, got '0'"),
        (["--ray", "--cpus-per-replica", "1.5"], "cpus-per-replica must be a fraction of 1 or a whole number"),
        (["--ray", "--gpus-per-replica", "2.5"], "gpus-per-replica must be a fraction of 1 or a whole number"),
        (["--ray", "--device", "cuda"], "--device cuda on Ray needs --gpus-per-replica"),
        (["--ray", "--replicas", "1000"], "1000 replicas × 1 CPUs need 1000 CPUs; this machine has"),
        (["--ray", "--dtype", "int3"], "unsupported dtype 'int3'"),
        (["--ray", "--policy", "nope"], "nope"),
    ],
)
def test_serve_ray_options_are_checked_before_anything_starts(capsys, no_model, monkeypatch, args, message) -> None:
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", refuse)
    assert main(["serve", *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (a parser error prints the usage before)
    assert last.startswith("kvsieve serve: error: ") and message in last


def test_gpus_per_replica_on_a_local_ray_needs_cuda(capsys, no_model, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "--ray", "--gpus-per-replica", "1", "--device", "cuda"]) == 2
    assert "--gpus-per-replica needs CUDA on this machine" in capsys.readouterr().err


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    name, raw = sys.argv[1:]
    result = {"local": scenario, "cluster": cluster}[name](json.loads(raw))
    print("\n" + json.dumps(result))  # (the last line: Ray may print before)
