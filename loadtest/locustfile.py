"""Camera stations at the line's takt: does every part get its verdict inside the takt window?

Each locust user is one camera station. It sends one frame per takt (``constant_pacing``) to the
inspect API (``InspectStation``, FastHttpUser) or over gRPC (``GrpcStation``, Triton's OIP v2
service through a plain sync grpc channel made gevent-friendly by ``init_gevent``), with the
deadline budget in ``X-Deadline-Ms`` / the OIP ``timeout`` parameter.

A frame answered in time is a success named ``inspect`` / ``ModelInfer``. A frame the server
answered ``LATE`` (504 / DEADLINE_EXCEEDED), answered with ``deadline_met: false``, or whose
round trip at the station exceeded the budget is a failure named ``... deadline-miss``, so the
CSV shows misses on their own row. At the end the process exits 1 when the p99 of all answers
exceeds the budget, the miss ratio exceeds --max-miss-ratio, other errors exceed
--max-error-ratio, or nothing was sent; else 0.

Options (each also an environment variable):
  --takt-ms        LOCUST_TAKT_MS        one frame per station every takt [200]
  --budget-ms      LOCUST_BUDGET_MS      deadline budget per frame [= takt]
  --images         LOCUST_IMAGES         gen:640x480[,1280x1024][:n=N][:q=Q] or a folder [gen:640x480]
  --protocol       LOCUST_PROTOCOL       inspect | grpc [inspect]
  --model          LOCUST_MODEL          [defect-classifier]
  --grpc-target    LOCUST_GRPC_TARGET    host:port for gRPC [host of --host, port 8001]
  --max-miss-ratio LOCUST_MAX_MISS_RATIO [0.001]
  --max-error-ratio LOCUST_MAX_ERROR_RATIO [0.01]

Headless example (see loadtest/README.md):
  locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://127.0.0.1:8000 \
      --takt-ms 250 --images gen:1280x1024 --csv out/line1
"""

from __future__ import annotations

import itertools
import json
import logging
import struct
import sys
import time
import urllib.parse
from pathlib import Path

from locust import FastHttpUser, User, constant_pacing, events, task
from locust.exception import StopUser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

log = logging.getLogger("loadtest")

_STATE: dict = {"frames": [], "misses": 0, "errors": 0}
_PART = itertools.count(1)


class DeadlineMiss(Exception):
    """A frame without a usable verdict inside its budget."""


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    g = parser.add_argument_group("visionserve line test")
    g.add_argument("--takt-ms", type=float, env_var="LOCUST_TAKT_MS", default=200.0,
                   help="one frame per station every takt (ms)")
    g.add_argument("--budget-ms", type=float, env_var="LOCUST_BUDGET_MS", default=None,
                   help="deadline budget per frame in ms (default: the takt)")
    g.add_argument("--images", env_var="LOCUST_IMAGES", default="gen:640x480",
                   help="gen:WxH[,WxH][:n=N][:q=Q] or a folder of .jpg/.png/.bmp files")
    g.add_argument("--protocol", env_var="LOCUST_PROTOCOL", default="inspect", choices=["inspect", "grpc"],
                   help="inspect (HTTP) or grpc (OIP v2)")
    g.add_argument("--model", env_var="LOCUST_MODEL", default="defect-classifier", help="model name")
    g.add_argument("--grpc-target", env_var="LOCUST_GRPC_TARGET", default=None,
                   help="gRPC host:port (default: --host's host, port 8001)")
    g.add_argument("--max-miss-ratio", type=float, env_var="LOCUST_MAX_MISS_RATIO", default=0.001,
                   help="exit 1 above this deadline-miss ratio")
    g.add_argument("--max-error-ratio", type=float, env_var="LOCUST_MAX_ERROR_RATIO", default=0.01,
                   help="exit 1 above this ratio of other errors")


def _budget_ms(opts) -> float:
    return opts.budget_ms if opts.budget_ms else opts.takt_ms


@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    opts = environment.parsed_options
    if opts is None:  # library use without the command line
        return
    if opts.takt_ms <= 0 or _budget_ms(opts) <= 0:
        _fatal(environment, f"--takt-ms {opts.takt_ms} and --budget-ms {opts.budget_ms} must be > 0")
        return
    from visionserve.benchclient import images

    try:
        _STATE["frames"] = images.load(opts.images)
    except images.ImageSetError as exc:
        _fatal(environment, f"--images: {exc}")
        return
    # one protocol per run: keep only the station class that speaks it
    want = GrpcStation if opts.protocol == "grpc" else InspectStation
    if opts.protocol == "grpc":
        import grpc.experimental.gevent as grpc_gevent

        grpc_gevent.init_gevent()  # before any channel: the sync channel then cooperates with gevent
    environment.user_classes[:] = [c for c in environment.user_classes if c is want] or [want]
    log.info("line test: takt %g ms, budget %g ms, %d frames (%s), protocol %s", opts.takt_ms,
             _budget_ms(opts), len(_STATE["frames"]), opts.images, opts.protocol)


def _fatal(environment, message: str) -> None:
    log.error("%s", message)
    sys.exit(2)


class _Station:
    """What both station kinds share: pacing at the takt, the frame and part id to send."""

    def _setup_station(self) -> None:
        opts = self.environment.parsed_options
        self.budget_ms = _budget_ms(opts)
        self.model = opts.model
        self._pace = constant_pacing(opts.takt_ms / 1000.0)
        self._cp_last_run = time.perf_counter()
        self._cp_last_wait_time = 0.0
        if not _STATE["frames"]:
            raise StopUser()
        self._frames = itertools.cycle(_STATE["frames"])

    def wait_time(self) -> float:
        return self._pace(self)

    def _miss(self, reason: str) -> DeadlineMiss:
        _STATE["misses"] += 1
        return DeadlineMiss(reason)


