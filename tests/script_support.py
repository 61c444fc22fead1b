"""The measurement scripts under scripts/ as modules, for the tests of their parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` imported as the module ``NAME``, with scripts/ on the path (as when a script runs: its
    siblings import each other)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses resolve annotations through sys.modules)
    spec.loader.exec_module(module)
    return module


def provenance_of(*command: str) -> dict:
    """The provenance of a result written by ``command`` (:func:`kvsieve.provenance.provenance`'s fields, placeholder
    values), for the tests that render a script's result."""
    return {"command": list(command), "cpu": {"name": "x", "flags": []}, "threads": 2, "versions": {}, "kvsieve": "0",
            "commit": None, "date": "today"}  # fmt: skip
