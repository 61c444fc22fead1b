"""Per request: the next token from the logits (greedy, or temperature / top-p sampling with a seed), and the text
so far (incremental detokenization that holds back what may still become a stop string)."""

from __future__ import annotations

import threading

import torch
from transformers import PreTrainedTokenizerBase


class Sampler:
    """Greedy when ``temperature`` is 0 (the argmax, as ``model.generate``), else sampling from the softmax of
    ``logits / temperature`` restricted to the smallest set of tokens whose probability reaches ``top_p``."""

    def __init__(self, temperature: float, top_p: float, seed: int | None) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` ``[vocab]`` (fp32)."""
        if self.temperature == 0:
            return int(logits.argmax())
        probs = (logits.cpu() / self.temperature).softmax(dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p  # (the first token always stays)
            probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0))
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextStream:
    """The text of the generated tokens, handed out in pieces: a piece never ends inside a character still being
    spelled by the next token (``\\ufffd``) nor with what may be the start of a stop string; the text ends before the
    first stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], lock: threading.Lock) -> None:
        self.tokenizer, self.stop, self.lock = tokenizer, stop, lock
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0

    def push(self, token: int) -> tuple[str, bool]:
        """Add a generated token: the new text that is safe to send, and whether a stop string was reached."""
        self.ids.append(token)
        with self.lock:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
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
