"""Replicas of ``kvsieve serve`` on Ray Serve, measured under load and under a fault: how requests spread, what a
killed replica costs the clients, how long Serve takes to replace it.

    unshare -rn sh -c 'ip link set lo up && exec "$@"' sh \\
        python scripts/serve_ray.py --model smollm2-135m --replicas 2 --out out/serve_ray.json

It starts ``kvsieve serve --ray --replicas N`` (a new local Ray, or ``--ray ADDRESS``) on a free port of 127.0.0.1
(a subprocess; stopped at the end, on failure too) and drives it with the official ``openai`` client, greedy:

1. ``answers``: a completion and a chat, unstreamed and streamed, with ``--short`` tokens (their texts: one replica's
   streamed and unstreamed answers must agree);
2. ``spread``: ``--requests`` completions of ``--short`` tokens sent at once: each one's replica (its PID and Ray
   node, from the response headers) and seconds, the throughput;
3. ``metrics``: each replica's ``/metrics`` (reached through the proxy until every replica answered): the most KV
   bytes it held against ``--kv-memory-gb``;
4. ``fault`` (not with ``--no-fault``): ``--streams`` streams of ``--long`` tokens, then, once each has its first
   chunk, ``--plain`` unstreamed completions of as many; a replica running a stream and holding an unstreamed
   request is killed (SIGKILL): the first whose ``/metrics`` shows more requests running or waiting than its streams
   still running, or the one left when every other replica's ``/metrics`` shows none beside its streams (the proxy
   sends ``/metrics`` to the less busy replica). Unstreamed requests are sent by a client that retries twice (the
   ``openai`` default), so those of the dead replica go to another one; then the seconds from the kill until
   Serve's replacement replica answers ``/metrics``;
5. ``exit``: Ctrl-C (SIGINT) to the server: its exit code and seconds.

The report (printed; ``--out FILE``: JSON with the provenance) keeps what each request got and these checks (exit
status 1 if one fails): ``spread`` (every replica answered part of the load), ``kv_within_cap`` (no replica held
more KV than the cap), ``none_lost`` (every unstreamed request answered in full, retried where its replica died),
``streams_ended`` (every stream complete, or ended by the error event of a dead replica), ``none_hung`` (every request
ended within ``--timeout``), ``replaced`` (Serve started a new replica) and ``stopped`` (the server exited 0 within
``--timeout`` of Ctrl-C).

Ray advertises the machine's routable address even when told 127.0.0.1: on a shared machine run this in a
loopback-only network namespace, as above (the tests do).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

PROMPTS = [
    "The history of the city begins with a small settlement on the river, where traders met every spring",
    "Photosynthesis converts light energy into chemical energy stored in sugar molecules inside the",
    "In 1905 Albert Einstein published four papers that changed physics, among them one on",
    "A recipe for bread: mix flour, water, salt and yeast, knead the dough for ten minutes, then",
]
CHAT = [{"role": "user", "content": "Name three rivers of Europe and the seas they flow into."}]
STOPPED = "the replica serving this request stopped"
PID, NODE = "x-kvsieve-replica-pid", "x-kvsieve-replica-node"
SETTLE_S = 1.0  # (seconds after which unstreamed requests sent at once have all reached a replica)


def answers(api: Any, name: str, tokens: int) -> dict[str, Any]:
    """Completions and chat, unstreamed and streamed, greedy: their texts and the PIDs of the replicas that answered
    (None in process), the KV bytes the first reserved, and the unstreamed completion of each of :data:`PROMPTS`."""
    found: dict[str, Any] = {"pids": []}
    greedy = {"model": name, "max_tokens": tokens, "temperature": 0}
    raw = api.completions.with_raw_response.create(prompt=PROMPTS[0], **greedy)
    out = raw.parse()
    found["completion"], found["reserved"] = out.choices[0].text, out.kvsieve["kv_bytes_reserved"]
    found["pids"].append(raw.headers.get(PID))
    raw = api.completions.with_raw_response.create(prompt=PROMPTS[0], stream=True, **greedy)
    found["completion_stream"] = "".join(chunk.choices[0].text for chunk in raw.parse() if chunk.choices)
    found["pids"].append(raw.headers.get(PID))
    raw = api.chat.completions.with_raw_response.create(messages=CHAT, **greedy)
    found["chat"] = raw.parse().choices[0].message.content
    found["pids"].append(raw.headers.get(PID))
    raw = api.chat.completions.with_raw_response.create(messages=CHAT, stream=True, **greedy)
    found["chat_stream"] = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    found["pids"].append(raw.headers.get(PID))
    found["each"] = [api.completions.create(prompt=p, **greedy).choices[0].text for p in PROMPTS]
    return found


def start_server(argv: list[str], log: Path, timeout: float) -> subprocess.Popen[str]:
    """``kvsieve serve`` with ``argv``, once it says it serves (its stderr goes on into ``log``)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # (a background job ignores SIGINT, and a child would inherit that; a handled signal is reset at exec, so
        # the server takes the Ctrl-C this script sends it)
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
    if not ready.wait(timeout) or proc.poll() is not None:
        proc.kill()
        raise RuntimeError("kvsieve serve did not start:\n" + "".join(lines[-30:]))
    return proc


