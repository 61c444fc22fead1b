"""The accumulated-score family, once for all its policies: the compiled loops' reading of a
:class:`~kvsieve.engine.rules.Pattern` and of a :class:`~kvsieve.engine.rules.ScoreRule`'s decode step is the
family's torch statement (:meth:`Pattern.kept`, :class:`~kvsieve.policies.families.ScorePolicy`), for rules drawn over
every field, whatever policy states them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.engine import compiled
from kvsieve.engine.rules import Pattern, ScoreRule
from kvsieve.policies import REGISTRY
from kvsieve.policies.base import Observation, Slots, group_sum
from kvsieve.policies.families import ScorePolicy

pytestmark = pytest.mark.skipif(compiled.numba is None, reason="the compiled loops need numba (the fast extra)")

patterns = st.builds(
    Pattern,
    keep=st.integers(0, 12),
    recent=st.integers(0, 6),
    block=st.sampled_from([0, 3, 5]),
    period=st.integers(1, 5),
    offset=st.integers(0, 4),
    span=st.integers(0, 3),
    sinks=st.integers(0, 4),
)


def _positions(last: int, held: int, seed: int, empty: int = 2) -> torch.Tensor:
    """``[2, 3, held + empty]`` positions: each (row, head) holds ``held`` of ``0 .. last`` (the newest among them)
    in any slot order, and ``empty`` empty slots."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(6):
        older = torch.randperm(last, generator=gen)[: held - 1]
        slots = torch.cat([older, torch.tensor([last] + [-1] * empty)])
        rows.append(slots[torch.randperm(len(slots), generator=gen)])
    return torch.stack(rows).view(2, 3, -1)


@settings(max_examples=150, deadline=None)
@given(pattern=patterns, last=st.integers(0, 60), held=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_the_loops_keep_what_a_pattern_keeps_in_torch(pattern, last, held, seed) -> None:
    pos = _positions(last, min(held, last + 1), seed)
    kept = pattern.kept(pos, torch.tensor([last, last]))
    fields = compiled.pattern_fields(pattern)
    for b in range(2):
        for h in range(3):
            expected = torch.empty(pos.shape[-1], dtype=torch.bool)
            scratch = torch.empty(pos.shape[-1], dtype=torch.long)
            compiled._pattern_kept(pos.numpy(), b, h, last, fields, expected.numpy(), scratch.numpy())
            assert torch.equal(kept[b, h], expected), (b, h, pos[b, h])


@pytest.mark.parametrize("name", ["local", "streaming_llm", "strided", "fixed"])
@pytest.mark.parametrize("budget", [5, 7, 12])
def test_a_pattern_policy_keeps_its_top_budget(name, budget) -> None:
    """What a positional policy keeps (its priorities' top ``budget`` of the real tokens held) is what its
    :class:`Pattern` keeps, the part an ``h2o+`` policy keeps whatever the scores."""
    policy = REGISTRY[name](budget)
    for seed, last in enumerate((0, 2, budget, 3 * budget + 1, 50)):
        pos = _positions(last, min(last + 1, 2 * budget), seed)
        lasts = torch.tensor([last, last])
        priority = policy.priority(pos, lasts).masked_fill(pos < 0, torch.iinfo(torch.long).min)
        top = priority.topk(min(budget, pos.shape[-1]), dim=-1).indices
        expected = torch.zeros_like(pos, dtype=torch.bool).scatter_(-1, top, True) & (pos >= 0)
        assert torch.equal(policy.kept.kept(pos, lasts), expected)


class _Family(ScorePolicy):
    """Any rule of the family, as a policy (not registered)."""

    name = "family"

    def __init__(self, rule: ScoreRule) -> None:
        self.given = rule
        super().__init__(16)

    def score_rule(self) -> ScoreRule:
        return self.given


rules = st.builds(
    ScoreRule,
    accumulate=st.booleans(),
    kept=patterns,
    across_heads=st.booleans(),
    pool=st.sampled_from([0, 1, 3, 7]),
    gain=st.sampled_from([0, 8, 200]),
)


@settings(max_examples=120, deadline=None)
@given(rule=rules, held=st.integers(2, 20), seed=st.integers(0, 2**16))
def test_a_compiled_decode_step_is_the_familys_torch_step(rule, held, seed) -> None:
    """One decode query over real slots: the compiled step's scores and victim are those of the family's torch
    ``observe`` and ``keep_scores`` (the victim: the lowest priority, the first of equal ones)."""
    last = 40
    pos = _positions(last, held, seed, empty=0)  # (a decode step's slots in use: each holds a token)
    gen = torch.Generator().manual_seed(seed)
    score = torch.rand(pos.shape, generator=gen)
    logits = torch.randn((2, 3, 2, held), generator=gen)
    lasts = torch.tensor([last, last])

    family = _Family(rule)
    torch_slots = Slots(pos, {"score": score.clone()}, lasts, torch.zeros(0), torch.zeros(0))
    probs = group_sum(logits.softmax(dim=-1)[:, :, :, None], None)
    family.observe(torch_slots, Observation(probs, logits[:, :, :, None], lasts[:, None], 1, key_pos=pos))
    expected = family.keep_scores(torch_slots).argmin(dim=-1, keepdim=True)

    loop_slots = Slots(pos, {"score": score.clone()}, lasts, torch.zeros(0), torch.zeros(0))
    victims = torch.full((2, 3, 1), -1, dtype=torch.long)
    compiled.compiled_decode(rule, logits, loop_slots, True, victims)
    torch.testing.assert_close(loop_slots.state["score"], torch_slots.state["score"])
    choice = ~rule.kept.kept(pos, lasts).all(dim=-1, keepdim=True)  # (a step never keeps more than the pattern)
    assert torch.equal(victims[choice], expected[choice])
