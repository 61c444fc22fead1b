"""A transformers ``Cache`` whose layers physically hold at most a budget of tokens.

Storage per layer: keys/values ``[batch, kv_heads, capacity, head_dim]``; the first ``n`` slots are in use. The
slot count is shared by the layer, but every (batch row, KV head) keeps its own token set: slot ``s`` of row
``b`` and head ``h`` holds the token at original position ``pos[b, h, s]`` (-1 = empty or padding). Per-slot
policy state lives beside the keys and moves with them.

A step (one forward pass of ``q`` tokens through a layer) is:

1. ``get_mask_sizes`` (asked by transformers' masking utilities) claims the mask built next: a
   :class:`~kvsieve.engine.attention.SieveMask` (the padding mask and the layer's window), not a dense one;
2. ``update`` takes the new K/V and hands the layer over to the attention function;
3. ``attend`` (called by the attention function once it has checked every argument the model passes) stores the
   new tokens in slots ``n .. n+q`` with their positions from the padding mask, runs masked attention over the
   slots, lets the policy observe the probabilities, and evicts down to the policy's ``n_keep``: at a decode step
   the victim's slot goes stale and the next token is written into it (no copy of the cache); several victims are
   removed by one gather into buffers of ``budget + 1`` slots, which frees the prompt-sized ones.

Between steps a bounded layer holds at most ``budget`` tokens in ``budget + 1`` allocated slots (the spare slot
receives the next decode token). ``get_seq_length()`` is the number of tokens seen, so RoPE positions stay true.

Speculative decoding (assisted generation, prompt lookup): ``activate_past_recording`` makes the layers feed the
tokens after a prompt one at a time, as decode steps, and keep them with the state before the first of them, until
``crop`` commits them or rolls the rejected ones back exactly (state restored, the accepted tokens fed again).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, TypeVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvsieve.engine.attention import (
    AttentionArgs,
    SieveMask,
    UnsupportedModelError,
    claim_mask,
    hand_over,
    slot_attention,
)
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


def _by_column(weights: torch.Tensor, pos: torch.Tensor, columns: torch.Tensor | None, total: int) -> torch.Tensor:
    """Slot probabilities ``[B, Hq, b, N]`` laid out by column ``[B, Hq, b, total]`` (0 for tokens not held):
    ``pos`` ``[B, Hkv, N]`` are the slots' positions, ``columns`` maps positions to columns (None: identity)."""
    group = weights.shape[1] // pos.shape[1]
    held = pos.clamp(min=0)
    col = held if columns is None else columns.gather(1, held.flatten(1)).view_as(pos)
    col = col.repeat_interleave(group, dim=1)[:, :, None, :].expand_as(weights)
    real = (pos >= 0).repeat_interleave(group, dim=1)[:, :, None, :]
    return weights.new_zeros((*weights.shape[:3], total)).scatter_add_(3, col, weights * real)


@dataclass
class _Chunk:
    """A recorded token of a step: what :meth:`SieveLayer._step` needs to feed it again."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor | None
    args: AttentionArgs


@dataclass
class _Record:
    """A recording layer's state before its recorded tokens, and those tokens (see :meth:`SieveLayer.crop`)."""

    saved: dict[str, Any]
    chunks: list[_Chunk] = field(default_factory=list)

    @classmethod
    def of(cls, layer: SieveLayer, seen: int) -> _Record:
        """The state of ``layer`` (copied), which had seen ``seen`` tokens before the token being fed."""
        saved = {name: _copy(getattr(layer, name)) for name in ("keys", "values", "pos", "last", "free")}
        state = {name: t.clone() for name, t in layer.state.items()}
        return cls({**saved, "state": state, "n": layer.n, "seen": seen, "holes": layer.holes})

    def restore(self, layer: SieveLayer) -> None:
        for name, value in self.saved.items():
            setattr(layer, name, value)


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