def replica_metrics(base: str) -> tuple[str, dict[str, float]] | None:
    """One ``GET /metrics`` through the proxy: the answering replica's PID and its unlabelled ``kvsieve_*`` values
    (None if the proxy did not answer 200)."""
    import httpx

    with contextlib.suppress(httpx.HTTPError):
        response = httpx.get(f"{base}/metrics", timeout=10)
        if response.status_code == 200:
            found = re.findall(r"^(kvsieve_\w+) (\S+)$", response.text, flags=re.MULTILINE)
            return response.headers[PID], {metric: float(value) for metric, value in found}
    return None


def metrics(
    base: str, want: int, seen: dict[str, dict[str, float]], timeout: float, avoid: set[str] = frozenset()
) -> None:
    """GET /metrics until ``want`` replicas (PIDs not in ``avoid``) answered, into ``seen`` (PID → metric → value)."""
    deadline = time.monotonic() + timeout
    while len(set(seen) - avoid) < want and time.monotonic() < deadline:
        if answer := replica_metrics(base):
            pid, values = answer
            seen[pid] = {k: v for k, v in values.items() if k in ("kvsieve_kv_bytes_held_max", "kvsieve_kv_bytes_cap")}
        time.sleep(0.2)


def concurrently(calls: list[Any], timeout: float) -> list[Any]:
    """Every call of ``calls`` in a thread of its own; their results (an exception as its text), each joined within
    ``timeout`` (else ``{"hung": True}``)."""
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except Exception as err:
            results[index] = {"error": f"{type(err).__name__}: {err}"}

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [{"hung": True} if thread.is_alive() else result for thread, result in zip(threads, results, strict=True)]


def fault(api: Any, base: str, name: str, args: argparse.Namespace, replicas: set[str]) -> dict[str, Any]:
    """Streams, then (once each has its first chunk) unstreamed requests, in flight on the ``replicas`` (their PIDs);
    a replica running a stream and holding an unstreamed request too is killed (SIGKILL). What each request got, and
    the kill (``killed_at``: ``time.monotonic``; ``victim_seen_by``: how the victim was known to hold an unstreamed
    request).

    ``/metrics`` reaches whichever replica the proxy picks, and it picks the less busy one: the replica that drew the
    unstreamed requests may never answer it. So the victim is known either way:

    - ``"metrics"``: its own ``/metrics`` shows more requests running or waiting than its streams still running (those
      whose client has not seen their end, taken before ``/metrics`` is read: a stream the replica holds then is among
      them, since the replica ends a stream before its client sees the end), so an unstreamed one;
    - ``"elimination"``: ``SETTLE_S`` after the unstreamed requests were sent (they have reached a replica), every
      other replica's ``/metrics`` showed no more requests than its streams still running, while unstreamed requests
      were open: these are on the one replica left, and it runs a stream. ``victim_held`` then counts its streams
      still running and the open unstreamed requests."""
    greedy = {"model": name, "max_tokens": args.long, "temperature": 0}
    began: dict[int, str] = {}  # stream index → its replica's PID, from its first chunk
    running: set[int] = set()  # the streams that began and have not ended
    pending: set[int] = set()  # the unstreamed requests sent that have not ended
    ready, sent = threading.Semaphore(0), threading.Event()

    def streamed(index: int, prompt: str) -> dict[str, Any]:
        start, pieces, pid, error = time.monotonic(), [], None, None
        try:
            raw = api.completions.with_raw_response.create(prompt=prompt, stream=True, **greedy)
            pid = raw.headers.get(PID)
            for chunk in raw.parse():
                pieces.append(chunk.choices[0].text if chunk.choices else "")
                if len(pieces) == 1:
                    began[index] = pid
                    running.add(index)
                    ready.release()
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            running.discard(index)
            if index not in began:
                ready.release()  # (it ended before a chunk: nothing to wait for)
        return {"text": "".join(pieces), "pid": pid, "error": error, "seconds": _since(start)}

    def plain(index: int, prompt: str) -> dict[str, Any]:
        sent.wait()
        start = time.monotonic()
        pending.add(index)
        try:
            raw = api.completions.with_raw_response.create(prompt=prompt, **greedy)
        finally:
            pending.discard(index)
        text = raw.parse().choices[0].text
        return {"text": text, "pid": raw.headers.get(PID), "retries": raw.retries_taken, "seconds": _since(start)}

    kill: dict[str, Any] = {"victim": None, "killed_at": None}

    def kill_victim(pid: str, seen_by: str, held: int, streams: int) -> None:
        os.kill(int(pid), signal.SIGKILL)
        kill.update(victim=pid, killed_at=time.monotonic(), victim_seen_by=seen_by)
        kill.update(victim_held=held, victim_streams=streams)

    def killer() -> None:
        deadline = time.monotonic() + args.timeout
        try:
            for _ in range(args.streams):
                ready.acquire(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            sent.set()  # (the unstreamed requests never wait for more than the streams)
        settled, cleared = time.monotonic() + SETTLE_S, set()
        while running and time.monotonic() < deadline:
            before = [began[i] for i in list(running)]  # (each running stream's replica, before /metrics is read)
            if answer := replica_metrics(base):
                pid, values = answer
                held = int(values.get("kvsieve_running_requests", 0) + values.get("kvsieve_queue_depth", 0))
                streams, now = before.count(pid), [began[i] for i in list(running)]
                if held > streams and pid in now:
                    kill_victim(pid, "metrics", held, streams)
                    return
                if time.monotonic() >= settled and held <= streams:
                    cleared.add(pid)
                    left = replicas - cleared
                    if len(left) == 1 and pending and (victim := next(iter(left))) in now:
                        kill_victim(victim, "elimination", now.count(victim) + len(pending), now.count(victim))
                        return
            time.sleep(0.05)

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(args.streams, args.plain))]
    calls = [lambda i=i, p=p: streamed(i, p) for i, p in enumerate(prompts[: args.streams])]
    calls += [lambda i=i, p=p: plain(i, p) for i, p in enumerate(prompts[: args.plain])]
    killing = threading.Thread(target=killer, daemon=True)
    killing.start()
    results = concurrently(calls, args.timeout * 2)  # (a retried request may take two timeouts)
    killing.join(1)
    return {**kill, "streams": results[: args.streams], "plain": results[args.streams :]}


