"""``kvsieve bench``: speed and memory of the evicting caches, side by side with transformers' cache and the floor.

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

import ctypes
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from kvsieve.api import make_cache, use_kvsieve_attention
from kvsieve.bench_defaults import DEFAULT_BATCHES, DEFAULT_BUDGET, DEFAULT_POINTS, DEFAULT_POLICIES
from kvsieve.benchmarks.floor import FloorCache
from kvsieve.engine.budget import Budget, resolve_budget
from kvsieve.engine.cache import SieveCache
from kvsieve.evaluation.plots import pyplot, save_figure
from kvsieve.policies import REGISTRY

DYNAMIC, FLOOR = "dynamic_full", "floor"
REFERENCES = (DYNAMIC, FLOOR)
TARGET_BUDGET = 512
NO_ATTENTION = tuple(name for name, cls in REGISTRY.items() if cls.bounded and not cls.needs_attention)
TARGET_PLAN = ((512, 32, ("h2o",)), (2048, 256, ("h2o", *NO_ATTENTION)), (7936, 256, ("h2o",)))
"""``--targets``: (prompt, gen, policies) at batch 1 and budget 512, the cells the issue's targets need."""
MEM_SHARE = 0.5
"""A grid point is skipped when the full cache alone would take more than this share of the available memory."""
VERIFY_STEPS = 4
"""Decode steps of a run that verifies a predicted largest batch."""
VERIFY_MAX_S = 300.0
"""A predicted batch is verified only if its run is expected to take at most this long."""
PROFILE_PROMPT = 2048
"""Prompt tokens before the profiled decode steps (``--profile``)."""
MIB = 2**20


# -- memory ------------------------------------------------------------------------------------------------------


def _proc_bytes(path: str, name: str) -> int | None:
    """The ``name:  N kB`` field of a ``/proc`` file, in bytes (None where there is no such file)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Return freed heap memory to the OS and reset the kernel's peak-RSS mark (Linux); False if unsupported."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident memory of this process in bytes (peak since the last :func:`reset_peak_rss`)."""
    current, peak = _proc_bytes("/proc/self/status", "VmRSS"), _proc_bytes("/proc/self/status", "VmHWM")
    if current is None or peak is None:  # no /proc (macOS): the process's peak, in bytes there
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak, peak
    return current, peak


def available_bytes() -> float:
    """Memory available to new allocations (``MemAvailable``), or infinity where unknown."""
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    return math.inf if available is None else available


def kv_nbytes(cache: Cache) -> int:
    """Key/value bytes allocated by any cache whose layers hold ``keys``/``values`` tensors."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def full_kv_bytes_per_token(model: PreTrainedModel) -> int:
    """K/V bytes one token takes in a full cache of ``model`` (all layers, one batch row)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elem


def model_nbytes(model: PreTrainedModel) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


