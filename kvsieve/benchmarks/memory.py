"""Memory of a run: resident memory (current, peak, its reset between runs), available memory, the bytes of caches and
models, and the :class:`MemoryModel` of a run's peak fitted on measured runs."""

from __future__ import annotations

import ctypes
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from kvsieve.engine.quant import Codec

MIB = 2**20


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


def held_kv_bytes(model: PreTrainedModel, slots: int, codec: Codec, batch: int = 1) -> int:
    """K/V bytes of a cache whose every layer holds ``slots`` slots per row and KV head stored as ``codec`` (plain, or
    quantized: codes, float16 scales and zeros, and the residual's exact copies; see :mod:`kvsieve.engine.quant`)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    kv_heads = config.num_key_value_heads
    per_row = kv_heads * slots * codec.slot_bytes(head_dim, dtype) + codec.fixed_bytes(head_dim, dtype, kv_heads)
    return batch * config.num_hidden_layers * per_row


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
