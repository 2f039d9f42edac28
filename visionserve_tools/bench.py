"""Measure served latency and throughput with a precise open-loop generator, against the bare model.

Open loop (--rate, constant or --arrival poisson): frames leave on a fixed schedule whatever
the server does, from several generator processes (--processes), each an asyncio loop with a
raw keep-alive HTTP/1.1 client (or grpc.aio). Closed loop (--concurrency N): N senders, each
waiting for its answer before sending again. Latencies are perf_counter_ns, write to answer.

Reported: p50/p90/p99/p99.9/max, throughput, deadline-miss ratio (LATE answers, answers past
their deadline, and answers slower than --budget-ms at the client), errors by kind, server
batch sizes (deltas of the visionserve_batch_size histogram at /metrics, and per frame from
inspect answers), CPU of the server's process tree, the generator's own send lag and CPU.

--bare measures the same model in-process first (same decode/resize/normalise/softmax code,
batch sizes --bare-batch-sizes), and every served figure is reported as a ratio to it.
--sweep R1,R2,... (or START:STOP:STEP) runs rising rates until p99 crosses --budget-ms and
reports the max rate at the SLO. --start-server --models DIR starts `visionserve serve` itself.
--overload M1,M2,... measures capacity first (closed loop, --capacity-concurrency senders, or
takes --capacity), then offers open-loop load at 1x and at each multiple of it, and reports the
goodput (answers within the deadline per second) against the goodput at 1x, and how fast and
how the rest was refused (503 + Retry-After); --check then checks --min-goodput-ratio and
--max-refusal-p99-ms.

Examples:
  visionserve bench --start-server --models models --bare --concurrency 32 --duration-s 10
  visionserve bench --url http://127.0.0.1:8000 --rate 100 --arrival poisson --budget-ms 50
  visionserve bench --start-server --models models --sweep 20:200:20 --budget-ms 100 \\
      --json out.json --plots out
  visionserve bench --start-server --models models --overload 1.1,1.5,3 --arrival poisson \\
      --json overload.json

Exit codes: 0 done (with --check: and within the budget), 1 --check failed, 2 bad arguments,
3 the server could not be reached or started.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from . import threadstates

log = logging.getLogger(__name__)

DEFAULT_MODEL = "defect-classifier"
#: the deadline sent while --overload measures the capacity
CAPACITY_DEADLINE_MS = 60_000.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server HTTP base URL [%(default)s]")
    t.add_argument("--grpc-url", default=None,
                   help="gRPC host:port (protocol grpc) [host of --url, port 8001]")
    t.add_argument("--protocol", choices=("inspect", "oip", "grpc", "json"), default="inspect",
                   help="inspect: POST /v1/models/M/inspect; oip: OIP v2 HTTP binary tensors; "
                        "grpc: OIP v2 gRPC; json: the inspect URL with a base64 JSON body (for "
                        "peers that only take JSON) [%(default)s]")
    t.add_argument("--model", default=None,
                   help=f"model name [{DEFAULT_MODEL}, or the only model in --models]")
    t.add_argument("--images", default="gen:640x480",
                   help="image set: gen:WxH[,WxH...][:n=N][:q=Q] or a folder of images "
                        "[%(default)s]")
    t.add_argument("--start-server", action="store_true",
                   help="start `visionserve serve` on --models first")
    t.add_argument("--models", type=Path, default=None,
                   help="model repository (for --start-server and --bare)")
    t.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the started server (repeat), e.g. "
                        "--server-arg=--max-batch-size=16")
    t.add_argument("--server-pid", type=int, default=None,
                   help="measure the CPU of this process tree (automatic with --start-server)")
    g = p.add_argument_group("load")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, default=None,
                      help="open loop: frames/s over all processes")
    mode.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: concurrent senders [1]")
    mode.add_argument("--sweep", default=None, help="open-loop rates R1,R2,... or START:STOP:STEP, "
                                                    "stopping once p99 exceeds --budget-ms")
    mode.add_argument("--overload", default=None, metavar="M1,M2,...",
                      help="open-loop load at 1x and these multiples of the capacity (e.g. "
                           "1.1,1.5,3)")
    g.add_argument("--arrival", choices=("constant", "poisson"), default="constant",
                   help="[%(default)s]")
    g.add_argument("--duration-s", type=float, default=10.0,
                   help="measured window per run [%(default)s]")
    g.add_argument("--warmup-s", type=float, default=1.0,
                   help="load before the window, not counted [%(default)s]")
    g.add_argument("--budget-ms", type=float, default=None,
                   help="p99 budget (the takt window) [the model's takt_ms with --models, else "
                        "200]")
    g.add_argument("--deadline-ms", type=float, default=None,
                   help="deadline sent with each frame (X-Deadline-Ms / timeout); 0 sends none "
                        "[--budget-ms]")
    g.add_argument("--miss-threshold", type=float, default=0.001,
                   help="largest deadline-miss ratio still within the SLO [%(default)s]")
    g.add_argument("--processes", type=int, default=2, help="generator processes [%(default)s]")
    g.add_argument("--connections", type=int, default=4,
                   help="pre-opened connections per process [%(default)s]")
    g.add_argument("--max-connections", type=int, default=512,
                   help="open-loop connection cap per process; past it frames count as "
                        "generator_overflow")
    g.add_argument("--timeout-s", type=float, default=10.0,
                   help="client timeout per frame [%(default)s]")
    g.add_argument("--seed", type=int, default=0)
    v = p.add_argument_group("overload (--overload)")
    v.add_argument("--capacity", type=float, default=None,
                   help="frames/s taken as the capacity [measured: closed loop for --duration-s]")
    v.add_argument("--capacity-concurrency", type=int, default=None,
                   help="closed-loop senders that measure the capacity [the model's "
                        "max_batch_size, else 32]")
    v.add_argument("--rounds", type=int, default=1,
                   help="repeat the 1x and multiples sequence; figures are the medians "
                        "[%(default)s]")
    v.add_argument("--min-goodput-ratio", type=float, default=0.9,
                   help="--check: goodput at each multiple over goodput at 1x, at least "
                        "[%(default)s]")
    v.add_argument("--max-refusal-p99-ms", type=float, default=5.0,
                   help="--check: p99 of send-to-503 time, at most [%(default)s]")
    b = p.add_argument_group("bare-model reference")
    b.add_argument("--bare", action="store_true",
                   help="measure the model in-process too (needs --models)")
    b.add_argument("--bare-batch-sizes", default=None,
                   help="comma list [1, 8, 16 and the model's max_batch_size, those <= it]")
    b.add_argument("--bare-seconds", type=float, default=2.0, help="per batch size [%(default)s]")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, help="write the full report here")
    o.add_argument("--plots", default=None,
                   help="PNG path prefix: PREFIX-cdf.png, PREFIX-sweep.png")
    o.add_argument("--label", default=None, help="name of this target in the report and plots")
    o.add_argument("--check", action="store_true",
                   help="exit 1 when p99 > budget or misses > threshold")
    o.add_argument("--quiet", action="store_true", help="no text summary")
    o.add_argument("--threads", action="store_true",
                   help="sample what each thread of the server does through each run (py-spy, "
                        "visionserve_tools.threadstates; needs --start-server or --server-pid): "
                        "'threads' in each run's report, a table in the summary")


class BenchError(Exception):
    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except BenchError as exc:
        print(f"visionserve bench: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("visionserve bench: interrupted", file=sys.stderr)
        return 130


# --- argument checks -------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    try:
        if ":" in text:
            start, stop, step = (float(x) for x in text.split(":"))
            if step <= 0 or stop < start:
                raise ValueError
            rates, r = [], start
            while r <= stop + 1e-9:
                rates.append(round(r, 6))
                r += step
        else:
            rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--sweep {text!r}: use R1,R2,... or START:STOP:STEP with STEP > "
                         "0") from None
    if not rates or any(r <= 0 for r in rates):
        raise BenchError(f"--sweep {text!r}: rates must be > 0")
    return rates


def parse_multiples(text: str) -> list[float]:
    """``--overload`` multiples, with 1x (the reference) first."""
    try:
        mults = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--overload {text!r}: use M1,M2,... (multiples of the "
                         "capacity)") from None
    if not mults or any(m <= 0 for m in mults):
        raise BenchError(f"--overload {text!r}: multiples must be > 0")
    return [1.0] + sorted({m for m in mults if m != 1.0})


def _check(args: argparse.Namespace) -> None:
    for name in ("duration_s", "timeout_s"):
        if getattr(args, name) <= 0:
            raise BenchError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.warmup_s < 0:
        raise BenchError(f"--warmup-s must be >= 0, got {args.warmup_s}")
    if args.rate is not None and args.rate <= 0:
        raise BenchError(f"--rate must be > 0, got {args.rate}")
    if args.concurrency is not None and args.concurrency < 1:
        raise BenchError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.processes < 1 or args.processes > 64:
        raise BenchError(f"--processes must be 1..64, got {args.processes}")
    if args.budget_ms is not None and args.budget_ms <= 0:
        raise BenchError(f"--budget-ms must be > 0, got {args.budget_ms}")
    if (args.start_server or args.bare) and args.models is None:
        raise BenchError("--start-server and --bare need --models (the model repository)")
    if args.models is not None and not args.models.is_dir():
        raise BenchError(f"--models {str(args.models)!r} is not a folder")
    if args.concurrency is not None and args.processes > args.concurrency:
        args.processes = args.concurrency
    if args.capacity is not None and args.capacity <= 0:
        raise BenchError(f"--capacity must be > 0, got {args.capacity}")
    if args.capacity_concurrency is not None and args.capacity_concurrency < 1:
        raise BenchError(f"--capacity-concurrency must be >= 1, got {args.capacity_concurrency}")
    if args.rounds < 1:
        raise BenchError(f"--rounds must be >= 1, got {args.rounds}")


def _model_and_takt(args: argparse.Namespace) -> tuple[str, float | None, int | None]:
    if args.models is None:
        return args.model or DEFAULT_MODEL, None, None
    from visionserve.errors import VisionServeError
    from visionserve.repository import scan

    try:
        entries = scan(args.models)
    except VisionServeError as exc:
        raise BenchError(exc.message) from None
    name = args.model or (DEFAULT_MODEL if DEFAULT_MODEL in entries or len(entries) != 1
                          else next(iter(entries)))
    if name not in entries:
        raise BenchError(f"--model {name!r} is not in {args.models}; it holds {sorted(entries)}")
    b = entries[name].config.batching
    return name, b.takt_ms, b.max_batch_size


# --- server ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int:
    """The HTTP status of GET ``url``; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


