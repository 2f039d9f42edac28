"""Sharing the GPU with training, measured (issue 22): inference latency and training throughput
under the guard's two mechanisms, in one run.

    python -m visionserve_tools.benchshare --device cuda --out share.json [--log-dir DIR]
    python -m visionserve_tools.benchshare --device cpu --quick --out share.json   # dry run

1. Starts ``visionserve serve --guard --guard-latency-budget-ms B`` (cuda: the ResNet-50 bench
   model of :mod:`.benchgpu`, fp16, ``--gpu-memory-budget``; cpu: the shipped default model).
2. Measures saturation (closed loop), then, phase ``train_alone``: the training job
   (:mod:`.trainloop`: ResNet-50, batch 64, bf16, two data-loader workers) through the guard with no
   inference load: its steps/s alone.
3. Starts the open-loop paced load at ``--load-fraction`` of saturation (:class:`.benchguard.
   PacedLoad`: latency from the schedule, the server's own time, send lag and the client's own
   lateness apart). Phase ``baseline``: the load alone.
4. Phase ``process``: the same job with ``VISIONSERVE_GUARD_YIELD=0`` (no hook): the
   process-level policy, i.e. paused (SIGSTOP) while the served p99 is over the latency budget.
5. Phase ``yield``: the same job with the guard's hook: it yields at module boundaries while a
   batch runs, bounds its queued GPU work, and follows the duty cycle the budget sets.
6. Phase ``yield_bound``: the hook in mode ``bound`` (``VISIONSERVE_GUARD_YIELD_MODE=bound``): it
   never waits, it only keeps one point of GPU work queued while a batch runs.
7. Phase ``mps`` (``--mps PCT``): the server is started with ``--guard-mps
   --guard-mps-job-sm-percent PCT``, so it and the job are clients of one CUDA MPS daemon and
   their kernels run side by side, the job's on PCT% of the SMs at a lower client priority (its
   ``train_alone`` run asks for 100%: the reference is the job on the whole GPU).
8. Phase ``hostile`` (cuda, if time is left): benchguard's memory-hungry job; the watchdog must
   stop it.

``--phases`` picks the sharing phases (default ``process,yield,yield_bound``; with ``--mps``:
``mps``); ``--frontends N`` starts the server with N front-end processes (the issue's second
target), the load then at ``--load-fraction`` of that server's saturation.

Each training phase is the job's timed part (from its ``warm`` line to its ``done`` line). The
JSON (``--out``, saved after every phase) has per phase the latency percentiles (client and
server side), errors, CPU time and run-queue wait of server, clients and job
(:class:`.benchguard.CpuSampler`), the SM utilisation of server and job (NVML per-process
samples, cuda), the job's steps/s and what the guard recorded (mechanism, yields, pauses); the p99
ratios over baseline, the steps/s ratios over alone, OOM lines, and ``conditions``: zero errors
and OOMs, the judged phase's p99 within 1.5x baseline (``mps`` with ``--mps``, else ``yield``),
its steps/s at least half of alone, the hostile job stopped. Exit 0: completed (see ``pass``);
1: aborted; 2: bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .benchgpu import Server, export_models, get, load, make_jpegs
from .benchguard import (
    FINAL,
    HOSTILE,
    P99_RATIO_LIMIT,
    CpuSampler,
    PacedLoad,
    _by_watchdog,
    cancel,
    follow,
    kill_jobs,
    log_tail,
    oom_lines,
    phase_stats,
    run_recorded,
    submit,
)

STEPS_RATIO_MIN = 0.5
TRAIN_MODULE = "visionserve_tools.trainloop"


def log(msg: str) -> None:  # CLI progress output
    print(f"[benchshare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    device: str
    saturation_s: float
    warmup_s: float
    baseline_s: float
    alone_s: float
    share_s: float
    job_timeout_s: float
    settle_s: float
    train_args: list[str]
    train_gpu_mem: str
    budget: str | None
    latency_budget_ms: float
    load_fraction: float
    rate: float | None
    processes: int
    threads: int
    hostile: bool
    deadline_s: float
    phases: tuple[str, ...] = ("process", "yield", "yield_bound")
    mps_percent: int | None = None
    frontends: int = 0

    @property
    def judged(self) -> str:
        """The sharing phase the targets are checked on."""
        return "mps" if self.mps_percent else "yield"


def make_plan(args: argparse.Namespace) -> Plan:
    cuda, q = args.device == "cuda", args.quick
    train = (["--model", "resnet50", "--batch-size", "64", "--size", "224", "--workers", "2"]
             if cuda else ["--model", "resnet18", "--batch-size", "4", "--size", "64",
                           "--workers", "1", "--warmup-steps", "2"])
    return Plan(
        device=args.device, saturation_s=5.0, warmup_s=1.0,
        baseline_s=args.baseline_s or (15.0 if cuda and not q else 8.0),
        alone_s=args.alone_s or (12.0 if cuda and not q else 5.0),
        share_s=args.share_s or (20.0 if cuda and not q else 8.0),
        job_timeout_s=45.0 if cuda else 120.0, settle_s=2.0,
        train_args=train + (args.train_args.split() if args.train_args else []),
        train_gpu_mem=args.train_gpu_mem if cuda else "0",
        budget=args.gpu_memory_budget if cuda else None,
        latency_budget_ms=args.latency_budget_ms or (20.0 if cuda else 400.0),
        load_fraction=args.load_fraction, rate=args.rate,
        processes=args.processes or min(8, max(2, (os.cpu_count() or 8) // 2)),
        threads=64 if cuda else 8, hostile=cuda and not args.no_hostile,
        deadline_s=args.deadline_s, phases=tuple(args.phases.split(",")) if args.phases
        else (("mps",) if args.mps else ("process", "yield", "yield_bound")),
        mps_percent=args.mps, frontends=args.frontends)


#: what each sharing phase sets in the job's environment
PHASE_ENV: dict[str, dict[str, str]] = {
    "process": {"VISIONSERVE_GUARD_YIELD": "0"}, "yield": {},
    "yield_bound": {"VISIONSERVE_GUARD_YIELD_MODE": "bound"}, "mps": {}}


class GpuSampler(threading.Thread):
    """SM utilisation per process from NVML's per-process samples, once a second: the server's
    and the jobs' (every other pid), as (time, {pid: percent}) rows; nothing without NVML."""

    def __init__(self, server_pid: int) -> None:
        super().__init__(daemon=True, name="gpu")
        self.server_pid = server_pid
        self.rows: list[tuple[float, dict[int, float]]] = []
        self.done = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # noqa: BLE001 no NVML: no figures
            self.error = repr(exc)
            return
        since = 0
        while not self.done.wait(1.0):
            try:
                samples = pynvml.nvmlDeviceGetProcessUtilization(h, since)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_NOT_FOUND:
                    self.error = repr(exc)
                self.rows.append((time.monotonic(), {}))
                continue
            per: dict[int, list[int]] = {}
            for smp in samples:
                per.setdefault(int(smp.pid), []).append(int(smp.smUtil))
                since = max(since, int(smp.timeStamp))
            self.rows.append((time.monotonic(), {p: sum(v) / len(v) for p, v in per.items()}))

    def window(self, a: float, b: float) -> dict:
        rows = [r for t, r in self.rows if a <= t <= b]
        if not rows:
            return {"error": self.error} if self.error else {}
        server = [r.get(self.server_pid, 0.0) for r in rows]
        jobs = [sum(v for p, v in r.items() if p != self.server_pid) for r in rows]
        return {"server_sm_pct": round(sum(server) / len(rows), 1),
                "jobs_sm_pct": round(sum(jobs) / len(rows), 1), "seconds": len(rows)}

    def stop(self) -> None:
        self.done.set()
        self.join(5)


