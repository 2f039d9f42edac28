"""Camera stations at the line's takt: does every part get its verdict inside the takt window?

Each locust user is one camera station. It sends one frame per takt (``constant_pacing``) to the
inspect API (``InspectStation``, FastHttpUser) or over gRPC (``GrpcStation``, Triton's OIP v2
service through a plain sync grpc channel made gevent-friendly by ``init_gevent``), with the
deadline budget in ``X-Deadline-Ms`` / the OIP ``timeout`` parameter.

Before the first frame the model is looked up at ``--host`` (``GET /v2/models/{model}``): a
model the server does not serve stops the run at once (exit 2), naming the models it does serve,
instead of a whole test run on 404s.

A frame answered in time is a success named ``inspect`` / ``ModelInfer``. A frame the server
answered ``LATE`` (504 / DEADLINE_EXCEEDED), answered with ``deadline_met: false``, or whose
round trip at the station exceeded the budget is a failure named ``... deadline-miss``, so the
CSV shows misses on their own row. Any other outcome is a failure named ``... error``, grouped by
its class (``HTTP 404 Not Found``, ``gRPC UNAVAILABLE``, ``connection error``, ``wrong part id``,
...) so the failures CSV has one row per class, not one per part; the first answer of each class is
logged in full. Latency figures are computed over the frames that got a verdict (in time or late)
only. At the end the process exits 1 when no frame got a verdict, the p99 of the verdicts exceeds
the budget, the miss ratio exceeds --max-miss-ratio, other errors exceed --max-error-ratio, or
nothing was sent; else 0.

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
      --model defect-classifier --takt-ms 250 --images gen:1280x1024 --csv out/line1
"""

from __future__ import annotations

import collections
import http
import itertools
import json
import logging
import math
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from locust import FastHttpUser, User, constant_pacing, events, task
from locust.exception import StopUser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

log = logging.getLogger("loadtest")

_STATE: dict = {"frames": [], "misses": 0, "errors": 0, "answered_ms": [],
                "error_classes": collections.Counter()}
_PART = itertools.count(1)


class DeadlineMiss(Exception):
    """A frame without a usable verdict inside its budget."""


class AnswerError(Exception):
    """A frame without a verdict: the message is the class (one failures-CSV row per class)."""

    def __repr__(self) -> str:
        return str(self)


def _error(kind: str, detail: str = "") -> AnswerError:
    """Count an error of class ``kind``; the first of each class is logged with its detail."""
    _STATE["errors"] += 1
    _STATE["error_classes"][kind] += 1
    if _STATE["error_classes"][kind] == 1:
        log.warning("first %s: %s", kind, detail[:500] or "-")
    return AnswerError(kind)


def _answered(took_ms: float) -> None:
    """A frame that got a verdict, in time or late: the latency figures are computed over these."""
    _STATE["answered_ms"].append(took_ms)


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
    from visionserve_tools.benchclient import images

    try:
        _STATE["frames"] = images.load(opts.images)
    except images.ImageSetError as exc:
        _fatal(environment, f"--images: {exc}")
        return
    problem = _check_model(environment.host or opts.host, opts.model, strict=opts.protocol != "grpc")
    if problem:
        _fatal(environment, problem)
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


def _check_model(host: str | None, model: str, *, strict: bool) -> str | None:
    """None when ``host`` serves ``model``; else why not, with the models it does serve.

    ``strict``: an unreachable host is a problem too (the inspect stations talk to it); for gRPC
    stations the HTTP host is only asked, so there it is a warning."""
    if not host:
        return None
    base = host.rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/v2/models/{urllib.parse.quote(model, safe='')}",
                                    timeout=10):
            return None
    except urllib.error.HTTPError as exc:
        if exc.code != 404:  # 401 with auth on, 503 while loading: the run itself will show it
            log.warning("--model %s: GET /v2/models/%s at %s answered %d; going ahead", model,
                        model, host, exc.code)
            return None
        served = _served_models(base)
        return (f"--model {model!r}: the server at {host} has no model of that name (it serves: "
                f"{', '.join(served) if served else 'none it would list'}); pass --model NAME")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if strict:
            return f"--host {host}: the server cannot be reached ({reason})"
        log.warning("--host %s: cannot check --model over HTTP (%s); going ahead", host, reason)
        return None


