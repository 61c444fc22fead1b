"""The slots of one cache layer: keys, values, each slot's original position and the policy's per-slot state.

Buffers are ``[batch, kv_heads, capacity, ...]``; the first ``used`` slots are in use. The slot count is shared by
the layer, but every (batch row, KV head) keeps its own token set: slot ``s`` of row ``b`` and head ``h`` holds the
token at original position ``positions[b, h, s]`` (-1 = empty or padding). Per-slot state moves with its token.
Keys and values are held as the layer's codec says (:mod:`kvsieve.engine.quant`: as they are, or quantized codes
with their scales), in per-slot tensors that move like the rest.

**Heads that keep their own counts** (:attr:`SlotStore.counts`, after :meth:`SlotStore.keep_heads`): each (row, KV
head) keeps its own number of tokens, in its first slots (the slots past them are holes, position -1). Keys and
values are then *packed* (:class:`HeadLayout`): ``[slots of all rows and heads, ...]``, each (row, head) holding its
count plus one slot for its next token, so the bytes held are the sum of the heads' own counts, not heads × the
largest. Positions and policy state stay ``[batch, kv_heads, slots]`` (a scalar or two per slot). A step reads the
keys and values as ``[batch, kv_heads, slots, ...]`` gathered from the packed buffers (one layer at a time); a single
token per (row, head) is written into its own slot; a step of several tokens unpacks the layer
(:meth:`SlotStore.unpack`) until the next :meth:`SlotStore.keep_heads` packs it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from kvsieve.engine.quant import PLAIN, Codec, KVQuant, Residual, as_integers, past, recent, split
from kvsieve.policies import Slots

GROWTH = 64  # minimum slots added when a buffer grows
StateSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]
Expand = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``expand(index, t)``: a slot index ``[B, H, k]`` expanded over the trailing dimensions of slot tensor ``t``."""


@dataclass
class StepKV:
    """The slots in use during a step of a quantized store, decoded once: dequantized, and exact where the residual
    (or the step's own tokens) gives them (elsewhere: meaningless); keys and values as one ``[B, H, used, 2·D]``
    tensor each."""

    both: torch.Tensor
    exact: torch.Tensor | None

    @property
    def keys(self) -> torch.Tensor:
        return split(self.both)[0]

    @property
    def values(self) -> torch.Tensor:
        return split(self.both)[1]

    @property
    def exact_keys(self) -> torch.Tensor | None:
        return None if self.exact is None else split(self.exact)[0]

    @property
    def exact_values(self) -> torch.Tensor | None:
        return None if self.exact is None else split(self.exact)[1]


