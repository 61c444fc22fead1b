"""kvsieve: bounded KV caches for Hugging Face causal language models.

model, tokenizer = kvsieve.load_model()                 # SmolLM2-135M-Instruct, offline after `kvsieve data`
out = kvsieve.generate(model, tokenizer, "Once upon a time", policy="h2o", budget=0.2, max_new_tokens=64)
cache = kvsieve.make_cache(model, "streaming_llm", 256, sink=4)   # for model.generate / forward loops

The public names are imported on first use (PEP 562), so that ``import kvsieve`` (and the command line's
``--help``) does not import torch; the first one used also registers the ``"kvsieve"`` attention with transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC: dict[str, str] = {
    "ATTN_IMPLEMENTATION": "kvsieve.engine.attention",
    "ContextQA": "kvsieve.qa",
    "Generation": "kvsieve.api",
    "POLICIES": "kvsieve.policies:REGISTRY",
    "SieveCache": "kvsieve.engine.cache",
    "UnsupportedModelError": "kvsieve.engine.attention",
    "compress": "kvsieve.qa",
    "compress_context": "kvsieve.api",
    "generate": "kvsieve.api",
    "load_context": "kvsieve.qa",
    "load_model": "kvsieve.models",
    "make_cache": "kvsieve.api",
    "register": "kvsieve.engine.attention",
    "use_kvsieve_attention": "kvsieve.api",
}
"""Public name → the module that defines it (``module:attribute`` where the name differs)."""

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvsieve' has no attribute {name!r}")
    importlib.import_module("kvsieve.engine.attention").register()
    module, _, attribute = _PUBLIC[name].partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
