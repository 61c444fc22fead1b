"""XSum under eviction: one-sentence summaries of XSum articles (:mod:`kvsieve.corpora.xsum`), scored with ROUGE-1/2/L.

Prompt: for a model with a chat template (SmolLM2-135M-Instruct, the default) the article goes in one user turn,
``"Summarize the following article in one sentence.\\n\\n<article>"``, followed by the assistant generation prompt
(the template adds its default system turn); for a model without one, the format of BIG-bench's ``gem/xsum`` task
``"summarize: <article>\\none-sentence summary:"``. Zero-shot: 5-shot XSum prompts would not fit a small model's
useful context. An article too long for the model's positions (with room for the summary) loses its end, so that
the instruction stays (the longest article is 4,784 SmolLM2 tokens: a model of fewer positions cuts). Decoding is
greedy, at most :data:`MAX_NEW_TOKENS` tokens, stopped at the first newline (the
summary is one sentence) or EOS. The generation runs through :class:`~kvsieve.evaluation.lm_eval_model.KVSieveLM`,
so a ratio budget is ``ratio · (prompt + max_new_tokens)`` tokens and the protocol (stream/prefill) applies to
the prompt. Scores: ROUGE F-measures × 100 with Porter stemming (``rouge-score``, which works offline; ``evaluate.
load("rouge")`` needs the Hub), averaged over the articles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rouge_score import rouge_scorer
from transformers import PreTrainedTokenizerBase

from kvsieve.corpora.xsum import load_xsum
from kvsieve.evaluation.defaults import ROUGE_TYPES
from kvsieve.evaluation.lm_eval_model import KVSieveLM

INSTRUCTION = "Summarize the following article in one sentence."
MAX_NEW_TOKENS = 64
CUT_MARGIN = 8


@dataclass
class XSumResult:
    articles: int
    rouge1: float
    rouge2: float
    rougeL: float
    samples: list[dict[str, str]] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def xsum_prompt(tokenizer: PreTrainedTokenizerBase, article: str, max_tokens: int | None = None) -> str:
    """The prompt asking for a one-sentence summary of ``article`` (see the module docs), the article cut short if
    the prompt would exceed ``max_tokens`` tokens."""
    prompt = _render(tokenizer, article)
    excess = 0 if max_tokens is None else len(tokenizer.encode(prompt)) - max_tokens
    if excess > 0:
        ids = tokenizer.encode(article, add_special_tokens=False)
        # (a margin: the cut text may tokenize into a few more tokens than its ids)
        prompt = _render(tokenizer, tokenizer.decode(ids[: max(0, len(ids) - excess - CUT_MARGIN)]))
    return prompt


def _render(tokenizer: PreTrainedTokenizerBase, article: str) -> str:
    if tokenizer.chat_template:
        message = {"role": "user", "content": f"{INSTRUCTION}\n\n{article}"}
        return tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    return f"summarize: {article}\none-sentence summary:"


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F-measures (× 100) of ``predictions`` against ``references``."""
    if not predictions or len(predictions) != len(references):
        raise ValueError(f"need as many predictions as references (> 0), got {len(predictions)}/{len(references)}")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references, strict=True)]
    return {name: 100 * sum(s[name].fmeasure for s in scores) / len(scores) for name in ROUGE_TYPES}


def evaluate_xsum(
    lm: KVSieveLM, limit: int | None = None, max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = False
) -> XSumResult:
    """Summarize the first ``limit`` XSum articles (all 999 when None) under ``lm``'s policy and budget."""
    examples = load_xsum()[:limit]
    room = None if lm.max_length is None else lm.max_length - max_new_tokens
    prompts = [xsum_prompt(lm.tokenizer, e.article, room) for e in examples]
    summaries = lm.generate(prompts, {"until": ["\n"], "max_gen_toks": max_new_tokens}, disable_tqdm=not progress)
    summaries = [s.strip() for s in summaries]
    scores = rouge(summaries, [e.summary for e in examples])
    samples = [{"reference": e.summary, "summary": s} for e, s in zip(examples, summaries, strict=True)]
    return XSumResult(articles=len(examples), samples=samples, **scores)
