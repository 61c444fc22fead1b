"""What a policy keeps while a text streams through its cache (one token at a time, the H2O paper's protocol):
the original positions it holds at the end (AhaKV Fig. 2), and the share of the full cache's attention that falls
on what it holds at each decode step — the attention recall; Cold Compress's attention loss is 1 − recall."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from kvsieve.analysis.attention import Result, accumulated, layer_progress, map_layers, require_tokens
from kvsieve.api import make_cache
from kvsieve.engine.budget import Budget, resolve_budget
from kvsieve.engine.cache import SieveCache
from kvsieve.policies import get_policy, resolve_spec

BINS = 20
"""Position bins of the kept-positions histogram (fewer for a text of fewer tokens)."""


def policy_names(policies: Sequence[str]) -> list[str]:
    """``policies`` (names or specs, see :mod:`kvsieve.policies`) checked: a ``ValueError`` for an unknown one, a bad
    parameter, or none."""
    if not policies:
        raise ValueError("give at least one policy")
    for policy in policies:
        resolve_spec(policy)
    return list(policies)


def budget_tokens(budget: Budget, n: int) -> int:
    """``budget`` (tokens or a ratio) in tokens for a text of ``n`` tokens; a ``ValueError`` if nothing would be
    evicted."""
    tokens = resolve_budget(budget, n)
    if tokens >= n:
        raise ValueError(f"the text has {n} tokens and the budget is {tokens}: nothing would be evicted")
    return tokens


@torch.inference_mode()
def stream(
    model: PreTrainedModel,
    cache: SieveCache,
    ids: torch.Tensor,
    per_token_from: int,
    after_step: Callable[[int], None] | None = None,
    progress: bool = False,
) -> None:
    """Feed ``ids`` (``[1, n]``) through ``cache`` exactly as one token at a time: the first ``per_token_from``
    tokens in one forward pass under the stream protocol (``cache.streaming()``: the result of feeding them token by
    token), then one forward pass per token. ``after_step(i)`` runs once the cache has seen tokens ``0 … i``: after
    the first pass, then after each token."""
    ids = ids.to(model.device)
    with cache.streaming(), layer_progress(model, cache.policy_name, progress):
        model(ids[:, :per_token_from], cache=cache, use_cache=True, logits_to_keep=1)
    steps = range(per_token_from - 1, ids.shape[1])
    for i in tqdm(steps, desc=f"{cache.policy_name} decode", unit="tok", disable=not progress, leave=False):
        if i >= per_token_from:
            model(ids[:, i : i + 1], cache=cache, use_cache=True, logits_to_keep=1)
        if after_step is not None:
            after_step(i)


@dataclass
class KeptPositions(Result):
    policy: str
    counts: list[int]
    """Kept tokens per position bin, all layers and KV heads pooled."""
    kept: int
    mean_position: float
    """The kept tokens' mean position over the text's last position (0 = first token, 1 = last)."""


@dataclass
class PositionsResult(Result):
    """AhaKV Fig. 2: where the kept tokens lie once the whole text has streamed through each policy's cache."""

    tokens: int
    budget_tokens: int
    layers: int
    kv_heads: int
    bin_edges: list[int]
    """Bin ``b`` holds the positions ``bin_edges[b] … bin_edges[b + 1] - 1``."""
    policies: list[KeptPositions]
    accumulated: list[float] | None
    """Per position: H2O's accumulated attention (column sums of the full eager attention, averaged over heads and
    layers); only when a policy accumulates attention scores, else None."""
    accumulated_binned: list[float] | None
    """Its mean per bin."""