@dataclass(frozen=True)
class HeadLayout:
    """Packed slots: (row ``b``, head ``h``) has ``caps[b, h]`` slots, its slot ``s`` is packed slot
    ``offsets[b, h] + s`` (rows and heads one after the other)."""

    caps: torch.Tensor
    """``[B, H]`` slots of each (row, head)."""
    offsets: torch.Tensor = field(init=False)
    indices: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        flat = self.caps.flatten()
        object.__setattr__(self, "offsets", (flat.cumsum(0) - flat).view_as(self.caps))

    def index(self, n: int) -> torch.Tensor:
        """``[B · H · n]``: the packed slot of each (row, head)'s slots ``0 … n`` (one past its own: its last slot,
        which a hole's position masks)."""
        if n not in self.indices:
            slot = torch.arange(n, device=self.caps.device)
            self.indices[n] = (self.offsets[..., None] + torch.minimum(slot, self.caps[..., None] - 1)).flatten()
        return self.indices[n]

    def packed(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` ``[B, H, n, ...]`` (``n`` ≥ every cap) packed: ``[slots, ...]``."""
        within = torch.arange(t.shape[2], device=t.device) < self.caps[..., None]
        return t.flatten(0, 2)[within.flatten()]

    def unpacked(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """Packed ``t`` ``[slots, ...]`` as ``[B, H, n, ...]``."""
        return t.index_select(0, self.index(n)).view(*self.caps.shape, n, *t.shape[1:])

    def slot_index(self, slot: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The packed slots of one slot per (row, head), ``slot`` ``[B, H, 1]``, expanded over packed ``t``'s
        trailing dimensions: ``[B · H, ...]``."""
        index = (self.offsets + slot[:, :, 0]).flatten()
        return index.view(-1, *([1] * (t.dim() - 1))).expand(-1, *t.shape[1:])


@dataclass
class SlotStore:
    """One layer's slots (see the module docstring). Eviction keeps at most ``limit`` slots allocated."""

    kv: dict[str, torch.Tensor]
    """The keys and values, as the codec holds them (:mod:`kvsieve.engine.quant`)."""
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
    padding_left: int = 0
    """While padding may be held: the most padding slots a (row, head) held when last counted, less the single
    evictions since — a lower bound of the most any holds now (after rows were removed it may be higher: padding is
    then counted later than it could be, and the masked path, right with or without padding, runs meanwhile; see
    :meth:`settle`)."""
    codec: Codec = PLAIN
    residual: Residual | None = None
    """Quantized slots: exact copies of each row's newest tokens."""
    dtype: torch.dtype = torch.float32
    """The model's dtype (keys and values are read in it)."""
    step: StepKV | None = None
    """Quantized slots, during a step: the slots decoded (see :meth:`append`, :meth:`release`)."""
    counts: torch.Tensor | None = None
    """``[B, H]``: the tokens each (row, KV head) keeps, where heads keep their own counts (:meth:`keep_heads`; -1:
    the row has not shared its budget among its heads yet, and each of its heads may hold the budget); None: every
    (row, head) keeps the layer's budget."""
    layout: HeadLayout | None = None
    """Where keys and values are packed (see the module docstring); None: ``[B, H, slots, ...]``."""

    @classmethod
    def empty(
        cls, keys: torch.Tensor, values: torch.Tensor, state: StateSpec, limit: int | float, codec: Codec = PLAIN
    ) -> SlotStore:
        """Empty buffers for tokens like ``keys``/``values`` ``[B, H, q, D]``, with the per-slot ``state``."""
        bsz, heads = keys.shape[:2]
        one = codec.encode(keys[:, :, :1], values[:, :, :1])  # (for the slot tensors' shapes and dtypes)
        return cls(
            kv={name: t.new_empty((bsz, heads, 0, *t.shape[3:])) for name, t in one.items()},
            positions=torch.empty((bsz, heads, 0), dtype=torch.long, device=keys.device),
            state={
                name: torch.zeros((bsz, heads, 0, *extra), dtype=dtype, device=keys.device)
                for name, (extra, dtype) in state.items()
            },
            limit=limit,
            codec=codec,
            residual=Residual.empty(torch.cat([keys[:, :, :1], values[:, :, :1]], -1), codec.residual)
            if codec.residual
            else None,
            dtype=keys.dtype,
        )

    @property
    def capacity(self) -> int:
        """Allocated slots."""
        return self.positions.shape[2]

    @property
    def held(self) -> int:
        """Tokens held (the stale slot excluded)."""
        return self.used - (self.stale is not None)

    @property
    def quantized(self) -> bool:
        return isinstance(self.codec, KVQuant)  # (a deep copy of a cache copies PLAIN too)

    @property
    def direct(self) -> bool:
        """Whether the buffers ``kv["keys"]`` and ``kv["values"]`` are the keys and values ``[B, H, slots, D]``
        themselves (neither quantized nor packed)."""
        return not self.quantized and self.layout is None

    @property
    def head_dim(self) -> int:
        return self.codec.head_dim(self.kv)

    def decoded(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, n, D]`` of the first ``n`` slots (default: those in use), dequantized."""
        self.code_pending()
        n = self.used if n is None else n
        return self.codec.decode(self.slot_kv(n), n, self.dtype)

    def slot_kv(self, n: int) -> dict[str, torch.Tensor]:
        """The key/value slot tensors ``[B, H, ≥ n, ...]`` (as the codec holds them): the buffers, or the first ``n``
        slots gathered from packed ones."""
        if self.layout is None:
            return self.kv
        return {name: self.layout.unpacked(t, n) for name, t in self.kv.items()}

    def keep_heads(self, kept: torch.Tensor, counts: torch.Tensor, room: torch.Tensor) -> None:
        """Keep the slots ``kept`` ``[B, H, used]`` flags in slots ``0 …`` of each (row, KV head), in slot order,
        and pack the keys and values (see the module docstring). ``counts`` ``[B, H]``: each (row, head)'s count
        (-1: its row has not shared its budget yet, see :attr:`counts`); ``room`` ``[B, H]``: the tokens each may
        hold (at least those kept), in slots of their own and one more: its next token is written into the first
        slot past its tokens (:attr:`stale`)."""
        if self.stale is not None:
            self.compact()
        held = kept.sum(dim=-1)
        caps = room + 1
        width = int(caps.max())
        order = torch.argsort((~kept).to(torch.uint8), dim=-1, stable=True)[:, :, :width]  # (kept first, in order)
        hole = torch.arange(order.shape[2], device=order.device) >= held[..., None]
        dense = self.slot_kv(self.used)
        layout = HeadLayout(caps)
        self.kv = {
            name: layout.packed(_widened(_gathered(t, order, order.shape[2]), width)) for name, t in dense.items()
        }
        positions = _gathered(self.positions, order, order.shape[2]).masked_fill_(hole, -1)
        self.positions = _widened(positions, width, -1)
        self.state = {name: _widened(_gathered(t, order, order.shape[2]), width) for name, t in self.state.items()}
        self.used, self.counts, self.layout = width, counts, layout
        self.stale = held[..., None]  # (the first slot past each head's tokens)
        self.may_hold_padding = True  # (the holes: every step masks them)

    def unpack(self) -> None:
        """Keys and values as ``[B, H, slots, ...]`` again (before a step that writes several tokens per head)."""
        if self.layout is not None:
            self.kv = {name: t.clone() for name, t in self.slot_kv(self.capacity).items()}
            self.layout = None

    def view(self, last: torch.Tensor, gather: bool = True) -> Slots:
        """The policy's view of the slots in use (during a step every one holds a token or padding); ``last``:
        each row's newest position. Quantized slots are seen as by the newest token: exact within the residual.
        ``gather=False``: packed plain slots are seen as a :class:`PackedView` (keys and values gathered when read)."""
        if not gather and self.layout is not None and not self.quantized:
            return PackedView(self, last)
        if self.step is None:
            keys, values = self.decoded()
        elif self.step.exact is None:
            keys, values = self.step.keys, self.step.values
        else:
            exact = recent(self.positions[:, :, : self.used], last, self.codec.residual)[..., None]
            keys, values = split(torch.where(exact, self.step.exact, self.step.both))
        return Slots(self.positions, self.state, last, keys, values).prefix(self.used)

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        initial: dict[str, torch.Tensor],
        newest: torch.Tensor | None = None,
        padded: bool = False,
        expand: Expand | None = None,
    ) -> int | None:
        """Store ``q`` new tokens (``keys``/``values`` ``[B, H, q, D]``, ``positions`` ``[B, H, q]``, ``initial``
        state; ``padded``: some may be padding): a single token takes the stale slot (None is returned), else they go
        at the end (the slot of the first is returned). Quantized slots: the slots in use are then decoded for the
        step (:attr:`step`); a single token is the step's only query, so its slots are decoded as it reads them
        (``newest``: each row's newest position after it, ``[B]``). ``expand``: how the stale slots are expanded over
        a slot tensor's trailing dimensions (default :func:`expand_index`)."""
        stale, ring = self.stale, self.residual
        if stale is None:
            self.unpack()
            self.reserve(self.used + keys.shape[2])
        both = torch.cat([keys, values], dim=-1) if self.quantized else None
        single = ring is not None and newest is not None and keys.shape[2] == 1
        if single:  # the token is read exactly for `residual` steps: coded later, with others (code_pending)
            new = positions[:, 0, 0]
            if ring.steps is None:  # (rows may differ: read each row's mark)
                due = bool(((new >= 0) & (ring.coded <= new - ring.size)).any())
            else:
                due = ring.steps == ring.size
            if due:  # (the oldest token without codes leaves the residual now)
                self.code_pending(torch.where(new >= 0, new, ring.coded))
            ring.steps = None if padded or ring.steps is None else ring.steps + 1
            # A padding token is never coded from the ring (it has no position): coded now, so that its slot holds
            # finite values (a padding query reads every slot; 0 · NaN would reach the real rows).
            entries = self.codec.encode_both(both) if padded else {}
        else:
            self.code_pending()  # (a step of several tokens reads the older ones dequantized)
            entries = self.codec.encode(keys, values) if both is None else self.codec.encode_both(both)
        packed = self.layout is not None  # (then the stale slots' keys and values are written below)
        pairs = [
            (self.positions, positions),
            *((t, initial.get(name, 0)) for name, t in self.state.items()),
            *((self.kv[name], entries[name]) for name in entries if not packed),
        ]
        start = None if stale is not None else self.used
        if stale is None:
            self.used += keys.shape[2]
        _put(pairs, stale, start, self.used, expand)
        if packed:
            index = {}  # (the stale slots' packed index, once per shape: keys and values share theirs)
            for name, new in entries.items():
                t = self.kv[name]
                if t.shape[1:] not in index:
                    index[t.shape[1:]] = self.layout.slot_index(stale, t)
                as_integers(t).scatter_(0, index[t.shape[1:]], as_integers(new[:, :, 0].flatten(0, 1).to(t.dtype)))
        self.stale = None
        if both is not None:
            decoded, exact, pos = (
                self.codec.decode_both(self.slot_kv(self.used), self.used, self.dtype),
                None,
                self.positions,
            )
            if single:
                ring.write(both, positions)  # (safe first: it replaces a position no query reads now)
                ring.restore_exact(decoded, pos[:, :, : self.used], newest)  # (the tokens without codes among them)
            elif ring is not None:  # exact: the ring before this step's tokens, and the tokens themselves
                exact = ring.read(pos[:, :, : self.used])
                _put([(exact, both)], stale, start, self.used, expand)
                ring.write(both, positions)
                ring.coded = torch.maximum(ring.coded, past(positions))  # (coded above)
            self.step = StepKV(decoded, exact)
        return start

    def code_pending(self, upto: torch.Tensor | None = None) -> None:
        """Quantized slots with a residual: code, from their exact copies, the held tokens that single-token steps
        stored without codes (positions from ``residual.coded``), up to position ``upto`` ``[B]`` (exclusive;
        default: all). Codes depend on the token alone, so when this runs changes nothing that is read."""
        ring = self.residual
        if ring is None:
            return
        with torch.inference_mode():  # (also when a saved context is exported: codes are never differentiated)
            pos = self.positions[:, :, : self.used]
            if upto is None:  # (every held token: those to come are newer than the newest held)
                upto = past(pos) if self.used else ring.coded
                every = True
            else:  # (every held token when each row got a real token at every step: `new` of each row)
                every = ring.steps is not None
            if ring.steps == 0 or (ring.steps is None and not bool((upto > ring.coded).any())):
                return  # (nothing pending: the usual case of a step of several)
            held = self.slot_kv(self.used)["codes"][:, :, : self.used]  # (gathered only when some are pending)
            pending = (pos >= ring.coded[:, None, None]) & (pos < upto[:, None, None])
            coded = self.codec.encode_both(ring.kv)["codes"].flatten(0, 2).index_select(0, ring.rows(pos))
            held = torch.where(pending[..., None], coded.view_as(held), held)
            if self.layout is None:
                self.kv["codes"][:, :, : self.used] = held
            else:  # (packed: the codes packed again, as the layout holds them)
                self.kv["codes"] = self.layout.packed(held)
            ring.coded = torch.maximum(ring.coded, upto)
            ring.steps = 0 if every else None

    def release(self) -> None:
        """The step is over: drop its decoded slots."""
        self.step = None

    def reserve(self, needed: int) -> None:
        """Grow the buffers to hold ``needed`` slots (by at least :data:`GROWTH`, never past ``limit``)."""
        if needed > self.capacity:
            grown = grown_capacity(needed, self.limit)
            used = self.used
            self._map(lambda t: _resized(t, grown, used))

    def compact(self) -> None:
        """Close the stale slot by moving the last slot into it."""
        self.unpack()
        _move_slot(self._slot_tensors(), self.used - 1, self.stale)
        self.used -= 1
        self.stale = None

    def drop(self, victim: torch.Tensor, leave_stale: bool) -> None:
        """Evict one slot per (row, head), ``victim`` ``[B, H, 1]``: leave it stale for the next token, or move the
        last slot into it."""
        if leave_stale:
            self.stale = victim
            return
        self.unpack()
        _move_slot(self._slot_tensors(), self.used - 1, victim)
        self.used -= 1

    def truncate(self, used: int) -> None:
        """Forget the slots from ``used`` on (a probe's tokens, appended after the held ones: see
        :func:`~kvsieve.engine.step.probe_step`); the buffers stay as they are until the next eviction."""
        self.used = used

    def keep(self, chosen: torch.Tensor) -> None:
        """Keep only the slots ``chosen`` ``[B, H, k]`` (in slot order), gathered into buffers of ``limit`` slots."""
        self.unpack()
        self._map(lambda t: _gathered(t, chosen, int(self.limit)))
        self.used = chosen.shape[2]

    def settle(self, single: bool = False) -> None:
        """After an eviction (``single``: of one slot per (row, head)): whether padding may still be held. Counting it
        reads a tensor on the host (a device sync), so it is counted only when it may be gone: a (row, head) that
        held ``k`` padding slots holds one at least until ``k`` single evictions are over (:attr:`padding_left`)."""
        if not self.may_hold_padding:
            return
        if single and self.padding_left > 1:
            self.padding_left -= 1
            return
        self.padding_left = int((self.positions[:, :, : self.used] < 0).sum(dim=-1).max())
        self.may_hold_padding = self.padding_left > 0

    def held_positions(self) -> torch.Tensor:
        """``[B, H, tokens held]`` positions of the held tokens, in slot order (-1 = padding)."""
        return self._held(self.positions)

    def held_state(self) -> dict[str, torch.Tensor]:
        """The policy's per-slot state of the held tokens, ``[B, H, tokens held, ...]`` each, in slot order."""
        return {name: self._held(t) for name, t in self.state.items()}

    def _held(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of the slots in use of ``t`` (``[B, H, slots, ...]``), the stale slot left out."""
        used = t[:, :, : self.used]
        if self.stale is None:
            return used.clone()
        held = torch.ones(used.shape[:3], dtype=torch.bool, device=t.device).scatter_(2, self.stale, False)
        return used[held].view(*used.shape[:2], self.used - 1, *used.shape[3:])

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation (reorder, repeat, select rows) to every buffer."""
        if self.stale is not None:
            self.compact()
        room = None if self.layout is None else self.layout.caps - 1
        self.unpack()  # (packed slots have no batch dimension: mapped as [B, H, slots], packed again)
        self._map(fn)
        if self.counts is not None:
            self.counts = fn(self.counts)
        if room is not None:
            self.keep_heads(self.positions[:, :, : self.used] >= 0, self.counts, fn(room))
        if self.residual is not None:
            self.residual = self.residual.map(fn)

    @classmethod
    def concat(cls, stores: Sequence[SlotStore]) -> SlotStore:
        """The rows of ``stores`` (of layers with the same slot limit, codec and state) in one store: each row keeps
        its slots in their order; a row that uses fewer slots than the most is padded with empty slots (position
        -1)."""
        if (
            len({store.limit for store in stores}) != 1
            or len({tuple(store.state) for store in stores}) != 1
            or len({repr(store.codec) for store in stores}) != 1
        ):
            raise ValueError("only stores of the same slot limit, policy state and quantization can be joined")
        for store in stores:
            if store.stale is not None:
                store.compact()
            store.unpack()
        used = max(store.used for store in stores)
        capacity = max(store.capacity for store in stores)

        def joined(pick: Callable[[SlotStore], torch.Tensor], fill: int) -> torch.Tensor:
            return torch.cat([_padded(pick(store), capacity, store.used, fill) for store in stores])

        first = stores[0]
        return cls(
            kv={name: joined(lambda store, name=name: store.kv[name], 0) for name in first.kv},
            positions=joined(lambda store: store.positions, -1),
            state={name: joined(lambda store, name=name: store.state[name], 0) for name in first.state},
            limit=first.limit,
            used=used,
            may_hold_padding=any(store.may_hold_padding or store.used < used for store in stores),
            codec=first.codec,
            residual=None
            if first.residual is None
            else Residual(
                torch.cat([store.residual.kv for store in stores]),
                first.residual.size,
                torch.cat([store.residual.coded for store in stores]),
                steps=first.residual.steps if len({store.residual.steps for store in stores}) == 1 else None,
            ),
            dtype=first.dtype,
            counts=None
            if all(store.counts is None for store in stores)
            else torch.cat([_counts(store) for store in stores]),
        )

    def copy(self) -> SlotStore:
        """A deep copy (to restore later)."""
        return replace(
            self,
            kv={name: t.clone() for name, t in self.kv.items()},
            positions=self.positions.clone(),
            state={name: t.clone() for name, t in self.state.items()},
            stale=None if self.stale is None else self.stale.clone(),
            residual=None if self.residual is None else self.residual.map(torch.clone),
            step=None,
            counts=None if self.counts is None else self.counts.clone(),
        )

    def kv_nbytes(self) -> int:
        """Bytes allocated for keys and values (codes, scales and the residual's exact copies when quantized)."""
        return sum(t.nbytes for t in self.kv.values()) + (0 if self.residual is None else self.residual.nbytes)

    def state_nbytes(self) -> int:
        """Bytes allocated for positions and policy state."""
        return self.positions.nbytes + sum(t.nbytes for t in self.state.values())

    def _slot_tensors(self) -> list[torch.Tensor]:
        return [*self.kv.values(), self.positions, *self.state.values()]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.kv = {name: fn(t) for name, t in self.kv.items()}
        self.positions = fn(self.positions)
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


def _counts(store: SlotStore) -> torch.Tensor:
    """A store's :attr:`~SlotStore.counts`, -1 (not shared yet) where it keeps none."""
    if store.counts is not None:
        return store.counts
    return torch.full(store.positions.shape[:2], -1, device=store.positions.device)


def _widened(t: torch.Tensor, width: int, fill: int = 0) -> torch.Tensor:
    """``t`` ``[B, H, n, ...]`` with slots up to ``width`` (≥ ``n``), the new ones ``fill``."""
    return t if t.shape[2] == width else _padded(t, width, t.shape[2], fill)


def _resized(t: torch.Tensor, capacity: int, n: int) -> torch.Tensor:
    out = t.new_empty((t.shape[0], t.shape[1], capacity, *t.shape[3:]))
    out[:, :, :n] = t[:, :, :n]
    return out


def _gathered(t: torch.Tensor, index: torch.Tensor, capacity: int) -> torch.Tensor:
    """The slots ``index`` of ``t`` first, in a buffer of ``capacity`` slots: ``t`` itself when it has that many (the
    buffers stay where they are from step to step, as CUDA graphs need), else a new one (a prompt-sized buffer is
    freed)."""
    kept = as_integers(t).gather(2, expand_index(index, t)).view(t.dtype)
    out = t if t.shape[2] == capacity else t.new_empty((t.shape[0], t.shape[1], capacity, *t.shape[3:]))
    out[:, :, : index.shape[2]] = kept
    return out


def expand_index(index: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``index`` ``[B, H, k]`` expanded over the trailing dimensions of the slot tensor ``t``."""
    if t.dim() == 3:
        return index
    return index.view(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])


def _put(
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor | int]],
    stale: torch.Tensor | None,
    start: int | None,
    end: int,
    expand: Expand | None = None,
) -> None:
    """In place: write new tokens' entries into each ``(slot tensor, entries)`` pair: one token per (row, head) into
    slot ``stale[b, h, 0]`` (expanded by ``expand``), or several into slots ``start:end``."""
    index = {}  # (the stale slots expanded once per shape of slot tensor: keys and values share theirs)
    for t, new in pairs:
        if stale is None:
            t[:, :, start:end] = new
            continue
        if t.shape[3:] not in index:
            index[t.shape[3:]] = (expand or expand_index)(stale, t)
        if isinstance(new, torch.Tensor):
            as_integers(t).scatter_(2, index[t.shape[3:]], as_integers(new.to(t.dtype)))
        else:
            t.scatter_(2, index[t.shape[3:]], new)


def _move_slot(tensors: Iterable[torch.Tensor], src: int, dst: torch.Tensor) -> None:
    """In place: for each (row, head), copy slot ``src`` into slot ``dst[b, h, 0]`` of every slot tensor."""
    for t in tensors:
        t = as_integers(t)
        t.scatter_(2, expand_index(dst, t), t[:, :, src : src + 1].clone())  # the source must not alias the destination


class PackedView(Slots):
    """The view of packed plain slots (:class:`HeadLayout`) whose keys and values ``[B, H, N, D]`` are gathered
    when first read: a decode step that reads them where they lie (:mod:`kvsieve.engine.packed`) copies nothing,
    a policy that reads keys or values gets them as from any view."""

    def __init__(self, store: SlotStore, last: torch.Tensor) -> None:
        n = store.used
        self.pos, self.last, self.store = store.positions[:, :, :n], last, store
        self.state = {name: t[:, :, :n] for name, t in store.state.items()}
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def keys(self) -> torch.Tensor:
        return self.gathered()[0]

    @property
    def values(self) -> torch.Tensor:
        return self.gathered()[1]

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[B, H, N, D]`` (gathered once)."""
        if self.kv is None:
            self.kv = self.store.decoded()
        return self.kv
