"""Eviction policies, one file each: a ``@register``-decorated subclass of :class:`Policy`, and its module's name
in :data:`MODULES` (in the order ``kvsieve policies`` lists them)."""

from __future__ import annotations

import importlib

from kvsieve.policies.base import REGISTRY, NoParams, Observation, Policy, Slots

MODULES = (
    "full",
    "local",
    "streaming_llm",
    "h2o",
    "scissorhands",
    "ahakv",
    "strided",
    "fixed",
    "random",
    "tova",
    "snapkv",
    "knorm",
    "topk_oracle",
)
for _module in MODULES:
    importlib.import_module(f"{__name__}.{_module}")  # (each module registers its policy)


def get_policy(name: str | type[Policy]) -> type[Policy]:
    """The policy class registered under ``name`` (a class is returned as is)."""
    if isinstance(name, type) and issubclass(name, Policy):
        return name
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(REGISTRY)}") from None


__all__ = ["MODULES", "REGISTRY", "NoParams", "Observation", "Policy", "Slots", "get_policy"]
