"""Published results, rendered from the files their commands wrote: no figure on a page is typed by hand.

A page (README.md, docs/*.md) holds blocks::

    <!-- results: PATH -->
    (rendered here)
    <!-- /results -->

``PATH``, relative to the repository root, is either a result file — what ``kvsieve compare --json``, ``kvsieve
bench --json`` (with or without a preset) or ``kvsieve reproduce --json`` (its claims table) printed, or
``scripts/ruler_cost.py``, ``ruler_floor.py``, ``ruler_overlap.py``, ``ruler_replay.py``, ``serve_soak.py --out`` or
``kvpress_ruler.py`` (its ``kvpress_ruler.json``: the table over all tasks) wrote; or ``kvsieve/architectures.py``,
the architectures the test matrix checks (:func:`kvsieve.architectures.markdown`); each result carries its
:func:`~kvsieve.provenance.provenance`, printed under the table — or the output directory of ``kvsieve ruler`` (its
summary tables, :func:`kvsieve.ruler.report.summary`; ``<!-- results: PATH overview -->``: its one table per length,
:func:`kvsieve.ruler.report.overview`; ``<!-- results: PATH claims -->``: the papers' claims checked on it,
:func:`kvsieve.ruler.claims.markdown`; ``<!-- results: PATH leaders -->``: the leading policies at each compression,
:func:`kvsieve.ruler.report.leaders`). ``python -m kvsieve.results [PAGE ...]`` renders every block
of the pages in place (default: README.md and every page under docs/); ``--check`` changes nothing and fails, naming
the pages, where a page and its data disagree (the test suite runs the same check). A figure in prose is tied to its
data the same way, inline: ``<!-- figure: PATH FIELD[:FORMAT] -->`` ... ``<!-- /figure -->`` (:func:`render`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvsieve.provenance import answered_on, host

__all__ = ["command_line", "figure", "md_table", "pages", "render", "render_file", "shown", "stale_pages"]

_BLOCK = re.compile(r"(<!-- results: (\S+)(?: (overview|claims|leaders))? -->\n)(.*?)(<!-- /results -->)", re.S)
MIB = 1 << 20


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]) + "\n"


def shown(value: str) -> str:
    """A result's argument as a page shows it: a file given by its absolute path by its name alone (where a run kept
    its files on the machine it ran on says nothing about the result)."""
    return Path(value).name if value.startswith("/") else value


def command_line(command: Sequence[str]) -> str:
    """A result's command as a page shows it (each argument :func:`shown`)."""
    return " ".join(map(shown, command))


def _origin(result: dict[str, Any]) -> str:
    """One line: the command, model and dtype, host, versions, code and date of a result."""
    p = result["provenance"]
    where = host(p["cpu"]) + (f", GPU {p['gpu']}" if "gpu" in p else "")
    versions = ", ".join(f"{name} {v}" for name, v in p["versions"].items() if v)
    model = " ".join(shown(str(p[k])) for k in ("model", "dtype") if p.get(k))
    return (
        f"*`{command_line(p['command'])}` · {model} · {where}, {p['threads']} torch thread(s) · {versions} · kvsieve "
        f"{p['kvsieve']} at {p['commit'] or 'an unknown commit'} · {p['date']}"
        + (f" · {p['note']}" if p.get("note") else "")
        + "*\n"
    )


def _ruler_origin(meta: dict[str, Any]) -> str:
    """One line from a ``kvsieve ruler`` directory's ``meta.json`` (written beside runs made on another machine, e.g. a
    GPU's): the command, model, dtype, device, versions, date and what the cells cover."""
    versions = ", ".join(f"{name} {v}" for name, v in meta["versions"].items())
    return (
        f"\n*`{meta['command']}` · {meta['model']} · {meta['dtype']} · {meta['device']} · {versions} · {meta['date']}."
        f" Covers {meta['covers']}.*\n"
    )


def _compare(result: dict[str, Any]) -> str:
    rows = [
        [
            f"`{r['policy']}`",
            "all" if r["budget_tokens"] is None else r["budget_tokens"],
            f"{r['ppl']:.3f}",
            "" if r["ppl_vs_full"] is None else f"{r['ppl_vs_full']:.3f}×",
            f"{r['kv_mib']:.2f}",
            f"{r['decode_tok_s']:.1f}",
        ]
        for r in sorted(result["rows"], key=lambda r: (r["budget_tokens"] is not None, r["ppl"]))
    ]
    (tokens,) = {r["tokens_scored"] for r in result["rows"]}
    head = f"Perplexity of {tokens:,} tokens streamed through each policy's cache (best first) and the KV it held:\n\n"
    header = ["policy", "budget (tokens)", "perplexity", "vs full", "KV MiB", "decode tok/s"]
    return head + md_table(header, rows)


