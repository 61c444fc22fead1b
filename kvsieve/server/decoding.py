"""Per request: the next token from the logits (greedy, or temperature / top-p sampling with a seed), the tokens'
log-probabilities, and the text so far (incremental detokenization that holds back what may still become a stop
string)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase


class Sampler:
    """Greedy when ``temperature`` is 0 (the argmax, as ``model.generate``), else sampling from the softmax of
    ``logits / temperature`` restricted to the smallest set of tokens whose probability reaches ``top_p``.

    Before either, as vLLM: ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of the
    tokens of the prompt and of the output so far; ``frequency_penalty`` is subtracted once per occurrence of a token
    in the output, ``presence_penalty`` once if it occurs; the ``suppressed`` tokens (EOS, stop token ids) cannot be
    chosen before ``min_tokens`` tokens. Each call records the chosen token as output."""

    def __init__(
        self,
        temperature: float,
        top_p: float,
        seed: int | None,
        *,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        prompt: Sequence[int] = (),
        min_tokens: int = 0,
        suppressed: Sequence[int] = (),
    ) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.presence, self.frequency, self.repetition = presence_penalty, frequency_penalty, repetition_penalty
        self.prompt, self.min_tokens, self.suppressed = list(prompt), min_tokens, sorted(set(suppressed))
        self.output: list[int] = []
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` ``[vocab]`` (fp32)."""
        logits = self.adjust(logits)
        if self.temperature == 0:
            token = int(logits.argmax())
        else:
            probs = (logits.cpu() / self.temperature).softmax(dim=-1)
            if self.top_p < 1:
                sorted_probs, order = probs.sort(descending=True)
                outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p  # (the first token always stays)
                probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0))
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.output.append(token)
        return token

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` after the penalties and the suppression (the same tensor when none applies)."""
        suppress = self.suppressed if len(self.output) < self.min_tokens else []
        if self.repetition == 1 and not (self.presence or self.frequency) and not suppress:
            return logits
        logits = logits.clone()
        if self.repetition != 1:
            seen = torch.tensor(sorted({*self.prompt, *self.output}), dtype=torch.long, device=logits.device)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / self.repetition, values * self.repetition)
        if (self.presence or self.frequency) and self.output:
            counts = torch.bincount(torch.tensor(self.output), minlength=logits.shape[-1]).to(logits)
            logits -= self.frequency * counts + self.presence * (counts > 0).to(logits)
        if suppress:
            logits[torch.tensor(suppress, device=logits.device)] = -torch.inf
        return logits


MIN_LOGPROB = -9999.0
"""Log-probabilities are reported at least this (JSON has no -inf; vLLM's floor)."""
SCORE_ROWS = 256
"""Positions whose log-softmax is computed at once (a long prompt's ``[L, vocab]`` in pieces)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (its raw logits, before temperature and top-p) and the ``k`` most
    likely tokens at its position with theirs, most likely first. ``logprob`` is None for a prompt's first token."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Each of ``tokens`` scored by the logits row before it (``logits`` ``[len(tokens), vocab]``), with the top
    ``k`` at each position."""
    if len(tokens) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(tokens)} tokens")
    scored: list[TokenLogprob] = []
    for start in range(0, len(tokens), SCORE_ROWS):
        rows = logits[start : start + SCORE_ROWS].float().log_softmax(-1).clamp(min=MIN_LOGPROB)
        targets = torch.tensor(tokens[start : start + SCORE_ROWS], device=rows.device)
        chosen = rows.gather(-1, targets[:, None])[:, 0].tolist()
        values, ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
        for token, logprob, top_ids, top_values in zip(
            targets.tolist(), chosen, ids.tolist(), values.tolist(), strict=True
        ):
            scored.append(TokenLogprob(token, logprob, tuple(zip(top_ids, top_values, strict=True))))
    return scored


class TextStream:
    """The text of the generated tokens, handed out in pieces: a piece never ends inside a character still being
    spelled by the next token (``\\ufffd``) nor with what may be the start of a stop string; the text ends before the
    first stop string. As vLLM, stop strings are looked for once ``min_tokens`` tokens are out: one that ended before
    does not count (one that ends after does, wherever it began)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop: list[str], lock: threading.Lock, min_tokens: int = 0
    ) -> None:
        self.tokenizer, self.stop, self.lock, self.min_tokens = tokenizer, stop, lock, min_tokens
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.before = 0  # the text's length when stop strings were last not looked for (before min_tokens)

    def push(self, token: int) -> tuple[str, bool]:
        """Add a generated token: the new text that is safe to send, and whether a stop string was reached."""
        self.ids.append(token)
        with self.lock:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(self.ids) < self.min_tokens:
            self.before, hits = len(text), []
        else:
            hits = [i for i in (text.find(s, max(0, self.before - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            self.text = text[: min(hits)]
            return self.flush(), True
        self.text = text
        ready = len(text.rstrip("\ufffd"))
        held = max((_overlap(text[:ready], s) for s in self.stop), default=0)
        return self._take(ready - held), False

    def flush(self) -> str:
        """Everything not sent yet (the generation ended)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that starts ``stop`` (shorter than ``stop``): held back."""
    return next((k for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), 0)
