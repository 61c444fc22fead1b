"""One layer of a :class:`~kvsieve.engine.cache.SieveCache`: the step that runs at every forward pass.

A step (one forward pass of ``q`` tokens through a layer) is:

1. ``get_mask_sizes`` (asked by transformers' masking utilities) claims the mask built next: a
   :class:`~kvsieve.engine.attention.SieveMask` (the padding mask and the layer's window), not a dense one;
2. ``update`` takes the new K/V and hands the layer over to the attention function;
3. ``attend`` (called by the attention function once it has checked every argument the model passes) cuts the
   step into chunks (:mod:`kvsieve.engine.stream`; one, but for the stream protocol), and for each: **store** the
   tokens in the layer's slots (:mod:`kvsieve.engine.storage`) with their positions from the padding mask,
   **attend** over the slots (:mod:`kvsieve.engine.slot_attention`), let the policy **observe** the probabilities
   (only if it asks for them), **evict** down to the policy's ``n_keep``: at a decode step the victim's slot goes
   stale and the next token is written into it (no copy of the cache); several victims are removed by one gather
   into buffers of ``budget + 1`` slots, which frees the prompt-sized ones.

Speculative decoding (assisted generation, prompt lookup): ``activate_past_recording`` makes the layer feed the
tokens after a prompt one at a time, as decode steps, and keep them with the state before the first of them, until
``crop`` commits them or rolls the rejected ones back exactly (state restored, the accepted tokens fed again).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, TypeVar

import torch
from transformers.cache_utils import CacheLayerMixin

from kvsieve.engine.attention import SieveMask, UnsupportedModelError, claim_mask, hand_over
from kvsieve.engine.compiled import compiled_decode, compiled_victims, decodes_by_rule
from kvsieve.engine.plan import PolicyPlan, StepMemo
from kvsieve.engine.quant import PLAIN, Codec, KVQuant, Residual, past
from kvsieve.engine.rope import Rotary, ranks
from kvsieve.engine.scan import run_length, scan, scannable
from kvsieve.engine.slot_attention import (
    AttentionArgs,
    Exact,
    Visibility,
    decided_attention,
    fused_attention,
    observed_attention,
)
from kvsieve.engine.storage import SlotStore, expand_index
from kvsieve.engine.stream import chunk_positions, plan_chunks
from kvsieve.policies import Policy, Slots
from kvsieve.policies.base import ScoreRule, demote

T = TypeVar("T")


@dataclass
class Chunk:
    """Tokens of a step: queries ``[B, Hq, c, D]``, keys and values ``[B, H, c, D]``, validity ``[B, c]``."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor | None

    def __getitem__(self, span: slice) -> Chunk:
        return Chunk(
            self.query[:, :, span],
            self.keys[:, :, span],
            self.values[:, :, span],
            None if self.padding is None else self.padding[:, span],
        )


@dataclass
class Recording:
    """A recording layer's state before its recorded tokens, and those tokens (see :meth:`SieveLayer.crop`)."""

    store: SlotStore
    newest: torch.Tensor
    tokens_seen: int
    tokens: list[tuple[Chunk, AttentionArgs]] = field(default_factory=list)


