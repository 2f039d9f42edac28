"""Queue training jobs on the inference GPU and run them without endangering the server.

  visionserve guard submit --gpu-mem 8GiB --policy pause -- python train.py --epochs 10
  visionserve guard list | show ID | cancel ID | logs ID [--follow]
  visionserve guard run --inference-floor 6GiB --margin 1GiB   (the supervisor)

The database is --db, else $VISIONSERVE_GUARD_DB, else $XDG_DATA_HOME/visionserve/guard.sqlite
(~/.local/share/visionserve/guard.sqlite): the same one from any working directory, and the one
`visionserve serve --guard` hosts by default. `list`, `show` and `submit` say which one they use.
See docs/guard.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import datetime

from ..config import parse_bytes
from ..errors import VisionServeError
from .admission import fmt_bytes
from .store import DB_ENV, DEFAULT_DB, POLICIES, TERMINAL, Job, JobSpec, JobStore, default_db_path

log = logging.getLogger(__name__)


class _UsageError(Exception):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=None,
                        help=f"job database (default: ${DB_ENV}, else {DEFAULT_DB}, "
                             "~/.local/share/visionserve/guard.sqlite where XDG_DATA_HOME is "
                             "unset)")
    sub = parser.add_subparsers(dest="guard_command", metavar="SUBCOMMAND")

    p = sub.add_parser("submit", parents=[common], help="queue a job; prints its id",
                       usage="%(prog)s [options] -- CMD [ARGS...]")
    p.add_argument("--name", help="label for lists (default: the program's name)")
    p.add_argument("--gpu-mem", default="0", metavar="SIZE",
                   help="GPU memory the job needs, CUDA context included (e.g. 8GiB); 0: no GPU")
    p.add_argument("--priority", type=int, default=0, help="higher starts first (default 0)")
    p.add_argument("--policy", choices=POLICIES, default="pause",
                   help="when headroom runs out: pause (SIGSTOP) or stop (SIGTERM, then SIGKILL)")
    p.add_argument("--cwd", help="working directory (default: the current one)")
    p.add_argument("--env", action="extend", nargs="+", default=[], metavar="K=V",
                   help="extra environment variables for the job")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then the job's command; a bare program name (python) is looked up on "
                        "YOUR PATH now and stored as an absolute path (the job runs that one, with "
                        "the supervisor's environment plus --env)")

    p = sub.add_parser("list", parents=[common], help="list jobs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--state", action="append", help="only jobs in this state (repeatable)")

    p = sub.add_parser("show", parents=[common],
                       help="one job in detail (JSON; times in ISO 8601 local time)")
    p.add_argument("id", type=int)

    p = sub.add_parser("cancel", parents=[common],
                       help="queued: cancel; running/paused: stop it (state cancelled)")
    p.add_argument("id", type=int)
    p.add_argument("--no-wait", action="store_true", help="do not wait for a running job to end")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when no supervisor runs")

    p = sub.add_parser("logs", parents=[common], help="print a job's log")
    p.add_argument("id", type=int)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")

    p = sub.add_parser("run", parents=[common], help="the supervisor (until SIGTERM/SIGINT)")
    p.add_argument("--device", default="auto",
                   help="auto, an index, cuda:N, GPU-<uuid> or a PCI bus id; cpu: no GPU")
    p.add_argument("--concurrency", type=int, default=1, help="jobs at a time (default 1)")
    p.add_argument("--inference-floor", default="0", metavar="SIZE",
                   help="the inference server's GPU memory budget, kept free at all times")
    p.add_argument("--margin", default="1GiB", metavar="SIZE",
                   help="safety margin added to the floor (default 1GiB)")
    p.add_argument("--hysteresis", default="1GiB", metavar="SIZE",
                   help="a paused job resumes once free memory is this much above the floor")
    p.add_argument("--poll-hz", type=float, default=10.0,
                   help="watchdog samples per second (>= 10)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("--context-reserve", default="768MiB", metavar="SIZE",
                   help="CUDA context allowance: the torch allocator cap is need minus this")
    p.add_argument("--nice", type=int, default=10, help="CPU nice increment for jobs")
    p.add_argument("--sched-idle", action=argparse.BooleanOptionalAction, default=True,
                   help="run jobs under SCHED_IDLE: CPU time the server does not want (default on)")
    p.add_argument("--job-cpus", default="", metavar="LIST",
                   help="CPUs jobs may run on, e.g. 4-15 (leaves the others to the server and its "
                        "clients); default all")
    p.add_argument("--yield", dest="cooperative", action=argparse.BooleanOptionalAction,
                   default=True, help="PyTorch jobs yield the GPU while the server runs a batch "
                   "(needs the server's busy word: VISIONSERVE_GUARD_SHARE set for both, or "
                   "serve --guard); default on")
    p.add_argument("--yield-max-wait-ms", type=float, default=50.0,
                   help="longest single wait of a job's hook (default 50)")
    p.add_argument("--yield-min-share", type=float, default=0.3,
                   help="share of time a yielding job keeps however busy the line (default 0.3)")
    p.add_argument("--yield-queue-ms", type=float, default=2.0,
                   help="GPU work (ms) a yielding job may keep queued ahead (default 2)")
    p.add_argument("--yield-mode", choices=("wait", "bound"), default="wait",
                   help="wait: a job waits while a batch runs (default); bound: it never waits, "
                        "it only keeps one point of GPU work queued while a batch runs")
    p.add_argument("--yield-depth", type=int, default=16,
                   help="at most this many hook intervals queued ahead (default 16)")
    p.add_argument("--stop-jobs-on-exit", action="store_true",
                   help="on SIGTERM/SIGINT stop running jobs instead of leaving them running")
    p.add_argument("--simulate-memory", metavar="FILE",
                   help="use a simulated GPU whose memory use is read from FILE (tests, demos)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "guard_command", None)
    if not cmd:
        print("visionserve guard: give a subcommand: submit, list, show, cancel, logs, run",
              file=sys.stderr)
        return 2
    try:
        return _COMMANDS[cmd](args)
    except _UsageError as exc:
        print(f"visionserve guard {cmd}: error: {exc}", file=sys.stderr)
        return 2
    except VisionServeError as exc:
        print(f"visionserve guard {cmd}: error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _store(args: argparse.Namespace) -> JobStore:
    return JobStore(args.db or default_db_path())


#: a supervisor writes its heartbeat every second; one silent this long is taken as gone
SUPERVISOR_STALE_S = 15.0


def _waiting_reason(store: JobStore) -> str | None:
    """Why queued jobs do not start when no supervisor runs on this database; None if one runs.

    The heartbeat decides (it works across PID namespaces: a supervisor in a container), the
    process table only as a second opinion for one that is busy."""
    from . import proc

    sup = store.supervisor()
    start = "start `visionserve guard run` or `visionserve serve --guard` on this database"
    if sup is None:
        return f"no supervisor runs on this database: {start}"
    if time.time() - (sup.get("heartbeat") or 0.0) <= SUPERVISOR_STALE_S \
            or proc.is_alive(sup["pid"], sup["starttime"]):
        return None
    return (f"the supervisor (pid {sup['pid']}) was last seen {_iso(sup.get('heartbeat'))} and is "
            f"gone: {start}")


def _with_reason(job: dict, waiting: str | None) -> dict:
    if job["state"] == "queued" and not job.get("reason") and waiting:
        job["reason"] = waiting
    return job


def _size(value: str, option: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise _UsageError(f"{option}: {exc}") from None


# -- subcommands ---------------------------------------------------------------------------------
def _submit(args: argparse.Namespace) -> int:
    command = list(args.command)
    if not command or command[0] != "--":
        raise _UsageError("missing '--' before the job's command "
                          "(e.g. submit --gpu-mem 8GiB -- python train.py)")
    command = command[1:]
    if not command:
        raise _UsageError("empty command after '--'")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _UsageError(f"--env {item!r}: use KEY=VALUE")
        env[key] = value
    spec = JobSpec(command=command, name=args.name, cwd=args.cwd, env=env,
                   gpu_mem=_size(args.gpu_mem, "--gpu-mem"), priority=args.priority,
                   policy=args.policy)
    store = _store(args)
    job = store.submit(spec)
    print(job.id)
    print(f"job {job.id} queued in {store.path}: {' '.join(job.command)}", file=sys.stderr)
    note = _python_note(command[0], job.command[0])
    if note:
        print(note, file=sys.stderr)
    waiting = _waiting_reason(store)
    if waiting:
        print(f"job {job.id} waits: {waiting}", file=sys.stderr)
    return 0


def _python_note(asked: str, resolved: str) -> str | None:
    """A bare `python` is found on the submitter's PATH, which is often not the environment
    visionserve (and torch) is installed in: say so, with the path that would be."""
    name = os.path.basename(asked)
    if asked != name or not name.startswith("python"):
        return None
    ours = sys.executable
    try:
        same = os.path.samefile(os.path.dirname(resolved), os.path.dirname(ours))
    except OSError:
        same = False
    if same:
        return None
    return (f"note: `{asked}` is {resolved} on your PATH, not the Python visionserve runs in "
            f"({ours}); the job runs {resolved}. To run it in visionserve's environment, give "
            f"that path: -- {ours} ...")


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _iso(t: float | None) -> str | None:
    """ISO 8601 local time with its UTC offset, to the second."""
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds") if t else None


def _list(args: argparse.Namespace) -> int:
    store = _store(args)
    jobs = store.list(tuple(args.state) if args.state else None)
    waiting = _waiting_reason(store) if any(j.state == "queued" for j in jobs) else None
    if args.json:
        print(f"guard database: {store.path}", file=sys.stderr)
        print(json.dumps([_with_reason(j.to_dict(), waiting) for j in jobs], indent=2))
        return 0
    if not jobs:
        print(f"no jobs in {store.path}"
              + (f" in state {', '.join(args.state)}" if args.state else ""))
        return 0
    print(f"guard database: {store.path}")
    print(f"{'ID':>5}  {'STATE':<9}  {'PRI':>4}  {'POLICY':<6}  {'GPU MEM':>10}  {'SUBMITTED':<19}"
          f"  {'NAME':<20}  REASON")
    for j in jobs:
        print(f"{j.id:>5}  {j.state:<9}  {j.priority:>4}  {j.policy:<6}  "
              f"{fmt_bytes(j.gpu_mem):>10}  {_when(j.submitted_at):<19}  {j.name[:20]:<20}  "
              f"{_with_reason(j.to_dict(), waiting)['reason'] or ''}")
    return 0


def _show(args: argparse.Namespace) -> int:
    store = _store(args)
    job = store.get(args.id)
    shown = _with_reason(job.to_dict(), _waiting_reason(store) if job.state == "queued" else None)
    for key in ("submitted_at", "started_at", "ended_at"):
        shown[key] = _iso(shown[key])
    shown["database"] = store.path
    print(json.dumps(shown, indent=2))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from . import proc

    store = _store(args)
    job = store.request_cancel(args.id)
    if job.state == "cancelled":
        print(f"job {job.id} cancelled")
        return 0
    sup = store.supervisor()
    live = sup is not None and proc.is_alive(sup["pid"], sup["starttime"])
    if not live:
        # nobody watches this job: stop it here rather than leave a cancelled job running
        print(f"job {job.id}: no supervisor running; stopping pid {job.pid} here", file=sys.stderr)
        _stop_unsupervised(store, job, args.grace)
    elif args.no_wait:
        print(f"job {job.id}: cancel requested; the supervisor will stop it")
        return 0
    deadline = time.monotonic() + args.grace + 30.0
    while time.monotonic() < deadline:
        job = store.get(args.id)
        if job.state in TERMINAL:
            print(f"job {job.id} {job.state}" + (f": {job.reason}" if job.reason else ""))
            return 0
        time.sleep(0.1)
    print(f"job {job.id}: cancel requested but it is still {job.state}", file=sys.stderr)
    return 1


def _stop_unsupervised(store: JobStore, job: Job, grace: float) -> None:
    from . import proc

    if job.pid and proc.is_alive(job.pid, job.pid_starttime):
        proc.signal_group(job.pid, signal.SIGTERM)
        proc.signal_group(job.pid, signal.SIGCONT)
        deadline = time.monotonic() + grace
        while proc.is_alive(job.pid, job.pid_starttime) and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.is_alive(job.pid, job.pid_starttime):
            proc.signal_group(job.pid, signal.SIGKILL)
        # the wrapper is not our child: wait for its parent to reap it
        deadline = time.monotonic() + 5.0
        while proc.is_alive(job.pid, job.pid_starttime) and time.monotonic() < deadline:
            time.sleep(0.05)
    store.finish(job.id, "cancelled", exit_code=None,
                 reason="cancelled by user (stopped by the CLI: no supervisor was running)")


def _logs(args: argparse.Namespace) -> int:
    store = _store(args)
    out = sys.stdout.buffer
    pos = 0
    while True:
        # state first, then the file: once the state is terminal, this read sees the whole log
        job = store.get(args.id)
        if job.log_path and os.path.exists(job.log_path):
            with open(job.log_path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            out.write(chunk)
            out.flush()
            pos += len(chunk)
        elif not args.follow:
            print(f"job {job.id} has no log yet (state: {job.state})", file=sys.stderr)
            return 0
        if not args.follow or job.state in TERMINAL:
            return 0
        time.sleep(0.2)


def _run(args: argparse.Namespace) -> int:
    from .memory import MemorySource, SimulatedMemorySource, open_nvml_source
    from .supervisor import Supervisor, SupervisorConfig

    if not logging.getLogger().handlers:
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.concurrency < 1:
        raise _UsageError(f"--concurrency must be >= 1, got {args.concurrency}")
    if not 10 <= args.poll_hz <= 1000:
        raise _UsageError(f"--poll-hz must be between 10 and 1000, got {args.poll_hz:g}")
    if args.grace < 0:
        raise _UsageError(f"--grace must be >= 0, got {args.grace:g}")
    if args.job_cpus:
        from .jobwrap import parse_cpus

        try:
            parse_cpus(args.job_cpus)
        except ValueError as exc:
            raise _UsageError(f"--job-cpus {args.job_cpus}: {exc}") from None
    if args.yield_max_wait_ms < 0 or not 0 <= args.yield_min_share <= 1 or args.yield_depth < 1 \
            or args.yield_queue_ms < 0:
        raise _UsageError("--yield-max-wait-ms and --yield-queue-ms must be >= 0, "
                          "--yield-min-share in 0..1 and --yield-depth >= 1")
    cfg = SupervisorConfig(
        concurrency=args.concurrency,
        inference_floor=_size(args.inference_floor, "--inference-floor"),
        margin=_size(args.margin, "--margin"), hysteresis=_size(args.hysteresis, "--hysteresis"),
        poll_hz=args.poll_hz, grace_s=args.grace, nice=args.nice, sched_idle=args.sched_idle,
        context_reserve=_size(args.context_reserve, "--context-reserve"),
        stop_jobs_on_exit=args.stop_jobs_on_exit, job_cpus=args.job_cpus,
        cooperative=args.cooperative, yield_max_wait_ms=args.yield_max_wait_ms,
        yield_min_share=args.yield_min_share, yield_depth=args.yield_depth,
        yield_queue_ms=args.yield_queue_ms, yield_mode=args.yield_mode)
    store = _store(args)
    log.info("guard job database: %s", store.path)
    source: MemorySource | None
    if args.simulate_memory:
        source = SimulatedMemorySource(args.simulate_memory)
    else:
        source = open_nvml_source(args.device)
    sup = Supervisor(store, source, cfg)
    if args.metrics_port is not None:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.request_stop())
    sup.run_forever()
    return 0


_COMMANDS = {"submit": _submit, "list": _list, "show": _show, "cancel": _cancel, "logs": _logs,
             "run": _run}
