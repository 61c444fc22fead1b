"""Eviction policies, one file each: a ``@register``-decorated subclass of :class:`Policy`, and its module's name
in :data:`MODULES` (in the order ``kvsieve policies`` lists them).

Wherever a policy is named (``make_cache``, the CLI's ``--policy``/``--policies``, sweeps, lm-eval's
``policy=``), a *policy spec* may carry parameters: ``"ahakv:sgs=false,recent=16"`` is ``ahakv`` with those
parameters, the key ``schedule`` sets the layer budget schedule (``"scissorhands:schedule=increasing"``), the key
``heads`` how a layer's budget is shared among its KV heads (``"snapkv:heads=adakv"``: AdaKV's budgets by head, with
its parameter ``safeguard``; see :mod:`kvsieve.policies.adakv`) and the keys ``kv_bits``, ``group_size``,
``residual`` quantize the slots (``"h2o:kv_bits=4"``, see :mod:`kvsieve.engine.quant`), so ablations are named
cells of one grid.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvsieve.engine.quant import QUANT_KEYS
from kvsieve.engine.schedules import SCHEDULES
from kvsieve.policies.adakv import HEAD_RULES, adaptive
from kvsieve.policies.base import REGISTRY, Asking, NoParams, Observation, Policy, Slots

MODULES = (
    "full",
    "local",
    "streaming_llm",
    "h2o",
    "scissorhands",
    "ahakv",
    "strided",
    "fixed",
    "heavy",
    "random",
    "tova",
    "snapkv",
    "knorm",
    "topk_oracle",
    "kvzip",
    "keydiff",
    "expected_attention",
    "rkv",
)
for _module in MODULES:
    importlib.import_module(f"{__name__}.{_module}")  # (each module registers its policy)


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"ahakv:sgs=false,recent=16"`` → ``("ahakv", {"sgs": "false", "recent": "16"})`` (values as text)."""
    name, _, rest = spec.partition(":")
    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or key.strip() in params:
            raise ValueError(f"bad policy spec {spec!r}: expected name:key=value,key=value (each key once)")
        params[key.strip()] = value.strip()
    return name.strip(), params


def join_spec(name: str, params: dict[str, Any]) -> str:
    """``("h2o", {"kv_bits": 4})`` → ``"h2o:kv_bits=4"``: the spec :func:`split_spec` splits (a bare name without
    parameters)."""
    return ":".join([name, ",".join(f"{key}={value}" for key, value in params.items())]) if params else name


def with_spec_keys(spec: str, keys: dict[str, Any], given_as: str = "separately") -> str:
    """``spec`` with ``keys`` added (``"ahakv:sgs=false"`` + ``{"kv_bits": 4}`` → ``"ahakv:sgs=false,kv_bits=4"``);
    a key already in ``spec`` is an error saying it was also given ``given_as``."""
    if not keys:
        return spec
    name, params = split_spec(spec)
    twice = sorted(params.keys() & keys.keys())
    if twice:
        raise ValueError(f"{', '.join(twice)} given both in {spec!r} and {given_as}")
    return join_spec(name, {**params, **keys})


def get_policy(name: str | type[Policy], heads: str | None = None) -> type[Policy]:
    """The policy class registered under ``name`` or named by a policy spec (a class is returned as is, unless
    ``heads`` says otherwise), with the spec's ``heads`` key (or ``heads``) applied: ``adakv`` gives
    :func:`~kvsieve.policies.adakv.adaptive`'s class."""
    if isinstance(name, type) and issubclass(name, Policy):
        cls = name
    else:
        name, params = split_spec(name)
        heads = params.get("heads", heads)
        try:
            cls = REGISTRY[name]
        except KeyError:
            raise ValueError(f"unknown policy {name!r}; available: {', '.join(REGISTRY)}") from None
    if heads not in (None, *HEAD_RULES):
        raise ValueError(f"unknown heads rule {heads!r}; available: {', '.join(HEAD_RULES)}")
    return adaptive(cls) if heads == "adakv" and not cls.allocates_heads else cls


def resolve_spec(
    policy: str | type[Policy], policy_kwargs: dict[str, Any] | None = None, schedule: Any = "uniform"
) -> tuple[type[Policy], dict[str, Any], Any, dict[str, Any]]:
    """The policy class, its parameters (typed, checked), the layer schedule and the slot quantization's keys
    (:data:`~kvsieve.engine.quant.QUANT_KEYS`, values as given) of ``policy`` (a name, a spec or a class) with
    ``policy_kwargs`` added: a key given both ways is an error; a spec's ``schedule`` replaces the default
    ``schedule``."""
    from_spec = split_spec(policy)[1] if isinstance(policy, str) else {}
    kwargs = dict(policy_kwargs or {})
    if "heads" in from_spec and "heads" in kwargs:
        raise ValueError(f"policy parameter(s) heads given both in {policy!r} and separately")
    cls = get_policy(policy, from_spec.pop("heads", None) or kwargs.pop("heads", None))
    if "schedule" in from_spec:
        schedule = from_spec.pop("schedule")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown layer schedule {schedule!r} in {policy!r}; available: {', '.join(SCHEDULES)}")
    twice = sorted(from_spec.keys() & kwargs.keys())
    if twice:
        raise ValueError(f"policy parameter(s) {', '.join(twice)} given both in {policy!r} and separately")
    quant = {key: source.pop(key) for source in (from_spec, kwargs) for key in QUANT_KEYS if key in source}
    return cls, cls.parse_params(**from_spec, **kwargs), schedule, quant


__all__ = [
    "MODULES",
    "REGISTRY",
    "Asking",
    "NoParams",
    "Observation",
    "Policy",
    "Slots",
    "get_policy",
    "join_spec",
    "resolve_spec",
    "split_spec",
    "with_spec_keys",
]
