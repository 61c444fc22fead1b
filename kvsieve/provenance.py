"""Where a measurement comes from: the command, the date, the code and library versions, the host.

Every ``kvsieve ... --json`` result carries it under ``"provenance"``, so that a result file says by itself which
machine and which code produced its figures (:mod:`kvsieve.results` prints it under each published table).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["CPU_FLAGS", "answered_on", "cpu", "host", "provenance"]

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU features that change this project's speeds (matrix products, bf16), reported when the host has them."""


def cpu() -> dict[str, Any]:
    """The host's CPU: its model name, the :data:`CPU_FLAGS` it has (Linux ``/proc/cpuinfo``; the architecture
    elsewhere) and its logical cores."""
    name, flags = platform.processor() or platform.machine(), set()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {"name": name, "flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count()}


def host(cpu: dict[str, Any]) -> str:
    """A :func:`cpu` in words: its name and the :data:`CPU_FLAGS` it has, e.g. ``Intel(R) Xeon(R) (avx2, avx512f)``."""
    return f"{cpu['name']} ({', '.join(cpu['flags']) or 'no AVX2'})"


def answered_on(hosts: dict[str, int]) -> str:
    """Hosts (as :func:`host` words them) and how many answers each gave, in words: ``A: 3 answers; B: 1 answers``."""
    return "; ".join(f"{h}: {n} answers" for h, n in hosts.items())


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The short commit of the kvsieve checkout this runs from (``+dirty`` with uncommitted changes to the package's
    code), or None when it is not a git checkout."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "kvsieve"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def provenance(command: list[str], **details: Any) -> dict[str, Any]:
    """The provenance of a result computed now by ``command`` (the argument list, program name first): the date
    (UTC), the kvsieve version and commit, torch / transformers / numba versions, torch's threads, the CPU, and
    ``details`` (e.g. the model, dtype and device the command used)."""
    import torch

    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "kvsieve": _version("kvsieve"),
        "commit": _commit(),
        "versions": {name: _version(name) for name in ("torch", "transformers", "numba")},
        "threads": torch.get_num_threads(),
        "cpu": cpu(),
        **({"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}),
        **details,
    }
