"""One layer of a :class:`~kvsieve.engine.cache.SieveCache`: transformers' layer contract, and the step that runs
at every forward pass cut into chunks.

A step (one forward pass of ``q`` tokens through a layer) is:

1. ``get_mask_sizes`` (asked by transformers' masking utilities) claims the mask built next: a
   :class:`~kvsieve.engine.attention.SieveMask` (the padding mask and the layer's window), not a dense one;
2. ``update`` takes the new K/V and hands the layer over to the attention function;
3. ``attend`` (called by the attention function once it has checked every argument the model passes) cuts the
   step into chunks (:mod:`kvsieve.engine.stream`; one, but for the stream protocol), and runs each
   (:func:`~kvsieve.engine.step.run_step`: store → attend → observe → evict, :mod:`kvsieve.engine.eviction`), or a
   run of single tokens at once (:mod:`kvsieve.engine.scan`).

Speculative decoding records and rolls back in :mod:`kvsieve.engine.recording`; saved contexts export and restore
a layer with :mod:`kvsieve.engine.saved`.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvsieve.engine.attention import SieveMask, UnsupportedModelError, claim_mask, hand_over
from kvsieve.engine.eviction import evict
from kvsieve.engine.plan import PolicyPlan, StepMemo
from kvsieve.engine.quant import PLAIN, Codec, KVQuant
from kvsieve.engine.recording import Recording, record, roll_back
from kvsieve.engine.rope import Rotary
from kvsieve.engine.scan import run_length, scan, scannable
from kvsieve.engine.slot_attention import AttentionArgs
from kvsieve.engine.step import Chunk, columns_of, probe_step, run_step, store_chunk
from kvsieve.engine.storage import SlotStore
from kvsieve.engine.stream import plan_chunks
from kvsieve.policies import Policy, Slots


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
        self.numba = kernels  # whether eager steps run the compiled loops where they apply (kvsieve.engine.compiled)
        self.policy: Policy | None = None
        self.newest: torch.Tensor | None = None  # [B] position of each row's newest real token (-1: none yet)
        self.tokens_seen = 0  # padding included: positions of the model are derived from it
        self.eviction_rounds = 0  # never reset, so never reused (positional layers share decisions by round)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.streaming = False
        self.rotary: Rotary | None = None  # position rolling (SieveCache.enable_rolling)
        self.rope: Rotary | None = None  # the model's RoPE, for a policy that reads queries (Policy.needs_queries)
        self.prompt_tokens: int | None = None  # the first step's prompt length, if given (set_prompt_length)
        self.record_past = False  # transformers' name: steps are recorded until crop() commits or rolls them back
        self.recording: Recording | None = None
        self.decoding = False  # past the prompt: the slot limit is the decode budget's (PolicyPlan.limit)
        self.holding = False  # nothing evicted until compress_held() (SieveCache.hold)
        self.probing = False  # steps are probes: observed, then removed (SieveCache.probing)
        self.victims: torch.Tensor | None = None  # [B, H, 1]: compiled steps write victims here (victims_buffer)
        self.ranked: torch.Tensor | None = None  # [B, H, N]: the slots in position order (ranked_buffer)

    @property
    def kernels(self) -> bool:
        """Whether this step runs the compiled loops where they apply: as the cache was made (``kernels``), in eager
        steps; never under ``torch.compile``, which traces the policies' torch code (the same decisions)."""
        return self.numba and not torch.compiler.is_compiling()

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
        if not store.direct:
            return store.decoded()
        return store.kv["keys"], store.kv["values"]

    def _set_held(self, name: str, value: torch.Tensor | None) -> None:
        if value is None:
            return
        if not self.store.direct:
            raise ValueError(f"layer {self.layer_idx} holds quantized or packed slots: its {name} cannot be set")
        self.store.kv[name] = value

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if isinstance(self.codec, KVQuant):
            self.codec.check(key_states.shape[-1])
        self.store = SlotStore.empty(key_states, value_states, self.policy.state_spec(), self.store_limit(), self.codec)
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
        probed = self.plan.probed if self.tokens_seen == 0 else None
        if probed is not None and not self.holding:  # (refused at the first layer, before anything is stored)
            raise ValueError(
                f"{probed.name} scores a context by passes of its own before compressing it: compress it with "
                "kvsieve.compress_context (kvsieve.qa.compress, kvsieve ruler's agnostic protocol)"
            )
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
        self.decoding = self.holding = self.probing = False
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

    def activate_past_recording(self, **kwargs: object) -> None:
        """Record the next steps, so that :meth:`crop` can roll them back (transformers calls it before assisted
        generation and prompt lookup); each step after the first is then processed one token at a time. ``kwargs``
        (``recurrent_states_to_keep``: how many recurrent states a linear-attention layer records) concern no slot
        of an attention layer."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens fed since recording began or since the last ``crop``,
        exactly (:func:`~kvsieve.engine.recording.roll_back`); ``crop(0)`` commits the recorded tokens."""
        roll_back(self, tokens_to_remove)

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
        if self.codec is not PLAIN and torch.compiler.is_compiling():
            raise ValueError("a compiled step over quantized slots is not supported; run it eagerly")
        (new_keys, new_values), self.pending = self.pending, None
        q = new_keys.shape[2]
        if self.probing:
            padding = mask.new_tokens(q)
            chunk = Chunk(query, new_keys, new_values, None if padding is None else padding.to(self.device))
            return probe_step(self, chunk, args), None
        # The step's first tokens that are a prompt: all of a first step, unless set_prompt_length said fewer.
        prompt = (q if self.prompt_tokens is None else min(self.prompt_tokens, q)) if self.tokens_seen == q else 0
        self.prompt_tokens = None
        self.enter_phase(decoding=prompt == 0)
        padding = mask.new_tokens(q)
        step = Chunk(query, new_keys, new_values, None if padding is None else padding.to(self.device))
        columns = columns_of(self, mask.padding) if args.weights else None
        if q == 1 and not self.record_past:  # (a decode step: one chunk, nothing to plan)
            self.recording = None
            out = run_step(self, step, args, columns=columns)
            self.enter_phase(decoding=True)  # (a one-token prompt is done)
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
                self.enter_phase(decoding=True)
            run = self._run(pairs, i, step, args)
            if run > 1:  # single tokens, scanned together
                end = pairs[i + run - 1][1]
                outputs.append((scan(self, step[start:end], args), None))
                i += run
                continue
            chunk = step if len(chunks.bounds) == 2 else step[start:end]  # (a decode step: no slicing)
            if self.record_past and start >= prompt:  # (a single token: see plan_chunks)
                record(self, chunk, args, self.tokens_seen - q + start)
            outputs.append(run_step(self, chunk, args, chunks.closed_form, start, columns))
            i += 1
        self.enter_phase(decoding=True)  # (the prompt is done)
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

    @property
    def observes(self) -> bool:
        """Whether the step hands the policy its attention. Once a bounded policy's layer may grow without limit,
        nothing is evicted again: its statistics would never be used (nor while the layer is held, but for a probe,
        which is observed for what it tells of the held tokens). A policy that never evicts observes all the same (the
        profiled schedule's Coverage measures)."""
        policy = self.policy
        bound = self.probing or self.limit is not None or not policy.bounded
        return policy.needs_attention and not policy.narrows and bound

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
        return store_chunk(self, keys, values, None, 0)[0]

    def close_prompt(self, slots: Slots) -> None:
        """Evict after :meth:`store_prompt` and its observations: the layer is then as a prompt step leaves it."""
        evict(self, slots)
        self.store.release()
        self.enter_phase(decoding=True)

    @property
    def limit(self) -> int | None:
        """The most tokens the layer holds after a step now (the prompt's budget, or the decode budget's limit after
        the prompt; None: no bound, or held until :meth:`compress_held`)."""
        return None if self.holding else self.plan.limit(self.layer_idx, self.decoding)

    def compress_held(self) -> None:
        """End a hold (:meth:`SieveCache.hold`): evict what the layer holds down to its prompt budget, as a prompt
        step evicts at its end (by the policy's priorities after everything it observed since the hold began)."""
        self.holding = False
        if self.store is None:
            return
        self.decoding = False  # (the held tokens are compressed as a prompt is)
        self.store.limit = self.store_limit()
        if self.store.stale is not None:
            self.store.compact()
        evict(self, self.store.view(self.newest))
        self.store.release()
        self.enter_phase(decoding=True)

    def n_keep(self, n: int) -> int:
        """The policy's ``n_keep`` under the current :attr:`limit`."""
        limit = self.limit
        return n if limit is None else self.policy.n_keep(n, limit)

    def store_limit(self) -> int | float:
        """Slots the store may allocate: the limit and a spare one for the next decode token."""
        limit = self.limit
        return float("inf") if limit is None else limit + 1

    def enter_phase(self, decoding: bool) -> None:
        """Past the prompt (``decoding``) or not: the slot limit follows (:meth:`PolicyPlan.limit`)."""
        if decoding != self.decoding:
            self.decoding = decoding
            self.store.limit = self.store_limit()

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

    def held_state(self) -> dict[str, torch.Tensor]:
        """The policy's per-slot state of the held tokens (``state_spec``'s names), ``[B, H, tokens held, ...]`` each,
        in slot order (the order of :meth:`held_positions`)."""
        if self.store is None:
            raise ValueError(f"layer {self.layer_idx} holds nothing yet")
        return self.store.held_state()

    def kv_nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return 0 if self.store is None else self.store.kv_nbytes()

    def state_nbytes(self) -> int:
        """Bytes allocated for positions and policy state."""
        return 0 if self.store is None else self.store.state_nbytes() + self.newest.nbytes
