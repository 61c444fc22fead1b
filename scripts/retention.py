"""Where in the context do the kept tokens lie? H2O vs AhaKV on one long Wikipedia article.

AhaKV's claim (Gu et al. 2025): accumulated attention is biased towards early positions, so H2O's kept tokens
crowd at the start of the context, while AhaKV's spread across it. This script streams one built-in article of
``--tokens`` tokens through the default model (SmolLM2-135M) with each policy at each budget, pools the positions
every layer and KV head holds at the end, prints the share of kept tokens in each tenth of the context, and saves
their histograms to ``--out``.

To keep a CPU run to a minute or two, the first ``tokens - stream`` tokens are one prefill pass (compressed to the
budget at once) and only the last ``--stream`` tokens are streamed one at a time
(:func:`kvsieve.evaluation.perplexity.stream_perplexity`); the cache has then seen ``tokens - 1`` tokens.

    python scripts/retention.py [--tokens 4096] [--stream 200] [--budgets 0.1 0.2] [--out out/retention.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import kvsieve
from kvsieve.data import builtin_text
from kvsieve.evaluation.perplexity import stream_perplexity

TENTHS = 10


def kept_positions(cache: kvsieve.SieveCache) -> torch.Tensor:
    """Original positions held by every layer and KV head, pooled (1-D)."""
    pos = torch.cat([cache.positions(i).flatten() for i in range(len(cache.layers))])
    return pos[pos >= 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="context length (tokens of one article)")
    parser.add_argument("--stream", type=int, default=200, help="last tokens streamed one at a time")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2], help="ratios of the context")
    parser.add_argument("--policies", nargs="+", default=["h2o", "ahakv"])
    parser.add_argument("--out", type=Path, default=Path("out/retention.png"))
    args = parser.parse_args()

    model, tokenizer = kvsieve.load_model("smollm2-135m", device="cpu")
    text = builtin_text(min_chars=args.tokens * 6)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    if ids.shape[1] < args.tokens:
        raise SystemExit(f"the longest built-in article has only {ids.shape[1]} tokens")
    seen = args.tokens - 1
    print(f"article: {text.splitlines()[0]} — {args.tokens} tokens, prefill {args.tokens - args.stream}")
    print(f"{'policy':<8} {'budget':>6} {'ppl':>7}  share of kept tokens per tenth of the context (%)")

    fig, axes = plt.subplots(len(args.budgets), 1, figsize=(9, 3.2 * len(args.budgets)), squeeze=False)
    for ax, budget in zip(axes[:, 0], args.budgets, strict=True):
        for policy in args.policies:
            result, cache = stream_perplexity(
                model, ids, policy, budget, prefill=args.tokens - args.stream, progress=False
            )
            pos = kept_positions(cache)
            tenths = torch.bincount(pos * TENTHS // seen, minlength=TENTHS).float() / pos.numel() * 100
            print(f"{policy:<8} {budget:>6.0%} {result.ppl:>7.2f}  " + " ".join(f"{s:5.1f}" for s in tenths.tolist()))
            ax.hist(pos.numpy(), bins=40, range=(0, seen), histtype="step", density=True, label=policy, linewidth=1.5)
        ax.set_title(f"budget {budget:.0%} of {args.tokens} tokens: kept positions, all layers and KV heads")
        ax.set_xlabel("original position")
        ax.set_ylabel("density")
        ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
