"""The policy contract: what a new policy writes, and what the engine infers from it."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from kvsieve.engine.rules import Pattern
from kvsieve.policies import REGISTRY, Observation, Policy, Slots
from kvsieve.policies.base import PatternPolicy, SinkWindow, register


class Every2nd(PatternPolicy):
    """Keeps the even positions, newest first, and the newest token (the example of docs/architecture.md)."""

    name = "every2nd"

    def pattern(self) -> Pattern:
        return Pattern(keep=self.budget, recent=1, period=2, span=1)


def test_a_new_positional_policy_is_one_small_class(llama_gqa, stream, make_ids) -> None:
    assert Every2nd.positional and not Every2nd.needs_attention and Every2nd.takes_budget()
    cache = kvsieve.make_cache(llama_gqa, Every2nd, 6)
    stream(llama_gqa, cache, make_ids(2, 20), 5)  # 25 tokens: 0..24
    for i in range(len(cache.layers)):
        kept = cache.positions(i).sort(dim=-1).values
        assert kept.tolist() == [[[14, 16, 18, 20, 22, 24]] * 2] * 2


def test_what_the_engine_infers() -> None:
    class Observes(Policy):
        name = "observes"

        def observe(self, slots: Slots, obs: Observation) -> None:
            pass

    class Narrows(Policy):
        name = "narrows"
        bounded = False

        def narrow(self, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
            return allowed[:, :, None]

    assert Observes.needs_attention and not Observes.narrows and not Observes.positional
    assert Narrows.needs_attention and Narrows.narrows and Narrows.takes_budget()  # (an attention budget)
    assert {name for name, cls in REGISTRY.items() if cls.positional} == {
        "local", "streaming_llm", "strided", "fixed", "random"
    }  # fmt: skip
    assert {name for name, cls in REGISTRY.items() if issubclass(cls, SinkWindow)} == {"local", "streaming_llm"}
    assert {name for name, cls in REGISTRY.items() if cls.needs_attention} == {
        "h2o", "scissorhands", "ahakv", "tova", "snapkv", "topk_oracle", "h2o+strided", "h2o+fixed", "h2o+local",
        "kvzip", "rkv",
    }  # fmt: skip
    assert {name for name, cls in REGISTRY.items() if cls.probed} == {"kvzip"}
    assert {name for name, cls in REGISTRY.items() if cls.needs_queries} == {"expected_attention"}


def test_registering_a_second_policy_under_a_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="a policy named 'h2o' is already registered"):
        register(type("Other", (Policy,), {"name": "h2o"}))


def test_a_policy_that_keeps_everything_has_no_priorities() -> None:
    full = REGISTRY["full"](None)
    with pytest.raises(NotImplementedError, match="full keeps everything"):
        full.keep_scores(None)
