"""Security basics shared by both front ends: bearer-token auth and request ids.

Auth is off unless a token is configured (``--auth-token`` / ``VISIONSERVE_AUTH_TOKEN`` or
``--auth-token-file``). Health endpoints stay open by default so load balancers and kubelets can
probe without the secret (``--no-auth-health-open`` closes them too).
"""

from __future__ import annotations

import hmac
import json
import uuid
from pathlib import Path

from .errors import ConfigError
from .logs import request_id

HEALTH_PATHS = ("/v2/health/live", "/v2/health/ready")
GRPC_HEALTH_METHODS = ("/inference.GRPCInferenceService/ServerLive",
                       "/inference.GRPCInferenceService/ServerReady",
                       "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


def load_token(token: str | None, token_file: Path | None) -> str | None:
    if token and token_file:
        raise ConfigError("give either auth_token or auth_token_file, not both")
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"auth_token_file {token_file}: {exc.strerror or exc}") from None
        if not token:
            raise ConfigError(f"auth_token_file {token_file} is empty")
    return token or None


def bearer_ok(header: str | None, token: str) -> bool:
    if not header or not header.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


class HttpSecurity:
    """ASGI middleware: a request id for every request (``X-Request-Id`` in and out) and, when a
    token is set, ``Authorization: Bearer <token>`` on everything but the open paths."""

    def __init__(self, app, token: str | None, health_open: bool = True) -> None:
        self.app = app
        self.token = token
        self.open_paths = set(HEALTH_PATHS) if health_open else set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or uuid.uuid4().hex[:16]
        reset = request_id.set(rid)
        try:
            if self.token and scope["path"] not in self.open_paths:
                auth = headers.get(b"authorization", b"").decode("latin-1")
                if not bearer_ok(auth, self.token):
                    await _deny(send, rid)
                    return

            async def send_with_id(message) -> None:
                if message["type"] == "http.response.start":
                    message.setdefault("headers", [])
                    message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode("latin-1"))]
                await send(message)

            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(reset)


async def _deny(send, rid: str) -> None:
    body = json.dumps({"error": "missing or wrong bearer token (Authorization: Bearer <token>)"}).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="visionserve"'),
        (b"x-request-id", rid.encode("latin-1")), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def grpc_auth_interceptor(token: str, health_open: bool = True):
    """A grpc.aio server interceptor that requires ``authorization: Bearer <token>`` metadata."""
    import grpc

    open_methods = set(GRPC_HEALTH_METHODS) if health_open else set()

    def _deny_unary(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def _deny_async(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def _deny_stream(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        yield  # pragma: no cover - makes this an async generator

    class AuthInterceptor(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            if details.method in open_methods:
                return await continuation(details)
            meta = dict(details.invocation_metadata or ())
            if bearer_ok(meta.get("authorization"), token):
                return await continuation(details)
            handler = await continuation(details)
            if handler is None:
                return None
            if handler.request_streaming:
                return grpc.stream_stream_rpc_method_handler(_deny_stream) if handler.response_streaming \
                    else grpc.stream_unary_rpc_method_handler(_deny_async)
            if handler.response_streaming:
                return grpc.unary_stream_rpc_method_handler(_deny_stream)
            return grpc.unary_unary_rpc_method_handler(_deny_async)

    return AuthInterceptor()
