"""The HTTP front end as a server: the ASGI app behind auth and request ids, served by uvicorn
with the connection limit and header timeout of :mod:`.connections`, and a first signal that
drains the engine before the sockets close. The gRPC counterpart is :mod:`visionserve.grpc.server`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn

from ..config import ServerSettings
from ..security import Access, HttpSecurity
from .app import create_app
from .connections import protocol_class
from .inspect import InspectFastPath

log = logging.getLogger("visionserve")


def http_app(engine, settings: ServerSettings, routers: tuple = ()):
    """The ASGI app a front end serves: the FastAPI app behind the access rules and request
    ids (``settings`` with the admin token resolved:
    :func:`~visionserve.security.with_admin_token`)."""
    app = create_app(engine, settings, routers)
    return HttpSecurity(InspectFastPath(app), Access.from_settings(settings), app.state.users)


def http_server(app, engine, settings: ServerSettings) -> DrainingServer:
    tls: dict[str, Any] = {"ssl_certfile": str(settings.tls_cert),
                           "ssl_keyfile": str(settings.tls_key)} if settings.tls_cert else {}
    # the connection limit and the header timeout live in the protocol (uvicorn has no header
    # timeout, and its own limit let slow clients lock everyone out); no WebSocket routes here
    return DrainingServer(uvicorn.Config(
        app, host=settings.host, port=settings.http_port, log_level=settings.log_level,
        access_log=settings.log_level == "debug", timeout_keep_alive=30,
        # uvicorn waits with asyncio.timeout, which takes float seconds; its annotation says int
        timeout_graceful_shutdown=max(1.0, settings.drain_timeout_s),  # type: ignore[arg-type]
        http=protocol_class(settings.header_timeout_s, settings.max_connections,
                            getattr(app, "answer_from_head", None),
                            settings.min_body_rate_bytes_s), ws="none",
        log_config=None, **tls,
        # X-Forwarded-For/-Proto only from the proxies named (uvicorn's default believes any
        # process on this machine, which could then write any client address into the audit)
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=settings.trusted_proxies or None,
    ), engine, settings.drain_timeout_s)


class DrainingServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM/SIGINT drains the engine before the sockets close, so
    readiness goes false and new requests get 503 while accepted ones still get answers; the
    live result streams then end; the listener then stays open while connections keep coming (see
    :meth:`~.connections.ConnectionTable.quiet`)."""

    def __init__(self, config, engine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
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
        # the live streams have had the last answers: they end now (an open one would hold the
        # connections' graceful close for its whole timeout)
        self.engine.feed.shut()
        table = getattr(self.config.http_protocol_class, "table", None)
        if table is not None:  # the late comers are answered before the listener closes
            await table.quiet()
        self.should_exit = True