class InspectStation(_Station, FastHttpUser):
    """A camera station posting JPEG frames to ``/v1/models/{model}/inspect``."""

    abstract = False
    connection_timeout = 10.0
    network_timeout = 30.0

    def on_start(self) -> None:
        self._setup_station()

    @task
    def inspect(self) -> None:
        frame = next(self._frames)
        part = f"part-{next(_PART)}"
        headers = {"Content-Type": frame.content_type, "X-Part-Id": part,
                   "X-Deadline-Ms": f"{self.budget_ms:g}"}
        t0 = time.perf_counter()
        with self.client.post(f"/v1/models/{self.model}/inspect", data=frame.data, headers=headers,
                              name="inspect", catch_response=True) as resp:
            took_ms = (time.perf_counter() - t0) * 1000.0
            miss = self._judge(resp, took_ms, part)
            if miss is not None:
                resp.request_meta["name"] = "inspect deadline-miss"
                resp.failure(miss)
            elif resp.status_code != 200:
                _STATE["errors"] += 1
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
            else:
                resp.success()

    def _judge(self, resp, took_ms: float, part: str) -> DeadlineMiss | None:
        if resp.status_code == 504:
            return self._miss("verdict LATE (504): the server dropped the frame past its deadline")
        if resp.status_code != 200:
            return None
        try:
            body = json.loads(resp.content)
        except (ValueError, TypeError):
            return None
        if body.get("verdict") == "LATE" or body.get("deadline_met") is False:
            return self._miss("answered after the deadline (deadline_met false)")
        if body.get("part_id") != part:
            _STATE["errors"] += 1
            return None
        if took_ms > self.budget_ms:
            return self._miss(f"round trip over the budget at the station ({self.budget_ms:g} ms)")
        return None


class GrpcStation(_Station, User):
    """A camera station calling ``inference.GRPCInferenceService/ModelInfer`` (OIP v2 gRPC)."""

    abstract = False

    def on_start(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self._setup_station()
        opts = self.environment.parsed_options
        target = opts.grpc_target
        if not target:
            host = urllib.parse.urlsplit(self.host or "http://127.0.0.1").hostname or "127.0.0.1"
            target = f"{host}:8001"
        self._grpc = grpc
        self._pb = service_pb2
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20),
                                                              ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def infer(self) -> None:
        frame = next(self._frames)
        req = self._pb.ModelInferRequest(model_name=self.model, id=f"part-{next(_PART)}")
        inp = req.inputs.add()
        inp.name, inp.datatype = "image", "BYTES"
        inp.shape.extend([1, 1])
        req.outputs.add().name = "verdict"
        req.parameters["timeout"].int64_param = int(self.budget_ms * 1000)
        req.raw_input_contents.append(struct.pack("<I", len(frame.data)) + frame.data)
        name, exc, length = "ModelInfer", None, 0
        t0 = time.perf_counter()
        try:
            resp = self.stub.ModelInfer(req, timeout=max(10.0, self.budget_ms / 100))
            length = resp.ByteSize()
        except self._grpc.RpcError as err:
            if err.code() == self._grpc.StatusCode.DEADLINE_EXCEEDED:
                name, exc = "ModelInfer deadline-miss", self._miss(f"verdict LATE: {err.details()}")
            else:
                _STATE["errors"] += 1
                exc = err
        took_ms = (time.perf_counter() - t0) * 1000.0
        if exc is None and took_ms > self.budget_ms:
            name, exc = "ModelInfer deadline-miss", self._miss(
                f"round trip over the budget at the station ({self.budget_ms:g} ms)")
        self.environment.events.request.fire(request_type="grpc", name=name, response_time=took_ms,
                                             response_length=length, exception=exc, context={}, url=None,
                                             response=None)


@events.quitting.add_listener
def _verdict(environment, **_kw) -> None:
    """Exit non-zero when the line would not keep its takt."""
    opts = environment.parsed_options
    if opts is None:
        return
    total = environment.stats.total
    n = total.num_requests
    if n == 0:
        log.error("line test: no frame was sent")
        environment.process_exit_code = 1
        return
    budget = _budget_ms(opts)
    p99 = total.get_response_time_percentile(0.99)
    miss_ratio = _STATE["misses"] / n
    other = max(0, total.num_failures - _STATE["misses"]) / n
    problems = []
    if p99 > budget:
        problems.append(f"p99 {p99:g} ms exceeds the budget of {budget:g} ms")
    if miss_ratio > opts.max_miss_ratio:
        problems.append(f"deadline-miss ratio {miss_ratio:.4f} exceeds {opts.max_miss_ratio:g}")
    if other > opts.max_error_ratio:
        problems.append(f"error ratio {other:.4f} exceeds {opts.max_error_ratio:g}")
    summary = (f"line test: {n} frames, p50 {total.get_response_time_percentile(0.5):g} ms, p99 {p99:g} ms, "
               f"budget {budget:g} ms (takt {opts.takt_ms:g} ms), margin {budget - p99:g} ms, "
               f"misses {_STATE['misses']} ({miss_ratio:.4%}), other errors {total.num_failures - _STATE['misses']}")
    if problems:
        log.error("%s -> FAIL: %s", summary, "; ".join(problems))
        environment.process_exit_code = 1
    else:
        log.info("%s -> PASS", summary)
        environment.process_exit_code = 0

