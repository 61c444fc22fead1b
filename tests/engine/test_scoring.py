"""The stream protocol: one forward over a sequence gives the logits of feeding its tokens one at a time."""

from __future__ import annotations

import math

import pytest
import torch

import kvsieve
from kvsieve.engine import layer as layer_module
from kvsieve.engine.scan import scan
from kvsieve.engine.stream import plan_chunks
from kvsieve.evaluation.perplexity import context_perplexity, stream_logits, stream_perplexity
from kvsieve.policies import REGISTRY
from kvsieve.policies.base import SinkWindow


def _both_engines(model, ids: torch.Tensor, policy: str, budget: int, prefill: int) -> tuple[torch.Tensor, ...]:
    """Logits of ids[prefill:] after a prefill, token by token and whole-sequence, plus the kept positions."""
    out = []
    for engine in ("decode", "whole"):
        cache = kvsieve.make_cache(model, policy, budget)
        with torch.no_grad():
            model(ids[:, :prefill], cache=cache)
            logits = torch.cat([chunk for _, chunk in stream_logits(model, cache, ids[:, prefill:], engine)], dim=1)
        out.append((logits, [cache.positions(i).sort(-1).values for i in range(len(cache.layers))]))
    (decode, kept_decode), (whole, kept_whole) = out
    return decode, whole, kept_decode, kept_whole


FED = sorted(name for name, cls in REGISTRY.items() if not cls.probed)
"""The policies a forward pass fills (``kvzip`` is filled by its probes: refused here, tested on its own)."""