@dataclass(frozen=True)
class MemSample:
    """One measured run, as the memory model sees it."""

    batch: int
    base_rss: float
    peak_rss: float
    kv_bytes: float
    tokens_held: int
    """Slots per (row, layer) the K/V bytes are for."""


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of a run as ``model + runtime + batch · (KV per token · tokens held + activations per row)``."""

    model_bytes: float
    runtime_bytes: float
    """Resident memory besides the weights (torch, tokenizer, ...) plus any per-run overhead that does not grow with
    the batch."""
    kv_bytes_per_token: float
    tokens_held: int
    act_bytes_per_seq: float
    """Peak memory per batch row beyond its final K/V (activations, the prompt's K/V before eviction, ...)."""

    @property
    def seq_bytes(self) -> float:
        return self.kv_bytes_per_token * self.tokens_held + self.act_bytes_per_seq

    def peak(self, batch: int) -> float:
        return self.model_bytes + self.runtime_bytes + batch * self.seq_bytes

    def max_batch(self, cap_bytes: float) -> int:
        """The largest batch whose predicted peak stays within ``cap_bytes`` (0 if not even one row fits)."""
        room = cap_bytes - self.model_bytes - self.runtime_bytes
        return max(0, math.floor(room / self.seq_bytes)) if self.seq_bytes > 0 else 0

    @classmethod
    def fit(cls, model_bytes: float, samples: Sequence[MemSample]) -> MemoryModel:
        """Fit from measured runs: KV per token directly; the growth of the peak per batch row by least squares over
        the batch sizes measured (one batch size: growth / batch); its intercept counts as runtime."""
        if not samples:
            raise ValueError("the memory model needs at least one measured run")
        kv_per_token = statistics.median(s.kv_bytes / (s.batch * s.tokens_held) for s in samples)
        tokens = samples[0].tokens_held
        growth = [s.peak_rss - s.base_rss for s in samples]
        batches = [s.batch for s in samples]
        if len(set(batches)) > 1:
            slope, intercept = np.polyfit(batches, growth, 1)
        else:
            slope, intercept = statistics.median(g / b for g, b in zip(growth, batches, strict=True)), 0.0
        base = statistics.median(s.base_rss for s in samples)
        return cls(
            model_bytes=model_bytes,
            runtime_bytes=base - model_bytes + max(float(intercept), 0.0),
            kv_bytes_per_token=kv_per_token,
            tokens_held=tokens,
            act_bytes_per_seq=max(float(slope) - kv_per_token * tokens, 0.0),
        )


# -- one run -----------------------------------------------------------------------------------------------------


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


def _next_token(model: PreTrainedModel, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward step (greedy, the last position's logits only); returns the next tokens ``[B, 1]``."""
    logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
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
        tokens[name] = _next_token(model, cache, ids)
        prefill_s[name] = time.perf_counter() - start
        resident, peak = rss_bytes()
        growth[name] = (peak - base, resident - base - sum(_held_bytes(cache)))
    steps: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(gen - 1):
        for name in policies:
            use_attention(model, name)
            start = time.perf_counter()
            tokens[name] = _next_token(model, caches[name], tokens[name])
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
    """Key/value bytes and policy-state bytes (positions included) the cache holds."""
    return kv_nbytes(cache), cache.state_nbytes() if isinstance(cache, SieveCache) else 0


# -- the grid ----------------------------------------------------------------------------------------------------


def rounds(policies: Sequence[str], repeats: int) -> list[list[str]]:
    """The policy order of each round of one grid point: every policy once per round, odd rounds reversed."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    return [list(policies) if r % 2 == 0 else list(policies)[::-1] for r in range(repeats)]


def pair_lengths(prompts: Sequence[int], gens: Sequence[int]) -> list[tuple[int, int]]:
    """(prompt, gen) pairs: element-wise when both lists have the same length, a single value pairs with every
    value of the other list."""
    if len(prompts) == len(gens):
        return list(zip(prompts, gens, strict=True))
    if len(gens) == 1:
        return [(p, gens[0]) for p in prompts]
    if len(prompts) == 1:
        return [(prompts[0], g) for g in gens]
    raise ValueError(
        f"--prompt-lens ({len(prompts)} values) and --gen-lens ({len(gens)}) must pair up: give as many of each, or "
        "one value for either"
    )


def make_plan(
    lengths: Sequence[tuple[int, int]], batches: Sequence[int], policies: Sequence[str]
) -> list[tuple[GridPoint, list[str]]]:
    """Every (prompt, gen) pair at every batch size, each with the references and ``policies``."""
    for prompt, gen in lengths:
        if prompt < 1 or gen < 2:
            raise ValueError(f"need prompts of at least 1 token and at least 2 generated tokens, got {prompt}+{gen}")
    if not batches or min(batches) < 1:
        raise ValueError(f"batch sizes must be positive, got {list(batches)}")
    for name in policies:
        if name not in REGISTRY and name not in REFERENCES:
            raise ValueError(f"unknown policy {name!r}; available: {', '.join([*REFERENCES, *REGISTRY])}")
    names = [*REFERENCES, *(p for p in dict.fromkeys(policies) if p not in REFERENCES)]
    return [(GridPoint(p, g, b), names) for p, g in lengths for b in batches]


def target_plan() -> list[tuple[GridPoint, list[str]]]:
    """The cells the issue's targets need (:data:`TARGET_PLAN`), with the references."""
    return [plan for p, g, names in TARGET_PLAN for plan in make_plan([(p, g)], [1], names)]


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
    bounded = policy == FLOOR or (policy in REGISTRY and REGISTRY[policy].takes_budget())
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


def skip_reason(model: PreTrainedModel, point: GridPoint) -> str | None:
    """Why a grid point cannot run here (too many positions for the model, or too little memory), or None."""
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_pos is not None and point.prompt + point.gen - 1 > max_pos:
        return f"{point.prompt}+{point.gen} tokens exceed the model's {max_pos} positions"
    full = point.batch * (point.prompt + point.gen) * full_kv_bytes_per_token(model)
    if full > MEM_SHARE * available_bytes():
        return f"the full cache ({full / MIB:.0f} MiB) exceeds {MEM_SHARE:.0%} of the available memory"
    return None


def prompt_tokens(tokenizer: PreTrainedTokenizerBase, length: int) -> torch.Tensor:
    """``[length]`` token ids of real Wikipedia text (one built-in article; repeated if it is too short)."""
    from kvsieve.data import builtin_text

    ids = tokenizer(builtin_text(min_chars=length * 6), return_tensors="pt").input_ids[0]
    return ids.repeat(math.ceil(length / ids.numel()))[:length]


def _rows(tokens: torch.Tensor, point: GridPoint, device: torch.device) -> torch.Tensor:
    if tokens.numel() < point.prompt:
        raise ValueError(f"{point.prompt}-token prompts need {point.prompt} tokens of text, got {tokens.numel()}")
    return tokens[: point.prompt].to(device).repeat(point.batch, 1)


def warm_up(model: PreTrainedModel, tokens: torch.Tensor, policies: Iterable[str]) -> None:
    """One short run per policy (with eviction), so that no measured run pays for first-use initialisation."""
    measure_round(model, list(policies), 16, tokens[:32].to(model.device)[None], 3)


def run_bench(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    plan: Sequence[tuple[GridPoint, Sequence[str]]],
    budget: Budget = DEFAULT_BUDGET,
    repeats: int = 3,
    progress: bool = True,
) -> tuple[list[Cell], list[dict[str, Any]]]:
    """Run ``plan`` (grid points with their policies, e.g. from :func:`make_plan`) in ``repeats`` rounds each (see
    :func:`measure_round`).

    ``tokens``: ``[n]`` ids, the prompts' source. ``budget``: tokens, or a ratio of each prompt. Returns the cells
    and the skipped grid points (their prompt and generation lengths, batch size and the reason).
    """
    runnable, skipped = [], []
    for point, names in plan:
        reason = skip_reason(model, point)
        if reason is None:
            runnable.append((point, list(names)))
        else:
            skipped.append(
                {"prompt_tokens": point.prompt, "gen_tokens": point.gen, "batch": point.batch, "reason": reason}
            )
    warm_up(model, tokens, dict.fromkeys(n for _, names in runnable for n in names))
    cells = []
    total = sum(len(names) * repeats for _, names in runnable)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        for point, names in runnable:
            budget_tokens = resolve_budget(budget, point.prompt)
            ids = _rows(tokens, point, model.device)
            runs: dict[str, list[Run]] = {name: [] for name in names}
            for r, order in enumerate(rounds(names, repeats)):
                bar.set_postfix_str(f"{point.label} round {r + 1}")
                for name, run in measure_round(model, order, budget_tokens, ids, point.gen).items():
                    runs[name].append(run)
                bar.update(len(order))
            cells.extend(summarize(name, point, budget_tokens, runs[name], runs) for name in names)
    return cells, skipped


def benchmark(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Sequence[tuple[int, int]] = DEFAULT_POINTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    policies: Sequence[str] = DEFAULT_POLICIES,
    budget: Budget = DEFAULT_BUDGET,
    repeats: int = 3,
    targets: bool = False,
    mem_cap_gb: float | None = None,
    plot: str | Path | None = None,
    progress: bool = True,
    title: str = "",
) -> dict[str, Any]:
    """The whole ``kvsieve bench``: the grid (or, with ``targets``, exactly the cells of the issue's targets at
    budget 512), the targets, the largest batches under ``mem_cap_gb`` and the plot. A JSON-ready dict."""
    plan = target_plan() if targets else make_plan(lengths, batches, policies)
    budget = TARGET_BUDGET if targets else budget
    tokens = prompt_tokens(tokenizer, max(point.prompt for point, _ in plan))
    per_run = reset_peak_rss()
    load = os.getloadavg()[0]
    cells, skipped = run_bench(model, tokens, plan, budget, repeats, progress)
    result: dict[str, Any] = {
        "model": title,
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "load_avg": load,
        "budget": budget,
        "repeats": repeats,
        "rss_method": "reset before each run (malloc_trim + clear_refs)" if per_run else "process peak so far",
        "cells": [c.to_dict() for c in cells],
        "skipped": skipped,
        "targets": [t.to_dict() for t in evaluate_targets(cells)],
    }
    if mem_cap_gb is not None:
        result["max_batch"] = max_batches(model, tokens, cells, mem_cap_gb * 2**30, budget)
    if plot is not None:
        result["plot"] = str(plot_decode(cells, plot, title))
    return result


# -- the largest batch under a memory cap (the H2O paper's Table 3 idea) ----------------------------------------


def max_batches(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    cells: Sequence[Cell],
    cap_bytes: float,
    budget: Budget = DEFAULT_BUDGET,
) -> list[dict[str, Any]]:
    """For every policy but the floor, at the longest (prompt + gen) measured: the largest batch under ``cap_bytes``
    predicted by a :class:`MemoryModel` fitted on its cells' medians (every batch size measured there), then — if it is
    expected to fit in the available memory and take at most :data:`VERIFY_MAX_S` — verified by a run of that batch
    (prefill + :data:`VERIFY_STEPS` decode steps) whose peak RSS is compared with the cap."""
    if not cells:
        return []
    longest = max(cells, key=lambda c: (c.prompt_tokens + c.gen_tokens, c.prompt_tokens))
    weights = model_nbytes(model)
    rows = []
    for name in dict.fromkeys(c.policy for c in cells if c.policy != FLOOR):
        group = [
            c
            for c in cells
            if c.policy == name and (c.prompt_tokens, c.gen_tokens) == (longest.prompt_tokens, longest.gen_tokens)
        ]
        if not group:
            continue
        mem = MemoryModel.fit(
            weights,
            [
                MemSample(
                    c.batch, (c.peak_rss_mb - c.rss_growth_mb) * MIB, c.peak_rss_mb * MIB, c.kv_bytes, c.tokens_held
                )
                for c in group
            ],
        )
        batch = mem.max_batch(cap_bytes)
        row: dict[str, Any] = {
            "policy": name,
            "budget_tokens": group[0].budget_tokens,
            "prompt_tokens": longest.prompt_tokens,
            "gen_tokens": longest.gen_tokens,
            "cap_mb": cap_bytes / MIB,
            "model_mb": mem.model_bytes / MIB,
            "runtime_mb": mem.runtime_bytes / MIB,
            "kv_bytes_per_token": mem.kv_bytes_per_token,
            "tokens_held": mem.tokens_held,
            "act_mb_per_seq": mem.act_bytes_per_seq / MIB,
            "max_batch": batch,
            "predicted_peak_mb": mem.peak(batch) / MIB,
            "verified_peak_mb": None,
            "verified": None,
            "note": "",
        }
        seconds = batch * max(c.prefill_s / c.batch for c in group)  # the prefill dominates a verification run
        current, _ = rss_bytes()
        if batch == 0:
            row["note"] = "not even one sequence fits under the cap"
        elif mem.peak(batch) - current > 0.8 * available_bytes():
            row["note"] = "not verified: the batch would not fit in this machine's available memory"
        elif seconds > VERIFY_MAX_S:
            row["note"] = f"not verified: the run would take about {seconds:.0f} s"
        else:
            point = GridPoint(longest.prompt_tokens, VERIFY_STEPS + 1, batch)
            ids = _rows(tokens, point, model.device)
            run = measure(model, name, resolve_budget(budget, point.prompt), ids, point.gen)
            row["verified_peak_mb"] = run.peak_rss / MIB
            row["verified"] = run.peak_rss <= cap_bytes
        rows.append(row)
    return rows


# -- targets -----------------------------------------------------------------------------------------------------


@dataclass
class Target:
    """One of the issue's targets: the measured figures and whether it is met (None: not measured)."""

    target: str
    measured: str
    met: bool | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _find(cells: Sequence[Cell], **where: Any) -> list[Cell]:
    return [c for c in cells if all(getattr(c, k) == v for k, v in where.items())]


def _target(text: str, checks: list[tuple[str, bool]]) -> Target:
    if not checks:
        return Target(text, "not measured (run `kvsieve bench --targets`)", None)
    return Target(text, "; ".join(m for m, _ in checks), all(ok for _, ok in checks))


def _ratio_checks(cells: Sequence[Cell], ref: str, metric: str, ok: Callable[[float], bool]) -> list[tuple[str, bool]]:
    out = []
    for c in cells:
        value = c.ratios[f"vs_{ref}"][metric]
        out.append((f"{c.policy} {c.prompt_tokens}+{c.gen_tokens} b{c.batch}: {value:.2f}x", bool(ok(value))))
    return out


def _growth_by_prompt(cells: Sequence[Cell]) -> dict[int, float]:
    """Peak RSS growth (MiB) of batch-1 cells by prompt length (the largest where several cells share one)."""
    growth: dict[int, float] = {}
    for c in cells:
        if c.batch == 1:
            growth[c.prompt_tokens] = max(growth.get(c.prompt_tokens, 0.0), c.rss_growth_mb)
    return growth


def evaluate_targets(cells: Sequence[Cell], budget: int = TARGET_BUDGET) -> list[Target]:
    """The issue's five targets, from whatever cells were measured (cells that evict, i.e. hold fewer tokens than
    they see, count for the ratios to the floor)."""
    evicting = [c for c in cells if c.budget_tokens == budget and c.prompt_tokens + c.gen_tokens - 1 > budget]
    h2o = _find(evicting, policy="h2o")
    long_h2o = [c for c in h2o if c.prompt_tokens >= 7936]
    t3 = _ratio_checks(long_h2o, DYNAMIC, "prefill_s", lambda v: v <= 1.5)
    growth = _growth_by_prompt(h2o)
    if len(growth) > 1:
        # Up to ~2k tokens the attention's row block (BLOCK_ELEMENTS) still grows with n²; from there on the peak
        # must grow at most linearly: compared between the two longest prompts.
        (n1, g1), (n2, g2) = sorted(growth.items())[-2:]
        sdpa = _growth_by_prompt(_find(cells, policy=DYNAMIC))
        shown = ", ".join(
            f"{n}: {g:.0f} MiB" + (f" (sdpa {sdpa[n]:.0f})" if n in sdpa else "") for n, g in sorted(growth.items())
        )
        t3.append((f"h2o peak RSS growth by prompt {shown}", g2 / max(g1, 1.0) <= 1.25 * n2 / n1))
    kv = []
    for c in cells:
        full = _find(cells, policy=DYNAMIC, prompt_tokens=c.prompt_tokens, gen_tokens=c.gen_tokens, batch=c.batch)
        held = c.prompt_tokens + c.gen_tokens - 1
        if c.policy in REFERENCES or c.budget_tokens is None or c.budget_tokens >= held or not full:
            continue
        ratio = c.kv_bytes / (full[0].kv_bytes * c.budget_tokens / held)
        kv.append(
            (
                f"{c.policy} {c.prompt_tokens}+{c.gen_tokens} b{c.batch}: {ratio:.3f}x "
                f"(state {c.state_bytes / MIB:.2f} MiB)",
                abs(ratio - 1) <= 0.02,
            )
        )
    no_attention = [c for c in evicting if c.policy in NO_ATTENTION]
    return [
        _target(
            f"(1) h2o decode step at budget {budget} <= 1.10x floor's",
            _ratio_checks(h2o, FLOOR, "step_ms_p50", lambda v: v <= 1.10),
        ),
        _target(
            f"(2) 7936-token prompt: h2o (budget {budget}) decode tok/s >= 1.6x DynamicCache",
            _ratio_checks(long_h2o, DYNAMIC, "decode_tok_s", lambda v: v >= 1.6),
        ),
        _target(
            "(3) 7936-token prefill with h2o <= 1.5x plain sdpa prefill; peak RSS growth at most linear in n",
            t3,
        ),
        _target("(4) KV bytes held = budget/length x full bytes +-2% (policy state separate)", kv),
        _target(
            "(5) policies without attention probabilities: decode step <= 1.05x floor's",
            _ratio_checks(no_attention, FLOOR, "step_ms_p50", lambda v: v <= 1.05),
        ),
    ]


# -- plot, profile, report ---------------------------------------------------------------------------------------


def plot_decode(cells: Sequence[Cell], path: str | Path, title: str = "") -> Path:
    """Decode tokens/s vs context length (prompt tokens), one line per policy, one panel per batch size. Where a
    prompt length was measured with several generation lengths, the longest generation is plotted."""
    plt = pyplot()
    batches = sorted({c.batch for c in cells})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for name in dict.fromkeys(c.policy for c in cells):
            best: dict[int, Cell] = {}
            for c in _find(cells, policy=name, batch=batch):
                if c.prompt_tokens not in best or c.gen_tokens > best[c.prompt_tokens].gen_tokens:
                    best[c.prompt_tokens] = c
            xs = sorted(best)
            style = "--" if name in REFERENCES else "-"
            ax.plot(xs, [best[x].decode_tok_s for x in xs], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        prompts = sorted({c.prompt_tokens for c in _find(cells, batch=batch)})
        ax.set_xticks(prompts, [str(p) for p in prompts])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context length (prompt tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {batch}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


@torch.inference_mode()
def profile_decode(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    policy: str = "h2o",
    budget: int = TARGET_BUDGET,
    prompt: int = PROFILE_PROMPT,
    steps: int = 16,
    top: int = 25,
) -> dict[str, Any]:
    """Top ops (by self CPU time) of ``steps`` decode steps of ``policy`` after a ``prompt``-token prefill."""
    from torch.profiler import ProfilerActivity, profile

    cache = new_cache(model, policy, budget)
    token = _next_token(model, cache, _rows(tokens, GridPoint(prompt, steps, 1), model.device))
    for _ in range(4):  # past the first evictions
        token = _next_token(model, cache, token)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            token = _next_token(model, cache, token)
    wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return {
        "policy": policy,
        "budget_tokens": budget,
        "prompt_tokens": prompt,
        "steps": steps,
        "step_ms_profiled": wall / steps * 1e3,
        "op_calls_per_step": sum(e.count for e in events) / steps,
        "ops": [
            {
                "op": e.key,
                "calls_per_step": e.count / steps,
                "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                "total_ms_per_step": e.cpu_time_total / 1e3 / steps,
                "self_share": e.self_cpu_time_total / total,
            }
            for e in events[:top]
        ],
    }


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_report(result: dict[str, Any]) -> str:
    """The result of ``kvsieve bench`` as plain text (cells, skipped points, largest batches, targets, profile)."""
    lines = []
    if "profile" in result:
        p = result["profile"]
        lines.append(
            f"{p['policy']} decode step, budget {p['budget_tokens']}, after a {p['prompt_tokens']}-token prompt: "
            f"{p['step_ms_profiled']:.2f} ms/step under the profiler ({p['steps']} steps), "
            f"{p['op_calls_per_step']:.0f} op calls/step"
        )
        body = [
            [o["op"], f"{o['calls_per_step']:.1f}", f"{o['self_ms_per_step']:.3f}", f"{o['total_ms_per_step']:.3f}",
             f"{o['self_share']:.1%}"]
            for o in p["ops"]
        ]  # fmt: skip
        lines += _table(["op", "calls/step", "self ms/step", "total ms/step", "self share"], body)
        return "\n".join(lines)
    body = []
    for c in result["cells"]:
        floor, full = c["ratios"].get(f"vs_{FLOOR}"), c["ratios"].get(f"vs_{DYNAMIC}")
        body.append(
            [
                f"{c['prompt_tokens']}+{c['gen_tokens']}",
                str(c["batch"]),
                c["policy"],
                "all" if c["budget_tokens"] is None else str(c["budget_tokens"]),
                f"{c['prefill_s']:.3f}",
                f"{c['decode_tok_s']:.1f}",
                f"{c['throughput_tok_s']:.1f}",
                f"{c['step_ms_p50']:.2f}",
                f"{c['step_ms_p90']:.2f}",
                "" if floor is None else f"{floor['step_ms_p50']:.2f}x",
                "" if full is None else f"{full['decode_tok_s']:.2f}x",
                f"{c['peak_rss_mb']:.0f}",
                f"{c['rss_growth_mb']:.0f}",
                f"{c['kv_bytes'] / MIB:.2f}",
                f"{c['state_bytes'] / MIB:.2f}",
            ]
        )
    header = ["cell", "batch", "policy", "budget", "prefill s", "decode tok/s", "e2e tok/s", "step p50 ms",
              "p90 ms", "step/floor", "tok/s/full", "peak RSS MB", "growth MB", "KV MiB", "state MiB"]  # fmt: skip
    lines += _table(header, body)
    lines += [f"skipped {s['prompt_tokens']}+{s['gen_tokens']} b{s['batch']}: {s['reason']}" for s in result["skipped"]]
    for row in result.get("max_batch", []):
        verified = "" if row["verified"] is None else f", verified peak {row['verified_peak_mb']:.0f} MiB"
        verdict = "" if row["verified"] is None else (" (fits)" if row["verified"] else " (EXCEEDS the cap)")
        lines.append(
            f"largest batch under {row['cap_mb']:.0f} MiB at {row['prompt_tokens']}+{row['gen_tokens']}: "
            f"{row['policy']} {row['max_batch']} (predicted peak {row['predicted_peak_mb']:.0f} MiB{verified}{verdict})"
            + (f" [{row['note']}]" if row["note"] else "")
        )
    lines.append("targets:")
    for t in result["targets"]:
        mark = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        lines.append(f"  [{mark}] {t['target']}: {t['measured']}")
    lines.append(
        f"(medians of {result['repeats']} rounds, decode steps in lockstep; {result['threads']} torch threads on "
        f"{result['device']}, load average {result['load_avg']:.1f} at the start; peak RSS per run: "
        f"{result['rss_method']})"
    )
    return "\n".join(lines)
