"""What replaying a sample's recorded prompt pass saves where its settings' caches do not fit in memory together.

    python scripts/ruler_replay.py --model qwen2.5-coder-0.5b --length 4096 --groups 2 --dtype bfloat16
    python scripts/ruler_replay.py --model qwen2.5-coder-1.5b --length 4096 --groups 2 --dtype float32

The first ``niah_single_2`` sample of the length (seed 0, the built-in articles) under every setting of the default grid
(every default policy at the default compressions, both protocols, and the full cache), in ``--groups`` groups of
consecutive settings, as equal in number as they divide (a run splits them so where their caches do not fit its memory
bound together: :func:`~kvsieve.ruler.predict.setting_groups`), each group's caches filled with their first tokens
(:func:`~kvsieve.ruler.predict.prefill_together`: the prompt pass, then the agnostic settings' question part) in two
arms: **passes**, each group by a model pass of its own, and **replay**, the first group's pass recorded and the next
groups' replaying it (:class:`~kvsieve.ruler.predict.PromptPass`). The arms alternate over ``--rounds`` rounds (the
first round's order: passes first); each group's caches are freed once timed, after their held tokens are compared
between the arms (every layer's held positions). Prints a table and writes JSON with its
:func:`~kvsieve.provenance.provenance` (``--out``; :mod:`kvsieve.results` renders it in the performance notes,
``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

TASK = "niah_single_2"
ARMS = ("passes", "replay")


def groups_of(settings: list, count: int) -> list[list]:
    """``settings`` in ``count`` groups of consecutive settings, as equal in number as they divide."""
    size = -(-len(settings) // count)
    return [settings[i : i + size] for i in range(0, len(settings), size)]


def fill(model, prompt: tuple, groups: list[list], replay: bool) -> tuple[list[float], list, int]:
    """Each group's caches filled (and freed) in turn: the seconds of each, every cache's held positions by layer
    (in the groups' order) and the bytes of the recorded pass (0: none)."""
    from kvsieve.ruler import predict

    prompt_pass = predict.PromptPass() if replay else None
    seconds, held = [], []
    for group in groups:
        start = time.perf_counter()
        rows = predict.prefill_together(model, *prompt, group, 2, prompt_pass)
        seconds.append(time.perf_counter() - start)
        held += [[layer.held_positions() for layer in row.cache.layers] for row in rows]
        del rows
    return seconds, held, 0 if prompt_pass is None else prompt_pass.recorded.nbytes


def measure(model_name: str, length: int, dtype: str, count: int, rounds: int) -> dict:
    import kvsieve
    from kvsieve.ruler import run
    from kvsieve.ruler.tasks import Prompter, generate_samples

    model, tokenizer = kvsieve.load_model(model_name, dtype=dtype)
    prompter = Prompter(tokenizer)
    (sample,) = generate_samples(TASK, length, 1, prompter, run.sources(with_reading=False), seed=0)
    prompt = prompter.ids(sample.context, sample.question, sample.answer_prefix)
    settings = run.grid_settings(run.default_policies(), run.DEFAULT_COMPRESSIONS, ["agnostic", "aware"])
    groups = groups_of(settings, count)
    fill(model, (prompt[0][:256], prompt[1]), groups_of(settings, 2), replay=True)  # (warm-up)
    times: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    held, recorded = {}, 0
    for r in range(rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            seconds, held[arm], nbytes = fill(model, prompt, groups, replay=arm == "replay")
            times[arm].append(seconds)
            recorded = max(recorded, nbytes)
    same = sum(
        all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
        for x, y in zip(held["passes"], held["replay"], strict=True)
    )
    best = {arm: [min(t[g] for t in times[arm]) for g in range(len(groups))] for arm in ARMS}
    return {
        "length": len(prompt[0]) + len(prompt[1]),
        "dtype": dtype,
        "settings": len(settings),
        "groups": [len(g) for g in groups],
        "rounds": rounds,
        **{arm: {"group_s": [round(s, 1) for s in best[arm]], "total_s": round(sum(best[arm]), 1)} for arm in ARMS},
        "later_speedup": round(sum(best["passes"][1:]) / sum(best["replay"][1:]), 2),
        "speedup": round(sum(best["passes"]) / sum(best["replay"]), 2),
        "recorded_gib": round(recorded / 2**30, 2),
        "same_caches": same,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.groups < 2 or args.rounds < 1:
        parser.error("--groups must be at least 2 and --rounds at least 1")
    from kvsieve.provenance import provenance

    origin = provenance(["scripts/ruler_replay.py", *sys.argv[1:]], model=args.model, threads=args.threads)
    torch.set_num_threads(args.threads)
    result = measure(args.model, args.length, args.dtype, args.groups, args.rounds)
    rounds = "one round" if args.rounds == 1 else f"the fastest of {args.rounds} rounds"
    print(f"{args.model}, {result['length']:,} tokens, {result['dtype']}: {result['settings']} settings in groups of "
          f"{result['groups']}, {rounds}")  # fmt: skip
    for arm in ARMS:
        print(f"  {arm}: {result[arm]['group_s']} s, {result[arm]['total_s']} s in all")
    print(f"  the later groups {result['later_speedup']}x faster replayed, all {result['speedup']}x; recorded pass "
          f"{result['recorded_gib']} GiB; {result['same_caches']} of {result['settings']} caches the same")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"result": result, "provenance": origin}, indent=1))


if __name__ == "__main__":
    main()
