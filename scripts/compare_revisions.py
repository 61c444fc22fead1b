"""Decode speed of the working tree against another git revision, measured in one run.

``kvsieve bench`` runs alternately on the two versions (rounds A B B A A B ..., each in its own process, so both
see the same machine drift), and the step ratios each version measures against its own same-size floor (and its
decode speed against DynamicCache) are compared, per policy:

    python scripts/compare_revisions.py HEAD~3 --rounds 4 -- --prompt-lens 2048 --gen-lens 64 --batches 1 \\
        --policies h2o streaming_llm --repeats 1   (the arguments after -- go to kvsieve bench)

The base revision is checked out in a temporary git worktree (removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(tree: Path, args: list[str]) -> dict:
    """One ``kvsieve bench --json`` run of the code in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "kvsieve.cli", "bench", *args, "--json"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


def ratios(result: dict) -> dict[str, tuple[float, float]]:
    """Per policy: (decode step / the floor's, decode tok/s / DynamicCache's), medians of the run's rounds."""
    out = {}
    for cell in result["cells"]:
        vs = cell["ratios"]
        if "vs_floor" in vs and "vs_dynamic_full" in vs:
            out[cell["policy"]] = (vs["vs_floor"]["step_ms_p50"], vs["vs_dynamic_full"]["decode_tok_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the git revision to compare with (e.g. HEAD~3, a commit)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each version (default 4)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, bench_args = parser.parse_args(argv[:split]), argv[split + 1 :]
    with tempfile.TemporaryDirectory(prefix="kvsieve-base-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True)
        try:
            seen: dict[str, list[dict[str, tuple[float, float]]]] = {"base": [], "current": []}
            order = [("base", base), ("current", ROOT)]
            for i in range(args.rounds):
                for name, tree in order if i % 2 == 0 else order[::-1]:
                    seen[name].append(ratios(bench(tree, bench_args)))
                    print(f"round {i + 1} {name}: {seen[name][-1]}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=True)
    policies = sorted(seen["current"][0])
    print(f"{'policy':<16}{'step/floor base':>18}{'current':>10}{'tok/s vs dynamic base':>24}{'current':>10}")
    for policy in policies:
        medians = [
            statistics.median(run[policy][k] for run in seen[name]) for k in (0, 1) for name in ("base", "current")
        ]
        print(f"{policy:<16}{medians[0]:>17.3f}x{medians[1]:>9.3f}x{medians[2]:>23.2f}x{medians[3]:>9.2f}x")
    print(f"({args.rounds} runs of each, alternating; kvsieve bench {' '.join(bench_args)})")


if __name__ == "__main__":
    main()
