"""The lm-evaluation-harness model ``kvsieve``: a causal LM scored and generating under an evicting KV cache.

lm-eval 0.4.13 resolves ``--model NAME`` only in its own registry (no plugin entry points), so this module must be
imported before lm-eval looks the name up. Both supported ways do that:

- command line: ``kvsieve lm-eval --model kvsieve --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2,\
protocol=stream --tasks kvsieve_social_iqa --limit 10`` (every argument is lm-eval's own; the offline task pack's
  directory is added as ``--include_path``, and ``--batch_size`` defaults to 8 rather than lm-eval's 1);
- Python: ``import kvsieve.evaluation.lm_eval_model`` then ``lm_eval.simple_evaluate(model="kvsieve",
  model_args=..., tasks=..., task_manager=kvsieve.evaluation.tasks.task_manager(tasks))``, or pass a
  :class:`KVSieveLM` instance as ``model``.

Model arguments: ``pretrained`` (built-in name, local directory or HF id), ``policy``, ``budget`` (a ratio of each
request's length, e.g. ``0.2`` or ``20%``, or a token count such as ``64``; write ``1.0`` for 100 %),
``protocol``, ``question``, ``budget_of``, ``batch_size``, ``dtype``; ``kv_bits`` (8, 4 or 2), ``group_size`` and
``residual`` quantize the slots (:mod:`kvsieve.engine.quant`; also as keys of a ``policy`` spec); any other argument
is a policy parameter (``recent=16``). The device comes from lm-eval's ``--device`` (its default ``cuda:0`` falls
back to the CPU when there is no GPU).

Budgets follow the H2O protocol: a ratio is resolved per request, ``round(ratio · (context + continuation))``
tokens for scoring, ``round(ratio · (context + max_gen_toks))`` for generation, before the cache is built.
``budget_of=context`` resolves it against the context alone, ``round(ratio · context)``: the choices of a
multiple-choice item then get one budget, so their shared context is streamed once (1.1× faster on BIG-bench's
cause_and_effect, a task of an earlier pack, whose choices mostly share a budget already); each log-likelihood is
still exactly that of its request scored alone under that budget.
Protocols:

- ``stream``: eviction applies from the first token. The request is fed in one forward pass with the cache's
  the stream protocol, which gives exactly the logits of feeding it token by token.
- ``prefill``: the context is processed with full attention in one step and compressed once to the budget; the
  continuation is then fed token by token under eviction (the stream protocol). The first continuation token is
  predicted by the full-attention pass, so one-token answers (Yes/No, correct/incorrect) score exactly as under
  ``full``: use ``stream`` for multiple-choice tasks; ``prefill`` suits generation (decoding under eviction).

``question`` (:data:`~kvsieve.evaluation.defaults.QUESTION_MODES`): ``aware`` (the default) is the above.
``agnostic`` (with ``protocol=prefill`` only) compresses each request's context **before its continuation is
known**, kvpress's protocol. An lm-eval request does not mark where its question starts (a task's prompt mixes
document, shots and question freely), so the split is by position: the **context but its last token** is compressed
alone, in one forward pass, to the budget; the context's last token and the continuation are then fed with no
eviction at all (``decode_budget=None``: the cache grows by them), so *every* scored or generated token — the first
one too — is predicted from the compressed context, and one-token answers are not scored as under ``full``. A
question that ends the context is therefore compressed with the document (all but its last token): this mode
measures compression that never sees the continuation, not one that keeps the question whole. A ratio budget is of
the request's context, ``round(ratio · context)`` tokens (kvpress's convention: of the compressed context, not of
what follows). ``loglikelihood_rolling`` requests (perplexity tasks) have no context to compress and are refused.

Requests whose budget can never be exceeded are computed with the ``full`` cache (the same result, faster; its
slots quantized alike).
Requests with equal budgets are batched (left padding; positions are per-row real-token indices), and requests
that share their context (the choices of a multiple-choice question) share its computation: the context is fed
once and the cache rows are copied for each continuation, which gives the same logits.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models: it registers them only while its registry is empty)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.api import make_cache
from kvsieve.engine.budget import Budget, parse_budget, resolve_budget
from kvsieve.engine.cache import SieveCache
from kvsieve.engine.plan import SAME
from kvsieve.engine.quant import kv_quant
from kvsieve.evaluation.defaults import (
    BUDGET_OF,
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_GEN_TOKS,
    DEFAULT_MODEL,
    DEFAULT_QUESTION,
    PROTOCOLS,
    check_question,
)
from kvsieve.policies import resolve_spec

Pair = tuple[list[int], list[int]]


@register_model("kvsieve")
class KVSieveLM(TemplateLM):
    """An lm-eval ``LM`` whose every request runs through a :class:`~kvsieve.SieveCache` (see the module docs).

    ``model``/``tokenizer``: an already loaded model (Python use); otherwise ``pretrained`` is loaded with
    :func:`kvsieve.load_model`.
    """

    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        policy: str = "h2o",
        budget: Budget | str = 0.2,
        protocol: str = "stream",
        question: str = DEFAULT_QUESTION,
        budget_of: str | None = None,
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        device: str | None = None,
        dtype: str | None = None,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_batch_size: int | None = None,
        **policy_kwargs: Any,
    ) -> None:
        super().__init__()
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        check_question(question, protocol)
        if budget_of not in (None, *BUDGET_OF):
            raise ValueError(f"budget_of must be one of {', '.join(BUDGET_OF)}, got {budget_of!r}")
        if question == "agnostic" and budget_of == "request":
            raise ValueError("question=agnostic compresses the context alone: its ratio budget is of the context")
        # typed; fails early on a bad one. ``policy`` may be a spec ("ahakv:sgs=false,schedule=increasing").
        self.policy, self.policy_kwargs, self.schedule, self.quant = resolve_spec(policy, policy_kwargs)
        kv_quant(**self.quant)
        self.budget = parse_budget(budget)
        self.protocol = protocol
        self.question = question
        self.budget_of = budget_of or ("context" if question == "agnostic" else "request")
        if model is None:
            from kvsieve.models import load_model

            if device and device.startswith("cuda") and not torch.cuda.is_available():
                device = None  # lm-eval's CLI asks for cuda:0 unless told otherwise; use what there is
            model, tokenizer = load_model(pretrained, device=device, dtype=dtype)
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        self.model, self.tokenizer = model, tokenizer
        size = int(batch_size) if str(batch_size).isdigit() else DEFAULT_BATCH_SIZE  # "auto" → the default
        self.batch_size = min(size, max_batch_size) if max_batch_size else size
        self.max_length = getattr(model.config.get_text_config(), "max_position_embeddings", None)

    # -- lm-eval's model contract -------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        special = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in its results' config."""
        return {
            "kvsieve_policy": self.policy.name,
            "kvsieve_budget": self.budget,
            "kvsieve_protocol": self.protocol,
            "kvsieve_question": self.question,
            "kvsieve_budget_of": self.budget_of,
            "kvsieve_policy_params": self.policy_kwargs,
        }

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        pairs = [self._truncate(context, continuation) for _, context, continuation in requests]
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        budgets = [self.request_budget(len(c), len(k)) for c, k in pairs]
        with tqdm(total=len(pairs), desc=f"kvsieve {self.policy.name} scoring", disable=disable_tqdm) as bar:
            for budget, batch in self._batches(budgets, [tuple(c) for c, _ in pairs]):
                for i, result in zip(batch, self.score([pairs[i] for i in batch], budget), strict=True):
                    results[i] = result
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
                bar.update(len(batch))
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string, streamed through the cache after the prefix token (no windows: the
        cache itself is bounded). Refused under ``question=agnostic`` (no context to compress)."""
        if self.question == "agnostic" and requests:
            raise ValueError(
                "question=agnostic compresses each request's context before its continuation; loglikelihood_rolling "
                "requests (perplexity tasks) have none: use question=aware"
            )
        tokenized = [(("", req.args[0]), [self.prefix_token_id], self.tok_encode(req.args[0])) for req in requests]
        results = [logprob for logprob, _ in self._loglikelihood_tokens(tokenized, disable_tqdm=disable_tqdm)]
        for req, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), result)
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        contexts = [req.args[0] for req in requests]
        outputs = self.generate(contexts, [req.args[1] for req in requests], disable_tqdm=disable_tqdm)
        for req, output in zip(requests, outputs, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, output)
        return outputs

    # -- kvsieve ------------------------------------------------------------------------------------------------

    def evicting_budget(self, length: int, of: int | None = None) -> int | None:
        """The budget of a request of ``length`` tokens (a ratio of ``of`` tokens, default ``length``), or None when
        nothing can ever be evicted (a request of ``length`` tokens feeds ``length - 1`` of them)."""
        if not self.policy.bounded:
            return None
        tokens = resolve_budget(self.budget, length if of is None else of)
        return tokens if tokens < length - 1 else None

    def request_budget(self, context: int, more: int) -> int | None:
        """The budget of a request whose context has ``context`` tokens and ``more`` follow (the continuation, or
        ``max_gen_toks``): a ratio of the whole request or of its context (:attr:`budget_of`). Under
        ``question=agnostic`` the context's last token is fed after the compression, so nothing is evicted unless
        fewer than ``context - 1`` are kept."""
        fed = context if self.question == "agnostic" else context + more
        return self.evicting_budget(fed, context if self.budget_of == "context" else None)

    def _cache(self, budget: int | None) -> SieveCache:
        """A cache for requests under ``budget`` (None: the full cache, its slots quantized all the same when
        ``kv_bits`` is set); streamed under the ``stream`` protocol, growing without bound after the compressed
        context under ``question=agnostic``."""
        if budget is None:
            return make_cache(self.model, "full", None, **self.quant)
        return make_cache(
            self.model,
            self.policy,
            budget,
            stream=self.protocol == "stream",
            schedule=self.schedule,
            decode_budget=None if self.question == "agnostic" else SAME,
            **self.quant,
            **self.policy_kwargs,
        )

    def _fit(self, context: list[int], room: int) -> list[int]:
        """``context`` without its oldest tokens if it and ``room`` more tokens exceed the model's positions."""
        if self.max_length is not None and len(context) + room > self.max_length:
            context = context[len(context) + room - self.max_length :]
        return context

    def _truncate(self, context: list[int], continuation: list[int]) -> Pair:
        """Drop the oldest context tokens if the request is longer than the model's positions."""
        return self._fit(context, len(continuation) - 1), continuation

    def _batches(
        self, keys: Sequence[Hashable], rows: Sequence[tuple[int, ...]]
    ) -> Iterator[tuple[Hashable, list[int]]]:
        """Request indices grouped by key (the budget, ...), longest row first, each batch holding at most
        ``batch_size`` distinct rows (requests sharing a row, e.g. the choices of one question, stay together)."""
        groups: dict[Hashable, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            groups[key].append(i)
        for key, indices in groups.items():
            indices.sort(key=lambda i: (-len(rows[i]), rows[i]))
            batch: list[int] = []
            distinct: set[tuple[int, ...]] = set()
            for i in indices:
                if rows[i] not in distinct and len(distinct) == self.batch_size:
                    yield key, batch
                    batch, distinct = [], set()
                batch.append(i)
                distinct.add(rows[i])
            yield key, batch

    def _forward(
        self, cache: SieveCache, rows: list[list[int]], past: torch.Tensor | None, keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``rows`` through ``cache``: left-padded on the first call (``past`` None), right-padded after
        ``past`` (the ``[B, seen]`` mask so far). Returns the logits of the last ``keep`` positions (0 = all) and the
        mask including the new tokens."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        new = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            span = slice(width - len(row), width) if past is None else slice(0, len(row))
            ids[i, span] = torch.tensor(row, dtype=torch.long)
            new[i, span] = 1
        mask = new if past is None else torch.cat([past, new], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        device = self.model.device
        logits = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=keep,
        ).logits
        return logits.float(), mask

    @torch.inference_mode()
    def score(self, pairs: Sequence[Pair], budget: int | None) -> list[tuple[float, bool]]:
        """``(log-probability, is_greedy)`` of each continuation after its context, all requests under ``budget``
        (None = the full cache) with this model's protocol.

        Each distinct context is fed once (left-padded batch; the stream protocol under ``stream``, one step under
        ``prefill``), the cache rows are then copied for every continuation of that context, and the continuations
        (right-padded) are streamed. Under ``question=agnostic`` with a budget, the contexts but their last tokens
        are compressed, then each last token and continuation is fed in one pass without eviction.
        """
        contexts: dict[tuple[int, ...], int] = {}
        owner = [contexts.setdefault(tuple(c), len(contexts)) for c, _ in pairs]
        conts = [k for _, k in pairs]
        cache = self._cache(budget)
        if self.question == "agnostic" and budget is not None:
            _, mask = self._forward(cache, [list(c[:-1]) for c in contexts], None, keep=1)
            cache.batch_select_indices(torch.tensor(owner, device=self.model.device))
            logits, _ = self._forward(cache, [[c[-1], *k[:-1]] for c, k in pairs], mask[owner])
            return self._logprobs([logits[i, : len(k)] for i, k in enumerate(conts)], conts)
        first, mask = self._forward(cache, [list(c) for c in contexts], None, keep=1)
        rows = [first[o] for o in owner]
        if max(len(k) for k in conts) > 1:
            cache.batch_select_indices(torch.tensor(owner, device=self.model.device))
            with cache.streaming(budget is not None):
                rest, _ = self._forward(cache, [k[:-1] for k in conts], mask[owner])
            rows = [torch.cat([row, rest[i, : len(k) - 1]]) for i, (row, k) in enumerate(zip(rows, conts, strict=True))]
        return self._logprobs(rows, conts)

    @staticmethod
    def _logprobs(rows: Sequence[torch.Tensor], conts: Sequence[list[int]]) -> list[tuple[float, bool]]:
        """``(log-probability, is_greedy)`` of each continuation from its ``[len(k), V]`` logits."""
        results = []
        for row, k in zip(rows, conts, strict=True):
            target = torch.tensor(k, device=row.device)
            logprob = row.log_softmax(-1).gather(-1, target[:, None]).sum().item()
            results.append((logprob, bool((row.argmax(-1) == target).all())))
        return results

    @torch.inference_mode()
    def generate(
        self,
        contexts: Sequence[str],
        gen_kwargs: dict[str, Any] | Sequence[dict[str, Any]],
        disable_tqdm: bool = True,
    ) -> list[str]:
        """Continue each context under eviction until a stop string (``until``), EOS or ``max_gen_toks`` tokens.

        ``gen_kwargs`` (one dict for all or one per context): lm-eval's generation arguments; the rest goes to
        ``model.generate`` (greedy unless ``do_sample=True``). The stop string itself is cut off.
        """
        kwargs_list = [gen_kwargs] * len(contexts) if isinstance(gen_kwargs, dict) else list(gen_kwargs)
        if len(kwargs_list) != len(contexts):
            raise ValueError(f"got {len(kwargs_list)} gen_kwargs for {len(contexts)} contexts")
        settings = []
        for kwargs in kwargs_list:
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            if self.max_length is not None and max_new >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={max_new} leaves no room for a context in the model's {self.max_length} positions"
                )
            kwargs.setdefault("do_sample", False)
            if not kwargs["do_sample"]:
                kwargs.pop("temperature", None)
            settings.append((until, max_new, kwargs))
        # As lm-eval's own models: a context too long for the positions loses its oldest tokens (a left-padded
        # batch would otherwise pad every row to it).
        prompts = [self._fit(self.tok_encode(c), s[1]) for c, s in zip(contexts, settings, strict=True)]
        keys = [
            (self.request_budget(len(p), max_new), json.dumps(s, sort_keys=True))
            for p, s in zip(prompts, settings, strict=True)
            for max_new in [s[1]]
        ]
        outputs = [""] * len(contexts)
        with tqdm(total=len(contexts), desc=f"kvsieve {self.policy.name} generating", disable=disable_tqdm) as bar:
            for (budget, _), batch in self._batches(keys, [tuple(p) for p in prompts]):
                until, max_new, kwargs = settings[batch[0]]
                texts = self._generate([prompts[i] for i in batch], budget, until, max_new, kwargs)
                for i, text in zip(batch, texts, strict=True):
                    outputs[i] = text
                bar.update(len(batch))
        return outputs

    def _generate(
        self, prompts: list[list[int]], budget: int | None, until: list[str], max_new: int, kwargs: dict[str, Any]
    ) -> list[str]:
        cache = self._cache(budget)
        width = max(len(p) for p in prompts)
        if self.question == "agnostic" and budget is not None:
            cache.set_prompt_length(width - 1)  # (left-padded: every row's last token is in the last column)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=max_new,
            stop_strings=until or None,
            tokenizer=self.tokenizer,
            pad_token_id=pad,
            **kwargs,
        )
        texts = self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return [min((text.split(stop)[0] for stop in until), key=len, default=text) for text in texts]
