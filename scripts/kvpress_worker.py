"""The process of ``scripts/kvpress_side_by_side.py`` and ``scripts/kvpress_qa.py``: one side, JSON lines in and
out.

It runs under either virtualenv: kvsieve's (``.venv``, side ``kvsieve``) or kvpress's (``.venv-kvpress``, side
``kvpress``: kvpress 0.5.5 needs transformers < 5.3). At the top it imports only torch and transformers; each side
imports its own library, so both sides time the very same code (:class:`Measurement`) on the same weights. The driver
keeps one process per side alive and alternates their runs.

The first line on stdin sets the process up::

    {"side": "kvsieve" | "kvpress", "model": DIR, "ids": [token ids], "threads": T, "methods": [names],
     "budget": TOKENS, "compression_ratio": R, "warmup": TOKENS}

``methods`` are kvsieve policy specs (``"snapkv:window=64,kernel=5"``) on the kvsieve side, press names on the
kvpress side, and ``"dynamic"`` on both (transformers' ``DynamicCache``, sdpa, nothing evicted). The kvsieve side
keeps ``budget`` tokens; the kvpress side compresses by ``compression_ratio``. The process loads the model, warms
every method up on the first ``warmup`` tokens (two decode steps, untimed) and answers ``{"side", "versions",
"threads"}``. Then one method's run at a time, a step per line, so that the driver can alternate the two sides'
decode steps: ``{"do": "start", "method": name, "kept": bool}`` prefills all ``ids`` (answer: ``prefill_s``),
``{"do": "step"}`` runs one greedy decode step (answer: ``{}``), ``{"do": "finish"}`` answers the run: ``prefill_s``,
``steps``, ``step_ms`` (median decode step), ``kv_bytes`` (keys and values held after the steps), ``extra_bytes``
(other per-token cache state: kvsieve's positions and policy scores), ``slots`` (tokens a layer's buffers hold, at
most) and, with ``"kept": true``, ``kept``: for each layer and KV head (batch row 0), the sorted prompt positions the
cache held right after the prefill.

Question answering (``scripts/kvpress_qa.py``) needs only ``side``, ``model``, ``threads`` and
``compression_ratio`` in the setup line (no ``ids``, ``methods``: nothing to warm up), then ``{"do": "ask",
"method": name, "context": str, "question": str, "budget": TOKENS, "max_new_tokens": N}``: the context compressed
before the question (kvpress's ``kv-press-text-generation`` pipeline with the press, ``"dynamic"``: no press;
kvsieve's ``compress`` with the policy spec at ``budget`` tokens, ``"full"``: nothing evicted, then ``ask``), greedy.
Answer: ``answer`` (the decoded text, stripped), ``tokens`` (the answer's token ids, an EOS included: the greedy
token of each forward pass of the LM after the context's), ``context_ids`` and ``question_ids`` (what was fed).

RULER (``scripts/kvpress_ruler.py``) needs the same setup line, then ``{"do": "ruler", ...}``: one sample given as
token ids, answered by that script's ``answer_sample`` (see there).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

DYNAMIC = "dynamic"

Kept = list[list[list[int]]]
"""Per layer, per KV head: sorted positions."""


@dataclass
class Setup:
    """A method ready to run: its fresh cache, what wraps the prefill (kvpress's hooks), what it keeps."""

    cache: Cache
    prefill: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    kept: Callable[[Cache], Kept] | None = None
    extra_bytes: Callable[[Cache], int] = lambda cache: 0


def load(model_dir: str, threads: int) -> PreTrainedModel:
    """The model in fp32, eval mode, sdpa attention, on ``threads`` CPU threads (no progress bars)."""
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def forward(model: PreTrainedModel, ids: torch.Tensor, cache: Cache) -> Any:
    """``model(ids)`` over ``cache``, the last position's logits only. The cache argument is ``cache`` since
    transformers 5.24 (kvsieve's side) and ``past_key_values`` before (kvpress's side, transformers < 5.3)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(ids, use_cache=True, logits_to_keep=1, **{name: cache})


def next_token(model: PreTrainedModel, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward pass (the last position's logits only); the greedy next tokens ``[B, 1]``."""
    return forward(model, ids, cache).logits[:, -1:].argmax(-1)


@functools.cache
def load_tokenizer(model: PreTrainedModel) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside ``model``'s weights (loaded once, when a question needs it)."""
    return AutoTokenizer.from_pretrained(model.name_or_path)


@contextlib.contextmanager
def greedy_tokens(model: PreTrainedModel) -> Iterator[list[int]]:
    """The greedy token of each forward pass of ``model`` made inside (the argmax of the last position's logits,
    batch row 0), read by a forward hook."""
    tokens: list[int] = []
    handle = model.register_forward_hook(lambda module, args, out: tokens.append(int(out.logits[0, -1].argmax())))
    try:
        yield tokens
    finally:
        handle.remove()


def answer_reply(answer: str, tokens: list[int], context_ids: list[int], question_ids: list[int]) -> dict[str, Any]:
    """An ``ask`` command's reply."""
    return {"answer": answer.strip(), "tokens": tokens, "context_ids": context_ids, "question_ids": question_ids}


def kv_bytes(cache: Cache) -> int:
    """Key and value bytes the cache's layers hold."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


class Measurement:
    """One method's run over a prompt: the prefill (timed, inside the method's prefill wrapper), what it kept (read
    untimed), then greedy decode steps of one token each, each timed; :meth:`result` sums it up."""

    @torch.inference_mode()
    def __init__(self, model: PreTrainedModel, setup: Setup, ids: torch.Tensor, kept: bool) -> None:
        self.model, self.setup = model, setup
        start = time.perf_counter()
        with setup.prefill():
            self.token = next_token(model, setup.cache, ids)
        self.prefill_s = time.perf_counter() - start
        self.kept = setup.kept(setup.cache) if kept and setup.kept is not None else None
        self.step_s: list[float] = []

    @torch.inference_mode()
    def step(self) -> None:
        start = time.perf_counter()
        self.token = next_token(self.model, self.setup.cache, self.token)
        self.step_s.append(time.perf_counter() - start)

    def result(self) -> dict[str, Any]:
        cache = self.setup.cache
        run = {
            "prefill_s": self.prefill_s,
            "steps": len(self.step_s),
            "step_ms": statistics.median(self.step_s) * 1e3,
            "kv_bytes": kv_bytes(cache),
            "extra_bytes": self.setup.extra_bytes(cache),
            "slots": max(layer.keys.shape[-2] for layer in cache.layers if layer.keys is not None),
        }
        return run if self.kept is None else {**run, "kept": self.kept}


def match_positions(kept: torch.Tensor, reference: torch.Tensor) -> list[list[int]]:
    """For each head, the sorted positions of the ``reference`` ``[H, N, D]`` rows that the rows of ``kept``
    ``[H, M, D]`` are exact copies of (a press gathers the prompt's keys). Rows are matched by a fingerprint of their
    bytes, then checked equal."""
    weights = torch.randint(
        1, 2**62, (kept.shape[-1] * kept.element_size(),), generator=torch.Generator().manual_seed(0)
    )

    def fingerprint(rows: torch.Tensor) -> torch.Tensor:
        return (rows.contiguous().view(torch.uint8).long() * weights).sum(-1)  # (wraps around: still a fingerprint)

    positions = []
    for rows, ref in zip(kept, reference, strict=True):
        ordered, order = fingerprint(ref).sort()
        index = order[torch.searchsorted(ordered, fingerprint(rows)).clamp(max=len(order) - 1)]
        if not torch.equal(ref[index], rows):
            raise RuntimeError("a kept key is no copy of a prompt key: the prefill's keys differ from the reference's")
        positions.append(sorted(index.tolist()))
    return positions


class KvpressSide:
    """kvpress's presses over a ``DynamicCache``: the press hooks wrap the prefill."""

    def __init__(self, model: PreTrainedModel, compression_ratio: float) -> None:
        import kvpress

        self.model, self.ratio = model, compression_ratio
        self.presses = {
            "streaming_llm": kvpress.StreamingLLMPress,
            "snapkv": kvpress.SnapKVPress,
            "knorm": kvpress.KnormPress,
            "tova": kvpress.TOVAPress,
        }
        self.reference: list[torch.Tensor] | None = None

    def setup(self, method: str, ids: torch.Tensor, budget: int, kept: bool) -> Setup:
        cache = DynamicCache(config=self.model.config)
        if method == DYNAMIC:
            return Setup(cache)
        if method not in self.presses:
            raise ValueError(f"unknown press {method!r}; expected one of {', '.join(self.presses)}")
        if kept and self.reference is None:  # the prompt's keys, unpressed: a press keeps copies of some of them
            full = DynamicCache(config=self.model.config)
            with torch.inference_mode():
                forward(self.model, ids, full)
            self.reference = [layer.keys[0].clone() for layer in full.layers]
        press = self.presses[method](compression_ratio=self.ratio)
        return Setup(
            cache,
            prefill=lambda: press(self.model),
            kept=lambda c: [
                match_positions(lay.keys[0], ref) for lay, ref in zip(c.layers, self.reference, strict=True)
            ],
        )

    def ask(self, method: str, context: str, question: str, budget: int, max_new_tokens: int) -> dict[str, Any]:
        """kvpress's pipeline: ``context`` compressed by the press (by ``compression_ratio``; ``budget`` unused),
        then ``question`` answered greedily. (The pipeline prefills the context through the base model, without the
        LM head: every forward pass of ``self.model`` is the answer's.)"""
        from transformers import pipeline

        if method != DYNAMIC and method not in self.presses:
            raise ValueError(f"unknown press {method!r}; expected one of {', '.join(self.presses)}")
        press = None if method == DYNAMIC else self.presses[method](compression_ratio=self.ratio)
        pipe = pipeline("kv-press-text-generation", model=self.model, tokenizer=load_tokenizer(self.model))
        fed = pipe.preprocess(context, questions=[question], answer_prefix="", max_context_length=int(1e10))
        with greedy_tokens(self.model) as tokens, torch.inference_mode():
            answer = pipe(context, question=question, press=press, max_new_tokens=max_new_tokens)["answer"]
        return answer_reply(answer, tokens, fed["context_ids"][0].tolist(), fed["questions_ids"][0][0].tolist())


class KvsieveSide:
    """kvsieve's caches (``make_cache`` at ``budget`` tokens, kvsieve's attention), or a ``DynamicCache`` with sdpa."""

    def __init__(self, model: PreTrainedModel, compression_ratio: float) -> None:
        self.model = model

    def setup(self, method: str, ids: torch.Tensor, budget: int, kept: bool) -> Setup:
        from kvsieve.api import make_cache

        if method == DYNAMIC:
            self.model.set_attn_implementation("sdpa")
            return Setup(DynamicCache(config=self.model.config))
        return Setup(
            make_cache(self.model, method, budget),
            kept=lambda c: [
                [sorted(p for p in head if p >= 0) for head in c.positions(i)[0].tolist()] for i in range(len(c.layers))
            ],
            extra_bytes=lambda c: c.state_nbytes(),
        )

    def ask(self, method: str, context: str, question: str, budget: int, max_new_tokens: int) -> dict[str, Any]:
        """``kvsieve.compress`` (the chat template, ``decode_budget=None``) of ``context`` to ``budget`` tokens under
        the policy spec ``method``, then ``ask(question)``, greedy."""
        from kvsieve.qa import compress

        qa = compress(self.model, load_tokenizer(self.model), context, method, budget)
        with greedy_tokens(self.model) as tokens:
            answer = qa.ask(question, max_new_tokens=max_new_tokens, batch_size=1)
        return answer_reply(answer, tokens, qa.context_ids[0].tolist(), qa.question_ids(question)[0].tolist())


SIDES = {"kvsieve": KvsieveSide, "kvpress": KvpressSide}


def versions(side: str) -> dict[str, str]:
    """The versions that matter for the side's figures."""
    import importlib.metadata

    import transformers

    library = importlib.metadata.version(side)
    return {side: library, "torch": torch.__version__, "transformers": transformers.__version__}


class Worker:
    """One side's model, prompt and methods (see the module docstring)."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.name = request["side"]
        if self.name not in SIDES:
            raise ValueError(f"unknown side {self.name!r}; expected one of {', '.join(SIDES)}")
        self.model = load(request["model"], request["threads"])
        self.side = SIDES[self.name](self.model, request["compression_ratio"])
        self.ids, self.budget = torch.tensor([request.get("ids", [])], dtype=torch.long), request.get("budget", 0)
        if request.get("methods"):
            self.warm_up(request["methods"], request["warmup"])
        self.run: Measurement | None = None

    def warm_up(self, methods: list[str], tokens: int) -> None:
        """Each method's run on the first ``tokens`` of the prompt, two decode steps, untimed."""
        warm = self.ids[:, :tokens]
        warm_budget = max(1, self.budget * warm.shape[1] // self.ids.shape[1])
        for method in methods:
            run = Measurement(self.model, self.side.setup(method, warm, warm_budget, False), warm, kept=False)
            run.step()
            run.step()

    def hello(self) -> dict[str, Any]:
        return {"side": self.name, "versions": versions(self.name), "threads": torch.get_num_threads()}

    def answer(self, command: dict[str, Any]) -> dict[str, Any]:
        """``start`` a method's run (its prefill), ``step`` it once, ``finish`` it (its result), or ``ask`` a question
        of a context."""
        match command["do"]:
            case "start":
                setup = self.side.setup(command["method"], self.ids, self.budget, command["kept"])
                self.run = Measurement(self.model, setup, self.ids, command["kept"])
                return {"prefill_s": self.run.prefill_s}
            case "step":
                self.run.step()
                return {}
            case "finish":
                result, self.run = self.run.result(), None
                return result
            case "ask":
                keys = ("method", "context", "question", "budget", "max_new_tokens")
                return self.side.ask(*(command[key] for key in keys))
            case "ruler":
                from kvpress_ruler import answer_sample  # (scripts/kvpress_ruler.py: a RULER sample, by ids)

                return answer_sample(self.name, self.model, command)
        raise ValueError(f"unknown command {command['do']!r}; expected start, step, finish, ask or ruler")


def serve(lines: Iterable[str], out: TextIO) -> None:
    """Answer the setup line, then each command line, one JSON line each, flushed."""
    worker = None
    for line in lines:
        request = json.loads(line)
        if worker is None:
            worker = Worker(request)
            reply = worker.hello()
        else:
            reply = worker.answer(request)
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main() -> None:
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
