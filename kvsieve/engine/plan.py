"""Which policy each layer of a cache runs, and what the layers share within a step.

:class:`PolicyPlan` builds each layer's policy instance, resolving a ratio budget against the prompt length once
(every layer is validated before any is used). :class:`StepMemo` is what the layers of one cache compute once per
step and share: every layer sees the same tokens, so the positions of a one-chunk step (every decode step) are
computed by the first layer; layers whose policy is positional, of the same class, parameters and budget hold the
same positions at every step, so they evict the same slots: the first of them decides, the others take it. A
decision is kept until every layer of its group has taken it: a scanned stream makes several in one step, each layer
making all of its own before the next layer starts. A compiled step shares nothing (:func:`_shares`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, TypeVar

import torch

from kvsieve.engine.budget import Budget, check_budget, resolve_budget
from kvsieve.engine.schedules import split_budget
from kvsieve.policies import Policy

T = TypeVar("T")
SAME = "budget"
"""``decode_budget``'s default: decoding keeps the prompt's budget (the cache never grows)."""
DecodeBudget = Budget | None | Literal["budget"]


class PolicyPlan:
    """``layer_policies[i]``: the policy class of layer ``i``, its params and, for layers with a fixed size of their
    own (sliding-window layers), the budget they always use. The other layers (the policy layers) all get
    ``budget``, or, with ``weights`` (one per policy layer: a layer budget schedule), share the same total as
    :func:`~kvsieve.engine.schedules.split_budget` divides it.

    Budgets by phase: the prompt (a cache's first forward pass, or its first tokens, see
    :meth:`~kvsieve.engine.cache.SieveCache.set_prompt_length`) is compressed to ``budget``; afterwards each policy
    layer may grow by ``decode_budget - budget`` tokens (the same for every layer under a schedule; None: without
    bound; ``"budget"``: not at all). Sliding-window layers keep their window. A ratio resolves against the prompt
    like ``budget``."""

    def __init__(
        self,
        layer_policies: Sequence[tuple[type[Policy], Any, int | None]],
        budget: Budget | None,
        weights: Sequence[float] | None = None,
        decode_budget: DecodeBudget = SAME,
    ) -> None:
        self.layer_policies = list(layer_policies)
        self.budget = None if budget is None else check_budget(budget)
        if decode_budget is not None and decode_budget != SAME:
            if isinstance(decode_budget, str):
                raise ValueError(f"decode_budget must be tokens, a ratio, None or 'budget', got {decode_budget!r}")
            check_budget(decode_budget)
        narrowing = next((cls.name for cls, *_ in self.layer_policies if cls.narrows), None)
        if narrowing is not None and decode_budget != SAME:
            raise ValueError(
                f"{narrowing} takes no decode_budget: its queries see the budget's worth of earlier keys, as those of "
                "an eviction cache that never grows"
            )
        self.decode_budget = decode_budget
        self.growth: int | None = 0
        """Tokens each policy layer may grow by after the prompt (None: without bound), once resolved."""
        self.n_shared = sum(fixed is None for *_, fixed in self.layer_policies)
        if weights is not None and len(weights) != self.n_shared:
            raise ValueError(f"a layer schedule needs a weight per policy layer ({self.n_shared}), not {len(weights)}")
        self.weights = None if weights is None else list(weights)
        self.budget_tokens: int | None = None
        self.groups: list[Hashable | None] = []
        """Per layer: the key of its positional group (layers deciding alike), None when it decides alone."""
        self.members: list[int] = []
        """Per layer: how many layers its positional group has (1 when it decides alone)."""
        self._policies: list[Policy] | None = None
        if not self._ratio:
            self.resolve(0)

    @property
    def _ratio(self) -> bool:
        """Whether a budget is a ratio of the prompt (resolved at the first prompt)."""
        return isinstance(self.budget, float) or isinstance(self.decode_budget, float)

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
            self.groups = [
                (cls, id(params), policy.budget) if policy.positional else None
                for (cls, params, _), policy in zip(self.layer_policies, policies, strict=True)
            ]
            sizes = Counter(self.groups)
            self.members = [1 if group is None else sizes[group] for group in self.groups]
            self.budget_tokens = tokens
            self.growth = self._growth(tokens, prompt_len)
        return self._policies

    def _growth(self, tokens: int | None, prompt_len: int) -> int | None:
        """Tokens each policy layer may grow by after the prompt, ``decode_budget`` resolved (see the class)."""
        if tokens is None or self.decode_budget == SAME:
            return 0
        if self.decode_budget is None:
            return None
        decode = resolve_budget(self.decode_budget, prompt_len)
        if decode < tokens:
            raise ValueError(
                f"decode_budget ({decode} tokens) must be at least the budget ({tokens} tokens), or None for "
                "unbounded growth"
            )
        return decode - tokens

    def set_budget(self, layer_idx: int, tokens: int) -> Policy:
        """Give policy layer ``layer_idx`` a budget of its own, ``tokens`` (a selection over all layers chose it:
        :meth:`~kvsieve.engine.cache.SieveCache.compress`); its policy, made anew (validated), is returned."""
        cls, params, fixed = self.layer_policies[layer_idx]
        if fixed is not None or self._policies is None:
            raise ValueError(f"layer {layer_idx} has no budget to set (a fixed window, or not resolved yet)")
        if self._policies[layer_idx].budget != tokens:
            self._policies[layer_idx] = cls(tokens, params)
        return self._policies[layer_idx]

    def limit(self, layer_idx: int, decoding: bool) -> int | None:
        """The most tokens layer ``layer_idx`` holds after a step of the prompt (``decoding`` False) or of decoding
        (None: no bound). Its policy must be resolved."""
        policy = self._policies[layer_idx]
        if not policy.bounded:
            return None
        if not decoding or self.layer_policies[layer_idx][2] is not None:
            return policy.budget
        return None if self.growth is None else policy.budget + self.growth

    @property
    def probed(self) -> Policy | None:
        """The first layer policy scored by probes of its own (``Policy.probes``: ``kvzip``), once resolved; None
        where there is none."""
        return next((policy for policy in self._policies or () if policy.probed), None)

    @property
    def policies(self) -> list[Policy] | None:
        """The policies of all layers, once resolved."""
        return self._policies

    def reset(self) -> None:
        """Forget a ratio budget's resolution (the next prompt resolves it again)."""
        if self._ratio:
            self._policies = None
            self.budget_tokens = None


