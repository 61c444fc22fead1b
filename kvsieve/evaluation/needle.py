"""Long-context retrieval: a passkey hidden in a real Wikipedia haystack (RULER-style, synthetic by design).

For each context length × needle depth, a random 5-digit passkey sentence is inserted at that depth of a
haystack of real prose cut to the length; the model is asked for the key at the end and answers greedily under
the policy. Exact match: the first number in the answer equals the key. Trials use distinct keys and haystack
offsets (seeded), so the grid is reproducible.

Two protocols (``question``, see :data:`~kvsieve.evaluation.defaults.QUESTION_MODES`):

- ``aware`` (the default): the whole prompt, haystack and question, is compressed to the budget in one forward pass
  (:func:`kvsieve.generate`; a ratio is of the whole prompt), and the answer is decoded under eviction within it;
- ``agnostic``: the haystack is compressed before the question is known (:func:`kvsieve.compress` with
  ``chat_template=False``: the same plain prompt text; a ratio is of the haystack part), then the question is fed to
  the compressed cache and the answer decoded without eviction (kvpress's protocol). The split: the question part
  starts with the whitespace the haystack ends with, so both parts tokenize exactly as the whole prompt does.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.api import generate
from kvsieve.engine.budget import Budget
from kvsieve.evaluation.defaults import DEFAULT_QUESTION, check_question
from kvsieve.evaluation.plots import pyplot, save_figure
from kvsieve.qa import compress

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer: the pass key is number"


@dataclass
class NeedleCell:
    length: int
    depth: float
    trials: int
    correct: int
    answers: list[str]

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"accuracy": self.accuracy}


def build_prompt(
    tokenizer: PreTrainedTokenizerBase, haystack_ids: list[int], length: int, depth: float, key: int, offset: int
) -> str:
    """A prompt of about ``length`` tokens: haystack prose with the needle at ``depth`` (0 = start, 1 = end)."""
    needle = tokenizer(" " + NEEDLE.format(key=key) + " ", add_special_tokens=False).input_ids
    question = tokenizer("\n\n" + QUESTION, add_special_tokens=False).input_ids
    fill = length - len(needle) - len(question)
    if fill < 8:
        raise ValueError(f"context length {length} is too short for the needle and the question")
    if offset + fill > len(haystack_ids):
        raise ValueError(f"the haystack has {len(haystack_ids)} tokens, {offset + fill} needed")
    hay = haystack_ids[offset : offset + fill]
    cut = round(depth * fill)
    return tokenizer.decode(hay[:cut] + needle + hay[cut:] + question)


def split_question(prompt: str) -> tuple[str, str]:
    """A :func:`build_prompt` prompt's haystack part and its question part (with the whitespace before it)."""
    if not prompt.endswith(QUESTION):
        raise ValueError("not a passkey prompt: it does not end with the question")
    context = prompt[: len(prompt) - len(QUESTION)].rstrip()
    return context, prompt[len(context) :]


def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    policy: str,
    budget: Budget,
    question: str = DEFAULT_QUESTION,
    max_new_tokens: int = 8,
    **policy_kwargs: Any,
) -> str:
    """The greedy answer to a passkey ``prompt`` under ``policy`` at ``budget`` in the ``question`` protocol."""
    if question == "agnostic":
        context, asked = split_question(prompt)
        qa = compress(model, tokenizer, context, policy, budget, chat_template=False, **policy_kwargs)
        return qa.ask(asked, max_new_tokens=max_new_tokens)
    kwargs = {"policy_kwargs": policy_kwargs, "max_new_tokens": max_new_tokens}
    return generate(model, tokenizer, prompt, policy=policy, budget=budget, **kwargs).text.strip()


def run_needle(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    haystack: str,
    lengths: Sequence[int] = (512, 1024, 2048),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    trials: int = 3,
    policy: str = "h2o",
    budget: Budget = 0.2,
    seed: int = 0,
    progress: bool = True,
    question: str = DEFAULT_QUESTION,
    **policy_kwargs: Any,
) -> list[NeedleCell]:
    """Accuracy of passkey retrieval for each (length, depth) under ``policy`` at ``budget``, the haystack compressed
    with the question (``question="aware"``) or before it (``"agnostic"``, see the module docs)."""
    check_question(question)
    if trials <= 0 or not lengths or not depths:
        raise ValueError("need at least one length, one depth and one trial")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be in [0, 1], got {list(depths)}")
    cells = []
    total = len(lengths) * len(depths) * trials
    with tqdm(total=total, desc=f"needle {policy} ({question})", disable=not progress, leave=False) as bar:
        grid = passkey_prompts(tokenizer, haystack, lengths, depths, trials, seed)
        for i, (length, depth, key, prompt) in enumerate(grid):
            if i % trials == 0:
                cells.append(NeedleCell(length, depth, trials, 0, []))
            with torch.inference_mode():
                text = answer(model, tokenizer, prompt, policy, budget, question, **policy_kwargs)
            cells[-1].correct += passkey_found(text, key)
            cells[-1].answers.append(text)
            bar.update()
    return cells


def passkey_prompts(
    tokenizer: PreTrainedTokenizerBase,
    haystack: str,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    seed: int = 0,
) -> Iterator[tuple[int, float, int, str]]:
    """``(length, depth, key, prompt)`` of each trial of the grid, length by length, depth by depth: distinct keys
    and haystack offsets drawn from ``seed``."""
    haystack_ids = tokenizer(haystack, add_special_tokens=False).input_ids
    rng = random.Random(seed)
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                key = rng.randrange(10000, 100000)
                offset = rng.randrange(0, max(1, len(haystack_ids) - length))
                yield length, depth, key, build_prompt(tokenizer, haystack_ids, length, depth, key, offset)


def passkey_found(answer: str, key: int) -> bool:
    """Exact match: the first number in ``answer`` is ``key``."""
    found = re.search(r"\d+", answer)
    return found is not None and int(found.group()) == key


def plot_needle(cells: Sequence[NeedleCell], path: str | Path, title: str = "") -> Path:
    """Heat map of accuracy: context length (rows) × needle depth (columns)."""
    plt = pyplot()
    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    grid = [[next(c.accuracy for c in cells if c.length == n and c.depth == d) for d in depths] for n in lengths]
    fig, ax = plt.subplots(figsize=(1.2 * len(depths) + 2, 0.8 * len(lengths) + 1.5))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context tokens")
    for i, row in enumerate(grid):
        for j, acc in enumerate(row):
            ax.text(j, i, f"{acc:.0%}", ha="center", va="center", fontsize=9)
    fig.colorbar(im, ax=ax, label="exact match")
    if title:
        ax.set_title(title)
    return save_figure(fig, path)