def _stream_engine(result: dict[str, Any]) -> str:
    rows = [
        [f"`{r['policy']}`", f"{r['whole_tok_s']:.1f}", f"{r['decode_tok_s']:.1f}", f"{r['speedup']:.1f}×",
         f"{r['of_full']:.2f}×", f"{r['ppl_whole_prefix']:.4f}", f"{r['ppl_decode_prefix']:.4f}"]
        for r in result["stream_engine"]
    ]  # fmt: skip
    head = (
        f"A stream of {result['length']:,} tokens at budget {result['budget']}, {result['repeats']} round(s): the "
        "whole-sequence engine against one forward per token, and against `full`'s one forward pass:\n\n"
    )
    header = ["policy", "whole tok/s", "token-by-token tok/s", "speed-up", "of full", "ppl (whole)", "ppl (by token)"]
    return head + md_table(header, rows) + _checks(result)


def _bench(result: dict[str, Any]) -> str:
    from kvsieve.benchmarks.runner import DYNAMIC, FLOOR

    rows = []
    for c in result["cells"]:
        floor, full = c["ratios"].get(f"vs_{FLOOR}"), c["ratios"].get(f"vs_{DYNAMIC}")
        rows.append(
            [
                f"`{c['policy']}`",
                f"{c['prompt_tokens']}+{c['gen_tokens']}",
                c["batch"],
                "all" if c["budget_tokens"] is None else c["budget_tokens"],
                f"{c['prefill_s']:.2f}",
                f"{c['decode_tok_s']:.1f}",
                f"{c['step_ms_p50']:.1f}",
                "" if floor is None else f"{floor['step_ms_p50']:.3f}×",
                "" if full is None else f"{full['decode_tok_s']:.2f}×",
                f"{c['kv_bytes'] / MIB:.1f}",
            ]
        )
    header = ["policy", "prompt+gen", "batch", "budget", "prefill s", "decode tok/s", "step ms (p50)",
              "step / floor", "tok/s / DynamicCache", "KV MiB"]  # fmt: skip
    head = (
        f"Medians of {result['repeats']} rounds, decode steps in lockstep; the floor is a cache of the same size that "
        "never evicts:\n\n"
    )
    return head + md_table(header, rows) + _checks(result)


def _checks(result: dict[str, Any]) -> str:
    marks = {True: "passes", False: "**fails**", None: "not measured"}
    return "".join(f"\n- {c['check']}: {c['measured']} ({marks[c['passed']]})" for c in result["checks"]) + (
        "\n" if result["checks"] else ""
    )


def _ruler_cost(result: dict[str, Any]) -> str:
    parts = []
    for r in result["results"]:
        rows = [
            [f"`{row['policy']}`", f"{row['first_token_s']:.1f}", f"{row['answer_s']:.2f}", row["tokens"],
             "yes" if row["correct"] else "no"]
            for row in r["rows"]
        ]  # fmt: skip
        head = f"A {r['length']:,}-token RULER prompt, {r['dtype']}, peak RSS {r['peak_rss_gib']} GiB:\n\n"
        parts.append(head + md_table(["policy", "to the first token s", "answer s", "answer tokens", "correct"], rows))
        if "grid" in r:
            g = r["grid"]
            parts.append(
                f"\nThe grid's {g['settings']} settings of this prompt answered together: the shared prompt pass "
                f"{g['prefill_s']:.1f} s, the agnostic settings' question parts {g['question_s']:.1f} s, the answers "
                f"{g['answers_s']:.1f} s: **{g['total_s']:.1f} s**, against ≈ {g['alone_s']:.0f} s one setting at a "
                f"time (the mean of the settings above × {g['settings']}), **{g['speedup']:.1f}× faster**; "
                f"{g['correct']} of the {g['settings']} answers correct"
                + (
                    f"; the settings timed alone answered the same together: {g['same_as_alone']}"
                    if "same_as_alone" in g
                    else ""
                )
                + ".\n"
            )
            if "decode_steps" in g:
                steps = g["decode_steps"]
                rows = [[s["rows"], s["steps"], f"{s['seconds']:.1f}", f"{s['plain_s']:.1f}"] for s in steps]
                n = sum(s["steps"] for s in steps)
                parts.append(
                    f"\n{g['prompt_passes']} prompt pass(es); the answers' {n} decode steps by the rows still decoding,"
                    " beside as many steps of the model with transformers' own cache "
                    "(64 tokens, no eviction) at as many rows:\n\n"
                    + md_table(["rows", "steps", "seconds", "transformers' cache s"], rows)
                )
    return "\n".join(parts)


