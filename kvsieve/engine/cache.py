"""A transformers ``Cache`` whose layers physically hold at most a budget of tokens.

Storage per layer: keys/values ``[batch, kv_heads, capacity, head_dim]``; the first ``n`` slots are in use. The
slot count is shared by the layer, but every (batch row, KV head) keeps its own token set: slot ``s`` of row
``b`` and head ``h`` holds the token at original position ``pos[b, h, s]`` (-1 = empty or padding). Per-slot
policy state lives beside the keys and moves with them.

A step (one forward pass of ``q`` tokens through a layer) is:

1. ``update`` writes the new K/V into slots ``n .. n+q`` (growing the buffers if needed) and returns the views
   ``[:, :, :n+q]``, handing itself over to the attention function;
2. ``attend`` (called by the attention function) assigns the new tokens' positions from the padding mask, runs
   masked attention over the slots, lets the policy observe the probabilities, and evicts down to the policy's
   ``n_keep``: one victim is overwritten by the last slot (decode: no copy of the cache), several are removed by
   one gather into buffers of ``budget + 1`` slots, which frees the prompt-sized ones.

Between steps a bounded layer holds at most ``budget`` tokens in ``budget + 1`` allocated slots (the spare slot
receives the next decode token). ``get_seq_length()`` is the number of tokens seen, so RoPE positions stay true.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import pairwise
from typing import Any, TypeVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvsieve.engine.attention import UnsupportedModelError, hand_over, slot_attention
from kvsieve.engine.budget import Budget, check_budget, resolve_budget
from kvsieve.engine.rope import Rotary, ranks
from kvsieve.engine.schedules import split_budget
from kvsieve.policies import Policy, Slots

T = TypeVar("T")
GROWTH = 64  # minimum slots added when a buffer grows
CLOSED_FORM_CHUNK = 64  # minimum tokens per chunk when a position-only policy streams in closed form


class PolicyPlan:
    """Builds each layer's policy instance, resolving a ratio budget against the prompt length once.

    ``layer_policies[i]`` is the policy class of layer ``i`` with its params and, for layers with their own fixed
    size (sliding-window layers), the budget they always use. The other layers (the policy layers) all get
    ``budget``, or, with ``weights`` (one per policy layer: a layer budget schedule), share the same total as
    :func:`~kvsieve.engine.schedules.split_budget` divides it.

    The plan is also what the layers of one cache share within a step (:meth:`share`, which keeps the latest value
    of each kind). Every layer sees the same tokens, so the positions of a one-chunk step (every decode step) are
    computed once, by the first layer. Layers whose policy is ``positional`` and built from the same class, params
    and budget hold the same positions at every step (they start empty, see the same tokens and decide from
    positions alone), so they evict the same slots: :meth:`decide` computes that decision once per step, for the
    first of them, and hands it to the others.
    """

    def __init__(
        self,
        layer_policies: Sequence[tuple[type[Policy], Any, int | None]],
        budget: Budget | None,
        weights: Sequence[float] | None = None,
    ) -> None:
        self.layer_policies = list(layer_policies)
        self.budget = None if budget is None else check_budget(budget)
        self.n_shared = sum(fixed is None for *_, fixed in self.layer_policies)
        if weights is not None and len(weights) != self.n_shared:
            raise ValueError(f"a layer schedule needs a weight per policy layer ({self.n_shared}), not {len(weights)}")
        self.weights = None if weights is None else list(weights)
        self.budget_tokens: int | None = None
        self._policies: list[Policy] | None = None
        self._groups: list[tuple[Any, ...] | None] = []
        self._shared: dict[Hashable, tuple[Hashable, Any]] = {}
        if self.budget is None or isinstance(self.budget, int):
            self.resolve(0)

    def resolve(self, prompt_len: int) -> list[Policy]:
        """The policies of all layers (built on first call; every layer is validated before any is used)."""
        if self._policies is None:
            tokens = None if self.budget is None else resolve_budget(self.budget, prompt_len)
            scheduled = tokens is not None and self.weights is not None
            shared = iter(split_budget(tokens, self.weights) if scheduled else [tokens] * self.n_shared)
            policies = []
            for i, (cls, params, fixed) in enumerate(self.layer_policies):
                budget = next(shared) if fixed is None else fixed
                try:
                    policies.append(cls(budget, params))
                except ValueError as err:
                    if not scheduled:
                        raise
                    raise ValueError(f"layer {i} gets {budget} tokens under the layer schedule: {err}") from None
            self._policies = policies
            self._groups = [
                (cls, id(params), policy.budget) if policy.positional else None
                for (cls, params, _), policy in zip(self.layer_policies, policies, strict=True)
            ]
            self.budget_tokens = tokens
        return self._policies

    def share(self, what: Hashable, stamp: Hashable, make: Callable[[], T]) -> T:
        """``make()``, or the value of ``what`` that another layer already made under the same ``stamp`` (the
        latest value of each ``what`` is kept)."""
        made = self._shared.get(what)
        if made is None or made[0] != stamp:
            made = self._shared[what] = (stamp, make())
        return made[1]

    def decide(self, layer_idx: int, step: int, choose: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``choose()`` for layer ``layer_idx`` at its ``step``-th eviction round, or the decision another layer of
        its positional group already made for that round (the layers of a group run their rounds in lockstep)."""
        group = self._groups[layer_idx]
        return choose() if group is None else self.share(group, step, choose)

    def reset(self) -> None:
        """Forget what the layers shared and a ratio budget's resolution (the next prompt resolves it again)."""
        self._shared.clear()
        if isinstance(self.budget, float):
            self._policies = None
            self.budget_tokens = None


