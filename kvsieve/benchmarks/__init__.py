"""Benchmarks: speed and memory of the evicting caches against transformers' ``DynamicCache`` and the floor.

- :mod:`~kvsieve.benchmarks.bench`: ``kvsieve bench`` as one call (:func:`benchmark`);
- :mod:`~kvsieve.benchmarks.runner`: one round (prefills in turn, decode steps in lockstep), the caches it runs, the
  figures of a cell (:class:`Cell`);
- :mod:`~kvsieve.benchmarks.grid`: the grid points and their plan, run in rounds (:func:`run_bench`);
- :mod:`~kvsieve.benchmarks.eviction_overhead`: the ``eviction-overhead`` preset, its cells and checks;
- :mod:`~kvsieve.benchmarks.memory`: resident memory probes, K/V and model bytes, the memory model of a run;
- :mod:`~kvsieve.benchmarks.capacity`: the largest batch under a memory cap, predicted and verified;
- :mod:`~kvsieve.benchmarks.report`: the plain-text report and the plot;
- :mod:`~kvsieve.benchmarks.profile`: ``--profile``, the top ops of a few decode steps;
- :mod:`~kvsieve.benchmarks.floor`: the floor cache (:class:`FloorCache`);
- :mod:`~kvsieve.benchmarks.defaults`: the command's defaults and preset names (no heavy imports).

The public names are imported on first use (PEP 562), so that the command line's parser can read
:mod:`~kvsieve.benchmarks.defaults` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC: dict[str, str] = {
    "Cell": "kvsieve.benchmarks.runner",
    "FloorCache": "kvsieve.benchmarks.floor",
    "FloorLayer": "kvsieve.benchmarks.floor",
    "benchmark": "kvsieve.benchmarks.bench",
    "evaluate_checks": "kvsieve.benchmarks.eviction_overhead",
    "profile_decode": "kvsieve.benchmarks.profile",
    "run_bench": "kvsieve.benchmarks.grid",
}
"""Public name → the module that defines it."""

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvsieve.benchmarks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