class StartedServer:
    def __init__(self, models: Path, extra: list[str], grpc: bool, log_path: Path) -> None:
        self.http_port = _free_port()
        self.grpc_port = _free_port() if grpc else -1
        cmd = [sys.executable, "-m", "visionserve", "serve", "--models", str(models),
               "--host", "127.0.0.1", "--http-port", str(self.http_port),
               "--grpc-port", str(self.grpc_port), "--device", "cpu", "--log-level", "warning",
               *extra]
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - open while the server runs; closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise BenchError(f"the server exited with {self.proc.returncode}; log "
                                 f"{self.log_path}:\n{tail}", 3)
            if http_status(self.url + "/v2/health/ready") == 200:
                return
            time.sleep(0.2)
        raise BenchError(f"the server was not ready after {timeout:.0f} s; log {self.log_path}", 3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# --- the measurement -------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    _check(args)
    model, takt, max_bs = _model_and_takt(args)
    budget = args.budget_ms or takt or 200.0
    deadline = budget if args.deadline_ms is None else (args.deadline_ms or None)
    rates = parse_rates(args.sweep) if args.sweep else None
    mults = parse_multiples(args.overload) if args.overload else None

    from .benchclient import images

    try:
        frames = images.load(args.images, seed=args.seed)
    except images.ImageSetError as exc:
        raise BenchError(f"--images: {exc}") from None

    server = None
    url = args.url
    grpc_url = args.grpc_url
    try:
        if args.start_server:
            import tempfile

            log_path = Path(tempfile.mkstemp(prefix="visionserve-bench-server-", suffix=".log")[1])
            server = StartedServer(args.models, args.server_arg, args.protocol == "grpc", log_path)
            server.wait_ready()
            url = server.url
            if args.protocol == "grpc":
                grpc_url = f"127.0.0.1:{server.grpc_port}"
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise BenchError(f"--url {url!r} must be http://HOST:PORT")
        host, port = u.hostname, u.port or 80
        if args.protocol == "grpc":
            grpc_url = grpc_url or f"{host}:8001"
            ghost, _, gport = grpc_url.rpartition(":")
            if not ghost or not gport.isdigit():
                raise BenchError(f"--grpc-url {grpc_url!r} must be HOST:PORT")
            host, port = ghost, int(gport)
        elif http_status(url.rstrip("/") + "/v2/health/ready") == 0 and http_status(url) == 0:
            raise BenchError(f"cannot reach the server at {url}", 3)
        server_pid = args.server_pid or (server.proc.pid if server else None)

        report: dict = {"meta": _meta(args, model, budget, deadline, frames, server, url)}
        bare = None
        if args.bare:
            from .benchclient import bare as bare_mod

            sizes = _bare_sizes(args.bare_batch_sizes, max_bs)
            bare = bare_mod.measure(args.models, model, frames, sizes, args.bare_seconds)
            report["bare"] = {k: v for k, v in bare.items() if k != "answers"}

        from .benchclient import generator

        pool = generator.Pool(args.processes, frames)
        try:
            steps = []
            if mults is not None:
                steps = _overload(pool, args, mults, model, host, port, url, budget, deadline,
                                  server_pid, max_bs)
            elif rates is None:
                conc = None if args.rate else (args.concurrency or 1)
                steps.append(_one_run(pool, args, model, host, port, url, args.rate or 0.0, conc,
                                      budget, deadline, server_pid, bare))
            else:
                for r in rates:
                    s = _one_run(pool, args, model, host, port, url, r, None, budget, deadline,
                                 server_pid, bare)
                    steps.append(s)
                    if not args.quiet:
                        print(_line(s), flush=True)
                    if not s["within_slo"]:
                        break
        finally:
            pool.close()
        if bare is not None:
            # again after the load: on a shared machine the CPU available drifts, and the faster
            # of the two rounds is the stricter reference for the server
            again = bare_mod.measure(args.models, model, frames, sizes, args.bare_seconds)
            bare = bare_mod.best_of(bare, again)
            report["bare"] = {k: v for k, v in bare.items() if k != "answers"}
            for s in steps:
                s["vs_bare"] = _vs_bare(s, bare)
    finally:
        if server is not None:
            server.stop()

    cdf = [(s.pop("_label"), s.pop("_lat_ms")) for s in steps]
    report["runs"] = steps
    report["summary"] = steps[-1] if rates is None else _best(steps)
    if mults is not None:
        report["summary"] = report["overload"] = _overload_verdict(steps, args, deadline or budget)
    if rates is not None:
        ok = [s for s in steps if s["within_slo"]]
        report["sweep"] = {"budget_ms": budget, "miss_threshold": args.miss_threshold,
                           "rates": rates,
                           "max_rate_at_slo": max((s["offered_rate"] for s in ok), default=None),
                           "throughput_at_slo_fps": max((s["throughput_fps"] for s in ok),
                                                        default=None)}
    if args.plots:
        from .benchclient import report as rep

        prefix = args.plots
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        rep.plot_cdf(cdf if rates is None else cdf[-4:], f"{prefix}-cdf.png", budget)
        report.setdefault("plots", []).append(f"{prefix}-cdf.png")
        if rates is not None:
            rep.plot_sweep(steps, f"{prefix}-sweep.png", budget, args.label or model)
            report["plots"].append(f"{prefix}-sweep.png")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    if not args.quiet:
        _print(report)
    if args.check:
        s = report["summary"]
        return 0 if s and s.get("within_slo", s.get("passed")) else 1
    return 0


def _overload(pool, args, mults, model, host, port, url, budget, deadline, server_pid,
              max_bs) -> list[dict]:
    """Capacity (closed loop, unless --capacity), then open loop at each multiple of it."""
    steps = []
    capacity = args.capacity
    if capacity is None:
        conc = args.capacity_concurrency or max_bs or 32
        # a deadline no frame meets its limit with: the closed loop keeps the queue short by itself,
        # and a sender refused with 503 would send again at once, spinning instead of measuring
        cap = _one_run(pool, args, model, host, port, url, 0.0, conc, budget, CAPACITY_DEADLINE_MS,
                       server_pid, None)
        cap["phase"] = "capacity"
        steps.append(cap)
        if not args.quiet:
            print("capacity: " + _line(cap), flush=True)
        capacity = cap["throughput_fps"]
        if not capacity:
            raise BenchError("measuring the capacity answered no frame in time; see the run's "
                             "errors", 3)
    for r in range(args.rounds):
        for m in mults:
            s = _one_run(pool, args, model, host, port, url, round(m * capacity, 3), None, budget,
                         deadline, server_pid, None)
            s.update(phase="overload", multiple=m, round=r, capacity_fps=capacity)
            steps.append(s)
            if not args.quiet:
                o = s["overload"]
                print(f"{m:g}x capacity ({s['offered_rate']:g}/s): goodput "
                      f"{o['goodput_fps']:.1f}/s, refused {o['refused_share']}, refusal p99 "
                      f"{_fmt(o['refusal_latency_ms']['p99'])} ms, late {o['late']}, other "
                      f"{o['other']}", flush=True)
    return steps


def _overload_verdict(steps: list[dict], args, deadline_ms: float) -> dict:
    """Medians per multiple over the rounds, each against 1x, and the pass/fail of the targets."""
    import statistics

    runs = [s for s in steps if s.get("phase") == "overload"]
    by: dict[float, list[dict]] = {}
    for s in runs:
        by.setdefault(s["multiple"], []).append(s["overload"])
    ref = statistics.median(o["goodput_fps"] for o in by[1.0])
    table = []
    for m, os_ in sorted(by.items()):
        good = statistics.median(o["goodput_fps"] for o in os_)
        p99s = [o["refusal_latency_ms"]["p99"] for o in os_
                if o["refusal_latency_ms"]["p99"] is not None]
        table.append({
            "multiple": m, "offered_fps": statistics.median(o["offered_fps"] for o in os_),
            "goodput_fps": round(good, 3), "goodput_over_1x": round(good / ref, 3) if ref else None,
            "refused_share": statistics.median(o["refused_share"] or 0.0 for o in os_),
            "refusal_p99_ms": max(p99s) if p99s else None,
            "refused_without_retry_after": sum(o["refused_without_retry_after"] for o in os_),
            "late": sum(o["late"] for o in os_), "other": sum(o["other"] for o in os_),
            "goodput_over_1x_per_round": [
                round(o["goodput_fps"] / g1["goodput_fps"], 3) if g1["goodput_fps"] else None
                for o, g1 in zip(os_, by[1.0])],
        })
    over = [t for t in table if t["multiple"] > 1.0]
    passed = bool(ref) and all(
        t["goodput_over_1x"] >= args.min_goodput_ratio
        and (t["refusal_p99_ms"] is None or t["refusal_p99_ms"] <= args.max_refusal_p99_ms)
        and t["refused_without_retry_after"] == 0 for t in over)
    return {"capacity_fps": runs[0]["capacity_fps"] if runs else None, "deadline_ms": deadline_ms,
            "goodput_at_1x_fps": ref, "rounds": args.rounds, "multiples": table,
            "targets": {"min_goodput_ratio": args.min_goodput_ratio,
                        "max_refusal_p99_ms": args.max_refusal_p99_ms},
            "passed": passed}


def _bare_sizes(text: str | None, max_bs: int | None) -> list[int]:
    if text:
        try:
            sizes = sorted({int(x) for x in text.split(",") if x.strip()})
        except ValueError:
            raise BenchError(f"--bare-batch-sizes {text!r} is not a comma list of "
                             "integers") from None
        if not sizes or sizes[0] < 1:
            raise BenchError(f"--bare-batch-sizes {text!r}: sizes must be >= 1")
        return sizes
    top = max_bs or 32
    return sorted({b for b in (1, 8, 16, top) if b <= top})


def _one_run(pool, args, model, host, port, url, rate, conc, budget, deadline, server_pid,
             bare) -> dict:
    from .benchclient import generator
    from .benchclient import report as rep

    start_ns = time.perf_counter_ns() + int(0.3e9)
    total = args.warmup_s + args.duration_s

    def make(k: int) -> generator.Job:
        return generator.Job(worker=k, workers=pool.processes, protocol=args.protocol,
                             host=host, port=port,
                             model=model, start_ns=start_ns, duration_s=total, rate=rate,
                             poisson=args.arrival == "poisson", concurrency=conc or 0,
                             deadline_ms=deadline,
                             timeout_s=args.timeout_s, connections=args.connections,
                             max_connections=args.max_connections, seed=args.seed)

    samples: dict[str, Any] = {}
    spied = None
    if args.threads and server_pid:  # sampling from before the window (py-spy reads symbols first)
        # kept, and named in the report: threadstates --from-raw classifies it again
        raw = Path(tempfile.mkdtemp(prefix="bench-threads-")) / "threads.raw"
        spied = (threadstates.start(server_pid, 3600, raw), raw)

    def sampler() -> None:  # scrape /metrics and server CPU at the window's edges
        for edge, at in (("begin", start_ns + int(args.warmup_s * 1e9)),
                         ("end", start_ns + int(total * 1e9))):
            delay = (at - time.perf_counter_ns()) / 1e9
            if delay > 0:
                time.sleep(delay)
            samples[edge + "_t"] = time.perf_counter()
            samples[edge + "_cpu"] = rep.tree_cpu_s(server_pid) if server_pid else None
            samples[edge + "_loop"] = rep.loop_cpu_s(server_pid) if server_pid else None
            samples[edge + "_hist"] = rep.scrape_batch_hist(url, model)
            # not a visionserve: try the OIP statistics extension
            if samples[edge + "_hist"] is None:
                samples[edge + "_oip"] = rep.scrape_oip_batch_stats(url, model)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    futures = pool.run(make)
    results = [f.result() for f in futures]
    th.join()
    threads = threadstates.finish(*spied, stop=True) if spied else None
    merged = generator.merge(results)
    s = rep.summarize(merged, warmup_s=args.warmup_s, window_s=args.duration_s, budget_ms=budget,
                      bare_answers=bare["answers"] if bare else None)
    lat = s["latency_ms"]
    s = {"label": args.label or model, "protocol": args.protocol,
         "mode": "open-loop" if rate else "closed-loop", "arrival": args.arrival if rate else None,
         "offered_rate": rate or None, "concurrency": conc, "duration_s": args.duration_s,
         "warmup_s": args.warmup_s, "budget_ms": budget, "deadline_sent_ms": deadline, **s}
    s["batch_size_server"] = (
        rep.batch_hist_delta(samples.get("begin_hist"), samples.get("end_hist"))
        or rep.oip_batch_delta(samples.get("begin_oip"), samples.get("end_oip")))
    # the server's process tree, and its main thread: the event loop (with --frontends, the one
    # all the front ends' frames pass through)
    wall, n = samples.get("end_t", 0.0) - samples.get("begin_t", 0.0), s["answered_ok"]
    for key, share, per_frame, scale, digits in (
            ("cpu", "server_cpu_cores", "server_cpu_ms_per_frame", 1e3, 4),
            ("loop", "server_loop_cpu_share", "server_loop_cpu_us_per_frame", 1e6, 1)):
        begin, end = samples.get(f"begin_{key}"), samples.get(f"end_{key}")
        if begin is not None and end is not None:
            s[share] = round((end - begin) / wall, 3) if wall > 0 else None
            s[per_frame] = round((end - begin) * scale / n, digits) if n else None
    s["within_slo"] = bool(lat["p99"] is not None and lat["p99"] <= budget
                           and (s["miss_ratio"] or 0) <= args.miss_threshold
                           and (not rate or s["throughput_fps"] >= 0.95 * rate))
    if bare:
        s["vs_bare"] = _vs_bare(s, bare)
    if args.threads:
        s["threads"] = threads or {"error": "no server process to sample (--server-pid)"}
    if args.overload:
        s["overload"] = rep.overload_summary(merged, warmup_s=args.warmup_s,
                                             window_s=args.duration_s,
                                             deadline_ms=deadline or budget)
    s["_label"] = f"{s['label']} {f'{rate:g}/s' if rate else f'c={conc}'}"
    measured = (merged.sched_ns >= int(args.warmup_s * 1e9)) & (merged.outcome == 0)
    ok_ms = merged.latency_ns[measured] / 1e6
    s["_lat_ms"] = ok_ms
    return s


def _vs_bare(s: dict, bare: dict) -> dict:
    out: dict = {}
    tput = s["throughput_fps"] or 0.0
    for bs, b in bare["batch_sizes"].items():
        out[f"throughput_over_bare_pipeline_bs{bs}"] = round(tput / b["pipeline_fps"], 3)
        out[f"throughput_over_bare_model_bs{bs}"] = round(tput / b["model_fps"], 3)
        if s.get("server_cpu_ms_per_frame") and b.get("pipeline_cpu_ms_per_frame"):
            out[f"cpu_per_frame_over_bare_pipeline_bs{bs}"] = round(
                s["server_cpu_ms_per_frame"] / b["pipeline_cpu_ms_per_frame"], 3)
    mean_bs = (s.get("batch_size_server") or {}).get("mean_batch_size") \
        or s["batch_size_per_frame"]["mean"]
    if mean_bs:
        # the bare batch size nearest above the served mean batch: "at the same batch size"
        sizes = sorted(int(k) for k in bare["batch_sizes"])
        near = next((b for b in sizes if b >= mean_bs), sizes[-1])
        ref = bare["batch_sizes"][str(near)]
        out["served_mean_batch"] = mean_bs
        out["bare_batch_at_served_mean"] = near
        out["throughput_over_bare_pipeline_at_served_batch"] = round(tput / ref["pipeline_fps"], 3)
    b1 = bare["batch_sizes"].get("1")
    p50 = s["latency_ms"]["p50"]
    if b1 and p50 is not None:
        out["p50_added_ms_over_bare_pipeline_bs1"] = round(p50 - b1["pipeline_ms"]["p50"], 4)
        out["p50_over_bare_pipeline_bs1"] = round(p50 / b1["pipeline_ms"]["p50"], 3)
        if "min" in b1["pipeline_ms"] and s["latency_ms"]["min"] is not None:
            # minima are the figures a neighbour's load disturbs least
            out["min_added_ms_over_bare_pipeline_bs1"] = round(
                s["latency_ms"]["min"] - b1["pipeline_ms"]["min"], 4)
    return out


def _best(steps: list[dict]) -> dict | None:
    ok = [s for s in steps if s["within_slo"]]
    return max(ok, key=lambda s: s["offered_rate"]) if ok else None


def _meta(args, model, budget, deadline, frames, server, url) -> dict:
    import numpy as np

    sizes = sorted({f.name.split("-")[1] for f in frames if f.name.count("-") >= 2}) or ["folder"]
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(), "python": platform.python_version(), "numpy": np.__version__,
        "command": "visionserve bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if len(sys.argv) > 1 and sys.argv[1] == "bench"
        else " ".join(shlex.quote(a) for a in sys.argv),
        "target": url, "protocol": args.protocol, "model": model, "budget_ms": budget,
        "deadline_sent_ms": deadline, "images": args.images, "image_count": len(frames),
        "image_sizes": sizes,
        "mean_image_bytes": int(sum(len(f.data) for f in frames) / len(frames)),
        "generator": {"processes": args.processes, "client": "raw asyncio HTTP/1.1 keep-alive"
                      if args.protocol != "grpc" else "grpc.aio", "arrival": args.arrival},
        "server_command": server.cmd if server else None,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _fmt(v, nd=2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _line(s: dict) -> str:
    lat = s["latency_ms"]
    what = f"rate {s['offered_rate']:g}/s" if s["offered_rate"] \
        else f"concurrency {s['concurrency']}"
    bs = (s.get("batch_size_server") or {}).get("mean_batch_size") \
        or s["batch_size_per_frame"]["mean"]
    return (f"{s['label']} {s['protocol']} {what}: {s['throughput_fps']:.1f} frames/s, p50 "
            f"{_fmt(lat['p50'])} p90 {_fmt(lat['p90'])} p99 {_fmt(lat['p99'])} p99.9 "
            f"{_fmt(lat['p99.9'])} max {_fmt(lat['max'])} ms, misses "
            f"{s['miss_ratio'] if s['miss_ratio'] is not None else '-'}, mean batch {_fmt(bs)}, "
            f"errors {s['errors'] or 'none'}{'' if s['within_slo'] else '  [over budget]'}")


def _print(report: dict) -> None:
    if "bare" in report:
        for bs, b in report["bare"]["batch_sizes"].items():
            print(f"bare bs={bs}: pipeline p50 {b['pipeline_ms']['p50']:.2f} ms "
                  f"({b['pipeline_fps']:.1f} frames/s), model p50 {b['model_ms']['p50']:.2f} ms "
                  f"({b['model_fps']:.1f} frames/s)")
    if "overload" in report:
        o = report["overload"]
        print(f"overload: capacity {o['capacity_fps']} frames/s, deadline {o['deadline_ms']:g} ms, "
              f"goodput at 1x {o['goodput_at_1x_fps']} frames/s ({o['rounds']} round(s), medians)")
        for t in o["multiples"]:
            print(f"  {t['multiple']:g}x: offered {t['offered_fps']:.1f}/s, goodput "
                  f"{t['goodput_fps']:.1f}/s = {t['goodput_over_1x']} of 1x, refused "
                  f"{t['refused_share']} (p99 {_fmt(t['refusal_p99_ms'])} ms, "
                  f"{t['refused_without_retry_after']} without Retry-After), late {t['late']}, "
                  f"other {t['other']}")
        print(f"  targets (goodput >= {o['targets']['min_goodput_ratio']} of 1x, refusal p99 <= "
              f"{o['targets']['max_refusal_p99_ms']:g} ms): {'met' if o['passed'] else 'NOT met'}")
    elif "sweep" not in report:
        for s in report["runs"]:
            print(_line(s))
            if "vs_bare" in s:
                print("  vs bare: " + ", ".join(f"{k} {v}" for k, v in s["vs_bare"].items()))
            if "answers_vs_bare" in s:
                print(f"  answers vs bare single-frame: {s['answers_vs_bare']}")
            lag = s["send_lag_ms"]
            print(f"  generator: send lag p99 {_fmt(lag['p99'], 3)} ms, CPU {s['generator_cpu_s']} "
                  f"s; server CPU {s.get('server_cpu_cores', '-')} cores, its event loop "
                  f"{s.get('server_loop_cpu_us_per_frame', '-')} us per frame")
            if "threads" in s:
                print(threadstates.table(s["threads"]))
    else:
        sw = report["sweep"]
        print(f"max rate at p99 <= {sw['budget_ms']:g} ms: {sw['max_rate_at_slo']} frames/s "
              f"(throughput {sw['throughput_at_slo_fps']})")
    for p in report.get("plots", []):
        print(f"plot: {p}")