class SieveLayer(CacheLayerMixin):
    """One layer of a :class:`SieveCache` (see the module docstring)."""

    is_compileable = False
    is_croppable = True  # what activate_past_recording() records, crop() rolls back exactly
    supports_early_init = False  # the policy (and its state) is known only at the first update

    def __init__(
        self,
        plan: PolicyPlan,
        memo: StepMemo,
        layer_idx: int,
        is_sliding: bool = False,
        codec: Codec = PLAIN,
        kernels: bool = False,
    ) -> None:
        self.store: SlotStore | None = None
        self.codec = codec
        super().__init__()
        self.plan, self.memo = plan, memo
        self.layer_idx = layer_idx
        self.is_sliding = is_sliding
        self.kernels = kernels  # whether steps run the compiled loops where they apply (kvsieve.engine.compiled)
        self.policy: Policy | None = None
        self.newest: torch.Tensor | None = None  # [B] position of each row's newest real token (-1: none yet)
        self.tokens_seen = 0  # padding included: positions of the model are derived from it
        self.eviction_rounds = 0  # never reset, so never reused (positional layers share decisions by round)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.streaming = False
        self.rotary: Rotary | None = None
        self.prompt_tokens: int | None = None  # the first step's prompt length, if given (set_prompt_length)
        self.record_past = False  # transformers' name: steps are recorded until crop() commits or rolls them back
        self.recording: Recording | None = None
        self.decoding = False  # past the prompt: the slot limit is the decode budget's (PolicyPlan.limit)
        self.victims: torch.Tensor | None = None  # [B, H, 1]: where compiled steps write victims (_victims_buffer)
        self.ranked: torch.Tensor | None = None  # [B, H, N]: the slots in position order (_ranked_buffer)

    # -- transformers' layer contract ---------------------------------------------------------------------------

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys held ``[B, H, slots, D]`` (None before the first step): the buffer itself, or dequantized."""
        return None if self.store is None else self._held_kv()[0]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._set_held("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The values held ``[B, H, slots, D]`` (None before the first step): the buffer itself, or dequantized."""
        return None if self.store is None else self._held_kv()[1]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._set_held("values", value)

    def _held_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        store = self.store
        if store.quantized:
            return store.decoded()
        return store.kv["keys"], store.kv["values"]

    def _set_held(self, name: str, value: torch.Tensor | None) -> None:
        if value is None:
            return
        if self.store.quantized:
            raise ValueError(f"layer {self.layer_idx} holds quantized slots: its {name} cannot be set")
        self.store.kv[name] = value

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if isinstance(self.codec, KVQuant):
            self.codec.check(key_states.shape[-1])
        self.store = SlotStore.empty(
            key_states, value_states, self.policy.state_spec(), self._store_limit(), self.codec
        )
        self.newest = torch.full((key_states.shape[0],), -1, dtype=torch.long, device=self.device)
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
        elif key_states.shape[0] != self.store.positions.shape[0]:
            raise ValueError(
                f"batch size changed from {self.store.positions.shape[0]} to {key_states.shape[0]}; use a new cache "
                "or reset()"
            )
        elif key_states.shape[1] != self.store.positions.shape[1] or key_states.shape[-1] != self.store.head_dim:
            heads, dim = self.store.positions.shape[1], self.store.head_dim
            raise ValueError(
                f"layer {self.layer_idx} holds {heads} KV heads of dim {dim}, the model "
                f"gives {key_states.shape[1]} of dim {key_states.shape[-1]}: a cache serves one model; make one for "
                "this model with kvsieve.make_cache"
            )
        self.tokens_seen += key_states.shape[-2]
        self.pending = (key_states, value_states)
        hand_over(self, key_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        claim_mask(self.tokens_seen + query_length)
        return self.tokens_seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen so far (not tokens kept): positions are derived from it."""
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = self.newest = self.policy = self.pending = None
        self.prompt_tokens = self.recording = None
        self.tokens_seen = 0
        self.decoding = False
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def join(self, other: SieveLayer) -> None:
        """Append the rows of ``other`` (the same layer of a cache with the same plan) to this layer's: each row keeps
        its tokens, positions and policy state (:meth:`SlotStore.concat`). ``tokens_seen`` becomes the larger one:
        feed a joined batch its position ids (each row's own)."""
        if not (self.is_initialized and other.is_initialized):
            raise ValueError("only layers that hold tokens can be joined (run each prompt first)")
        self.store = SlotStore.concat([self.store, other.store])
        self.newest = torch.cat([self.newest, other.newest])
        self.tokens_seen = max(self.tokens_seen, other.tokens_seen)
        self.recording = None

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
        recording, tokens = self.recording, -tokens_to_remove
        recorded = 0 if recording is None else len(recording.tokens)
        if tokens > recorded:
            raise ValueError(
                f"cannot remove the last {tokens} tokens of layer {self.layer_idx}: kvsieve rolls back only the "
                f"{recorded} token(s) fed after a prompt since cache.activate_past_recording() (transformers calls it "
                "for assisted generation and prompt lookup) or since the last crop"
            )
        self.recording = None
        if tokens == 0:
            return
        replay = recording.tokens[: recorded - tokens]
        self.store, self.newest = recording.store, recording.newest
        self.tokens_seen = recording.tokens_seen + len(replay)
        for offset, (chunk, args) in enumerate(replay):
            self._step(chunk, args, offset=offset)

    def export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The layer's held tokens (keys, values, positions, policy state: the slots in use only) and newest
        positions as tensors, and its counters, for :meth:`restore` (saved contexts)."""
        if self.store is None:
            raise ValueError(f"layer {self.layer_idx} holds nothing yet")
        store = self.store
        store.code_pending()  # (saved codes are complete: a restored layer starts with every token coded)
        if store.stale is not None:
            store = store.copy()
            store.compact()
        n = store.used
        residual = {} if store.residual is None else {"residual": store.residual.kv}
        tensors = {
            **{name: t[:, :, :n] for name, t in store.kv.items()},
            **residual,
            "positions": store.positions[:, :, :n],
            "newest": self.newest.clone(),  # (layers share it)
            **{f"state.{name}": t[:, :, :n] for name, t in store.state.items()},
        }
        counters = {
            "tokens_seen": self.tokens_seen,
            "eviction_rounds": self.eviction_rounds,
            "may_hold_padding": store.may_hold_padding,
            "decoding": self.decoding,
            "dtype": str(store.dtype).removeprefix("torch."),
        }
        return {name: t.contiguous() for name, t in tensors.items()}, counters

    def restore(self, tensors: dict[str, torch.Tensor], counters: dict[str, Any], prompt_len: int) -> None:
        """Hold what :meth:`export` gave (the policy resolved against a prompt of ``prompt_len`` tokens)."""
        self.reset()
        self.policy = self.plan.resolve(prompt_len)[self.layer_idx]
        codec = self.codec
        residual = ("residual",) if codec.residual else ()
        needed = {*codec.names(), *residual, "positions", "newest"} | {f"state.{n}" for n in self.policy.state_spec()}
        missing = [name for name in sorted(needed) if name not in tensors]
        if missing:
            raise ValueError(
                f"layer {self.layer_idx} misses {', '.join(missing)} for policy {self.policy.name} with {codec}"
            )
        positions = tensors["positions"]
        self.device = positions.device
        self.dtype = getattr(torch, counters["dtype"]) if "dtype" in counters else tensors["keys"].dtype
        self.decoding = bool(counters["decoding"])
        self.store = SlotStore(
            kv={name: tensors[name] for name in codec.names()},
            positions=positions,
            state={name: tensors[f"state.{name}"] for name in self.policy.state_spec()},
            limit=self._store_limit(),
            used=positions.shape[2],
            may_hold_padding=bool(counters["may_hold_padding"]),
            codec=codec,
            residual=Residual(tensors["residual"], codec.residual, past(positions)) if residual else None,
            dtype=self.dtype,
        )
        self.newest = tensors["newest"]
        self.tokens_seen = int(counters["tokens_seen"])
        self.eviction_rounds = int(counters["eviction_rounds"])
        self.is_initialized = True

    # -- the step -----------------------------------------------------------------------------------------------

    def discard_step(self) -> None:
        """Forget the step :meth:`update` took (its attention was refused before anything was computed)."""
        if self.pending is None:
            return
        self.tokens_seen -= self.pending[0].shape[-2]
        self.pending = None
        if self.tokens_seen == 0:  # nothing was cached yet: back to a fresh layer (a ratio budget resolves again)
            self.reset()
            self.plan.reset()

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: SieveMask, args: AttentionArgs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the pending step: ``query`` ``[B, Hq, q, D]`` → the output of the same shape and, with
        ``args.weights``, the attention probabilities ``[B, Hq, q, tokens seen]`` laid out as over a
        ``DynamicCache`` (column = the token's index in the padded sequence; evicted tokens get 0).

        The step's chunks (:func:`~kvsieve.engine.stream.plan_chunks`) are each stored, attended, observed and
        evicted before the next. While recording, the tokens after a prompt are kept, with the layer's state before
        the first of them, until :meth:`crop`.
        """
        (new_keys, new_values), self.pending = self.pending, None
        q = new_keys.shape[2]
        # The step's first tokens that are a prompt: all of a first step, unless set_prompt_length said fewer.
        prompt = (q if self.prompt_tokens is None else min(self.prompt_tokens, q)) if self.tokens_seen == q else 0
        self.prompt_tokens = None
        self._enter_phase(decoding=prompt == 0)
        padding = mask.new_tokens(q)
        step = Chunk(query, new_keys, new_values, None if padding is None else padding.to(self.device))
        columns = self._columns(mask.padding) if args.weights else None
        if q == 1 and not self.record_past:  # (a decode step: one chunk, nothing to plan)
            self.recording = None
            out = self._step(step, args, columns=columns)
            self._enter_phase(decoding=True)  # (a one-token prompt is done)
            return out
        chunks = plan_chunks(
            q,
            prompt,
            stream=self.streaming,
            decode=self.record_past,
            policy=self.policy,
            limit=self.limit,
            held=self.store.used,
            rolling=self.rotary is not None,
        )
        if not self.record_past:
            self.recording = None
        outputs, pairs, i = [], list(pairwise(chunks.bounds)), 0
        while i < len(pairs):
            start, end = pairs[i]
            if start >= prompt:
                self._enter_phase(decoding=True)
            run = self._run(pairs, i, step, args)
            if run > 1:  # single tokens, scanned together
                end = pairs[i + run - 1][1]
                outputs.append((scan(self, step[start:end], args), None))
                i += run
                continue
            chunk = step if len(chunks.bounds) == 2 else step[start:end]  # (a decode step: no slicing)
            if self.record_past and start >= prompt:  # (a single token: see plan_chunks)
                if self.recording is None:
                    self.recording = Recording(self.store.copy(), self.newest.clone(), self.tokens_seen - q + start)
                self.recording.tokens.append((chunk, args))
            outputs.append(self._step(chunk, args, chunks.closed_form, start, columns))
            i += 1
        self._enter_phase(decoding=True)  # (the prompt is done)
        outs, weights = zip(*outputs, strict=True)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        if not args.weights:
            return out, None
        return out, weights[0] if len(weights) == 1 else torch.cat(weights, dim=2)

    def _run(self, pairs: list[tuple[int, int]], i: int, step: Chunk, args: AttentionArgs) -> int:
        """How many chunks from ``pairs[i]`` on are single tokens to scan together (:mod:`kvsieve.engine.scan`);
        1 when ``pairs[i]`` is to be stepped alone."""
        if self.record_past or pairs[i][1] - pairs[i][0] != 1:
            return 1
        run = 1
        while i + run < len(pairs) and pairs[i + run][1] - pairs[i + run][0] == 1:
            run += 1
        if run < 2:  # (a decode step)
            return 1
        run = min(run, run_length(self, step.query, run))
        start = pairs[i][0]
        if run < 2 or not scannable(self, step[start : start + run], args):
            return 1
        return run

    def _step(
        self,
        chunk: Chunk,
        args: AttentionArgs,
        closed_form: bool = False,
        offset: int = 0,
        columns: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk, its tokens starting at index ``offset`` of the step's: store → attend → observe → evict.
        Returns its output and, with ``args.weights``, its probabilities by column (see :meth:`_columns`)."""
        store, policy = self.store, self.policy
        q = chunk.keys.shape[2]
        slots, query_pos, start = self._store_chunk(chunk.keys, chunk.values, chunk.padding, offset)
        keys, values, query, exact = slots.keys, slots.values, chunk.query, None
        if q > 1 and store.step is not None and store.step.exact is not None:
            # Quantized slots with a residual: each query reads its own recent tokens exactly (quant.recent).
            keys, values = store.step.keys, store.step.values
            exact = Exact(store.step.exact_keys, store.step.exact_values, store.codec.residual)
        if self.rotary is not None:  # keys are stored un-rotated; re-rotated by rank (position rolling)
            rank = ranks(slots.pos)
            query = self._rolled_query(rank, query, query_pos, slice(start, start + q), keys.shape[1])
            keys = self.rotary.rotate(keys, rank)
            if exact is not None:
                exact = Exact(self.rotary.rotate(exact.keys, rank), exact.values, exact.residual)
        seen = Visibility(
            restrict=policy.stream_visible if closed_form and q > 1 else None,
            all_visible=q == 1 and chunk.padding is None and args.window is None and not store.may_hold_padding,
            causal_tail=not policy.observes_all_slots,  # (the chunk's tokens are the last q slots, in order)
        )
        weights = None
        observes = self.observes
        decided = victim = None
        if (
            observes
            and seen.all_visible
            and not (args.explicit or exact)
            and self.kernels
            and decodes_by_rule(policy.rule, keys.device)
        ):
            decided = self._decide_by_rule(query, keys, values, slots, args)
        if decided is not None:
            out, victim = decided
        elif observes or policy.narrows or args.explicit or exact is not None:
            observe = (lambda obs: policy.observe(slots.prefix(obs.key_pos.shape[-1]), obs)) if observes else None
            narrow = policy.narrow if policy.narrows else None
            # The rows before those the policy observes need no probabilities: the fused kernel attends them over
            # the slots before the chunk's later tokens (which they cannot see).
            rows = policy.observed_rows() if observes and not (args.explicit or exact) else None
            head = 0 if rows is None else max(0, q - rows)
            outs = []
            if head:
                before = keys.shape[2] - (q - head)
                early = (t[:, :, :before] for t in (keys, values, slots.pos))
                outs.append(fused_attention(query[:, :, :head], *early, query_pos[:, :head], args, seen))
            if head < q:
                late = (query[:, :, head:], keys, values, slots.pos, query_pos[:, head:], args, seen)
                out, weights = observed_attention(*late, observe, narrow, exact, step_rows=q)
                outs.append(out)
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        else:
            out = fused_attention(query, keys, values, slots.pos, query_pos, args, seen)
        if weights is not None:
            weights = _by_column(weights, slots.pos, columns, self.tokens_seen)
        self._evict(slots, victim)
        store.release()
        return out, weights

    def _store_chunk(
        self, keys: torch.Tensor, values: torch.Tensor, padding: torch.Tensor | None, offset: int
    ) -> tuple[Slots, torch.Tensor, int]:
        """Store a chunk's tokens (keys and values ``[B, H, q, D]``, validity ``[B, q]``; starting at index
        ``offset`` of the step's) after the held ones: the view of the slots in use, the chunk's query positions
        ``[B, q]`` (-1 = padding) and the slot of its first token."""
        store = self.store
        q, heads = keys.shape[2], keys.shape[1]
        if store.stale is not None and q > 1:
            store.compact()
        query_pos, self.newest, new_pos = self.memo.share(
            "positions",
            (self.tokens_seen, offset, q, heads),
            lambda: chunk_positions(self.newest, padding, q, heads),
        )
        store.may_hold_padding |= padding is not None
        keys = keys if self.rotary is None else self.rotary.rotate(keys, -query_pos[:, None, :])
        start = store.append(
            keys,
            values,
            new_pos,
            self.policy.initial_state(keys, new_pos),
            self.newest,
            padding is not None,
            self._expand_stale,
        )
        return store.view(self.newest), query_pos, start

    @property
    def observes(self) -> bool:
        """Whether the step hands the policy its attention. Once a bounded policy's layer may grow without limit,
        nothing is evicted again: its statistics would never be used. A policy that never evicts observes all the
        same (the profiled schedule's Coverage measures)."""
        policy = self.policy
        return policy.needs_attention and not policy.narrows and (self.limit is not None or not policy.bounded)

    def unshared(self) -> str | None:
        """Why the pending step cannot be stored as a shared prompt's (:meth:`store_prompt`); None if it can."""
        if self.tokens_seen != self.pending[0].shape[2] or self.prompt_tokens not in (None, self.tokens_seen):
            return "a shared prompt fills an empty layer, all of it a prompt"
        if self.streaming or self.rotary is not None or isinstance(self.codec, KVQuant) or self.record_past:
            return "a shared prompt needs plain slots (no stream protocol, position rolling, quantization or recording)"
        return None

    def store_prompt(self) -> Slots:
        """Store the pending step — a whole prompt over an empty layer of plain slots (:meth:`unshared`) — without
        attending: the view of its slots, whose policy observes attention computed elsewhere
        (:class:`~kvsieve.engine.shared.SharedPrompt`) before :meth:`close_prompt`."""
        (keys, values), self.pending = self.pending, None
        self.prompt_tokens = None
        return self._store_chunk(keys, values, None, 0)[0]

    def close_prompt(self, slots: Slots) -> None:
        """Evict after :meth:`store_prompt` and its observations: the layer is then as a prompt step leaves it."""
        self._evict(slots)
        self.store.release()
        self._enter_phase(decoding=True)

    def _decide_by_rule(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: Slots, args: AttentionArgs
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A decode step over real slots whose observation (and victim) the policy states as a rule
        (:func:`compiled_decode`: a ``ScoreRule``'s score and victim, ``LowMarks``' marks in one compiled call).
        Returns the output and the victim (None when no single slot goes or the policy chooses it); None where that
        does not apply (autograd; a policy that observes none of the step's rows) and the step attends, observes and
        chooses in torch."""
        if query.requires_grad or self.policy.observed_rows() == 0:
            return None
        used, rule = self.store.used, self.policy.rule
        evict = self.n_keep(used) == used - 1
        victims = self._victims_buffer(keys)
        scale = None
        if isinstance(rule, ScoreRule) and rule.logit_scale is not None:  # (made once for the layers of equal rules)
            scale = self.memo.derive(
                ("logit_scale", rule.logit_scale), slots.last, lambda: rule.logit_scale(slots.last[:, None])[:, 0]
            )
        ranked = self._ranked_buffer(slots.pos) if isinstance(rule, ScoreRule) and rule.pool else None
        out, ruled = decided_attention(
            query,
            keys,
            values,
            args.scaling,
            lambda logits: compiled_decode(rule, logits, slots, evict, victims, scale, ranked),
        )
        return out, victims if evict and ruled is not None else None

    def _victims_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The layer's buffer of victims ``[B, H, 1]`` (``like``: ``[B, H, ...]``; int64, on CPU), where a compiled
        step writes them: rewritten at every step, so the stale slot it becomes is expanded once
        (:meth:`_expand_stale`). Not for the decisions a positional group shares: each of its layers holds the victim
        until its own next token is written."""
        victims = self.victims
        if victims is None or victims.shape[:2] != like.shape[:2]:
            victims = self.victims = torch.zeros((*like.shape[:2], 1), dtype=torch.long)
        return victims

    def _ranked_buffer(self, pos: torch.Tensor) -> torch.Tensor:
        """The layer's slots in position order ``[B, H, N]`` as a pooling rule's compiled decode step left them (int64,
        on CPU; ``pos``: the positions of the slots in use), or, new, -1 (sorted at the first step)."""
        ranked = self.ranked
        if ranked is None or ranked.shape != pos.shape:
            ranked = self.ranked = torch.full(pos.shape, -1, dtype=torch.long)
        return ranked

    def _expand_stale(self, stale: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The stale slots expanded over slot tensor ``t``'s trailing dimensions; a victim the layers of a positional
        group share (:meth:`shared_decision`) is expanded once for all of them, a layer's own buffer of victims
        (:attr:`victims`) once for all steps."""
        group = self.plan.groups[self.layer_idx]
        owner = ("layer", self.layer_idx) if group is None else ("group", group)
        return self.memo.derive(("stale", owner, t.shape[3:]), stale, lambda: expand_index(stale, t))

    def _rolled_query(
        self, rank: torch.Tensor, query: torch.Tensor, query_pos: torch.Tensor, new: slice, kv_heads: int
    ) -> torch.Tensor:
        """The queries rotated by the rank ``rank[..., new]`` of their own slots (their keys are rotated by rank)."""
        query_rank = rank[:, :, new].repeat_interleave(query.shape[1] // kv_heads, dim=1)
        return self.rotary.rotate(query, query_rank - query_pos[:, None, :])

    def _evict(self, slots: Slots, victim: torch.Tensor | None = None) -> None:
        """Evict down to the policy's ``n_keep`` (``slots``: the view of the slots in use; ``victim``: the slot per
        (row, head) already chosen when one goes)."""
        self.eviction_rounds += 1
        store, policy = self.store, self.policy
        target, rows = self.n_keep(store.used), None
        if policy.counts_rows and store.may_hold_padding:  # each row's target from its own count of tokens
            rows = [self.n_keep(count) for count in (slots.pos[:, 0] >= 0).sum(dim=-1).tolist()]
            target = max(rows)
        if target >= store.used:
            return
        if rows is not None:
            chosen, evicted = self._choose_per_row(slots, rows, target)
            store.keep(chosen)
            store.positions[:, :, :target].masked_fill_(evicted, -1)  # (holes where a row keeps fewer)
        else:
            chosen = (
                victim
                if victim is not None
                else self.shared_decision(self.eviction_rounds, lambda: self._choose(slots, target))
            )
            if store.used - target == 1:
                store.drop(chosen, leave_stale=not store.may_hold_padding and self.rotary is None)
                store.settle(single=True)
                return
            store.keep(chosen)
        store.settle()

    def shared_decision(self, round_: Hashable, choose: Callable[[], T]) -> T:
        """``choose()``, or the decision the layer's positional group made for eviction round ``round_``
        (:meth:`~kvsieve.engine.plan.StepMemo.decide`)."""
        group = self.plan.groups[self.layer_idx]
        return self.memo.decide(group, round_, choose, self.plan.group_sizes[group])

    @property
    def limit(self) -> int | None:
        """The most tokens the layer holds after a step now (the prompt's budget, or the decode budget's limit after
        the prompt; None: no bound)."""
        return self.plan.limit(self.layer_idx, self.decoding)

    def n_keep(self, n: int) -> int:
        """The policy's ``n_keep`` under the current :attr:`limit`."""
        limit = self.limit
        return n if limit is None else self.policy.n_keep(n, limit)

    def _store_limit(self) -> int | float:
        """Slots the store may allocate: the limit and a spare one for the next decode token."""
        limit = self.limit
        return float("inf") if limit is None else limit + 1

    def _enter_phase(self, decoding: bool) -> None:
        """Past the prompt (``decoding``) or not: the slot limit follows (:meth:`PolicyPlan.limit`)."""
        if decoding != self.decoding:
            self.decoding = decoding
            self.store.limit = self._store_limit()

    def _scores(self, slots: Slots) -> torch.Tensor:
        """The policy's priorities, padding and empty slots lowest."""
        scores = self.policy.keep_scores(slots)
        return demote(scores, slots.pos < 0) if self.store.may_hold_padding else scores

    def _choose(self, slots: Slots, target: int) -> torch.Tensor:
        """By the policy's priorities: the victim slot ``[B, H, 1]`` when one slot goes, else the ``target`` slots
        kept ``[B, H, target]``, in slot order."""
        if self.store.used - target == 1:
            out = self._victims_buffer(slots.pos) if self.plan.groups[self.layer_idx] is None else None
            padded = self.store.may_hold_padding
            victims = compiled_victims(self.policy.rule, slots, padded, out) if self.kernels else None
            return self._scores(slots).argmin(dim=-1, keepdim=True) if victims is None else victims
        scores = self._scores(slots)
        return scores.topk(target, dim=-1, sorted=False).indices.sort(dim=-1).values

    def _choose_per_row(self, slots: Slots, rows: list[int], target: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``target`` best slots ``[B, H, target]`` in slot order, and which of them go all the same ``[B, H,
        target]`` because their row keeps only its ``rows[b]`` best."""
        best = self._scores(slots).topk(target, dim=-1).indices  # best first
        beyond = torch.arange(target, device=best.device) >= torch.tensor(rows, device=best.device)[:, None, None]
        chosen, order = best.sort(dim=-1)
        return chosen, beyond.expand_as(best).gather(-1, order)

    def _columns(self, padding: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, tokens seen]``: the column of each row's token at each position (None: position = column)."""
        if padding is None:
            return None
        if padding.shape[1] != self.tokens_seen:
            raise ValueError(
                f"output_attentions with a kvsieve cache needs the attention mask of all {self.tokens_seen} tokens "
                f"seen, got one of {padding.shape[1]}"
            )
        return torch.argsort((~padding).to(torch.uint8), dim=1, stable=True).to(self.device)

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.recording = None  # (recorded steps cannot be rolled back across a change of the batch)
        if self.is_initialized:
            self.store.map_batch(fn)
            self.newest = fn(self.newest)

    # -- introspection ------------------------------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        """Layers of the model the cache was made for."""
        return len(self.plan.layer_policies)

    @property
    def capacity(self) -> int:
        """Allocated slots."""
        return 0 if self.store is None else self.store.capacity

    def held_positions(self) -> torch.Tensor:
        """``[B, H, tokens held]`` positions of the held tokens, in slot order (-1 = padding)."""
        if self.store is None:
            raise ValueError(f"layer {self.layer_idx} holds nothing yet")
        return self.store.held_positions()

    def kv_nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return 0 if self.store is None else self.store.kv_nbytes()

    def state_nbytes(self) -> int:
        """Bytes allocated for positions and policy state."""
        return 0 if self.store is None else self.store.state_nbytes() + self.newest.nbytes


def _by_column(weights: torch.Tensor, pos: torch.Tensor, columns: torch.Tensor | None, total: int) -> torch.Tensor:
    """Slot probabilities ``[B, Hq, b, N]`` laid out by column ``[B, Hq, b, total]`` (0 for tokens not held):
    ``pos`` ``[B, Hkv, N]`` are the slots' positions, ``columns`` maps positions to columns (None: identity)."""
    group = weights.shape[1] // pos.shape[1]
    held = pos.clamp(min=0)
    col = held if columns is None else columns.gather(1, held.flatten(1)).view_as(pos)
    col = col.repeat_interleave(group, dim=1)[:, :, None, :].expand_as(weights)
    real = (pos >= 0).repeat_interleave(group, dim=1)[:, :, None, :]
    return weights.new_zeros((*weights.shape[:3], total)).scatter_add_(3, col, weights * real)
