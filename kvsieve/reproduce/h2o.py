"""H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
NeurIPS 2023, arXiv:2306.14048): its motivating analyses, ablations and evaluations on the default model."""

from __future__ import annotations

from kvsieve.reproduce.cells import Analysis, Needle, Rolling
from kvsieve.reproduce.claims import (
    ALMOST_ALL,
    MOST,
    Claim,
    accuracy_close,
    beats,
    layer_share,
    memory_flat,
    needle_at_least,
    pairs_beat,
    power_law,
    rolling_at_most,
)
from kvsieve.reproduce.experiments import Grid
from kvsieve.reproduce.runner import Plan

TITLE = "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs (Zhang et al., NeurIPS 2023)"
MC_TASKS = ("copa", "piqa")
"""Two of the H2O paper's Fig. 4 tasks in the offline pack: COPA and PIQA, those the default model is clearly above
chance on (its full cache, 5-shot, 100 documents each: COPA 0.61 and PIQA 0.63 against 0.5; OpenBookQA 0.17 against
0.25; RTE 0.56 against 0.5, within two standard errors; MathQA and Winogrande are not in the pack)."""
SPARSE = ("strided", "fixed")
ROLLING_TOKENS = 20_000
"""Tokens of each rolling stream: well past the model's 8,192 positions (the four runs, h2o and streaming_llm at 128
and 512 slots, take about 22 min single-threaded here)."""


def plan(quick: bool = False) -> Plan:
    tokens = 128 if quick else 1024
    budgets = (0.1, 0.2)
    sizes = (32,) if quick else (128, 512)
    rolling_tokens = 300 if quick else ROLLING_TOKENS
    limit = 1 if quick else 20
    needle_length = 256 if quick else 1024
    depths = (0.0, 1.0) if quick else (0.0, 0.25, 0.5, 0.75, 1.0)
    trials = 1 if quick else 3

    ppl = f"ppl of {tokens:,} tokens of Wikipedia, stream protocol"
    experiments = [
        Analysis("sparsity", "H2O Fig. 2a: attention sparsity", "sparsity", tokens),
        Analysis("powerlaw", "H2O Fig. 2b: accumulated attention vs rank", "powerlaw", tokens),
        Grid(
            "ppl_stream",
            "H2O Tables 2, 8, 9: heavy hitters with recent and sparse patterns (perplexity)",
            ["ppl"],
            ["full", "h2o", "h2o:recent=0", "local", *SPARSE, *(f"h2o+{p}" for p in SPARSE)],
            budgets,
            ppl_tokens=tokens,
        ),
        Rolling(
            "rolling",
            "H2O Fig. 5: long rolling streams, h2o vs StreamingLLM",
            ["h2o", "streaming_llm"],
            sizes,
            rolling_tokens,
            curve_every=100 if quick else 1000,
        ),
        Grid(
            "mc",
            "H2O Fig. 4: multiple-choice accuracy at 20% (COPA, PIQA)",
            MC_TASKS,
            ["full", "h2o", "local"],
            [0.2],
            limit=limit,
        ),
        Needle(
            "needle",
            "H2O App. C.4: key information at varying positions (passkey depth grid)",
            ["h2o", "local"],
            0.2,
            needle_length,
            depths,
            trials,
        ),
    ]
    mc = f"5-shot, {limit} doc(s) per task, stream protocol, budget 20% of each request"
    claims = [
        Claim(
            "H2O Fig. 2a",
            "attention is sparse: 95% or more of the attention scores are below 1% of their row's maximum in almost "
            "all layers",
            f"share of scores < 1% of the row max per layer (rows ≥ 20 keys), {tokens:,} tokens; 'almost all' = "
            f"≥ {ALMOST_ALL:.0%} of layers",
            layer_share("sparsity", lambda r: r["near_zero"], 0.95, ALMOST_ALL, "scores < 1% of max"),
        ),
        Claim(
            "H2O Fig. 2a",
            "attention is sparse: a small share of the keys holds almost all of a row's attention (here: ≥ 95% of "
            "the mass on the top 20% of keys) in most layers",
            f"mean over heads and rows ≥ 20 keys, {tokens:,} tokens; 'most' = more than {MOST:.0%} of layers",
            layer_share("sparsity", lambda r: r["top_mass"]["top 20%"], 0.95, MOST, "top-20% mass"),
        ),
        Claim(
            "H2O Fig. 2b",
            "the accumulated attention scores follow a power law over the tokens' ranks",
            f"layer-averaged accumulated attention of {tokens:,} tokens; log-log least squares, R² ≥ 0.8",
            power_law("powerlaw", 0.8),
        ),
        Claim(
            "H2O Table 9",
            "heavy hitters + recent window beat heavy hitters only and the recent window only",
            f"{ppl}; h2o vs h2o:recent=0 vs local at the same budget",
            beats("ppl_stream", "h2o", ["h2o:recent=0", "local"], budgets),
        ),
        Claim(
            "H2O Tables 2 / 8",
            "adding heavy hitters improves the sparse attention patterns strided and fixed",
            f"{ppl}; h2o+strided vs strided, h2o+fixed vs fixed at the same budget",
            pairs_beat("ppl_stream", [(f"h2o+{p}", p) for p in SPARSE], budgets),
        ),
        Claim(
            "H2O Fig. 5",
            "in long streams h2o's perplexity is at most StreamingLLM's at each cache size",
            f"{rolling_tokens:,} tokens of Wikipedia, position rolling, stream protocol, cache sizes "
            + ", ".join(map(str, sizes)),
            rolling_at_most("rolling", "h2o", "streaming_llm", sizes),
        ),
        Claim(
            "H2O Fig. 5",
            "memory stays flat over the stream",
            "KV bytes equal at every curve point, RSS at the end ≤ 1.10 × at the first point",
            memory_flat("rolling", ["h2o", "streaming_llm"], sizes, 0.10),
        ),
        Claim(
            "H2O Fig. 4",
            "at a 20% budget h2o's accuracy stays within a few points of the full cache's",
            f"acc, {mc}; within 5 points",
            accuracy_close("mc", "h2o", "full", 0.2, MC_TASKS, 0.05),
        ),
        Claim(
            "H2O Fig. 4",
            "at a 20% budget h2o is at least as accurate as the recent window alone",
            f"acc, {mc}",
            accuracy_close("mc", "h2o", "local", 0.2, MC_TASKS, 0.0),
        ),
        Claim(
            "H2O App. C.4",
            "h2o keeps key information wherever it lies in the context at least as well as the recent window",
            f"passkey exact match at {needle_length:,} tokens, depths {', '.join(f'{d:g}' for d in depths)}, "
            f"{trials} trial(s) each, budget 20%, prefill protocol",
            needle_at_least("needle", "h2o", ["local"]),
        ),
    ]
    notes = [
        "Perplexity: the first 1,024 tokens (quick: 128) of the built-in article, stream protocol (the H2O paper's): "
        "eviction from the first token, every later token one at a time; budgets are shares of the text.",
        "Multiple choice: COPA and PIQA from the offline pack (two of the figure's six; MathQA is not in it), "
        f"5-shot; {limit} document(s) per task, so differences of a few points are within noise.",
        "Rolling streams use position rolling (RoPE positions by rank in the cache), as StreamingLLM does.",
    ]
    return Plan("h2o", TITLE, experiments, claims, notes=notes)
