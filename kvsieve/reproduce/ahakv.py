"""AhaKV (Gu et al., "AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient Inference of Large
Language Models", 2025, arXiv:2506.03762): where the kept tokens lie, the attention entropy, the RA/SGS/VPE ablation
in both protocols, needle retrieval and accuracy, on the default model."""

from __future__ import annotations

import itertools

from kvsieve.reproduce.cells import Analysis, Needle, PrefillPositions
from kvsieve.reproduce.claims import (
    Claim,
    accuracy_close,
    beats,
    entropy_grows,
    less_at_start,
    main_effect,
    needle_at_least,
)
from kvsieve.reproduce.experiments import Grid
from kvsieve.reproduce.h2o import MC_TASKS
from kvsieve.reproduce.runner import Plan, View, side_by_side

TITLE = "AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient Inference of LLMs (Gu et al., 2025)"
COMPONENTS = ("RA", "SGS", "VPE")


def ablation_specs() -> dict[tuple[bool, bool, bool], str]:
    """(RA, SGS, VPE) on/off → the policy spec; all on is plain ``ahakv``."""
    specs = {}
    for combo in itertools.product((True, False), repeat=3):
        ra, sgs, vpe = (str(v).lower() for v in combo)
        specs[combo] = "ahakv" if all(combo) else f"ahakv:ra={ra},sgs={sgs},vpe={vpe}"
    return specs


READINGS = ("ahakv:sgs_tokens=kept", "ahakv:sgs_decode=false")
"""kvsieve's reading variants: SGS's ``i`` = the tokens kept in the softmax; SGS on the prompt only."""


def plan(quick: bool = False) -> Plan:
    tokens = 128 if quick else 1024
    budgets = (0.2,) if quick else (0.1, 0.2)
    limit = 1 if quick else 20
    needle_length = 256 if quick else 1024
    depths = (0.0, 1.0) if quick else (0.0, 0.25, 0.5, 0.75, 1.0)
    trials = 1 if quick else 3
    specs = ablation_specs()
    table2 = [*specs.values(), "h2o", "full", *READINGS]
    protocols = {"stream": "table2_stream", "prefill": "table2_prefill"}
    experiments = [
        Analysis(
            "positions",
            "AhaKV Fig. 2: the positions each policy keeps (stream protocol)",
            "positions",
            tokens,
            analysis_policies=("h2o", "ahakv"),
            budget=0.2,
        ),
        PrefillPositions(
            "positions_prefill",
            "AhaKV Fig. 2: the positions each policy keeps after one compression (prefill protocol)",
            ("h2o", "ahakv"),
            0.2,
            tokens,
        ),
        Analysis("entropy", "AhaKV §3.1, Eq. 8: attention entropy vs sequence length", "entropy", tokens),
        *(
            Grid(
                name,
                f"AhaKV Table 2: the RA/SGS/VPE ablation, {protocol} protocol (perplexity)",
                ["ppl"],
                table2,
                budgets,
                protocol=protocol,
                ppl_tokens=tokens,
            )
            for protocol, name in protocols.items()
        ),
        Needle(
            "needle",
            "AhaKV: passkey retrieval over needle depths",
            ["h2o", "ahakv", "snapkv"],
            0.2,
            needle_length,
            depths,
            trials,
        ),
        Grid(
            "mc",
            "AhaKV accuracy analogue: multiple-choice accuracy at 20%, prefill protocol",
            MC_TASKS,
            ["full", "h2o", "ahakv", "snapkv"],
            [0.2],
            protocol="prefill",
            limit=limit,
        ),
    ]
    ppl = {
        "stream": f"ppl of {tokens:,} tokens of Wikipedia, stream protocol",
        "prefill": f"ppl of the last third of {tokens:,} tokens after the first two thirds were compressed once "
        "(prefill protocol)",
    }
    claims = [
        *(
            Claim(
                "AhaKV Fig. 2 / Fig. 5",
                "AhaKV's kept tokens are less concentrated at the start of the text than H2O's (accumulated attention "
                "is biased towards early tokens)",
                f"{protocol} protocol, budget 20% of {tokens:,} tokens, all layers and KV heads pooled",
                less_at_start(part, "ahakv", "h2o"),
            )
            for protocol, part in (("stream", "positions"), ("prefill", "positions_prefill"))
        ),
        Claim(
            "AhaKV §3.1, Eq. 8",
            "the attention entropy grows with the sequence length (like ln i)",
            f"mean attention-row entropy over heads and layers at each query position, {tokens:,} tokens; "
            "correlation with ln i ≥ 0.9",
            entropy_grows("entropy", 0.9),
        ),
        *(
            Claim(
                "AhaKV Table 2",
                f"{component} helps ({protocol} protocol)",
                f"{ppl[protocol]}; main effect over the 8 on/off combinations of RA, SGS, VPE",
                main_effect(part, component, specs, i, budgets),
            )
            for protocol, part in protocols.items()
            for i, component in enumerate(COMPONENTS)
        ),
        *(
            Claim(
                "AhaKV Table 2",
                f"ahakv's perplexity is at most h2o's ({protocol} protocol)",
                ppl[protocol],
                beats(part, "ahakv", ["h2o"], budgets, strict=False),
            )
            for protocol, part in protocols.items()
        ),
        Claim(
            "AhaKV (needle)",
            "ahakv retrieves the passkey at least as often as h2o",
            f"exact match at {needle_length:,} tokens, depths {', '.join(f'{d:g}' for d in depths)}, {trials} "
            "trial(s) each, budget 20%, prefill protocol",
            needle_at_least("needle", "ahakv", ["h2o"]),
        ),
        Claim(
            "AhaKV (accuracy)",
            "at a 20% budget ahakv is at least as accurate as h2o",
            f"acc, 5-shot, {limit} doc(s) per task, prefill protocol",
            accuracy_close("mc", "ahakv", "h2o", 0.2, MC_TASKS, 0.0),
        ),
    ]
    flags = {spec: combo for combo, spec in specs.items()}

    def columns(policy: str) -> list[str]:
        combo = flags.get(policy)
        return ["✓" if on else "–" for on in combo] if combo else ["", "", ""]

    views = [
        View(
            "AhaKV Table 2: both protocols side by side (perplexity)",
            side_by_side(
                [("stream", protocols["stream"]), ("prefill", protocols["prefill"])],
                table2,
                budgets,
                columns=columns,
                column_names=COMPONENTS,
            ),
        )
    ]
    notes = [
        "Perplexity, stream protocol: the first 1,024 tokens (quick: 128) of the built-in article with eviction "
        "from the first token; prefill protocol: the first two thirds compressed once to the budget (a share of "
        "the context), the last third scored under that cache (AhaKV's, SnapKV's).",
        "Reading variants (no claim): `ahakv:sgs_tokens=kept` (SGS's i = tokens kept in the softmax) and "
        "`ahakv:sgs_decode=false` (SGS on the prompt only).",
        "LongBench is not available offline: accuracy uses COPA and PIQA from the offline pack, 5-shot, "
        f"{limit} document(s) per task.",
    ]
    return Plan("ahakv", TITLE, experiments, claims, views=views, notes=notes)
