"""Where one instance's batches are prepared and run, as the engine's view of the machine
(:class:`~.reservation.GpuReservation` on a GPU) decides it: in the serving process with a
given preparation (:class:`InProcess`), or in worker processes (:class:`InWorkers`). Each says
why, for the start-up log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .results import Prepare

if TYPE_CHECKING:
    from .workers import WorkerPool


@dataclass(frozen=True)
class InProcess:
    """Batches prepared by ``prepare`` (None: on the CPU, ``imaging.prepare_batch``) and run in
    the serving process."""

    prepare: Prepare | None = None
    why: str = "CPU"


@dataclass(frozen=True)
class InWorkers:
    """Batches sent to worker processes (started, warm), which prepare them, and with a model
    run them too; the serving process takes what they cannot."""

    pool: WorkerPool
    why: str


Placement = InProcess | InWorkers
