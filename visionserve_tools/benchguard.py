"""Acceptance run of the training-queue guard (issue 8) in one script.

    python -m visionserve_tools.benchguard --out result.json [--log-dir DIR] [--device cuda|cpu]
        [--quick]

1. Starts ``visionserve serve --guard`` (on cuda: the ResNet-50 bench model of
   :mod:`visionserve_tools.benchgpu`, torch fp16, with ``--gpu-memory-budget``; on cpu: the
   shipped default model, no budget).
2. Measures saturation (closed loop, several client processes), then drives an open-loop paced
   load at ``--load-fraction`` (default 50 %) of it from several processes for the whole run;
   every request's latency is measured from its *scheduled* send time (no coordinated omission)
   and any answer but 200 is an error. Phase ``baseline``: the load alone.
3. Phase ``training``: the project's own trainer, ``python -m visionserve_tools.training.train``
   (small settings, its output in a temporary ``--models-dir``) submitted through
   ``POST /v1/guard/jobs`` with a declared GPU memory need; the phase is the time the job is
   ``running``.
4. Phase ``hostile`` (cuda only): a job that allocates GPU memory in a loop until it fails, policy
   ``--hostile-policy``; the watchdog must stop (or pause) it; its recorded reason is read back.
5. Writes ``--out`` (JSON, saved after every phase): saturation, rate, per phase count / errors /
   p50 / p90 / p99, the p99 ratio training/baseline, both jobs' states, OOM lines in the server
   log, the guard's GPU free-memory minimum from ``/metrics``, and ``pass`` with the conditions
   that held. Exit 0 when the run completed (pass or not: see ``pass``), 1 when it was aborted
   (``error`` in the JSON), 2 on bad arguments.

Server log, the guard database and the jobs' logs go to ``--log-dir`` (default: beside --out).
Needs only the server's dependencies; the training job also needs ``onnx`` and ``onnxruntime``
(train.py exports and checks the model it wrote).
"""

from __future__ import annotations

import argparse
import array
import http.client
import json
import multiprocessing as mp
import os
import queue
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .benchgpu import Server, export_models, get, load, make_jpegs

TRAIN_MODULE = "visionserve_tools.training.train"
OOM = re.compile(r"out of memory|OutOfMemory|CUDA error", re.IGNORECASE)
FINAL = ("succeeded", "failed", "cancelled", "killed")
P99_RATIO_LIMIT = 1.5

# A job that ignores its declaration: lifts the allocator cap the guard injected and allocates
# 256 MiB every 20 ms until CUDA refuses (the watchdog is meant to act long before that).
HOSTILE = """
import time, torch
torch.cuda.set_per_process_memory_fraction(1.0)
hold = []
while True:
    hold.append(torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    time.sleep(0.02)
"""

# train.py settings: small, so the job runs about a minute on the H200 (quick: ~25 s) and
# seconds on a CPU; its output goes to a temporary --models-dir, never to the repository.
TRAIN_ARGS = {
    ("cuda", False): "--epochs 12 --n-per-label 300 --val-per-label 20 --workers 4 --batch-size 64",
    ("cuda", True): "--epochs 4 --n-per-label 100 --val-per-label 10 --workers 4 --batch-size 64",
    ("cpu", False): "--epochs 2 --n-per-label 40 --val-per-label 4 --sizes 640x480 --workers 1 "
                    "--check-per-label 2",
    ("cpu", True): "--epochs 1 --n-per-label 8 --val-per-label 2 --sizes 640x480 --workers 1 "
                   "--check-per-label 1 --batch-size 16",
}


