"""Eviction policies, one file each, registered by name."""

from __future__ import annotations

from kvsieve.policies.ahakv import AhaKV
from kvsieve.policies.base import NoParams, Observation, Policy, Slots
from kvsieve.policies.fixed import Fixed
from kvsieve.policies.full import Full
from kvsieve.policies.h2o import H2O
from kvsieve.policies.knorm import KNorm
from kvsieve.policies.local import Local
from kvsieve.policies.random import Random
from kvsieve.policies.scissorhands import Scissorhands
from kvsieve.policies.snapkv import SnapKV
from kvsieve.policies.streaming_llm import StreamingLLM
from kvsieve.policies.strided import Strided
from kvsieve.policies.topk_oracle import TopKOracle
from kvsieve.policies.tova import TOVA

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        Full,
        Local,
        StreamingLLM,
        H2O,
        Scissorhands,
        AhaKV,
        Strided,
        Fixed,
        Random,
        TOVA,
        SnapKV,
        KNorm,
        TopKOracle,
    )
}


def get_policy(name: str | type[Policy]) -> type[Policy]:
    """The policy class registered under ``name`` (a class is returned as is)."""
    if isinstance(name, type) and issubclass(name, Policy):
        return name
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(REGISTRY)}") from None


__all__ = ["REGISTRY", "NoParams", "Observation", "Policy", "Slots", "get_policy"]
