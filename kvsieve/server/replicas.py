"""``kvsieve serve --ray [ADDRESS] --replicas N``: N replicas of the server behind one OpenAI endpoint, on Ray Serve.

Each replica is a Ray Serve replica (an actor with ``--cpus-per-replica`` CPUs, also its torch threads, and
``--gpus-per-replica`` GPUs) that loads its own model and runs one :func:`~kvsieve.server.app.build_app`: its own
scheduler, KV admission under ``--kv-memory-gb`` and continuous batching. Ray Serve's HTTP proxy, one on the head
node at ``--host``:``--port``, routes each request to the less busy replica of two picked at random (on any node:
:data:`PROXY_ENV`) and streams the server-sent events through. Every response names the replica that answered in
the headers ``X-Kvsieve-Replica`` (Serve's replica id), ``X-Kvsieve-Replica-Pid`` and ``X-Kvsieve-Replica-Node``;
``/metrics`` and ``/health`` are those of the replica that answers them.

Ray is started or joined as ``kvsieve sweep --ray`` does (:func:`kvsieve.evaluation.ray_sweep.connect`): a new
local Ray without ADDRESS, else the cluster at ADDRESS, whose nodes need the same Python environment with kvsieve
and the model. A replica that dies is replaced by Serve. The requests it was running fail: an unstreamed one with
the proxy's 500 (the ``openai`` client sends it again, twice by default, and the router avoids the dead replica),
a stream with an OpenAI error event and ``[DONE]`` (:class:`EndCutStreams`, in the proxy). Ctrl-C (or SIGTERM)
deletes the application; a local Ray stops with this process.

Needs Ray Serve: ``pip install 'kvsieve[ray,serve]'``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsieve.evaluation.ray_sweep import RayOptions

# (This module is imported by Ray Serve's HTTP proxy for :func:`proxy_middlewares`: torch and Ray are imported
# inside the functions that need them.)

APP_NAME = "kvsieve"
PROXY_ENV = {
    # (Applied where this command starts Serve on the Ray: a Serve already running keeps its options.)
    # The proxy is the Serve controller's child and inherits its environment: it adds proxy_middlewares (below)
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": f"{__name__}.proxy_middlewares",
    # and routes by the replicas' load alone: preferring its own node's replicas, one proxy on the head would send
    # them everything until they refuse (max_ongoing_requests), leaving the other nodes' replicas idle
    "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
    "RAY_SERVE_PROXY_PREFER_LOCAL_AZ_ROUTING": "0",
}
REPLICA_HEADER = "x-kvsieve-replica"
PID_HEADER = "x-kvsieve-replica-pid"
NODE_HEADER = "x-kvsieve-replica-node"


@dataclass(frozen=True)
class ReplicaOptions:
    """Where the replicas run and what each one holds."""

    address: str = "local"
    """As :attr:`~kvsieve.evaluation.ray_sweep.RayOptions.address`: ``"local"`` or a cluster's address."""
    replicas: int = 1
    cpus_per_replica: float = 1.0
    """CPUs of a replica's actor, and its torch threads."""
    gpus_per_replica: float = 0.0
    """GPUs of a replica's actor (Ray sets its ``CUDA_VISIBLE_DEVICES``; a fraction shares a GPU)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        try:
            _ = self.ray  # (Ray's rule for an actor's resources, as for a sweep's cells)
        except ValueError as err:
            raise ValueError(str(err).replace("-per-cell", "-per-replica")) from None

    @property
    def ray(self) -> RayOptions:
        """The options of :func:`~kvsieve.evaluation.ray_sweep.connect` (the same resource rules as cells)."""
        from kvsieve.evaluation.ray_sweep import RayOptions

        return RayOptions(self.address, cpus_per_cell=self.cpus_per_replica, gpus_per_cell=self.gpus_per_replica)

    @property
    def threads(self) -> int:
        return self.ray.threads


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica builds its server from (sent to the replicas: plain values only): the model to load, its
    device, dtype and torch threads, and ``server``, the keyword arguments of
    :func:`~kvsieve.server.app.build_app` (the same as a server in one process gets)."""

    model: str
    server: dict[str, Any] = field(repr=False)  # (it holds the API key)
    device: str | None = None
    dtype: str | None = None
    threads: int = 1


