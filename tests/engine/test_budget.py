"""Budgets: parsing command-line values, validation, resolving ratios against a length."""

from __future__ import annotations

import math

import pytest
import torch

from kvsieve.engine.budget import check_budget, parse_budget, resolve_budget
from kvsieve.engine.plan import shared_budgets


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512", 512), (" 64 ", 64), ("0.2", 0.2), ("20%", 0.2), ("100%", 1.0), ("1.0", 1.0), ("1", 1), (7, 7), (0.5, 0.5)],
)
def test_parse_budget(text, expected) -> None:
    parsed = parse_budget(text)
    assert parsed == expected and type(parsed) is type(expected)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("abc", "neither a token count"),
        ("", "neither a token count"),
        ("12 tokens", "neither a token count"),
        ("%", "neither a token count"),
        ("0", "positive number of tokens, got 0"),
        ("-5", "positive number of tokens, got -5"),
        ("1.5", r"ratio must be in \(0, 1\], got 1.5"),
        ("150%", r"ratio must be in \(0, 1\], got 1.5"),
        ("0%", r"ratio must be in \(0, 1\], got 0.0"),
        ("nan", r"ratio must be in \(0, 1\], got nan"),
        ("inf", r"ratio must be in \(0, 1\], got inf"),
        (True, "not True"),
    ],
)
def test_parse_budget_rejects(text, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_budget(text)


@pytest.mark.parametrize("budget", [1, 4096, 1e-9, 0.2, 1.0])
def test_check_budget_accepts_and_returns_unchanged(budget) -> None:
    assert check_budget(budget) is budget


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (0, "got 0"),
        (-1, "got -1"),
        (0.0, r"\(0, 1\], got 0.0"),
        (-0.5, r"\(0, 1\], got -0.5"),
        (1.0001, r"\(0, 1\], got 1.0001"),
        (math.nan, "got nan"),
        (math.inf, "got inf"),
        (True, "got True"),
        ("12", "got '12'"),
        (None, "got None"),
    ],
)
def test_check_budget_rejects(budget, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_budget(budget)


@pytest.mark.parametrize(
    ("budget", "length", "expected"),
    [
        (64, 10, 64),  # an int stays as is, even above the length
        (64, 0, 64),
        (0.2, 100, 20),
        (0.2, 1024, 205),  # 204.8 rounds to nearest
        (0.2, 1022, 204),  # 204.4
        (0.5, 3, 2),  # 1.5: round half to even
        (0.5, 5, 2),  # 2.5: round half to even
        (0.1, 4, 1),  # 0.4 would round to 0: at least one token
        (1e-6, 10, 1),
        (1.0, 37, 37),
    ],
)
def test_resolve_budget(budget, length, expected) -> None:
    assert resolve_budget(budget, length) == expected


def test_resolve_budget_errors() -> None:
    with pytest.raises(ValueError, match="empty sequence"):
        resolve_budget(0.5, 0)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        resolve_budget(2.0, 10)


def test_shared_budgets_follow_one_selection_over_the_layers() -> None:
    low, high = torch.zeros(1, 2, 10), torch.ones(1, 2, 10)
    # (a layer's count among the top 12 · 2, over its 2 heads; at least 1 each, which the largest gives)
    assert shared_budgets([high, torch.full((1, 2, 10), 0.1), torch.full((1, 2, 10), 0.2)], 12) == [9, 1, 2]
    assert shared_budgets([low, high, low], 6) == [1, 4, 1]
    assert shared_budgets([torch.rand(1, 2, 4) for _ in range(3)], 30) == [10, 10, 10]  # (all held: shared evenly)
    mixed = torch.tensor([[[0.9, 0.8, 0.1], [0.9, 0.1, 0.1]]])  # (heads of one layer: their average count)
    assert shared_budgets([mixed, torch.full((1, 2, 3), 0.5)], 4) == [2, 2]
    assert sum(shared_budgets([torch.rand(2, 2, n) for n in (7, 3, 12)], 9)) == 9
