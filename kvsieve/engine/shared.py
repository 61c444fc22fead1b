"""Several kvsieve caches in one forward pass: a grid of settings pays for one model pass, not one per setting.

- :class:`SharedPrompt`: one prompt's forward pass fills several empty caches — any policies, budgets and decode
  budgets — each with the whole prompt or with its first ``end`` tokens. A prompt step attends with full attention
  and evicts after it (:class:`~kvsieve.engine.layer.SieveLayer`), so the pass's keys, values and outputs, and the
  attention each policy observes, are those of every cache alone: the pass computes them once, hands each policy
  its own rows of the same attention (the last ``observed_rows()`` of its ``end``, blocks in order, as its own step
  would), and each cache evicts by its own rule. Policies that observe alike over the same rows
  (:meth:`~kvsieve.policies.base.Policy.observes_as`: ``h2o`` and the ``h2o+`` policies at any budget, say) observe
  once: the others get a copy of the state. The attention is the explicit one over the rows any policy observes and
  the fused kernel over the rows none does, as a layer alone computes it: a cache alone computes the rows its policy
  skips with the fused kernel, so outputs and scores agree with running each cache alone up to the rounding of the
  two kernels (the tests check that the kept tokens and the answers are the same).
- :class:`StackedRows`: one batch whose rows are held by several caches (cache ``i`` holds the next ``B_i`` rows),
  each row at its own position (caches of different prompts stack): the model's layers run on the whole batch, and
  each cache attends, observes and evicts its own rows under its own policy. Rows are removed with
  ``batch_select_indices``; a cache left without rows leaves the batch.

A shared prompt's pass can be *recorded* (``SharedPrompt(..., record=True)``): every layer's attention inputs — the
queries, keys and values of the prompt, its mask and arguments — kept as a :class:`RecordedPass`. Another
:class:`SharedPrompt` over the same prompt then :meth:`~SharedPrompt.replay` s it: each layer stores the recorded
keys and values and attends the recorded queries, so its caches get the attention, observations and eviction of
that very pass without the model's layers running again (a grid whose caches do not fit in memory together pays
for one model pass, however many groups its settings take).

Both serve one forward pass each and refuse what they do not implement: padding and ``output_attentions`` in a
shared prompt (a policy that narrows attention narrows the keys of earlier steps: a prompt's are attended in full);
in a stack, a step whose position ids are not each row's next position (:meth:`StackedRows.position_ids`; they may
be left out where every row is at the same one) and a padding mask over caches that have seen different numbers of
tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvsieve.engine.attention import SieveMask, claim_mask, hand_over
from kvsieve.engine.cache import SieveCache
from kvsieve.engine.layer import SieveLayer
from kvsieve.engine.slot_attention import AttentionArgs, Visibility, fused_attention, observed_attention
from kvsieve.engine.step import observe_queries
from kvsieve.policies.base import Observation, Policy, Slots

__all__ = ["LayerInputs", "RecordedPass", "SharedPrompt", "StackedRows"]


@dataclass(frozen=True)
class LayerInputs:
    """What one layer's attention got in a prompt pass: the queries ``[1, Hq, q, D]``, keys and values
    ``[1, H, q, D]`` (as the model hands them over: rotated), the mask and the attention arguments."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    mask: SieveMask
    args: AttentionArgs


@dataclass(frozen=True)
class RecordedPass:
    """A :class:`SharedPrompt`'s forward pass, kept (``record=True``) for other caches of the same prompt
    (:meth:`SharedPrompt.replay`): each layer's :class:`LayerInputs`."""

    layers: tuple[LayerInputs, ...]

    @property
    def nbytes(self) -> int:
        """Bytes its tensors hold."""
        return sum(t.nbytes for step in self.layers for t in (step.query, step.keys, step.values))


def _layers_of(caches: Sequence[SieveCache]) -> list[list[SieveLayer]]:
    """Layer ``i`` of every cache, for each ``i`` (checked: at least one cache, all for models of as many layers)."""
    if not caches:
        raise ValueError("need at least one cache")
    for cache in caches:
        if not isinstance(cache, SieveCache):
            raise TypeError(f"expected kvsieve caches (kvsieve.make_cache), got {type(cache).__name__}")
    counts = {len(cache.layers) for cache in caches}
    if len(counts) > 1:
        raise ValueError(f"the caches were made for models of different depths ({sorted(counts)} layers)")
    return [list(layers) for layers in zip(*(cache.layers for cache in caches), strict=True)]


