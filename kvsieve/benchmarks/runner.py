"""One round of runs and the figures of a cell: the measurement under ``kvsieve bench``.

A *grid point* is a (prompt length, generation length, batch size); a *cell* is one policy at one grid point.
Every grid point also runs two references: ``dynamic_full`` (transformers' ``DynamicCache`` with the plain
``"sdpa"`` attention implementation) and ``floor`` (:class:`~kvsieve.benchmarks.floor.FloorCache`: a cache that
already holds exactly the budget and does no eviction work, the best speed possible at that memory).

One run: a prefill of the prompt (one forward pass, logits of the last position only), then ``gen - 1`` greedy
decode steps of one token each, never stopped by EOS — ``gen`` tokens generated per row, the first by the prefill
(the convention of transformers' ``generate``). Prompts are real Wikipedia text (one built-in article, tokenized,
truncated to the length, the same text in every batch row: tokens do not matter for speed).

Figures of a cell (medians over ``repeats`` runs; tokens count every batch row):

- ``prefill_s``; ``decode_tok_s`` = batch·(gen−1) / decode time; ``throughput_tok_s`` = batch·gen / (prefill +
  decode time), the H2O paper's end-to-end metric, computed from the median prefill and decode times;
- ``step_ms_p50`` / ``step_ms_p90``: percentiles of the decode steps of a run, median over runs;
- ``rss_growth_mb``: the run's own peak memory beyond what the process held before it (weights, runtime, the other
  policies' caches), ``peak_rss_mb`` = that growth on top of the resident memory at the start of the round. Before
  each prefill, freed heap memory is returned to the OS (glibc ``malloc_trim``) and the kernel's peak mark is reset
  (``/proc/self/clear_refs`` ← 5), so each prefill's peak is its own even though every run shares one process;
  decode steps add the cache's growth (see :func:`measure_round`). Where the reset is unavailable (not Linux) the
  peak is the process's peak so far;
- ``kv_bytes``: key/value bytes allocated at the end of the run; ``state_bytes``: positions and policy state.

Interleaving: the repeats of a grid point run in rounds; each round prefills every policy once (odd rounds in
reverse order, so order effects fall evenly), then runs their decode steps in lockstep — one step of each policy
in turn —, so every policy's steps meet the same machine state (a noisy machine's slow spells last seconds, a
run's decode tens of seconds). Ratios to ``dynamic_full`` and ``floor`` are medians of per-round ratios.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from kvsieve.api import make_cache, use_kvsieve_attention
from kvsieve.benchmarks.floor import FloorCache
from kvsieve.benchmarks.memory import MIB, kv_nbytes, reset_peak_rss, rss_bytes
from kvsieve.engine.cache import SieveCache
from kvsieve.policies import get_policy

DYNAMIC, FLOOR = "dynamic_full", "floor"
REFERENCES = (DYNAMIC, FLOOR)


@dataclass(frozen=True)
class GridPoint:
    prompt: int
    gen: int
    batch: int

    @property
    def label(self) -> str:
        return f"{self.prompt}+{self.gen} b{self.batch}"


@dataclass
class Run:
    """One measured run of one policy at one grid point."""

    prefill_s: float
    step_s: list[float]
    base_rss: int
    peak_rss: int
    kv_bytes: int
    state_bytes: int
    tokens_held: int

    @property
    def decode_s(self) -> float:
        return sum(self.step_s)

    def step_ms(self, percentile: float) -> float:
        return float(np.percentile(self.step_s, percentile)) * 1e3


def use_attention(model: PreTrainedModel, policy: str) -> None:
    """Switch the model to the attention implementation of ``policy``'s cache (plain ``"sdpa"`` for the references,
    ``"kvsieve"`` for the policies)."""
    if policy not in REFERENCES:
        use_kvsieve_attention(model)
    elif model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")


def new_cache(model: PreTrainedModel, policy: str, budget_tokens: int) -> Cache:
    """A fresh cache for ``policy`` (a registered policy, ``dynamic_full`` or ``floor``), the model's attention
    implementation switched to match (see :func:`use_attention`)."""
    use_attention(model, policy)
    if policy not in REFERENCES:
        return make_cache(model, policy, budget_tokens)
    if policy == FLOOR:
        return FloorCache(budget_tokens, model.config.get_text_config().num_hidden_layers)
    return DynamicCache(config=model.config)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def next_token(model: PreTrainedModel | Callable[..., Any], cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward step of ``model`` (or of a forward function of it, e.g. compiled), greedy, the last position's
    logits only, finished on the device when the call returns; returns the next tokens ``[B, 1]``."""
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1:].argmax(-1)
    _sync(ids.device)
    return token