def _ruler_floor(result: dict[str, Any]) -> str:
    dtypes, grid = list(result["gflops"]), result["phases"]["grid"]
    phases = {
        "prompt": "the prompt pass (one per sample, its causal attention included)",
        "question": "the question parts (each question-agnostic setting)",
        "answers": "every setting's answer tokens after the first",
    }
    tokens = {"prompt": "prompt_tokens", "question": "question_tokens", "answers": "decode_tokens"}
    rows = [
        [name, f"{int(grid[tokens[p]]):,}", f"{grid[f'{p}_tflop']:,.1f}",
         *(f"{grid[f'{p}_{d}_s'] / 3600:.2f}" for d in dtypes)]
        for p, name in phases.items()
    ]  # fmt: skip
    hours = [sum(grid[f"{p}_{d}_s"] for p in phases) / 3600 for d in dtypes]
    tflop = sum(grid[f"{p}_tflop"] for p in phases)
    rows.append(
        [f"**the grid ({int(grid['samples'])} samples)**", "", f"{tflop:,.1f}", *(f"**{h:.2f}**" for h in hours)]
    )
    speeds = "; ".join(
        f"{d} {g['prompt']} GFLOP/s on {result['rows']['prompt']:,} rows, {g['answers']} on {result['rows']['answers']}"
        for d, g in result["gflops"].items()
    )
    head = ["phase", "tokens", "TFLOP", *(f"{d} CPU-hours" for d in dtypes)]
    text = (
        f"The {result['settings']} settings of `{result['run']}` ({result['model']}: "
        f"{result['linear_weights']:,} weights in linear layers, {result['output_weights']:,} in the output layer) at "
        f"the best speed of `torch.nn.functional.linear` on one core of this host ({speeds}):\n\n"
        + md_table(head, rows)
    )
    by_rows = {int(rows): n for rows, n in result.get("steps_by_rows", {}).items()}
    if by_rows:
        top = max(by_rows)
        bands = [(lo, min(hi, top)) for lo, hi in ((1, 8), (9, 32), (33, 64), (65, top)) if lo <= top]
        cells = [[f"{lo} to {hi}", f"{sum(n for r, n in by_rows.items() if lo <= r <= hi):,}"] for lo, hi in bands]
        text += (
            f"\nThe answers' {sum(by_rows.values()):,} decode steps (one per sample and answer token after the first) "
            "by the rows they decode:\n\n" + md_table(["rows", "decode steps"], cells)
        )
    timed = result.get("timed")
    if not timed:
        return text
    task = result["phases"][timed["task"]]
    n, both = task["samples"], [d for d in dtypes if d in timed["cpu_s"]]
    cells = [[name, *(x for d in both for x in (f"{task[f'{p}_{d}_s'] / n:.1f}", f"{timed['cpu_s'][d][p]:.1f}"))]
             for p, name in [("prompt", "the shared prompt pass"), ("question", "the question parts"),
                             ("answers", "the answers")]]  # fmt: skip
    alone = ", ".join(f"{timed['cpu_s'][d]['alone']:.1f} in {d}" for d in both)
    counted = {"prompt": "prompt tokens", "question": "question tokens", "decode": "answer tokens"}
    per = ", ".join(f"{task[f'{t}_tokens'] / n:,.0f} {what}" for t, what in counted.items())
    return (
        text + f"\nA `{timed['task']}` sample of {timed['tokens']:,} tokens timed under every setting together "
        f"(`{timed['result']}`, {timed['threads']} threads: its seconds × {timed['threads']} in CPU seconds) beside "
        f"the floor of the grid's {int(n)} `{timed['task']}` samples (per sample {per}); the full cache's prompt pass "
        f"alone took {alone} CPU seconds:\n\n"
        + md_table(["phase", *(f"{d} CPU-s {k}" for d in both for k in ("floor", "timed"))], cells)
    )