def log(msg: str) -> None:  # CLI progress output
    print(f"[benchguard {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    device: str
    quick: bool
    saturation_s: float
    warmup_s: float
    baseline_s: float
    settle_s: float
    train_args: list[str]
    train_gpu_mem: str
    train_timeout_s: float
    hostile_gpu_mem: str
    hostile_policy: str
    hostile_timeout_s: float
    budget: str | None
    load_fraction: float
    rate: float | None
    deadline_ms: float | None
    processes: int
    threads: int


def make_plan(args: argparse.Namespace) -> Plan:
    cuda, q = args.device == "cuda", args.quick
    return Plan(
        device=args.device, quick=q,
        saturation_s=5.0 if q else 10.0, warmup_s=1.0 if q else 2.0,
        baseline_s=args.baseline_s or ((10.0 if cuda else 6.0) if q else 30.0),
        settle_s=3.0 if q else 5.0,
        train_args=shlex.split(args.train_args if args.train_args is not None
                               else TRAIN_ARGS[(args.device, q)]),
        train_gpu_mem=args.train_gpu_mem if cuda else "0",
        train_timeout_s=150.0 if q else 240.0,
        hostile_gpu_mem=args.hostile_gpu_mem, hostile_policy=args.hostile_policy,
        hostile_timeout_s=60.0,
        budget=args.gpu_memory_budget if cuda else None,
        load_fraction=args.load_fraction, rate=args.rate,
        deadline_ms=paced_deadline_ms(args.deadline_ms, cuda),
        processes=args.processes or min(8, max(2, (os.cpu_count() or 8) // 2)),
        # senders per client process: enough that a second-long stall does not run out of them
        # (then the send lag is the client's, not a queue behind slow answers)
        threads=64 if cuda else 8)


# --- open-loop paced load --------------------------------------------------------------------

#: columns of a request record: scheduled time (monotonic s), latency from the schedule (ms),
#: send lag (ms: sent - scheduled), HTTP status (0: no answer), the server's own time (ms, its
#: answer's timing.total_ms; -1 when absent), round trip from the actual send (ms), and the
#: scheduler's wake-up lateness (ms: this client process's own CPU and timers)
RECORD = (("sched", "d"), ("latency", "d"), ("lag", "d"), ("status", "H"), ("server", "d"),
          ("rtt", "d"), ("wake", "d"), ("queue", "d"), ("compute", "d"))
_TOTAL_MS = re.compile(rb'"total_ms":\s*([0-9.]+)')
_QUEUE_MS = re.compile(rb'"queue_ms":\s*([0-9.]+)')
_COMPUTE_MS = re.compile(rb'"compute_ms":\s*([0-9.]+)')


def _paced_client(idx: int, procs: int, threads: int, port: int, model: str, jpegs: list[bytes],
                  rate: float, deadline_ms: float | None, max_s: float, t0_value, go, stop,
                  out_q) -> None:
    """One client process. The run's global schedule is request n at ``t0 + n / rate``; this
    process owns slots ``idx, idx + procs, ...``. A scheduler thread wakes at each slot's time and
    hands it to a pool of ``threads`` senders (a keep-alive connection each), so a slow answer does
    not delay the sends behind it unless every sender is busy (then the send lag says so). The
    scheduler's own lateness is recorded apart: it is this process's CPU, not the server."""
    out_q.put(("ready", idx))
    if not go.wait(120):
        out_q.put(("result", idx, *(b"" for _ in RECORD)))
        return
    t0 = t0_value.value
    t_end = t0 + max_s
    path = f"/v1/models/{model}/inspect"
    headers = {"Content-Type": "image/jpeg"}
    if deadline_ms is not None:
        headers["X-Deadline-Ms"] = str(deadline_ms)
    local_stop = threading.Event()
    lock = threading.Lock()
    cols = [array.array(code) for _, code in RECORD]
    work: queue.SimpleQueue = queue.SimpleQueue()

    def sender() -> None:
        conn = None
        mine: list[tuple] = []
        while True:
            item = work.get()
            if item is None:
                break
            t_s, woke, n = item
            sent = time.monotonic()
            body = b""
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("POST", path, body=jpegs[n % len(jpegs)], headers=headers)
                r = conn.getresponse()
                body = r.read()
                code = r.status
            except (OSError, http.client.HTTPException):
                code = 0
                if conn is not None:
                    conn.close()
                conn = None
            done = time.monotonic()
            ms = [rx.search(body) if code == 200 else None
                  for rx in (_TOTAL_MS, _QUEUE_MS, _COMPUTE_MS)]
            total, queued, computed = (float(m.group(1)) if m else -1.0 for m in ms)
            mine.append((t_s, (done - t_s) * 1000, (sent - t_s) * 1000, code, total,
                         (done - sent) * 1000, (woke - t_s) * 1000, queued, computed))
        if conn is not None:
            conn.close()
        with lock:
            for row in mine:
                for col, v in zip(cols, row):
                    col.append(v)

    ts = [threading.Thread(target=sender, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()

    def watch() -> None:  # the run's stop (a multiprocessing event) -> this process's
        while not local_stop.is_set():
            if stop.wait(0.2):
                local_stop.set()

    threading.Thread(target=watch, daemon=True).start()
    n = 0
    while True:
        t_s = t0 + (idx + n * procs) / rate
        n += 1
        if t_s > t_end:
            break
        delay = t_s - time.monotonic()
        if delay > 0 and local_stop.wait(delay):
            break
        if local_stop.is_set():
            break
        work.put((t_s, time.monotonic(), idx + n))
    local_stop.set()
    for _ in ts:
        work.put(None)
    for t in ts:
        t.join()
    out_q.put(("result", idx, *(c.tobytes() for c in cols)))


class PacedLoad:
    """``processes`` client processes sending ``rate`` requests/s in total until :meth:`stop`."""

    def __init__(self, port: int, model: str, jpegs: list[bytes], rate: float, processes: int,
                 threads: int, deadline_ms: float | None, max_s: float) -> None:
        ctx = mp.get_context("spawn")
        self._stop, self._go = ctx.Event(), ctx.Event()
        self._t0 = ctx.Value("d", 0.0)
        self._q = ctx.Queue()
        self.records: list[tuple] = []
        self.missing = 0
        self._stopped = False
        self.procs = [ctx.Process(target=_paced_client, daemon=True, args=(
            i, processes, threads, port, model, jpegs, rate, deadline_ms, max_s, self._t0,
            self._go, self._stop, self._q)) for i in range(processes)]
        try:
            for p in self.procs:
                p.start()
            ready, deadline = 0, time.monotonic() + 120
            while ready < processes:  # spawn start-up (imports) is not part of the schedule
                msg = self._q.get(timeout=max(0.1, deadline - time.monotonic()))
                ready += msg[0] == "ready"
        except BaseException:
            self._stop.set()
            self._go.set()
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            raise
        self.t0 = time.monotonic() + 0.5
        self._t0.value = self.t0
        self._go.set()

    def stop(self) -> list[tuple]:
        """Stop the senders and return their rows (:data:`RECORD`), by scheduled time."""
        if self._stopped:
            return self.records
        self._stopped = True
        self._stop.set()
        self._go.set()
        got = 0
        try:
            while got < len(self.procs):
                msg = self._q.get(timeout=90)
                if msg[0] != "result":
                    continue
                got += 1
                cols = []
                for raw, (_, code) in zip(msg[2:], RECORD):
                    a = array.array(code)
                    a.frombytes(raw)
                    cols.append(a)
                self.records.extend(zip(*cols))
        except (queue.Empty, OSError, EOFError) as exc:  # a client died: keep what arrived
            log(f"paced load: {len(self.procs) - got} client(s) returned nothing ({exc!r})")
            self.missing = len(self.procs) - got
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.records.sort()
        return self.records


def _q(sorted_values: list[float], f: float) -> float:
    return round(sorted_values[min(len(sorted_values) - 1, int(f * len(sorted_values)))], 3)


def paced_deadline_ms(asked: float | None, cuda: bool) -> float | None:
    """The paced requests' ``X-Deadline-Ms``: ``asked``, or on cuda the model's own (None), on
    the CPU 1000 ms: a shipped model's 200 ms takt would count a shared CPU box's scheduler
    hiccups as errors."""
    return asked if asked is not None else (None if cuda else CPU_DEADLINE_MS)


CPU_DEADLINE_MS = 1000.0


def phase_stats(records: list[tuple], a: float, b: float) -> dict:
    """Requests *scheduled* in [a, b): count, errors (any answer but 200), latency percentiles from
    the schedule (what a line sees), and apart from it: the server's own time (``server_*``), the
    round trip from the actual send (``rtt_p99_ms``), the send lag and the client scheduler's own
    lateness (``client_wake_lag_p99_ms``: the load generator's CPU, not the server)."""
    rows = [r for r in records if a <= r[0] < b]
    ok = sorted(r[1] for r in rows if r[3] == 200)
    errors: dict[str, int] = {}
    for r in rows:
        if r[3] != 200:
            key = str(r[3]) if r[3] else "connection"
            errors[key] = errors.get(key, 0) + 1
    lags = sorted(r[2] for r in rows)
    out = {"window_s": round(b - a, 2), "count": len(rows), "errors": sum(errors.values()),
           "errors_by_status": errors,
           "rate_per_s": round(len(rows) / (b - a), 1) if b > a else None}
    if ok:
        out.update(p50_ms=_q(ok, 0.5), p90_ms=_q(ok, 0.9), p99_ms=_q(ok, 0.99),
                   max_ms=round(ok[-1], 3))
    if lags:
        out["send_lag_p99_ms"] = _q(lags, 0.99)
    if rows and len(rows[0]) >= len(RECORD):
        srv = sorted(r[4] for r in rows if r[3] == 200 and r[4] >= 0)
        if srv:
            out.update(server_p50_ms=_q(srv, 0.5), server_p90_ms=_q(srv, 0.9),
                       server_p99_ms=_q(srv, 0.99), server_max_ms=round(srv[-1], 3))
            outside = sorted(r[5] - r[4] for r in rows if r[3] == 200 and r[4] >= 0)
            out["outside_server_p99_ms"] = _q(outside, 0.99)  # HTTP, network, both event loops
        rtt = sorted(r[5] for r in rows if r[3] == 200)
        if rtt:
            out["rtt_p99_ms"] = _q(rtt, 0.99)
        out["client_wake_lag_p99_ms"] = _q(sorted(r[6] for r in rows), 0.99)
    return out


# --- the guard over HTTP ---------------------------------------------------------------------

def post_json(url: str, body: dict, timeout: float = 10.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def submit(server: Server, **body) -> dict:
    code, job = post_json(server.url + "/v1/guard/jobs", body)
    if code != 201:
        raise RuntimeError(f"POST /v1/guard/jobs answered {code}: {job}")
    log(f"submitted job {job['id']} ({job['name']}): gpu_mem {job['gpu_mem']}, "
        f"policy {job['policy']}")
    return job


def job_of(server: Server, job_id: int) -> dict | None:
    code, body = get(f"{server.url}/v1/guard/jobs/{job_id}")
    return json.loads(body) if code == 200 else None


def log_tail(server: Server, job_id: int, n: int = 1500) -> str:
    body = get(f"{server.url}/v1/guard/jobs/{job_id}/logs?tail_bytes={n}")[1]
    return body.decode("utf-8", "replace")


def follow(server: Server, job_id: int, until, timeout: float, seen: list[dict] | None = None
           ) -> tuple[dict, list, bool]:
    """Poll the job (5 Hz: a negligible load beside the paced one) until ``until(job)``;
    returns (last job, its state transitions appended to ``seen``, timed out)."""
    deadline = time.monotonic() + timeout
    seen = [] if seen is None else seen
    job: dict = {}
    while time.monotonic() < deadline:
        j = job_of(server, job_id)
        if j is not None:
            job = j
            if not seen or (seen[-1]["state"], seen[-1]["reason"]) != (j["state"], j["reason"]):
                seen.append({"t": round(time.time(), 3), "state": j["state"],
                             "reason": j["reason"]})
                log(f"job {job_id}: {j['state']}" + (f" ({j['reason']})" if j["reason"] else ""))
            if until(j):
                return job, seen, False
        time.sleep(0.2)
    return job, seen, True


def cancel(server: Server, job_id: int, seen: list[dict], timeout: float = 30.0) -> dict:
    """Cancel through the API and wait for the end (the guard stops a running job)."""
    post_json(f"{server.url}/v1/guard/jobs/{job_id}/cancel", {})
    return follow(server, job_id, lambda j: j["state"] in FINAL, timeout, seen)[0]


def kill_jobs(db: Path, grace_s: float = 5.0) -> list[int]:
    """Stop every job of the guard database ``db`` whose process is still alive (SIGTERM to its
    group, SIGKILL after ``grace_s``) and cancel queued ones. The guard deliberately leaves jobs
    running when its server stops; a benchmark must not leave a GPU job behind."""
    if not Path(db).exists():
        return []
    from visionserve.errors import VisionServeError
    from visionserve.guard import proc
    from visionserve.guard.store import ACTIVE, JobStore

    store = JobStore(db)
    for j in store.list(("queued",)):
        try:
            store.request_cancel(j.id)
        except VisionServeError as exc:  # it started or ended meanwhile
            log(f"cleanup: job {j.id}: {exc.message}")
    alive = [(j.id, j.pid) for j in store.list(ACTIVE)
             if j.pid and proc.is_alive(j.pid, j.pid_starttime)]
    for _, pid in alive:
        proc.signal_group(pid, signal.SIGTERM)
        proc.signal_group(pid, signal.SIGCONT)  # a paused job must wake to die
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(proc.session_members(pid) for _, pid in alive):
        time.sleep(0.1)
    for _, pid in alive:
        if proc.session_members(pid):
            proc.signal_group(pid, signal.SIGKILL)
    return [job_id for job_id, _ in alive]


class MetricsSampler(threading.Thread):
    """Samples the server's /metrics (the hosted guard's gauges) at 2 Hz: GPU free minimum."""

    PREFIXES = ("visionserve_guard_", "visionserve_gpu_memory_")

    def __init__(self, server: Server, gpu: bool) -> None:
        super().__init__(daemon=True, name="metrics")
        self.server, self.gpu = server, gpu
        self.min_free: float | None = None
        self.min_headroom: float | None = None
        self.floor: float | None = None
        self.samples = 0
        self.last: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            m = self.server.metrics(self.PREFIXES)
            if not m:
                continue
            self.samples += 1
            self.last = m
            free = m.get("visionserve_guard_gpu_free_bytes")
            if self.gpu and free:  # 0 until the supervisor's first sample; always 0 without GPU
                self.min_free = free if self.min_free is None else min(self.min_free, free)
                head = m.get("visionserve_guard_headroom_bytes")
                if head is not None:
                    self.min_headroom = head if self.min_headroom is None \
                        else min(self.min_headroom, head)
                self.floor = m.get("visionserve_guard_inference_floor_bytes")

    def report(self) -> dict:
        self.done.set()
        self.join(5)
        def gib(v: float | None) -> float | None:
            return None if v is None else round(v / 2**30, 3)

        out: dict[str, Any] = {"samples": self.samples, "gpu_free_min_gib": gib(self.min_free),
               "headroom_min_gib": gib(self.min_headroom), "inference_floor_gib": gib(self.floor),
               "interventions": {k: v for k, v in self.last.items()
                                 if k.startswith("visionserve_guard_interventions_total{")}}
        if not self.gpu:
            out["note"] = "no GPU: the guard runs as a serial job queue, no memory figures"
        return out


class CpuSampler(threading.Thread):
    """Once a second, per task (thread) of the server, the client processes and the guard's jobs:
    time on a CPU and time runnable but waiting for one (``/proc/<pid>/task/<tid>/schedstat``).
    :meth:`window` gives both per second of a phase: a process starved of CPU shows as run-queue
    wait. Also counts the jobs' threads that are not under SCHED_IDLE (the guard's claim).
    Jobs are found as the server's children that lead their own session (the guard's wrappers)."""

    def __init__(self, server_pid: int, client_pids: list[int], interval_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="cpu")
        self.server_pid, self.client_pids, self.interval = server_pid, client_pids, interval_s
        self.samples: list[tuple[float, dict[str, dict[int, tuple[int, int]]], int]] = []
        self.done = threading.Event()

    @staticmethod
    def _tasks(pids) -> dict[int, tuple[int, int]]:
        out = {}
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        on_cpu, wait = f.read().split()[:2]
                except (OSError, ValueError):
                    continue
                out[int(tid)] = (int(on_cpu), int(wait))
        return out

    def _job_pids(self) -> list[int]:
        from visionserve.guard import proc

        leaders = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = proc.stat(int(name))
                if st is not None and st.ppid == self.server_pid and st.sid == st.pid:
                    leaders.append(st.pid)
        return [m.pid for pid in leaders for m in proc.session_members(pid)]

    def run(self) -> None:
        idle = getattr(os, "SCHED_IDLE", None)
        while not self.done.wait(self.interval):
            jobs = self._job_pids()
            tasks = {"server": self._tasks([self.server_pid]),
                     "clients": self._tasks(self.client_pids), "jobs": self._tasks(jobs)}
            not_idle = 0
            for tid in tasks["jobs"]:
                try:
                    not_idle += os.sched_getscheduler(tid) != idle
                except OSError:
                    pass
            self.samples.append((time.monotonic(), tasks, not_idle))

    def window(self, a: float, b: float) -> dict:
        inside = [x for x in self.samples if a <= x[0] <= b]
        if len(inside) < 2:
            return {}
        (t0, s0, _), (t1, s1, _) = inside[0], inside[-1]
        out: dict = {}
        for group, tasks in s1.items():
            cpu = wait = 0
            for tid, (c, w) in tasks.items():
                c0, w0 = s0[group].get(tid, (0, 0))
                cpu, wait = cpu + c - c0, wait + w - w0
            out[group] = {"cpu_per_s": round(cpu / 1e9 / (t1 - t0), 3),
                          "runq_wait_per_s": round(wait / 1e9 / (t1 - t0), 4),
                          "threads": len(tasks)}
        out["jobs"]["threads_not_sched_idle_max"] = max(x[2] for x in inside)
        return out

    def stop(self) -> None:
        self.done.set()
        self.join(5)


# --- the run ---------------------------------------------------------------------------------

def oom_lines(path: Path, offset: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line.strip()[:400] for line in text.splitlines() if OOM.search(line)]


def to_mono(wall: float | None, offset: float) -> float | None:
    return None if wall is None else wall - offset


def job_summary(job: dict, seen: list, timed_out: bool, tail: str) -> dict:
    dur = job["ended_at"] - job["started_at"] \
        if job.get("ended_at") and job.get("started_at") else None
    return {"id": job.get("id"), "state": job.get("state"), "exit_code": job.get("exit_code"),
            "reason": job.get("reason"), "gpu_mem": job.get("gpu_mem"), "policy": job.get("policy"),
            "duration_s": round(dur, 1) if dur is not None else None,
            "wait_s": round(job["started_at"] - job["submitted_at"], 2)
            if job.get("started_at") else None,
            "timed_out": timed_out, "transitions": seen, "log_path": job.get("log_path"),
            "log_tail": tail[-1500:]}


def acceptance(args: argparse.Namespace, res: dict, save) -> None:
    plan = make_plan(args)
    res["plan"] = asdict(plan)
    log_dir: Path = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    db = (log_dir / f"guard-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sqlite").resolve()
    res["guard_db"] = str(db)
    cuda = plan.device == "cuda"
    missing = [m for m in ("onnx", "onnxruntime") if not _importable(m)]
    res["training_needs_missing"] = missing  # train.py's export step fails without them
    with tempfile.TemporaryDirectory(prefix="benchguard-") as tmp:
        tmp_path = Path(tmp)
        if cuda:
            repo, model = export_models(tmp_path / "models", ("rn50",))["rn50"], "rn50"
        else:
            from visionserve.config import default_models_dir

            repo, model = default_models_dir(), "defect-classifier"
        res["model"] = model
        jpegs = make_jpegs()
        server_log = log_dir / "server.log"
        log_offset = server_log.stat().st_size if server_log.exists() else 0
        # the memory guard's acceptance (issue 8): the watchdog, on the process-level sharing it
        # was measured with; CUDA MPS (the default on a GPU) holds a job by its own memory limit
        # and is measured by benchshare --mps
        extra = ["--guard", "--guard-db", str(db), "--no-guard-mps"]
        if plan.budget:
            extra += ["--gpu-memory-budget", plan.budget]
        if args.latency_budget_ms:
            extra += ["--guard-latency-budget-ms", f"{args.latency_budget_ms:g}"]
        res["server_args"] = extra
        server = paced = sampler = cpu = None
        windows: dict[str, tuple[float, float]] = {}
        try:
            server = Server(repo, server_log, *extra, device=plan.device)
            res["server_start_s"] = server.start_s
            log(f"server ready in {server.start_s} s on {plan.device}; measuring saturation")
            sampler = MetricsSampler(server, cuda)
            sampler.start()
            sat = load(server, model, jpegs, plan.processes, 8 if cuda else 4, plan.saturation_s)
            res["saturation"] = sat
            if not sat.get("answers"):
                raise RuntimeError(f"saturation run got no answers: {sat}")
            rate = plan.rate or round(plan.load_fraction * sat["throughput_per_s"], 1)
            res["rate_per_s"] = rate
            res["rate_source"] = "--rate" if plan.rate else f"{plan.load_fraction:g} x saturation"
            save()
            log(f"saturation {sat['throughput_per_s']}/s; paced load at {rate}/s "
                f"({plan.processes} processes x {plan.threads} threads)")
            max_s = (plan.warmup_s + plan.baseline_s + plan.train_timeout_s + plan.hostile_timeout_s
                     + plan.settle_s + 120)
            paced = PacedLoad(server.port, model, jpegs, rate, plan.processes, plan.threads,
                              plan.deadline_ms, max_s)
            cpu = CpuSampler(server.proc.pid, [p.pid for p in paced.procs if p.pid is not None])
            cpu.start()
            b0 = paced.t0 + plan.warmup_s
            time.sleep(max(0.0, b0 + plan.baseline_s - time.monotonic()))
            windows["baseline"] = (b0, b0 + plan.baseline_s)
            log(f"baseline done ({plan.baseline_s:g} s); submitting the training job")

            # training: the project's own script through the guard
            train_cmd = [sys.executable, "-m", TRAIN_MODULE,
                         "--models-dir", str(tmp_path / "train-models"),
                         "--device", plan.device, *plan.train_args]
            job = submit(server, name="train-defect-classifier", command=train_cmd, cwd=tmp,
                         env={"PYTHONUNBUFFERED": "1"}, gpu_mem=plan.train_gpu_mem, policy="pause")
            job_id, t_sub = job["id"], time.monotonic()
            job, seen, timed_out = follow(server, job_id, lambda j: j["state"] in FINAL,
                                          plan.train_timeout_s)
            if timed_out:
                log(f"training job still {job.get('state')} after {plan.train_timeout_s:g} s; "
                    "cancelling")
                job = cancel(server, job_id, seen)
            off = time.time() - time.monotonic()
            a = to_mono(job.get("started_at"), off) or t_sub
            windows["training"] = (a, to_mono(job.get("ended_at"), off) or time.monotonic())
            res["training_job"] = job_summary(job, seen, timed_out, log_tail(server, job_id))
            res["training_job"]["command"] = train_cmd
            save()

            # hostile: allocates until it fails, unless the watchdog acts first
            if cuda:
                want = "killed" if plan.hostile_policy == "stop" else "paused"
                hjob = submit(server, name="hostile", command=[sys.executable, "-c", HOSTILE],
                              cwd=tmp, gpu_mem=plan.hostile_gpu_mem, policy=plan.hostile_policy)
                hjob_id, t_sub = hjob["id"], time.monotonic()
                hjob, hseen, htimed = follow(server, hjob_id,
                                             lambda j: j["state"] in FINAL or j["state"] == want,
                                             plan.hostile_timeout_s)
                acted = dict(hjob)
                t_acted = time.monotonic()
                if hjob.get("state") not in FINAL:  # paused (or timed out): end it
                    hjob = cancel(server, hjob_id, hseen)
                off = time.time() - time.monotonic()
                time.sleep(plan.settle_s)  # the load goes on; errors after the stop count too
                windows["hostile"] = (to_mono(acted.get("started_at"), off) or t_sub,
                                      t_acted + plan.settle_s)
                h = job_summary(hjob, hseen, htimed, log_tail(server, hjob_id))
                started = acted.get("started_at")
                h.update(state_when_acted=acted.get("state"), reason_when_acted=acted.get("reason"),
                         acted_after_s=round(t_acted - (to_mono(started, off) or t_sub), 2)
                         if started else None,
                         by_watchdog=_by_watchdog(acted))
                res["hostile_job"] = h
            else:
                res["hostile_job"] = {"skipped": "no GPU: there is no GPU memory for a hostile job "
                                                 "to take, nor for the watchdog to watch"}
        finally:
            if paced is not None:  # also after an error: the phases measured so far
                t_end = time.monotonic()
                records = paced.stop()
                res["phases"] = {name: phase_stats(records, a, b)
                                 for name, (a, b) in windows.items()}
                res["phases"]["all"] = phase_stats(records, paced.t0, t_end)
                if paced.missing:
                    res["phases"]["all"]["clients_missing"] = paced.missing
            if cpu is not None:
                cpu.stop()
                res["cpu"] = {name: cpu.window(a, b) for name, (a, b) in windows.items()}
            if sampler is not None:
                res["gpu_memory"] = sampler.report()
            res["jobs_killed_at_cleanup"] = kill_jobs(db)  # before the server: jobs outlive it
            if server is not None:
                server.stop()
            res["server_log"] = str(server_log)
            res["oom_lines"] = oom_lines(server_log, log_offset)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _by_watchdog(job: dict) -> bool:
    """Whether the guard held the job to its declaration: the watchdog stopped or paused it, or,
    an MPS client (serve --guard-mps), MPS's memory limit made it fail out of memory."""
    reason = job.get("reason") or ""
    return job.get("state") in ("killed", "paused") and (
        "over its declared" in reason or "inference floor" in reason) or (
        job.get("state") == "failed" and "(the MPS limit)" in reason)


def run_recorded(acceptance, verdict, args, results: dict, save, log=log) -> int:
    """Run ``acceptance(args, results, save)``, judge with ``verdict`` and save: an error leaves
    the partial results and its reason in ``--out`` (exit 1)."""
    rc = 0
    try:
        acceptance(args, results, save)
    except Exception as exc:  # noqa: BLE001  the partial results and the reason go to --out
        results["error"] = repr(exc)
        log(f"aborted: {exc!r}")
        rc = 1
    verdict(results, args.device == "cuda")
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    return rc


def verdict(res: dict, cuda: bool) -> None:
    ph = res.get("phases", {})
    base, train = ph.get("baseline", {}).get("p99_ms"), ph.get("training", {}).get("p99_ms")
    ratio = round(train / base, 3) if base and train else None
    res["p99_ratio_training_over_baseline"] = ratio
    sb = ph.get("baseline", {}).get("server_p99_ms")
    st = ph.get("training", {}).get("server_p99_ms")
    res["server_p99_ratio_training_over_baseline"] = round(st / sb, 3) if sb and st else None
    cond = {
        "zero_inference_errors": ph.get("all", {}).get("count", 0) > 0
        and ph["all"].get("errors") == 0,
        "zero_oom_lines": not res.get("oom_lines"),
        f"p99_training_le_{P99_RATIO_LIMIT:g}x_baseline": ratio is not None
        and ratio <= P99_RATIO_LIMIT,
        "training_job_succeeded": res.get("training_job", {}).get("state") == "succeeded",
        "hostile_stopped_or_paused_by_watchdog":
            bool(res.get("hostile_job", {}).get("by_watchdog")) if cuda else None,
    }
    res["conditions"] = cond
    res["conditions_held"] = [k for k, v in cond.items() if v is True]
    res["conditions_failed"] = [k for k, v in cond.items() if v is False]
    res["conditions_skipped"] = [k for k, v in cond.items() if v is None]
    res["pass"] = not res["conditions_failed"] and "error" not in res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchguard.json"))
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="server log, guard database and job logs (default: beside --out)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="shorter phases, smaller training job")
    ap.add_argument("--load-fraction", type=float, default=0.5, help="paced load / saturation")
    ap.add_argument("--rate", type=float, default=None,
                    help="paced load in requests/s (default: --load-fraction x saturation)")
    ap.add_argument("--baseline-s", type=float, default=None, help="baseline phase length")
    ap.add_argument("--processes", type=int, default=None, help="client processes")
    ap.add_argument("--deadline-ms", type=float, default=None,
                    help="X-Deadline-Ms of the paced requests (default: the model's takt on cuda, "
                         f"{CPU_DEADLINE_MS:g} on cpu)")
    ap.add_argument("--gpu-memory-budget", default="8GiB", help="the server's budget (cuda)")
    ap.add_argument("--train-gpu-mem", default="6GiB", help="the training job's declared need")
    ap.add_argument("--train-args", default=None, help="train.py options (one string)")
    ap.add_argument("--hostile-gpu-mem", default="4GiB", help="the hostile job's declared need")
    ap.add_argument("--hostile-policy", choices=("stop", "pause"), default="stop")
    ap.add_argument("--latency-budget-ms", type=float, default=None,
                    help="the server's --guard-latency-budget-ms: jobs pause while its p99 is "
                         "over it")
    args = ap.parse_args(argv)
    for name in ("rate", "baseline_s", "deadline_ms", "latency_budget_ms"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    if not 0 < args.load_fraction <= 1:
        ap.error(f"--load-fraction must be in (0, 1], got {args.load_fraction}")
    if args.processes is not None and args.processes < 1:
        ap.error(f"--processes must be >= 1, got {args.processes}")
    from visionserve.config import parse_bytes

    for name in ("gpu_memory_budget", "train_gpu_mem", "hostile_gpu_mem"):
        try:
            parse_bytes(getattr(args, name))
        except ValueError as exc:
            ap.error(f"--{name.replace('_', '-')}: {exc}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("benchguard: --device cuda: CUDA is not available here (use --device cpu)",
                  file=sys.stderr)
            return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": args.device,
                     "quick": args.quick}

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")

    rc = run_recorded(acceptance, verdict, args, results, save)
    summary = {k: results.get(k) for k in ("rate_per_s", "p99_ratio_training_over_baseline",
                                           "server_p99_ratio_training_over_baseline",
                                           "conditions", "pass", "error") if k in results}
    summary["phases"] = {k: {f: v.get(f) for f in ("count", "errors", "p50_ms", "p99_ms",
                                                   "server_p99_ms", "send_lag_p99_ms",
                                                   "client_wake_lag_p99_ms")}
                         for k, v in results.get("phases", {}).items()}
    print(json.dumps(summary, indent=2, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
