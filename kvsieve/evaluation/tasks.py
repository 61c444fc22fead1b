"""The offline task pack: six BIG-bench multiple-choice tasks and GEM XSum, as lm-evaluation-harness tasks, and
BIG-bench's squad_shifts reading-comprehension items (:func:`squad_shifts`).

Source: the ``bigbench==1.0.0`` sdist on PyPI (358 MB). Only the needed data files (``task.json`` files and
squad_shifts' SQuAD files) are extracted, in one pass over the tarball, into ``cache_dir()/"bigbench"``; the
tarball is deleted. Nothing is committed. The sdist is downloaded from its PyPI file URL (pinned SHA-256) because
pip >= 26.3 refuses to download it: pip prepares its metadata and rejects the direct-URL dependency
(``bleurt @ file://...``) it declares.

Each multiple-choice (sub)task becomes one lm-eval task (``kvsieve_<task>[_<subtask>]``) reading a local JSON
lines file (``dataset_path: json``), formatted as BIG-bench's own ``JsonTask`` does (``default_format_fn``: the
task's input/output/choice prefixes, choices appended to the input unless the task says otherwise, in BIG-bench's
seeded order; the subtask's ``task_prefix`` as the lm-eval description, shots separated by ``"\\n"``). Tasks with
subtasks (elementary_math_qa, cause_and_effect, goal_step_wikihow) are lm-eval groups named ``kvsieve_<task>``
whose ``acc``/``acc_norm`` are the size-weighted means of the subtasks (BIG-bench's task = the union of its
subtasks); shots are drawn from the same subtask, so every prompt has one format. Defaults: 5 shots
(``num_fewshot``), multiple_choice output, metrics ``acc`` and ``acc_norm``. Documents are shuffled once with a
fixed seed so that lm-eval's ``limit`` takes a random sample (several tasks are stored sorted).

The YAML configs are generated into ``cache_dir()/"lm_eval_tasks"`` (pass it as ``--include_path``).
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvsieve.fetch import FetchError, cache_dir, extract_members

BIGBENCH_URL = (
    "https://files.pythonhosted.org/packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721c157/"
    "bigbench-1.0.0.tar.gz"
)
BIGBENCH_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
TASKS_ROOT = "bigbench/benchmark_tasks"

MC_TASKS: dict[str, tuple[str, ...]] = {
    "elementary_math_qa": (
        "question_only",
        "question_with_language_hint",
        "question_with_mathematical_hint",
        "language_hint_only",
        "mathematical_hint_only",
    ),
    "cause_and_effect": ("one_sentence", "one_sentence_no_prompt", "two_sentences"),
    "social_iqa": (),
    "winowhy": (),
    "strategyqa": (),
    "goal_step_wikihow": ("goal_inference", "step_inference", "step_ordering"),
}
"""BIG-bench task → its subtasks (empty: the task has none)."""
XSUM = "gem/xsum"
SQUAD_SHIFTS = ("squaddev", "amazon_reviews", "reddit", "nyt", "new_wiki")
"""squad_shifts' sources (its subtasks), in BIG-bench's order."""
PREFIX = "kvsieve_"
NUM_FEWSHOT = 5
BIGBENCH_SEED = 42  # JsonTask's default random_seed (the order of the choices appended to the input)
SHUFFLE_SEED = 0
FORMAT_VERSION = 1  # bump when the generated configs or documents change
METRICS = ("acc", "acc_norm")


def bigbench_dir() -> Path:
    """Where the extracted ``task.json`` files live."""
    return cache_dir() / "bigbench"


def tasks_dir() -> Path:
    """Where the generated lm-eval task configs and their JSON lines data live (the ``--include_path``)."""
    return cache_dir() / "lm_eval_tasks"


def short_names() -> list[str]:
    """Every pack task and subtask by its short name (``social_iqa``, ``cause_and_effect_one_sentence``, ...)."""
    return [name for task, subs in MC_TASKS.items() for name in (task, *(f"{task}_{sub}" for sub in subs))]


def task_name(task: str) -> str:
    """The lm-eval name of a pack task or subtask: ``social_iqa`` → ``kvsieve_social_iqa`` (other names
    unchanged)."""
    return PREFIX + task if task in short_names() else task


def _units() -> list[tuple[str, str]]:
    """``(task, subtask)`` of every task.json that holds examples ("" = the task itself)."""
    return [(task, sub) for task, subs in MC_TASKS.items() for sub in (subs or ("",))]


def _member(task: str, sub: str = "") -> str:
    return "/".join(part for part in (TASKS_ROOT, task, sub, "task.json") if part)


def _squad_member(source: str) -> str:
    return f"{TASKS_ROOT}/squad_shifts/{source}_v{'1.1' if source == 'squaddev' else '1.0'}.json"


def _local(member: str) -> Path:
    return bigbench_dir() / member.removeprefix(TASKS_ROOT + "/")


def fetch_bigbench() -> dict[str, Path]:
    """Make sure the needed data files are cached; download the sdist once if any is missing."""
    members = [*(_member(task, sub) for task, sub in _units()), _member(XSUM), *map(_squad_member, SQUAD_SHIFTS)]
    wanted = {member: _local(member) for member in members}
    missing = {member: path for member, path in wanted.items() if not path.exists()}
    if missing:
        with tempfile.TemporaryDirectory(prefix="kvsieve-bigbench-") as tmp:
            archive = Path(tmp) / "bigbench-1.0.0.tar.gz"
            _download(BIGBENCH_URL, BIGBENCH_SHA256, archive)
            extract_members(archive, missing)
    return wanted


def _download(url: str, sha256: str, target: Path) -> None:
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=180) as response, open(target, "wb") as out:
            while block := response.read(1 << 20):
                digest.update(block)
                out.write(block)
    except OSError as err:
        raise FetchError(f"could not download {url} ({err}); run `kvsieve data` once with access to PyPI") from err
    if digest.hexdigest() != sha256:
        raise FetchError(f"{url} has SHA-256 {digest.hexdigest()}, expected {sha256}")


def format_examples(task_json: dict[str, Any]) -> list[dict[str, Any]]:
    """A BIG-bench multiple-choice ``task.json`` as documents ``{"query", "choices", "gold"}``.

    As BIG-bench's ``default_format_fn``: duplicates dropped; ``query`` = input prefix + input (+ the choices, each
    after the choice prefix, in the seeded order, unless ``append_choices_to_input`` is false) + output prefix;
    ``choices`` in the file's order; ``gold`` = the first choice with the highest score.
    """
    input_prefix = task_json.get("example_input_prefix", "\nQ: ")
    output_prefix = task_json.get("example_output_prefix", "\nA: ")
    choice_prefix = task_json.get("choice_prefix", "\n  choice: ")
    append = str(task_json.get("append_choices_to_input", True)).lower() == "true"
    seen: set[str] = set()
    docs = []
    for example in task_json["examples"]:
        key = json.dumps(example)
        if key in seen:
            continue
        seen.add(key)
        scores = example["target_scores"]
        choices = list(scores)
        text = example["input"]
        if append:
            order = np.random.RandomState(seed=BIGBENCH_SEED).permutation(sorted(choices))
            text += choice_prefix + choice_prefix.join(order)
        best = max(scores.values())
        docs.append(
            {
                "query": input_prefix + text + output_prefix,
                "choices": choices,
                "gold": next(i for i, c in enumerate(choices) if scores[c] == best),
            }
        )
    return docs


def _task_config(task: str, sub: str, data: Path, description: str) -> dict[str, Any]:
    return {
        "task": PREFIX + "_".join(part for part in (task, sub) if part),
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "fewshot_split": "test",
        "num_fewshot": NUM_FEWSHOT,
        "output_type": "multiple_choice",
        "description": description,
        "doc_to_text": "query",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "target_delimiter": "",
        "fewshot_delimiter": "\n",
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in METRICS],
        "metadata": {"version": 1.0, "source": f"bigbench==1.0.0 {_member(task, sub)}"},
    }


def _write(path: Path, text: str) -> None:
    """Write atomically (concurrent sweeps may build the pack at the same time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".partial", encoding="utf-8") as f:
        f.write(text)
    Path(f.name).replace(path)


