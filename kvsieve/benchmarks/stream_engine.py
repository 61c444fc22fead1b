"""The ``stream-engine`` preset (``kvsieve bench --preset stream-engine``): how much faster the whole-sequence engine
(``--engine whole``: the stream protocol inside a few long forward passes) streams a text than one forward pass per
token (``--engine decode``), for every registered policy, and that both give the same perplexity.

Setting: the first :data:`LENGTH` tokens of a built-in Wikipedia article, budget :data:`BUDGET`, the first
``BUDGET`` tokens prefilled, the rest streamed (:func:`~kvsieve.evaluation.perplexity.stream_perplexity`). Each
round runs every policy's whole stream and then :data:`DECODE_TOKENS` of its token-by-token stream (its rate is
flat: the cache is at the budget from the first streamed token) and then the same whole stream under ``full``
(nothing evicted: the rest of the text in one forward pass, the model's own speed over these tokens — the ceiling
of any engine that computes every token's logits), policies in turn, odd rounds in reverse order, so a slow spell of
the machine meets every policy; the figures are the medians over rounds of the per-round ratios of streamed tokens
per second. Before the rounds, ``full`` and every policy stream :data:`WARM_UP_TOKENS` past the budget with each
engine, untimed: first use (compiling kernels, on a fresh kernel cache) is not timed as streaming. The check: the
whole engine at least :data:`TARGET` × the token-by-token one for every policy.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from kvsieve.evaluation.perplexity import stream_perplexity
from kvsieve.policies import REGISTRY

LENGTH = 1000
BUDGET = 128
WARM_UP_TOKENS = 16
"""Tokens each policy streams past its budget, with each engine, before the measured rounds."""
DECODE_TOKENS = 96
"""Streamed tokens timed with one forward per token (the whole engine streams all ``LENGTH - BUDGET - 1``)."""
TARGET = 15.0


@dataclass
class EngineRow:
    policy: str
    whole_tok_s: float
    decode_tok_s: float
    speedup: float
    """Median over rounds of whole tok/s ÷ decode tok/s."""
    full_tok_s: float
    """``full``'s whole stream of the same tokens, timed next to the policy's (the ceiling)."""
    of_full: float
    """Median over rounds of whole tok/s ÷ full tok/s."""
    ppl_whole: float
    ppl_decode_prefix: float
    """The token-by-token engine's perplexity over the tokens it streamed (the prefill's predictions included)."""
    ppl_whole_prefix: float
    """The whole engine's perplexity over the same tokens (equal to the above up to float noise)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _streamed(model: PreTrainedModel, ids: torch.Tensor, policy: str, engine: str) -> tuple[float, float]:
    """Streamed tokens per second (the prefill excluded) and the perplexity of ``ids`` under ``policy`` with
    ``engine``."""
    result, _ = stream_perplexity(model, ids, policy, BUDGET, prefill=BUDGET, engine=engine, progress=False)
    return result.stream_tok_s, result.ppl


def stream_engine(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    policies: Sequence[str] | None = None,
    repeats: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the preset on the first :data:`LENGTH` of ``tokens`` (see the module docstring)."""
    if tokens.shape[-1] < LENGTH:
        raise ValueError(f"the stream-engine preset needs {LENGTH} tokens of text, got {tokens.shape[-1]}")
    names = list(policies) if policies else [name for name, cls in REGISTRY.items() if cls.bounded]
    ids = tokens[:LENGTH]
    prefix = ids[: BUDGET + 1 + DECODE_TOKENS]
    rates: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    ppl: dict[str, tuple[float, float, float]] = {}
    warm = ids[: BUDGET + 1 + WARM_UP_TOKENS]
    for name in ["full", *names]:  # (first use, compiling kernels included, is not timed)
        for engine in ("whole", "decode"):
            _streamed(model, warm, name, engine)
    with tqdm(total=repeats * len(names), desc="stream engines", disable=not progress) as bar:
        for r in range(repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                whole, ppl_whole = _streamed(model, ids, name, "whole")
                decode, ppl_decode = _streamed(model, prefix, name, "decode")
                _, ppl_prefix = _streamed(model, prefix, name, "whole")
                full, _ = _streamed(model, ids, "full", "whole")
                rates[name].append((whole, decode, full))
                ppl[name] = (ppl_whole, ppl_decode, ppl_prefix)
                bar.update()
    rows = [
        EngineRow(
            policy=name,
            whole_tok_s=statistics.median(w for w, _, _ in rates[name]),
            decode_tok_s=statistics.median(d for _, d, _ in rates[name]),
            speedup=statistics.median(w / d for w, d, _ in rates[name]),
            full_tok_s=statistics.median(f for _, _, f in rates[name]),
            of_full=statistics.median(w / f for w, _, f in rates[name]),
            ppl_whole=ppl[name][0],
            ppl_decode_prefix=ppl[name][1],
            ppl_whole_prefix=ppl[name][2],
        )
        for name in names
    ]
    measured = "; ".join(f"{row.policy} {row.speedup:.1f}x" for row in rows)
    return {
        "preset": "stream-engine",
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "length": LENGTH,
        "budget": BUDGET,
        "repeats": repeats,
        "stream_engine": [row.to_dict() for row in rows],
        "checks": [
            {
                "check": f"whole-sequence stream vs token by token, {LENGTH} tokens, budget {BUDGET}: >= {TARGET:g}x",
                "measured": measured,
                "passed": all(row.speedup >= TARGET for row in rows),
            }
        ],
    }
