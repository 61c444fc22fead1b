"""A bounded soak test of a live ``kvsieve serve``: many concurrent clients mixing what the server takes, its memory
and KV bytes watched, every answer accounted for, then a graceful shutdown under load.

    python scripts/serve_soak.py --model smollm2-135m --requests 2000 --concurrency 16 --out out/serve_soak.json

It starts ``kvsieve serve`` on a free port of 127.0.0.1 (a subprocess; stopped at the end, on failure too) and sends
``--requests`` requests (fewer if ``--seconds`` runs out first) from ``--concurrency`` clients (asyncio + httpx),
drawn with ``--seed``: ``/v1/completions`` (token ids) and, if the model has a chat template,
``/v1/chat/completions`` (text); the ``--policies`` with budgets in tokens and ratios (``full``: none); prompts of
log-uniform lengths up to ``--typical`` tokens, a ``--long`` fraction of them up to the model's window (a long
prompt's prefill takes a 2-core CPU a minute), cut from the built-in Wikipedia text; greedy or seeded sampling;
streamed or not; ``n`` of 2 or 3 (``--multiple``); streams closed after a few chunks (``--disconnect``); malformed
bodies (``--malformed``: broken JSON, unknown fields, out-of-range values, an unknown policy or model...). Before the
load it sends each policy one request with the longest prompt the load may send (``--no-warm-up``: none), so that the
server's memory is judged after its largest buffers exist. Every second it reads ``/metrics``, ``/health`` and the
server's RSS (``VmRSS`` of ``/proc/PID/status``). Last, it starts a few long streams and sends the server SIGTERM while
they run: uvicorn stops listening, lets the running responses finish, then stops the app (and re-raises the signal: the
process ends by SIGTERM, or exits 0).

The report (printed; ``--out FILE``: JSON with the provenance): throughput, p50/p99 latency and time to the first
chunk, the server's RSS at start, after warm-up (the first 20 % of the run), middle and end, the most KV bytes held
and reserved against the cap, and the checks (exit status 1 if one fails):

- ``malformed_4xx``: every malformed body got a 4xx;
- ``none_lost``: every valid request was answered in full (every choice with its finish reason, a stream its
  ``[DONE]``), explicitly refused (429: the queue full; 400: more KV than the cap) or closed by its client, and the
  server failed none (``kvsieve_requests_finished_total{reason="error"}``);
- ``answering``: ``/health`` was ok at every poll, and a request after the load was answered;
- ``kv_within_cap``: the KV bytes held (the server's own maximum) and reserved (polled) never exceeded the cap;
- ``drained``: the streams running at SIGTERM completed and the server ended by itself;
- ``rss_flat``: the server's memory beyond the KV bytes it holds (RSS − held, polled together) did not grow: its
  median over the last fifth of the run is within 5 % of its median over the fifth after warm-up (judged over 30 s
  at least; else null). The KV bytes held follow the load up to the cap (checked by ``kv_within_cap``), and a long
  prompt's prefill briefly takes more: medians judge a leak, not those.

The report keeps every poll (seconds, RSS and KV bytes held, in MiB), so the memory can be plotted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

BUDGETS: tuple[int | str | float, ...] = (16, 64, 256, "10%", 0.25, 0.5)
"""Request budgets: tokens and ratios of the prompt."""
POLICIES = ("h2o", "snapkv", "streaming_llm", "tova", "full", "h2o:kv_bits=4")
CHAT_MARGIN = 64
"""Tokens left for the chat template around a chat prompt."""
RSS_GROWTH = 0.05
RSS_JUDGED_S = 30.0
WARM_UP = 0.2
"""The first fraction of the run, and the length of the windows compared after it (see ``rss_flat``)."""
DRAIN_STREAMS = 4


@dataclass
class Plan:
    """One request: its path and body (bytes: sent as is), what is wrong with it (malformed), and after how many
    chunks its client closes its stream (None: never)."""

    path: str
    body: dict[str, Any] | bytes
    malformed: str | None = None
    disconnect: int | None = None
    prompt_tokens: int = 0

    @property
    def choices(self) -> int:
        return self.body.get("n", 1) if isinstance(self.body, dict) else 0


@dataclass
class Outcome:
    """What a request got: ``ok``, ``disconnected`` (by its client), ``refused`` (a malformed body's 4xx),
    ``overloaded`` (429), ``over_cap`` (400: more KV than the cap) or ``failed``; seconds to the end and to the
    first chunk (streams), tokens generated."""

    result: str
    status: int | None = None
    seconds: float = 0.0
    first: float | None = None
    tokens: int = 0
    error: str = ""
    malformed: str | None = None
    choices: int = 1
    prompt_tokens: int = 0


def malformed_bodies(model: str, window: int) -> list[tuple[str, str, dict[str, Any] | bytes]]:
    """``(what is wrong, path, body)``: requests the server must refuse with a 4xx."""
    good = {"model": model, "prompt": "The river", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    completions, chats = "/v1/completions", "/v1/chat/completions"
    return [
        ("broken JSON", completions, b'{"model": "x", "prompt": '),
        ("not an object", chats, b"[1, 2, 3]"),
        ("no prompt", completions, {"model": model, "max_tokens": 4}),
        ("unknown field", completions, {**good, "tools": []}),
        ("n=0", completions, {**good, "n": 0}),
        ("unknown policy", completions, {**good, "kv_policy": "nope"}),
        ("zero budget", completions, {**good, "kv_budget": 0}),
        ("temperature 5", completions, {**good, "temperature": 5}),
        ("token out of the vocabulary", completions, {**good, "prompt": [10**9]}),
        ("unknown model", completions, {**good, "model": f"not-{model}"}),
        ("past the window", completions, {**good, "max_tokens": window + 10}),
        ("five stop strings", completions, {**good, "stop": list("abcde")}),
        ("no messages", chats, {**chat, "messages": []}),
        ("unknown role", chats, {**chat, "messages": [{"role": "robot", "content": "Hi"}]}),
    ]


class Mix:
    """Draws the requests (see the module docstring) from ``ids`` (the text's tokens) and ``text``."""

    def __init__(self, args: argparse.Namespace, model: str, window: int, ids: list[int], text: str, chat: bool):
        self.args, self.model, self.window, self.ids, self.text, self.chat = args, model, window, ids, text, chat
        self.rng = random.Random(args.seed)
        self.bad = malformed_bodies(model, window)
        self.chars_per_token = len(text) / len(ids)

    def room(self, max_tokens: int) -> int:
        """The longest prompt a request for ``max_tokens`` tokens may have (the chat template's margin left)."""
        return self.window - max_tokens - CHAT_MARGIN

    def plan(self) -> Plan:
        rng, args = self.rng, self.args
        if rng.random() < args.malformed:
            what, path, body = rng.choice(self.bad)
            return Plan(path, body, malformed=what)
        max_tokens = rng.randint(1, args.max_tokens)
        policy = rng.choice(args.policies)
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "kv_policy": policy}
        shortest = 8
        if not policy.startswith("full"):
            budget = body["kv_budget"] = rng.choice(BUDGETS)
            if policy.startswith("streaming_llm") and not isinstance(budget, int):  # (its 4 sink tokens must fit)
                shortest = math.ceil(8 / (float(budget.rstrip("%")) / 100 if isinstance(budget, str) else budget))
        room = self.room(max_tokens)
        top = max(shortest, room if rng.random() < args.long else min(room, args.typical))
        length = round(math.exp(rng.uniform(math.log(shortest), math.log(top))))  # (log-uniform)
        if rng.random() < 0.5:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
        else:
            body["temperature"] = 0
        if args.max_batch >= 3 and rng.random() < args.multiple:
            body["n"] = rng.choice((2, 3))
        if self.chat and rng.random() < 0.3:
            chars = int(0.8 * length * self.chars_per_token)  # (fewer tokens than ``length``, whatever the text)
            start = rng.randrange(len(self.text) - chars)
            body["messages"] = [{"role": "user", "content": self.text[start : start + chars]}]
            path = "/v1/chat/completions"
        else:
            start = rng.randrange(len(self.ids) - length)
            body["prompt"] = self.ids[start : start + length]
            path = "/v1/completions"
        disconnect = None
        if rng.random() < 0.5:
            body.update(stream=True, stream_options={"include_usage": True})
            if rng.random() < args.disconnect:
                disconnect = rng.randint(1, 3)
        return Plan(path, body, disconnect=disconnect, prompt_tokens=length)


def refusal(plan: Plan, response: httpx.Response, started: float) -> Outcome:
    """A request answered with an error status."""
    status, seconds = response.status_code, time.perf_counter() - started
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    if plan.malformed is not None:
        result = "refused" if 400 <= status < 500 else "failed"
    elif status == 429:
        result = "overloaded"
    elif status == 400 and "more than the server's cap" in message:
        result = "over_cap"
    else:
        result = "failed"
    return Outcome(result, status, seconds, error=f"{status}: {message}", malformed=plan.malformed)


def answered(plan: Plan, payload: dict[str, Any], started: float) -> Outcome:
    """A non-streamed answer: every choice there with its finish reason."""
    choices = payload.get("choices", [])
    ends = {c["index"] for c in choices if c.get("finish_reason") in ("stop", "length")}
    seconds = time.perf_counter() - started
    if ends != set(range(plan.choices)) or len(choices) != plan.choices:
        return Outcome("failed", 200, seconds, error=f"choices ended: {sorted(ends)} of {plan.choices}")
    return Outcome("ok", 200, seconds, tokens=payload["usage"]["completion_tokens"])


async def streamed(plan: Plan, response: httpx.Response, started: float) -> Outcome:
    """A stream read to its ``[DONE]`` (or closed after ``plan.disconnect`` chunks): every choice's finish reason."""
    ends: set[int] = set()
    first, chunks, tokens, done = None, 0, 0, False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return Outcome("failed", 200, time.perf_counter() - started, error=chunk["error"]["message"])
        first = first if first is not None else time.perf_counter() - started
        chunks += 1
        ends |= {c["index"] for c in chunk["choices"] if c.get("finish_reason") in ("stop", "length")}
        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        if plan.disconnect is not None and chunks >= plan.disconnect and len(ends) < plan.choices:
            return Outcome("disconnected", 200, time.perf_counter() - started, first)
    seconds = time.perf_counter() - started
    if not done or ends != set(range(plan.choices)):
        return Outcome("failed", 200, seconds, first, error=f"[DONE]: {done}; choices ended: {sorted(ends)}")
    return Outcome("ok", 200, seconds, first, tokens)


async def send(http: httpx.AsyncClient, plan: Plan) -> Outcome:
    started = time.perf_counter()
    if isinstance(plan.body, bytes):
        options: dict[str, Any] = {"content": plan.body, "headers": {"content-type": "application/json"}}
    else:
        options = {"json": plan.body}
    try:
        if isinstance(plan.body, dict) and plan.body.get("stream"):
            async with http.stream("POST", plan.path, **options) as response:
                if response.status_code != 200:
                    await response.aread()
                    return refusal(plan, response, started)
                return await streamed(plan, response, started)
        response = await http.post(plan.path, **options)
        if response.status_code != 200:
            return refusal(plan, response, started)
        if plan.malformed is not None:
            return Outcome("failed", 200, error="a malformed body was accepted", malformed=plan.malformed)
        return answered(plan, response.json(), started)
    except (httpx.HTTPError, ValueError, KeyError) as err:
        seconds = time.perf_counter() - started
        return Outcome("failed", None, seconds, error=f"{type(err).__name__}: {err}", malformed=plan.malformed)


def rss_mib(pid: int) -> float | None:
    """The process's resident memory (None once it has gone)."""
    with suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def gauges(exposition: str) -> dict[str, float]:
    """The kvsieve metrics of the Prometheus text, by name with their labels."""
    values = {}
    for line in exposition.splitlines():
        if line.startswith("kvsieve_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def watch(base: str, pid: int, outcomes: list[Outcome], total: int, stop: asyncio.Event) -> list[dict]:
    """Every second until ``stop``: RSS, KV bytes held and reserved, whether /health is ok."""
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        while not stop.is_set():
            sample: dict[str, Any] = {"t": time.monotonic() - started, "done": len(outcomes), "rss_mib": rss_mib(pid)}
            try:
                metrics = gauges((await http.get("/metrics")).text)
                health = await http.get("/health")
                sample["healthy"] = health.status_code == 200 and health.json()["status"] == "ok"
                sample["held"] = metrics["kvsieve_kv_bytes_held"]
                sample["reserved"] = metrics["kvsieve_kv_bytes_reserved"]
            except (httpx.HTTPError, ValueError, KeyError) as err:
                sample.update(healthy=False, error=f"{type(err).__name__}: {err}")
            samples.append(sample)
            if len(samples) % 10 == 0:
                print(
                    f"{sample['t']:.0f} s: {len(outcomes)}/{total} requests, RSS {sample['rss_mib']:.0f} MiB, "
                    f"KV held {sample.get('held', float('nan')) / 2**20:.1f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    return samples


async def load(base: str, mix: Mix, args: argparse.Namespace, pid: int) -> tuple[list[Outcome], list[dict], float]:
    """Send the requests from ``args.concurrency`` clients; their outcomes, the samples and the seconds it took."""
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + args.seconds if args.seconds else math.inf
    left = iter(range(args.requests))
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(base, pid, outcomes, args.requests, stop))

    async def client(http: httpx.AsyncClient) -> None:
        for _ in left:  # (shared by the clients)
            if time.monotonic() > deadline:
                break
            plan = mix.plan()
            outcome = await send(http, plan)
            outcome.choices, outcome.prompt_tokens = plan.choices, plan.prompt_tokens
            outcomes.append(outcome)

    limits = httpx.Limits(max_connections=args.concurrency + 2)
    started = time.perf_counter()
    try:
        async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as http:
            await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
    finally:
        seconds = time.perf_counter() - started
        stop.set()
        samples = await watcher
    return outcomes, samples, seconds


async def drain(base: str, proc: subprocess.Popen, model: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    """Start ``DRAIN_STREAMS`` long streams, send SIGTERM once each has its first chunk: did they complete, and did
    the server end by itself?"""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, kv_policy="h2o", kv_budget=16)
    opened = [asyncio.Event() for _ in range(DRAIN_STREAMS)]

    async def one(http: httpx.AsyncClient, i: int) -> bool:
        done = ended = False
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                opened[i].set()
                ended |= '"finish_reason": "length"' in line
                done |= line == "data: [DONE]"
        return done and ended

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        streams = [asyncio.create_task(one(http, i)) for i in range(DRAIN_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in opened)), 300)
        running = (await http.get("/health")).json()["running"]
        proc.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        results = await asyncio.gather(*streams, return_exceptions=True)
    try:
        code: int | None = await asyncio.to_thread(proc.wait, 120)
    except subprocess.TimeoutExpired:
        code = None
    completed = sum(result is True for result in results)
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return {
        "streams": DRAIN_STREAMS,
        "running_at_signal": running,
        "completed": completed,
        "errors": errors,
        "exit_code": code,
        "seconds_after_signal": round(time.perf_counter() - signalled, 2),
        "drained": running > 0 and completed == DRAIN_STREAMS and code in (0, -signal.SIGTERM),
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    if len(values) == 1:
        return {"p50": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(cuts[49], 4), "p99": round(cuts[98], 4)}


def _median_between(points: list[tuple[float, float]], start: float, end: float) -> float:
    return statistics.median([value for t, value in points if start <= t <= end])


def memory(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS at start, after warm-up, middle and end, and its most after warm-up; the memory beyond the KV bytes held
    (RSS − held) over the fifth after warm-up and the last fifth, and whether it stayed flat (None: too short)."""
    rss = [(s["t"], s["rss_mib"]) for s in samples if s["rss_mib"] is not None]
    if not rss:
        return {"flat": None}
    span = rss[-1][0]
    warm_at = next(i for i, (t, _) in enumerate(rss) if t >= WARM_UP * span)
    warm = rss[warm_at][1]
    after = [value for _, value in rss[warm_at:]]
    beyond = [(s["t"], s["rss_mib"] - s["held"] / 2**20) for s in samples if s["rss_mib"] is not None and "held" in s]
    judged = span - rss[warm_at][0] >= RSS_JUDGED_S and bool(beyond)
    early = _median_between(beyond, WARM_UP * span, 2 * WARM_UP * span) if judged else None
    late = _median_between(beyond, (1 - WARM_UP) * span, span) if judged else None
    return {
        "start": rss[0][1],
        "warm": warm,
        "middle": next(value for t, value in rss if t >= span / 2),
        "end": rss[-1][1],
        "max_after_warm": max(after),
        "growth_after_warm": round(max(after) / warm - 1, 4),
        "beyond_kv_after_warm": None if early is None else round(early, 1),
        "beyond_kv_last": None if late is None else round(late, 1),
        "beyond_kv_growth": None if early is None else round(late / early - 1, 4),
        "flat": (late <= (1 + RSS_GROWTH) * early) if judged else None,
    }


def report(
    args: argparse.Namespace,
    outcomes: list[Outcome],
    samples: list[dict[str, Any]],
    seconds: float,
    after: dict[str, Any],
    shutdown: dict[str, Any],
) -> dict[str, Any]:
    """The numbers and the checks (see the module docstring)."""
    from kvsieve.provenance import provenance

    valid = [o for o in outcomes if o.malformed is None]
    malformed = [o for o in outcomes if o.malformed is not None]
    ok = [o for o in valid if o.result == "ok"]
    by_result: dict[str, int] = {}
    for outcome in outcomes:
        by_result[outcome.result] = by_result.get(outcome.result, 0) + 1
    metrics = after["metrics"]
    cap = metrics["kvsieve_kv_bytes_cap"]
    held = max([metrics["kvsieve_kv_bytes_held_max"], *(s.get("held", 0) for s in samples)])
    reserved = max((s.get("reserved", 0) for s in samples), default=0)
    server_errors = metrics.get('kvsieve_requests_finished_total{reason="error"}', 0)
    rss = memory(samples)
    checks = {
        "malformed_4xx": all(o.result == "refused" for o in malformed),
        "none_lost": all(o.result in ("ok", "disconnected", "overloaded", "over_cap") for o in valid)
        and server_errors == 0,
        "answering": all(s["healthy"] for s in samples) and after["answered"],
        "kv_within_cap": held <= cap and reserved <= cap,
        "drained": shutdown["drained"],
        "rss_flat": rss["flat"],
    }
    return {
        "provenance": provenance(["scripts/serve_soak.py", *args.argv], model=args.model, device=args.device),
        "settings": {k: v for k, v in vars(args).items() if k != "argv"},
        "requests": {
            "sent": len(outcomes),
            "malformed": len(malformed),
            "streamed": sum(o.first is not None for o in valid),
            "several_choices": sum(o.choices > 1 for o in valid),
            "by_result": by_result,
            "failures": [asdict(o) for o in outcomes if o.result == "failed"][:20],
        },
        "throughput": {
            "seconds": round(seconds, 2),
            "requests_per_s": round(len(ok) / seconds, 3),
            "tokens_per_s": round(sum(o.tokens for o in ok) / seconds, 2),
        },
        "prompt_tokens": {
            **percentiles([float(o.prompt_tokens) for o in valid]),
            "max": max((o.prompt_tokens for o in valid), default=0),
            "over_2048": sum(o.prompt_tokens > 2048 for o in valid),
        },
        "latency_s": percentiles([o.seconds for o in ok]),
        "first_chunk_s": percentiles([o.first for o in ok if o.first is not None]),
        "rss_mib": rss,
        "kv_bytes": {"cap": cap, "held_max": held, "reserved_max_polled": reserved},
        "server": {
            "errors": server_errors,
            "cancelled": metrics.get('kvsieve_requests_finished_total{reason="cancelled"}', 0),
        },
        "health_polls": {"total": len(samples), "failed": sum(not s["healthy"] for s in samples)},
        "polls": {
            "t": [round(s["t"], 1) for s in samples],
            "rss_mib": [s["rss_mib"] for s in samples],
            "held_mib": [round(s.get("held", 0) / 2**20, 2) for s in samples],
        },
        "shutdown": shutdown,
        "checks": checks,
        "ok": all(value is not False for value in checks.values()),
    }


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """``kvsieve serve`` on a free port of 127.0.0.1, its output to ``log``; the process and its base URL once
    /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "kvsieve", "serve", "--model", args.model, "--device", args.device]
    cmd += ["--port", str(port), "--kv-memory-gb", str(args.kv_memory_gb), "--max-batch", str(args.max_batch)]
    cmd += ["--max-queue", str(args.max_queue)]
    env = {k: v for k, v in os.environ.items() if k != "KVSIEVE_API_KEY"}  # (no key: the soak sends none)
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with suppress(httpx.TransportError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        time.sleep(0.2)
    stop_server(proc)
    raise SystemExit(f"kvsieve serve did not start:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def soak(args: argparse.Namespace, proc: subprocess.Popen, base: str) -> dict[str, Any]:
    from kvsieve.data import builtin_text

    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        chat = bool((await http.get("/tokenizer_info")).json().get("chat_template"))
        window = (await http.post("/tokenize", json={"prompt": "x"})).json()["max_model_len"] or args.window
        text = builtin_text(min_chars=8 * window)
        ids = (await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
    ids = ids * math.ceil((window + 1) / len(ids))  # (at least a window of tokens)
    mix = Mix(args, model, window, ids, text, chat)
    warm = await warm_up(base, model, args, ids[: mix.room(1)]) if args.warm_up else None
    outcomes, samples, seconds = await load(base, mix, args, proc.pid)
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        probe = {"model": model, "prompt": ids[:16], "max_tokens": 4}
        answered_after = (await http.post("/v1/completions", json=probe)).status_code == 200
        after = {"answered": answered_after, "metrics": gauges((await http.get("/metrics")).text)}
    shutdown = await drain(base, proc, model, ids[:32], min(256, window - 32))
    return report(args, outcomes, samples, seconds, after, shutdown) | {"warm_up": warm}


async def warm_up(base: str, model: str, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """One request per policy with the longest prompt the load may send (``prompt``: the room of a one-token answer,
    which it asks for), one after the other, before the load: the server's buffers reach the size its largest
    requests need before its memory is judged."""
    started = time.perf_counter()
    statuses = []
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout) as http:
        for policy in args.policies:
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "kv_policy": policy}
            body |= {} if policy.startswith("full") else {"kv_budget": 256}
            statuses.append((await http.post("/v1/completions", json=body)).status_code)
    return {"requests": len(statuses), "prompt_tokens": len(prompt), "statuses": statuses,
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    t, rss, kv = result["throughput"], result["rss_mib"], result["kv_bytes"]
    lines = [
        f"requests: {result['requests']['sent']} in {t['seconds']} s ({result['requests']['by_result']})",
        f"prompt tokens: p50 {result['prompt_tokens']['p50']}, max {result['prompt_tokens']['max']}, "
        f"{result['prompt_tokens']['over_2048']} over 2,048",
        f"throughput: {t['requests_per_s']} requests/s, {t['tokens_per_s']} tokens/s",
        f"latency p50/p99: {result['latency_s']['p50']} / {result['latency_s']['p99']} s; first chunk "
        f"{result['first_chunk_s']['p50']} / {result['first_chunk_s']['p99']} s",
        f"RSS MiB start/warm/middle/end: {rss.get('start')} / {rss.get('warm')} / {rss.get('middle')} / "
        f"{rss.get('end')} (flat: {rss['flat']})",
        f"KV bytes: held at most {kv['held_max']:.0f}, reserved at most {kv['reserved_max_polled']:.0f} (polled), "
        f"cap {kv['cap']:.0f}",
        f"shutdown: {result['shutdown']}",
        "checks: " + ", ".join(f"{name} {value}" for name, value in result["checks"].items()),
    ]
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="what kvsieve serve --model takes (default smollm2-135m)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=2000, help="requests to send (default 2000)")
    p.add_argument("--seconds", type=float, help="stop sending after this many seconds (default: no limit)")
    p.add_argument("--concurrency", type=int, default=16, help="clients sending at once (default 16)")
    p.add_argument("--typical", type=int, default=512, help="the longest typical prompt in tokens (default 512)")
    p.add_argument("--long", type=float, default=0.03, help="fraction of prompts up to the window (default 0.03)")
    p.add_argument("--max-tokens", type=int, default=64, help="the most tokens a request asks for (default 64)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), help="(default: %(default)s)")
    p.add_argument("--malformed", type=float, default=0.1, help="fraction of malformed bodies (default 0.1)")
    p.add_argument("--disconnect", type=float, default=0.1, help="fraction of streams closed early (default 0.1)")
    p.add_argument("--multiple", type=float, default=0.1, help="fraction of requests with n of 2 or 3 (default 0.1)")
    p.add_argument("--kv-memory-gb", type=float, default=1.0, help="the server's KV cap (default 1)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="the server's OpenMP threads (default 1)")
    p.add_argument("--window", type=int, default=2048, help="positions, if the model states none (default 2048)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a request may take (default 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-warm-up", dest="warm_up", action="store_false", help="skip the longest prompt per policy first"
    )
    p.add_argument("--out", type=Path, help="write the report here (JSON)")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        proc, base = start_server(args, log)
        try:
            result = asyncio.run(soak(args, proc, base))
        except BaseException:
            print(f"the server's log (tail):\n{log.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            stop_server(proc)
    print(summary(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
