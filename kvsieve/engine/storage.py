"""The slots of one cache layer: keys, values, each slot's original position and the policy's per-slot state.

Buffers are ``[batch, kv_heads, capacity, ...]``; the first ``used`` slots are in use. The slot count is shared by
the layer, but every (batch row, KV head) keeps its own token set: slot ``s`` of row ``b`` and head ``h`` holds the
token at original position ``positions[b, h, s]`` (-1 = empty or padding). Per-slot state moves with its token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from kvsieve.policies import Slots

GROWTH = 64  # minimum slots added when a buffer grows
StateSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class SlotStore:
    """One layer's slots (see the module docstring). Eviction keeps at most ``limit`` slots allocated."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    state: dict[str, torch.Tensor]
    limit: int | float
    """Most slots kept allocated between steps (``budget + 1``; unbounded: inf)."""
    used: int = 0
    stale: torch.Tensor | None = None
    """``[B, H, 1]``: the slot of the last decode step's victim, still counted in ``used``; the next token is
    written into it (no copy of the cache)."""
    may_hold_padding: bool = False
    """Whether slots in use may hold padding (position -1)."""

    @classmethod
    def empty(cls, keys: torch.Tensor, values: torch.Tensor, state: StateSpec, limit: int | float) -> SlotStore:
        """Empty buffers for tokens like ``keys``/``values`` ``[B, H, q, D]``, with the per-slot ``state``."""
        bsz, heads = keys.shape[:2]
        return cls(
            keys=keys.new_empty((bsz, heads, 0, keys.shape[-1])),
            values=values.new_empty((bsz, heads, 0, values.shape[-1])),
            positions=torch.empty((bsz, heads, 0), dtype=torch.long, device=keys.device),
            state={
                name: torch.zeros((bsz, heads, 0, *extra), dtype=dtype, device=keys.device)
                for name, (extra, dtype) in state.items()
            },
            limit=limit,
        )

    @property
    def capacity(self) -> int:
        """Allocated slots."""
        return self.keys.shape[2]

    @property
    def held(self) -> int:
        """Tokens held (the stale slot excluded)."""
        return self.used - (self.stale is not None)

    def view(self, last: torch.Tensor) -> Slots:
        """The policy's view of the slots in use (during a step every one holds a token or padding); ``last``:
        each row's newest position."""
        return Slots(self.positions, self.state, last, self.keys, self.values).prefix(self.used)

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, initial: dict[str, torch.Tensor]
    ) -> int | None:
        """Store ``q`` new tokens (``keys``/``values`` ``[B, H, q, D]``, ``positions`` ``[B, H, q]``, ``initial``
        state): a single token takes the stale slot (None is returned), else they go at the end (the slot of the
        first is returned)."""
        if self.stale is None:
            self.reserve(self.used + keys.shape[2])
        others = [(self.positions, positions), *((t, initial.get(name, 0)) for name, t in self.state.items())]
        if self.stale is not None:  # (a single token: compact() runs before a step of several)
            _write_slot(self.keys, self.values, others, self.stale, keys, values)
            self.stale = None
            return None
        start = self.used
        self.used += keys.shape[2]
        self.keys[:, :, start : self.used] = keys
        self.values[:, :, start : self.used] = values
        for t, new in others:
            t[:, :, start : self.used] = new
        return start

    def reserve(self, needed: int) -> None:
        """Grow the buffers to hold ``needed`` slots (by at least :data:`GROWTH`, never past ``limit``)."""
        if needed > self.capacity:
            grown = grown_capacity(needed, self.limit)
            used = self.used
            self._map(lambda t: _resized(t, grown, used))

    def compact(self) -> None:
        """Close the stale slot by moving the last slot into it."""
        _move_slot(self.keys, self.values, [self.positions, *self.state.values()], self.used - 1, self.stale)
        self.used -= 1
        self.stale = None

    def drop(self, victim: torch.Tensor, leave_stale: bool) -> None:
        """Evict one slot per (row, head), ``victim`` ``[B, H, 1]``: leave it stale for the next token, or move the
        last slot into it."""
        if leave_stale:
            self.stale = victim
            return
        _move_slot(self.keys, self.values, [self.positions, *self.state.values()], self.used - 1, victim)
        self.used -= 1

    def keep(self, chosen: torch.Tensor) -> None:
        """Keep only the slots ``chosen`` ``[B, H, k]`` (in slot order), gathered into buffers of ``limit`` slots."""
        self._map(lambda t: _gathered(t, chosen, int(self.limit)))
        self.used = chosen.shape[2]

    def settle(self) -> None:
        """After an eviction: whether padding may still be held."""
        if self.may_hold_padding:
            self.may_hold_padding = bool((self.positions[:, :, : self.used] < 0).any())

    def held_positions(self) -> torch.Tensor:
        """``[B, H, tokens held]`` positions of the held tokens, in slot order (-1 = padding)."""
        pos = self.positions[:, :, : self.used]
        if self.stale is None:
            return pos.clone()
        held = torch.ones_like(pos, dtype=torch.bool).scatter_(2, self.stale, False)
        return pos[held].view(*pos.shape[:2], self.used - 1)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation (reorder, repeat, select rows) to every buffer."""
        if self.stale is not None:
            self.compact()
        self._map(fn)

    @classmethod
    def concat(cls, stores: Sequence[SlotStore]) -> SlotStore:
        """The rows of ``stores`` (of layers with the same slot limit and state) in one store: each row keeps its
        slots in their order; a row that uses fewer slots than the most is padded with empty slots (position -1)."""
        if len({store.limit for store in stores}) != 1 or len({tuple(store.state) for store in stores}) != 1:
            raise ValueError("only stores of the same slot limit and policy state can be joined")
        for store in stores:
            if store.stale is not None:
                store.compact()
        used = max(store.used for store in stores)
        capacity = max(store.capacity for store in stores)

        def joined(pick: Callable[[SlotStore], torch.Tensor], fill: int) -> torch.Tensor:
            return torch.cat([_padded(pick(store), capacity, store.used, fill) for store in stores])

        return cls(
            keys=joined(lambda store: store.keys, 0),
            values=joined(lambda store: store.values, 0),
            positions=joined(lambda store: store.positions, -1),
            state={name: joined(lambda store, name=name: store.state[name], 0) for name in stores[0].state},
            limit=stores[0].limit,
            used=used,
            may_hold_padding=any(store.may_hold_padding or store.used < used for store in stores),
        )

    def copy(self) -> SlotStore:
        """A deep copy (to restore later)."""
        return replace(
            self,
            keys=self.keys.clone(),
            values=self.values.clone(),
            positions=self.positions.clone(),
            state={name: t.clone() for name, t in self.state.items()},
            stale=None if self.stale is None else self.stale.clone(),
        )

    def kv_nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return self.keys.nbytes + self.values.nbytes

    def state_nbytes(self) -> int:
        """Bytes allocated for positions and policy state."""
        return self.positions.nbytes + sum(t.nbytes for t in self.state.values())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values, self.positions = fn(self.keys), fn(self.values), fn(self.positions)
        self.state = {name: fn(t) for name, t in self.state.items()}


def grown_capacity(needed: int, limit: int | float) -> int:
    """The slots a buffer grows to when ``needed`` slots do not fit: at least :data:`GROWTH` (or a quarter) more,
    never past ``limit`` (nor below ``needed``)."""
    return int(max(needed, min(needed + max(GROWTH, needed // 4), limit)))


def _padded(t: torch.Tensor, capacity: int, used: int, fill: int) -> torch.Tensor:
    """``t``'s first ``used`` slots in a buffer of ``capacity`` slots, the others ``fill``."""
    out = t.new_full((t.shape[0], t.shape[1], capacity, *t.shape[3:]), fill)
    out[:, :, :used] = t[:, :, :used]
    return out


