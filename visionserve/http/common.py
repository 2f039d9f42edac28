"""What every route module of the HTTP front end shares: reading a body within its limits,
dropping the work of a client that left, and turning errors into answers. The routes
(:mod:`.v2`, :mod:`.inspect`) and the app (:mod:`.app`) import this; it imports none of them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from ..audit import AuditTrail
from ..config import ServerSettings
from ..errors import (
    INTERNAL_MESSAGE,
    InvalidInput,
    PayloadTooLarge,
    RequestTimeout,
    VisionServeError,
    http_status,
    retry_after,
)
from ..logs import request_id
from ..security import IDENTITY_KEY

if TYPE_CHECKING:
    from ..dataplane import DataPlane

log = logging.getLogger(__name__)

T = TypeVar("T")


def error_response(exc: VisionServeError, extra: dict | None = None) -> JSONResponse:
    wait = retry_after(exc)
    headers = {"Retry-After": wait} if wait is not None else {}
    return JSONResponse({"error": exc.message, **(extra or {})},
                        status_code=http_status(exc), headers=headers)


def check_declared_length(headers: Headers, limit: int, setting: str = "max_body_bytes") -> None:
    """413 for a body whose Content-Length is over ``limit`` (the value of ``setting``), from the
    head alone (a request that can never be taken is told so before it would be told to retry
    later)."""
    declared = headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise PayloadTooLarge(f"body of {int(declared)} bytes is over the limit of {limit} "
                                      f"(setting {setting})")
        except ValueError:
            raise InvalidInput(f"bad Content-Length {declared!r}") from None


async def read_body(request: Request, limit: int, timeout_s: float | None = None,
                    setting: str = "max_body_bytes") -> bytes:
    """The whole body, refusing (413) as soon as it passes ``limit`` bytes (the value of
    ``setting``), and (408) when it does not arrive within ``timeout_s`` (a slow client must not
    hold a worker forever)."""
    if timeout_s is not None:
        try:
            return await asyncio.wait_for(read_body(request, limit, setting=setting), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} "
                                 "s") from None
    check_declared_length(request.headers, limit, setting)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body is over the limit of {limit} bytes (setting "
                                      f"{setting})")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut by the server (a body below the minimum rate)
        raise ClientGone() from None
    return b"".join(chunks)


async def read_json_object(request: Request, limit: int, what: str = "",
                           empty: dict | None = None) -> dict:
    """The body as a JSON object (400 otherwise; ``what`` says what it must hold); ``empty``:
    the value of an empty body, which is refused when None."""
    body = await read_body(request, limit, request.app.state.settings.body_timeout_s)
    if empty is not None and not body.strip():
        return empty
    data = parse_json(body)
    if not isinstance(data, dict):
        raise InvalidInput(f"the body must be a JSON object{what}")
    return data


def parse_json(body: bytes) -> Any:
    """The body as JSON; 400 (InvalidInput) for one that is not, or is nested too deeply for
    the parser (which raises RecursionError)."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("the body is not JSON this server takes: nested too deeply") from None


def caller_of(request: Request) -> dict[str, Any]:
    """Who made a change, for the audit line: the client's address, the request id, the
    ``operator`` the credential names (``admin-token``, ``loopback``: docs/security.md) and the
    ``X-Operator`` header as ``operator_declared`` (what the client says, unchecked)."""
    client = request.client
    return {"client": f"{client.host}:{client.port}" if client else "?",
            "request_id": request_id.get(), "operator": request.scope.get(IDENTITY_KEY),
            "operator_declared": request.headers.get("x-operator")}


class ClientGone(Exception):
    """The client disconnected before its answer: nothing can be sent back.

    Raised instead of ``CancelledError``, which escaped the app and made uvicorn log "Exception in
    ASGI application" with a traceback for every line controller that timed out.
    """


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it so its frames never run."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    log.info("client disconnected before its answer; request dropped")
    raise ClientGone()


def client_gone_response() -> Response:
    # never reaches the client (uvicorn drops sends after a disconnect); 499 as nginx logs it
    return Response(status_code=499)


def internal_error_response(method: str, path: str) -> JSONResponse:
    """Called from an ``except``: the traceback goes to the log, the client gets one line."""
    log.exception("unhandled error on %s %s", method, path)
    return JSONResponse({"error": INTERNAL_MESSAGE}, status_code=500)


def engine_of(request: Request) -> DataPlane:
    return request.app.state.engine


def settings_of(request: Request) -> ServerSettings:
    return request.app.state.settings


def audit_of(request: Request) -> AuditTrail:
    """The process's audit trail (:mod:`visionserve.audit`), for the changes a route makes
    itself (sign-ins and sign-outs) and for reading it."""
    return request.app.state.audit

