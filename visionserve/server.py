"""Start the HTTP (and gRPC) server on a model repository.

Every option is also an environment variable VISIONSERVE_<OPTION> (e.g. VISIONSERVE_DEVICE=cuda:1);
the command line wins. On SIGTERM/SIGINT readiness goes false, new requests get 503, queued ones
finish within --drain-timeout-s, then the process exits 0.

Exit codes: 0 clean shutdown, 2 bad settings or model repository, 3 a model failed to load.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import typing
from pathlib import Path

from pydantic import ValidationError

from .config import ServerSettings, setting_docs, unknown_variables
from .errors import VisionServeError

log = logging.getLogger("visionserve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per ServerSettings field, so the CLI, env and docs (docs/settings.md, from the
    same :func:`~visionserve.config.setting_docs`) never drift apart."""
    for doc in setting_docs():
        # argparse %-formats help texts: a literal "%" (as in "80% of it") must be doubled
        help_text = f"{doc.help} [env {doc.env}; default {doc.default}]".replace("%", "%%")
        ann = ServerSettings.model_fields[doc.name].annotation
        if ann is bool:
            parser.add_argument(doc.flags[0], dest=doc.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
            continue
        parser.add_argument(doc.flags[0], dest=doc.name, type=_scalar(ann), choices=doc.choices or None,
                            default=None, help=help_text, metavar=None if doc.choices else doc.name.upper())


def _scalar(ann) -> type:
    for t in (int, float, Path):
        if ann is t or t in typing.get_args(ann):
            return str if t is Path else t
    return str


def settings_from(args: argparse.Namespace) -> ServerSettings:
    given = {k: getattr(args, k) for k in ServerSettings.model_fields if getattr(args, k, None) is not None}
    return ServerSettings(**given)


def configure_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        from .logs import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    from .logs import RequestIdFilter

    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def apply_process_settings(settings: ServerSettings) -> None:
    """Interpreter settings of the serving process (the one with the runner threads)."""
    sys.setswitchinterval(settings.switch_interval_ms / 1000)
    raise_fd_limit(settings.max_connections or 0)


def raise_fd_limit(connections: int) -> None:
    """Every HTTP connection holds a file descriptor, and many systems start a process with 1,024:
    raise the soft limit to the hard one (front-end processes inherit it), and say so when that is
    still short of ``max_connections`` plus what the server itself keeps open."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft < connections + 256:
        log.warning("only %d file descriptors (RLIMIT_NOFILE) for max_connections %d: past about %d "
                    "connections new ones fail; raise it (ulimit -n, systemd LimitNOFILE, docker --ulimit "
                    "nofile) or lower --max-connections", soft, connections, soft - 256)


def run_loop(main):
    """Run ``main`` on uvloop where it is installed (uvicorn[standard] brings it): the event loop
    is on every request's path, and uvloop's costs a fraction of asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if sys.version_info < (3, 11):  # no asyncio.Runner: the policy is how 3.10 picks a loop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def pin_device(spec: str):
    """Resolve the device and pin this process to it before any CUDA library loads.

    Returns the ResolvedDevice; its ``torch_device`` (``cpu`` or ``cuda:0``, the one visible GPU)
    is what the backends use.
    """
    from .gpu import device as gpu_device
    from .gpu.nvml import real_nvml

    nvml = real_nvml()
    resolved = gpu_device.resolve(gpu_device.parse_device(spec), nvml)
    if resolved.kind == "cuda":
        from .extras import gpu_without_torch

        resolved = gpu_without_torch(resolved, lambda: gpu_device.resolve("cpu", nvml))
    gpu_device.pin_environment(resolved)
    log.info("device: %s", gpu_device.describe(resolved))
    return resolved


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        for err in exc.errors():
            print(f"visionserve serve: --{'-'.join(str(p) for p in err['loc']).replace('_', '-')}: "
                  f"{err['msg']} (got {err.get('input')!r})", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    for warning in unknown_variables(os.environ):
        log.warning("%s", warning)
    try:
        from .security import load_token

        token = load_token(settings.auth_token, settings.auth_token_file)
        resolved = pin_device(settings.device)
        apply_process_settings(settings)
        from .engine import Engine

        engine = Engine(settings, device=resolved.torch_device)
        engine.scan()
        guard = None
        if settings.guard:
            p99 = engine.latency_p99() if settings.guard_latency_budget_ms else None
            guard = HostedGuard(settings, resolved, latency=p99)
            log_guard_access(settings.host, token)
    except VisionServeError as exc:
        if not settings.hold_on_error:
            print(f"visionserve serve: {exc.message}", file=sys.stderr)
            return 2
        print(f"visionserve serve: {exc.message} -- not serving; fix it, then restart "
              f"(hold_on_error: waiting for SIGTERM)", file=sys.stderr)
        return hold(2)
    code = run_loop(serve(engine, settings, guard))
    if code == 3 and settings.hold_on_error:   # start-up failed; the reason is logged
        log.error("not serving; fix it, then restart (hold_on_error: waiting for SIGTERM)")
        return hold(code)
    return code


def hold(code: int) -> int:
    """Stay up, serving nothing, until SIGTERM/SIGINT; then ``code``. Under a restart policy an
    exit would restart into the same error again and again (a crash loop that buries the reason);
    held, the container shows unhealthy and its log holds the reason once."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(60):
        pass
    return code


def open_guard_store(settings: ServerSettings):
    from .guard.store import JobStore, default_db_path

    return JobStore(str(settings.guard_db or default_db_path()))


class HostedGuard:
    """The training-queue guard's supervisor in a thread of the server, its API under /v1/guard."""

    def __init__(self, settings: ServerSettings, resolved, latency=None) -> None:
        """``latency``: the engine's served-p99 function, for ``--guard-latency-budget-ms``."""
        from .config import parse_bytes
        from .guard.memory import open_nvml_source
        from .guard.supervisor import Supervisor, SupervisorConfig

        self.store = open_guard_store(settings)
        source = None if resolved.gpu is None else open_nvml_source(resolved.gpu.uuid)
        budget = parse_bytes(settings.gpu_memory_budget) if settings.gpu_memory_budget else 0
        self.supervisor = Supervisor(self.store, source, SupervisorConfig(
            inference_floor=budget, margin=parse_bytes(settings.guard_margin),
            latency_budget_ms=settings.guard_latency_budget_ms), latency=latency)
        self._thread = None

    def router(self):
        from .guard.http import make_router

        return make_router(self.store)

    def start(self) -> None:
        import threading

        self._thread = threading.Thread(target=self.supervisor.run_forever, name="guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.supervisor.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=30)


def log_guard_access(host: str, token: str | None) -> None:
    """Say at start-up who may use the guard's job API, which runs commands."""
    from .security import GUARD_PREFIX, guard_api_refusal

    refusal = guard_api_refusal(token, host)
    if refusal:
        log.warning("guard: %s", refusal)
    elif token:
        log.info("guard: the job API (%s) runs commands; it needs the bearer token", GUARD_PREFIX)
    else:
        log.info("guard: the job API (%s) runs commands; open without a token to this machine only "
                 "(listening on %s)", GUARD_PREFIX, host)


def http_app(engine, settings: ServerSettings, routers: tuple = ()):
    """The ASGI app a front end serves: the FastAPI app behind auth and request ids."""
    from .http.app import create_app
    from .http.inspect import InspectFastPath
    from .security import HttpSecurity, guard_api_refusal, load_token

    token = load_token(settings.auth_token, settings.auth_token_file)
    return HttpSecurity(InspectFastPath(create_app(engine, settings, routers)), token,
                        settings.auth_health_open, settings.auth_metrics_open,
                        guard_api_refusal(token, settings.host) if settings.guard else None)


def http_server(app, engine, settings: ServerSettings) -> DrainingServer:
    import uvicorn

    from .http.connections import protocol_class

    tls = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)} \
        if settings.tls_cert else {}
    # the connection limit and the header timeout live in the protocol (uvicorn has no header
    # timeout, and its own limit let slow clients lock everyone out); no WebSocket routes here
    return DrainingServer(uvicorn.Config(
        app, host=settings.host, port=settings.http_port, log_level=settings.log_level,
        access_log=settings.log_level == "debug", timeout_keep_alive=30,
        timeout_graceful_shutdown=max(1.0, settings.drain_timeout_s),
        http=protocol_class(settings.header_timeout_s, settings.max_connections), ws="none",
        log_config=None, **tls,
    ), engine, settings.drain_timeout_s)


async def serve(engine, settings: ServerSettings, guard: HostedGuard | None = None) -> int:
    """Run HTTP (+ gRPC) until a signal, then drain; returns the exit code. The PLC servers
    (--opcua, --modbus) run alongside, in either front-end mode: the engine publishes to them."""
    from .plc.service import plc_running

    async with plc_running(engine, settings) as failed:
        return failed or await _serve(engine, settings, guard)


async def _serve(engine, settings: ServerSettings, guard: HostedGuard | None = None) -> int:
    if settings.frontends:
        from .frontends.procs import serve_with_frontends

        return await serve_with_frontends(engine, settings, guard)
    routers = (guard.router(),) if guard is not None else ()
    server = http_server(http_app(engine, settings, routers), engine, settings)
    grpc_server = None
    if settings.grpc_port >= 0:
        from .grpc.server import create_server

        try:
            grpc_server = create_server(engine, settings)
            await grpc_server.start()
        except VisionServeError as exc:
            log.error("%s", exc.message)
            return 2
        log.info("gRPC listening on %s:%d", settings.host, settings.grpc_port)
    server.grpc_server = grpc_server
    start = asyncio.create_task(_start_engine(engine, server))
    if guard is not None:
        guard.start()
    try:
        await server.serve()
    finally:
        if guard is not None:
            await asyncio.to_thread(guard.stop)
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)
        start.cancel()
        await engine.close()
    return server.exit_code


