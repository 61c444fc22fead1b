"""``kvsieve serve --ray --replicas N``: replicas of the server on Ray Serve behind one OpenAI endpoint.

scripts/serve_ray.py drives one ``kvsieve serve --ray --replicas 2`` on a local Ray (run in a loopback-only network
namespace, as evaluation/test_ray.py runs Ray: tests/ray_support.py) with the official ``openai`` client: its greedy
answers (completions and chat, streamed and not) must be the in-process server's, requests must spread over both
replicas (each response names its replica's PID in ``X-Kvsieve-Replica-Pid``), each replica's ``/metrics`` must show
its KV held within the cap, and a replica killed (SIGKILL) while it runs a stream and holds an unstreamed request
must cost no unstreamed request (the ``openai`` client retries the proxy's 500 on the other replica) while its streams
end with an error event, nothing hanging.
The script's report must say so too. Everything started is killed at the end, also on failure.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ray_support import TIMEOUT_S, in_loopback, two_nodes
from script_support import SCRIPTS, load_script

from kvsieve.cli import main
from kvsieve.results import render_file

script = load_script("serve_ray")
slow = pytest.mark.slow  # (starts Ray: about 1.5 minutes on a 2-core machine shared with other jobs)

NAME = "tiny"
BUDGET = 16
# completion tokens: the answers and spread phases; the fault phase (in flight when killed: long enough that a
# replica's lone stream still runs when the unstreamed requests reach it, /metrics answering in seconds under load)
SHORT, LONG = 24, 640


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
            found = script.answers(api, NAME, SHORT)
            long = [
                api.completions.create(model=NAME, prompt=p, max_tokens=LONG, temperature=0) for p in script.PROMPTS
            ]
    finally:
        torch.set_num_threads(threads)
    return {**found, "long": [out.choices[0].text for out in long]}


# --- the tests ------------------------------------------------------------------------------------------------


def _run(work: Path, argv: list[str], driver: list[str]) -> Path:
    """The report file of scripts/serve_ray.py run with ``argv`` by ``driver`` in a loopback namespace."""
    out = work / "report.json"
    argv = [*argv, "--served-name", NAME, "--budget", str(BUDGET), "--requests", "16", "--short", str(SHORT)]
    argv += ["--long", str(LONG), "--timeout", str(TIMEOUT_S), "--log", str(work / "serve.log"), "--out", str(out)]
    run = in_loopback([sys.executable, *driver, *argv], timeout=TIMEOUT_S * 4)
    assert out.is_file(), run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert run.returncode == (0 if all(report["checks"].values()) else 1)
    return out


def _cap(in_process: dict[str, Any]) -> int:
    """A KV cap that admits three of the test's requests at once on a replica (they reserve the same bytes)."""
    return int(in_process["reserved"] * 3.5)


def _model(tiny_dir: str, in_process: dict[str, Any]) -> list[str]:
    return ["--model", tiny_dir, "--kv-memory-gb", repr(_cap(in_process) / 2**30)]


@pytest.fixture(scope="module")
def report_file(tiny_dir, in_process, tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp("serve_ray"), _model(tiny_dir, in_process), [str(SCRIPTS / "serve_ray.py")])


@pytest.fixture(scope="module")
def report(report_file) -> dict[str, Any]:
    return json.loads(report_file.read_text())


@pytest.fixture(scope="module")
def local(report) -> dict[str, Any]:
    return report["found"]


def _same_answers(found: dict[str, Any], in_process: dict[str, Any]) -> None:
    for key in ("completion", "completion_stream", "chat", "chat_stream", "each"):
        assert found[key] == in_process[key], key
    assert found["completion"] == found["completion_stream"] and found["chat"] == found["chat_stream"]


@slow
def test_replicas_answer_as_the_in_process_server(local, in_process) -> None:
    _same_answers(local["answers"], in_process)
    assert [r["text"] for r in local["spread"]] == in_process["each"] * 4


@slow
def test_requests_spread_over_both_replicas(local, report) -> None:
    pids = {r["pid"] for r in local["spread"]}
    assert len(pids) == 2 and all(pid.isdigit() for pid in pids)
    assert {pid for pid in local["answers"]["pids"]} <= pids
    assert set(local["metrics"]) == pids  # (each replica's own /metrics, reached through the proxy)
    spread = report["summary"]["spread"]
    assert sum(spread["per_replica"].values()) == spread["answered"] == 16 and set(spread["per_replica"]) == pids
    assert report["checks"]["spread"]


@slow
def test_each_replica_holds_its_kv_within_the_cap(local, in_process, report) -> None:
    cap = _cap(in_process)
    for pid, values in local["metrics"].items():
        assert values["kvsieve_kv_bytes_cap"] == cap, pid
        # several requests held at once (16 requests, 8 a replica, 3 admitted at a time), never past the cap
        assert 2 * in_process["reserved"] <= values["kvsieve_kv_bytes_held_max"] <= cap, (pid, values)
    assert report["checks"]["kv_within_cap"]