def _ruler_overlap(result: dict[str, Any]) -> str:
    names = {"one_at_a_time": "one sample at a time", "together": "the next samples joining"}
    figures = [
        ("seconds", "wall seconds", "{:,.1f}"),
        ("prompt_passes", "prompt passes", "{}"),
        ("prompt_s", "prompt passes s", "{:,.1f}"),
        ("question_s", "question parts s", "{:,.1f}"),
        ("decode_steps", "decode steps", "{:,}"),
        ("decode_s", "decode steps s", "{:,.1f}"),
        ("few_row_steps", "steps of at most 8 rows", "{:,}"),
        ("few_row_s", "their seconds", "{:,.1f}"),
        ("rows_per_step", "rows per step", "{}"),
        ("correct", "answers correct", "{}"),
    ]
    parts = []
    for r in result["results"]:
        rows = [[label, *(form.format(r[arm][key]) for arm in r["order"])] for key, label, form in figures]
        parts.append(
            f"{len(r['samples'])} samples of {r['length']:,} tokens ({', '.join(r['samples'])}) under the grid's "
            f"{r['settings']} settings each, {r['dtype']}, caches bound to {r['kv_memory_gib']} GiB, in the order "
            f"shown: **{r['speedup']}× faster** with the next samples joining; {r['same_text']} of the "
            f"{r['answers']} answers the same text both ways; peak RSS {r['peak_rss_gib']} GiB.\n\n"
            + md_table(["", *(names[arm] for arm in r["order"])], rows)
        )
    return "\n".join(parts)


def _ruler_replay(result: dict[str, Any]) -> str:
    r = result["result"]
    names = {"passes": "a model pass per group", "replay": "the first group's pass, replayed after"}
    header = ["", *(f"group {i + 1} ({n} settings) s" for i, n in enumerate(r["groups"])), "all groups s"]
    rows = [[names[arm], *(f"{s:,.1f}" for s in r[arm]["group_s"]), f"{r[arm]['total_s']:,.1f}"] for arm in names]
    rounds = "one round" if r["rounds"] == 1 else f"the fastest of {r['rounds']} rounds"
    return (
        f"One sample of {r['length']:,} tokens under the grid's {r['settings']} settings in {len(r['groups'])} groups, "
        f"{r['dtype']}, {rounds}: the later groups **{r['later_speedup']}× faster** replaying the first group's pass, "
        f"all groups {r['speedup']}×; the recorded pass holds {r['recorded_gib']} GiB; {r['same_caches']} of the "
        f"{r['settings']} caches hold the same tokens both ways; peak RSS {r['peak_rss_gib']} GiB.\n\n"
        + md_table(header, rows)
    )


def _serve_soak(result: dict[str, Any]) -> str:
    req, t, rss, kv, down = (result[k] for k in ("requests", "throughput", "rss_mib", "kv_bytes", "shutdown"))
    prompts, latency, first = result["prompt_tokens"], result["latency_s"], result["first_chunk_s"]
    by_result = ", ".join(f"{name} {count:,}" for name, count in sorted(req["by_result"].items()))
    rows = [
        ["requests", f"{req['sent']:,} in {t['seconds']:,.0f} s ({by_result})"],
        ["of which", f"{req['malformed']:,} malformed, {req['streamed']:,} streamed, {req['several_choices']:,} "
         "with `n` of 2 or 3"],
        ["prompt tokens", f"p50 {prompts['p50']:,.0f}, max {prompts['max']:,} ({prompts['over_2048']} over 2,048)"],
        ["throughput", f"{t['requests_per_s']:.2f} requests/s, {t['tokens_per_s']:.1f} generated tokens/s"],
        ["latency p50 / p99", f"{latency['p50']:.2f} / {latency['p99']:.2f} s"],
        ["first chunk p50 / p99", f"{first['p50']:.2f} / {first['p99']:.2f} s"],
        ["server RSS start / warm / middle / end", f"{rss['start']:.0f} / {rss['warm']:.0f} / {rss['middle']:.0f} / "
         f"{rss['end']:.0f} MiB (after warm-up at most {rss['growth_after_warm']:+.1%})"],
        *([["RSS beyond the KV held (median)", f"{rss['beyond_kv_after_warm']:.0f} MiB after warm-up, "
            f"{rss['beyond_kv_last']:.0f} MiB over the last fifth ({rss['beyond_kv_growth']:+.1%})"]]
          if rss.get("beyond_kv_growth") is not None else []),
        ["KV bytes held at most", f"{kv['held_max'] / MIB:.1f} MiB of a {kv['cap'] / MIB:.0f} MiB cap (reserved at "
         f"most {kv['reserved_max_polled'] / MIB:.1f} MiB)"],
        ["SIGTERM under load", f"{down['completed']} of {down['streams']} streams completed, the server ended "
         f"{down['seconds_after_signal']:.1f} s after the signal (exit {down['exit_code']})"],
    ]  # fmt: skip
    return md_table(["", "measured"], rows) + _check_list(result["checks"])


