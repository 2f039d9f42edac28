"""How each running job shares the GPU, as the supervisor sees it (read once a second).

- ``mechanism``: ``mps`` for a job launched as a CUDA MPS client (:mod:`.mps`: its kernels run
  beside the server's on a capped share of the SMs; fixed at launch); else ``yield`` while the
  job's hook (:mod:`.yieldhook`) reports calls (it waits at module boundaries while the server
  runs a batch), ``process`` otherwise (no torch, opted out,
  stripped environment, or a phase of the job that runs no module): the process-level policies
  (pause/resume by SIGSTOP/SIGCONT) apply then, the latency budget's pause included.
- figures for ``guard show`` and ``/metrics``: yields and forced passes, time waited, time slept
  for the duty cycle, pauses and time paused, per minute of running; the share of wall time the job
  could run (not waiting, throttled or paused), and its SM utilisation where NVML gives it.

Also here: the estimate of how long the server's batches waited on jobs (:class:`WaitEstimate`),
from the engine's stage timers when the guard is hosted in the server.
"""

from __future__ import annotations

import os
import sys
import time

from . import metrics, proc
from .share import YieldStats, read_stats

#: the hook counts as alive while its calls advanced within this many seconds (it writes its
#: figures at least every 0.25 s while it is called)
HOOK_STALE_S = 3.0


class JobSharing:
    def __init__(self, stats_path: str | None, now: float | None = None, *,
                 mps: bool = False) -> None:
        self.stats_path = stats_path
        self.mps = mps
        self.started = time.monotonic() if now is None else now
        self.stats: YieldStats | None = None
        self.hook_seen = False
        self._hooks_at = 0.0  # when its hook calls last advanced
        self.pauses = 0
        self.paused_s = 0.0
        self._paused_since: float | None = None
        self.time_share: float | None = None
        self.sm_util: float | None = None
        self.sched: dict | None = None
        self.pids: set[int] = set()  # the job's processes (for NVML's per-process figures)
        self._last = (self.started, 0.0, 0.0, 0.0)  # time, waited, slept, paused at the last read
        self.mechanism = "mps" if mps else "process"

    @property
    def recorded(self) -> str:
        """The mechanism the job's record keeps: ``mps``, ``yield`` once its hook was seen, else
        ``process``."""
        return "mps" if self.mps else "yield" if self.hook_seen else "process"

    # -- the process-level policy -------------------------------------------------------------
    def paused(self, now: float) -> None:
        self.pauses += 1
        if self._paused_since is None:
            self._paused_since = now

    def resumed(self, now: float) -> None:
        if self._paused_since is not None:
            self.paused_s += now - self._paused_since
            metrics.PAUSED.inc(now - self._paused_since)
            self._paused_since = None

    def paused_total(self, now: float) -> float:
        return self.paused_s + (now - self._paused_since if self._paused_since is not None else 0.0)

    # -- the hook -------------------------------------------------------------------------------
    @property
    def cooperative(self) -> bool:
        return self.mechanism == "yield"

    def read(self, now: float | None = None) -> bool:
        """Read the hook's statistics, count what changed into the metrics; True when the
        mechanism changed."""
        now = time.monotonic() if now is None else now
        old = self.stats
        new = read_stats(self.stats_path) if self.stats_path else None
        if new is not None and (old is None or new.pid != old.pid or new.hooks >= old.hooks):
            if old is not None and new.pid == old.pid:
                metrics.YIELDS.inc(max(0, new.yields - old.yields))
                metrics.YIELD_FORCED.inc(max(0, new.forced - old.forced))
                metrics.YIELD_WAIT.inc(max(0.0, new.waited_s - old.waited_s))
                metrics.YIELD_THROTTLE.inc(max(0.0, new.throttled_s - old.throttled_s))
            else:
                metrics.YIELDS.inc(new.yields)
                metrics.YIELD_FORCED.inc(new.forced)
                metrics.YIELD_WAIT.inc(new.waited_s)
                metrics.YIELD_THROTTLE.inc(new.throttled_s)
            if new.hooks and (old is None or new.hooks != old.hooks):
                self._hooks_at = now
                self.hook_seen = True
            self.stats = new
        t0, w0, s0, p0 = self._last
        waited = self.stats.waited_s if self.stats else 0.0
        slept = self.stats.throttled_s if self.stats else 0.0
        paused = self.paused_total(now)
        if now - t0 >= 0.5:
            held = (waited - w0) + (slept - s0) + (paused - p0)
            self.time_share = round(max(0.0, min(1.0, 1.0 - held / (now - t0))), 3)
            self._last = (now, waited, slept, paused)
        alive = self.hook_seen and now - self._hooks_at <= HOOK_STALE_S
        mechanism = "mps" if self.mps else "yield" if alive else "process"
        changed = mechanism != self.mechanism
        self.mechanism = mechanism
        return changed

    def summary(self, now: float | None = None) -> dict:
        """What ``guard show`` and the API show under ``sharing``."""
        now = time.monotonic() if now is None else now
        minutes = max(1e-9, (now - self.started) / 60.0)
        st = self.stats
        out: dict = {
            "mechanism": self.mechanism,
            "hook": "active" if self.cooperative else ("seen" if self.hook_seen else
                                                        "installed" if st else "absent"),
            "running_s": round(now - self.started, 1),
            "pauses": self.pauses,
            "paused_s": round(self.paused_total(now), 2),
            "pauses_per_min": round(self.pauses / minutes, 2),
        }
        if st is not None:
            out.update(hooks=st.hooks, yields=st.yields, forced=st.forced,
                       waited_s=round(st.waited_s, 2), throttled_s=round(st.throttled_s, 2),
                       yields_per_min=round(st.yields / minutes, 1), gpu_bounded=st.bounded,
                       mode=st.mode,
                       run_ahead_syncs=st.syncs)
        if self.time_share is not None:
            out["time_share"] = self.time_share
        if self.sm_util is not None:
            out["gpu_sm_util_pct"] = round(self.sm_util, 1)
        if self.sched is not None:
            out["sched"] = self.sched
        return out

    def remove_stats(self) -> None:
        if self.stats_path:
            try:
                os.unlink(self.stats_path)
            except OSError:
                pass