@torch.inference_mode()
def measure_round(
    model: PreTrainedModel, policies: Sequence[str], budget_tokens: int, ids: torch.Tensor, gen: int
) -> dict[str, Run]:
    """One round: the prefill of ``ids`` ``[B, L]`` through a fresh cache for each policy in turn, then their
    ``gen - 1`` decode steps in lockstep (one step of each policy in turn), so that a slow spell of a noisy machine
    falls on every policy's steps alike.

    Memory: each prefill has its own peak mark (see the module docstring); the caches of the policies before it are
    still held, so each run's growth is counted from the resident memory just before its prefill, and reported on top
    of the resident memory at the start of the round. Decode steps add only the cache's growth (one token's
    activations are negligible), so a run's growth is the larger of its prefill's peak growth and its resident
    growth at the end of the prefill plus its cache's growth over the decode steps.
    """
    if gen < 2:
        raise ValueError(f"gen must be at least 2 (the prefill generates the first token), got {gen}")
    if len(set(policies)) != len(policies):
        raise ValueError(f"each policy runs once per round, got {list(policies)}")
    reset_peak_rss()
    round_base, _ = rss_bytes()
    caches, tokens, prefill_s, growth = {}, {}, {}, {}
    for name in policies:
        cache = caches[name] = new_cache(model, name, budget_tokens)
        reset_peak_rss()
        base, _ = rss_bytes()
        start = time.perf_counter()
        tokens[name] = next_token(model, cache, ids)
        prefill_s[name] = time.perf_counter() - start
        resident, peak = rss_bytes()
        growth[name] = (peak - base, resident - base - sum(_held_bytes(cache)))
    steps: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(gen - 1):
        for name in policies:
            use_attention(model, name)
            start = time.perf_counter()
            tokens[name] = next_token(model, caches[name], tokens[name])
            steps[name].append(time.perf_counter() - start)
    runs = {}
    for name, cache in caches.items():
        prefill_peak, resident = growth[name]
        kv, state = _held_bytes(cache)
        runs[name] = Run(
            prefill_s=prefill_s[name],
            step_s=steps[name],
            base_rss=round_base,
            peak_rss=round_base + max(prefill_peak, resident + kv + state),
            kv_bytes=kv,
            state_bytes=state,
            tokens_held=max(cache.capacities()) if isinstance(cache, SieveCache) else cache.layers[0].keys.shape[2],
        )
    return runs


def measure(model: PreTrainedModel, policy: str, budget_tokens: int, ids: torch.Tensor, gen: int) -> Run:
    """Prefill ``ids`` ``[B, L]`` then run ``gen - 1`` decode steps through a fresh cache for ``policy``."""
    return measure_round(model, [policy], budget_tokens, ids, gen)[policy]


def _held_bytes(cache: Cache) -> tuple[int, int]:
    """Key/value bytes (a kvsieve cache's own count: codes, scales and residual when quantized) and policy-state
    bytes (positions included) the cache holds."""
    if isinstance(cache, SieveCache):
        return cache.kv_nbytes(), cache.state_nbytes()
    return kv_nbytes(cache), 0


