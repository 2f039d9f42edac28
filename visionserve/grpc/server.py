"""The gRPC front end: ``inference.GRPCInferenceService`` (OIP v2) and ``grpc.health.v1.Health``.

``create_server(engine, settings)`` returns a server bound to ``settings.host:settings.grpc_port``;
``await server.start()`` serves, ``await server.stop(grace)`` ends. The health service says
SERVING exactly while the engine is ready: a small watcher follows readiness (start-up warm-up,
a model turning unhealthy, the drain on SIGTERM), and ``stop()`` turns it NOT_SERVING first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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


class GrpcServer:
    """A ``grpc.aio.Server`` plus the readiness watcher that keeps the health service current.

    Everything not defined here (``wait_for_termination``, ``add_insecure_port`` ...) is the
    wrapped ``grpc.aio.Server``'s.
    """

    def __init__(self, server: grpc.aio.Server, engine: DataPlane, health_servicer: Any,
                 address: str) -> None:
        self.server = server
        self.engine = engine
        self.health = health_servicer
        self.address = address
        self._watcher: asyncio.Task | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    async def start(self) -> None:
        await self._publish(self.engine.ready)
        await self.server.start()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self, grace: float | None = None) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def _publish(self, ready: bool) -> None:
        status = _SERVING if ready else _NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _watch(self) -> None:
        last = self.engine.ready
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            ready = self.engine.ready
            if ready != last:
                log.info("gRPC health: %s", "SERVING" if ready else "NOT_SERVING")
                await self._publish(ready)
                last = ready


def create_server(engine: DataPlane, settings: ServerSettings, *,
                  shared_port: bool = False) -> GrpcServer:
    """``shared_port``: several front-end processes serve the one port (SO_REUSEPORT); the serving
    process holds the port so that no other program can take it."""
    limit = settings.grpc_max_message_bytes
    from ..security import grpc_auth_interceptor, load_token

    token = load_token(settings.auth_token, settings.auth_token_file)
    interceptors = [grpc_auth_interceptor(token, settings.auth_health_open)] if token else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        # one port per server: a second server on the same port must fail, not share it
        ("grpc.so_reuseport", 1 if shared_port else 0),
    ])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
        InferenceServicer(engine, settings), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{_host(settings.host)}:{settings.grpc_port}"
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
    return GrpcServer(server, engine, health_servicer, address)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
