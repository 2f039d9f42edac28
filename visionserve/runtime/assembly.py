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
from .hosted import HostedGuard, start_mps, watch_batchers
from .startup import apply_process_settings, choose_execution, pin_device, start_engine

log = logging.getLogger("visionserve")


def assemble(settings: ServerSettings):
    """(settings, engine, hosted guard or None), the device pinned, the front ends and batch
    workers chosen (:func:`~.startup.choose_execution`: the returned settings say how many) and
    the models scanned (not loaded: :func:`serve` starts them). ``settings`` comes with the admin
    token resolved (:func:`~visionserve.security.with_admin_token`). Raises VisionServeError on
    bad settings or model repository."""
    from ..security import Access

    for line in Access.from_settings(settings).summary(settings):  # the token files read
        log.info("access: %s", line)
    resolved = pin_device(settings.device)
    settings = choose_execution(settings, on_gpu=resolved.kind == "cuda")
    apply_process_settings(settings)
    mps = None
    if settings.guard and settings.guard_mps:  # before anything here initialises CUDA
        mps = start_mps(settings, resolved)
    from ..engine import Engine

    engine = Engine(settings, device=resolved.torch_device)
    engine.scan()
    watch_batchers(settings)
    guard = None
    if settings.guard:
        p99 = engine.latency_p99() if settings.guard_latency_budget_ms else None
        guard = HostedGuard(settings, resolved, latency=p99, mps=mps)
    return settings, engine, guard


async def serve(engine, settings: ServerSettings, guard: HostedGuard | None = None) -> int:
    """Run HTTP (+ gRPC) until a signal, then drain; returns the exit code. The PLC servers
    (--opcua, --modbus), the record writer (--records) and the cameras run alongside, in either
    front-end mode: the engine hands them every answer, and the cameras' frames go to it."""
    from ..cameras.service import cameras_running
    from ..plc.service import plc_running
    from ..records.service import records_running

    async with records_running(engine, settings) as failed, \
            plc_running(engine, settings) as plc_failed, \
            cameras_running(engine, settings) as cameras_failed:
        if failed or plc_failed or cameras_failed:
            return failed or plc_failed or cameras_failed
        if settings.frontends:
            from .procs import serve_with_frontends

            return await serve_with_frontends(engine, settings, guard)
        return await serve_here(engine, settings, guard)


def service_routers(settings: ServerSettings, guard_store=None) -> tuple:
    """The services' HTTP routes of a process's app: the guard's job API (with ``guard_store``),
    the part records (``--records``), the console (``--console``)."""
    routers = []
    if guard_store is not None:
        from ..audit import AuditTrail
        from ..guard.http import make_router

        routers.append(make_router(guard_store, AuditTrail.from_settings(settings)))
    store = shadows = None
    if settings.records:
        from ..loop.http import make_router as loop_router
        from ..loop.shadow import Shadows
        from ..records.http import make_router as records_router
        from ..records.service import images_of, store_of

        store = store_of(settings)
        images = images_of(settings)
        shadows = Shadows()
        routers.append(records_router(store, images))
        routers.append(loop_router(store, images, guard_store, shadows))
    if settings.console:
        from ..console.pages import make_router as console_router

        routers.append(console_router(settings, guard_store, store, shadows))
    return tuple(routers)


async def serve_here(engine, settings: ServerSettings, guard: HostedGuard | None = None) -> int:
    """The front ends in this process, beside the engine."""
    from ..http.connections import refuse_until_quiet
    from ..http.server import http_app, http_server
    from .ports import check_free, listen_socket

    try:  # both ports before anything starts (see .ports)
        http_sock = listen_socket(settings.host, settings.http_port, "--http-port")
    except VisionServeError as exc:
        log.error("%s", exc.message)
        return 2
    routers = service_routers(settings, guard.store if guard is not None else None)
    server = http_server(http_app(engine, settings, routers), engine, settings)
    grpc_server = None
    if settings.grpc_port >= 0:
        from ..grpc.server import create_server

        try:
            check_free(settings.host, settings.grpc_port, "--grpc-port")
            grpc_server = create_server(engine, settings)
            await grpc_server.start()
        except VisionServeError as exc:
            log.error("%s", exc.message)
            http_sock.close()
            return 2
        log.info("gRPC listening on %s:%d", settings.host, settings.grpc_port)
    log.info("HTTP listening on %s:%d", settings.host, http_sock.getsockname()[1])
    start = asyncio.create_task(_start_engine(engine, server))
    if guard is not None:
        guard.start()
    try:
        # uvicorn closes the socket it serves: it serves a copy, and this one answers what is
        # left in the backlog before it closes (see refuse_until_quiet), as with --frontends
        await server.serve(sockets=[http_sock.dup()])
        if not server.force_exit:  # a second signal: leave now
            await refuse_until_quiet(http_sock, server.config.ssl)
    finally:
        http_sock.close()
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