class _Together(CacheLayerMixin):
    """What the model and the kvsieve attention function need of a layer that stands for several."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, subs: list[SieveLayer]) -> None:
        super().__init__()
        self.subs = subs
        self.layer_idx = subs[0].layer_idx
        self.is_sliding = subs[0].is_sliding

    @property
    def n_layers(self) -> int:
        return self.subs[0].n_layers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True  # (each cache's layer initializes itself)

    def get_max_length(self) -> int:
        return -1

    def discard_step(self) -> None:
        for sub in self.subs:
            sub.discard_step()


class _SharedLayer(_Together):
    def __init__(self, subs: list[SieveLayer], ends: list[int | None], record: bool) -> None:
        super().__init__(subs)
        self.ends = ends
        self.tokens_seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.record = record
        self.recorded: LayerInputs | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = key_states.shape[-2]
        if self.tokens_seen:
            raise ValueError("a SharedPrompt serves one forward pass (the prompt); continue with each cache")
        too_long = [end for end in self.ends if end is not None and not 0 < end <= q]
        if too_long:
            raise ValueError(f"a cache's end must be in [1, {q}] (the prompt's tokens), got {too_long[0]}")
        self.lazy_initialization(key_states, value_states)
        for sub, end in zip(self.subs, self.ends, strict=True):
            sub.update(key_states[:, :, :end], value_states[:, :, :end])
        self.tokens_seen = q
        self.pending = (key_states, value_states)
        hand_over(self, key_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        claim_mask(self.tokens_seen + query_length)
        return self.tokens_seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def discard_step(self) -> None:
        super().discard_step()
        self.pending, self.tokens_seen = None, 0

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: SieveMask, args: AttentionArgs
    ) -> tuple[torch.Tensor, None]:
        keys, values = self.pending
        bsz, heads, q = keys.shape[:3]
        refused = next((why for why in map(SieveLayer.unshared, self.subs) if why is not None), None)
        if mask.new_tokens(q) is not None or args.weights:
            refused = "a SharedPrompt implements neither padding nor output_attentions"
        if refused is not None:
            self.discard_step()
            raise ValueError(refused)
        self.pending = None
        watchers = []  # (layer, its slots, its end, its first observed row)
        alike: dict[Hashable, Slots] = {}  # (what a policy observes, over which rows) → the slots of its observer
        copies = []  # (layer, its slots, its observer's slots)
        positions = torch.arange(q, device=keys.device)
        for sub, end in zip(self.subs, self.ends, strict=True):
            view = sub.store_prompt()
            if sub.policy.needs_queries and sub.limit is not None:
                end = q if end is None else end
                observe_queries(sub, view, query[:, :, :end], positions[:end].expand(bsz, end), args.scaling)
            if not sub.observes:  # (it evicts now: its prompt-sized buffer is not held through the attention)
                sub.close_prompt(view)
                continue
            end = q if end is None else end
            rows = sub.policy.observed_rows()
            first = 0 if rows is None else max(0, end - rows)
            like = sub.policy.observes_as()
            key = None if like is None else (like, sub.policy.reads_kv, end, first)
            if key in alike:
                copies.append((sub, view, alike[key]))
                continue
            if key is not None:
                alike[key] = view
            watchers.append((sub, view, end, first))
        key_pos, query_pos = positions.expand(bsz, heads, q), positions.expand(bsz, q)
        seen = Visibility(causal_tail=True)
        head = 0 if args.explicit else min((first for *_, first in watchers), default=q)
        outs = []
        if head:
            early = (keys[:, :, :head], values[:, :, :head], key_pos[..., :head])
            outs.append(fused_attention(query[:, :, :head], *early, query_pos[:, :head], args, seen))
        if head < q:
            done = head  # (the blocks come in order: the first row of the next one)

            def observe(obs: Observation) -> None:
                nonlocal done
                start, done = done, done + obs.query_pos.shape[1]
                for sub, view, end, first in watchers:
                    part = _rows(obs, start, max(first, start), min(end, done), end, sub.policy, view)
                    if part is not None:
                        sub.policy.observe(view.prefix(part.key_pos.shape[-1]), part)

            late = (query[:, :, head:], keys, values, key_pos, query_pos[:, head:], args, seen)
            outs.append(observed_attention(*late, observe, step_rows=q)[0])
        for _, view, observer in copies:
            for name, state in view.state.items():
                state.copy_(observer.state[name])
        for sub, view, *_ in [*watchers, *copies]:
            sub.close_prompt(view)
        if self.record:
            self.recorded = LayerInputs(query, keys, values, mask, args)
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), None


def _rows(obs: Observation, start: int, lo: int, hi: int, end: int, policy: Policy, view: Slots) -> Observation | None:
    """Rows ``lo:hi`` of ``obs`` (whose first row is row ``start`` of the prompt) as the step of a cache that took
    the prompt's first ``end`` tokens observes them: over its slots up to its own last token (all of them for a
    policy that reads keys or values), a step of ``end`` rows. None when ``obs`` has none of those rows."""
    if lo >= hi:
        return None
    cols = end if policy.reads_kv else min(obs.key_pos.shape[-1], end)
    have = obs.key_pos.shape[-1]
    if lo == start and hi - start == obs.query_pos.shape[1] and cols == have and end == obs.step_rows:
        return obs  # (all of it: the pass's slots are the cache's, positions and all)
    rows = slice(lo - start, hi - start)
    probs, logits = obs.probs[:, :, rows, :cols], obs.logits[..., rows, :cols]
    if cols > have:  # (keys no row of the block sees: probability 0, logit -inf)
        probs = torch.nn.functional.pad(probs, (0, cols - have))
        logits = torch.nn.functional.pad(logits, (0, cols - have), value=float("-inf"))
    mask = None if obs.mask is None or cols > have else obs.mask[:, :, rows, :cols]
    return replace(
        obs,
        probs=probs,
        logits=logits,
        query_pos=obs.query_pos[:, rows],
        step_rows=end,
        key_pos=view.pos[..., :cols],
        mask=mask,
    )


class SharedPrompt(Cache):
    """One forward pass of a prompt into several empty kvsieve caches (see the module docstring): cache ``i`` takes
    the prompt's first ``ends[i]`` tokens (default: all). After the pass each cache holds what a forward pass of its
    tokens alone would have left it; continue with each (or with several as :class:`StackedRows`). The pass's
    logits are those of the whole prompt: for a cache with a shorter ``end``, feed it the rest.

    >>> caches = [make_cache(model, "h2o", 0.25), make_cache(model, "snapkv", 0.5, decode_budget=None)]
    >>> shared = SharedPrompt(caches, ends=[None, 3000], record=True)
    >>> model(input_ids=ids, cache=shared, logits_to_keep=1)
    >>> SharedPrompt([make_cache(model, "tova", 0.25)]).replay(shared.recorded)  # (no second model pass)
    """

    def __init__(
        self, caches: Sequence[SieveCache], ends: Sequence[int | None] | None = None, record: bool = False
    ) -> None:
        layers = _layers_of(caches)
        ends = [None] * len(caches) if ends is None else list(ends)
        if len(ends) != len(caches):
            raise ValueError(f"{len(ends)} ends for {len(caches)} caches")
        for cache in caches:
            if cache.get_seq_length():
                raise ValueError("a SharedPrompt fills empty caches (use new ones, or reset())")
        super().__init__(layers=[_SharedLayer(subs, ends, record) for subs in layers])
        self.caches = list(caches)

    @property
    def recorded(self) -> RecordedPass:
        """The pass's attention inputs (made with ``record=True``, after its forward pass), to :meth:`replay`."""
        steps = [layer.recorded for layer in self.layers]
        if not self.layers[0].record:
            raise ValueError("this SharedPrompt records nothing: make it with record=True")
        if any(step is None for step in steps):
            raise ValueError("no forward pass was recorded: run the prompt through the model first")
        return RecordedPass(tuple(steps))

    def replay(self, recorded: RecordedPass) -> None:
        """Fill the caches from ``recorded`` — another SharedPrompt's pass over the same prompt — as this one's own
        forward pass would: each layer takes the recorded keys and values and attends the recorded queries (the same
        inputs: the same attention, observations and eviction), with no model pass. The pass's logits are the
        recorded pass's."""
        if len(recorded.layers) != len(self.layers):
            raise ValueError(
                f"a pass recorded over {len(recorded.layers)} layers cannot fill caches of {len(self.layers)}"
            )
        try:
            for layer, step in zip(self.layers, recorded.layers, strict=True):
                layer.update(step.keys, step.values)
                layer.attend(step.query, step.keys, step.values, step.mask, step.args)
        finally:
            hand_over(None, None)  # (no attention call takes what the layers handed over)


