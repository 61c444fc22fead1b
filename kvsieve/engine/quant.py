"""How a layer's slots hold keys and values: as they are (:data:`PLAIN`), or as packed integer codes
(:class:`KVQuant`, ``make_cache(..., kv_bits=8|4|2)``).

Quantized slots (the choices; how to measure them: docs/quantized.md):

- **Per token, in groups of channels.** A slot holds one token, so each token's key and value vectors are quantized
  on their own, in groups of ``group_size`` consecutive channels, asymmetric (``x ≈ zero + code · scale``). KIVI
  groups keys per *channel* (a group spans tokens); that does not compose with per-slot eviction: a victim's slot
  receives the next token, whose key would be coded with the old group's scale (clipped) or the whole group coded
  again. Per-token groups make every slot independent: eviction, the stale-slot write, gathers and batch operations
  move codes like any other per-slot tensor.
- **Codes** are ``uint8``, ``8 / bits`` codes per byte (planar: with ``W`` code bytes per token, byte ``j`` holds
  elements ``j``, ``j + W``, …, the first in the low bits); **scale and zero** are float16, one pair per group. A
  token's key and value are coded as one vector (one pass for both; groups never straddle them), its codes, scales
  and zeros one byte row of its slot. The zero (the group minimum) is rounded
  down and the scale up to float16, so the group's range is covered: every element is within ``scale / 2`` of its
  dequantized value.
- **Residual.** The ``residual`` newest positions of each row also keep exact copies (a ring indexed by position
  modulo ``residual``, in the model's dtype, plus one slot that receives padding): a query at position ``p`` reads
  the token at ``x`` exactly when ``p - x < residual``, dequantized otherwise. It is a rule by positions, so a
  step's tokens see one another as if fed one at a time, and streaming a sequence in one pass stays equal to feeding
  it token by token. A step of several tokens codes them when it stores them; a token fed alone is stored without
  codes and coded from its exact copy once the oldest such token leaves the residual, ``residual`` tokens at a time
  (codes depend on the token alone, so when they are made changes nothing; tokens are never coded again).
- **Defaults** (``group_size=32``, ``residual=16``), measured on SmolLM2-135M (fp32), h2o at 20 % of 1,024 tokens of
  Wikipedia, one-pass streaming perplexity (unquantized 20.01): 4-bit 20.67 without a residual, 19.98 with 16,
  20.04 with 32, 19.94 with 128; groups of 64 channels: 20.59 (residual 16), 20.36 (32); 8-bit 20.00 (groups of 64,
  no residual). 2-bit is where per-token keys fail (KIVI's finding): 159.7 without a residual, 37.4 with 32, 25.2
  with 128. Measured and not kept: dividing each key channel by a calibrated scale before coding (the channel's
  absolute maximum over 512 tokens of another article, shared by each RoPE pair of channels; KIVI's per-channel
  remedy in a form that composes with eviction): 2-bit / residual 32 149.4 (scale^0.5: 33.8), 2-bit without a
  residual 417.3 (111.7), 4-bit without a residual 21.45 (20.92) — small gains at 2 bits, losses at 4.
- Policies see the slots as the newest token does (:meth:`~kvsieve.engine.storage.SlotStore.view`): dequantized,
  the residual exact. A policy's per-slot state computed at storage (``initial_state``, e.g. knorm's key norm) uses
  the exact key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

BITS = (2, 4, 8)
TOWARD = {  # (what float16 values are rounded toward)
    "up": torch.tensor(float("inf"), dtype=torch.float16),
    "down": torch.tensor(float("-inf"), dtype=torch.float16),
}
QUANT_KEYS = ("kv_bits", "group_size", "residual")
"""The arguments of :func:`kv_quant` (``make_cache``'s, or keys of a policy spec: ``"h2o:kv_bits=4"``)."""


class Codec(Protocol):
    """How keys and values are held in slot tensors (each ``[B, H, slots, ...]``)."""

    residual: int

    def names(self) -> tuple[str, ...]:
        """The slot tensors' names."""

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """The slot tensors of tokens ``keys``/``values`` ``[B, H, q, D]``."""

    def decode(self, kv: dict[str, torch.Tensor], n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, n, D]`` of the first ``n`` slots."""

    def head_dim(self, kv: dict[str, torch.Tensor]) -> int:
        """The head dimension of the tokens held."""

    def slot_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one slot's key and value (one KV head)."""

    def fixed_bytes(self, head_dim: int, dtype: torch.dtype, kv_heads: int) -> int:
        """Bytes held per batch row whatever the slots (the residual's exact copies and its mark)."""


class Plain:
    """Keys and values held as they are (``keys``, ``values``): decoding is slicing."""

    residual = 0

    def names(self) -> tuple[str, ...]:
        return ("keys", "values")

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys, "values": values}

    def decode(self, kv: dict[str, torch.Tensor], n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = kv["keys"], kv["values"]
        if n == keys.shape[2]:  # (every slot: a decode step at the budget reads the buffers as they are)
            return keys, values
        return keys[:, :, :n], values[:, :, :n]

    def head_dim(self, kv: dict[str, torch.Tensor]) -> int:
        return kv["keys"].shape[-1]

    def slot_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * head_dim * dtype.itemsize

    def fixed_bytes(self, head_dim: int, dtype: torch.dtype, kv_heads: int) -> int:
        return 0

    def __repr__(self) -> str:
        return "Plain()"


PLAIN = Plain()


@dataclass(frozen=True)
class KVQuant:
    """Quantized slots (see the module docstring): ``bits`` per element, ``group_size`` channels per scale/zero pair,
    exact copies of the ``residual`` newest positions of each row."""

    bits: int
    group_size: int = 32
    residual: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in BITS:
            choices = ", ".join(map(str, BITS))
            raise ValueError(f"kv_bits must be one of {choices} (or None: not quantized), got {self.bits!r}")
        for name in ("group_size", "residual"):
            value = getattr(self, name)
            low = 1 if name == "group_size" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.group_size % (8 // self.bits):
            raise ValueError(f"group_size must be a multiple of {8 // self.bits} for {self.bits}-bit codes")

    def check(self, head_dim: int) -> None:
        """Refuse a head dimension the groups do not divide."""
        if head_dim % self.group_size:
            raise ValueError(
                f"group_size {self.group_size} does not divide the model's head dimension {head_dim}; pick a divisor"
            )

    def names(self) -> tuple[str, ...]:
        return ("codes",)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        # A token's key and value are one vector of 2·D channels (groups never straddle them: D % group == 0), coded
        # in one pass.
        return self.encode_both(torch.cat([keys, values], dim=-1))

    def encode_both(self, both: torch.Tensor) -> dict[str, torch.Tensor]:
        """The slot tensor of tokens whose keys and values are ``both`` ``[B, H, q, 2·D]``: one row of bytes per
        token, its packed codes, then its float16 scales, then its zeros (one tensor: one write per step)."""
        codes, scale, zero = quantize(both, self.bits, self.group_size)
        return {"codes": torch.cat([codes, scale.view(torch.uint8), zero.view(torch.uint8)], dim=-1)}

    def decode(self, kv: dict[str, torch.Tensor], n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return split(self.decode_both(kv, n, dtype))

    def decode_both(self, kv: dict[str, torch.Tensor], n: int, dtype: torch.dtype) -> torch.Tensor:
        """Keys and values of the first ``n`` slots as one ``[B, H, n, 2·D]`` tensor."""
        row = kv["codes"][:, :, :n]
        end = 2 * self.head_dim(kv) * self.bits // 8  # (the codes' bytes)
        scales = row[..., end:].view(torch.float16)  # (2·D / group_size scales, then as many zeros)
        scale, zero = scales.tensor_split(2, dim=-1)
        return dequantize(row[..., :end], scale, zero, self.bits, dtype)

    def head_dim(self, kv: dict[str, torch.Tensor]) -> int:
        return kv["codes"].shape[-1] * 4 * self.group_size // (self.bits * self.group_size + 32)

    def slot_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * head_dim * self.bits // 8 + 2 * (2 * head_dim // self.group_size) * 2  # codes, fp16 scales, zeros

    def fixed_bytes(self, head_dim: int, dtype: torch.dtype, kv_heads: int) -> int:
        if not self.residual:
            return 0
        return kv_heads * (self.residual + 1) * 2 * head_dim * dtype.itemsize + torch.long.itemsize  # (+ the mark)


_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_integers(t: torch.Tensor) -> torch.Tensor:
    """``t`` seen as integers of its element size (a view; ``t`` itself unless floating point), to move slots bit
    for bit: on the CPU torch's scatter and gather of bf16 and fp16 run several times slower than of integers (one
    decode token's keys: about 60 µs against 3)."""
    return t.view(_INTEGERS[t.element_size()]) if t.is_floating_point() else t


def split(both: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (views) of ``both`` ``[..., 2·D]``."""
    return both.tensor_split(2, dim=-1)


def kv_quant(kv_bits: Any = None, group_size: Any = None, residual: Any = None) -> KVQuant | None:
    """The slot quantization asked for (None: plain slots); values may be text (from a spec or the command line)."""
    given = {"group_size": group_size, "residual": residual}
    if kv_bits in (None, "none", "None"):
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(f"{' and '.join(extra)} apply to quantized slots only: give kv_bits too")
        return None
    values = {"bits": kv_bits, **{name: value for name, value in given.items() if value is not None}}
    for name, value in values.items():
        if isinstance(value, str):
            try:
                values[name] = int(value)
            except ValueError:
                raise ValueError(f"{'kv_bits' if name == 'bits' else name} must be an integer, got {value!r}") from None
    return KVQuant(**values)


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` → packed codes ``[..., D · bits / 8]`` (uint8), scale and zero ``[..., D / group]``
    (float16): asymmetric, per group of ``group`` consecutive elements (see the module docstring)."""
    levels = (1 << bits) - 1
    g = x.float().unflatten(-1, (-1, group))
    low, high = torch.aminmax(g, dim=-1)
    zero = _to_half(low, up=False)
    zero_f = zero.float()
    scale = _to_half(high.sub_(zero_f).div_(levels), up=True)  # (> 0: a constant group gets the least float16)
    codes = g.sub(zero_f[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, levels)
    return _pack(codes.to(torch.uint8).flatten(-2), bits), scale, zero


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """The values of :func:`quantize`'s output, in ``dtype``."""
    precision = torch.promote_types(dtype, torch.float32)
    out = _unpack(codes, bits, precision)
    grouped = out.view(*scale.shape, -1)
    grouped.mul_(scale.to(precision)[..., None]).add_(zero.to(precision)[..., None])
    return out.to(dtype)


def _to_half(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` (float32) in float16, on the side of ``x`` asked for: the nearest float16, moved one step that way
    (one step coarser at most; two operations instead of a comparison and a choice)."""
    return torch.nextafter(x.to(torch.float16), TOWARD["up" if up else "down"].to(x.device))


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Planar: with ``p = 8 / bits`` codes per byte, byte ``j`` holds the codes of elements ``j``, ``j + D/p``, …
    (the first in the low bits), so unpacking writes ``p`` contiguous runs."""
    parts = codes.tensor_split(8 // bits, dim=-1)
    packed = parts[0].clone()
    for i, part in enumerate(parts[1:], start=1):
        packed |= part << (bits * i)
    return packed


def _unpack(packed: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The codes of :func:`_pack`'s bytes, as ``dtype``."""
    per, mask = 8 // bits, (1 << bits) - 1
    width = packed.shape[-1]
    out = packed.new_empty((*packed.shape[:-1], width * per), dtype=dtype)
    for i in range(per):
        shifted = packed >> (bits * i) if i else packed
        out[..., i * width : (i + 1) * width] = shifted & mask if i < per - 1 else shifted
    return out


@dataclass
class Residual:
    """Exact copies of each row's ``size`` newest tokens (keys and values as one ``[B, H, size + 1, 2·D]`` tensor), at
    index ``position mod size`` (padding: index ``size``). Single-token steps store their token without codes: it is
    coded from here once older tokens are due (:meth:`~kvsieve.engine.storage.SlotStore.code_pending`), ``size``
    tokens at a time."""

    kv: torch.Tensor
    size: int
    coded: torch.Tensor | None = None
    """``[B]``: each row's tokens at positions from ``coded`` on may be held without codes."""
    steps: int | None = 0
    """Known on the host: every row holds its ``steps`` newest tokens without codes, each stored by a single-token
    step in which every row got a real token, and all older ones coded (so a decode step knows when tokens are due
    without reading ``coded``: no device-to-host copy). None: rows may differ (after a padded step or a join)."""
    first_rows: torch.Tensor | None = None
    """``[B, H, 1]``: the first row of each (batch row, head)'s ring in the flattened tensor."""

    def __post_init__(self) -> None:
        bsz, heads, slots = self.kv.shape[:3]
        self.first_rows = torch.arange(0, bsz * heads * slots, slots, device=self.kv.device).view(bsz, heads, 1)
        if self.coded is None:
            self.coded = torch.zeros(bsz, dtype=torch.long, device=self.kv.device)

    @classmethod
    def empty(cls, both: torch.Tensor, size: int) -> Residual:
        """A ring for tokens like ``both`` ``[B, H, q, 2·D]``."""
        return cls(both.new_zeros((*both.shape[:2], size + 1, both.shape[-1])), size)

    def rows(self, pos: torch.Tensor) -> torch.Tensor:
        """The rows of the ring (flattened over batch and heads) holding positions ``pos`` ``[B, H, n]``."""
        return torch.where(pos >= 0, pos % self.size, self.size).add_(self.first_rows).flatten()

    def read(self, pos: torch.Tensor) -> torch.Tensor:
        """Keys and values ``[B, H, N, 2·D]`` held for positions ``pos`` ``[B, H, N]`` (meaningful for the newest
        ``size`` positions of each row only)."""
        return self.kv.flatten(0, 2).index_select(0, self.rows(pos)).view(*pos.shape, -1)

    def restore_exact(self, decoded: torch.Tensor, pos: torch.Tensor, last: torch.Tensor) -> None:
        """In place: the rows of ``decoded`` ``[B, H, N, 2·D]`` (slots at positions ``pos`` ``[B, H, N]``) that a query
        at ``last`` ``[B]`` reads exactly (:func:`recent`) get their exact copies. Those are among each (row, head)'s
        ``size`` newest slots, so the shapes do not depend on the values (no device-to-host copy)."""
        newest, slots = pos.topk(min(self.size, pos.shape[-1]), dim=-1, sorted=False)
        slots = slots[..., None].expand(-1, -1, -1, decoded.shape[-1])
        exact = recent(newest, last, self.size)[..., None]
        held = as_integers(decoded)
        held.scatter_(2, slots, torch.where(exact, as_integers(self.read(newest)), held.gather(2, slots)))

    def write(self, both: torch.Tensor, pos: torch.Tensor) -> None:
        """Hold the newest of tokens ``both`` ``[B, H, q, 2·D]`` at positions ``pos`` ``[B, H, q]``."""
        last = min(pos.shape[-1], self.size)
        self.kv.flatten(0, 2).index_copy_(0, self.rows(pos[:, :, -last:]), both[:, :, -last:].flatten(0, 2))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Residual:
        """The ring with ``fn`` (a batch operation, a copy) applied to its tensor."""
        return Residual(fn(self.kv).contiguous(), self.size, fn(self.coded), steps=self.steps)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.coded.nbytes


def past(pos: torch.Tensor) -> torch.Tensor:
    """``[B]``: one past each row's newest position in ``pos`` ``[B, H, n]`` (``n > 0``; 0 for a row of padding)."""
    return pos.amax(dim=(1, 2)).add(1).clamp_(min=0)


def recent(pos: torch.Tensor, last: torch.Tensor, residual: int) -> torch.Tensor:
    """``[B, H, N]`` (for ``last`` ``[B]``) or ``[B, H, q, N]`` (for ``last`` ``[B, q]``, a step's queries): whether
    the token at ``pos`` ``[B, H, N]`` is read exactly by a query at ``last`` (within the residual)."""
    if last.dim() == 1:
        return (pos > (last - residual)[:, None, None]) & (pos >= 0)
    key = pos[:, :, None, :]
    return (key > (last - residual)[:, None, :, None]) & (key >= 0)