def shared_budgets(priorities: list[torch.Tensor], total: int) -> list[int]:
    """Each layer's share of ``total`` tokens per (row, KV head), by one selection over all layers: ``priorities``
    ``[B, H, N_l]`` per layer (comparable across layers; -inf: a slot that holds no token). The ``total · B · H``
    highest are taken; a layer's budget is its count among them over ``B · H`` (each of its heads keeps that many:
    heads hold the same count), at least 1, the remainders going to the largest fractions, so that the budgets sum
    to ``total``; where every held token is taken, what is left is shared evenly (room to grow, as under a uniform
    budget larger than the prompt)."""
    rows_heads = priorities[0].shape[0] * priorities[0].shape[1]
    sizes = torch.tensor([p.shape[-1] for p in priorities])
    flat = torch.cat([p.float().flatten(0, 1).T.flatten() for p in priorities])  # (layer by layer)
    owner = torch.repeat_interleave(torch.arange(len(sizes)), sizes * rows_heads)
    chosen = owner[flat.topk(min(total * rows_heads, flat.numel())).indices.cpu()]
    share = torch.bincount(chosen, minlength=len(sizes)).double() / rows_heads
    budgets = share.floor().long().clamp(min=1)
    while int(budgets.sum()) > total:  # (the floor of 1 took more: the largest give it back)
        budgets[int(budgets.argmax())] -= 1
    fraction = (share - share.floor()).tolist()
    for i in sorted(range(len(sizes)), key=lambda i: -fraction[i]):  # (the largest remainders first, with room)
        if int(budgets.sum()) < total and budgets[i] < sizes[i]:
            budgets[i] += 1
    left = total - int(budgets.sum())
    budgets += left // len(sizes) + (torch.arange(len(sizes)) < left % len(sizes)).long()
    return budgets.tolist()


def _shares() -> bool:
    """Whether the layers share what they compute: in eager steps only. Under ``torch.compile`` each layer computes
    its own (the same values: the compiler sees the ops twice), since checking a stamp would read the step's Python
    counters, which a compiled step must not depend on: it would be traced again at every step."""
    return not torch.compiler.is_compiling()


class StepMemo:
    """What the layers of one cache compute once per step and share (see the module docstring)."""

    def __init__(self) -> None:
        self._made: dict[Hashable, tuple[Hashable, Any]] = {}
        self._derived: dict[Hashable, tuple[object, Any]] = {}
        self._decisions: dict[tuple[Hashable, Hashable], list[Any]] = {}  # (group, round) → [decision, takers left]

    def share(self, what: Hashable, stamp: Hashable, make: Callable[[], T]) -> T:
        """``make()``, or the value of ``what`` that another layer already made under the same ``stamp`` (the
        latest value of each ``what`` is kept)."""
        if not _shares():
            return make()
        made = self._made.get(what)
        if made is None or made[0] != stamp:
            made = self._made[what] = (stamp, make())
        return made[1]

    def derive(self, what: Hashable, source: object, make: Callable[[], T]) -> T:
        """``make()``, or the value of ``what`` that another layer already made from the very object ``source`` (a
        decision the layers share: :meth:`decide`). The latest of each ``what`` is kept with its source, which it
        therefore keeps alive: no later object can be taken for it."""
        if not _shares():
            return make()
        made = self._derived.get(what)
        if made is None or made[0] is not source:
            made = self._derived[what] = (source, make())
        return made[1]

    def decide(self, group: Hashable | None, round_: Hashable, choose: Callable[[], T], members: int) -> T:
        """``choose()``, or the decision another layer of positional ``group`` (of ``members`` layers) made for the
        same eviction round (the layers of a group run the same rounds); a layer of no group always chooses itself.
        The decision is forgotten once all ``members`` took it."""
        if group is None or members == 1 or not _shares():
            return choose()
        key = (group, round_)
        entry = self._decisions.get(key)
        if entry is None:
            entry = self._decisions[key] = [choose(), members]
        entry[1] -= 1
        if not entry[1]:
            del self._decisions[key]
        return entry[0]

    def clear(self) -> None:
        self._made.clear()
        self._derived.clear()
        self._decisions.clear()