class _StackedLayer(_Together):
    def __init__(self, subs: list[SieveLayer], spans: list[slice], checks: bool = False) -> None:
        super().__init__(subs)
        self.spans = spans
        self.checks = checks  # (the first layer checks the step's position ids, which every layer gets alike)

    def position_ids(self, q: int) -> torch.Tensor:
        """``[B, q]``: the positions of each row's next ``q`` tokens (its newest position + 1, …)."""
        newest = torch.cat([sub.newest for sub in self.subs])
        return newest[:, None] + 1 + torch.arange(q, device=newest.device)

    def check(self, q: int, given: torch.Tensor | None) -> None:
        """Refuse a step of ``q`` tokens whose position ids are not each row's next positions (None, the model
        handing none to the cache: unless every row is at the same one); nothing is stored before."""
        want = self.position_ids(q)
        if given is None:
            ok = not bool((want != want[:1]).any())
        else:
            given = given.to(want.device)
            ok = given.shape[-1] == q and given.shape[0] in (1, len(want)) and torch.equal(given.expand_as(want), want)
        if not ok:
            got = "none (the model hands the cache no position ids)" if given is None else given.tolist()
            raise ValueError(
                "the position ids of a step over stacked rows at different positions must be each row's next ones: "
                f"pass position_ids=stack.position_ids({q}); got {got}"
            )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.checks:  # (the model hands update its attention keywords as ``kwargs``)
            self.check(key_states.shape[-2], (kwargs.get("kwargs") or {}).get("position_ids"))
        for sub, span in zip(self.subs, self.spans, strict=True):
            sub.update(key_states[span], value_states[span])
        hand_over(self, key_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.subs[0].get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.subs[0].get_seq_length()

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: SieveMask, args: AttentionArgs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask.padding is not None and len({sub.tokens_seen for sub in self.subs}) > 1:
            self.discard_step()
            raise ValueError("a padding mask cannot cover stacked caches that have seen different numbers of tokens")
        outs, weights = [], []
        for sub, span in zip(self.subs, self.spans, strict=True):
            padding = None if mask.padding is None else mask.padding[span]
            rows = SieveMask(padding, mask.window, mask.unsupported)
            out, w = sub.attend(query[span], key[span], value[span], rows, args)
            outs.append(out)
            weights.append(w)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out, None if weights[0] is None else torch.cat(weights)


class StackedRows(Cache):
    """One batch whose rows are held by several kvsieve caches, in order (see the module docstring): feed it the
    rows of the caches one after the other. The caches hold tokens; where their rows are at different positions
    (caches of different prompts), each step takes ``position_ids=stack.position_ids(q)``."""

    def __init__(self, caches: Sequence[SieveCache]) -> None:
        _layers_of(caches)
        if any(not cache.get_seq_length() for cache in caches):
            raise ValueError("stacked caches hold tokens: run each one's prompt first")
        self.caches = list(caches)
        self.rows = [cache.layers[0].store.positions.shape[0] for cache in caches]
        super().__init__(layers=self._stack())

    def _stack(self) -> list[_StackedLayer]:
        bounds = torch.tensor([0, *self.rows]).cumsum(0).tolist()
        spans = [slice(lo, hi) for lo, hi in pairwise(bounds)]
        return [_StackedLayer(subs, spans, checks=i == 0) for i, subs in enumerate(_layers_of(self.caches))]

    def position_ids(self, q: int = 1) -> torch.Tensor:
        """``[B, q]``: the positions of each row's next ``q`` tokens (its newest position + 1, …)."""
        return self.layers[0].position_ids(q)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (ascending): each cache keeps its own, and a cache left without rows leaves."""
        keep = [int(i) for i in torch.as_tensor(indices).flatten().tolist()]
        if keep != sorted(set(keep)) or (keep and not 0 <= keep[0] <= keep[-1] < sum(self.rows)):
            raise ValueError(f"rows to keep must be ascending indices of the {sum(self.rows)} rows, got {keep}")
        caches, rows, first = [], [], 0
        for cache, n in zip(self.caches, self.rows, strict=True):
            local = [i - first for i in keep if first <= i < first + n]
            first += n
            if not local:
                continue
            if len(local) < n:
                cache.batch_select_indices(torch.tensor(local))
            caches.append(cache)
            rows.append(len(local))
        if not caches:
            raise ValueError("a stack keeps at least one row")
        self.caches, self.rows = caches, rows
        self.layers = self._stack()
