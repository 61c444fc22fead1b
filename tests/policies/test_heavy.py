"""``h2o+strided``, ``h2o+fixed``, ``h2o+local`` (H2O's sparse patterns "with heavy hitters"): against a naive
reference replayed on recorded observations (see ``policy_runs``), on constructed slots (padding never counted in
the pattern's share), ``heavy_ratio = 0`` as the base policy, parameter errors, the policy list, and the shared
property test on these policies."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from functools import partial
from typing import Any
from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_runs import BUDGET, Call, Reference, record, recorder, replay, softmax

import kvsieve
from kvsieve.cli import main
from kvsieve.policies import REGISTRY, Slots

NAMES = ("h2o+strided", "h2o+fixed", "h2o+local")

# -- the naive reference ---------------------------------------------------------------------------------------------


def ranked(present: set[int], tiers: Callable[[int], int]) -> list[int]:
    """``present`` by tier (highest first), newest first within a tier."""
    return sorted(present, key=lambda p: (tiers(p), p), reverse=True)


def strided_keeps(present: set[int], last: int, k: int, recent: int | None = None, stride: int | None = None):
    """What the strided pattern keeps at budget ``k``: the ``recent`` newest, then ``p % stride == 0``, then the
    rest, newest first (``recent`` defaults to ``k // 2``, ``stride`` to ``max(1, recent)``)."""
    recent = k // 2 if recent is None else recent
    stride = max(1, recent) if stride is None else stride
    return set(ranked(present, lambda p: 2 if p > last - recent else 1 if p % stride == 0 else 0)[:k])


def fixed_keeps(present: set[int], last: int, k: int, block: int | None = None, summary: int | None = None):
    """What the fixed pattern keeps at budget ``k``: the newest token's block, then the last ``summary`` positions
    of every block, then the rest, newest first (``block`` defaults to ``max(1, k // 2)``)."""
    block = max(1, k // 2) if block is None else block
    summary = max(1, block // 16) if summary is None else summary
    return set(
        ranked(present, lambda p: 2 if p // block == last // block else 1 if p % block >= block - summary else 0)[:k]
    )


def local_keeps(present: set[int], last: int, k: int):
    return set(sorted(present)[-k:])


PATTERNS = {"h2o+strided": strided_keeps, "h2o+fixed": fixed_keeps, "h2o+local": local_keeps}


class HeavyReference(Reference):
    """Per (layer, row, KV head): H2O's accumulated attention (the softmax of each query head's logits over the
    allowed slots, summed over the group and the rows), and ``pattern(B - heavy) ∪ top heavy others by score``."""

    def __init__(self, budget: int, group: int, pattern: Callable[..., set[int]], heavy: int, **params: Any) -> None:
        super().__init__(budget, group)
        self.pattern, self.heavy, self.params = pattern, heavy, params

    def row(self, call: Call, b: int, h: int, r: int) -> None:
        allowed = call.allowed[b][h][r]
        for g in range(self.group):
            probs = softmax(call.logits[b][h][g][r], allowed)
            for s, p in enumerate(call.pos[b][h]):
                if allowed[s]:
                    self.score[p] += probs[s]

    def keep(self, present: set[int], last: int, n_keep: int) -> set[int]:
        base = self.pattern(present, last, self.budget - self.heavy, **self.params)
        assert len(base) == self.budget - self.heavy and n_keep == self.budget
        others = sorted(present - base, key=lambda p: self.score[p], reverse=True)
        return base | set(others[: self.heavy])


CASES = [
    ("h2o+strided", {}),
    ("h2o+strided", {"recent": 3, "stride": 4, "heavy_ratio": 0.3}),
    ("h2o+fixed", {}),
    ("h2o+fixed", {"block": 4, "summary": 2, "heavy_ratio": 0.4}),
    ("h2o+local", {}),
    ("h2o+local", {"heavy_ratio": 0.7}),
]


@pytest.mark.parametrize(("policy", "params"), CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_matches_the_naive_reference(llama_gqa, stream, monkeypatch, policy, params) -> None:
    """GQA (2 query heads per KV head), a batch of 2 with a left-padded row, a prompt then decode steps: the kept
    positions after every step and every held token's score, per (layer, row, KV head)."""
    run = record(llama_gqa, stream, monkeypatch, policy, **params)
    heavy = int(BUDGET * params.get("heavy_ratio", 0.5))
    pattern_params = {k: v for k, v in params.items() if k != "heavy_ratio"}
    make = partial(HeavyReference, BUDGET, 2, PATTERNS[policy], heavy, **pattern_params)
    replay(run, make, lambda state: state["score"])
    # The heavy hitters matter: the base pattern alone (at the whole budget) keeps other tokens somewhere.
    base = record(llama_gqa, stream, monkeypatch, policy.removeprefix("h2o+"), **pattern_params)
    assert base.slots != run.slots


def test_padding_never_takes_the_patterns_share() -> None:
    """The fixed pattern ranks a padding slot (position -1: ``-1 % block`` is a summary position) above old real
    tokens; the pattern's share goes to real tokens only, and the heavy hitters are the best-scored others."""
    policy = REGISTRY["h2o+fixed"](10, REGISTRY["h2o+fixed"].make_params(block=4, summary=1, heavy_ratio=0.2))
    assert (policy.heavy, policy.share) == (2, 8)
    pos = torch.tensor([[[-1, -1, *range(12)], [*range(12), -1, -1]]])  # [1, 2, 14]: padding first, or last
    score = torch.rand(1, 2, 14, generator=torch.Generator().manual_seed(0))
    score[0, 0, 2 + 1] = 5.0  # position 1 (outside the pattern) is the best-scored in head 0, 0 in head 1
    score[0, 1, 0] = 4.0
    slots = Slots(pos=pos, state={"score": score}, last=torch.tensor([11]), keys=None, values=None)
    priority = policy.keep_scores(slots)
    # Current block 8..11, summary positions 7 and 3, then the newest others 6 and 5.
    expected_base = {8, 9, 10, 11, 7, 3, 6, 5}
    for h in range(2):
        protected = {p for p, x in zip(pos[0, h].tolist(), priority[0, h].tolist(), strict=True) if x == math.inf}
        assert protected == expected_base
        # The engine keeps the top `budget` with padding lowest: the pattern's 8 + the 2 best-scored others.
        kept = priority.masked_fill(pos < 0, float("-inf"))[0, h].topk(10).indices
        by_score = sorted({0, 1, 2, 4}, key=lambda p: score[0, h, pos[0, h].tolist().index(p)].item(), reverse=True)
        assert set(pos[0, h, kept].tolist()) == expected_base | set(by_score[:2])
        assert (1 if h == 0 else 0) in by_score[:2]  # (the boosted token is a heavy hitter)
    assert torch.equal(slots.state["score"], score)  # (the state is not changed)


def test_a_row_with_fewer_tokens_than_the_share_protects_only_real_ones() -> None:
    policy = REGISTRY["h2o+strided"](8, REGISTRY["h2o+strided"].make_params(recent=4))
    pos = torch.tensor([[[-1, -1, -1, 0, 1]]])
    slots = Slots(pos=pos, state={"score": torch.zeros(1, 1, 5)}, last=torch.tensor([1]), keys=None, values=None)
    assert policy.keep_scores(slots).isinf().tolist() == [[[False, False, False, True, True]]]


# -- heavy_ratio = 0 is the base policy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "params"),
    [("h2o+strided", {"recent": 3, "stride": 3}), ("h2o+strided", {}), ("h2o+fixed", {}), ("h2o+local", {})],
)
def test_no_heavy_hitters_is_the_base_policy(llama_gqa, stream, make_ids, policy, params) -> None:
    """Same kept positions after every step and the same logits, on a batch with a left-padded row."""
    ids = make_ids(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    runs = []
    for name, kwargs in ((policy, {**params, "heavy_ratio": 0.0}), (policy.removeprefix("h2o+"), params)):
        cache = kvsieve.make_cache(llama_gqa, name, 8, **kwargs)
        kept: list = []
        logits = stream(llama_gqa, cache, ids, 16, attention_mask=mask, on_step=recorder(cache, kept))
        runs.append((kept, logits))
    (kept, logits), (base_kept, base_logits) = runs
    assert kept == base_kept
    torch.testing.assert_close(logits[mask_all(mask, 16)], base_logits[mask_all(mask, 16)], atol=1e-4, rtol=0)
    # ...and with heavy hitters, something else is kept.
    cache = kvsieve.make_cache(llama_gqa, policy, 8, **params)
    other: list = []
    stream(llama_gqa, cache, ids, 16, attention_mask=mask, on_step=recorder(cache, other))
    assert other != base_kept


def mask_all(mask: torch.Tensor, steps: int) -> torch.Tensor:
    """The real positions of a prompt with ``mask`` followed by ``steps`` decode tokens."""
    return torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1).bool()


@pytest.mark.parametrize("policy", NAMES)
def test_no_heavy_hitters_is_the_base_policy_in_the_stream_protocol(llama_gqa, make_ids, policy) -> None:
    """One forward pass over 50 tokens with ``stream=True`` (the base policies in closed form or in chunks, the
    combined one chunked up to the first eviction, then token by token): same logits and kept positions."""
    ids = make_ids(2, 50)
    out = []
    with torch.no_grad():
        for name, kwargs in ((policy, {"heavy_ratio": 0.0}), (policy.removeprefix("h2o+"), {})):
            cache = kvsieve.make_cache(llama_gqa, name, 12, stream=True, **kwargs)
            logits = llama_gqa(ids, cache=cache).logits
            out.append((logits, [cache.positions(i).sort(-1).values for i in range(len(cache.layers))]))
    (logits, kept), (base_logits, base_kept) = out
    torch.testing.assert_close(logits, base_logits, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(kept, base_kept, strict=True))


# -- parameters and errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", NAMES)
@pytest.mark.parametrize("ratio", [1.0, 1.5, -0.1, float("nan"), float("inf")])
def test_bad_heavy_ratio_is_one_line(llama_gqa, policy, ratio) -> None:
    with pytest.raises(ValueError) as err:
        kvsieve.make_cache(llama_gqa, policy, 8, heavy_ratio=ratio)
    assert str(err.value) == f"{policy}: heavy_ratio must be in [0, 1), got {ratio}"


@pytest.mark.parametrize(
    ("policy", "budget", "params", "message"),
    [
        # budget 8, heavy 4: the pattern gets 4, too few for its own parameters
        ("h2o+strided", 8, {"recent": 5}, "h2o+strided: strided: recent must be in [0, budget=4], got 5"),
        ("h2o+fixed", 8, {"block": 6}, "h2o+fixed: fixed: block must be in [1, budget=4], got 6"),
        ("h2o+fixed", 10, {"block": 8, "heavy_ratio": 0.3}, "h2o+fixed: fixed: block must be in [1, budget=7], got 8"),
    ],
)
def test_a_budget_too_small_for_the_pattern_is_one_line(llama_gqa, policy, budget, params, message) -> None:
    with pytest.raises(ValueError) as err:
        kvsieve.make_cache(llama_gqa, policy, budget, **params)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    REGISTRY[policy](budget + 4, REGISTRY[policy].make_params(**params))  # (4 more tokens of budget: it fits)
    with pytest.raises(ValueError, match=rf"^{re.escape(policy)}: budget must be a positive number of tokens, got 0$"):
        REGISTRY[policy](0)


def test_tiny_budgets_leave_the_pattern_at_least_one_token() -> None:
    """``heavy = int(budget · heavy_ratio)`` with ``heavy_ratio < 1`` leaves ``budget - heavy >= 1``."""
    for name in NAMES:
        cls = REGISTRY[name]
        for budget in (1, 2, 3, 7):
            for ratio in (0.5, 0.99):
                policy = cls(budget, cls.make_params(heavy_ratio=ratio))
                assert policy.heavy == int(budget * ratio) and policy.share == policy.base_policy.budget >= 1


def test_params_are_the_base_policys_plus_heavy_ratio() -> None:
    for name in NAMES:
        cls, base = REGISTRY[name], REGISTRY[name.removeprefix("h2o+")]
        assert cls.base is base and not cls.positional and cls.needs_attention and cls.row_additive
        assert cls.info()["params"] == {**base.info()["params"], "heavy_ratio": 0.5}
        params = cls.make_params(heavy_ratio="0.25")  # (command-line text)
        assert params.heavy_ratio == 0.25 and type(params.heavy_ratio) is float
        with pytest.raises(ValueError, match=rf"^invalid value 'abc' for {re.escape(name)} parameter"):
            cls.make_params(heavy_ratio="abc")
    policy = REGISTRY["h2o+strided"](12, REGISTRY["h2o+strided"].make_params(heavy_ratio=0.3))
    assert (policy.heavy, policy.share, policy.base_policy.budget, policy.base_policy.recent) == (3, 9, 9, 4)


# -- the policy list ------------------------------------------------------------------------------------------------


def test_kvsieve_policies_lists_them(capsys) -> None:
    assert main(["policies", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["policies"]}
    for name in NAMES:
        row = rows[name]
        assert row["needs_attention"] is True and row["bounded"] is True
        assert "arXiv:2306.14048" in row["paper"] and "Tables 2 and 8" in row["paper"]
        assert row["summary"].startswith(f"Keeps what ``{name.removeprefix('h2o+')}`` keeps at ``budget - heavy``")
    assert rows["h2o+fixed"]["params"] == {"block": None, "summary": None, "heavy_ratio": 0.5}
    assert list(rows).index("h2o+strided") == list(rows).index("fixed") + 1


# -- the shared property test, on these policies only ---------------------------------------------------------------


@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_shared_invariants_on_these_policies(tiny_models, data) -> None:
    """``test_properties.py``'s checks (budget held, finite logits, a padded row = the row alone) on runs of
    these policies only: the shared test draws them among all policies."""
    import test_properties

    with patch.object(test_properties, "REGISTRY", {name: REGISTRY[name] for name in NAMES}):
        run = data.draw(test_properties.runs())
    test_properties.test_invariants_hold_for_any_run.hypothesis.inner_test(tiny_models, run)