def positions(
    model: PreTrainedModel,
    ids: torch.Tensor,
    policies: Sequence[str],
    budget: Budget = 0.2,
    progress: bool = False,
) -> PositionsResult:
    """:class:`PositionsResult` of ``ids`` (``[1, n]``) for each policy at ``budget`` (a ratio is of ``n``)."""
    n = require_tokens(ids, 2, "positions")
    names = policy_names(policies)
    tokens = budget_tokens(budget, n)
    bins = min(BINS, n)
    edges = [-(-b * n // bins) for b in range(bins + 1)]  # ceil(b·n / bins): the first position p·bins // n = b
    rows = []
    for policy in names:
        cache = make_cache(model, policy, tokens)
        stream(model, cache, ids, n, progress=progress)
        held = [cache.positions(layer)[0] for layer in range(len(cache.layers))]  # [kv_heads, slots] each
        pooled = torch.cat([pos.flatten() for pos in held]).cpu()
        counts = torch.bincount(pooled * bins // n, minlength=bins).tolist()
        mean = pooled.double().mean().item() / (n - 1)
        rows.append(KeptPositions(policy=policy, counts=counts, kept=pooled.numel(), mean_position=mean))
    scores = binned = None
    if any(get_policy(p).needs_attention for p in policies):
        per_position = torch.stack(map_layers(model, ids, lambda _, w: accumulated(w), progress)).mean(0).cpu()
        scores = per_position.tolist()
        index = torch.arange(n) * bins // n
        binned = (torch.zeros(bins).index_add_(0, index, per_position) / torch.bincount(index, minlength=bins)).tolist()
    return PositionsResult(
        tokens=n,
        budget_tokens=tokens,
        layers=len(held),
        kv_heads=held[0].shape[0],
        bin_edges=edges,
        policies=rows,
        accumulated=scores,
        accumulated_binned=binned,
    )


def recall_rows(weights: torch.Tensor, last_held: torch.Tensor) -> torch.Tensor:
    """``[heads, n, n]`` full causal attention and ``[kv_heads, n]`` the last step after which each token was held
    (-1: never) → ``[heads, n]``: each query row's attention mass on the tokens the policy let it see.

    Query ``i`` sees the tokens held after step ``i - 1`` (an evicted token never comes back: ``last_held[j] >=
    i - 1``) and its own. Computed as 1 − the mass on the others, so that a policy that evicts nothing gets exactly 1.
    """
    heads, n, _ = weights.shape
    kv_heads = last_held.shape[0]
    query = torch.arange(n, device=weights.device)[:, None]
    key = torch.arange(n, device=weights.device)[None, :]
    hidden = (key < query) & (last_held[:, None, :] < query - 1)  # [kv_heads, n, n]
    lost = (weights.view(kv_heads, heads // kv_heads, n, n) * hidden[:, None]).sum(-1)
    return 1 - lost.reshape(heads, n)


def held_steps(
    model: PreTrainedModel, cache: SieveCache, ids: torch.Tensor, prefill: int, progress: bool = False
) -> list[torch.Tensor]:
    """Stream ``ids`` (``[1, n]``) through ``cache`` (:func:`stream`, per token after ``prefill``); per layer, the
    last step after which each token was held, ``[kv_heads, n]`` (-1: never held after a step)."""
    n = ids.shape[1]
    last: list[torch.Tensor] = []

    def record(step: int) -> None:
        for layer in range(len(cache.layers)):
            held = cache.positions(layer)[0]
            if len(last) == layer:
                last.append(torch.full((held.shape[0], n), -1, dtype=torch.long, device=held.device))
            last[layer].scatter_(1, held, step)

    stream(model, cache, ids, prefill, record, progress)
    return last


@dataclass
class PolicyRecall(Result):
    policy: str
    mean: float
    """Over layers, heads and decode steps."""
    loss: float
    """``1 - mean``: the attention loss."""
    per_layer: list[float]
    curve: list[float]
    """Per decode step (query positions ``first_step … n - 1``), averaged over layers and heads."""


@dataclass
class RecallResult(Result):
    """The attention recall: at each decode step and layer, the share of the full cache's attention (the eager
    attention of the full model's query over every previous token, averaged over heads) on the tokens a policy's
    cache holds at that step. The first ``budget_tokens`` tokens are the prefill (nothing is evicted before the
    cache is full); every later token is a decode step."""

    tokens: int
    budget_tokens: int
    first_step: int
    policies: list[PolicyRecall]


def recall(
    model: PreTrainedModel,
    ids: torch.Tensor,
    policies: Sequence[str],
    budget: Budget = 0.2,
    progress: bool = False,
) -> RecallResult:
    """:class:`RecallResult` of ``ids`` (``[1, n]``) for each policy at ``budget`` (a ratio is of ``n``)."""
    n = require_tokens(ids, 2, "recall")
    names = policy_names(policies)
    tokens = budget_tokens(budget, n)
    held = [held_steps(model, make_cache(model, p, tokens), ids, tokens, progress) for p in names]
    per_layer = map_layers(
        model,
        ids,
        lambda layer, w: torch.stack([recall_rows(w, h[layer])[:, tokens:].mean(0) for h in held]).cpu(),
        progress,
    )
    steps = torch.stack(per_layer).double()  # [layers, policies, decode steps]
    rows = [_policy_recall(policy, steps[:, p]) for p, policy in enumerate(names)]
    return RecallResult(tokens=n, budget_tokens=tokens, first_step=tokens, policies=rows)


def _policy_recall(policy: str, steps: torch.Tensor) -> PolicyRecall:
    """``steps``: ``[layers, decode steps]`` recall of ``policy``."""
    mean = steps.mean().item()
    return PolicyRecall(
        policy=policy, mean=mean, loss=1 - mean, per_layer=steps.mean(-1).tolist(), curve=steps.mean(0).tolist()
    )
