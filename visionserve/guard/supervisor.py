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

Sharing the GPU (once a second, :mod:`.sharing`): each job's yield statistics are read, its
mechanism recorded (``yield`` while its hook reports, else ``process``), the metrics updated, the
threads of its tree checked for SCHED_IDLE, and, with a latency budget, the duty cycle of
cooperative jobs moved after the served p99 (down 30 % when over the budget, up 0.1 when under
80 % of it, never under their minimum share). A job gets the server's busy word when this process
serves (the guard hosted by ``serve --guard``) or ``VISIONSERVE_GUARD_SHARE`` names one.

Shutdown (SIGTERM/SIGINT): no new job starts; running jobs are left running (they are re-adopted
by the next supervisor) unless ``stop_jobs_on_exit``, which stops each one (SIGTERM, grace,
SIGKILL) and records it ``killed``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from . import admission, metrics, proc, share, watchdog
from .launcher import LaunchSettings, launch, write_site_dir, yield_stats_path
from .memory import MemorySample, MemorySource
from .sharing import JobSharing, WaitEstimate, audit_sched
from .store import ACTIVE, Job, JobStore, StoreFault

log = logging.getLogger(__name__)

#: after a database fault the store is retried after RETRY_MIN_S, doubling up to RETRY_MAX_S
RETRY_MIN_S = 0.1
RETRY_MAX_S = 5.0
#: sharing figures are read every SHARING_S, written to the store every SHARING_RECORD_S, the
#: jobs' threads checked for SCHED_IDLE every AUDIT_S; the duty cycle moves every DUTY_S
SHARING_S = 1.0
SHARING_RECORD_S = 5.0
AUDIT_S = 5.0
DUTY_S = 0.5


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
    #: CPUs jobs may run on, e.g. "4-15" (leaves 0-3 to the server and its clients); "": all
    job_cpus: str = ""
    #: give PyTorch jobs the server's busy word, so they yield while it runs a batch
    cooperative: bool = True
    yield_max_wait_ms: float = 50.0
    yield_min_share: float = 0.3
    yield_depth: int = 16
    yield_queue_ms: float = 2.0
    yield_mode: str = "wait"
    #: CUDA MPS (:mod:`.mps`): the daemon's pipe and log directories jobs join; "": none
    mps_pipe_dir: str = ""
    mps_log_dir: str = ""
    mps_job_sm_percent: int = 50

    @property
    def floor(self) -> int:
        return self.inference_floor + self.margin


