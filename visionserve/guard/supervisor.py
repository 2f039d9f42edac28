"""The guard's supervisor: one loop that admits queued jobs, watches the running ones and
records every change in the store.

Each tick (``poll_hz``, default 10 per second): sample memory, apply the watchdog (signals first,
database after, so a slow write never delays a pause), reap ended jobs, act on cancel requests,
escalate stops whose grace expired, then admit the next job if a slot is free.

Restart semantics: jobs run in their own session and survive the supervisor. A new supervisor
finds every ``running``/``paused`` job; if its (pid, start time) is still alive it is re-adopted
and watched like any other, otherwise it is marked ``failed``/``killed`` ("guard restarted; job was
running, not re-run") and never started again.

Shutdown (SIGTERM/SIGINT): no new job starts; running jobs are left running (they are re-adopted
by the next supervisor) unless ``stop_jobs_on_exit``, which stops each one (SIGTERM, grace,
SIGKILL) and records it ``killed``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from . import admission, metrics, proc, watchdog
from .launcher import LaunchSettings, launch, write_site_dir
from .memory import MemorySample, MemorySource
from .store import ACTIVE, Job, JobStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisorConfig:
    concurrency: int = 1
    inference_floor: int = 0  # the inference server's budget
    margin: int = 0
    hysteresis: int = 1024**3
    poll_hz: float = 10.0
    grace_s: float = 10.0
    nice: int = 10
    sched_idle: bool = True
    context_reserve: int = 768 * 1024**2
    stop_jobs_on_exit: bool = False
    #: pause running jobs while the served p99 (``latency`` below) is over this; None: off
    latency_budget_ms: float | None = None

    @property
    def floor(self) -> int:
        return self.inference_floor + self.margin


@dataclass
class Active:
    job: Job
    popen: object | None  # subprocess.Popen, or None for a job re-adopted after a restart
    pid: int
    starttime: int | None
    state: str  # running | paused
    stop_state: str | None = None  # killed | cancelled: the terminal state once it exits
    stop_reason: str | None = None
    kill_at: float | None = None
    killed: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def pgid(self) -> int:
        return self.pid  # started with start_new_session: pid = pgid = sid


class Supervisor:
    def __init__(self, store: JobStore, source: MemorySource | None,
                 config: SupervisorConfig | None = None, latency=None) -> None:
        """``latency``: a function returning the served p99 (ms) of the last second, or None
        when it cannot tell; given by the server that hosts the guard."""
        self.store = store
        self.source = source
        self.latency = latency
        self.cfg = config or SupervisorConfig()
        if self.cfg.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.active: dict[int, Active] = {}
        self.stopping = threading.Event()
        self._draining = False
        self._last_wait_reason: dict[int, str] = {}
        self._last_heartbeat = 0.0
        self._sample_failed = False
        self._pid = os.getpid()
        total = None
        if source is not None:
            total, _ = source.device_memory()
        self._total = total
        self.launch_settings = LaunchSettings(
            gpu_uuid=source.uuid if source is not None else None, gpu_total=total,
            context_reserve=self.cfg.context_reserve, nice=self.cfg.nice, sched_idle=self.cfg.sched_idle,
            site_dir=write_site_dir(os.path.join(store.log_dir, "jobsite")))

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the database's lease and recover jobs left by a previous supervisor."""
        self.store.acquire_lease(self._pid, proc.starttime(self._pid) or 0,
                                 self.source.uuid if self.source else None, proc.is_alive)
        if self.source is None:
            log.warning("guard: no GPU visible; running as a serial job queue without memory "
                        "admission or watchdog")
        else:
            log.info("guard: watching %s, inference floor %s (budget %s + margin %s), "
                     "concurrency %d, %.0f Hz", self.source.description,
                     admission.fmt_bytes(self.cfg.floor),
                     admission.fmt_bytes(self.cfg.inference_floor),
                     admission.fmt_bytes(self.cfg.margin), self.cfg.concurrency, self.cfg.poll_hz)
        metrics.INFERENCE_FLOOR.set(self.cfg.floor)
        if self._latency_budget() is not None:
            log.info("guard: running jobs pause while the served p99 is over %g ms (resume under %g ms)",
                     self.cfg.latency_budget_ms, watchdog.RESUME_FRACTION * self.cfg.latency_budget_ms)
        self.recover()

    def run_forever(self) -> None:
        """Tick until :meth:`request_stop`; then shut down as configured."""
        self.start()
        period = 1.0 / self.cfg.poll_hz
        try:
            while not self.stopping.is_set():
                t0 = time.monotonic()
                self.tick()
                self.stopping.wait(max(0.0, period - (time.monotonic() - t0)))
            self.shutdown()
        finally:
            self.store.release_lease(self._pid)

    def request_stop(self) -> None:
        self.stopping.set()

    def shutdown(self) -> None:
        self._draining = True
        if not self.active:
            return
        if not self.cfg.stop_jobs_on_exit:
            log.warning("guard: shutting down; %d job(s) keep running unwatched until a guard "
                        "starts again on this database: %s", len(self.active),
                        ", ".join(str(i) for i in self.active))
            return
        for a in list(self.active.values()):
            self._begin_stop(a, "killed", "stopped: guard shut down (--stop-jobs-on-exit)",
                             "shutdown")
        deadline = time.monotonic() + self.cfg.grace_s + 5.0
        while self.active and time.monotonic() < deadline:
            self._reap()
            self._escalate()
            time.sleep(0.05)

    # -- recovery -------------------------------------------------------------------------------
    def recover(self) -> None:
        for job in self.store.list(ACTIVE):
            if job.pid is None:
                self.store.finish(job.id, "failed", exit_code=None,
                                  reason="guard restarted; job was starting, not re-run")
                log.warning("guard: job %d was being started when the guard died; marked failed",
                            job.id)
            elif proc.is_alive(job.pid, job.pid_starttime):
                self.active[job.id] = Active(job, None, job.pid, job.pid_starttime, job.state)
                log.warning("guard: re-adopted job %d (pid %d, %s) left by a previous guard",
                            job.id, job.pid, job.state)
            else:
                status = _read_status(job)
                rc = status.get("returncode") if status else None
                if rc is None:
                    state, reason = "killed", "guard restarted; job was running, not re-run"
                elif rc == 0:
                    state, reason = "succeeded", ("guard restarted; job finished (exit 0) while "
                                                  "the guard was down, not re-run")
                else:
                    state, reason = "failed", (f"guard restarted; job was running and ended "
                                               f"with {_describe_rc(rc)}, not re-run")
                self.store.finish(job.id, state, exit_code=rc, reason=reason)
                log.warning("guard: job %d ended while the guard was down: %s", job.id, state)

    # -- one tick -------------------------------------------------------------------------------
    def tick(self) -> None:
        sample = self._sample()
        if sample is not None or self._latency_budget() is not None:
            self._watch(sample)
        self._reap()
        self._cancels()
        self._escalate()
        if not self._draining and not self.stopping.is_set():
            self._admit(sample)
        now = time.monotonic()
        if now - self._last_heartbeat >= 1.0:
            self._last_heartbeat = now
            self.store.heartbeat(self._pid)
            counts = self.store.counts()
            metrics.JOBS_QUEUED.set(counts["queued"])
            metrics.JOBS_RUNNING.set(counts["running"])
            metrics.JOBS_PAUSED.set(counts["paused"])

    def _sample(self) -> MemorySample | None:
        if self.source is None:
            return None
        try:
            s = self.source.sample()
        except Exception as exc:  # NVML hiccup: keep going, admit nothing until it answers
            if not self._sample_failed:
                log.error("guard: cannot read GPU memory (%s); admitting no job until it works",
                          exc)
            self._sample_failed = True
            return None
        if self._sample_failed:
            log.info("guard: GPU memory readable again")
        self._sample_failed = False
        metrics.GPU_FREE.set(s.free)
        metrics.HEADROOM.set(s.free - self.cfg.floor)
        return s

    def job_usage(self, sample: MemorySample) -> dict[int, int]:
        """job id -> bytes its session's processes hold on the device."""
        by_sid = {a.pid: a.job.id for a in self.active.values()}
        out = dict.fromkeys(self.active, 0)
        for pid, used in sample.used_by_pid.items():
            sid = proc.session_of(pid)
            if sid in by_sid:
                out[by_sid[sid]] += used
        return out

    def _latency_budget(self) -> float | None:
        return self.cfg.latency_budget_ms if self.latency is not None else None

    def _watch(self, sample: MemorySample | None) -> None:
        usage = self.job_usage(sample) if sample is not None else dict.fromkeys(self.active, 0)
        views = [watchdog.JobView(a.job.id, a.job.policy, a.state, a.job.gpu_mem, usage[i])
                 for i, a in self.active.items() if a.stop_state is None]
        latency = None
        budget = self._latency_budget()
        if budget is not None and views:
            latency = watchdog.Latency(self.latency(), budget)
        for act in watchdog.decide(views, free=sample.free if sample is not None else None,
                                   floor=self.cfg.floor, hysteresis=self.cfg.hysteresis,
                                   latency=latency):
            a = self.active[act.job_id]
            if act.kind == "pause":
                proc.signal_group(a.pgid, signal.SIGSTOP)
                a.state = "paused"
                metrics.INTERVENTIONS.labels("pause", act.trigger).inc()
                log.warning("guard: job %d %s", a.job.id, act.reason)
                self.store.set_paused(a.job.id, act.reason)
            elif act.kind == "resume":
                proc.signal_group(a.pgid, signal.SIGCONT)
                a.state = "running"
                metrics.INTERVENTIONS.labels("resume", act.trigger).inc()
                log.info("guard: job %d %s", a.job.id, act.reason)
                self.store.set_resumed(a.job.id, act.reason)
            else:
                self._begin_stop(a, "killed", act.reason, act.trigger)

    def _begin_stop(self, a: Active, final: str, reason: str, trigger: str) -> None:
        if a.stop_state is not None:
            return
        a.stop_state, a.stop_reason = final, reason
        a.kill_at = time.monotonic() + self.cfg.grace_s
        # TERM first, then CONT: a paused job wakes with SIGTERM pending and can handle it
        proc.signal_group(a.pgid, signal.SIGTERM)
        proc.signal_group(a.pgid, signal.SIGCONT)
        metrics.INTERVENTIONS.labels("stop", trigger).inc()
        log.warning("guard: stopping job %d (SIGTERM, SIGKILL after %.1f s): %s", a.job.id,
                    self.cfg.grace_s, reason)
        self.store.set_reason(a.job.id, f"stopping: {reason}")

    def _escalate(self) -> None:
        now = time.monotonic()
        for a in self.active.values():
            if a.kill_at is not None and not a.killed and now >= a.kill_at:
                a.killed = True
                proc.signal_group(a.pgid, signal.SIGKILL)
                metrics.INTERVENTIONS.labels("kill", "grace_expired").inc()
                log.warning("guard: job %d ignored SIGTERM for %.1f s; sent SIGKILL", a.job.id,
                            self.cfg.grace_s)
                a.stop_reason = f"{a.stop_reason} (SIGKILL after {self.cfg.grace_s:g} s grace)"

    def _cancels(self) -> None:
        for job_id in self.store.cancel_requested_ids():
            a = self.active.get(job_id)
            if a is not None:
                self._begin_stop(a, "cancelled", "cancelled by user", "cancel")

    def _reap(self) -> None:
        for job_id, a in list(self.active.items()):
            if a.popen is not None:
                wrapper_rc = a.popen.poll()
                if wrapper_rc is None:
                    continue
            elif proc.is_alive(a.pid, a.starttime):
                continue
            else:
                wrapper_rc = None
            del self.active[job_id]
            # whatever the job left in its process group (workers, daemons) goes with it
            if proc.session_members(a.pid):
                proc.signal_group(a.pgid, signal.SIGKILL)
            status = _read_status(a.job)
            rc = status["returncode"] if status and "returncode" in status else wrapper_rc
            if a.stop_state is not None:
                state, reason = a.stop_state, a.stop_reason
            elif rc == 0:
                state, reason = "succeeded", None
            elif rc is None:
                state, reason = "killed", "process vanished; exit status unknown"
            else:
                state = "failed"
                reason = status.get("error") if status and status.get("error") else \
                    f"exited with {_describe_rc(rc)}"
            self.store.finish(job_id, state, exit_code=rc, reason=reason)
            log.info("guard: job %d ended: %s (%s)", job_id, state, _describe_rc(rc))

    # -- admission ------------------------------------------------------------------------------
    def _admit(self, sample: MemorySample | None) -> None:
        while len(self.active) < self.cfg.concurrency:
            job = self.store.next_queued()
            if job is None:
                return
            if self.source is not None:
                if sample is None:
                    return  # memory unreadable: admit nothing
                usage = self.job_usage(sample)
                promised = sum(max(0, a.job.gpu_mem - usage[i]) for i, a in self.active.items())
                d = admission.decide(need=job.gpu_mem, total=sample.total, free=sample.free,
                                     floor=self.cfg.floor, promised=promised)
                if d.impossible:
                    if self.store.claim(job.id):
                        self.store.finish(job.id, "failed", exit_code=None,
                                          reason=f"not admitted: {d.reason}")
                        log.error("guard: job %d can never fit: %s", job.id, d.reason)
                    continue
                if not d.admit:
                    if self._last_wait_reason.get(job.id) != d.reason.split(":")[0]:
                        self._last_wait_reason[job.id] = d.reason.split(":")[0]
                        log.info("guard: job %d %s", job.id, d.reason)
                        self.store.set_reason(job.id, d.reason)
                    return  # strict order: nothing overtakes the head of the queue
            self._start(job)

    def _start(self, job: Job) -> None:
        claimed = self.store.claim(job.id)
        if claimed is None:  # cancelled between the read and the claim
            return
        self._last_wait_reason.pop(job.id, None)
        try:
            launched = launch(claimed, self.launch_settings)
        except OSError as exc:
            self.store.finish(job.id, "failed", exit_code=None, reason=f"cannot start: {exc}")
            log.error("guard: job %d cannot start: %s", job.id, exc)
            return
        self.store.set_process(job.id, launched.pid, launched.starttime)
        self.store.set_reason(job.id, None)
        self.active[job.id] = Active(self.store.get(job.id), launched.popen, launched.pid,
                                     launched.starttime, "running")
        log.info("guard: started job %d (%s) pid %d", job.id, job.name, launched.pid)


def _read_status(job: Job) -> dict | None:
    if not job.status_path:
        return None
    try:
        with open(job.status_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _describe_rc(rc: int | None) -> str:
    if rc is None:
        return "unknown exit status"
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    if rc > 128:
        try:
            return f"exit code {rc} ({signal.Signals(rc - 128).name}?)"
        except ValueError:
            pass
    return f"exit code {rc}"
