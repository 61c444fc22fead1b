"""The parsed arguments of the ``kvsieve`` commands turned into what the library takes: policy specs with the
quantization options, checked policy parameters, the model, the text."""

from __future__ import annotations

import argparse
from typing import Any


def quant_keys(args: argparse.Namespace) -> dict[str, int]:
    """``--kv-bits``, ``--group-size`` and ``--kv-residual`` as policy-spec keys (checked; none given: ``{}``)."""
    from kvsieve.engine.quant import kv_quant

    options = (("kv_bits", args.kv_bits), ("group_size", args.group_size), ("residual", args.kv_residual))
    given = {key: value for key, value in options if value is not None}
    if given and args.kv_bits is None:
        raise ValueError("--group-size and --kv-residual apply to quantized slots only: give --kv-bits too")
    kv_quant(**given)
    return given


def policy_spec(args: argparse.Namespace, policy: str | None = None) -> str:
    """``policy`` (default ``--policy``) as a spec with the quantization options added (see :func:`quant_keys`)."""
    from kvsieve.policies import with_spec_keys

    return with_spec_keys(policy or args.policy, quant_keys(args), "as --kv-bits/--group-size/--kv-residual")


def policy_specs(args: argparse.Namespace) -> list[str]:
    """``--policies``, each with the quantization options added (see :func:`quant_keys`)."""
    return [policy_spec(args, policy) for policy in args.policies]


def checked_params(args: argparse.Namespace) -> dict[str, Any]:
    """The ``-p`` parameters checked and typed by ``--policy``'s ``Params`` (with the spec's own, if ``--policy``
    is a spec): called before any model loads."""
    from kvsieve.policies import get_policy, resolve_spec

    resolve_spec(policy_spec(args), dict(args.param))
    return get_policy(args.policy).parse_params(**dict(args.param))


def load_model_of(args: argparse.Namespace):
    from kvsieve.models import load_model

    return load_model(args.model, device=args.device, dtype=args.dtype)


def text_of(args: argparse.Namespace) -> str:
    from kvsieve.data import builtin_text, read_text

    if args.file:
        return read_text(args.file)
    # One real article long enough for the requested tokens (~4 characters per token, with margin).
    return builtin_text(min_chars=args.max_tokens * 6)
