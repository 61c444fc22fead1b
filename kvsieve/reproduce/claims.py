"""The measured numbers and the papers' claims as predicates over them.

:class:`Results` holds each experiment's rows (plain dicts, as written to ``results.json``). A :class:`Claim` says
where the paper makes it, what it says, our setting, and a check: a function of the results returning an
:class:`Outcome` — the number(s) it compared, formatted, and whether the claim holds. A check that needs a number
that was not measured (a part not run yet, a cell that failed) raises :class:`Missing`, and the claim is reported
as not evaluated. The factories below build the checks the three papers need; each is a small comparison, so that
"holds?" is always computed, never written by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvsieve.engine.budget import Budget

MOST = 0.5
"""'Most layers': more than this share of them."""
ALMOST_ALL = 0.9
"""'Almost all layers': at least this share of them."""


class Missing(LookupError):
    """A number a claim needs was not measured (or its cell failed)."""


class Results:
    """Experiment name → its rows; lookups by field values."""

    def __init__(self, parts: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        self.parts = {name: list(rows) for name, rows in parts.items()}

    def rows(self, part: str, **where: Any) -> list[Mapping[str, Any]]:
        """The rows of ``part`` whose fields equal ``where``."""
        return [r for r in self.parts.get(part, []) if all(k in r and r[k] == v for k, v in where.items())]

    def row(self, part: str, **where: Any) -> Mapping[str, Any]:
        """The one row of ``part`` matching ``where`` that holds a result (:class:`Missing` otherwise)."""
        found = self.rows(part, **where)
        shown = ", ".join(f"{k}={v}" for k, v in where.items())
        if len(found) != 1:
            raise Missing(f"{part}: {len(found)} rows for {shown or 'the part'}")
        row = found[0]
        if row.get("missing") or row.get("error"):
            raise Missing(f"{part}: {shown or 'the part'} " + (f"failed ({row['error']})" if row.get("error") else ""))
        return row

    def value(self, part: str, metric: str, **where: Any) -> Any:
        """``row(part, **where)[metric]``; :class:`Missing` if it is absent or ``None``."""
        value = self.row(part, **where).get(metric)
        if value is None:
            raise Missing(f"{part}: no {metric} for " + ", ".join(f"{k}={v}" for k, v in where.items()))
        return value


@dataclass(frozen=True)
class Outcome:
    number: str
    """The measured numbers the check compared, formatted."""
    holds: bool


Check = Callable[[Results], Outcome]


@dataclass(frozen=True)
class Claim:
    source: str
    """Where the paper makes it: ``"H2O Table 9"``."""
    statement: str
    setting: str
    """Our setting: what was measured, how."""
    check: Check

    def evaluate(self, results: Results) -> dict[str, Any]:
        """The claim's row of the report: ``holds`` is True, False, or None (not evaluated: ``missing`` says why)."""
        row = {"source": self.source, "statement": self.statement, "setting": self.setting}
        try:
            outcome = self.check(results)
        except Missing as err:
            return row | {"number": "—", "holds": None, "missing": str(err)}
        return row | {"number": outcome.number, "holds": outcome.holds}


def verdict(claim: dict[str, Any]) -> str:
    return {True: "yes", False: "no", None: "not evaluated"}[claim["holds"]]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def tally(claims: Sequence[dict[str, Any]]) -> str:
    """One line: how many of ``claims`` (evaluated) hold, do not, and are not evaluated yet."""
    held = sum(c["holds"] is True for c in claims)
    failed = sum(c["holds"] is False for c in claims)
    pending = sum(c["holds"] is None for c in claims)
    return f"{held} of {len(claims)} claims hold, {failed} do not" + (
        f", {pending} not evaluated (parts not finished)." if pending else "."
    )


def claims_table(claims: Sequence[dict[str, Any]]) -> str:
    """The markdown table: claim (with section/table/figure) | our setting | our number | holds?"""
    lines = ["| claim | our setting | our number | holds? |", "|---|---|---|---|"]
    for c in claims:
        number = c["number"] if c["holds"] is not None else f"— ({c['missing']})"
        claim = f"**{c['source']}**: {c['statement']}"
        lines.append(f"| {_cell(claim)} | {_cell(c['setting'])} | {_cell(number)} | {verdict(c)} |")
    return "\n".join(lines) + "\n"


# --- formatting -------------------------------------------------------------------------------------------------


def pct(budget: Budget) -> str:
    """``0.2`` → ``"20%"``; a token budget as is."""
    return f"{budget * 100:g}%" if isinstance(budget, float) else f"{budget} tokens"


def num(value: float, metric: str = "ppl") -> str:
    """Perplexities with 2 decimals, accuracies and shares with 3."""
    return f"{value:.2f}" if metric == "ppl" else f"{value:.3f}"


def signed(value: float, digits: int = 2) -> str:
    return f"{value:+.{digits}f}".replace("-", "−")


# --- checks -----------------------------------------------------------------------------------------------------