def _check_list(checks: dict[str, bool | None]) -> str:
    """A script's checks as a markdown list."""
    marks = {True: "passes", False: "**fails**", None: "not judged"}
    return "".join(f"\n- `{name}`: {marks[value]}" for name, value in checks.items()) + "\n"


def _serve_ray(result: dict[str, Any]) -> str:
    summary, settings = result["summary"], result["settings"]
    spread, exit_ = summary["spread"], summary["exit"]
    where = f"a cluster at `{settings['ray']}`" if settings["ray"] else "a new local Ray"
    per_replica = " / ".join(str(n) for n in spread["per_replica"].values())
    held = " / ".join(f"{most / MIB:.1f}" for most in summary["kv_held_max"].values())
    rows = [
        ["replicas", f"{settings['replicas']} on {where}, serving {summary['start_seconds']:.0f} s after the start"],
        ["requests spread", f"{spread['answered']} of {spread['requests']} sent at once answered, {per_replica} per "
         f"replica on {spread['nodes']} node(s); {spread['requests_per_s']:.2f} requests/s, latency p50 / max "
         f"{spread['latency_p50']:.1f} / {spread['latency_max']:.1f} s"],
        ["KV held at most", f"{held} MiB per replica, each under a {summary['kv_cap'] / MIB:,.0f} MiB cap"],
    ]  # fmt: skip
    if "fault" in summary:
        f = summary["fault"]
        by_elimination = f.get("victim_seen_by") == "elimination"
        seen = " (the other replicas' /metrics showed none unstreamed)" if by_elimination else ""
        rows += [
            [f"a replica killed (SIGKILL) holding {f['victim_held']} requests, {f['victim_streams']} streamed{seen}",
             f"{f['plain_answered']} of {f['plain']} unstreamed requests "
             f"answered in full ({f['plain_retried']} retried on the other replica); of {f['streams']} streams "
             f"{f['streams_complete']} complete, {f['streams_ended_by_error']} ended by the error event; {f['hung']} "
             f"hung, the slowest ended after {f['slowest_seconds']:.0f} s"],
            ["replacement", f"Serve's new replica answered {f['replaced_seconds_after_kill']:.0f} s after the kill"],
        ]  # fmt: skip
    rows.append(["Ctrl-C", f"the server exited {exit_['code']} after {exit_['seconds']:.1f} s"])
    note = (
        f"`{settings['policy']}` at a budget of {settings['budget']} tokens; greedy completions of {settings['short']} "
        f"tokens (spread) and {settings['long']} (in flight at the kill).\n"
    )
    return md_table(["", "measured"], rows) + "\n" + note + _check_list(result["checks"])


def _compiled_decode(result: dict[str, Any]) -> str:
    settings = result["settings"]
    rows = [
        [
            f"`{r['policy']}`",
            f"{r['eager_step_ms']:.1f}",
            f"{r['compiled_step_ms']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['traces']} in {r['warm_up_with_traces_s']:.0f} s",
            "same" if r["same_tokens"] else f"differ from step {r['first_difference']}",
        ]
        for r in result["results"]
    ]
    header = ["cache", "eager ms/step", "compiled ms/step", "speed-up", "traces", "greedy tokens"]
    note = (
        f"Prompt {settings['prompt']:,} tokens, kvsieve caches at {settings['budget']:,}; medians of "
        f"{settings['rounds']} rounds of {settings['steps']} steps each.\n"
    )
    return md_table(header, rows) + "\n" + note


