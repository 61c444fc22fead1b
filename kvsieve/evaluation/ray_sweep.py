"""A sweep's cells as Ray tasks (``kvsieve sweep --ray [ADDRESS]``): on a local Ray or across a cluster.

Each cell is one task that declares its resources (``cpus_per_cell`` CPUs, which are also its torch threads, and
``gpus_per_cell`` GPUs: Ray sets ``CUDA_VISIBLE_DEVICES``, fractions share a GPU). A worker process keeps its model
between cells (:func:`~kvsieve.evaluation.sweep.shared_runner`). The results come back to this process as the
cells finish, and it writes the cell files (:func:`~kvsieve.evaluation.sweep.run_sweep`): the nodes need no
shared disk, but the same Python environment with kvsieve, the model and its data. A task that raises or whose
worker dies (killed, out of memory) is retried ``max_retries`` times, then its cell is stored with the error.
Leaving early (Ctrl-C) cancels the outstanding tasks; the finished cells stay stored.
The submit-and-collect loop, :func:`ray_tasks`, is shared with ``kvsieve ruler --ray`` (:mod:`kvsieve.ruler.run`).

Ray is an optional dependency: ``pip install 'kvsieve[ray]'``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from kvsieve.evaluation.sweep import Cell, Finished, Settings, error_result, shared_runner

if TYPE_CHECKING:
    from kvsieve.evaluation.sweep import Progress


@dataclass(frozen=True)
class RayOptions:
    address: str = "local"
    """``"local"``: start a Ray on this machine (its CPUs and GPUs) for this process; ``"auto"``, ``"HOST:PORT"`` or
    ``"ray://HOST:PORT"``: join a running cluster. Ignored when this process is already connected to a Ray."""
    cpus_per_cell: float = 1.0
    gpus_per_cell: float = 0.0
    max_retries: int = 2
    """Retries of a cell whose task raised or whose worker died, before it is stored as failed."""

    def __post_init__(self) -> None:
        # (Ray's rule for a task's resources: a fraction of one unit, or whole units)
        for name, value in (("cpus-per-cell", self.cpus_per_cell), ("gpus-per-cell", self.gpus_per_cell)):
            if not 0 <= value < math.inf or (value > 1 and value % 1) or (name == "cpus-per-cell" and value == 0):
                raise ValueError(f"{name} must be a fraction of 1 or a whole number, got {value}")
        if self.max_retries < 0:
            raise ValueError(f"max-retries must be >= 0, got {self.max_retries}")

    @property
    def threads(self) -> int:
        """Torch threads of a cell: its CPUs."""
        return max(1, int(self.cpus_per_cell))


def require_ray() -> ModuleType:
    """The ``ray`` module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'kvsieve[ray]'") from None
    return ray


def connect(options: RayOptions) -> None:
    """Start or join Ray (see :attr:`RayOptions.address`), unless this process is connected already."""
    ray = require_ray()
    if ray.is_initialized():
        return
    local = options.address == "local"
    # Workers' output goes to Ray's session logs: this process prints the progress (and JSON with --json).
    ray.init(
        address=options.address,
        logging_level=logging.WARNING,
        log_to_driver=False,
        **({"include_dashboard": False} if local else {}),
    )


def _run_cell(settings: Settings, device: str | None, threads: int, cell: Cell) -> tuple[dict[str, Any], float, str]:
    """A Ray task: the metrics of ``cell``, its seconds and the node it ran on (an exception goes to Ray)."""
    import ray

    torch.set_num_threads(threads)
    start = time.perf_counter()
    result = shared_runner(settings, device).run(cell)
    return result, time.perf_counter() - start, ray.get_runtime_context().get_node_id()


def _slots(ray: ModuleType, options: RayOptions) -> int:
    """How many cells the cluster runs at once (for the progress bar; it may grow or shrink)."""
    resources = ray.cluster_resources()
    slots = resources.get("CPU", 0) // options.cpus_per_cell
    if options.gpus_per_cell:
        slots = min(slots, resources.get("GPU", 0) // options.gpus_per_cell)
    return int(slots)


def ray_tasks(
    function: Callable[..., Any], calls: Sequence[tuple[Any, ...]], options: RayOptions, running: Callable[[int], None]
) -> Iterator[tuple[int, Any, BaseException | None]]:
    """``function(*args)`` for every ``args`` of ``calls``, each a task with ``options``' resources and retries, yielded
    as they finish: ``(index in calls, value, None)``, or ``(index, None, error)`` for a task that failed after its
    retries (its exception, or Ray's error where its worker died). ``running(n)``: about ``n`` tasks run now. Leaving
    early (Ctrl-C, ``close()``) cancels the outstanding tasks."""
    ray = require_ray()
    connect(options)
    task = ray.remote(
        num_cpus=options.cpus_per_cell,
        num_gpus=options.gpus_per_cell,
        max_retries=options.max_retries,
        retry_exceptions=True,
        max_calls=0,  # (Ray's default for GPU tasks is a new worker per task: the model would load per task)
    )(function)
    pending = {task.remote(*args): index for index, args in enumerate(calls)}
    try:
        while pending:
            running(min(len(pending), _slots(ray, options)))
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(ref)
            try:
                value, error = ray.get(ref), None
            except ray.exceptions.RayError as err:
                value, error = None, err.cause if isinstance(err, ray.exceptions.RayTaskError) and err.cause else err
            yield index, value, error
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


def ray_cells(
    todo: Sequence[Cell], settings: Settings, device: str | None, options: RayOptions, progress: Progress
) -> Iterator[Finished]:
    """Submit every cell of ``todo`` as a task and yield each as it finishes (a failed one with its error)."""
    calls = [(settings, device, options.threads, cell) for cell in todo]
    with closing(ray_tasks(_run_cell, calls, options, progress.show_running)) as finished:
        for index, value, error in finished:
            result, seconds, node = value if error is None else (error_result(error), 0.0, None)
            yield todo[index], result, seconds, node