@dataclass
class Cell:
    """The figures of one policy at one grid point (see the module docstring)."""

    policy: str
    budget_tokens: int | None
    prompt_tokens: int
    gen_tokens: int
    batch: int
    repeats: int
    prefill_s: float
    decode_s: float
    decode_tok_s: float
    throughput_tok_s: float
    step_ms_p50: float
    step_ms_p90: float
    peak_rss_mb: float
    rss_growth_mb: float
    kv_bytes: int
    state_bytes: int
    tokens_held: int
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    """``{"vs_floor": {...}, "vs_dynamic_full": {...}}``: medians of per-round ratios (this policy / reference)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_cells(cells: Sequence[Cell], **where: Any) -> list[Cell]:
    """The cells whose fields have the given values."""
    return [c for c in cells if all(getattr(c, k) == v for k, v in where.items())]


def _round_ratios(runs: Sequence[Run], refs: Sequence[Run]) -> dict[str, float]:
    pairs = list(zip(runs, refs, strict=True))
    return {
        "prefill_s": statistics.median(a.prefill_s / b.prefill_s for a, b in pairs),
        "step_ms_p50": statistics.median(a.step_ms(50) / b.step_ms(50) for a, b in pairs),
        "decode_tok_s": statistics.median(b.decode_s / a.decode_s for a, b in pairs),
        "throughput_tok_s": statistics.median(
            (b.prefill_s + b.decode_s) / (a.prefill_s + a.decode_s) for a, b in pairs
        ),
    }


def summarize(
    policy: str, point: GridPoint, budget_tokens: int, runs: Sequence[Run], all_runs: dict[str, list[Run]]
) -> Cell:
    """A cell from its runs; ratios against the references among ``all_runs`` (same rounds)."""
    prefill = statistics.median(r.prefill_s for r in runs)
    decode = statistics.median(r.decode_s for r in runs)
    steps = point.batch * (point.gen - 1)
    bounded = policy == FLOOR or (policy != DYNAMIC and get_policy(policy).takes_budget())
    return Cell(
        policy=policy,
        budget_tokens=budget_tokens if bounded else None,
        prompt_tokens=point.prompt,
        gen_tokens=point.gen,
        batch=point.batch,
        repeats=len(runs),
        prefill_s=prefill,
        decode_s=decode,
        decode_tok_s=steps / decode,
        throughput_tok_s=point.batch * point.gen / (prefill + decode),
        step_ms_p50=statistics.median(r.step_ms(50) for r in runs),
        step_ms_p90=statistics.median(r.step_ms(90) for r in runs),
        peak_rss_mb=statistics.median(r.peak_rss for r in runs) / MIB,
        rss_growth_mb=statistics.median(r.peak_rss - r.base_rss for r in runs) / MIB,
        kv_bytes=runs[-1].kv_bytes,
        state_bytes=runs[-1].state_bytes,
        tokens_held=runs[-1].tokens_held,
        ratios={f"vs_{ref}": _round_ratios(runs, all_runs[ref]) for ref in REFERENCES if ref != policy},
    )


def prompt_tokens(tokenizer: PreTrainedTokenizerBase, length: int) -> torch.Tensor:
    """``[length]`` token ids of real Wikipedia text (one built-in article; repeated if it is too short)."""
    from kvsieve.data import builtin_text

    ids = tokenizer(builtin_text(min_chars=length * 6), return_tensors="pt").input_ids[0]
    return ids.repeat(math.ceil(length / ids.numel()))[:length]


def prompt_rows(tokens: torch.Tensor, point: GridPoint, device: torch.device) -> torch.Tensor:
    """The first ``point.prompt`` of ``tokens`` in every batch row: ``[batch, prompt]`` on ``device``."""
    if tokens.numel() < point.prompt:
        raise ValueError(f"{point.prompt}-token prompts need {point.prompt} tokens of text, got {tokens.numel()}")
    return tokens[: point.prompt].to(device).repeat(point.batch, 1)
