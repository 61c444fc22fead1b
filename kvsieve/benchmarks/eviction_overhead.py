"""The ``eviction-overhead`` preset (``kvsieve bench --preset eviction-overhead``): what eviction costs against the
same-size floor and what it saves against transformers' full cache, at budget 512 and batch 1.

Its cells: h2o after a 512-token prompt, and every registered policy that bounds the cache after 2048- and 7936-token
prompts, each with the references. Its checks, evaluated on whatever cells were measured (those that evict, i.e. see
more tokens than the budget, count for the ratios):

- every policy's decode step is at most 1.08× the floor's, a position-only policy's at most 1.03×;
- after a 7936-token prompt h2o's decode tokens/s are at least 1.6× ``DynamicCache``'s, and the prefill of every
  policy that observes attention is at most 1.15× plain sdpa's; h2o's peak RSS growth is at most linear in the
  prompt length;
- the K/V bytes an evicting cache holds are budget/length × the full cache's, within 2 % (policy state apart);
- quantized slots (a spec with ``kv_bits``, e.g. ``kvsieve bench --kv-bits 4``): the decode step is at most 1.3× the
  same-size unquantized floor's (they are left out of the checks above).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvsieve.benchmarks.defaults import EVICTION_OVERHEAD
from kvsieve.benchmarks.grid import make_plan
from kvsieve.benchmarks.memory import MIB
from kvsieve.benchmarks.runner import DYNAMIC, FLOOR, REFERENCES, Cell, GridPoint, find_cells
from kvsieve.engine.quant import kv_quant
from kvsieve.policies import REGISTRY, resolve_spec

BUDGET = 512
LONG_PROMPT = 7936
BOUNDED = tuple(name for name, cls in REGISTRY.items() if cls.bounded)
POSITIONAL = tuple(name for name in BOUNDED if REGISTRY[name].positional)
OBSERVING = tuple(name for name in BOUNDED if REGISTRY[name].needs_attention)
CELLS = ((512, 32, ("h2o",)), (2048, 256, BOUNDED), (LONG_PROMPT, 256, BOUNDED))
"""(prompt, gen, policies) at batch 1 and budget :data:`BUDGET`."""


def preset_plan() -> list[tuple[GridPoint, list[str]]]:
    """The preset's cells (:data:`CELLS`), with the references."""
    return [plan for p, g, names in CELLS for plan in make_plan([(p, g)], [1], names)]


@dataclass
class Check:
    """One check of the preset: what it compares (and its threshold), the measured figures, and whether it passes
    (None: not measured)."""

    check: str
    measured: str
    passed: bool | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(text: str, results: list[tuple[str, bool]]) -> Check:
    if not results:
        return Check(text, f"not measured (run `kvsieve bench --preset {EVICTION_OVERHEAD}`)", None)
    return Check(text, "; ".join(m for m, _ in results), all(ok for _, ok in results))


def _ratios(cells: Sequence[Cell], ref: str, metric: str, ok: Callable[[float], bool]) -> list[tuple[str, bool]]:
    out = []
    for c in cells:
        value = c.ratios[f"vs_{ref}"][metric]
        out.append((f"{c.policy} {c.prompt_tokens}+{c.gen_tokens} b{c.batch}: {value:.2f}x", bool(ok(value))))
    return out


def _growth_by_prompt(cells: Sequence[Cell]) -> dict[int, float]:
    """Peak RSS growth (MiB) of batch-1 cells by prompt length (the largest where several cells share one)."""
    growth: dict[int, float] = {}
    for c in cells:
        if c.batch == 1:
            growth[c.prompt_tokens] = max(growth.get(c.prompt_tokens, 0.0), c.rss_growth_mb)
    return growth


def evaluate_checks(cells: Sequence[Cell], budget: int = BUDGET) -> list[Check]:
    """The preset's six checks, from whatever cells were measured (see the module docstring)."""
    evicting = [c for c in cells if c.budget_tokens == budget and c.prompt_tokens + c.gen_tokens - 1 > budget]
    h2o = find_cells(evicting, policy="h2o")
    long_h2o = [c for c in h2o if c.prompt_tokens >= LONG_PROMPT]
    observing = [c for c in evicting if c.policy in OBSERVING and c.prompt_tokens >= LONG_PROMPT]
    prefill = _ratios(observing, DYNAMIC, "prefill_s", lambda v: v <= 1.15)
    growth = _growth_by_prompt(h2o)
    if len(growth) > 1:
        # Up to ~2k tokens the attention's row block (BLOCK_ELEMENTS) still grows with n²; from there on the peak
        # must grow at most linearly: compared between the two longest prompts.
        (n1, g1), (n2, g2) = sorted(growth.items())[-2:]
        sdpa = _growth_by_prompt(find_cells(cells, policy=DYNAMIC))
        shown = ", ".join(
            f"{n}: {g:.0f} MiB" + (f" (sdpa {sdpa[n]:.0f})" if n in sdpa else "") for n, g in sorted(growth.items())
        )
        prefill.append((f"h2o peak RSS growth by prompt {shown}", g2 / max(g1, 1.0) <= 1.25 * n2 / n1))
    kv = []
    for c in cells:
        full = find_cells(cells, policy=DYNAMIC, prompt_tokens=c.prompt_tokens, gen_tokens=c.gen_tokens, batch=c.batch)
        held = c.prompt_tokens + c.gen_tokens - 1
        if c.policy in REFERENCES or quantized(c) or c.budget_tokens is None or c.budget_tokens >= held or not full:
            continue
        ratio = c.kv_bytes / (full[0].kv_bytes * c.budget_tokens / held)
        kv.append(
            (
                f"{c.policy} {c.prompt_tokens}+{c.gen_tokens} b{c.batch}: {ratio:.3f}x "
                f"(state {c.state_bytes / MIB:.2f} MiB)",
                abs(ratio - 1) <= 0.02,
            )
        )
    positional = [c for c in evicting if c.policy in POSITIONAL]
    policies = [c for c in evicting if c.policy not in REFERENCES]
    return [
        _check(
            f"decode step of every policy vs the same-size floor (budget {budget}) <= 1.08x",
            _ratios([c for c in policies if not quantized(c)], FLOOR, "step_ms_p50", lambda v: v <= 1.08),
        ),
        _check(
            f"h2o decode tok/s vs DynamicCache after a {LONG_PROMPT}-token prompt (budget {budget}) >= 1.6x",
            _ratios(long_h2o, DYNAMIC, "decode_tok_s", lambda v: v >= 1.6),
        ),
        _check(
            f"prefill of a {LONG_PROMPT}-token prompt by the policies that observe attention vs plain sdpa <= 1.15x; "
            "h2o peak RSS growth at most linear in the prompt length",
            prefill,
        ),
        _check("KV bytes held vs budget/length x the full cache's, within 2% (policy state apart)", kv),
        _check(
            "decode step of the position-only policies vs the floor <= 1.03x",
            _ratios(positional, FLOOR, "step_ms_p50", lambda v: v <= 1.03),
        ),
        _check(
            f"decode step of quantized slots (kv_bits) vs the same-size unquantized floor (budget {budget}) <= 1.3x",
            _ratios([c for c in policies if quantized(c)], FLOOR, "step_ms_p50", lambda v: v <= 1.3),
        ),
    ]


def quantized(cell: Cell) -> bool:
    """Whether ``cell``'s policy is a spec with quantized slots (``"h2o:kv_bits=4"``)."""
    return cell.policy not in REFERENCES and kv_quant(**resolve_spec(cell.policy)[3]) is not None