def _resized(t: torch.Tensor, capacity: int, n: int) -> torch.Tensor:
    out = t.new_empty((t.shape[0], t.shape[1], capacity, *t.shape[3:]))
    out[:, :, :n] = t[:, :, :n]
    return out


def _gathered(t: torch.Tensor, index: torch.Tensor, capacity: int) -> torch.Tensor:
    out = t.new_empty((t.shape[0], t.shape[1], capacity, *t.shape[3:]))
    out[:, :, : index.shape[2]] = t.gather(2, _state_index(index, t))
    return out


def _state_index(index: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``index`` ``[B, H, k]`` expanded over the trailing dimensions of the slot tensor ``t``."""
    if t.dim() == 3:
        return index
    return index.view(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])


def _write_slot(
    keys: torch.Tensor,
    values: torch.Tensor,
    others: Iterable[tuple[torch.Tensor, torch.Tensor | int]],
    slot: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
) -> None:
    """In place: write one token per (row, head) into slot ``slot[b, h, 0]`` of the keys, the values and each
    ``(slot tensor, new entry)`` of ``others`` (positions, policy state)."""
    wide = slot[..., None].expand(*slot.shape, keys.shape[-1])  # shared by keys and values
    keys.scatter_(2, wide, new_keys)
    values.scatter_(2, wide, new_values)
    for t, new in others:
        t.scatter_(2, _state_index(slot, t), new)


def _move_slot(
    keys: torch.Tensor, values: torch.Tensor, others: Iterable[torch.Tensor], src: int, dst: torch.Tensor
) -> None:
    """In place: for each (row, head), copy slot ``src`` into slot ``dst[b, h, 0]`` of every slot tensor."""
    wide = dst[..., None].expand(*dst.shape, keys.shape[-1])  # shared by keys and values
    for t in (keys, values):
        t.scatter_(2, wide, t[:, :, src : src + 1].clone())  # the source must not alias the destination
    for t in others:
        t.scatter_(2, _state_index(dst, t), t[:, :, src : src + 1].clone())