def audit_sched(sid: int, want_idle: bool) -> dict:
    """Threads of the job's session (its whole tree) by scheduling policy; with ``want_idle``,
    threads found outside SCHED_IDLE are put back (each counted in ``sched_fixed_total``). Jobs
    cannot leave SCHED_IDLE without privilege, so this should find nothing: it checks the claim."""
    counts: dict = {"threads": 0, "idle": 0, "fixed": 0}
    idle = getattr(os, "SCHED_IDLE", None)
    for member in proc.session_members(sid):
        try:
            tids = os.listdir(f"/proc/{member.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                policy = os.sched_getscheduler(int(tid))
            except OSError:
                continue  # ended meanwhile
            counts["threads"] += 1
            if policy == idle:
                counts["idle"] += 1
            elif want_idle and idle is not None:
                try:
                    os.sched_setscheduler(int(tid), idle, os.sched_param(0))
                    counts["fixed"] += 1
                    metrics.SCHED_FIXED.inc()
                except OSError:
                    pass
    return counts


class WaitEstimate:
    """How long the server's batches waited on jobs, estimated from the engine's stage timers
    (``visionserve_compute_duration_seconds``: decode + model + postprocess per batch): while a job
    runs, each batch's compute time over its level without a job counts as time waited. Needs the
    guard hosted in the server (the engine's metrics in this process); an estimate, since batches
    also grow while the server waits, which lengthens them by itself."""

    ALPHA = 0.2

    def __init__(self) -> None:
        self.baseline: float | None = None  # seconds per batch without a job
        self._last: tuple[float, float] | None = None
        self.total_s = 0.0

    @staticmethod
    def _compute() -> tuple[float, float] | None:
        engine_metrics = sys.modules.get("visionserve.metrics")
        hist = getattr(engine_metrics, "COMPUTE_SECONDS", None)
        if hist is None:
            return None
        total = count = 0.0
        for family in hist.collect():
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
        return total, count

    def update(self, job_running: bool) -> float:
        """Call once a second; returns the seconds of waiting estimated in this interval."""
        now = self._compute()
        if now is None:
            return 0.0
        last, self._last = self._last, now
        if last is None or now[1] <= last[1]:
            return 0.0
        per_batch = (now[0] - last[0]) / (now[1] - last[1])
        if not job_running:
            self.baseline = per_batch if self.baseline is None else \
                self.baseline + self.ALPHA * (per_batch - self.baseline)
            return 0.0
        if self.baseline is None:
            return 0.0
        waited = max(0.0, per_batch - self.baseline) * (now[1] - last[1])
        self.total_s += waited
        metrics.INFERENCE_WAIT.inc(waited)
        return waited