def _kvpress_ruler(result: dict[str, Any]) -> str:
    from kvsieve.ruler.scoring import plus_minus

    def both(row: dict[str, Any], fmt: str, key: str) -> str:
        mine, theirs = row["kvsieve"], row["kvpress"]
        return f"{fmt.format(mine[key]) if mine else '—'} / {fmt.format(theirs[key])}"

    rows = [
        [
            f"`{r['kvsieve_spec']}`" if r["kvsieve_spec"] else "—",
            r["press"],
            f"{r['compression']:g}" if r["compression"] else "—",
            f"{r['tasks']} / {r['samples']}",
            plus_minus(r["kvsieve"]["score"], r["kvsieve"]["stderr"]) if r["kvsieve"] else "—",
            plus_minus(r["kvpress"]["score"], r["kvpress"]["stderr"]),
            "—" if r["same_answer"] is None else f"{round(r['same_answer'] * r['samples'])} of {r['samples']}",
            both(r, "{:.1f}", "seconds"),
            both(r, "{:,.0f}", "rss_rise_mib"),
        ]
        for r in result["overview"]
    ]
    header = ["kvsieve", "kvpress", "c", "tasks / samples", "score kvsieve %", "score kvpress %", "same answer",
              "s / sample", "RSS rise MiB"]  # fmt: skip
    theirs = ", ".join(f"{k} {v}" for k, v in result["versions"]["kvpress"].items())
    return (
        f"Question-agnostic, both sides fed the same token ids and keeping the same number of context tokens; "
        f"scores ± standard error over the samples of all tasks pooled; kvsieve / kvpress in the paired columns; "
        f"kvpress side: {theirs}. Answered on {answered_on(result['hosts'])}.\n\n" + md_table(header, rows)
    )


def _reproduce(result: dict[str, Any]) -> str:
    from kvsieve.reproduce.claims import claims_table, tally

    return claims_table(result["claims"]) + "\n" + tally(result["claims"]) + "\n"


def _renderer(result: dict[str, Any]) -> Callable[[dict[str, Any]], str]:
    program, command = result["provenance"]["command"][:2]
    if Path(program).name == "ruler_cost.py":
        return _ruler_cost
    if Path(program).name == "ruler_floor.py":
        return _ruler_floor
    if Path(program).name == "ruler_overlap.py":
        return _ruler_overlap
    if Path(program).name == "ruler_replay.py":
        return _ruler_replay
    if Path(program).name == "serve_soak.py":
        return _serve_soak
    if Path(program).name == "compiled_decode.py":
        return _compiled_decode
    if Path(program).name == "serve_ray.py":
        return _serve_ray
    if Path(program).name == "kvpress_ruler.py":
        return _kvpress_ruler
    if command == "compare":
        return _compare
    if command == "reproduce":
        return _reproduce
    if command == "bench" and "stream_engine" in result:
        return _stream_engine
    if command == "bench" and "cells" in result:
        return _bench
    raise ValueError(f"no renderer for the result of `{' '.join(result['provenance']['command'][:2])}`")


def render_file(path: Path, view: str | None = None) -> str:
    """The markdown of the result at ``path``: a ``--json`` result file, or a ``kvsieve ruler`` output directory
    (its summary tables; ``view``: ``overview``, its one table per length, ``claims``, the papers' claims, or
    ``leaders``, the policies keeping the most answers at each compression)."""
    if path.suffix == ".py":  # a module of the package that states a table (kvsieve/architectures.py): its markdown()
        import importlib

        return importlib.import_module(f"kvsieve.{path.stem}").markdown()
    if path.is_dir():
        from kvsieve.ruler import claims, report

        rows = report.collect(path)
        meta = path / "meta.json"
        views = {
            None: lambda: report.summary(rows, level=4),
            "overview": lambda: report.overview(rows),
            "claims": lambda: claims.markdown(rows) + "\n",
            "leaders": lambda: report.leaders(rows),
        }
        tables = views[view]()
        return tables + (_ruler_origin(json.loads(meta.read_text())) if meta.is_file() else "")
    if view:
        raise ValueError(f"{path}: `{view}` is a view of a kvsieve ruler directory, not of a result file")
    result = json.loads(path.read_text())
    return _renderer(result)(result) + "\n" + _origin(result)


_FIGURE = re.compile(
    r"(<!-- figure: (\S+) ((?:\[[^\]\s]*\]|\{[^}\s]*\}|[^\s:\[{])+)(?::(\S+))? -->)(.*?)(<!-- /figure -->)", re.S
)  # (a selection's value may hold a colon: [policy=snapkv:pooling=mean])
_STEP = re.compile(r"(\w*)(?:\[(-?\d+)\]|\[(\w+=[^\]]+)\]|\{(\w+=[^}]+)\})?")
_OUTSIDE = r"(?![^\[{]*[\]}])"  # (a character outside the brackets of a selection)
_AGGREGATES: dict[str, Callable[[list[Any]], Any]] = {
    "count": len, "sum": sum, "min": min, "max": max, "mean": lambda values: sum(values) / len(values)
}  # fmt: skip


