"""Build a serving process from its settings, and run it.

:func:`assemble` turns settings into an engine (device pinned, models scanned) and, with
``--guard``, the hosted guard; :func:`serve` runs them: the PLC servers alongside, the front ends
in this process (HTTP, and gRPC unless ``--grpc-port -1``), or ``--frontends N`` processes
(:mod:`.procs`). Nothing here parses a command line or prints; :mod:`.serve` does.
"""

from __future__ import annotations

import asyncio
import logging

from ..config import ServerSettings
from ..errors import VisionServeError
from .hosted import HostedGuard, log_guard_access
from .startup import apply_process_settings, pin_device, start_engine

log = logging.getLogger("visionserve")


def assemble(settings: ServerSettings):
    """(engine, hosted guard or None), the device pinned and the models scanned (not loaded:
    :func:`serve` starts them). Raises VisionServeError on bad settings or model repository."""
    from ..security import load_token

    token = load_token(settings.auth_token, settings.auth_token_file)
    resolved = pin_device(settings.device)
    apply_process_settings(settings)
    from ..engine import Engine

    engine = Engine(settings, device=resolved.torch_device)
    engine.scan()
    guard = None
    if settings.guard:
        p99 = engine.latency_p99() if settings.guard_latency_budget_ms else None
        guard = HostedGuard(settings, resolved, latency=p99)
        log_guard_access(settings.host, token)
    return engine, guard


async def serve(engine, settings: ServerSettings, guard: HostedGuard | None = None) -> int:
    """Run HTTP (+ gRPC) until a signal, then drain; returns the exit code. The PLC servers
    (--opcua, --modbus) run alongside, in either front-end mode: the engine publishes to them."""
    from ..plc.service import plc_running

    async with plc_running(engine, settings) as failed:
        if failed:
            return failed
        if settings.frontends:
            from .procs import serve_with_frontends

            return await serve_with_frontends(engine, settings, guard)
        return await serve_here(engine, settings, guard)


async def serve_here(engine, settings: ServerSettings, guard: HostedGuard | None = None) -> int:
    """The front ends in this process, beside the engine."""
    from ..http.server import http_app, http_server

    routers = (guard.router(),) if guard is not None else ()
    server = http_server(http_app(engine, settings, routers), engine, settings)
    grpc_server = None
    if settings.grpc_port >= 0:
        from ..grpc.server import create_server

        try:
            grpc_server = create_server(engine, settings)
            await grpc_server.start()
        except VisionServeError as exc:
            log.error("%s", exc.message)
            return 2
        log.info("gRPC listening on %s:%d", settings.host, settings.grpc_port)
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


async def _start_engine(engine, server) -> None:
    code = await start_engine(engine)
    if code:
        server.exit_code = code
        server.should_exit = True
