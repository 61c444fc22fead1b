"""``kvsieve compare``: every policy at one budget on one real text, side by side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine.budget import Budget
from kvsieve.engine.cache import SieveCache
from kvsieve.evaluation.perplexity import PerplexityResult, stream_perplexity

DEFAULT_POLICIES = ("full", "local", "streaming_llm", "h2o")
MIB = 1 << 20


@dataclass
class CompareRow:
    policy: str
    budget_tokens: int | None
    tokens_scored: int
    ppl: float
    ppl_vs_full: float | None
    kv_mib: float
    state_mib: float
    kv_slots_max: int
    decode_tok_s: float
    sample: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.inference_mode()
def greedy_continue(model: PreTrainedModel, cache: SieveCache, last_token: torch.Tensor, n: int) -> list[int]:
    """Feed ``last_token`` (``[1, 1]``) and ``n - 1`` greedy tokens through ``cache``; return the ``n`` tokens."""
    out: list[int] = []
    token = last_token
    for _ in range(n):
        logits = model(token, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        out.append(int(token))
    return out


def compare(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    policies: Sequence[str] = DEFAULT_POLICIES,
    budget: Budget = 0.2,
    max_tokens: int = 1024,
    sample_tokens: int = 24,
    progress: bool = True,
) -> list[CompareRow]:
    """Stream the first ``max_tokens`` tokens of ``text`` through each policy at ``budget``.

    Every policy gets the same prefill (the budget) and the same tokens; ``ppl_vs_full`` is relative to ``full``
    when it is in ``policies``. The sample is a greedy continuation of the text from each policy's cache.
    """
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    if ids.shape[1] < 16:
        raise ValueError(f"the text has {ids.shape[1]} tokens; compare needs at least 16")
    results: list[tuple[PerplexityResult, list[int]]] = []
    for name in policies:
        result, cache = stream_perplexity(model, ids, name, budget, progress=progress)
        sample = greedy_continue(model, cache, ids[:, -1:].to(model.device), sample_tokens)
        results.append((result, sample))
    full_ppl = next((r.ppl for r, _ in results if r.policy == "full"), None)
    return [
        CompareRow(
            policy=r.policy,
            budget_tokens=r.budget_tokens,
            tokens_scored=r.tokens_scored,
            ppl=r.ppl,
            ppl_vs_full=None if full_ppl is None else r.ppl / full_ppl,
            kv_mib=r.kv_bytes / MIB,
            state_mib=r.state_bytes / MIB,
            kv_slots_max=r.kv_slots_max,
            decode_tok_s=r.decode_tok_s,
            sample=tokenizer.decode(sample, skip_special_tokens=True),
        )
        for r, sample in results
    ]


def format_table(rows: Sequence[CompareRow]) -> str:
    """A plain-text table of the rows, then each policy's sample continuation."""
    header = ["policy", "budget", "tokens", "ppl", "vs full", "KV MiB", "state MiB", "slots", "decode tok/s"]
    body = [
        [
            r.policy,
            "all" if r.budget_tokens is None else str(r.budget_tokens),
            str(r.tokens_scored),
            f"{r.ppl:.3f}",
            "" if r.ppl_vs_full is None else f"{r.ppl_vs_full:.3f}x",
            f"{r.kv_mib:.2f}",
            f"{r.state_mib:.2f}",
            str(r.kv_slots_max),
            f"{r.decode_tok_s:.1f}",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    samples = [f"{r.policy:>14}: {' '.join(r.sample.split())!r}" for r in rows]
    return "\n".join([*lines, "", "greedy continuation of the text from each cache:", *samples])