@dataclass
class Active:
    job: Job
    popen: subprocess.Popen | None  # None for a job re-adopted after a restart
    pid: int
    starttime: int | None
    state: str  # running | paused
    stop_state: str | None = None  # killed | cancelled: the terminal state once it exits
    stop_reason: str | None = None
    kill_at: float | None = None
    killed: bool = False
    notes: list[str] = field(default_factory=list)
    sharing: JobSharing | None = None
    recorded_at: float = 0.0  # when its sharing figures were last written to the store

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
        self._sharing_at = self._audit_at = self._duty_at = 0.0
        self._wait_estimate = WaitEstimate()
        self.duty = 1.0
        self._sm_since = 0
        self._published = False  # this supervisor published the busy word (hosted guard)
        self._pid = os.getpid()
        total = None
        if source is not None:
            total, _ = source.device_memory()
        self._total = total
        self.launch_settings = LaunchSettings(
            gpu_uuid=source.uuid if source is not None else None, gpu_total=total,
            context_reserve=self.cfg.context_reserve, nice=self.cfg.nice,
            sched_idle=self.cfg.sched_idle,
            site_dir=write_site_dir(os.path.join(store.log_dir, "jobsite")), cpus=self.cfg.job_cpus,
            yield_max_wait_ms=self.cfg.yield_max_wait_ms, yield_min_share=self.cfg.yield_min_share,
            yield_depth=self.cfg.yield_depth, yield_queue_ms=self.cfg.yield_queue_ms,
            yield_mode=self.cfg.yield_mode, mps_pipe_dir=self.cfg.mps_pipe_dir,
            mps_log_dir=self.cfg.mps_log_dir, mps_job_sm_percent=self.cfg.mps_job_sm_percent)

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
        share.remove_stale()  # busy words of servers that died
        budget = self._latency_budget()
        if budget is not None:
            log.info("guard: running jobs pause while the served p99 is over %g ms (resume under "
                     "%g ms)", budget, watchdog.RESUME_FRACTION * budget)
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
            if self._published:  # jobs left running read the word of a dead server as idle
                share.unpublish()
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
                self.active[job.id] = Active(job, None, job.pid, job.pid_starttime, job.state,
                                             sharing=JobSharing(yield_stats_path(job),
                                                                mps=job.mechanism == "mps"))
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
        self._share_tick()
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
        views = [watchdog.JobView(a.job.id, a.job.policy, a.state, a.job.gpu_mem, usage[i],
                                  cooperative=a.sharing is not None and a.sharing.cooperative)
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
                if a.sharing is not None:
                    a.sharing.paused(time.monotonic())
                metrics.INTERVENTIONS.labels("pause", act.trigger).inc()
                log.warning("guard: job %d %s", a.job.id, act.reason)
                self._record(self.store.set_paused, a.job.id, act.reason)
            elif act.kind == "resume":
                proc.signal_group(a.pgid, signal.SIGCONT)
                a.state = "running"
                if a.sharing is not None:
                    a.sharing.resumed(time.monotonic())
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
            if a.sharing is not None:  # its last figures; the hook's file goes with the job
                a.sharing.resumed(time.monotonic())
                a.sharing.read()
                self._record(self.store.set_sharing, job_id, a.sharing.recorded,
                             a.sharing.summary())
                a.sharing.remove_stats()
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
                if a.sharing is not None and a.sharing.mps and _ran_out_of_memory(a.job):
                    reason = (f"{reason}; CUDA out of memory at its declared "
                              f"{a.job.gpu_mem / 2**30:.2f} GiB (the MPS limit)")
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
        settings = dataclasses.replace(self.launch_settings, share_path=self._share_path())
        on_mps = bool(settings.mps_pipe_dir)
        try:
            launched = launch(claimed, settings)
        except OSError as exc:
            self._record(self.store.finish, job.id, "failed", exit_code=None,
                         reason=f"cannot start: {exc}")
            log.error("guard: job %d cannot start: %s", job.id, exc)
            return
        # watched from now on, whether or not the database takes the records at once
        self.active[job.id] = Active(claimed, launched.popen, launched.pid, launched.starttime,
                                     "running", sharing=JobSharing(yield_stats_path(claimed),
                                                                   mps=on_mps))
        self._record(self.store.set_process, job.id, launched.pid, launched.starttime)
        self._record(self.store.set_reason, job.id, None)
        log.info("guard: started job %d (%s) pid %d", job.id, job.name, launched.pid)


    # -- sharing the GPU ------------------------------------------------------------------------
    def _share_path(self) -> str:
        """The busy word a new job gets: the one named by VISIONSERVE_GUARD_SHARE, or one this
        process publishes when batchers serve here (the hosted guard); "" for none."""
        if not self.cfg.cooperative:
            return ""
        named = os.environ.get(share.SHARE_ENV)
        if named:
            return named
        if share.serving():
            try:
                path = share.publish()
                self._published = True
                return path
            except OSError as exc:
                log.warning("guard: cannot publish the server's busy word (%s); jobs will not "
                            "yield", exc)
        return ""

    def _share_tick(self) -> None:
        """Once a second: every job's sharing figures; the duty cycle twice a second."""
        now = time.monotonic()
        if now - self._duty_at >= DUTY_S:
            self._duty_at = now
            self._steer_duty()
        if now - self._sharing_at < SHARING_S:
            return
        self._sharing_at = now
        running = [a for a in self.active.values() if a.state == "running" and a.sharing]
        self._wait_estimate.update(bool(running))
        util = self._sm_util()
        audit = now - self._audit_at >= AUDIT_S
        if audit:
            self._audit_at = now
        by_mechanism = {"mps": 0, "yield": 0, "process": 0}
        shares = []
        for a in self.active.values():
            sh = a.sharing
            if sh is None:
                continue
            changed = sh.read(now)
            if a.state == "running":
                by_mechanism[sh.mechanism] += 1
                if sh.time_share is not None:
                    shares.append(sh.time_share)
            if util is not None:
                if audit or not sh.pids:  # the job's processes, refreshed with the audit
                    sh.pids = {m.pid for m in proc.session_members(a.pid)}
                sh.sm_util = sum(v for p, v in util.items() if p in sh.pids)
            if audit:
                sh.sched = audit_sched(a.pid, self.cfg.sched_idle)
            if changed:
                log.info("guard: job %d shares the GPU by %s", a.job.id,
                         "CUDA MPS" if sh.mps else "yielding at module boundaries"
                         if sh.cooperative else "the process-level policies (no active hook)")
            if changed or now - a.recorded_at >= SHARING_RECORD_S:
                a.recorded_at = now
                self._record(self.store.set_sharing, a.job.id, sh.recorded, sh.summary(now))
        for mech, n in by_mechanism.items():
            metrics.JOBS_BY_MECHANISM.labels(mech).set(n)
        if shares:
            metrics.JOB_TIME_SHARE.set(min(shares))
        if util is not None:
            metrics.JOB_GPU_UTIL.set(sum(a.sharing.sm_util or 0.0 for a in self.active.values()
                                         if a.sharing is not None))

    def _sm_util(self) -> dict[int, float] | None:
        fn = getattr(self.source, "process_sm_util", None)
        if fn is None or not self.active:
            return None
        try:
            got = fn(self._sm_since)
        except Exception:  # noqa: BLE001 a figure, never a reason to fail the tick
            return None
        if got is None:
            return None
        util, self._sm_since = got
        return util

    def _steer_duty(self) -> None:
        """With a latency budget, cooperative jobs run at a duty cycle that follows the served
        p99 (rate limiting through their hook); without one, or without cooperative jobs, none."""
        budget = self._latency_budget()
        coop = any(a.sharing is not None and a.sharing.cooperative and a.state == "running"
                   for a in self.active.values())
        duty = self.duty
        if budget is None or not coop:
            duty = 1.0
        else:
            p99 = self.latency()
            if p99 is not None and p99 > budget:
                duty = max(self.cfg.yield_min_share, duty * 0.7)
            elif p99 is None or p99 <= watchdog.RESUME_FRACTION * budget:
                duty = min(1.0, duty + 0.1)
        if duty != self.duty or duty < 1.0:
            share.set_duty(duty)
        self.duty = duty
        metrics.DUTY.set(duty)


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


def _ran_out_of_memory(job: Job, tail_bytes: int = 16384) -> bool:
    """Whether the end of the job's log reports a CUDA out-of-memory error (an MPS client held to
    its declared memory fails that way, not through the watchdog)."""
    try:
        with open(job.log_path or "", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            text = f.read().decode("utf-8", "replace").lower()
    except OSError:
        return False
    return "out of memory" in text
