"""The ``kvsieve`` commands: each takes the parsed arguments and returns its result as a dict (printed as text, or
as JSON with ``--json``). Heavy modules are imported inside the commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvsieve.cli.arguments import checked_params, load_model_of, policy_spec, policy_specs, quant_keys, text_of
from kvsieve.cli.grids import cmd_reproduce, cmd_ruler, cmd_sweep


def cmd_data(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from kvsieve.evaluation.defaults import DEFAULT_MODEL
    from kvsieve.pieces import DATA_PIECES, fetch

    def bar(names: list[str]) -> Iterator[str]:
        with tqdm(names, desc="kvsieve data", unit="piece", disable=args.json) as shown:
            for name in shown:
                shown.set_postfix_str(name)
                yield name

    models = args.models or ([] if args.only else [DEFAULT_MODEL])
    rows = fetch([*models, *(args.only or DATA_PIECES)], progress=bar)
    return {"pieces": [asdict(row) for row in rows], "missing": [r.piece for r in rows if r.error is not None]}


def cmd_policies(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.policies import REGISTRY

    return {"policies": [cls.info() for cls in REGISTRY.values()]}


def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.api import generate
    from kvsieve.data import read_text

    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of PROMPT or --prompt-file")
    policy_kwargs = checked_params(args)
    prompt = read_text(args.prompt_file) if args.prompt_file else args.prompt
    model, tokenizer = load_model_of(args)
    out = generate(
        model,
        tokenizer,
        prompt,
        policy=policy_spec(args),
        budget=args.budget,
        max_new_tokens=args.max_new_tokens,
        policy_kwargs=policy_kwargs,
        schedule=args.schedule,
    )
    return {
        "policy": policy_spec(args),
        "budget_tokens": out.budget_tokens,
        "prompt_tokens": out.prompt_tokens[0],
        "generated_tokens": out.generated_tokens[0],
        "text": out.text,
        "kv_slots_max": max(out.cache.slot_counts()),
        "kv_bytes": out.cache.kv_nbytes(),
        "state_bytes": out.cache.state_nbytes(),
    }


def cmd_ask(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.data import read_text
    from kvsieve.qa import compress, load_context

    if any(not q.strip() for q in args.question):
        raise ValueError("every --question must be non-empty")
    if args.load:
        if quant_keys(args):
            raise ValueError("a saved context keeps the quantization it was compressed with: drop --kv-bits")
        if not Path(args.load).is_file():
            raise FileNotFoundError(f"no saved context at {args.load}")
        model, tokenizer = load_model_of(args)
        qa = load_context(args.load, model, tokenizer)
    else:
        policy_kwargs = checked_params(args)
        context = read_text(args.context)
        model, tokenizer = load_model_of(args)
        qa = compress(
            model,
            tokenizer,
            context,
            policy=policy_spec(args),
            budget=args.budget,
            decode_budget=args.decode_budget,
            schedule=args.schedule,
            **policy_kwargs,
        )
    saved = str(qa.save(args.save)) if args.save else None
    answers = qa.ask(args.question, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    return {
        "policy": qa.spec["policy"],
        "budget_tokens": qa.cache.budget_tokens,
        "decode_budget_tokens": qa.cache.decode_budget_tokens,
        "context_tokens": qa.context_tokens,
        "kv_slots_max": max(qa.cache.slot_counts()),
        "kv_bytes": qa.cache.kv_nbytes(),
        "saved": saved,
        "answers": [{"question": q, "answer": a} for q, a in zip(args.question, answers, strict=True)],
    }


def cmd_ppl(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.evaluation.perplexity import stream_perplexity

    policy, policy_kwargs = policy_spec(args), checked_params(args)
    text = text_of(args)
    model, tokenizer = load_model_of(args)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.max_tokens]
    result, _ = stream_perplexity(
        model,
        ids,
        policy,
        args.budget,
        prefill=args.prefill,
        engine=args.engine,
        progress=not args.json,
        rolling=args.rolling,
        curve_every=args.curve_every or (512 if args.plot else None),
        schedule=args.schedule,
        **policy_kwargs,
    )
    if args.plot:
        from kvsieve.evaluation.plots import plot_stream_curves

        plot_stream_curves([result], args.plot, title=f"{args.model}, rolling={args.rolling}")
    return {**result.to_dict(), "policy": policy}


def cmd_needle(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.data import builtin_text
    from kvsieve.evaluation.needle import plot_needle, run_needle

    policy_kwargs = checked_params(args)
    model, tokenizer = load_model_of(args)
    cells = run_needle(
        model,
        tokenizer,
        builtin_text(),
        lengths=args.lengths,
        depths=args.depths,
        trials=args.trials,
        policy=policy_spec(args),
        budget=args.budget,
        progress=not args.json,
        question=args.question,
        **policy_kwargs,
    )
    if args.plot:
        plot_needle(cells, args.plot, title=f"{policy_spec(args)}, budget {args.budget}, question-{args.question}")
    cells = [c.to_dict() for c in cells]
    return {"policy": policy_spec(args), "budget": args.budget, "question": args.question, "cells": cells}


def cmd_compare(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.engine.compiled import compilations
    from kvsieve.evaluation.compare import compare

    policies = policy_specs(args)
    text = text_of(args)
    model, tokenizer = load_model_of(args)
    compiled_before = compilations()
    rows = compare(
        model,
        tokenizer,
        text,
        policies=policies,
        budget=args.budget,
        max_tokens=args.max_tokens,
        sample_tokens=args.sample_tokens,
        progress=not args.json,
        schedule=args.schedule,
    )
    return {
        "model": args.model,
        "budget": args.budget,
        "rows": [r.to_dict() for r in rows],
        "kernels_compiled": compilations() - compiled_before,
    }


def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.benchmarks.bench import benchmark
    from kvsieve.benchmarks.grid import check_policies, pair_lengths
    from kvsieve.benchmarks.profile import PROFILE_PROMPT, profile_decode
    from kvsieve.benchmarks.runner import prompt_tokens

    lengths = pair_lengths(args.prompt_lens, args.gen_lens)
    policies = check_policies(policy_specs(args))
    profiled = check_policies([policy_spec(args, args.profile)])[0] if args.profile else None
    model, tokenizer = load_model_of(args)
    if profiled is not None:
        return {"profile": profile_decode(model, prompt_tokens(tokenizer, PROFILE_PROMPT), policy=profiled)}
    return benchmark(
        model,
        tokenizer,
        lengths=lengths,
        batches=args.batches,
        policies=policies,
        budget=args.budget,
        repeats=args.repeats,
        preset=args.preset,
        mem_cap_gb=args.mem_cap_gb,
        plot=args.plot,
        title=args.model,
    )


def cmd_xsum(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.evaluation.defaults import check_question
    from kvsieve.evaluation.lm_eval_model import KVSieveLM
    from kvsieve.evaluation.summarization import evaluate_xsum

    check_question(args.question, args.protocol)
    policy_kwargs = checked_params(args)
    model, tokenizer = load_model_of(args)
    lm = KVSieveLM(
        model=model,
        tokenizer=tokenizer,
        policy=policy_spec(args),
        budget=args.budget,
        protocol=args.protocol,
        question=args.question,
        batch_size=args.batch_size,
        **policy_kwargs,
    )
    result = evaluate_xsum(lm, args.limit, args.max_new_tokens, progress=not args.json).to_dict()
    samples = result.pop("samples")
    settings = {
        "policy": policy_spec(args),
        "budget": args.budget,
        "protocol": args.protocol,
        "question": args.question,
    }
    return {**settings, **result, "first": samples[0]}


def cmd_lm_eval(args: argparse.Namespace) -> dict[str, Any]:
    """lm-eval's own command line, with the ``kvsieve`` model registered and the offline task pack included."""
    from lm_eval.__main__ import cli_evaluate

    import kvsieve.evaluation.lm_eval_model  # noqa: F401  (registers --model kvsieve)
    from kvsieve.evaluation.tasks import PREFIX, ensure_task_pack, tasks_dir

    argv = list(args.lm_eval_args)
    if "--include_path" not in argv and (tasks_dir().exists() or any(PREFIX in a for a in argv)):
        argv += ["--include_path", str(ensure_task_pack())]
    saved, sys.argv = sys.argv, ["lm-eval", *lm_eval_batch_size(argv)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return {}


def lm_eval_batch_size(argv: list[str]) -> list[str]:
    """lm-eval's arguments with ``--batch_size`` defaulting to the kvsieve model's batch (lm-eval's own default is 1:
    batching requests under equal budgets changes no result, and amortizes the per-token work of the stream)."""
    from kvsieve.evaluation.defaults import DEFAULT_BATCH_SIZE

    given = any(a.startswith(("--batch_size", "-b", "--config")) for a in argv)
    return argv if given else [*argv, "--batch_size", str(DEFAULT_BATCH_SIZE)]


def cmd_analyze(args: argparse.Namespace) -> dict[str, Any]:
    from kvsieve.analysis import POLICY_ANALYSES
    from kvsieve.analysis.kept import policy_names
    from kvsieve.analysis.report import run_analysis

    options: dict[str, Any] = {}
    if args.analysis in POLICY_ANALYSES:  # (an unknown policy is an error before the model loads)
        options = {"policies": policy_names(args.policies), "budget": args.budget}
    text = text_of(args)
    model, tokenizer = load_model_of(args)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.max_tokens]
    about = {"model": args.model, "text": args.file or text.splitlines()[0].strip("= ")}
    out = args.out or f"out/analyze/{args.analysis}"
    return run_analysis(args.analysis, model, ids, out, progress=not args.json, about=about, **options)


