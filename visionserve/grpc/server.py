"""The gRPC front end: ``inference.GRPCInferenceService`` (OIP v2) and ``grpc.health.v1.Health``.

``create_server(engine, settings)`` returns a server bound to ``settings.host:settings.grpc_port``;
``await server.start()`` serves, ``await server.stop(grace)`` ends. The health service says
SERVING exactly while the engine is ready: each Check and each new Watch first brings it up to
date with the engine's readiness (so it agrees with HTTP ``/v2/health/ready`` at every moment), a
small watcher pushes later changes to open Watches (start-up warm-up, a model turning unhealthy,
the drain on SIGTERM), and ``stop()`` turns it NOT_SERVING first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2_grpc

from ..errors import ConfigError
from .servicer import InferenceServicer

if TYPE_CHECKING:
    from ..config import ServerSettings
    from ..dataplane import DataPlane

log = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"
#: how often readiness is looked at; a load balancer polls far less often than this
HEALTH_POLL_S = 0.2

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Health(health.aio.HealthServicer):
    """``grpc.health.v1.Health`` that brings its status up to date (``refresh``) before it answers a
    Check or opens a Watch: a client that has just seen the server answer never reads the
    readiness of up to one poll ago."""

    def __init__(self, refresh: Callable[[], Awaitable[None]]) -> None:
        super().__init__()
        self._refresh = refresh

    async def Check(self, request, context):
        await self._refresh()
        return await super().Check(request, context)

    async def Watch(self, request, context):
        await self._refresh()
        await super().Watch(request, context)


class GrpcServer:
    """A ``grpc.aio.Server`` plus the health service and the readiness watcher that keeps it
    current.

    Everything not defined here (``wait_for_termination``, ``add_insecure_port`` ...) is the
    wrapped ``grpc.aio.Server``'s.
    """

    def __init__(self, server: grpc.aio.Server, engine: DataPlane, address: str) -> None:
        self.server = server
        self.engine = engine
        self.address = address
        self.health = _Health(self._refresh)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self._published: bool | None = None  # the readiness the health service says
        self.ipv6_hold: socket.socket | None = None  # see _hold_ipv6_wildcard
        self._watcher: asyncio.Task | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    async def start(self) -> None:
        await self._refresh()
        await self.server.start()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self, grace: float | None = None) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.ipv6_hold is not None:
            self.ipv6_hold.close()

    async def _publish(self, ready: bool) -> None:
        status = _SERVING if ready else _NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _refresh(self) -> None:
        """The engine's readiness into the health service, where it changed."""
        ready = self.engine.ready
        if ready != self._published:
            if self._published is not None:
                log.info("gRPC health: %s", "SERVING" if ready else "NOT_SERVING")
            self._published = ready
            await self._publish(ready)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self._refresh()


def create_server(engine: DataPlane, settings: ServerSettings, *,
                  shared_port: bool = False) -> GrpcServer:
    """``shared_port``: several front-end processes serve the one port (SO_REUSEPORT); the serving
    process holds the port so that no other program can take it."""
    limit = settings.grpc_max_message_bytes
    from ..security import Access, grpc_auth_interceptor

    interceptor = grpc_auth_interceptor(Access.from_settings(settings))
    server = grpc.aio.server(interceptors=[interceptor] if interceptor else [], options=[
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        # one port per server: a second server on the same port must fail, not share it
        ("grpc.so_reuseport", 1 if shared_port else 0),
    ])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
        InferenceServicer(engine, settings), server)
    port, ipv6_hold = settings.grpc_port, None
    if settings.host == "0.0.0.0":
        ipv6_hold = _hold_ipv6_wildcard(port)
        if ipv6_hold is not None:
            port = ipv6_hold.getsockname()[1]
    address = f"{_host(settings.host)}:{port}"
    grpc_server = GrpcServer(server, engine, address)
    grpc_server.ipv6_hold = ipv6_hold
    try:
        if settings.tls_cert:
            assert settings.tls_key is not None  # the settings check they come together
            creds = grpc.ssl_server_credentials(
                [(Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())])
            server.add_secure_port(address, creds)
        else:
            server.add_insecure_port(address)
    except OSError as exc:
        raise ConfigError(f"cannot read the TLS certificate or key: {exc}") from None
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen for gRPC on {address}: {exc}") from None
    return grpc_server


def _hold_ipv6_wildcard(port: int) -> socket.socket | None:
    """A socket bound to [::]:``port`` (IPv6 only, never listening), or None where there is no
    IPv6 or another socket holds it already. gRPC takes 0.0.0.0 for "every address, IPv6 too"
    (it binds [::] dual-stack); with [::] taken it binds 0.0.0.0 alone, as HTTP does."""
    hold = None
    try:
        hold = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        hold.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        hold.bind(("::", port))
    except OSError:
        if hold is not None:
            hold.close()
        return None
    return hold


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