def _served_models(base: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"{base}/v2/models/stats", timeout=10) as resp:
            stats = json.loads(resp.read())
        return sorted({m["name"] for m in stats.get("model_stats", [])})
    except (OSError, ValueError, KeyError, TypeError):
        return []


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
            outcome = self._judge(resp, took_ms, part)
            if isinstance(outcome, DeadlineMiss):
                resp.request_meta["name"] = "inspect deadline-miss"
                resp.failure(outcome)
            elif isinstance(outcome, AnswerError):
                resp.request_meta["name"] = "inspect error"
                resp.failure(outcome)
            else:
                resp.success()

    def _judge(self, resp, took_ms: float, part: str) -> Exception | None:
        """None: a verdict in time; DeadlineMiss: a verdict, late; AnswerError: no verdict."""
        status = resp.status_code or 0
        if status == 504:
            _answered(took_ms)
            return self._miss("verdict LATE (504): the server dropped the frame past its deadline")
        if status != 200:
            # the body names the part (and the request id): never part of the class
            return _error(_http_class(status), f"{status} {resp.text or getattr(resp, 'error', None) or ''}")
        try:
            body = json.loads(resp.content)
        except (ValueError, TypeError):
            return _error("answer is not JSON", repr(resp.content[:200]))
        if not isinstance(body, dict) or body.get("verdict") not in ("OK", "NG", "LATE"):
            return _error("answer without a verdict", json.dumps(body)[:500])
        if body.get("part_id") != part:
            return _error("wrong part id in the answer", f"sent {part}, got {body.get('part_id')}")
        _answered(took_ms)
        if body.get("verdict") == "LATE" or body.get("deadline_met") is False:
            return self._miss("answered after the deadline (deadline_met false)")
        if took_ms > self.budget_ms:
            return self._miss(f"round trip over the budget at the station ({self.budget_ms:g} ms)")
        return None


def _http_class(status: int) -> str:
    if not status:
        return "connection error"
    try:
        return f"HTTP {status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


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
                name, exc = "ModelInfer deadline-miss", self._miss("verdict LATE (DEADLINE_EXCEEDED)")
            else:
                name = "ModelInfer error"
                exc = _error(f"gRPC {err.code().name}", err.details() or "")
        took_ms = (time.perf_counter() - t0) * 1000.0
        if not isinstance(exc, AnswerError):
            _answered(took_ms)
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
    errors = _STATE["error_classes"]
    by_class = ", ".join(f"{k}: {v}" for k, v in errors.most_common())
    answered = sorted(_STATE["answered_ms"])
    if not answered:
        log.error("line test: %d frames sent to model %r, none got a verdict (%s) -> FAIL: no valid "
                  "answers; check --model and --host", n, opts.model, by_class or "no answers")
        environment.process_exit_code = 1
        return
    p50, p99 = _percentile(answered, 0.5), _percentile(answered, 0.99)
    miss_ratio = _STATE["misses"] / n
    other = sum(errors.values()) / n
    problems = []
    if p99 > budget:
        problems.append(f"p99 {p99:g} ms exceeds the budget of {budget:g} ms")
    if miss_ratio > opts.max_miss_ratio:
        problems.append(f"deadline-miss ratio {miss_ratio:.4f} exceeds {opts.max_miss_ratio:g}")
    if other > opts.max_error_ratio:
        problems.append(f"error ratio {other:.4f} exceeds {opts.max_error_ratio:g}")
    summary = (f"line test: {n} frames, {len(answered)} with a verdict: p50 {p50:g} ms, p99 {p99:g} ms, "
               f"budget {budget:g} ms (takt {opts.takt_ms:g} ms), margin {budget - p99:g} ms, "
               f"misses {_STATE['misses']} ({miss_ratio:.4%}), other errors {sum(errors.values())}"
               + (f" ({by_class})" if by_class else ""))
    if problems:
        log.error("%s -> FAIL: %s", summary, "; ".join(problems))
        environment.process_exit_code = 1
    else:
        log.info("%s -> PASS", summary)
        environment.process_exit_code = 0



def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list, rounded to 0.1 ms."""
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return round(ordered[rank - 1], 1)