def replica_options(
    address: str | None,
    replicas: int | None = None,
    cpus_per_replica: float | None = None,
    gpus_per_replica: float | None = None,
    device: str | None = None,
) -> ReplicaOptions:
    """The command line's ``--ray [ADDRESS]``, ``--replicas``, ``--cpus-per-replica``, ``--gpus-per-replica`` (None:
    not given) and ``--device`` as checked options: a one-line error (ValueError) before anything starts."""
    given = {
        name: value
        for name, value in (
            ("replicas", replicas),
            ("cpus_per_replica", cpus_per_replica),
            ("gpus_per_replica", gpus_per_replica),
        )
        if value is not None
    }
    if address is None:
        raise ValueError(f"--{next(iter(given), 'replicas').replace('_', '-')} needs --ray")
    from kvsieve.evaluation.ray_sweep import require_ray

    options = ReplicaOptions(address=address, **given)
    check_options(options, device)
    require_ray()
    try:
        import ray.serve  # noqa: F401
    except ImportError as err:
        raise ValueError(f"--ray needs Ray Serve ({err.name} is missing): pip install 'kvsieve[ray]'") from None
    return options


def check_options(options: ReplicaOptions, device: str | None) -> None:
    """The checks that need no Ray: a one-line error for a combination that cannot run (``device``: ``--device``)."""
    device = (device or "").lower()
    if device.startswith("cuda") and not options.gpus_per_replica:
        raise ValueError("--device cuda on Ray needs --gpus-per-replica (a replica sees only the GPUs it asks for)")
    if options.gpus_per_replica and device and not device.startswith("cuda"):
        raise ValueError(f"--gpus-per-replica runs the replicas on CUDA: give --device cuda, not {device}")
    if options.address == "local":
        import torch

        if options.gpus_per_replica and not torch.cuda.is_available():
            raise ValueError(
                "--gpus-per-replica needs CUDA on this machine (a local Ray); join a cluster with --ray ADDRESS"
            )
        cpus = os.cpu_count() or 1
        if options.replicas * options.cpus_per_replica > cpus:
            raise ValueError(
                f"{options.replicas} replicas × {options.cpus_per_replica:g} CPUs need "
                f"{options.replicas * options.cpus_per_replica:g} CPUs; this machine has {cpus}"
            )
        if options.gpus_per_replica:
            gpus = torch.cuda.device_count()
            if options.replicas * options.gpus_per_replica > gpus:
                raise ValueError(
                    f"{options.replicas} replicas × {options.gpus_per_replica:g} GPUs need "
                    f"{options.replicas * options.gpus_per_replica:g} GPUs; this machine has {gpus}"
                )


def _check_cluster(ray: Any, options: ReplicaOptions) -> None:
    """Once connected: a one-line error where the cluster, as it is now, cannot place the replicas."""
    resources = ray.cluster_resources()
    for name, each in (("CPU", options.cpus_per_replica), ("GPU", options.gpus_per_replica)):
        have = resources.get(name, 0)
        if each and options.replicas * each > have:
            raise ValueError(
                f"{options.replicas} replicas × {each:g} {name}s need {options.replicas * each:g}; "
                f"the Ray cluster has {have:g}"
            )


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGI = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class Identify:
    """ASGI middleware: every HTTP response carries ``headers`` (which replica answered)."""

    def __init__(self, app: ASGI, headers: list[tuple[bytes, bytes]]) -> None:
        self.app, self.headers = app, headers

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.headers]
            await send(message)

        await self.app(scope, receive, tagged)


