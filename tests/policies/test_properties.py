"""Property-based test (hypothesis) over tiny random models: any policy × budget × parameters × batch and padding ×
prompt and decode lengths × dtype × protocol (stream or not) either is refused by ``make_cache`` with a
``ValueError`` or runs with every invariant holding:

- every layer holds at most its budget between steps (sliding layers their window − 1), unbounded ones grow;
- no NaN or inf in the logits of real tokens;
- each row of a left-padded batch gives the logits it gives alone (float64, where round-off cannot decide ties);
- ``full`` equals a ``DynamicCache``.

Seeded and derandomized (the same examples every run), no example database, a bounded number of examples.
"""

from __future__ import annotations

import typing
from typing import Any

import torch
from conftest import ASKING, decode_positions, is_probed
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, PreTrainedModel

import kvsieve
from kvsieve.policies import REGISTRY

VOCAB = 128
EXAMPLES = 1500


def _value(kind: Any) -> st.SearchStrategy[Any]:
    """Values for a parameter annotated ``kind``: valid ones and, often, out-of-range ones."""
    args = typing.get_args(kind)
    if type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return st.none() | _value(inner)
    if typing.get_origin(kind) is typing.Literal:
        return st.sampled_from(args)
    if kind is bool:
        return st.booleans()
    if kind is int:
        return st.integers(-2, 24)
    return st.floats(-0.5, 1.5) | st.sampled_from([float("nan"), float("inf")])


@st.composite
def runs(draw: st.DrawFn) -> dict[str, Any]:
    policy = draw(st.sampled_from(sorted(REGISTRY)))
    hints = typing.get_type_hints(REGISTRY[policy].Params)
    names = draw(st.lists(st.sampled_from(sorted(hints)), unique=True)) if hints else []
    batch = draw(st.integers(1, 3))
    return {
        "model": draw(st.sampled_from(["llama_mha", "llama_gqa", "gemma3"])),
        "dtype": draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16])),
        "policy": policy,
        "budget": draw(st.integers(1, 20) | st.floats(0.05, 1.0)),
        "params": {name: draw(_value(hints[name])) for name in names},
        "lengths": draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch)),
        "steps": draw(st.integers(0, 24)),
        "stream": draw(st.sampled_from([False, False, True])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _feed(model: PreTrainedModel, cache: Any, ids: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor, check):
    """Prefill ``ids`` then feed ``steps`` ``[B, n]`` one at a time; the logits ``[B, L + n, V]``."""
    logits = []
    with torch.inference_mode():
        for t in range(steps.shape[1] + 1):
            step = ids if t == 0 else steps[:, t - 1 : t]
            if t:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            if t == 0 and is_probed(cache):  # (a policy scored by probes fills its cache through them)
                out = kvsieve.compress_context(model, cache, step, ASKING, mask, logits_to_keep=0)
            else:
                out = model(step, attention_mask=mask, position_ids=decode_positions(cache, mask), cache=cache).logits
            logits.append(out.double())
            check(cache)
    return torch.cat(logits, dim=1)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(run=runs())
def test_invariants_hold_for_any_run(tiny_models, run) -> None:
    model = tiny_models(run["model"], run["dtype"])
    try:
        cache = kvsieve.make_cache(model, run["policy"], run["budget"], stream=run["stream"], **run["params"])
    except ValueError:
        event("refused by make_cache")
        return  # refused up front with one clear error: fine (bad parameters for this budget)
    lengths = run["lengths"]
    batch, width = len(lengths), max(lengths)
    gen = torch.Generator().manual_seed(run["seed"])
    # Distinct tokens in every row (no repeated token), so that every kept set shows in the logits.
    tokens = torch.stack([3 + torch.randperm(VOCAB - 3, generator=gen)[: width + run["steps"]] for _ in lengths])
    ids, steps = tokens[:, :width].clone(), tokens[:, width:]
    mask = torch.ones(batch, width, dtype=torch.long)
    for row, length in enumerate(lengths):  # left padding
        ids[row, : width - length] = model.config.pad_token_id or 0
        mask[row, : width - length] = 0
    window = getattr(model.config.get_text_config(), "sliding_window", None)

    def check(cache: kvsieve.SieveCache) -> None:
        for layer, held in zip(cache.layers, cache.slot_counts(), strict=True):
            bound = window - 1 if layer.is_sliding else layer.policy.budget if layer.policy.bounded else None
            assert bound is None or held <= bound, f"layer {layer.layer_idx} holds {held} > {bound}"

    try:
        logits = _feed(model, cache, ids, mask, steps, check)
    except ValueError as err:  # a ratio budget is resolved (and may be refused) at the first forward pass
        assert cache.get_seq_length() == 0, f"refused after caching something: {err}"
        event("refused at the first forward pass")
        return
    event(f"ran: {run['dtype']}, batch {len(lengths)}")
    real = torch.cat([mask, torch.ones(batch, run["steps"], dtype=torch.long)], dim=1).bool()
    assert torch.isfinite(logits[real]).all()
    if run["dtype"] == torch.bfloat16:
        return
    if run["policy"] == "full":
        reference = _feed(model, DynamicCache(config=model.config), ids, mask, steps, lambda cache: None)
        torch.testing.assert_close(logits[real], reference[real], atol=1e-4, rtol=0)
    # (a budget shared by the layers is shared over the rows of a batch together: its rows are not as alone)
    if run["dtype"] == torch.float64 and batch > 1 and not cache.plan.policies[-1].shares_budget():
        budget = cache.budget_tokens if isinstance(run["budget"], float) else run["budget"]
        for row in range(batch):
            alone = kvsieve.make_cache(model, run["policy"], budget, stream=run["stream"], **run["params"])
            row_ids = ids[row : row + 1, mask[row].bool()]
            got = _feed(model, alone, row_ids, torch.ones_like(row_ids), steps[row : row + 1], lambda cache: None)
            torch.testing.assert_close(logits[row, real[row]], got[0], atol=1e-4, rtol=1e-4)  # (RoPE in fp32)