def _where(items: list[Any], conditions: str) -> list[Any]:
    """The elements of ``items`` whose keys read as ``conditions`` says: ``KEY=VALUE`` pairs joined by commas."""
    pairs = [condition.split("=", 1) for condition in conditions.split(",")]
    return [item for item in items if all(str(item[key]) == value for key, value in pairs)]


def _path(result: Any, field: str) -> Any:
    value = result
    for step in re.split(r"\." + _OUTSIDE, field):
        found = _STEP.fullmatch(step)
        if found is None:
            raise ValueError(f"no single value at {field!r} (at {step!r})")
        name, index, one, every = found.groups()
        try:
            if name and isinstance(value, list):
                value = _AGGREGATES[name](value) if name in _AGGREGATES else [item[name] for item in value]
            elif name:
                value = value[name]
            if index is not None:
                value = value[int(index)]
            elif one is not None:
                (value,) = _where(value, one)
            elif every is not None:
                value = _where(value, every)
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as err:
            raise ValueError(f"no single value at {field!r} (at {step!r})") from err
    return value


def figure(result: Any, field: str) -> Any:
    """The value at ``field`` of a result: names joined by dots, each optionally followed by ``[KEY=VALUE]`` (the
    one element of a list whose ``KEY`` reads ``VALUE``) or ``[INDEX]`` — ``rows[policy=h2o].ppl``. ``[K=V,K2=V2]``
    asks every pair of the one element; ``{K=V,...}`` keeps every element that matches, a list. A name after a list
    reads it in each element, but ``count``, ``sum``, ``min``, ``max`` and ``mean``, which reduce the list:
    ``rows{budget=64}.ppl.mean``. Fields joined by ``*`` or ``/`` are multiplied or divided, left to right (a ratio
    of two figures: ``a.seconds/b.seconds``), a number after either standing for itself (``step_s*1000``: ms). A
    ``ValueError`` naming the field where it leads nowhere."""
    terms = re.split(r"([*/])" + _OUTSIDE, field)
    value = _path(result, terms[0])
    for operator, term in zip(terms[1::2], terms[2::2], strict=True):
        other = float(term) if re.fullmatch(r"\d+(\.\d+)?", term) else _path(result, term)
        try:
            value = value * other if operator == "*" else value / other
        except (TypeError, ZeroDivisionError) as err:
            raise ValueError(f"no single value at {field!r} (at {operator}{term!r})") from err
    return value


def render(text: str, root: Path) -> str:
    """``text`` with every results block rendered from its data under ``root``, and every inline figure::

        <!-- figure: PATH FIELD[:FORMAT] -->(the value)<!-- /figure -->

    the value at ``FIELD`` (:func:`figure`) of the result file ``PATH``, formatted with Python's ``FORMAT``."""
    text = _BLOCK.sub(lambda m: m[1] + render_file(root / m[2], view=m[3]) + m[5], text)
    results: dict[str, Any] = {}

    def value(m: re.Match[str]) -> str:
        if m[2] not in results:
            results[m[2]] = json.loads((root / m[2]).read_text())
        return m[1] + format(figure(results[m[2]], m[3]), m[4] or "") + m[6]

    return _FIGURE.sub(value, text)


def pages(root: Path) -> list[Path]:
    """The pages that may hold results blocks: README.md and every markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def stale_pages(root: Path, among: Sequence[Path] | None = None) -> list[Path]:
    """The pages (``among``, default :func:`pages`) whose results blocks disagree with their data under ``root``."""
    return [page for page in among or pages(root) if render(text := page.read_text(), root) != text]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsieve.results", description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to render (default: README.md and docs/**/*.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; fail where a page disagrees")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root (default: here)")
    args = parser.parse_args(argv)
    stale = stale_pages(args.root, args.pages)
    if args.check:
        if stale:
            print("results out of date with their data:", *stale, "run: python -m kvsieve.results", file=sys.stderr)
        return 1 if stale else 0
    for page in stale:
        page.write_text(render(page.read_text(), args.root))
        print("rendered", page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