class EndCutStreams:
    """ASGI middleware of Ray Serve's HTTP proxy: a stream of server-sent events that its replica left unfinished
    (the replica died: Ray's proxy then just stops) ends with an OpenAI error event and ``[DONE]``, as a request that
    fails on a running server does, instead of a connection cut mid-body."""

    def __init__(self, app: ASGI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"events": False, "open": False}

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers", [])).get(b"content-type", b"")
                state["events"] = state["open"] = kind.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                state["open"] = state["open"] and bool(message.get("more_body", False))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            if state["events"] and state["open"]:
                error = {"message": "the replica serving this request stopped", "type": "server_error", "param": None}
                body = f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
                with suppress(Exception):  # (the client may be gone too)
                    await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list[Any]:
    """Ray Serve's HTTP proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): the proxy's middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(EndCutStreams)]


class Replica:
    """One replica: its model and its server (:func:`~kvsieve.server.app.build_app`), built when Serve starts it."""

    def __init__(self, settings: ReplicaSettings) -> None:
        import ray
        import torch
        from ray import serve

        from kvsieve.models import load_model
        from kvsieve.server.app import build_app

        torch.set_num_threads(settings.threads)
        model, tokenizer = load_model(settings.model, device=settings.device, dtype=settings.dtype)
        self.server = build_app(model, tokenizer, **settings.server)
        identity = {
            REPLICA_HEADER: serve.get_replica_context().replica_id.unique_id,
            PID_HEADER: str(os.getpid()),
            NODE_HEADER: ray.get_runtime_context().get_node_id(),
        }
        self.server.add_middleware(Identify, headers=[(k.encode(), v.encode()) for k, v in identity.items()])

    def __serve_build_asgi_app__(self) -> Any:
        """Ray Serve's hook for an ingress whose app is made at replica start (``serve.ingress()``)."""
        return self.server

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose scheduler thread has died is replaced."""
        if not self.server.state.scheduler.alive:
            raise RuntimeError("the scheduler thread has stopped")


def deployment(options: ReplicaOptions, settings: ReplicaSettings) -> Any:
    """The Serve application: ``options.replicas`` replicas of :class:`Replica`, each with its resources. A replica
    takes up to ``max_batch + max_queue`` requests at once (past its own queue: 429, as one server); Serve's router
    holds up to ``max_queue`` more when every replica is full (past them: 503)."""
    from ray import serve

    ingress = serve.ingress()(Replica)
    return serve.deployment(
        ingress,
        name="Replica",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": options.gpus_per_replica},
        max_ongoing_requests=settings.server["max_batch"] + settings.server["max_queue"],
        max_queued_requests=settings.server["max_queue"],
        health_check_period_s=5,
    ).bind(settings)


def model_path(model: str) -> str:
    """A local model path made absolute (the replicas' working directory is Ray's), else ``model`` unchanged."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def serve_on_ray(options: ReplicaOptions, settings: ReplicaSettings, *, host: str, port: int) -> None:
    """Deploy the replicas, their proxy on ``host``:``port``, then serve until Ctrl-C or SIGTERM (which delete the
    application; a local Ray stops with this process). Errors before anything runs are one line (ValueError)."""
    from kvsieve.evaluation.ray_sweep import connect, require_ray

    check_options(options, settings.device)
    ray = require_ray()
    from ray import serve

    connect(options.ray)
    try:
        _check_cluster(ray, options)
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": host, "port": port},
            controller_options={"runtime_env": {"env_vars": PROXY_ENV}},
        )
        try:
            serve.run(deployment(options, settings), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as err:
            raise ValueError(f"the replicas did not start: {_failure(serve, err)}") from None
        where = "a local Ray" if options.address == "local" else f"the Ray cluster at {options.address}"
        print(
            f"kvsieve serve: {options.replicas} replica(s) of {settings.server['model_name']} on {where}, "
            f"http://{host}:{port} (Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        _wait_for_stop()
    finally:
        try:
            if options.address == "local":
                serve.shutdown()
            else:
                serve.delete(APP_NAME)  # (Serve itself and its proxy stay: the cluster may serve other apps)
        finally:
            ray.shutdown()  # (a local Ray stops; from a cluster, this process disconnects)


def _failure(serve: Any, err: Exception) -> str:
    """Why the deployment failed, in one line: the last line of the replicas' error (Serve's status keeps it)."""
    message = str(err)
    try:
        status = serve.status().applications[APP_NAME]
        message = "\n".join([status.message, *(d.message for d in status.deployments.values())])
    except Exception:  # (the status is a courtesy: the error stands without it)
        pass
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _wait_for_stop() -> None:
    """Block until Ctrl-C or SIGTERM."""
    stop = signal.getsignal(signal.SIGTERM)

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, stop)
