"""Security basics shared by both front ends: bearer-token auth and request ids.

Auth is off unless a token is configured (``--auth-token`` / ``VISIONSERVE_AUTH_TOKEN`` or
``--auth-token-file``). Once it is on, every path needs it but these, which change nothing, run
nothing and read no file: the health endpoints, so load balancers and kubelets can probe without
the secret (``--no-auth-health-open`` closes them too), and ``/metrics``, so Prometheus can scrape
it (``--no-auth-metrics-open`` closes it).

The training-queue guard's job API (``/v1/guard``, ``serve --guard``) runs commands, so it is
refused (403) unless a token is set, or the server listens on loopback only.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from pathlib import Path

from .errors import ConfigError
from .logs import new_request_id, request_id

HEALTH_PATHS = ("/v2/health/live", "/v2/health/ready")
GRPC_HEALTH_METHODS = ("/inference.GRPCInferenceService/ServerLive",
                       "/inference.GRPCInferenceService/ServerReady",
                       "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
METRICS_PATH = "/metrics"
GUARD_PREFIX = "/v1/guard"


def is_loopback(host: str) -> bool:
    """True when a server bound to ``host`` is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name, or "" (all interfaces)
        return False


def guard_api_refusal(token: str | None, host: str) -> str | None:
    """Why the guard's job API must stay shut, or None when it may be served (behind the token,
    or to local clients only). A client's address is no test: behind a reverse proxy on the same
    machine every client comes from 127.0.0.1."""
    if token or is_loopback(host):
        return None
    return (f"the guard's job API ({GUARD_PREFIX}) is off: it runs commands, and this server "
            f"listens on {host or 'all interfaces'} without an auth token. Set --auth-token or "
            "--auth-token-file, or --host 127.0.0.1; on this machine `visionserve guard submit` "
            "still queues jobs")


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
    """ASGI middleware: a request id for every request (``X-Request-Id`` in and out); when a
    token is set, ``Authorization: Bearer <token>`` on everything but the open paths; and 403 with
    ``guard_refusal`` as the message under the guard's prefix when that is given."""

    def __init__(self, app, token: str | None, health_open: bool = True, metrics_open: bool = True,
                 guard_refusal: str | None = None) -> None:
        self.app = app
        self.token = token
        self.open_paths = (set(HEALTH_PATHS) if health_open else set()) | \
            ({METRICS_PATH} if metrics_open else set())
        self.guard_refusal = guard_refusal

    def answer_from_head(self, scope) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """(status, headers, body) of a request that the app answers from its head alone
        (``answer_from_head`` of the app inside, the inspect API's), once it passes the checks
        here; None: serve the request as usual (then it keeps the request id given here). The
        HTTP protocol asks this as a request's head arrives (:mod:`.http.connections`)."""
        inner = getattr(self.app, "answer_from_head", None)
        if inner is None or scope["type"] != "http":
            return None
        headers = dict(scope.get("headers") or [])
        if self._refusal(scope["path"], headers) is not None:
            return None  # __call__ says it
        rid = scope[_RID_KEY] = _request_id(headers)
        reset = request_id.set(rid)
        try:
            response = inner(scope)
        finally:
            request_id.reset(reset)
        if response is None:
            return None
        return (response.status_code,
                [*response.raw_headers, (b"x-request-id", rid.encode("latin-1"))], response.body)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> tuple | None:
        """(status, message, extra headers) of a request refused here, or None."""
        if self.guard_refusal and (path == GUARD_PREFIX or path.startswith(GUARD_PREFIX + "/")):
            return 403, self.guard_refusal, ()
        if self.token and path not in self.open_paths:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not bearer_ok(auth, self.token):
                return (401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                        ((b"www-authenticate", b'Bearer realm="visionserve"'),))
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope.get(_RID_KEY)  # set once answer_from_head has checked this request
        headers = {} if rid else dict(scope.get("headers") or [])
        rid = rid or _request_id(headers)
        reset = request_id.set(rid)
        try:
            refused = None if _RID_KEY in scope else self._refusal(scope["path"], headers)
            if refused is not None:
                status, message, extra = refused
                await _reply(send, rid, status, message, *extra)
                return

            async def send_with_id(message) -> None:
                if message["type"] == "http.response.start":
                    message.setdefault("headers", [])
                    message["headers"] = list(message["headers"]) + [
                        (b"x-request-id", rid.encode("latin-1"))]
                await send(message)

            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(reset)


# where answer_from_head leaves the request id it gave to a request that passed its checks, for
# __call__ (scope key): present, the checks are not made twice
_RID_KEY = "visionserve.request_id"


def _request_id(headers: dict[bytes, bytes]) -> str:
    """The client's X-Request-Id (up to 64 characters), else a new one."""
    return headers.get(b"x-request-id", b"").decode("latin-1")[:64] or new_request_id()


async def _reply(send, rid: str, status: int, message: str, *headers: tuple[bytes, bytes]) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), *headers,
        (b"x-request-id", rid.encode("latin-1")), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def grpc_auth_interceptor(token: str, health_open: bool = True):
    """A grpc.aio server interceptor that requires ``authorization: Bearer <token>`` metadata."""
    import grpc

    open_methods = set(GRPC_HEALTH_METHODS) if health_open else set()

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
                if handler.response_streaming:
                    return grpc.stream_stream_rpc_method_handler(_deny_stream)
                return grpc.stream_unary_rpc_method_handler(_deny_async)
            if handler.response_streaming:
                return grpc.unary_stream_rpc_method_handler(_deny_stream)
            return grpc.unary_unary_rpc_method_handler(_deny_async)

    return AuthInterceptor()
