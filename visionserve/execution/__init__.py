"""How a model instance's batches are prepared and run: one interface, :class:`Executor`, with two
implementations.

* :class:`~.threads.ThreadExecutor`, in the serving process: a prep thread (decode, resize,
  normalise on the CPU or the GPU) and a compute thread (the backend, then the model's task).
* :class:`~.workers.WorkerExecutor`, in worker processes (``--gpu-batch-processes``): the event
  loop sends each batch to a worker, which prepares it, and runs the model too, and answers with
  its outputs; the serving process's two threads take what no worker can.

The engine asks the machine where an instance runs (:mod:`.placement`, decided by
:class:`~.reservation.GpuReservation` on a GPU), and :func:`choose` builds its executor; the
executor's :meth:`~Executor.describe` says which it is and why, for the start-up log. Results
and records (:mod:`.results`) are what every executor hands on. The messages between the serving
process and its workers use :mod:`visionserve.framing`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from ..backends.base import Backend
from ..batching import CostModel, Pending
from ..config import ModelConfig
from ..tasks import Task
from .placement import InProcess, InWorkers, Placement
from .results import BatchRecord
from .threads import ThreadExecutor
from .workers import WorkerExecutor

__all__ = ["Executor", "InProcess", "InWorkers", "Placement", "choose"]


class Executor(Protocol):
    """One model instance's execution, as the engine and its batcher see it."""

    name: str
    backend: Backend
    #: False after a device fault: the instance is out of service (not ready)
    healthy: bool
    #: batches accepted and not answered yet, and accepted in all (the event loop's): the
    #: engine sends a batch to the instance with the fewest in flight
    inflight: int
    accepted: int
    #: called on the event loop with each batch's record, before its answers are released
    on_batch: Callable[[BatchRecord], None]

    @property
    def batches_in_flight(self) -> int:
        """Batches the batcher may give this instance at once."""
        ...

    @property
    def full_batches_extra(self) -> int:
        """Full batches the batcher may give it beyond :attr:`batches_in_flight`."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start its threads (off the loop: starting one waits until it runs)."""
        ...

    async def execute(self, batch: list[Pending]) -> None:
        """Returns when every frame of ``batch`` has its answer (or error)."""
        ...

    def stop(self) -> None:
        """Stop its threads and worker processes (blocking: off the loop)."""
        ...

    def describe(self) -> str:
        """Where its batches run and why, in a few words: "in the serving process (2 threads;
        CPU)", "in 3 worker process(es) (--gpu-batch-processes 3)"."""
        ...


def choose(placement: Placement, *, name: str, backend: Backend, config: ModelConfig,
           preferred: tuple[int, ...], cost: CostModel,
           on_batch: Callable[[BatchRecord], None], task: Task, nice: int) -> Executor:
    """The executor of one instance (``name``), loaded and warm in ``backend``, where
    ``placement`` says; ``preferred``: the batch sizes it pads batches up to (none: no
    padding); ``nice``: its threads this many levels below the event loop."""
    common: dict[str, Any] = {"name": name, "backend": backend, "config": config,
                              "preferred": preferred, "cost": cost, "on_batch": on_batch,
                              "task": task, "nice": nice}
    if isinstance(placement, InWorkers):
        return WorkerExecutor(pool=placement.pool, why=placement.why, **common)
    return ThreadExecutor(prepare=placement.prepare, why=placement.why, **common)