def _resized(t: torch.Tensor, capacity: int, n: int) -> torch.Tensor:
    out = t.new_empty((t.shape[0], t.shape[1], capacity, *t.shape[3:]))
    out[:, :, :n] = t[:, :, :n]
    return out


def _gathered(t: torch.Tensor, index: torch.Tensor, capacity: int) -> torch.Tensor:
    out = t.new_empty((t.shape[0], t.shape[1], capacity, *t.shape[3:]))
    idx = index.view(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])
    out[:, :, : index.shape[2]] = t.gather(2, idx)
    return out


def _state_index(index: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``index`` ``[B, H, 1]`` expanded over the trailing dimensions of the slot tensor ``t``."""
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
    keys: torch.Tensor, values: torch.Tensor, others: Sequence[torch.Tensor], src: int, dst: torch.Tensor
) -> None:
    """In place: for each (row, head), copy slot ``src`` into slot ``dst[b, h, 0]`` of every slot tensor."""
    wide = dst[..., None].expand(*dst.shape, keys.shape[-1])  # shared by keys and values
    for t in (keys, values):
        t.scatter_(2, wide, t[:, :, src : src + 1].clone())  # the source must not alias the destination
    for t in others:
        t.scatter_(2, _state_index(dst, t), t[:, :, src : src + 1].clone())


class SieveLayer(CacheLayerMixin):
    """One layer of a :class:`SieveCache` (see the module docstring)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False  # the policy (and its state) is known only at the first update

    def __init__(self, plan: PolicyPlan, layer_idx: int, is_sliding: bool = False) -> None:
        super().__init__()
        self.plan = plan
        self.layer_idx = layer_idx
        self.is_sliding = is_sliding
        self.policy: Policy | None = None
        self.pos: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.last: torch.Tensor | None = None  # [B] position of each row's newest real token (-1: none yet)
        self.holes = False  # whether slots in use may hold padding (position -1)
        self.free: torch.Tensor | None = None  # [B, H, 1] the slot of the last decode step's victim (stale)
        self.n = 0
        self.seen = 0
        self.rounds = 0  # eviction rounds run (steps, or chunks of a step); never reset, so never reused
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.step_size: int | None = None
        self.rotary: Rotary | None = None

    # -- transformers' layer contract ---------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, heads = key_states.shape[:2]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty((bsz, heads, 0, key_states.shape[-1]))
        self.values = value_states.new_empty((bsz, heads, 0, value_states.shape[-1]))
        self.pos = torch.empty((bsz, heads, 0), dtype=torch.long, device=self.device)
        self.state = {
            name: torch.zeros((bsz, heads, 0, *extra), dtype=dtype, device=self.device)
            for name, (extra, dtype) in self.policy.state_spec().items()
        }
        self.last = torch.full((bsz,), -1, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the step's new K/V; :meth:`attend` (called by the attention function) stores and uses them."""
        if self.pending is not None:
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: the attention of the previous forward step never ran through the kvsieve "
                "attention (load the model with kvsieve.load_model or use kvsieve.make_cache, which sets "
                "attn_implementation='kvsieve'); if a forward pass was interrupted, call cache.reset()"
            )
        if self.policy is None:
            self.policy = self.plan.resolve(key_states.shape[-2])[self.layer_idx]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"batch size changed from {self.keys.shape[0]} to {key_states.shape[0]}; use a new cache or reset()"
            )
        self.seen += key_states.shape[-2]
        self.pending = (key_states, value_states)
        hand_over(self, key_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen so far (not tokens kept): positions are derived from it."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.pos = self.last = None
        self.state = {}
        self.n = self.seen = 0
        self.holes = False
        self.free = None
        self.pending = None
        self.policy = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    # -- the step -----------------------------------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        padding: torch.Tensor | None,
        scaling: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Run the pending step (``query`` ``[B, Hq, q, D]`` → output of the same shape).

        The step's tokens are processed in chunks of ``step_size`` (all at once when None), each chunk stored,
        attended, observed and evicted before the next — with ``step_size=1`` this is exactly the computation of
        feeding the tokens one at a time. When the policy's state does not depend on how rows are grouped
        (``row_additive``, or no attention observed), the tokens that fit before the first eviction are one chunk;
        when its kept set is known in closed form (``stream_closed_form``), ``step_size=1`` runs chunks of
        ``max(budget, 64)`` tokens whose queries see exactly what they would see one at a time, evicting after
        each chunk (the cache briefly holds budget + chunk tokens).
        """
        (new_keys, new_values), self.pending = self.pending, None
        q = new_keys.shape[2]
        step = self.step_size or q
        policy = self.policy
        # Position-only policies: what each query sees is known, so chunks of ~budget tokens are attended at once,
        # evicted at their end (keys re-rotated by rank, under position rolling, depend on the step: not then).
        closed_form = step == 1 and policy.stream_closed_form and self.rotary is None
        if closed_form:
            step = max(policy.budget, CLOSED_FORM_CHUNK)
        bounds = [*range(0, q, step), q]
        if step < q and not closed_form and (policy.row_additive or not policy.needs_attention):
            # Tokens that fit before the first eviction form one chunk: the same result, without the per-token loop.
            room = min(policy.budget - self.n, q) if policy.bounded else q
            if room > step:
                bounds = [0, *range(room, q, step), q]
        if padding is not None:
            padding = padding.to(self.device)
        if len(bounds) == 2:  # one chunk (every decode step): no slicing
            return self._step(query, new_keys, new_values, padding, scaling, window, closed_form)
        outputs = [
            self._step(
                query[:, :, s:e],
                new_keys[:, :, s:e],
                new_values[:, :, s:e],
                None if padding is None else padding[:, s:e],
                scaling,
                window,
                closed_form,
                s,
            )
            for s, e in pairwise(bounds)
        ]
        return torch.cat(outputs, dim=2)

    def _step(
        self,
        query: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        padding: torch.Tensor | None,
        scaling: float,
        window: int | None,
        closed_form: bool = False,
        offset: int = 0,
    ) -> torch.Tensor:
        """One chunk of the pending step: its tokens start at index ``offset`` of the step's tokens."""
        q, heads = key_states.shape[2], key_states.shape[1]
        if self.free is not None and q > 1:
            self._compact()
        start, total = self.n, self.n + q
        query_pos, self.last, new_pos = self.plan.share(
            "positions", (self.seen, offset, q, heads), lambda: self._positions(padding, q, heads)
        )
        self.holes |= padding is not None
        if self.rotary is not None:  # store keys un-rotated (position rolling)
            key_states = self.rotary.rotate(key_states, -query_pos[:, None, :])
        initial = self.policy.initial_state(key_states, new_pos)
        if self.free is None:
            self._reserve(total)
        others = [(self.pos, new_pos), *((t, initial.get(name, 0)) for name, t in self.state.items())]
        if self.free is not None:  # a decode token takes the previous victim's slot
            start, total = self.n - 1, self.n
            _write_slot(self.keys, self.values, others, self.free, key_states, value_states)
            self.free = None
        else:
            self.keys[:, :, start:total] = key_states
            self.values[:, :, start:total] = value_states
            for t, new in others:
                t[:, :, start:total] = new
            self.n = total
        slots = self.slots()
        keys = slots.keys
        if self.rotary is not None:
            rank = ranks(slots.pos)
            keys = self.rotary.rotate(keys, rank)
            group = query.shape[1] // keys.shape[1]
            query_rank = rank[:, :, start:total].repeat_interleave(group, dim=1)
            query = self.rotary.rotate(query, query_rank - query_pos[:, None, :])
        policy = self.policy
        out = slot_attention(
            query,
            keys,
            slots.values,
            slots.pos,
            query_pos,
            scaling,
            window,
            observe=(lambda obs: policy.observe(slots.prefix(obs.key_pos.shape[-1]), obs))
            if policy.needs_attention
            else None,
            narrow=policy.narrow if policy.needs_attention and policy.narrows else None,
            restrict=policy.stream_visible if closed_form and q > 1 else None,
            all_visible=q == 1 and padding is None and window is None and not self.holes,
            causal_tail=not policy.observes_all_slots,  # (the step's tokens are the last q slots, in order)
        )
        self._evict(slots)
        return out

    def _positions(
        self, padding: torch.Tensor | None, q: int, heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk's query positions ``[B, q]`` (-1 = padding), each row's newest position after it ``[B]``, and
        the positions to store ``[B, heads, q]``: the same in every layer."""
        if padding is None:  # (a decode step needs no arange)
            first = self.last + 1
            query_pos = first[:, None] if q == 1 else first[:, None] + torch.arange(q, device=self.device)
            last = first if q == 1 else self.last + q
        else:
            query_pos = (self.last[:, None] + padding.cumsum(-1)).masked_fill(~padding, -1)
            last = self.last + padding.sum(-1)
        return query_pos, last, query_pos[:, None, :].expand(-1, heads, -1)

    def slots(self) -> Slots:
        """The policy's view of the slots in use (during a step: every slot holds a token or padding)."""
        return Slots(self.pos, self.state, self.last, self.keys, self.values).prefix(self.n)

    def held_positions(self) -> torch.Tensor:
        """``[B, H, tokens held]`` positions of the held tokens, in slot order (-1 = padding)."""
        pos = self.pos[:, :, : self.n]
        if self.free is None:
            return pos.clone()
        held = torch.ones_like(pos, dtype=torch.bool).scatter_(2, self.free, False)
        return pos[held].view(*pos.shape[:2], self.n - 1)

    def _compact(self) -> None:
        """Close the stale slot of the last decode victim by moving the last slot into it."""
        _move_slot(self.keys, self.values, [self.pos, *self.state.values()], self.n - 1, self.free)
        self.n -= 1
        self.free = None

    def _evict(self, slots: Slots) -> None:
        """Evict down to the policy's ``n_keep`` (``slots``: the view of the slots in use)."""
        self.rounds += 1
        target = self.policy.n_keep(self.n)
        if target >= self.n:
            return
        chosen = self.plan.decide(self.layer_idx, self.rounds, lambda: self._choose(slots, target))
        if self.n - target == 1:
            victim = chosen
            if not self.holes and self.rotary is None:
                # The victim's slot goes stale; the next decode token is written into it (no copy of the cache).
                self.free = victim
                return
            _move_slot(self.keys, self.values, [self.pos, *self.state.values()], self.n - 1, victim)
        else:
            capacity = self._limit()
            self._map_slots(lambda t: _gathered(t, chosen, capacity))
        self.n = target
        if self.holes:
            self.holes = bool((self.pos[:, :, :target] < 0).any())

    def _choose(self, slots: Slots, target: int) -> torch.Tensor:
        """By the policy's priorities: the victim slot ``[B, H, 1]`` when one slot goes, else the ``target`` slots
        kept ``[B, H, target]``, in slot order."""
        scores = self.policy.keep_scores(slots)
        if self.holes:
            lowest = float("-inf") if scores.is_floating_point() else torch.iinfo(scores.dtype).min
            scores = scores.masked_fill(slots.pos < 0, lowest)
        if self.n - target == 1:
            return scores.argmin(dim=-1, keepdim=True)
        return scores.topk(target, dim=-1, sorted=False).indices.sort(dim=-1).values

    # -- storage ------------------------------------------------------------------------------------------------

    def _limit(self) -> int | float:
        """Most slots kept allocated between steps."""
        return self.policy.budget + 1 if self.policy.bounded else float("inf")

    def _reserve(self, needed: int) -> None:
        capacity = self.keys.shape[2]
        if needed > capacity:
            grown = max(needed, min(needed + max(GROWTH, needed // 4), self._limit()))
            self._map_slots(lambda t: _resized(t, int(grown), self.n))

    def _map_slots(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values, self.pos = fn(self.keys), fn(self.values), fn(self.pos)
        self.state = {name: fn(t) for name, t in self.state.items()}

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.free is not None:
            self._compact()
        if self.is_initialized:
            self._map_slots(fn)
            self.last = fn(self.last)

    # -- introspection ------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Allocated slots."""
        return 0 if self.keys is None else self.keys.shape[2]

    def kv_nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def state_nbytes(self) -> int:
        """Bytes allocated for positions and policy state."""
        if self.pos is None:
            return 0
        return self.pos.nbytes + self.last.nbytes + sum(t.nbytes for t in self.state.values())


class SieveCache(Cache):
    """A cache of :class:`SieveLayer` s. Build it with :func:`kvsieve.make_cache`."""

    layers: list[SieveLayer]

    def __init__(self, plan: PolicyPlan, sliding: Sequence[bool]) -> None:
        super().__init__(layers=[SieveLayer(plan, i, s) for i, s in enumerate(sliding)])
        self.plan = plan

    @property
    def budget_tokens(self) -> int | None:
        """The resolved budget in tokens (None before a ratio budget meets its prompt, or when unbounded)."""
        return self.plan.budget_tokens

    @property
    def policy_name(self) -> str:
        return self.plan.layer_policies[-1][0].name

    def reset(self) -> None:
        super().reset()
        self.plan.reset()

    @property
    def step_size(self) -> int | None:
        """Tokens processed per eviction round within one forward pass (None: the whole forward at once).

        ``1`` is the "stream" protocol: one forward over a whole sequence gives the logits of feeding it token by
        token through this cache, at a fraction of the cost (the per-token work runs inside each layer).
        """
        return self.layers[0].step_size

    @step_size.setter
    def step_size(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"step_size must be a positive int or None, got {value!r}")
        for layer in self.layers:
            layer.step_size = value

    @property
    def rolling(self) -> bool:
        """Whether keys are re-rotated by their rank in the cache (position rolling, see :mod:`kvsieve.engine.rope`)."""
        return self.layers[0].rotary is not None

    def enable_rolling(self, rotary: Rotary) -> None:
        """Switch on position rolling (before the first forward pass)."""
        if any(layer.is_initialized for layer in self.layers):
            raise ValueError("position rolling must be enabled before the cache is used")
        for layer in self.layers:
            layer.rotary = rotary

    def positions(self, layer_idx: int) -> torch.Tensor:
        """``[batch, kv_heads, slots]`` original positions of the tokens held by ``layer_idx`` (-1 = empty)."""
        layer = self.layers[layer_idx]
        if layer.pos is None:
            raise ValueError(f"layer {layer_idx} holds nothing yet")
        return layer.held_positions()

    def slot_counts(self) -> list[int]:
        """Slots in use per layer."""
        return [layer.n - (layer.free is not None) for layer in self.layers]

    def capacities(self) -> list[int]:
        """Slots allocated per layer."""
        return [layer.capacity for layer in self.layers]

    def kv_nbytes(self) -> int:
        """Bytes held by keys and values (allocated buffers)."""
        return sum(layer.kv_nbytes() for layer in self.layers)

    def state_nbytes(self) -> int:
        """Bytes held by positions and policy state."""
        return sum(layer.state_nbytes() for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes held by K/V and policy state together."""
        return self.kv_nbytes() + self.state_nbytes()