@slow
def test_a_killed_replica_costs_no_unstreamed_request_and_ends_its_streams_with_an_error(
    local, in_process, report, report_file
) -> None:
    fault, expected = local["fault"], in_process["long"] * 2
    victim = fault["victim"]
    assert victim is not None and victim in local["metrics"]
    # killed while it ran a stream and held an unstreamed request too (its /metrics said so, or the other's said that
    # it held none while unstreamed requests were open)
    summary = report["summary"]["fault"]
    assert summary["victim_held"] > summary["victim_streams"] >= 1, summary
    assert summary["victim_seen_by"] in ("metrics", "elimination"), summary
    # unstreamed: every one answered in full, those of the dead replica by the other (the openai client retried)
    retried = [r for r in fault["plain"] if r.get("retries")]
    assert [r.get("text") for r in fault["plain"]] == expected, fault["plain"]
    assert retried and all(r["pid"] != victim for r in fault["plain"])
    # streamed: the dead replica's end with the proxy's error event, the other replica's complete
    for result, text in zip(fault["streams"], in_process["long"], strict=True):
        if result["pid"] == victim:
            assert result["error"] == f"APIError: {script.STOPPED}" and text.startswith(result["text"]), result
        else:
            assert result["error"] is None and result["text"] == text, result
    assert any(r["pid"] == victim for r in fault["streams"])
    # nothing hung: each request ended within the clients' timeout
    assert all(r["seconds"] < TIMEOUT_S for r in fault["plain"] + fault["streams"])
    # Serve replaced the dead replica; Ctrl-C stopped the server
    assert len(local["replaced"]["pids"]) == 1, local["replaced"]
    assert 0 < local["replaced"]["seconds_after_kill"] < TIMEOUT_S
    assert local["exit"]["code"] == 0
    # the report counts the same
    assert summary["plain_answered"] == 8 and summary["plain_retried"] == len(retried) and summary["hung"] == 0
    ended = sum(r["pid"] == victim for r in fault["streams"])
    assert (summary["streams_ended_by_error"], summary["streams_complete"]) == (ended, 4 - ended)
    assert all(report["checks"].values()), report["checks"]
    page = render_file(report_file)
    assert "scripts/serve_ray.py" in page and "| requests spread |" in page
    assert ("/metrics showed none unstreamed" in page) == (summary["victim_seen_by"] == "elimination")


@slow
def test_a_two_node_cluster_serves_a_replica_on_each_node(tiny_dir, in_process, tmp_path) -> None:
    report = json.loads(_run(tmp_path, [*_model(tiny_dir, in_process), "--no-fault"], [__file__]).read_text())
    found = report["found"]
    _same_answers(found["answers"], in_process)
    assert [r["text"] for r in found["spread"]] == in_process["each"] * 4
    nodes = {r["pid"]: r["node"] for r in found["spread"]}
    assert len(nodes) == 2 and len(set(nodes.values())) == 2  # (Ray's node ids: one replica on each node)
    assert report["summary"]["spread"]["nodes"] == 2 and "fault" not in report["summary"]
    assert found["exit"]["code"] == 0 and all(report["checks"].values())


class _Replicas:
    """Two replicas as the fault phase's client sees them, without Ray: streams of the first three prompts on
    replica 101, of the fourth on 102, every unstreamed request on 102, and ``/metrics`` answered by ``answering``
    with what it holds (Ray Serve's proxy sends it to the less busy replica). A killed replica's streams fail; the
    unstreamed requests end (answered by 101: retried) once one is killed."""

    def __init__(self, answering: str) -> None:
        self.answering, self.killed = answering, threading.Event()
        self.victims: list[int] = []
        self.completions = self  # (api.completions.with_raw_response.create)
        self.with_raw_response = self

    def create(self, prompt: str, stream: bool = False, **_: Any) -> SimpleNamespace:
        pid = "101" if stream and prompt != script.PROMPTS[3] else "102"
        if not stream:
            assert self.killed.wait(10)
            answer = SimpleNamespace(choices=[SimpleNamespace(text="answer")])
            return SimpleNamespace(headers={script.PID: "101"}, retries_taken=1, parse=lambda: answer)
        return SimpleNamespace(headers={script.PID: pid}, parse=lambda: self._chunks(pid))

    def _chunks(self, pid: str) -> Iterator[SimpleNamespace]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.killed.is_set():
                if self.victims == [int(pid)]:
                    raise RuntimeError(script.STOPPED)
                return
            yield SimpleNamespace(choices=[SimpleNamespace(text="x")])
            time.sleep(0.01)

    def metrics(self, base: str) -> tuple[str, dict[str, float]]:
        held = 3 if self.answering == "101" else 1 + 8  # (101: its three streams; 102: its stream, the unstreamed)
        return self.answering, {"kvsieve_running_requests": float(held), "kvsieve_queue_depth": 0.0}

    def kill(self, pid: int, signum: int) -> None:
        assert signum == signal.SIGKILL
        self.victims.append(pid)
        self.killed.set()


@pytest.mark.parametrize(("answering", "seen_by"), [("102", "metrics"), ("101", "elimination")])
def test_the_replica_killed_holds_an_unstreamed_request_though_metrics_reach_only_the_other(
    monkeypatch, answering, seen_by
) -> None:
    """The fault phase kills the replica that runs a stream and holds the unstreamed requests, whether its own
    ``/metrics`` says so or only the other replica's answers (it holds nothing but its streams)."""
    replicas = _Replicas(answering)
    monkeypatch.setattr(script, "replica_metrics", replicas.metrics)
    monkeypatch.setattr(script.os, "kill", replicas.kill)
    monkeypatch.setattr(script, "SETTLE_S", 0.2)
    args = SimpleNamespace(long=8, streams=4, plain=8, timeout=10.0)
    found = script.fault(replicas, "http://unused", NAME, args, {"101", "102"})
    assert replicas.victims == [102]
    assert (found["victim"], found["victim_seen_by"]) == ("102", seen_by)
    assert (found["victim_held"], found["victim_streams"]) == (9, 1)
    assert [r["pid"] for r in found["streams"]] == ["101", "101", "101", "102"]
    assert found["streams"][3]["error"] == f"RuntimeError: {script.STOPPED}"
    assert [r["retries"] for r in found["plain"]] == [1] * 8


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


if __name__ == "__main__":  # (scripts/serve_ray.py against a head and a second node of one CPU each)
    with two_nodes() as address:
        code = script.main([*sys.argv[1:], "--ray", address])
    sys.exit(code)
