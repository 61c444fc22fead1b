"""A load run against a live ``kvsieve serve`` on 127.0.0.1: throughput, time to first token and inter-token latency
at several concurrencies and policies, the server's RSS over the run; and how many requests a fixed KV cap admits at
once per policy (the H2O paper's batch-size argument, on a live server).

    python scripts/serve_bench.py throughput --policies h2o@256 full --concurrency 1 4 16
    python scripts/serve_bench.py capacity --policies h2o@20% full --cap-mib 128 --requests 32

Each part starts ``kvsieve serve`` on a free port (a subprocess, stopped at the end), sends prompts of
``--prompt-tokens`` tokens cut from the built-in Wikipedia articles (as token ids), greedy, ``--max-tokens`` each,
streamed, and prints a table (``--json``: the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Stats:
    """One request: seconds to the first token, gaps between the next ones, tokens."""

    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


def prompts(model: str, n: int, tokens: int) -> list[list[int]]:
    """``n`` different prompts of ``tokens`` token ids from the built-in Wikipedia text."""
    from transformers import AutoTokenizer

    from kvsieve.data import builtin_text
    from kvsieve.models import ensure_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_model(model))
    ids = tokenizer(builtin_text(min_chars=n * tokens * 6)).input_ids
    if len(ids) < n * tokens:
        raise SystemExit(f"the built-in text has {len(ids)} tokens, fewer than {n} × {tokens}")
    return [ids[i * tokens : (i + 1) * tokens] for i in range(n)]


def start_server(model: str, cap_mib: float, max_batch: int, threads: int) -> tuple[subprocess.Popen, str]:
    """``kvsieve serve`` on a free port of 127.0.0.1 (``threads`` OpenMP threads); the process and its base URL once
    /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "kvsieve", "serve", "--model", model, "--device", "cpu", "--port", str(port)]
    cmd += ["--kv-memory-gb", str(cap_mib / 1024), "--max-batch", str(max_batch), "--max-queue", "256"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvsieve serve exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("kvsieve serve did not start within 120 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def kv_body(model: str, prompt: list[int], policy: str, max_tokens: int) -> dict:
    name, _, budget = policy.partition("@")
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["kv_policy"] = name
    if budget:
        body["kv_budget"] = budget
    return body


async def one(http: httpx.AsyncClient, body: dict) -> Stats:
    """Stream one completion; when each token's chunk arrived."""
    sent = time.perf_counter()
    stats, last = None, sent
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if not chunk["choices"][0]["text"] and chunk["choices"][0]["finish_reason"]:
                continue
            now = time.perf_counter()
            if stats is None:
                stats = Stats(ttft=now - sent)
            else:
                stats.gaps.append(now - last)
            stats.tokens += 1
            last = now
    return stats


async def wave(base: str, bodies: list[dict], concurrency: int) -> tuple[list[Stats], float]:
    """Send ``bodies`` with at most ``concurrency`` in flight; their stats and the wall time."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(http: httpx.AsyncClient, body: dict) -> Stats:
        async with gate:
            return await one(http, body)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        started = time.perf_counter()
        stats = await asyncio.gather(*(gated(http, body) for body in bodies))
    return list(stats), time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def throughput(args: argparse.Namespace) -> list[dict]:
    rows = []
    waves = [(c, max(c, args.min_requests)) for c in args.concurrency]
    texts = prompts(args.model, max(n for _, n in waves), args.prompt_tokens)
    proc, base = start_server(args.model, args.cap_mib, max(args.concurrency), args.threads)
    try:
        rss = [rss_mib(proc.pid)]
        for policy in args.policies:
            for concurrency, n in waves:
                bodies = [kv_body(args.model, texts[i], policy, args.max_tokens) for i in range(n)]
                stats, seconds = asyncio.run(wave(base, bodies, concurrency))
                rss.append(rss_mib(proc.pid))
                gaps = [g for s in stats for g in s.gaps]
                ttft = [s.ttft for s in stats]
                rows.append(
                    {
                        "policy": policy,
                        "concurrency": concurrency,
                        "requests": n,
                        "tokens_per_s": sum(s.tokens for s in stats) / seconds,
                        "ttft_p50_s": pct(ttft, 50),
                        "ttft_p95_s": pct(ttft, 95),
                        "itl_p50_ms": 1000 * pct(gaps, 50),
                        "itl_p95_ms": 1000 * pct(gaps, 95),
                        "rss_mib": rss[-1],
                    }
                )
                print(_line(rows[-1]), file=sys.stderr, flush=True)
    finally:
        stop_server(proc)
    print(f"server RSS (MiB) after start and after each wave: {', '.join(f'{r:.0f}' for r in rss)}", file=sys.stderr)
    return rows


def _line(row: dict) -> str:
    return (
        f"| {row['policy']} | {row['concurrency']} | {row['requests']} | {row['tokens_per_s']:.1f} | "
        f"{row['ttft_p50_s']:.2f} / {row['ttft_p95_s']:.2f} | {row['itl_p50_ms']:.0f} / {row['itl_p95_ms']:.0f} | "
        f"{row['rss_mib']:.0f} |"
    )


def capacity(args: argparse.Namespace) -> list[dict]:
    """Per policy: send ``--requests`` at once to a server capped at ``--cap-mib``; the most running at once."""
    texts = prompts(args.model, args.requests, args.prompt_tokens)
    rows = []
    for policy in args.policies:
        proc, base = start_server(args.model, args.cap_mib, args.requests, args.threads)
        try:
            bodies = [kv_body(args.model, text, policy, args.max_tokens) for text in texts]
            most = {"running": 0.0, "held": 0.0, "reserved": 0.0}

            async def run(bodies: list[dict] = bodies, base: str = base, most: dict = most) -> float:
                task = asyncio.create_task(wave(base, bodies, len(bodies)))
                async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                    while not task.done():
                        state = (await http.get("/health")).json()
                        most["running"] = max(most["running"], state["running"])
                        most["held"] = max(most["held"], state["kv_bytes_held"])
                        most["reserved"] = max(most["reserved"], state["kv_bytes_reserved"])
                        await asyncio.sleep(0.05)
                return (await task)[1]

            seconds = asyncio.run(run())
        finally:
            stop_server(proc)
        rows.append(
            {
                "policy": policy,
                "cap_mib": args.cap_mib,
                "most_running": int(most["running"]),
                "kv_held_max_mib": most["held"] / 2**20,
                "kv_reserved_max_mib": most["reserved"] / 2**20,
                "seconds": seconds,
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["throughput", "capacity"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", nargs="+", default=["h2o@256", "full"], help="POLICY[@BUDGET] per request")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--min-requests", type=int, default=4, help="requests per wave at least (throughput)")
    parser.add_argument("--requests", type=int, default=32, help="requests sent at once (capacity)")
    parser.add_argument("--cap-mib", type=float, default=4096, help="the server's --kv-memory-gb, in MiB")
    parser.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS (1: best on a busy CPU)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = throughput(args) if args.part == "throughput" else capacity(args)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.part == "throughput":
        print("| policy | concurrency | requests | tokens/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | RSS (MiB) |")
        print("|---|---|---|---|---|---|---|")
        print(*map(_line, rows), sep="\n")
    else:
        print("| policy | KV cap (MiB) | most running at once | KV held max (MiB) | KV reserved max (MiB) |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['policy']} | {r['cap_mib']:.0f} | {r['most_running']} | {r['kv_held_max_mib']:.1f} | "
                f"{r['kv_reserved_max_mib']:.1f} |"
            )


if __name__ == "__main__":
    main()
