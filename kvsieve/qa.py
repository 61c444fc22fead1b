"""Compress once, ask many: a context compressed before any question is known, questions answered against copies of
it (kvpress's protocol), and compressed contexts saved to disk and loaded back.

**The prompt split.** The model's chat template lays out one user turn, ``context + "\\n\\n" + question``, and a
generation prompt. Everything before the question (the template's system prompt and user-turn header, the context,
the blank line) is the **context part**: compressed once, by the first forward pass of a
:class:`~kvsieve.engine.cache.SieveCache`. The question and everything after it (the end of the user turn, the
assistant's header) is the **question part**, fed to a copy of the compressed cache. Each part is tokenized on its
own, so no token spans the boundary. A tokenizer without a chat template gets ``context + "\\n\\n"`` and
``question + "\\n"``; ``chat_template=False`` takes the context and the question as given, nothing added (a plain
completion prompt, e.g. the passkey grid's).

**Answers** decode greedily from a copy of the compressed cache (``copy.deepcopy``): the context is never compressed
again and no question changes it. Several questions are decoded together from rows of one copy
(``batch_repeat_interleave``), each question part left-padded to the longest: the padding sits between the context
and the question, where the model's positions (from the attention mask) and the cache (padding slots are never
attended, never kept over real tokens) skip it, so each row computes what the question asked alone computes, up to
floating-point summation order (``batch_size=1`` asks one at a time). After the prompt the cache grows as
``decode_budget`` says (default None: without bound, so the question and the answer are never evicted, as in kvpress;
a bounded one evicts from the question part's tokens at the end of its forward pass, then one token per step).

**Saved contexts** are one safetensors file: every layer's held keys, values, positions, newest positions and policy
state, the context's tokens, and a JSON header in the file's metadata (format, kvsieve version, model name and a hash
of its config and first embedding rows, dtype, policy, parameters, budgets, the prompt split, each layer's counters).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.api import compress_context, generated, make_cache
from kvsieve.engine.budget import Budget
from kvsieve.engine.cache import SieveCache
from kvsieve.engine.plan import DecodeBudget
from kvsieve.policies import Asking, Policy, resolve_spec

__all__ = ["ContextQA", "asking", "compress", "load_context", "split_prompt"]

SEPARATOR = "\n\n"
"""Between the context and the question in the user turn."""
FORMAT = 1
"""The saved-context format this kvsieve writes and reads."""
_MARKER = "\x1fkvsieve-question\x1f"
_HEADER_KEY = "kvsieve_context"


def split_prompt(tokenizer: PreTrainedTokenizerBase, context: str, chat_template: bool = True) -> tuple[str, str]:
    """The prompt's context part and its question part with ``{question}`` (see the module docstring)."""
    if not chat_template:
        return context, "{question}"
    if not tokenizer.chat_template:
        return context + SEPARATOR, "{question}\n"
    messages = [{"role": "user", "content": context + SEPARATOR + _MARKER}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before, found, after = rendered.partition(_MARKER)
    if not found or context not in before:
        raise ValueError("the tokenizer's chat template changes the context or the question; cannot split the prompt")
    return before, "{question}" + after.replace("{", "{{").replace("}", "}}")


def asking(tokenizer: PreTrainedTokenizerBase, chat_template: bool = True) -> Asking:
    """How a request is written after a context split by :func:`split_prompt` (for a policy's probes): its text,
    then the question part's end (the rest of the user turn and the assistant's header; ``"\n"`` without a chat
    template; nothing with ``chat_template=False``)."""
    after = split_prompt(tokenizer, "", chat_template)[1].removeprefix("{question}").format()
    encode = functools.partial(_encode, tokenizer)
    return Asking(encode=encode, turn_end=encode(after))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


class ContextQA:
    """A compressed context and the questions asked against it. Build it with :func:`compress` or
    :func:`load_context`."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cache: SieveCache,
        context_ids: torch.Tensor,
        question_template: str,
        spec: dict[str, Any],
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.cache = cache
        """The compressed context (never fed anything after it: questions go to copies)."""
        self.context_ids = context_ids
        """``[1, n]``: the context part's tokens."""
        self.question_template = question_template
        self.spec = spec
        """How the context was compressed: policy, params, budget, decode_budget, schedule, rolling."""

    @property
    def context_tokens(self) -> int:
        """Tokens of the context part."""
        return self.context_ids.shape[1]

    def cache_copy(self) -> SieveCache:
        """A copy of the compressed context's cache, to feed a question to."""
        return copy.deepcopy(self.cache)

    def question_ids(self, question: str) -> torch.Tensor:
        """``[1, q]``: the question part's tokens for ``question``."""
        text = self.question_template.format(question=question)
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return ids.to(self.context_ids.device)

    def ask(
        self,
        questions: str | Sequence[str],
        max_new_tokens: int = 64,
        batch_size: int = 8,
        **generate_kwargs: Any,
    ) -> str | list[str]:
        """The answer to ``questions`` (a string), or the answers to each (a list), against the compressed context,
        ``batch_size`` questions at a time (1: one by one). Greedy unless ``generate_kwargs`` say otherwise."""
        one = isinstance(questions, str)
        asked = [questions] if one else list(questions)
        if not asked or any(not isinstance(q, str) or not q.strip() for q in asked):
            raise ValueError("questions must be a non-empty string or a non-empty list of non-empty strings")
        for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        reserved = sorted({"input_ids", "attention_mask", "cache", "past_key_values"} & generate_kwargs.keys())
        if reserved:
            raise ValueError(f"ContextQA.ask sets {', '.join(reserved)} itself")
        answers = []
        for start in range(0, len(asked), batch_size):
            answers += self._answer(asked[start : start + batch_size], max_new_tokens, generate_kwargs)
        return answers[0] if one else answers

    def batch(self, questions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``attention_mask`` ``[len(questions), n + q]``: the context's tokens, then each question
        part left-padded to the longest (the padding sits between context and question: the model's positions and
        the cache's skip it)."""
        parts = [self.question_ids(q)[0] for q in questions]
        longest = max(len(part) for part in parts)
        n, pad = self.context_tokens, self.tokenizer.pad_token_id or 0
        ids = self.context_ids.new_full((len(parts), n + longest), pad)
        mask = torch.zeros_like(ids)
        ids[:, :n], mask[:, :n] = self.context_ids, 1
        for row, part in enumerate(parts):
            ids[row, n + longest - len(part) :], mask[row, n + longest - len(part) :] = part, 1
        return ids, mask

    def _answer(self, questions: list[str], max_new_tokens: int, generate_kwargs: dict[str, Any]) -> list[str]:
        """Answers to ``questions`` decoded together from rows of one copy of the compressed cache."""
        ids, mask = self.batch(questions)
        cache = self.cache_copy()
        if len(questions) > 1:
            cache.batch_repeat_interleave(len(questions))
        kwargs = {"do_sample": False, **generate_kwargs}
        if self.tokenizer.pad_token_id is not None:
            kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=max_new_tokens, **kwargs
            )
        texts, _ = generated(self.model, self.tokenizer, out, ids.shape[1], kwargs.get("eos_token_id"))
        return [text.strip() for text in texts]

    def save(self, path: str | Path) -> Path:
        """Write the compressed context to ``path`` (safetensors; see the module docstring); the path."""
        tensors, counters = self.cache.export()
        tensors["context_ids"] = self.context_ids
        header = {
            "format": FORMAT,
            "kvsieve_version": importlib.metadata.version("kvsieve"),
            **model_identity(self.model),
            **self.spec,
            "question_template": self.question_template,
            "layer_budgets": self.cache.budgets,
            "layers": counters,
        }
        path = Path(path)
        save_file({k: t.contiguous() for k, t in tensors.items()}, path, metadata={_HEADER_KEY: json.dumps(header)})
        return path


def compress(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    policy: str | type[Policy] = "h2o",
    budget: Budget = 0.2,
    *,
    decode_budget: DecodeBudget = None,
    schedule: str | Sequence[float] = "uniform",
    rolling: bool = False,
    chat_template: bool = True,
    **policy_kwargs: Any,
) -> ContextQA:
    """Compress ``context`` to ``budget`` (tokens, or a ratio of the context part's tokens) before any question is
    known; ask it questions with :meth:`ContextQA.ask`. ``decode_budget``: how far a question's copy may grow (default
    None: without bound); ``chat_template=False``: the context and each question as given, no template and nothing
    between them (see the module docstring); the other arguments are :func:`kvsieve.make_cache`'s."""
    if not isinstance(context, str) or not context.strip():
        raise ValueError("the context must be a non-empty string")
    cls, params, schedule, quant = resolve_spec(policy, policy_kwargs, schedule)
    spec = {
        "policy": cls.name,
        "params": params,
        "budget": budget,
        "decode_budget": decode_budget,
        "schedule": schedule if isinstance(schedule, str) else list(schedule),
        "rolling": rolling,
        "quant": quant,
    }
    cache = _make(model, spec)
    context_text, question_template = split_prompt(tokenizer, context, chat_template)
    special = not (chat_template and tokenizer.chat_template)  # (a template writes its own special tokens)
    ids = tokenizer(context_text, add_special_tokens=special, return_tensors="pt")["input_ids"].to(model.device)
    cache.resolve(ids.shape[1])  # (invalid budgets fail before any work)
    compress_context(model, cache, ids, asking(tokenizer, chat_template))
    return ContextQA(model, tokenizer, cache, ids, question_template, spec)


def load_context(path: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ContextQA:
    """The compressed context saved at ``path`` by :meth:`ContextQA.save`, for ``model`` (the one it was compressed
    with: another model, dtype or an incompatible format is refused)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no saved context at {path}")
    try:
        with safe_open(str(path), framework="pt", device=str(model.device)) as f:
            raw = (f.metadata() or {}).get(_HEADER_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except SafetensorError as err:
        raise ValueError(f"{path} is not a safetensors file: {err}") from None
    if raw is None:
        raise ValueError(f"{path} is not a kvsieve saved context (no {_HEADER_KEY} header)")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its {_HEADER_KEY} header is not a JSON object")
    if header.get("format") != FORMAT:
        raise ValueError(
            f"{path} was saved by kvsieve {header.get('kvsieve_version')} in format {header.get('format')}; this "
            f"kvsieve reads format {FORMAT}"
        )
    missing = sorted(_HEADER_FIELDS - header.keys())
    if missing:
        raise ValueError(f"{path}: its header misses {', '.join(missing)}")
    identity = model_identity(model)
    for key, what in (("dtype", "dtype"), ("config_hash", "config and weights")):
        if header[key] != identity[key]:
            raise ValueError(
                f"{path} holds a context compressed by {header['model'] or 'another model'} ({header[key]}); this "
                f"model ({identity['model'] or type(model).__name__}) differs in {what} ({identity[key]})"
            )
    spec = {key: header[key] for key in _SPEC_FIELDS} | {"quant": header.get("quant", {})}
    cache = _make(model, spec)
    context_ids = tensors.pop("context_ids")
    cache.restore(tensors, header["layers"], context_ids.shape[1])
    if cache.budgets != header["layer_budgets"]:
        raise ValueError(f"{path}: the layer budgets rebuilt ({cache.budgets}) differ from the saved ones")
    return ContextQA(model, tokenizer, cache, context_ids, header["question_template"], spec)


def model_identity(model: PreTrainedModel) -> dict[str, str]:
    """What a saved context records of its model: its name, dtype, and a hash of its config (private and
    version fields left out) and of its first embedding rows (a different checkpoint of the same architecture)."""
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in _UNHASHED}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(model.get_input_embeddings().weight[:8].detach().float().cpu().numpy().tobytes())
    return {"model": model.config.name_or_path, "dtype": str(model.dtype), "config_hash": digest.hexdigest()}


_SPEC_FIELDS = ("policy", "params", "budget", "decode_budget", "schedule", "rolling")
_HEADER_FIELDS = frozenset(
    {*_SPEC_FIELDS, "model", "dtype", "config_hash", "question_template", "layer_budgets", "layers"}
)
_UNHASHED = frozenset({"transformers_version", "dtype", "torch_dtype", "name_or_path"})


def _make(model: PreTrainedModel, spec: dict[str, Any]) -> SieveCache:
    return make_cache(
        model,
        spec["policy"],
        spec["budget"],
        decode_budget=spec["decode_budget"],
        schedule=spec["schedule"],
        rolling=spec["rolling"],
        **spec["quant"],
        **spec["params"],
    )
