"""The guard's supervisor: one loop that admits queued jobs, watches the running ones and
records every change in the store.

Each tick (``poll_hz``, default 10 per second): sample memory, apply the watchdog (signals first,
database after, so a slow write never delays a pause), reap ended jobs, act on cancel requests,
escalate stops whose grace expired, then admit the next job if a slot is free.

Restart semantics: jobs run in their own session and survive the supervisor. A new supervisor
finds every ``running``/``paused`` job; if its (pid, start time) is still alive it is re-adopted
and watched like any other, otherwise it is marked ``failed``/``killed`` ("guard restarted; job was
running, not re-run") and never started again.

Database faults (disk full, read-only file system, I/O errors: :class:`.store.StoreFault`): the
watchdog goes on (it signals from what it holds in memory), the job-state changes the store refuses
are kept, in order, and written once it works again; nothing is admitted meanwhile. The store is
retried with backoff (``RETRY_MIN_S`` doubling to ``RETRY_MAX_S``); the fault is logged once when
it starts and once when it ends, and ``visionserve_guard_store_fault`` reads 1 while it lasts.
Any other error in a tick is logged (with its traceback, once) and the loop goes on.

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
from collections import deque
from dataclasses import dataclass, field

from . import admission, metrics, proc, watchdog
from .launcher import LaunchSettings, launch, write_site_dir
from .memory import MemorySample, MemorySource
from .store import ACTIVE, Job, JobStore, StoreFault

log = logging.getLogger(__name__)

#: after a database fault the store is retried after RETRY_MIN_S, doubling up to RETRY_MAX_S
RETRY_MIN_S = 0.1
RETRY_MAX_S = 5.0


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
        self._pending: deque = deque()  # (store method, args, kwargs): job records not written yet
        self._fault: StoreFault | None = None  # the store's refusal, while it lasts
        self._fault_since = 0.0
        self._backoff = 0.0
        self._retry_at = 0.0
        self._tick_error: str | None = None
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
    def start(self) -> bool:
        """Take the database's lease and recover jobs left by a previous supervisor, retrying
        while the database refuses; False if asked to stop before it worked."""
        while True:
            try:
                self.store.acquire_lease(self._pid, proc.starttime(self._pid) or 0,
                                         self.source.uuid if self.source else None, proc.is_alive)
                self.recover()
                break
            except StoreFault as exc:
                self._store_failed(exc)
                if self.stopping.wait(self._retry_at - time.monotonic()):
                    return False
        self._store_ok()
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
        return True

    def run_forever(self) -> None:
        """Tick until :meth:`request_stop`; then shut down as configured."""
        period = 1.0 / self.cfg.poll_hz
        try:
            if not self.start():
                return
            while not self.stopping.is_set():
                t0 = time.monotonic()
                self._guarded_tick()
                self.stopping.wait(max(0.0, period - (time.monotonic() - t0)))
            self.shutdown()
        finally:
            try:
                self._flush()
                self.store.release_lease(self._pid)
            except StoreFault as exc:
                log.error("guard: exiting with %d job record(s) unwritten and the lease held: %s "
                          "(the next guard settles the jobs when it recovers them)",
                          len(self._pending), exc.cause)

    def _guarded_tick(self) -> None:
        """A tick whose unexpected error is logged (once, until a tick works again), not fatal:
        a dead loop would leave running jobs unwatched and queued ones waiting for ever."""
        try:
            self.tick()
        except Exception as exc:
            if self._tick_error != repr(exc):
                log.exception("guard: supervisor tick failed; retrying every tick")
            self._tick_error = repr(exc)
            return
        if self._tick_error is not None:
            log.info("guard: supervisor ticks work again")
            self._tick_error = None

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
            if job.id in self.active:  # re-adopted by an attempt the database cut short
                continue
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
        self._escalate()
        if time.monotonic() < self._retry_at:
            return  # the database refused: its retry is not due yet
        try:
            self._flush()
            self._cancels()
            if not self._draining and not self.stopping.is_set():
                self._admit(sample)
            self._flush()
            self._heartbeat()
        except StoreFault as exc:
            self._store_failed(exc)
        else:
            self._store_ok()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= 1.0:
            self.store.heartbeat(self._pid)
            counts = self.store.counts()
            metrics.JOBS_QUEUED.set(counts["queued"])
            metrics.JOBS_RUNNING.set(counts["running"])
            metrics.JOBS_PAUSED.set(counts["paused"])
            self._last_heartbeat = now

    # -- the job database's faults --------------------------------------------------------------
    def _record(self, method, *args, **kwargs) -> None:
        """A job-state change for the store, written in order after those before it at the next
        store access of this tick (or, while the store refuses, once it works again): signals
        and process bookkeeping never wait for the database."""
        self._pending.append((method, args, kwargs))

    def _flush(self) -> None:
        while self._pending:
            method, args, kwargs = self._pending[0]
            try:
                method(*args, **kwargs)
            except StoreFault:
                raise
            except Exception:  # not the disk's fault: retrying cannot help
                log.exception("guard: dropped job record change %s%r", method.__name__, args)
            self._pending.popleft()

    def _store_failed(self, exc: StoreFault) -> None:
        now = time.monotonic()
        metrics.STORE_ERRORS.inc()
        if self._fault is None:
            self._fault_since, self._backoff = now, RETRY_MIN_S
            metrics.STORE_FAULT.set(1)
            log.error("guard: %s. Running jobs stay watched; no job starts, and job records wait "
                      "for the database (retried every %g s at most)", exc.message, RETRY_MAX_S)
        else:
            self._backoff = min(RETRY_MAX_S, 2 * self._backoff)
        self._fault = exc
        self._retry_at = now + self._backoff

    def _store_ok(self) -> None:
        if self._fault is None:
            return
        log.warning("guard: the job database works again after %.1f s (%s); job records are up "
                    "to date", time.monotonic() - self._fault_since, self._fault.cause)
        self._fault, self._backoff, self._retry_at = None, 0.0, 0.0
        metrics.STORE_FAULT.set(0)

    def _sample(self) -> MemorySample | None:
        if self.source is None:
            return None
        try:
            s = self.source.sample()
        except Exception as exc:  # noqa: BLE001 NVML hiccup: go on, admit nothing until it answers
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
                self._record(self.store.set_paused, a.job.id, act.reason)
            elif act.kind == "resume":
                proc.signal_group(a.pgid, signal.SIGCONT)
                a.state = "running"
                metrics.INTERVENTIONS.labels("resume", act.trigger).inc()
                log.info("guard: job %d %s", a.job.id, act.reason)
                self._record(self.store.set_resumed, a.job.id, act.reason)
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
        self._record(self.store.set_reason, a.job.id, f"stopping: {reason}")

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
            self._record(self.store.finish, job_id, state, exit_code=rc, reason=reason)
            log.info("guard: job %d ended: %s (%s)", job_id, state, _describe_rc(rc))

    # -- admission ------------------------------------------------------------------------------
    def _admit(self, sample: MemorySample | None) -> None:
        while len(self.active) < self.cfg.concurrency:
            self._flush()  # claims come after the records before them
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
                        self._record(self.store.finish, job.id, "failed", exit_code=None,
                                     reason=f"not admitted: {d.reason}")
                        log.error("guard: job %d can never fit: %s", job.id, d.reason)
                    continue
                if not d.admit:
                    if self._last_wait_reason.get(job.id) != d.reason.split(":")[0]:
                        self._last_wait_reason[job.id] = d.reason.split(":")[0]
                        log.info("guard: job %d %s", job.id, d.reason)
                        self._record(self.store.set_reason, job.id, d.reason)
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
            self._record(self.store.finish, job.id, "failed", exit_code=None,
                         reason=f"cannot start: {exc}")
            log.error("guard: job %d cannot start: %s", job.id, exc)
            return
        # watched from now on, whether or not the database takes the records at once
        self.active[job.id] = Active(claimed, launched.popen, launched.pid, launched.starttime,
                                     "running")
        self._record(self.store.set_process, job.id, launched.pid, launched.starttime)
        self._record(self.store.set_reason, job.id, None)
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
