"""The measuring process of ``scripts/kvpress_side_by_side.py``: one side, one JSON line.

It runs under either virtualenv: kvsieve's (``.venv``, side ``kvsieve``) or kvpress's (``.venv-kvpress``, side
``kvpress``: kvpress 0.5.5 needs transformers < 5.3). At the top it imports only torch and transformers; each side
imports its own library, so both sides time the very same loop (:func:`measure`) on the same weights.

Request, one JSON object on stdin::

    {"side": "kvsieve" | "kvpress", "model": DIR, "ids": [token ids], "steps": N, "threads": T,
     "methods": [names], "budget": TOKENS, "compression_ratio": R, "kept": bool, "warmup": TOKENS}

``methods`` are kvsieve policy specs (``"snapkv:window=64,kernel=5"``) on the kvsieve side, press names on the
kvpress side, and ``"dynamic"`` on both (transformers' ``DynamicCache``, sdpa, nothing evicted). The kvsieve side
keeps ``budget`` tokens; the kvpress side compresses by ``compression_ratio``.

Reply, one JSON line on stdout: ``{"side", "versions", "threads", "runs": {method: run}}``, a run being
``prefill_s``, ``step_ms`` (median decode step), ``kv_bytes`` (keys and values allocated after the ``steps`` decode
steps), ``extra_bytes`` (other per-token cache state: kvsieve's positions and policy scores), ``slots`` (tokens a
layer's buffers hold, at most) and, with ``"kept": true``, ``kept``: for each layer and KV head (batch row 0), the
sorted prompt positions the cache holds right after the prefill.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

DYNAMIC = "dynamic"

Kept = list[list[list[int]]]
"""Per layer, per KV head: sorted positions."""


@dataclass
class Setup:
    """A method ready to run: its fresh cache, what wraps the prefill (kvpress's hooks), what it keeps."""

    cache: Cache
    prefill: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    kept: Callable[[Cache], Kept] | None = None
    extra_bytes: Callable[[Cache], int] = lambda cache: 0


def load(model_dir: str, threads: int) -> PreTrainedModel:
    """The model in fp32, eval mode, sdpa attention, on ``threads`` CPU threads (no progress bars)."""
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def next_token(model: PreTrainedModel, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward pass (the last position's logits only); the greedy next tokens ``[B, 1]``."""
    return model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)


def kv_bytes(cache: Cache) -> int:
    """Key and value bytes the cache's layers hold."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


@torch.inference_mode()
def measure(model: PreTrainedModel, setup: Setup, ids: torch.Tensor, steps: int, kept: bool) -> dict[str, Any]:
    """Prefill ``ids`` (timed with the method's prefill wrapper), read what it kept (untimed), then ``steps`` greedy
    decode steps of one token each, each timed."""
    start = time.perf_counter()
    with setup.prefill():
        token = next_token(model, setup.cache, ids)
    prefill_s = time.perf_counter() - start
    run: dict[str, Any] = {"prefill_s": prefill_s}
    if kept and setup.kept is not None:
        run["kept"] = setup.kept(setup.cache)
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        token = next_token(model, setup.cache, token)
        step_s.append(time.perf_counter() - start)
    layers = [layer for layer in setup.cache.layers if layer.keys is not None]
    run |= {
        "step_ms": statistics.median(step_s) * 1e3,
        "kv_bytes": kv_bytes(setup.cache),
        "extra_bytes": setup.extra_bytes(setup.cache),
        "slots": max(layer.keys.shape[-2] for layer in layers),
    }
    return run


def match_positions(kept: torch.Tensor, reference: torch.Tensor) -> list[list[int]]:
    """For each head, the sorted positions of the ``reference`` ``[H, N, D]`` rows that the rows of ``kept``
    ``[H, M, D]`` are exact copies of (a press gathers the prompt's keys). Rows are matched by a fingerprint of their
    bytes, then checked equal."""
    weights = torch.randint(
        1, 2**62, (kept.shape[-1] * kept.element_size(),), generator=torch.Generator().manual_seed(0)
    )

    def fingerprint(rows: torch.Tensor) -> torch.Tensor:
        return (rows.contiguous().view(torch.uint8).long() * weights).sum(-1)  # (wraps around: still a fingerprint)

    positions = []
    for rows, ref in zip(kept, reference, strict=True):
        ordered, order = fingerprint(ref).sort()
        index = order[torch.searchsorted(ordered, fingerprint(rows)).clamp(max=len(order) - 1)]
        if not torch.equal(ref[index], rows):
            raise RuntimeError("a kept key is no copy of a prompt key: the prefill's keys differ from the reference's")
        positions.append(sorted(index.tolist()))
    return positions


def kvpress_setups(model: PreTrainedModel, request: dict[str, Any], ids: torch.Tensor) -> Iterator[Setup]:
    """A setup per requested method: a ``DynamicCache`` and kvpress's press hooks around the prefill."""
    import kvpress

    presses = {
        "streaming_llm": kvpress.StreamingLLMPress,
        "snapkv": kvpress.SnapKVPress,
        "knorm": kvpress.KnormPress,
        "tova": kvpress.TOVAPress,
    }
    reference: list[torch.Tensor] = []
    if request["kept"]:  # the prompt's keys, unpressed: each press keeps copies of some of them
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        reference = [layer.keys[0].clone() for layer in cache.layers]
    for name in request["methods"]:
        cache = DynamicCache(config=model.config)
        if name == DYNAMIC:
            yield Setup(cache)
            continue
        press = presses[name](compression_ratio=request["compression_ratio"])
        yield Setup(
            cache,
            prefill=lambda press=press: press(model),
            kept=lambda c: [
                match_positions(layer.keys[0], ref) for layer, ref in zip(c.layers, reference, strict=True)
            ],
        )


def kvsieve_setups(model: PreTrainedModel, request: dict[str, Any], ids: torch.Tensor) -> Iterator[Setup]:
    """A setup per requested method: ``kvsieve.make_cache`` at ``budget`` tokens (kvsieve's attention), or a
    ``DynamicCache`` with sdpa."""
    from kvsieve.api import make_cache

    for spec in request["methods"]:
        if spec == DYNAMIC:
            model.set_attn_implementation("sdpa")
            yield Setup(DynamicCache(config=model.config))
            continue
        cache = make_cache(model, spec, request["budget"])
        yield Setup(
            cache,
            kept=lambda c: [
                [sorted(p for p in head if p >= 0) for head in c.positions(i)[0].tolist()] for i in range(len(c.layers))
            ],
            extra_bytes=lambda c: c.state_nbytes(),
        )


SIDES = {"kvsieve": kvsieve_setups, "kvpress": kvpress_setups}


def versions(side: str) -> dict[str, str]:
    """The versions that matter for the side's figures."""
    import importlib.metadata

    import transformers

    library = importlib.metadata.version(side)
    return {side: library, "torch": torch.__version__, "transformers": transformers.__version__}


def work(request: dict[str, Any]) -> dict[str, Any]:
    """Load the model, warm every method up on the first ``warmup`` tokens (two decode steps, untimed), then run
    each method once over all ``ids``; the reply (see the module docstring)."""
    side = request["side"]
    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}; expected one of {', '.join(SIDES)}")
    model = load(request["model"], request["threads"])
    ids = torch.tensor([request["ids"]])
    warm = ids[:, : request["warmup"]]
    warm_request = {**request, "kept": False, "budget": max(1, request["budget"] * warm.shape[1] // ids.shape[1])}
    for setup in SIDES[side](model, warm_request, warm):
        measure(model, setup, warm, 2, kept=False)
    runs = {}
    for name, setup in zip(request["methods"], SIDES[side](model, request, ids), strict=True):
        print(f"{side}: {name}", file=sys.stderr, flush=True)
        runs[name] = measure(model, setup, ids, request["steps"], request["kept"])
    return {"side": side, "versions": versions(side), "threads": torch.get_num_threads(), "runs": runs}


def main() -> None:
    print(json.dumps(work(json.load(sys.stdin))))


if __name__ == "__main__":
    main()