class SieveLayer(CacheLayerMixin):
    """One layer of a :class:`SieveCache` (see the module docstring)."""

    is_compileable = False
    is_croppable = True  # what activate_past_recording() records, crop() rolls back exactly
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
        self.prompt_tokens: int | None = None  # the first step's prompt length, if given (set_prompt_length)
        self.record_past = False  # transformers' name: steps are recorded until crop() commits or rolls them back
        self.record: _Record | None = None

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
            prompt = key_states.shape[-2] if self.prompt_tokens is None else self.prompt_tokens
            self.policy = self.plan.resolve(prompt)[self.layer_idx]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"batch size changed from {self.keys.shape[0]} to {key_states.shape[0]}; use a new cache or reset()"
            )
        elif key_states.shape[1] != self.keys.shape[1] or key_states.shape[-1] != self.keys.shape[-1]:
            raise ValueError(
                f"layer {self.layer_idx} holds {self.keys.shape[1]} KV heads of dim {self.keys.shape[-1]}, the model "
                f"gives {key_states.shape[1]} of dim {key_states.shape[-1]}: a cache serves one model; make one for "
                "this model with kvsieve.make_cache"
            )
        self.seen += key_states.shape[-2]
        self.pending = (key_states, value_states)
        hand_over(self, key_states)
        return key_states, value_states

    @property
    def n_layers(self) -> int:
        """Layers of the model the cache was made for."""
        return len(self.plan.layer_policies)

    def discard_step(self) -> None:
        """Forget the step :meth:`update` took (its attention was refused before anything was computed)."""
        if self.pending is None:
            return
        self.seen -= self.pending[0].shape[-2]
        self.pending = None
        if self.seen == 0:  # nothing was cached yet: back to a fresh layer (a ratio budget resolves again)
            self.reset()
            self.plan.reset()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        claim_mask(self.seen + query_length)
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
        self.prompt_tokens = None
        self.record = None
        self.is_initialized = False

    def activate_past_recording(self) -> None:
        """Record the next steps, so that :meth:`crop` can roll them back (transformers calls it before assisted
        generation and prompt lookup); each step after the first is then processed one token at a time."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens fed since recording began or since the last ``crop``,
        exactly: the layer returns to its state before the recorded tokens and feeds the tokens that stay again, as
        it fed them (what their steps evicted is therefore back). ``crop(0)`` commits the recorded tokens."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass minus the number of tokens to remove (transformers' convention)"
            )
        record, tokens = self.record, -tokens_to_remove
        recorded = 0 if record is None else len(record.chunks)
        if tokens > recorded:
            raise ValueError(
                f"cannot remove the last {tokens} tokens of layer {self.layer_idx}: kvsieve rolls back only the "
                f"{recorded} token(s) fed after a prompt since cache.activate_past_recording() (transformers calls it "
                "for assisted generation and prompt lookup) or since the last crop"
            )
        self.record = None
        if tokens == 0:
            return
        record.restore(self)
        replay = record.chunks[: recorded - tokens]
        self.seen += len(replay)
        for offset, chunk in enumerate(replay):
            self._step(chunk.query, chunk.keys, chunk.values, chunk.padding, chunk.args, offset=offset)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    # -- the step -----------------------------------------------------------------------------------------------

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: SieveMask, args: AttentionArgs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the pending step: ``query`` ``[B, Hq, q, D]`` → the output of the same shape and, with
        ``args.weights``, the attention probabilities ``[B, Hq, q, tokens seen]`` laid out as over a
        ``DynamicCache`` (column = the token's index in the padded sequence; evicted tokens get 0).

        The step's tokens are processed in chunks (:meth:`_bounds`), each chunk stored, attended, observed and
        evicted before the next. While recording (:meth:`activate_past_recording`) the tokens after a prompt are
        kept, with the layer's state before the first of them, until :meth:`crop`.
        """
        (new_keys, new_values), self.pending = self.pending, None
        q = new_keys.shape[2]
        # The step's first tokens that are a prompt: all of a first step, unless set_prompt_length said fewer.
        prompt = (q if self.prompt_tokens is None else min(self.prompt_tokens, q)) if self.seen == q else 0
        self.prompt_tokens = None
        bounds, closed_form = self._bounds(q, prompt)
        padding = mask.new_tokens(q)
        if padding is not None:
            padding = padding.to(self.device)
        columns = self._columns(mask.padding) if args.weights else None
        if not self.record_past:
            self.record = None
        outputs = []
        for s, e in pairwise(bounds):
            chunk = (query, new_keys, new_values, padding)
            if len(bounds) > 2:  # (every decode step is one chunk: no slicing)
                chunk = tuple(None if t is None else t[..., s:e, :] if t.dim() == 4 else t[:, s:e] for t in chunk)
            if self.record_past and s >= prompt:  # (a single token: see _bounds)
                if self.record is None:
                    self.record = _Record.of(self, self.seen - q + s)
                self.record.chunks.append(_Chunk(*chunk, args))
            outputs.append(self._step(*chunk, args, closed_form, s, columns))
        outs, weights = zip(*outputs, strict=True)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        if not args.weights:
            return out, None
        return out, weights[0] if len(weights) == 1 else torch.cat(weights, dim=2)

    def _bounds(self, q: int, prompt: int) -> tuple[list[int], bool]:
        """Where the step's ``q`` tokens, of which the first ``prompt`` are a prompt, are cut into chunks, and
        whether the chunks are closed-form.

        - Tokens after a prompt (:meth:`SieveCache.set_prompt_length`), and every token of a later step while
          recording: one token at a time, as decode steps feed them (the prompt at once).
        - Otherwise chunks of ``step_size`` (all at once when None) — with ``step_size=1`` this is exactly the
          computation of feeding the tokens one at a time. When the policy's state does not depend on how rows are
          grouped (``row_additive``, or no attention observed), the tokens that fit before the first eviction are
          one chunk; when its kept set is known in closed form (``stream_closed_form``), ``step_size=1`` runs
          chunks of ``max(budget, 64)`` tokens whose queries see exactly what they would see one at a time,
          evicting after each chunk (the cache briefly holds budget + chunk tokens).
        """
        if prompt < q and (prompt > 0 or self.record_past):
            return [0, *range(max(prompt, 1), q + 1)], False
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
        return bounds, closed_form

    def _columns(self, padding: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, tokens seen]``: the column of each row's token at each position (None: position = column)."""
        if padding is None:
            return None
        if padding.shape[1] != self.seen:
            raise ValueError(
                f"output_attentions with a kvsieve cache needs the attention mask of all {self.seen} tokens seen, "
                f"got one of {padding.shape[1]}"
            )
        return torch.argsort((~padding).to(torch.uint8), dim=1, stable=True).to(self.device)

    def _step(
        self,
        query: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        padding: torch.Tensor | None,
        args: AttentionArgs,
        closed_form: bool = False,
        offset: int = 0,
        columns: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk of the pending step: its tokens start at index ``offset`` of the step's tokens. Returns its
        output and, with ``args.weights``, its probabilities by column (``columns``: see :meth:`_columns`)."""
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
        out, weights = slot_attention(
            query,
            keys,
            slots.values,
            slots.pos,
            query_pos,
            args,
            observe=(lambda obs: policy.observe(slots.prefix(obs.key_pos.shape[-1]), obs))
            if policy.needs_attention
            else None,
            narrow=policy.narrow if policy.needs_attention and policy.narrows else None,
            restrict=policy.stream_visible if closed_form and q > 1 else None,
            all_visible=q == 1 and padding is None and args.window is None and not self.holes,
            causal_tail=not policy.observes_all_slots,  # (the step's tokens are the last q slots, in order)
        )
        if weights is not None:
            weights = _by_column(weights, slots.pos, columns, self.seen)
        self._evict(slots)
        return out, weights

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
        self.record = None  # (recorded steps cannot be rolled back across a change of the batch)
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

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"this kvsieve cache was made for a model of {len(self.layers)} layers, not one with a layer "
                f"{layer_idx}: a cache serves one model; make one for this model with kvsieve.make_cache"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def set_prompt_length(self, tokens: int) -> None:
        """The first forward pass starts with a prompt of ``tokens`` tokens: they are processed at once (a prefill,
        which also resolves a ratio budget), the tokens after them in that pass one at a time, as decode steps.

        transformers' assisted generation and prompt lookup verify their first draft tokens in the prompt's forward
        pass; with this, they evict exactly as plain decoding does (``kvsieve.generate`` sets it)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"the prompt length must be a positive int, got {tokens!r}")
        if self.get_seq_length() > 0:
            raise ValueError("the prompt length is set before the first forward pass (or after reset())")
        for layer in self.layers:
            layer.prompt_tokens = tokens

    def activate_past_recording(self) -> None:
        """Record the next steps so that :meth:`crop` can roll them back exactly (transformers calls this before
        assisted generation and prompt lookup). An empty cache must know where the prompt of its first pass ends
        (:meth:`set_prompt_length`): transformers verifies the first draft tokens in that pass, and the cache evicts
        (and can roll back) the tokens after the prompt one at a time."""
        if self.get_seq_length() == 0 and self.layers[0].prompt_tokens is None:
            raise ValueError(
                "assisted generation and prompt lookup verify the first draft tokens in the prompt's forward pass; to "
                "evict exactly as plain decoding does, the kvsieve cache must know where the prompt ends: call "
                "cache.set_prompt_length(input_ids.shape[1]) before generate (kvsieve.generate does it)"
            )
        super().activate_past_recording()

    @property
    def step_size(self) -> int | None:
        """Tokens processed per eviction round within one forward pass (None: the whole forward at once).

        ``1`` is the "stream" protocol: one forward over a whole sequence gives the logits of feeding it token by
        token through this cache, at a fraction of the cost (the per-token work runs inside each layer). Larger
        chunks are cut in the (left-padded) batch's token axis, so a padded row is chunked otherwise than alone.
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