def beats(
    part: str,
    policy: str,
    rivals: Sequence[str],
    budgets: Sequence[Budget],
    *,
    task: str = "ppl",
    metric: str = "ppl",
    strict: bool = True,
) -> Check:
    """At every budget, ``policy``'s ``metric`` (lower is better: perplexity) is below each rival's (``strict``) or
    not above it."""

    def check(results: Results) -> Outcome:
        parts, holds = [], True
        for budget in budgets:
            mine = results.value(part, metric, task=task, policy=policy, budget=budget)
            theirs = [(r, results.value(part, metric, task=task, policy=r, budget=budget)) for r in rivals]
            holds &= all(mine < v if strict else mine <= v for _, v in theirs)
            shown = ", ".join(f"{r} {num(v, metric)}" for r, v in theirs)
            parts.append(f"{pct(budget)}: {policy} {num(mine, metric)} vs {shown}")
        return Outcome("; ".join(parts), holds)

    return check


def pairs_beat(part: str, pairs: Sequence[tuple[str, str]], budgets: Sequence[Budget], *, metric: str = "ppl") -> Check:
    """For every ``(better, worse)`` pair and budget, ``better``'s ``metric`` is below ``worse``'s."""

    def check(results: Results) -> Outcome:
        parts, holds = [], True
        for budget in budgets:
            shown = []
            for better, worse in pairs:
                a = results.value(part, metric, task="ppl", policy=better, budget=budget)
                b = results.value(part, metric, task="ppl", policy=worse, budget=budget)
                holds &= a < b
                shown.append(f"{better} {num(a, metric)} vs {worse} {num(b, metric)}")
            parts.append(f"{pct(budget)}: " + ", ".join(shown))
        return Outcome("; ".join(parts), holds)

    return check


def ppl_within(part: str, policy: str, reference: str, budgets: Sequence[Budget], factor: float) -> Check:
    """At every budget, ``policy``'s perplexity is at most ``factor`` × ``reference``'s."""

    def check(results: Results) -> Outcome:
        parts, holds = [], True
        for budget in budgets:
            mine = results.value(part, "ppl", task="ppl", policy=policy, budget=budget)
            ref = results.value(part, "ppl", task="ppl", policy=reference, budget=budget)
            holds &= mine <= factor * ref
            parts.append(f"{pct(budget)}: {policy} {num(mine)} = {mine / ref:.3f}× {reference} {num(ref)}")
        return Outcome("; ".join(parts), holds)

    return check


def accuracy_close(
    part: str, policy: str, reference: str, budget: Budget, tasks: Sequence[str], points: float, metric: str = "acc"
) -> Check:
    """On every task, ``policy``'s accuracy at ``budget`` is at least ``reference``'s minus ``points``
    (``points = 0``: at least as accurate)."""

    def check(results: Results) -> Outcome:
        parts, holds = [], True
        for task in tasks:
            mine = results.value(part, metric, task=task, policy=policy, budget=budget)
            ref = results.value(part, metric, task=task, policy=reference, budget=budget)
            n = results.row(part, task=task, policy=policy, budget=budget).get("n")
            holds &= mine >= ref - points - 1e-9
            parts.append(
                f"{task}: {policy} {num(mine, metric)} vs {reference} {num(ref, metric)} ({signed(mine - ref, 3)}"
                + (f", n = {n})" if n else ")")
            )
        return Outcome("; ".join(parts), holds)

    return check


def main_effect(
    part: str, component: str, specs: Mapping[tuple[bool, ...], str], index: int, budgets: Sequence[Budget]
) -> Check:
    """A factorial ablation: ``specs`` maps each on/off combination of the components to its policy spec; at every
    budget, the mean perplexity of the combinations with component ``index`` on is below the mean with it off (its
    main effect is negative: it helps)."""

    def check(results: Results) -> Outcome:
        parts, holds = [], True
        for budget in budgets:
            on, off = [], []
            for combo, spec in specs.items():
                value = results.value(part, "ppl", task="ppl", policy=spec, budget=budget)
                (on if combo[index] else off).append(value)
            mean_on, mean_off = sum(on) / len(on), sum(off) / len(off)
            holds &= mean_on < mean_off
            parts.append(
                f"{pct(budget)}: with {num(mean_on)} vs without {num(mean_off)} ({signed(mean_on - mean_off)})"
            )
        return Outcome(f"{component} main effect on ppl, " + "; ".join(parts), holds)

    return check


def rolling_at_most(part: str, policy: str, rival: str, sizes: Sequence[int]) -> Check:
    """At every cache size, ``policy``'s perplexity over the rolling stream is at most ``rival``'s."""

    def check(results: Results) -> Outcome:
        parts, holds = [], True
        for size in sizes:
            mine = results.value(part, "ppl", policy=policy, size=size)
            theirs = results.value(part, "ppl", policy=rival, size=size)
            holds &= mine <= theirs
            parts.append(f"{size} slots: {policy} {num(mine)} vs {rival} {num(theirs)}")
        return Outcome("; ".join(parts), holds)

    return check


