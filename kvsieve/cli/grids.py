"""The ``kvsieve`` commands that run grids of cells into an output directory, resumable, locally or on Ray:
``sweep``, ``ruler`` and ``reproduce``. Each takes the parsed arguments and returns its result as a dict."""

from __future__ import annotations

import argparse
from typing import Any

from kvsieve.cli.arguments import policy_spec


def _ray_options(args: argparse.Namespace) -> Any:
    """``--ray`` and its options as :class:`~kvsieve.evaluation.ray_sweep.RayOptions` (None without ``--ray``)."""
    given = {
        name: value
        for name, value in (
            ("cpus_per_cell", args.cpus_per_cell),
            ("gpus_per_cell", args.gpus_per_cell),
            ("max_retries", args.max_retries),
        )
        if value is not None
    }
    if args.ray is None:
        if given:
            raise ValueError(f"--{next(iter(given)).replace('_', '-')} needs --ray")
        return None
    from kvsieve.evaluation.ray_sweep import RayOptions, require_ray

    require_ray()
    return RayOptions(address=args.ray, **given)


def cmd_sweep(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.evaluation import sweep

    result = sweep.run_sweep(
        args.out,
        args.tasks,
        [policy_spec(args, policy) for policy in args.policies or sweep.DEFAULT_POLICIES],
        args.budgets or sweep.DEFAULT_BUDGETS,
        settings=sweep.Settings(
            model=args.model,
            limit=args.limit,
            protocol=args.protocol,
            question=args.question,
            ppl_tokens=args.ppl_tokens,
            dtype=args.dtype,
        ),
        jobs=args.jobs,
        threads=args.threads,
        device=args.device,
        progress=not args.json,
        compute=not args.report,
        ray=_ray_options(args),
    )
    return {"computed": result.computed, "files": result.files, "rows": result.rows, "table": result.table}


def cmd_ruler(args: argparse.Namespace) -> dict[str, Any]:
    """With ``--ray`` the samples are Ray tasks, each with ``--cpus-per-cell`` threads (``--threads`` is refused), on
    the workers' ``--device``; this process loads only the tokenizer (the samples' lengths and prompts). Samples
    that failed on Ray: the report of the rest is written, then a one-line error names them."""
    import torch

    from kvsieve.evaluation.defaults import QUESTION_MODES
    from kvsieve.models import load_model, load_tokenizer, resolve_dtype
    from kvsieve.ruler import run
    from kvsieve.ruler.report import write_report

    quick = run.QUICK if args.quick else {}
    ray = _ray_options(args)
    if ray is not None and args.threads:
        raise ValueError("with Ray, each sample is a task with --cpus-per-cell threads: give --threads without it")
    failed = None
    if not args.report:
        if args.threads:
            torch.set_num_threads(args.threads)
        policies = args.policies or quick.get("policies") or run.default_policies()
        settings = run.grid_settings(
            [policy_spec(args, p) for p in policies],
            args.compressions or quick.get("compressions", run.DEFAULT_COMPRESSIONS),
            args.protocols or QUESTION_MODES,
        )
        tasks = args.tasks or list(run.TASKS)
        haystack = run.haystack_name(args.file)  # (a missing --file fails before the model loads)
        if ray is None:
            model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
        else:  # (this process answers nothing: the workers load the model, this one its tokenizer)
            model, tokenizer = None, load_tokenizer(args.model)
        grid = run.GridSettings(
            model=args.model,
            dtype=str(resolve_dtype(args.dtype)).removeprefix("torch."),
            seed=args.seed,
            haystack=haystack,
            chat_template=not args.no_chat_template,
            generator=args.generator,
        )
        try:
            run.run_ruler(
                model,
                tokenizer,
                args.out,
                lambda: run.sources(args.file, with_reading="qa" in tasks, generator=args.generator),
                grid,
                tasks=tasks,
                lengths=args.lengths or quick.get("lengths", run.DEFAULT_LENGTHS),
                settings=settings,
                samples=args.samples or quick.get("samples", run.DEFAULT_SAMPLES),
                progress=not args.json,
                ray=ray,
                device=args.device,
                kv_memory=None if args.kv_memory_gb is None else int(args.kv_memory_gb * 2**30),
            )
        except run.SamplesFailed as err:
            failed = err
    result = write_report(args.out, title=f"RULER, {args.model}")
    if failed is not None:
        raise ValueError(str(failed))
    return result


def cmd_reproduce(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.reproduce.runner import reproduce

    return reproduce(
        args.paper,
        args.out,
        quick=args.quick,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        compute=not args.report,
        progress=not args.json,
        ray=_ray_options(args),
    )