def train_events(text: str) -> dict[str, dict]:
    """The trainloop's JSON lines in a job log, by event (the last of each)."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        if line.startswith('{"event"'):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            out[ev.get("event", "?")] = ev
    return out


def run_job(server: Server, plan: Plan, name: str, seconds: float, env: dict, tmp: str,
            seen_jobs: list[int]) -> tuple[dict, tuple[float, float] | None]:
    """Submit the training job, follow it to its end; returns its summary and its timed window
    (monotonic, from its warm line to its done line)."""
    cmd = [sys.executable, "-m", TRAIN_MODULE, "--device", plan.device, "--seconds", f"{seconds:g}",
           *plan.train_args]
    job = submit(server, name=name, command=cmd, cwd=tmp, env={"PYTHONUNBUFFERED": "1", **env},
                 gpu_mem=plan.train_gpu_mem, policy="pause")
    seen_jobs.append(job["id"])
    job, seen, timed_out = follow(server, job["id"], lambda j: j["state"] in FINAL,
                                  plan.job_timeout_s + seconds)
    if timed_out:
        log(f"{name}: still {job.get('state')} after its timeout; cancelling")
        job = cancel(server, job["id"], seen)
    text = get(f"{server.url}/v1/guard/jobs/{job['id']}/logs")[1].decode("utf-8", "replace")
    ev = train_events(text)
    off = time.time() - time.monotonic()
    window = None
    if "warm" in ev and "done" in ev:
        window = (ev["warm"]["wall"] - off, ev["done"]["wall"] - off)
    summary = {"id": job.get("id"), "state": job.get("state"), "exit_code": job.get("exit_code"),
               "reason": job.get("reason"), "mechanism": job.get("mechanism"),
               "sharing": job.get("sharing"), "timed_out": timed_out, "transitions": seen,
               "train": ev.get("done"), "command": cmd, "env": env,
               # what the guard's sitecustomize and hook said in the job (an error turns it off)
               "guard_lines": [ln[:300] for ln in text.splitlines()
                               if ln.startswith("visionserve guard:")][:10]}
    if job.get("state") != "succeeded":
        summary["log_tail"] = text[-2000:]
    return summary, window


def acceptance(args: argparse.Namespace, res: dict, save) -> None:
    plan = make_plan(args)
    t_start = time.monotonic()

    def left() -> float:  # of --deadline-s: a phase that would not fit is skipped, and said so
        return plan.deadline_s - (time.monotonic() - t_start)

    res["plan"] = asdict(plan)
    cuda = plan.device == "cuda"
    log_dir: Path = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    db = (log_dir / f"guard-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sqlite").resolve()
    res["guard_db"] = str(db)
    windows: dict[str, tuple[float, float]] = {}
    jobs: list[int] = []
    with tempfile.TemporaryDirectory(prefix="benchshare-") as tmp:
        if cuda:
            repo, model = export_models(Path(tmp) / "models", ("rn50",))["rn50"], "rn50"
        else:
            from visionserve.config import default_models_dir

            repo, model = default_models_dir(), "defect-classifier"
        res["model"] = model
        jpegs = make_jpegs()
        server_log = log_dir / "server.log"
        log_offset = server_log.stat().st_size if server_log.exists() else 0
        extra = ["--guard", "--guard-db", str(db),
                 "--guard-latency-budget-ms", f"{plan.latency_budget_ms:g}"]
        if plan.budget:
            extra += ["--gpu-memory-budget", plan.budget]
        if plan.mps_percent:
            extra += ["--guard-mps", "--guard-mps-job-sm-percent", str(plan.mps_percent)]
        else:  # the other mechanisms, measured without MPS (the server's default where it runs)
            extra += ["--no-guard-mps"]
        if plan.frontends:
            extra += ["--frontends", str(plan.frontends)]
        res["server_args"] = extra
        server = paced = cpu = gpu = None
        try:
            server = Server(repo, server_log, *extra, device=plan.device)
            res["server_start_s"] = server.start_s
            log(f"server ready in {server.start_s} s; measuring saturation")
            sat = load(server, model, jpegs, plan.processes, 8 if cuda else 4, plan.saturation_s)
            res["saturation"] = sat
            if not sat.get("answers"):
                raise RuntimeError(f"saturation run got no answers: {sat}")
            rate = plan.rate or round(plan.load_fraction * sat["throughput_per_s"], 1)
            res["rate_per_s"] = rate
            gpu = GpuSampler(server.proc.pid)
            gpu.start()
            save()

            log(f"training alone ({plan.alone_s:g} s)")
            alone_env = {"VISIONSERVE_GUARD_YIELD": "0"}
            if plan.mps_percent:  # the reference: the job on every SM
                alone_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "100"
            res["train_alone"], w = run_job(server, plan, "train-alone", plan.alone_s,
                                            alone_env, tmp, jobs)
            if w:
                windows["train_alone"] = w
            save()

            log(f"saturation {sat['throughput_per_s']}/s; paced load at {rate}/s")
            paced = PacedLoad(server.port, model, jpegs, rate, plan.processes, plan.threads,
                              None if cuda else 1000.0, 900.0)
            cpu = CpuSampler(server.proc.pid, [p.pid for p in paced.procs if p.pid is not None])
            cpu.start()
            b0 = paced.t0 + plan.warmup_s
            time.sleep(max(0.0, b0 + plan.baseline_s - time.monotonic()))
            windows["baseline"] = (b0, b0 + plan.baseline_s)

            for phase in plan.phases:
                env = PHASE_ENV[phase]
                if left() < plan.share_s + 25:
                    res.setdefault("skipped", []).append(f"{phase}: {left():.0f} s left")
                    log(f"phase {phase} skipped: {left():.0f} s left of --deadline-s")
                    continue
                log(f"phase {phase}: training beside the load ({plan.share_s:g} s)")
                res[f"train_{phase}"], w = run_job(server, plan, f"train-{phase}", plan.share_s,
                                                   env, tmp, jobs)
                if w:
                    windows[phase] = w
                res["guard_metrics_" + phase] = server.metrics(("visionserve_guard_",))
                save()

            if plan.hostile and left() < 20:
                res.setdefault("skipped", []).append(f"hostile: {left():.0f} s left")
            elif plan.hostile:
                hjob = submit(server, name="hostile", command=[sys.executable, "-c", HOSTILE],
                              cwd=tmp, gpu_mem="4GiB", policy="stop")
                jobs.append(hjob["id"])
                t_sub = time.monotonic()
                # until the watchdog acts: a pause for the latency budget (the job is new load
                # on the GPU) is not the watchdog's, and the job grows again once resumed
                hjob, hseen, _ = follow(server, hjob["id"],
                                        lambda j: j["state"] in FINAL or _by_watchdog(j), 60)
                acted = dict(hjob)
                if hjob.get("state") not in FINAL:
                    hjob = cancel(server, hjob["id"], hseen)
                time.sleep(plan.settle_s)
                windows["hostile"] = (t_sub, time.monotonic())
                res["hostile_job"] = {"state_when_acted": acted.get("state"),
                                      "reason_when_acted": acted.get("reason"),
                                      "state": hjob.get("state"),
                                      "by_watchdog": _by_watchdog(acted),
                                      "log_tail": log_tail(server, hjob["id"], 600)}
        finally:
            if paced is not None:
                t_end = time.monotonic()
                records = paced.stop()
                res["phases"] = {n: phase_stats(records, a, b) for n, (a, b) in windows.items()
                                 if n != "train_alone"}
                res["phases"]["all"] = phase_stats(records, paced.t0, t_end)
            for sampler, key in ((cpu, "cpu"), (gpu, "gpu")):
                if sampler is not None:
                    sampler.stop()
                    res[key] = {n: sampler.window(a, b) for n, (a, b) in windows.items()}
            res["jobs_killed_at_cleanup"] = kill_jobs(db)  # before the server: jobs outlive it
            if server is not None:
                server.stop()
            res["server_log"] = str(server_log)
            res["oom_lines"] = oom_lines(server_log, log_offset)


def verdict(res: dict, cuda: bool) -> None:
    ph = res.get("phases", {})
    plan = res.get("plan") or {}
    judged = "mps" if plan.get("mps_percent") else "yield"
    phases = plan.get("phases") or ("process", "yield", "yield_bound")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    base_phase = ph.get("baseline", {})
    base, base_srv = base_phase.get("p99_ms"), base_phase.get("server_p99_ms")
    alone = (res.get("train_alone", {}).get("train") or {}).get("steps_per_s")
    out = {}
    for phase in phases:
        steps = (res.get(f"train_{phase}", {}).get("train") or {}).get("steps_per_s")
        out[phase] = {"p99_ratio": ratio(ph.get(phase, {}).get("p99_ms"), base),
                      "server_p99_ratio": ratio(ph.get(phase, {}).get("server_p99_ms"), base_srv),
                      "steps_per_s": steps, "steps_ratio_vs_alone": ratio(steps, alone)}
    res["steps_per_s_alone"] = alone
    res["ratios"] = out
    y = out.get(judged) or {"p99_ratio": None, "steps_ratio_vs_alone": None}
    cond = {
        "zero_inference_errors": ph.get("all", {}).get("count", 0) > 0
        and ph["all"].get("errors") == 0,
        "zero_oom_lines": not res.get("oom_lines"),
        f"{judged}_p99_le_{P99_RATIO_LIMIT:g}x_baseline": y["p99_ratio"] is not None
        and y["p99_ratio"] <= P99_RATIO_LIMIT,
        f"{judged}_steps_ge_{STEPS_RATIO_MIN:g}x_alone": y["steps_ratio_vs_alone"] is not None
        and y["steps_ratio_vs_alone"] >= STEPS_RATIO_MIN,
        f"{judged}_job_shared_by_{judged}":
        res.get(f"train_{judged}", {}).get("mechanism") == judged,
        # None: the phase did not run
        "process_job_had_no_hook": res.get("train_process", {}).get("mechanism") == "process"
        if "process" in phases else None,
        # None: not run (cpu, or no time left: see "skipped")
        "hostile_stopped_by_watchdog": bool(res["hostile_job"].get("by_watchdog"))
        if cuda and "hostile_job" in res else None,
    }
    res["conditions"] = cond
    res["conditions_failed"] = [k for k, v in cond.items() if v is False]
    res["pass"] = not res["conditions_failed"] and "error" not in res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchshare.json"))
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="short phases (a dry run)")
    ap.add_argument("--load-fraction", type=float, default=0.5)
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--baseline-s", type=float, default=None)
    ap.add_argument("--alone-s", type=float, default=None)
    ap.add_argument("--share-s", type=float, default=None)
    ap.add_argument("--latency-budget-ms", type=float, default=None,
                    help="the server's --guard-latency-budget-ms (default 20 on cuda)")
    ap.add_argument("--gpu-memory-budget", default="8GiB")
    ap.add_argument("--train-gpu-mem", default="16GiB")
    ap.add_argument("--train-args", default=None, help="more trainloop options (one string)")
    ap.add_argument("--no-hostile", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=235.0,
                    help="phases that would end later than this after the start are skipped")
    ap.add_argument("--mps", type=int, default=None, metavar="PCT",
                    help="serve with --guard-mps, jobs on PCT%% of the SMs (phase mps)")
    ap.add_argument("--phases", default=None,
                    help=f"sharing phases, of {','.join(PHASE_ENV)} (default: process,yield,"
                         "yield_bound; with --mps: mps)")
    ap.add_argument("--frontends", type=int, default=0, help="the server's --frontends")
    args = ap.parse_args(argv)
    if args.phases and not set(args.phases.split(",")) <= set(PHASE_ENV):
        ap.error(f"--phases: of {', '.join(PHASE_ENV)}")
    if "mps" in (args.phases or "").split(",") and not args.mps:
        ap.error("phase mps needs --mps PCT")
    if args.mps is not None and not 1 <= args.mps <= 100:
        ap.error("--mps: a percentage, 1..100")
    if not 0 < args.load_fraction <= 1:
        ap.error("--load-fraction must be in (0, 1]")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("benchshare: CUDA is not available here (use --device cpu)", file=sys.stderr)
            return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": args.device}

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")

    def terminated(*_):  # `timeout`: the phases measured so far still reach --out
        raise TimeoutError("SIGTERM")

    signal.signal(signal.SIGTERM, terminated)
    rc = run_recorded(acceptance, verdict, args, res, save, log)
    brief = {k: res.get(k) for k in ("rate_per_s", "steps_per_s_alone", "ratios", "conditions",
                                     "pass", "error") if k in res}
    brief["phases"] = {k: {f: v.get(f) for f in ("count", "errors", "p50_ms", "p99_ms",
                                                 "server_p99_ms", "send_lag_p99_ms",
                                                 "client_wake_lag_p99_ms")}
                       for k, v in res.get("phases", {}).items()}
    brief["sharing"] = {p: (res.get(f"train_{p}") or {}).get("sharing") for p in PHASE_ENV}
    brief["guard_lines"] = {p: (res.get(f"train_{p}") or {}).get("guard_lines")
                            for p in PHASE_ENV}
    print(json.dumps(brief, default=str))
    print("\n".join(table(res)))
    return rc


def table(res: dict) -> list[str]:
    """The figures that matter, one line per phase (the end of the printed output)."""
    ph, cpu, gpu = res.get("phases", {}), res.get("cpu", {}), res.get("gpu", {})
    lines = [(f"{'phase':<12}{'frames':>7}{'err':>5}{'p50':>8}{'p99':>8}{'srv p99':>9}"
             f"{'lag p99':>9}{'wake p99':>9}{'steps/s':>9}{'mech':>8}{'yields':>8}{'pauses':>7}"
             f"{'srv rq/s':>9}{'cli rq/s':>9}{'job cpu':>8}{'srv SM%':>8}{'job SM%':>8}")]

    def f(v, w: int, nd: int = 1) -> str:
        return f"{v:>{w}.{nd}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

    for name in ("train_alone", "baseline", *PHASE_ENV, "hostile", "all"):
        p = ph.get(name, {})
        job = res.get(name if name.startswith("train") else f"train_{name}", {}) or {}
        sh = job.get("sharing") or {}
        c, g = cpu.get(name, {}), gpu.get(name, {})
        if not p and not job:
            continue
        lines.append(
            f"{name:<12}{p.get('count', 0):>7}{p.get('errors', 0):>5}{f(p.get('p50_ms'), 8)}"
            f"{f(p.get('p99_ms'), 8)}{f(p.get('server_p99_ms'), 9)}{f(p.get('send_lag_p99_ms'), 9)}"
            f"{f(p.get('client_wake_lag_p99_ms'), 9)}"
            f"{f((job.get('train') or {}).get('steps_per_s'), 9, 2)}"
            f"{job.get('mechanism') or '-':>8}"
            f"{sh.get('yields', '-'):>8}{sh.get('pauses', '-'):>7}"
            f"{f(c.get('server', {}).get('runq_wait_per_s'), 9, 3)}"
            f"{f(c.get('clients', {}).get('runq_wait_per_s'), 9, 3)}"
            f"{f(c.get('jobs', {}).get('cpu_per_s'), 8, 2)}{f(g.get('server_sm_pct'), 8)}"
            f"{f(g.get('jobs_sm_pct'), 8)}")
    r = res.get("ratios", {})
    lines.append("p99 ratio over baseline (client / server side); steps/s over alone: " + "; ".join(
        f"{p} {r.get(p, {}).get('p99_ratio')} / {r.get(p, {}).get('server_p99_ratio')}; "
        f"{r.get(p, {}).get('steps_ratio_vs_alone')}" for p in PHASE_ENV if p in r))
    lines.append(f"pass {res.get('pass')}; failed {res.get('conditions_failed')}; "
                 f"oom lines {len(res.get('oom_lines') or [])}; hostile "
                 f"{(res.get('hostile_job') or {}).get('state_when_acted')}; skipped "
                 f"{res.get('skipped', [])}; error {res.get('error')}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
