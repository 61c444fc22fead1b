"""Support for the Ray tests (test_ray.py, test_ruler_ray.py, test_serve_ray.py): Ray on the loopback interface
only (a command run in its own namespace, two nodes in it), a worker hook that injects faults, and the scenarios run
by a driver process.

Ray advertises a machine's routable address even when told 127.0.0.1, so every Ray of the tests runs in a network
namespace of its own (``unshare -rn``) whose only interface is the loopback: ``loopback_command``. A scenario runs
as ``python tests/ray_support.py SCENARIO ARGS_JSON`` in that namespace and prints its findings as JSON.

Faults: ``install`` (Ray's ``worker_process_setup_hook``) wraps ``Runner.run`` in each worker process. The file
named by ``KVSIEVE_TEST_FAULTS`` maps a cell's key to ``raise`` (every attempt), ``kill`` (the worker process dies
on the first attempt) or ``hang``; every attempt is logged as ``KEY PID`` to the file named by its ``log`` entry.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvsieve.engine.memory import available_memory

FAULTS = "KVSIEVE_TEST_FAULTS"
TIMEOUT_S = 60


def loopback_command(argv: list[str]) -> list[str]:
    """``argv`` run in a new network namespace with only the loopback interface up."""
    if shutil.which("unshare") is None:
        raise RuntimeError("the Ray tests need unshare (util-linux) to keep Ray on the loopback interface")
    return ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def install() -> None:
    """The worker hook: wrap ``Runner.run`` with the faults of the ``KVSIEVE_TEST_FAULTS`` file."""
    from kvsieve.evaluation.sweep import Runner

    run = Runner.run

    def faulty(self: Runner, cell: Any) -> dict[str, Any]:
        plan = json.loads(Path(os.environ[FAULTS]).read_text())
        with open(plan["log"], "a") as log:
            log.write(f"{cell.key} {os.getpid()}\n")
        fault = plan["faults"].get(cell.key)
        if fault == "raise":
            raise ValueError(f"injected failure in {cell.key}")
        if fault == "kill":
            marker = Path(plan["log"]).with_name(f"{cell.key}.killed")
            if not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            time.sleep(TIMEOUT_S * 10)
        return run(self, cell)

    Runner.run = faulty


def _attempts(log: Path) -> list[tuple[str, int]]:
    if not log.exists():
        return []
    return [(key, int(pid)) for key, pid in (line.split() for line in log.read_text().splitlines())]


def local(args: dict[str, Any]) -> dict[str, Any]:
    """On one local Ray: a sweep; a sweep with a killed worker and a cell that always raises; its rerun after a cell
    file is deleted; a sweep interrupted (Ctrl-C) while a cell hangs."""
    import ray

    from kvsieve.evaluation import sweep
    from kvsieve.evaluation.ray_sweep import RayOptions

    work = Path(args["work"])
    plan_file, log = work / "faults.json", work / "attempts.log"
    os.environ[FAULTS] = str(plan_file)
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=100 * 2**20,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": "ray_support.install"},
    )
    writes: list[str] = []
    save = sweep._save_cell

    def counted(out: Path, cell: sweep.Cell, *rest: Any) -> None:
        save(out, cell, *rest)
        writes.append(cell.key)  # (after the file is in place: the Ctrl-C scenario interrupts on seeing it)

    sweep._save_cell = counted
    settings = sweep.Settings(**args["settings"])
    grid = (["ppl"], args["policies"], args["budgets"])
    options = RayOptions(max_retries=1)
    found: dict[str, Any] = {}
    try:
        plan_file.write_text(json.dumps({"log": str(log), "faults": {}}))
        plain = sweep.run_sweep(work / "plain", *grid, settings=settings, ray=options, progress=False)
        cells = {p.stem: json.loads(p.read_text()) for p in (work / "plain" / "cells").glob("*.json")}
        found["plain"] = {"rows": plain.rows, "computed": plain.computed, "cells": cells}

        def sweep_out(faults: dict[str, str]) -> dict[str, Any]:
            """A sweep into ``work/out`` with ``faults`` injected: its rows, cells computed, writes and attempts."""
            log.unlink()
            writes.clear()
            plan_file.write_text(json.dumps({"log": str(log), "faults": faults}))
            result = sweep.run_sweep(work / "out", *grid, settings=settings, ray=options, progress=False)
            return {"rows": result.rows, "computed": result.computed, "writes": writes.copy(), "log": _attempts(log)}

        found["first"] = sweep_out(args["faults"])
        (work / "out" / "cells" / f"{args['delete']}.json").unlink()
        found["rerun"] = sweep_out({})

        hang = sweep.Cell("ppl", args["policies"][-1], args["budgets"][-1])
        plan_file.write_text(json.dumps({"log": str(log), "faults": {hang.key: "hang"}}))
        log.unlink()
        writes.clear()
        others = [sweep.Cell("ppl", p, b).computed_as() for p in args["policies"] for b in args["budgets"]]
        others = {c.key for c in others} - {hang.key}

        def interrupt_when_the_others_are_written() -> None:
            deadline = time.monotonic() + TIMEOUT_S
            while not ({hang.key} <= {k for k, _ in _attempts(log)} and others <= set(writes)):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)  # (Ctrl-C)

        threading.Thread(target=interrupt_when_the_others_are_written, daemon=True).start()
        started = time.monotonic()
        try:
            sweep.run_sweep(work / "interrupted", *grid, settings=settings, ray=options, progress=False)
            found["interrupted"] = {"raised": False}
        except KeyboardInterrupt:
            (pid,) = [pid for key, pid in _attempts(log) if key == hang.key]
            deadline = time.monotonic() + 20
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            stored = sorted(p.stem for p in (work / "interrupted" / "cells").glob("*.json"))
            found["interrupted"] = {
                "raised": True,
                "stored": stored,
                "others": sorted(others),
                "hung_worker_alive": _alive(pid),
                "seconds": time.monotonic() - started,
            }
    finally:
        ray.shutdown()
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OBJECT_STORE_BYTES = 128 * 2**20
"""A local Ray's object store in these tests (Ray's minimum is 75 MiB)."""


def _object_store_share() -> str:
    """The share of the available memory Ray gives its object store by default, set so that it is about
    :data:`OBJECT_STORE_BYTES` whatever else holds memory on the machine."""
    free = available_memory(torch.device("cpu")) or 24 * 2**30
    return f"{min(0.3, OBJECT_STORE_BYTES / free):.6f}"


def in_loopback(argv: list[str], timeout: float = TIMEOUT_S * 10) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a loopback-only network namespace; whatever it started is killed at the end, also on failure."""
    tests = str(Path(__file__).parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
        "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": _object_store_share(),
        "RAY_AUTH_MODE": "disabled",  # (one namespace, nothing else can reach it)
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    proc = subprocess.Popen(
        loopback_command(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the namespace's processes: Ray's, started by the test)
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@contextlib.contextmanager
def two_nodes() -> Iterator[str]:
    """A head and a second node of one CPU each (``ray start``), in this namespace: their address. Both are stopped
    at the end (what they started goes with the namespace's process group: :func:`in_loopback`)."""
    ray_bin = Path(sys.executable).with_name("ray")
    address = f"127.0.0.1:{free_port()}"
    common = ["--block", "--num-cpus", "1", "--object-store-memory", str(80 * 2**20), "--disable-usage-stats"]
    head = ["--head", "--port", address.split(":")[1], "--include-dashboard", "false"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    nodes = [subprocess.Popen([ray_bin, "start", *head, *common], **quiet)]
    try:
        _wait(lambda: subprocess.run([ray_bin, "status", "--address", address], capture_output=True).returncode == 0)
        nodes.append(subprocess.Popen([ray_bin, "start", "--address", address, *common], **quiet))
        _wait(lambda: "2 node" in _nodes(ray_bin, address))
        yield address
    finally:
        for node in reversed(nodes):
            node.terminate()
        for node in reversed(nodes):
            try:
                node.wait(TIMEOUT_S / 2)
            except subprocess.TimeoutExpired:
                node.kill()


def cluster(args: dict[str, Any]) -> dict[str, Any]:
    """Two nodes (:func:`two_nodes`), then ``kvsieve sweep --ray HOST:PORT``."""
    with two_nodes() as address:
        sweep = subprocess.run(
            [sys.executable, "-m", "kvsieve.cli", "sweep", "--json", "--ray", address, *args["sweep"]],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S * 3,
        )
        return {"returncode": sweep.returncode, "stdout": sweep.stdout, "stderr": sweep.stderr[-3000:]}


def _nodes(ray_bin: Path, address: str) -> str:
    status = subprocess.run([ray_bin, "status", "--address", address], capture_output=True, text=True).stdout
    alive = sum(line.strip().startswith("1 node_") for line in status.split("Pending:")[0].splitlines())
    return f"{alive} node(s)"


def _wait(ready: Any) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError("Ray did not start in time")
        time.sleep(0.5)


if __name__ == "__main__":
    # Ctrl-C must raise KeyboardInterrupt here even when this process inherited SIGINT ignored (a background job of a
    # non-interactive shell ignores it, and Python then installs no handler): the Ctrl-C scenario sends it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    scenario, raw = sys.argv[1:]
    found = {"local": local, "cluster": cluster}[scenario](json.loads(raw))
    print("\n" + json.dumps(found))  # (the last line: Ray may print before)
