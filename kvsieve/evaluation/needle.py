"""Long-context retrieval: a passkey hidden in a real Wikipedia haystack (RULER-style, synthetic by design).

For each context length × needle depth, a random 5-digit passkey sentence is inserted at that depth of a
haystack of real prose cut to the length; the model is asked for the key at the end and answers greedily under
the policy. Exact match: the first number in the answer equals the key. Trials use distinct keys and haystack
offsets (seeded), so the grid is reproducible.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.api import generate
from kvsieve.engine.budget import Budget
from kvsieve.evaluation.plots import pyplot, save_figure

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
    **policy_kwargs: Any,
) -> list[NeedleCell]:
    """Accuracy of passkey retrieval for each (length, depth) under ``policy`` at ``budget``."""
    if trials <= 0 or not lengths or not depths:
        raise ValueError("need at least one length, one depth and one trial")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be in [0, 1], got {list(depths)}")
    haystack_ids = tokenizer(haystack, add_special_tokens=False).input_ids
    rng = random.Random(seed)
    cells = []
    total = len(lengths) * len(depths) * trials
    with tqdm(total=total, desc=f"needle {policy}", disable=not progress, leave=False) as bar:
        for length in lengths:
            for depth in depths:
                answers, correct = [], 0
                for _ in range(trials):
                    key = rng.randrange(10000, 100000)
                    offset = rng.randrange(0, max(1, len(haystack_ids) - length))
                    prompt = build_prompt(tokenizer, haystack_ids, length, depth, key, offset)
                    with torch.inference_mode():
                        out = generate(
                            model,
                            tokenizer,
                            prompt,
                            policy=policy,
                            budget=budget,
                            max_new_tokens=8,
                            policy_kwargs=policy_kwargs,
                        )
                    found = re.search(r"\d+", out.text)
                    correct += int(found is not None and int(found.group()) == key)
                    answers.append(out.text.strip())
                    bar.update()
                cells.append(NeedleCell(length, depth, trials, correct, answers))
    return cells


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