def ensure_task_pack() -> Path:
    """Fetch the BIG-bench files and generate the task configs and data if needed; return :func:`tasks_dir`."""
    root = tasks_dir()
    stamp = root / "VERSION"
    if stamp.exists() and stamp.read_text() == f"{FORMAT_VERSION} {root}":
        return root
    files = fetch_bigbench()
    configs: list[dict[str, Any]] = []
    for task, sub in _units():
        task_json = json.loads(files[_member(task, sub)].read_text(encoding="utf-8"))
        docs = format_examples(task_json)
        random.Random(SHUFFLE_SEED).shuffle(docs)
        data = root / "data" / f"{task}{'_' + sub if sub else ''}.jsonl"
        _write(data, "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs))
        configs.append(_task_config(task, sub, data, str(task_json.get("task_prefix", ""))))
    for task, subs in MC_TASKS.items():
        if subs:
            configs.append(
                {
                    "group": PREFIX + task,
                    "task": [f"{PREFIX}{task}_{sub}" for sub in subs],
                    "aggregate_metric_list": [{"metric": m, "weight_by_size": True} for m in METRICS],
                    "metadata": {"version": 1.0},
                }
            )
    for config in configs:
        name = config.get("task") if "group" not in config else config["group"]
        _write(root / f"{name}.yaml", yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    _write(stamp, f"{FORMAT_VERSION} {root}")
    return root


def task_manager(tasks: list[str]):
    """An lm-eval ``TaskManager`` that knows the pack; lm-eval's own tasks are indexed only if ``tasks`` needs them
    (indexing them takes ~10-30 s)."""
    from lm_eval.tasks import TaskManager

    ours = all(name.startswith(PREFIX) for name in tasks)
    return TaskManager(include_path=str(ensure_task_pack()), include_defaults=not ours)


@dataclass(frozen=True)
class XSumExample:
    article: str
    summary: str


def load_xsum() -> list[XSumExample]:
    """The 1,001 GEM XSum articles with their reference summaries, in BIG-bench's order."""
    path = fetch_bigbench()[_member(XSUM)]
    examples = json.loads(path.read_text(encoding="utf-8"))["examples"]
    return [XSumExample(article=e["input"], summary=e["target"]) for e in examples]


@dataclass(frozen=True)
class ReadingItem:
    """A question on a passage with its acceptable answers; ``source``: its squad_shifts source."""

    passage: str
    question: str
    answers: tuple[str, ...]
    source: str


def squad_shifts() -> list[ReadingItem]:
    """BIG-bench's squad_shifts questions (48,201), source by source in :data:`SQUAD_SHIFTS` order, each in file order.

    The task has no ``task.json``: its ``task.py`` reads SQuAD v1.1-format files (articles → paragraphs with a
    ``context`` and ``qas``, each a ``question`` and crowd ``answers``) and builds its own prompt
    (``"Title: …\\nBackground: <context>\\nQ: <question>\\nA: "``), so passage and question are the separate
    fields, free of prefixes. As ``task.py``: one item per question (SQuAD's few repeated questions on a passage
    included), passage, question and answers stripped of surrounding whitespace. Answers are deduplicated in order,
    empty ones dropped, and so are questions left without an answer (none in 1.0.0). Not kept: the article title
    (a Wikipedia title, an NYT URL or a placeholder) and the answers' offsets.
    """
    files = fetch_bigbench()
    items = []
    for source in SQUAD_SHIFTS:
        articles = json.loads(files[_squad_member(source)].read_text(encoding="utf-8"))["data"]
        for paragraph in (paragraph for article in articles for paragraph in article["paragraphs"]):
            passage = paragraph["context"].strip()
            for qa in paragraph["qas"]:
                if answers := tuple(dict.fromkeys(text for a in qa["answers"] if (text := a["text"].strip()))):
                    items.append(ReadingItem(passage, qa["question"].strip(), answers, source))
    return items