def memory_flat(part: str, policies: Sequence[str], sizes: Sequence[int], rss_growth: float) -> Check:
    """Every run's KV bytes are the same at every point of its curve, and its resident memory at the end is at most
    ``1 + rss_growth`` times that at the first point."""

    def check(results: Results) -> Outcome:
        parts, holds = [], True
        for policy in policies:
            for size in sizes:
                curve = results.value(part, "curve", policy=policy, size=size)
                if not curve:
                    raise Missing(f"{part}: {policy} at {size} slots has no curve")
                kv = {p["kv_bytes"] for p in curve}
                first, last = curve[0]["rss_mb"], curve[-1]["rss_mb"]
                holds &= len(kv) == 1 and last <= (1 + rss_growth) * first
                held = f"KV {max(kv) / 2**20:.2f} MiB" + ("" if len(kv) == 1 else " (varies)")
                parts.append(f"{policy}/{size}: {held}, RSS {first:,.0f} → {last:,.0f} MiB")
        return Outcome("; ".join(parts), holds)

    return check


def layer_share(
    part: str, values: Callable[[Mapping[str, Any]], Sequence[float]], threshold: float, share: float, what: str
) -> Check:
    """More than ``share`` of the layers (at least that share, for ``share`` ≥ :data:`ALMOST_ALL`) have ``values``
    (one per layer, read from the part's row) at or above ``threshold``."""

    def check(results: Results) -> Outcome:
        layers = [v for v in values(results.row(part)) if not math.isnan(v)]
        if not layers:
            raise Missing(f"{part}: no layers")
        above = sum(v >= threshold for v in layers)
        holds = above / len(layers) >= share if share >= ALMOST_ALL else above / len(layers) > share
        mean = sum(layers) / len(layers)
        return Outcome(f"{what} ≥ {threshold:g} in {above}/{len(layers)} layers (mean {mean:.3f})", holds)

    return check


def power_law(part: str, min_r2: float) -> Check:
    """The accumulated attention, sorted, fits ``rank^-s`` (``s > 0``) on log-log axes with ``R² >= min_r2``."""

    def check(results: Results) -> Outcome:
        row = results.row(part)
        exponent, r2 = row["exponent"], row["r2"]
        top = row["sorted_mean"]
        head = sum(top[: max(1, len(top) // 5)]) / sum(top)
        number = f"rank^−{exponent:.2f}, R² {r2:.3f}; the top 20% of tokens collect {head:.1%} of the attention"
        return Outcome(number, exponent > 0 and r2 >= min_r2)

    return check


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    return cov / (sx * sy) if sx and sy else math.nan


def entropy_grows(part: str, min_corr: float) -> Check:
    """The mean attention-row entropy rises with ``ln i`` (Pearson correlation over ``i >= 2`` at least
    ``min_corr``) and is higher at the last position than at the first quarter's end."""

    def check(results: Results) -> Outcome:
        row = results.row(part)
        mean, uniform = row["mean"][1:], row["uniform"][1:]
        corr = pearson(uniform, mean)
        quarter = max(0, len(mean) // 4 - 1)
        holds = corr >= min_corr and mean[-1] > mean[quarter]
        number = (
            f"corr(entropy, ln i) {corr:.3f}; {mean[quarter]:.2f} nats at i = {quarter + 2}, {mean[-1]:.2f} at "
            f"i = {len(mean) + 1} (ln i: {uniform[quarter]:.2f}, {uniform[-1]:.2f})"
        )
        return Outcome(number, holds)

    return check


def less_at_start(part: str, policy: str, rival: str) -> Check:
    """``policy`` keeps a smaller share of its tokens in the text's first bin (its first twentieth) than ``rival``."""

    def check(results: Results) -> Outcome:
        mine, theirs = (results.row(part, policy=p) for p in (policy, rival))
        holds = mine["first_share"] < theirs["first_share"]
        number = (
            f"kept in the first twentieth: {policy} {mine['first_share']:.1%} vs {rival} {theirs['first_share']:.1%}; "
            f"mean kept position {mine['mean_position']:.2f} vs {theirs['mean_position']:.2f}"
        )
        return Outcome(number, holds)

    return check


def needle_at_least(part: str, policy: str, rivals: Sequence[str]) -> Check:
    """``policy``'s needle accuracy (mean over depths) is at least each rival's."""

    def check(results: Results) -> Outcome:
        def mean(p: str) -> tuple[float, int]:
            rows = [results.row(part, policy=p, depth=r["depth"]) for r in results.rows(part, policy=p)]
            if not rows:
                raise Missing(f"{part}: no cells for {p}")
            return sum(r["correct"] for r in rows) / sum(r["trials"] for r in rows), sum(r["trials"] for r in rows)

        (mine, n), theirs = mean(policy), [(r, mean(r)[0]) for r in rivals]
        holds = all(mine >= v for _, v in theirs)
        shown = ", ".join(f"{r} {v:.3f}" for r, v in theirs)
        return Outcome(f"exact match over depths: {policy} {mine:.3f} vs {shown} (n = {n} each)", holds)

    return check
