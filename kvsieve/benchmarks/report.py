"""The report of ``kvsieve bench``: the plain-text table of the cells (and of a profile), the skipped grid points,
the largest batches and the preset's checks; the plot of decode speed against context length."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsieve.benchmarks.defaults import EVICTION_OVERHEAD, STREAM_ENGINE
from kvsieve.benchmarks.memory import MIB
from kvsieve.benchmarks.runner import DYNAMIC, FLOOR, REFERENCES, Cell, find_cells
from kvsieve.evaluation.plots import pyplot, save_figure


def plot_decode(cells: Sequence[Cell], path: str | Path, title: str = "") -> Path:
    """Decode tokens/s vs context length (prompt tokens), one line per policy, one panel per batch size. Where a
    prompt length was measured with several generation lengths, the longest generation is plotted."""
    plt = pyplot()
    batches = sorted({c.batch for c in cells})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for name in dict.fromkeys(c.policy for c in cells):
            best: dict[int, Cell] = {}
            for c in find_cells(cells, policy=name, batch=batch):
                if c.prompt_tokens not in best or c.gen_tokens > best[c.prompt_tokens].gen_tokens:
                    best[c.prompt_tokens] = c
            xs = sorted(best)
            style = "--" if name in REFERENCES else "-"
            ax.plot(xs, [best[x].decode_tok_s for x in xs], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        prompts = sorted({c.prompt_tokens for c in find_cells(cells, batch=batch)})
        ax.set_xticks(prompts, [str(p) for p in prompts])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context length (prompt tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {batch}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_report(result: dict[str, Any]) -> str:
    """The result of ``kvsieve bench`` as plain text: the cells, skipped grid points, largest batches and the preset's
    checks (or the profile)."""
    lines = []
    if "profile" in result:
        p = result["profile"]
        lines.append(
            f"{p['policy']} decode step, budget {p['budget_tokens']}, after a {p['prompt_tokens']}-token prompt: "
            f"{p['step_ms_profiled']:.2f} ms/step under the profiler ({p['steps']} steps), "
            f"{p['op_calls_per_step']:.0f} op calls/step"
        )
        body = [
            [o["op"], f"{o['calls_per_step']:.1f}", f"{o['self_ms_per_step']:.3f}", f"{o['total_ms_per_step']:.3f}",
             f"{o['self_share']:.1%}"]
            for o in p["ops"]
        ]  # fmt: skip
        lines += _table(["op", "calls/step", "self ms/step", "total ms/step", "self share"], body)
        return "\n".join(lines)
    if "stream_engine" in result:
        lines.append(
            f"stream of {result['length']} tokens at budget {result['budget']}, {result['threads']} thread(s), "
            f"{result['repeats']} round(s): whole-sequence engine vs one forward per token"
        )
        body = [
            [r["policy"], f"{r['whole_tok_s']:.1f}", f"{r['decode_tok_s']:.1f}", f"{r['speedup']:.1f}x",
             f"{r['full_tok_s']:.1f}", f"{r['of_full']:.2f}x", f"{r['ppl_whole']:.3f}", f"{r['ppl_whole_prefix']:.4f}",
             f"{r['ppl_decode_prefix']:.4f}"]
            for r in result["stream_engine"]
        ]  # fmt: skip
        header = ["policy", "whole tok/s", "decode tok/s", "speed-up", "full tok/s", "of full", "ppl",
                  "ppl prefix whole", "ppl prefix decode"]  # fmt: skip
        return "\n".join(lines + _table(header, body) + _checks(result["checks"], STREAM_ENGINE))
    body = []
    for c in result["cells"]:
        floor, full = c["ratios"].get(f"vs_{FLOOR}"), c["ratios"].get(f"vs_{DYNAMIC}")
        body.append(
            [
                f"{c['prompt_tokens']}+{c['gen_tokens']}",
                str(c["batch"]),
                c["policy"],
                "all" if c["budget_tokens"] is None else str(c["budget_tokens"]),
                f"{c['prefill_s']:.3f}",
                f"{c['decode_tok_s']:.1f}",
                f"{c['throughput_tok_s']:.1f}",
                f"{c['step_ms_p50']:.2f}",
                f"{c['step_ms_p90']:.2f}",
                "" if floor is None else f"{floor['step_ms_p50']:.2f}x",
                "" if full is None else f"{full['decode_tok_s']:.2f}x",
                f"{c['peak_rss_mb']:.0f}",
                f"{c['rss_growth_mb']:.0f}",
                f"{c['kv_bytes'] / MIB:.2f}",
                f"{c['state_bytes'] / MIB:.2f}",
            ]
        )
    header = ["cell", "batch", "policy", "budget", "prefill s", "decode tok/s", "e2e tok/s", "step p50 ms",
              "p90 ms", "step/floor", "tok/s/full", "peak RSS MB", "growth MB", "KV MiB", "state MiB"]  # fmt: skip
    lines += _table(header, body)
    lines += [f"skipped {s['prompt_tokens']}+{s['gen_tokens']} b{s['batch']}: {s['reason']}" for s in result["skipped"]]
    for row in result.get("max_batch", []):
        verified = "" if row["verified"] is None else f", verified peak {row['verified_peak_mb']:.0f} MiB"
        verdict = "" if row["verified"] is None else (" (fits)" if row["verified"] else " (EXCEEDS the cap)")
        lines.append(
            f"largest batch under {row['cap_mb']:.0f} MiB at {row['prompt_tokens']}+{row['gen_tokens']}: "
            f"{row['policy']} {row['max_batch']} (predicted peak {row['predicted_peak_mb']:.0f} MiB{verified}{verdict})"
            + (f" [{row['note']}]" if row["note"] else "")
        )
    lines += _checks(result["checks"], EVICTION_OVERHEAD)
    lines.append(
        f"(medians of {result['repeats']} rounds, decode steps in lockstep; {result['threads']} torch threads on "
        f"{result['device']}, load average {result['load_avg']:.1f} at the start; peak RSS per run: "
        f"{result['rss_method']})"
    )
    return "\n".join(lines)


def _checks(checks: list[dict[str, Any]], preset: str) -> list[str]:
    """A preset's checks, one line each."""
    marks = {True: "pass", False: "FAIL", None: "n/a"}
    return [f"checks of the {preset} preset:"] + [
        f"  [{marks[c['passed']]}] {c['check']}: {c['measured']}" for c in checks
    ]
