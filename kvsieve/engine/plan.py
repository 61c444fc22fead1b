"""Which policy each layer of a cache runs, and what the layers share within a step.

:class:`PolicyPlan` builds each layer's policy instance, resolving a ratio budget against the prompt length once
(every layer is validated before any is used). :class:`StepMemo` is what the layers of one cache compute once per
step and share: every layer sees the same tokens, so the positions of a one-chunk step (every decode step) are
computed by the first layer; layers whose policy is positional, of the same class, parameters and budget hold the
same positions at every step, so they evict the same slots: the first of them decides, the others take it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

from kvsieve.engine.budget import Budget, check_budget, resolve_budget
from kvsieve.engine.schedules import split_budget
from kvsieve.policies import Policy

T = TypeVar("T")


class PolicyPlan:
    """``layer_policies[i]``: the policy class of layer ``i``, its params and, for layers with a fixed size of their
    own (sliding-window layers), the budget they always use. The other layers (the policy layers) all get
    ``budget``, or, with ``weights`` (one per policy layer: a layer budget schedule), share the same total as
    :func:`~kvsieve.engine.schedules.split_budget` divides it."""

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
        self.groups: list[Hashable | None] = []
        """Per layer: the key of its positional group (layers deciding alike), None when it decides alone."""
        self._policies: list[Policy] | None = None
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
            self.groups = [
                (cls, id(params), policy.budget) if policy.positional else None
                for (cls, params, _), policy in zip(self.layer_policies, policies, strict=True)
            ]
            self.budget_tokens = tokens
        return self._policies

    @property
    def policies(self) -> list[Policy] | None:
        """The policies of all layers, once resolved."""
        return self._policies

    def reset(self) -> None:
        """Forget a ratio budget's resolution (the next prompt resolves it again)."""
        if isinstance(self.budget, float):
            self._policies = None
            self.budget_tokens = None


class StepMemo:
    """What the layers of one cache compute once per step and share (see the module docstring)."""

    def __init__(self) -> None:
        self._made: dict[Hashable, tuple[Hashable, Any]] = {}

    def share(self, what: Hashable, stamp: Hashable, make: Callable[[], T]) -> T:
        """``make()``, or the value of ``what`` that another layer already made under the same ``stamp`` (the
        latest value of each ``what`` is kept)."""
        made = self._made.get(what)
        if made is None or made[0] != stamp:
            made = self._made[what] = (stamp, make())
        return made[1]

    def decide(self, group: Hashable | None, round_: int, choose: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``choose()``, or the decision another layer of positional ``group`` made for the same eviction round
        (the layers of a group run their rounds in lockstep); a layer of no group always chooses itself."""
        return choose() if group is None else self.share(group, round_, choose)

    def clear(self) -> None:
        self._made.clear()