def _since(start: float) -> float:
    return time.monotonic() - start


def scenario(args: argparse.Namespace) -> dict[str, Any]:
    """The phases of the module docstring against a new ``kvsieve serve --ray``: what each request got."""
    import openai

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    name = args.served_name
    argv = ["--model", args.model, "--served-name", name, "--policy", args.policy, "--budget", str(args.budget)]
    argv += ["--port", str(port), "--kv-memory-gb", repr(args.kv_memory_gb), "--device", args.device]
    argv += ["--ray", *([args.ray] if args.ray else []), "--replicas", str(args.replicas)]
    found: dict[str, Any] = {"argv": argv}
    started = time.monotonic()
    server = start_server(argv, Path(args.log), args.timeout * 2.5)
    found["start_seconds"] = _since(started)
    try:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=args.timeout)
        found["answers"] = answers(api, name, args.short)

        def spread(prompt: str) -> dict[str, Any]:
            start = time.monotonic()
            raw = api.completions.with_raw_response.create(
                model=name, prompt=prompt, max_tokens=args.short, temperature=0
            )
            text = raw.parse().choices[0].text
            return {"text": text, "pid": raw.headers[PID], "node": raw.headers[NODE], "seconds": _since(start)}

        started = time.monotonic()
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        found["spread"] = concurrently([lambda p=p: spread(p) for p in prompts], args.timeout)
        found["spread_seconds"] = _since(started)
        seen: dict[str, dict[str, float]] = {}
        metrics(base, args.replicas, seen, args.timeout)
        found["metrics"] = seen
        if args.fault:
            retrying = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=2, timeout=args.timeout)
            found["fault"] = fault(retrying, base, name, args, set(seen))
            after: dict[str, dict[str, float]] = {}
            metrics(base, 1, after, args.timeout, avoid={found["fault"]["victim"], *seen})  # (Serve starts a new one)
            killed = found["fault"].pop("killed_at")
            found["replaced"] = {
                "pids": sorted(set(after) - set(seen)),
                "seconds_after_kill": None if killed is None else _since(killed),
            }
    finally:
        stopping = time.monotonic()
        server.send_signal(signal.SIGINT)
        try:
            found["exit"] = {"code": server.wait(args.timeout), "seconds": _since(stopping)}
        except subprocess.TimeoutExpired:
            server.kill()
            found["exit"] = {"code": None, "seconds": None}
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(found: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The figures and checks of ``found`` (the module docstring)."""
    spread = [r for r in found["spread"] if "pid" in r]
    per_replica = Counter(r["pid"] for r in spread)
    seconds = sorted(r["seconds"] for r in spread)
    summary: dict[str, Any] = {
        "start_seconds": found["start_seconds"],
        "spread": {
            "requests": len(found["spread"]),
            "answered": len(spread),
            "per_replica": dict(sorted(per_replica.items())),
            "nodes": len({r["node"] for r in spread}),
            "seconds": found["spread_seconds"],
            "requests_per_s": len(spread) / found["spread_seconds"],
            "latency_p50": statistics.median(seconds) if seconds else None,
            "latency_max": seconds[-1] if seconds else None,
        },
        "kv_held_max": {pid: m["kvsieve_kv_bytes_held_max"] for pid, m in found["metrics"].items()},
        "kv_cap": args.kv_memory_gb * 2**30,
        "exit": found["exit"],
    }
    held = [(m["kvsieve_kv_bytes_held_max"], m["kvsieve_kv_bytes_cap"]) for m in found["metrics"].values()]
    checks: dict[str, bool] = {
        "spread": len(per_replica) == args.replicas and len(spread) == len(found["spread"]),
        "kv_within_cap": len(held) == args.replicas and all(most <= cap for most, cap in held),
        "stopped": found["exit"]["code"] == 0,
    }
    if "fault" in found:
        victim, plain, streams = found["fault"]["victim"], found["fault"]["plain"], found["fault"]["streams"]
        ended = [r for r in streams if r.get("error") == f"APIError: {STOPPED}" and r["pid"] == victim]
        complete = [r for r in streams if r.get("error") is None and "hung" not in r and r["pid"] != victim]
        everything = plain + streams
        summary["fault"] = {
            "victim_seen_by": found["fault"].get("victim_seen_by"),
            "victim_held": found["fault"].get("victim_held"),
            "victim_streams": found["fault"].get("victim_streams"),
            "plain": len(plain),
            "plain_answered": sum("text" in r for r in plain),
            "plain_retried": sum(bool(r.get("retries")) for r in plain),
            "streams": len(streams),
            "streams_complete": len(complete),
            "streams_ended_by_error": len(ended),
            "hung": sum("hung" in r for r in everything),
            "slowest_seconds": max((r["seconds"] for r in everything if "seconds" in r), default=None),
            "replaced_seconds_after_kill": found["replaced"]["seconds_after_kill"],
        }
        checks["none_lost"] = all("text" in r and r["pid"] != victim for r in plain)
        checks["streams_ended"] = len(ended) + len(complete) == len(streams) and bool(ended)
        checks["none_hung"] = summary["fault"]["hung"] == 0 and all(
            r["seconds"] < args.timeout for r in everything if "seconds" in r
        )
        checks["replaced"] = len(found["replaced"]["pids"]) == 1
    return {"summary": summary, "checks": checks}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="what kvsieve serve --model takes (default smollm2-135m)")
    p.add_argument("--served-name", default="served", help="the model name clients send (default served)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=int, default=256, help="KV tokens a request keeps (default 256)")
    p.add_argument("--kv-memory-gb", type=float, default=1.0, help="each replica's KV cap (default 1)")
    p.add_argument("--ray", help="a running cluster's address (default: a new local Ray)")
    p.add_argument("--replicas", type=int, default=2, help="(default 2)")
    p.add_argument("--requests", type=int, default=32, help="completions sent at once to spread (default 32)")
    p.add_argument("--short", type=int, default=24, help="tokens of the answers and spread requests (default 24)")
    p.add_argument("--long", type=int, default=160, help="tokens of the requests in flight at the kill (default 160)")
    p.add_argument("--streams", type=int, default=4, help="streams in flight at the kill (default 4)")
    p.add_argument("--plain", type=int, default=8, help="unstreamed requests in flight at the kill (default 8)")
    p.add_argument("--no-fault", dest="fault", action="store_false", help="no replica killed")
    p.add_argument("--timeout", type=float, default=300, help="seconds a request may take (default 300)")
    p.add_argument("--log", default=os.devnull, help="the server's stderr goes here (default: nowhere)")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    from kvsieve.provenance import provenance

    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    found = scenario(args)
    report = {
        "provenance": provenance(["scripts/serve_ray.py", *argv], model=args.model, device=args.device, threads=1),
        "settings": {k: v for k, v in vars(args).items() if k not in ("argv", "log", "out")},
        **summarize(found, args),
        "found": found,
    }
    print(json.dumps({"summary": report["summary"], "checks": report["checks"]}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