def cmd_serve(args: argparse.Namespace) -> dict[str, Any]:
    """With ``--ray``, ``--replicas`` servers on Ray Serve behind one endpoint (:mod:`kvsieve.server.replicas`): this
    process loads no model."""
    try:
        import uvicorn

        from kvsieve.server.app import build_app
        from kvsieve.server.jobs import KVSpec
    except ImportError as err:
        missing = f"kvsieve serve needs the serve extra ({err.name} is missing)"
        raise ValueError(f"{missing}: pip install 'kvsieve[serve]'") from None
    import os

    from kvsieve.server.security import exposure_warning

    if args.schedule != "uniform":
        raise ValueError("the server shares budgets uniformly; a request may carry schedule= in its kv_policy spec")
    defaults = KVSpec(policy_spec(args), args.budget, checked_params(args))
    replicas = None
    ray_given = (args.ray, args.replicas, args.cpus_per_replica, args.gpus_per_replica)
    if any(value is not None for value in ray_given):
        from kvsieve.server.replicas import replica_options

        replicas = replica_options(args.ray, args.replicas, args.cpus_per_replica, args.gpus_per_replica, args.device)
    api_key = args.api_key or os.environ.get("KVSIEVE_API_KEY") or None
    warning = exposure_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    server = {  # (build_app's keyword arguments: a server in this process, or each replica on Ray)
        "model_name": args.served_name or args.model,
        "defaults": defaults,
        "kv_cap_bytes": int(args.kv_memory_gb * 2**30),
        "max_batch": args.max_batch,
        "max_queue": args.max_queue,
        "prefill_tokens": args.prefill_tokens,
        "api_key": api_key,
        "max_body_bytes": int(args.max_body_mb * 2**20),
    }
    if replicas is not None:
        from kvsieve.models import resolve_dtype
        from kvsieve.server.replicas import ReplicaSettings, model_path, serve_on_ray

        resolve_dtype(args.dtype)  # (checked here: the replicas load the model)
        settings = ReplicaSettings(
            model=model_path(args.model), server=server, device=args.device, dtype=args.dtype, threads=replicas.threads
        )
        serve_on_ray(replicas, settings, host=args.host, port=args.port)
        return {}
    model, tokenizer = load_model_of(args)
    app = build_app(model, tokenizer, **server)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return {}


COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "data": cmd_data,
    "policies": cmd_policies,
    "generate": cmd_generate,
    "ask": cmd_ask,
    "ppl": cmd_ppl,
    "compare": cmd_compare,
    "needle": cmd_needle,
    "bench": cmd_bench,
    "xsum": cmd_xsum,
    "sweep": cmd_sweep,
    "lm-eval": cmd_lm_eval,
    "ruler": cmd_ruler,
    "analyze": cmd_analyze,
    "reproduce": cmd_reproduce,
    "serve": cmd_serve,
}