@pytest.mark.parametrize("policy", FED)
def test_whole_sequence_equals_token_by_token_on_a_tiny_model(policy, llama_gqa, make_ids):
    ids = make_ids(2, 48)
    decode, whole, kept_decode, kept_whole = _both_engines(llama_gqa, ids, policy, budget=12, prefill=10)
    torch.testing.assert_close(whole, decode, atol=1e-4, rtol=1e-4)
    for a, b in zip(kept_decode, kept_whole, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", FED)
def test_stream_from_an_empty_cache_equals_token_by_token(policy, llama_gqa, make_ids, monkeypatch):
    """The stream protocol from the first token (as lm-eval runs it): position-only policies in closed form (one
    chunk), row-additive policies and policies that never observe attention with the tokens before the
    first eviction as one chunk, the tokens after it (all tokens, for the others) as one scanned run; a policy that
    narrows attention (each token a step of its own) one token at a time."""
    ids = make_ids(2, 40)
    with torch.no_grad():
        cache = kvsieve.make_cache(llama_gqa, policy, 16)
        decode = torch.cat([llama_gqa(ids[:, i : i + 1], cache=cache).logits for i in range(40)], dim=1)
        kept = [cache.positions(i).sort(-1).values for i in range(len(cache.layers))]
        steps = []
        monkeypatch.setattr(layer_module, "run_step", _counting(layer_module.run_step, steps))
        monkeypatch.setattr(layer_module, "scan", _counting(layer_module.scan, steps, scanned=True))
        cache = kvsieve.make_cache(llama_gqa, policy, 16, stream=True)
        whole = llama_gqa(ids, cache=cache).logits
    torch.testing.assert_close(whole, decode, atol=1e-4, rtol=1e-4)
    for a, b in zip(kept, [cache.positions(i).sort(-1).values for i in range(len(cache.layers))], strict=True):
        assert torch.equal(a, b)
    cls = REGISTRY[policy]
    chunked = cls.row_additive or not cls.needs_attention
    closed_form = isinstance(cache.layers[0].policy, SinkWindow)
    after = [1] * 24 if cls.needs_queries else [-24]  # (a policy that reads queries is stepped, never scanned)
    per_layer = (
        [1] * 40 if cls.narrows else [40] if not cls.bounded or closed_form else [16, *after] if chunked else [-40]
    )
    assert steps == per_layer * len(cache.layers)


PADDED_POLICIES = sorted(set(FED) - {"topk_oracle"})
"""``topk_oracle`` picks each query's top keys by logits: the batched and single-row products differ in the last
bits, enough to swap near-equal keys (it is never scanned: it narrows each query's keys)."""


@pytest.mark.parametrize("policy", PADDED_POLICIES)
def test_stream_of_a_padded_batch_equals_token_by_token(policy, llama_gqa, make_ids, monkeypatch):
    """A left-padded batch (a row with 7 padding tokens first; 150 tokens, budget 16: several closed-form chunks or
    scanned runs of at most 64 tokens), then a right-padded continuation (a row with its last 9 of 40 tokens
    padding), as lm-eval feeds them: the logits of the real tokens and the kept positions are those of feeding each
    token alone. Runs holding padding are scanned unless the policy's target is each row's own count."""
    ids = make_ids(2, 190)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[1, -9:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = kvsieve.make_cache(llama_gqa, policy, 16)
        decode = torch.cat(
            [
                llama_gqa(
                    ids[:, i : i + 1],
                    attention_mask=mask[:, : i + 1],
                    position_ids=positions[:, i : i + 1],
                    cache=cache,
                ).logits
                for i in range(190)
            ],
            dim=1,
        )
        kept = [cache.positions(i).sort(-1).values for i in range(len(cache.layers))]
        cache = kvsieve.make_cache(llama_gqa, policy, 16, stream=True)
        whole, scanned = [], []
        for span in (slice(0, 150), slice(150, 190)):
            scanned.append([])
            monkeypatch.setattr(layer_module, "scan", _counting(scan, scanned[-1], scanned=True))
            kwargs = {"attention_mask": mask[:, : span.stop], "position_ids": positions[:, span]}
            whole.append(llama_gqa(ids[:, span], cache=cache, **kwargs).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(whole, dim=1)[real], decode[real], atol=1e-4, rtol=1e-4)
    for a, b in zip(kept, [cache.positions(i).sort(-1).values for i in range(len(cache.layers))], strict=True):
        assert torch.equal(a, b)
    cls = REGISTRY[policy]
    closed_form = isinstance(cache.layers[0].policy, SinkWindow)
    if not cls.bounded or closed_form or cls.narrows or cls.needs_queries:
        assert scanned == [[], []]
    elif cls.counts_rows:  # (scanned once the padding slots are evicted; not the right-padded continuation)
        assert scanned[1] == []
    else:  # after the tokens that fit before the first eviction (one chunk where that changes nothing)
        first_chunk = 16 if cls.row_additive or not cls.needs_attention else 0
        assert [sum(-n for n in runs) for runs in scanned] == [(150 - first_chunk) * 3, 40 * 3]


def _counting(step, calls: list[int], scanned: bool = False):
    """``step`` recording its chunk's tokens in ``calls`` (negative for a scanned run)."""

    def counted(self, chunk, *args, **kwargs):
        calls.append(-chunk.keys.shape[2] if scanned else chunk.keys.shape[2])
        return step(self, chunk, *args, **kwargs)

    return counted


# Float drift between the two loop orders (batched vs single-row projections) reaches ~5e-4 on logits of ~20 for
# `random`; the closed-form policies attend a whole chunk with a mask instead of one token over its kept slots (a
# different summation order in sdpa: ~2e-4 on a few of 4M logits). The kept sets are equal (checked on the tiny
# model). `topk_oracle` picks each query's top-k keys by logits, so near-equal logits can swap a key: for it only
# the mean log-likelihood must agree.
REAL_ATOL = {"random": 1e-3, "local": 1e-3, "streaming_llm": 1e-3}


@pytest.mark.slow
@pytest.mark.parametrize("policy", FED)
def test_whole_sequence_equals_token_by_token_on_the_real_model(policy, real_model, tokenizer, wiki_text):
    model, _ = real_model
    ids = tokenizer(wiki_text, return_tensors="pt").input_ids[:, :120]
    decode, whole, _, _ = _both_engines(model, ids, policy, budget=32, prefill=32)
    if policy == "topk_oracle":
        nll = [torch.nn.functional.cross_entropy(x[0, :-1], ids[0, 33:]).item() for x in (decode, whole)]
        assert math.isclose(*nll, rel_tol=1e-3)
    else:
        torch.testing.assert_close(whole, decode, atol=REAL_ATOL.get(policy, 1e-4), rtol=1e-4)


@pytest.mark.slow
def test_stream_perplexity_engines_agree_and_report(real_model, tokenizer, wiki_text):
    model, _ = real_model
    ids = tokenizer(wiki_text, return_tensors="pt").input_ids[:, :160]
    results = {
        engine: stream_perplexity(model, ids, "h2o", 40, engine=engine, progress=False, curve_every=64)[0]
        for engine in ("whole", "decode")
    }
    assert math.isclose(results["whole"].ppl, results["decode"].ppl, rel_tol=1e-4)
    for engine, r in results.items():
        assert r.engine == engine and r.tokens_scored == 159 and r.kv_slots_max <= 40
        assert r.curve and r.curve[-1]["tokens"] == 159 and all(p["rss_mb"] > 0 for p in r.curve)
    with pytest.raises(ValueError, match="engine"):
        stream_perplexity(model, ids, "h2o", 40, engine="fast")
    with pytest.raises(ValueError, match="prefill"):
        stream_perplexity(model, ids, "h2o", 40, prefill=160)


def test_stream_is_an_option_of_the_cache_or_of_a_block(llama_gqa):
    cache = kvsieve.make_cache(llama_gqa, "h2o", 8)
    assert cache.stream is False
    with cache.streaming():
        assert cache.stream is True
        with cache.streaming(False):
            assert cache.stream is False
        assert cache.stream is True
    assert cache.stream is False and kvsieve.make_cache(llama_gqa, "h2o", 8, stream=True).stream is True
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match="stream must be True or False"):
            kvsieve.make_cache(llama_gqa, "h2o", 8, stream=bad)


def test_stream_curve_plot(tmp_path):
    from kvsieve.evaluation.perplexity import PerplexityResult
    from kvsieve.evaluation.plots import plot_stream_curves

    point = {"tokens": 10, "ppl": 5.0, "rss_mb": 900.0, "kv_bytes": 2**20}
    curve = [point, point | {"tokens": 20}]
    result = PerplexityResult("h2o", "whole", 8, 8, 10, 5.0, 1.6, 8, 1, 1, 1.0, 1.0, curve=curve)
    png = plot_stream_curves([result], tmp_path / "sub" / "curve.png")
    assert png.stat().st_size > 1000
    result.curve = []
    with pytest.raises(ValueError, match="no curve"):
        plot_stream_curves([result], tmp_path / "x.png")


@pytest.mark.parametrize(
    ("policy", "q", "prompt", "options", "bounds", "closed_form"),
    [
        ("h2o", 5, 5, {}, [0, 5], False),  # an ordinary pass: one chunk
        ("h2o", 1, 0, {"stream": True}, [0, 1], False),  # a decode step
        ("h2o", 8, 5, {}, [0, 5, 6, 7, 8], False),  # a prompt then drafts (set_prompt_length)
        ("h2o", 3, 0, {"decode": True}, [0, 1, 2, 3], False),  # a recorded step
        ("local", 150, 150, {"stream": True}, [0, 64, 128, 150], True),  # closed form: chunks of max(16, 64)
        ("local", 40, 40, {"stream": True, "rolling": True}, [0, *range(16, 41)], False),  # (rolling: not closed)
        ("h2o", 20, 20, {"stream": True, "held": 10}, [0, 6, 7, 8, *range(9, 21)], False),  # room for 6 first
        ("knorm", 20, 20, {"stream": True}, [0, *range(16, 21)], False),  # (never observes: chunked as well)
        ("snapkv", 4, 4, {"stream": True}, [0, 1, 2, 3, 4], False),  # observes, not row-additive: one by one
        ("full", 30, 30, {"stream": True}, [0, 30], False),  # never evicts: one chunk
    ],
)
def test_chunk_plans(policy, q, prompt, options, bounds, closed_form) -> None:
    cls = REGISTRY[policy]
    instance = cls(16 if cls.takes_budget() else None)
    planned = plan_chunks(
        q,
        prompt,
        stream=options.get("stream", False),
        decode=options.get("decode", False),
        policy=instance,
        limit=instance.budget if instance.bounded else None,
        held=options.get("held", 0),
        rolling=options.get("rolling", False),
    )
    assert planned.bounds == sorted(set(bounds)) and planned.closed_form is closed_form


def test_context_perplexity_scores_the_continuation_over_the_compressed_context(llama_gqa) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (1, 60))
    with torch.no_grad():
        logits = llama_gqa(ids).logits
    targets = ids[0, 41:]
    reference = torch.nn.functional.cross_entropy(logits[0, 40:-1], targets).exp().item()
    full, _ = context_perplexity(llama_gqa, ids, "full", context=40)
    assert full.ppl == pytest.approx(reference, rel=1e-5)
    assert (full.protocol, full.prefill_tokens, full.tokens_scored) == ("prefill", 40, 19)
    same, _ = context_perplexity(llama_gqa, ids, "h2o", 1.0, context=40)  # a budget the context fits: nothing evicted
    assert same.ppl == pytest.approx(reference, rel=1e-5)
    h2o, _ = context_perplexity(llama_gqa, ids, "h2o", 0.25, context=40)
    assert (h2o.budget_tokens, h2o.kv_slots_max) == (10, 10)  # the ratio is of the context
    assert h2o.ppl != pytest.approx(reference, rel=1e-3)
    with pytest.raises(ValueError, match="context must be in"):
        context_perplexity(llama_gqa, ids, "h2o", 0.25, context=59)
