"""Eviction × quantized slots on real text: the perplexity grid (policies × budgets × kv_bits), the claim "h2o at 20 %
with 4-bit slots is within 2 % of h2o at 20 % unquantized", and the K/V bytes measured against the prediction and the
full caches.

The grid is a ``kvsieve sweep`` (resumable: the cells are in ``OUT/sweep``; ``--report`` computes nothing): the ppl
task on ``--ppl-tokens`` tokens of the built-in Wikipedia article, the stream protocol (the budget is prefilled, every
later token streamed under eviction), each policy as a spec ``"h2o:kv_bits=4"``; ``full`` (100 %) once per bit width.
The model is SmolLM2-135M in float32, so the unquantized cache holds float32 keys and values ("fp32" below).

Bytes: a cache for ``h2o`` at 20 % of each length, its prompt prefilled in one pass (compressed to the budget):
``cache.kv_nbytes()`` against :func:`~kvsieve.benchmarks.memory.held_kv_bytes` (codes + float16 scales and
zeros + the residual's exact copies, for the slots allocated) and against the full cache of the same length in
float16 and float32.

    python scripts/quant_grid.py [--out out/quant-grid] [--ppl-tokens 512] [--budgets 0.2 0.1] [--bits 8 4 2]
        [--residual N]   # (given: a key of every quantized spec; else the engine's default, not in the cell names)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from kvsieve.evaluation.plots import pyplot, save_figure
from kvsieve.evaluation.sweep import Settings, budget_label, run_sweep

FP32 = "fp32"
CLAIM = ("h2o", 0.2, 4, 0.02)
"""(policy, budget, bits, tolerance): h2o 20 % + 4-bit within 2 % of h2o 20 % unquantized."""


def spec(policy: str, bits: int | None, residual: int | None = None) -> str:
    """``policy`` with ``kv_bits`` (and ``residual`` when given; else the engine's default) as spec keys."""
    if bits is None:
        return policy
    return f"{policy}:kv_bits={bits}" + ("" if residual is None else f",residual={residual}")


def grid_tables(
    rows: list[dict[str, Any]], policies: list[str], budgets: list[float], bits: list[int], residual: int | None = None
) -> dict:
    """Perplexity by (policy, budget) × bit width (None: unquantized), from the sweep's rows."""
    ppl = {(r["policy"], r["budget"]): r.get("ppl") for r in rows}
    table: dict[tuple[str, float], dict[int | None, float | None]] = {}
    for policy, budget in [("full", 1.0), *((p, b) for p in policies for b in budgets)]:
        table[policy, budget] = {b: ppl.get((spec(policy, b, residual), budget)) for b in [None, *bits]}
    return table


def markdown_grid(table: dict, bits: list[int], tokens: int) -> str:
    head = [FP32, *(f"{b}-bit" for b in bits)]
    lines = [
        f"perplexity, {tokens} tokens of Wikipedia (in brackets: vs the same policy and budget unquantized)",
        "",
        "| policy | budget | " + " | ".join(head) + " |",
        "|---|---:|" + "---:|" * len(head),
    ]
    for (policy, budget), by_bits in table.items():
        base = by_bits[None]
        cells = []
        for b in [None, *bits]:
            value = by_bits[b]
            if value is None:
                cells.append("—")
            elif b is None or base is None:
                cells.append(f"{value:.3f}")
            else:
                cells.append(f"{value:.3f} ({(value / base - 1) * 100:+.1f} %)")
        lines.append(f"| {policy} | {budget_label(budget)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def claim(table: dict) -> str:
    policy, budget, bits, tol = CLAIM
    by_bits = table.get((policy, budget), {})
    base, quant = by_bits.get(None), by_bits.get(bits)
    if base is None or quant is None:
        return f"claim: {policy} {budget_label(budget)} + {bits}-bit vs unquantized: not measured"
    ratio = quant / base
    verdict = "holds" if abs(ratio - 1) <= tol else "does NOT hold"
    return (
        f"claim: {policy} {budget_label(budget)} + {bits}-bit within {tol:.0%} of {policy} {budget_label(budget)} "
        f"unquantized: {quant:.3f} vs {base:.3f} ({(ratio - 1) * 100:+.2f} %): {verdict}"
    )


def plot_grid(table: dict, bits: list[int], budgets: list[float], path: Path) -> Path:
    """Perplexity vs bits per element (fp32 = 32), one panel per budget, one line per policy."""
    plt = pyplot()
    panels = [1.0, *budgets]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    xs = [32, *bits]
    for ax, budget in zip(axes[0], panels, strict=True):
        for (policy, b), by_bits in table.items():
            if b != budget:
                continue
            points = [(x, by_bits[k]) for x, k in zip(xs, [None, *bits], strict=True) if by_bits[k] is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [FP32, *map(str, bits)])
        ax.set_xlabel("bits per K/V element")
        ax.set_ylabel("perplexity")
        ax.set_title("100 % (full)" if budget == 1.0 else f"budget {budget_label(budget)}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M on Wikipedia: eviction × quantized slots")
    return save_figure(fig, path)


@torch.inference_mode()
def bytes_rows(lengths: list[int], bits: list[int], budget: float, residual: int | None) -> list[dict[str, Any]]:
    """Measured vs predicted K/V bytes of h2o at ``budget`` of each length, and the full caches' bytes."""
    import kvsieve
    from kvsieve.benchmarks.memory import full_kv_bytes_per_token, held_kv_bytes
    from kvsieve.benchmarks.runner import prompt_tokens

    model, tokenizer = kvsieve.load_model("smollm2-135m", device="cpu")
    fp32_per_token = full_kv_bytes_per_token(model)  # (the model is float32)
    tokens = prompt_tokens(tokenizer, max(lengths))
    out = []
    for length in lengths:
        for b in [None, *bits]:
            cache = kvsieve.make_cache(model, "h2o", budget, kv_bits=b, residual=None if b is None else residual)
            model(tokens[None, :length], cache=cache, logits_to_keep=1)
            slots = max(cache.capacities())
            measured = cache.kv_nbytes()
            predicted = held_kv_bytes(model, slots, cache.codec)
            out.append(
                {
                    "length": length,
                    "bits": FP32 if b is None else b,
                    "residual": None if b is None else cache.codec.residual,
                    "budget_tokens": cache.budget_tokens,
                    "slots": slots,
                    "measured": measured,
                    "predicted": predicted,
                    "full_fp16": fp32_per_token // 2 * length,
                    "full_fp32": fp32_per_token * length,
                }
            )
    return out


def markdown_bytes(rows: list[dict[str, Any]], budget: float) -> str:
    lines = [
        f"K/V bytes of h2o at {budget_label(budget)} after a prefill of each length (the residual's exact tokens in "
        "float32, float16 scale and zero per group of 32)",
        "",
        "| length | bits | residual | budget | slots | measured | predicted | measured/predicted "
        "| full fp16 / measured | full fp32 / measured |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        residual = "—" if r["residual"] is None else r["residual"]
        lines.append(
            f"| {r['length']} | {r['bits']} | {residual} | {r['budget_tokens']} | {r['slots']} | {r['measured']:,} | "
            f"{r['predicted']:,} | {r['measured'] / r['predicted']:.4f} | {r['full_fp16'] / r['measured']:.1f}x | "
            f"{r['full_fp32'] / r['measured']:.1f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/quant-grid"))
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--policies", nargs="+", default=["h2o", "scissorhands", "streaming_llm"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.1])
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2])
    parser.add_argument("--bytes-lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--residual", type=int, help="exact newest tokens per row (default: the engine's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--report", action="store_true", help="compute no cell (the bytes are always measured)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    specs = [spec(p, b, args.residual) for p in ["full", *args.policies] for b in [None, *args.bits]]
    result = run_sweep(
        args.out / "sweep",
        ["ppl"],
        specs,
        [*args.budgets, 1.0],
        settings=Settings(ppl_tokens=args.ppl_tokens),
        threads=args.threads,
        compute=not args.report,
    )
    table = grid_tables(result.rows, args.policies, args.budgets, args.bits, args.residual)
    grid_md = markdown_grid(table, args.bits, args.ppl_tokens)
    claim_line = claim(table)
    plot = plot_grid(table, args.bits, args.budgets, args.out / "ppl_vs_bits.png")
    sizes = bytes_rows(args.bytes_lengths, args.bits, CLAIM[1], args.residual)
    bytes_md = markdown_bytes(sizes, CLAIM[1])
    report = "\n\n".join([grid_md, claim_line, bytes_md]) + "\n"
    (args.out / "report.md").write_text(report)
    (args.out / "bytes.json").write_text(json.dumps(sizes, indent=2))
    print(report)
    print(f"{result.computed} cell(s) computed; wrote {args.out / 'report.md'}, {plot}, {args.out / 'sweep'}")


if __name__ == "__main__":
    main()
