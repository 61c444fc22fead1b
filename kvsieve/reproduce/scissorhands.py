"""Scissorhands (Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023, arXiv:2305.17118): the persistence of importance, quality at a 20% budget
and the layer-wise budget, on the default model."""

from __future__ import annotations

from kvsieve.reproduce.cells import Analysis
from kvsieve.reproduce.claims import MOST, Claim, accuracy_close, beats, layer_share, ppl_within
from kvsieve.reproduce.experiments import Grid
from kvsieve.reproduce.h2o import MC_TASKS
from kvsieve.reproduce.runner import Plan

TITLE = (
    "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache Compression at Test Time "
    "(Liu et al., NeurIPS 2023)"
)
INCREASING = "scissorhands:schedule=increasing"


def plan(quick: bool = False) -> Plan:
    tokens = 128 if quick else 1024
    budgets = (0.1, 0.2)
    limit = 1 if quick else 20
    experiments = [
        Analysis("persistence", "Scissorhands Fig. 2 and §3.1: the persistence of importance", "persistence", tokens),
        Grid(
            "ppl_stream",
            "Scissorhands §5 and §4.1: perplexity at 10% and 20%, the threshold readings and the layer-wise budget",
            ["ppl"],
            ["full", "scissorhands", "scissorhands:threshold=paper", INCREASING, "h2o", "local"],
            budgets,
            ppl_tokens=tokens,
        ),
        Grid(
            "mc",
            "Scissorhands §5: multiple-choice accuracy at 20% (COPA, PIQA)",
            MC_TASKS,
            ["full", "scissorhands", "h2o"],
            [0.2],
            limit=limit,
        ),
    ]
    ppl = f"ppl of {tokens:,} tokens of Wikipedia, stream protocol"
    claims = [
        Claim(
            "Scissorhands Fig. 2",
            "persistence of importance: the tokens important to later queries were already important to earlier "
            "ones (persistence ratio > 0.9 in most layers)",
            f"{tokens:,} tokens, t = {tokens // 2}, α = 1/t; ratio over the tokens before t (those that could be "
            f"important to the first half); 'most' = more than {MOST:.0%} of layers",
            layer_share("persistence", lambda r: r["early_ratio"], 0.9, MOST, "persistence ratio"),
        ),
        Claim(
            "Scissorhands §5 (language modelling)",
            "at a 20% budget (5× compression) scissorhands keeps the full cache's perplexity",
            f"{ppl}; within 5% of full",
            ppl_within("ppl_stream", "scissorhands", "full", [0.2], 1.05),
        ),
        Claim(
            "Scissorhands §5 (downstream tasks)",
            "at a 20% budget scissorhands keeps the full cache's accuracy",
            f"acc, 5-shot, {limit} doc(s) per task, stream protocol; within 5 points",
            accuracy_close("mc", "scissorhands", "full", 0.2, MC_TASKS, 0.05),
        ),
        Claim(
            "Scissorhands §4.1",
            "a budget increasing with depth (same total) is at least as good as a uniform one",
            f"{ppl}; {INCREASING} vs scissorhands",
            beats("ppl_stream", INCREASING, ["scissorhands"], budgets, strict=False),
        ),
    ]
    notes = [
        "Perplexity: the first 1,024 tokens (quick: 128) of the built-in article, stream protocol: eviction from "
        "the first token, every later token one at a time; budgets are shares of the text.",
        "scissorhands' `threshold`: `attended` (kvsieve's default reading) and `paper` are both in the grid; the "
        "claims use the default.",
        "Multiple choice: COPA and PIQA from the offline pack (MathQA is not in it), 5-shot; "
        f"{limit} document(s) per task, so differences of a few points are within noise.",
    ]
    return Plan("scissorhands", TITLE, experiments, claims, notes=notes)