async def start_engine(engine) -> int:
    """Load and warm up every model; 0 when ready, else the exit code (3), the reason logged."""
    try:
        await engine.start()
        return 0
    except VisionServeError as exc:
        log.error("start-up failed: %s", exc.message)
    except Exception:
        log.exception("start-up failed")
    return 3


async def _start_engine(engine, server: DrainingServer) -> None:
    code = await start_engine(engine)
    if code:
        server.exit_code = code
        server.should_exit = True


def _uvicorn_server_class():
    import uvicorn

    return uvicorn.Server


class DrainingServer(_uvicorn_server_class()):  # type: ignore[misc]
    """uvicorn server whose first SIGTERM/SIGINT drains the engine before the sockets close, so
    readiness goes false and new requests get 503 while accepted ones still get answers."""

    def __init__(self, config, engine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
        self.grpc_server = None
        self._drain_task: asyncio.Task | None = None
        self.ignored_signals: tuple[int, ...] = ()

    def handle_exit(self, sig, frame) -> None:  # called from the signal handler
        if sig in self.ignored_signals:
            return
        if self._drain_task is not None:  # second signal: leave now
            self.force_exit = True
            self.should_exit = True
            return
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        log.info("shutdown requested: draining for up to %.1f s", self.drain_timeout_s)
        ok = await self.engine.drain(self.drain_timeout_s)
        if not ok:
            log.warning("drain timeout: unfinished frames were answered 503")
        self.should_exit = True
