"""The training-queue guard hosted in the server (``--guard``): its supervisor in a thread of
the serving process, its job API under /v1/guard on the server's HTTP port."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..batching import observe_states
from ..config import ServerSettings

if TYPE_CHECKING:
    import threading

log = logging.getLogger("visionserve")


def watch_batchers(settings: ServerSettings) -> bool:
    """The guard's busy word follows the batchers' states when the server hosts the guard
    (``--guard``: it publishes the word for its jobs) or runs beside one
    (``VISIONSERVE_GUARD_SHARE`` names the word); otherwise nobody reads it, and the batchers report
    to no one. Returns whether it was installed."""
    from ..guard import share

    if not (settings.guard or os.environ.get(share.SHARE_ENV)):
        return False
    observe_states(share.note)
    return True


def open_guard_store(settings: ServerSettings):
    from ..guard.store import JobStore, default_db_path

    return JobStore(str(settings.guard_db or default_db_path()))


class HostedGuard:
    """The training-queue guard's supervisor in a thread of the server, its API under /v1/guard."""

    def __init__(self, settings: ServerSettings, resolved, latency=None, mps=None) -> None:
        """``latency``: the engine's served-p99 function, for ``--guard-latency-budget-ms``;
        ``mps``: the :class:`~visionserve.guard.mps.Mps` state of ``--guard-mps``."""
        from ..config import parse_bytes
        from ..guard.memory import open_nvml_source
        from ..guard.supervisor import Supervisor, SupervisorConfig

        self.store = open_guard_store(settings)
        source = None if resolved.gpu is None else open_nvml_source(resolved.gpu.uuid)
        budget = parse_bytes(settings.gpu_memory_budget) if settings.gpu_memory_budget else 0
        self.mps = mps
        on = mps is not None and mps.active
        self.supervisor = Supervisor(self.store, source, SupervisorConfig(
            inference_floor=budget, margin=parse_bytes(settings.guard_margin),
            latency_budget_ms=settings.guard_latency_budget_ms,
            mps_pipe_dir=mps.pipe_dir if on else "", mps_log_dir=mps.log_dir if on else "",
            mps_job_sm_percent=settings.guard_mps_job_sm_percent), latency=latency)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        import threading

        self._thread = threading.Thread(target=self.supervisor.run_forever, name="guard",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.supervisor.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.mps is not None:
            self.mps.stop()


def start_mps(settings: ServerSettings, resolved):
    """``--guard-mps``: this process a client of a CUDA MPS daemon (started if needed), before
    anything initialises CUDA; the guard's jobs join the same daemon. Said at start-up either
    way; never fatal (see :mod:`visionserve.guard.mps`)."""
    from ..guard import metrics, mps

    state = mps.start(settings.guard_mps_job_sm_percent,
                      resolved.gpu.uuid if resolved.gpu is not None else None)
    metrics.MPS_ACTIVE.set(1 if state.active else 0)
    if state.active:
        log.info("guard: CUDA MPS on (%s daemon pid %s, pipe %s): training jobs run beside "
                 "inference on %d%% of the SMs, at a lower client priority",
                 "started" if state.started_here else "existing", state.daemon, state.pipe_dir,
                 settings.guard_mps_job_sm_percent)
    else:  # a GPU-less guard is a serial job queue: nothing to share, nothing to warn about
        log.log(logging.INFO if resolved.gpu is None else logging.WARNING,
                "guard: CUDA MPS not used: %s; jobs share the GPU by yielding or by the "
                "process-level policies", state.reason)
    return state
