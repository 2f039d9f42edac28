"""The FastAPI application: OIP v2 routes, the inspect API, /metrics. It only translates."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import ServerSettings
from ..engine import Engine
from ..errors import (
    INTERNAL_MESSAGE,
    InvalidInput,
    PayloadTooLarge,
    RequestTimeout,
    Unavailable,
    VisionServeError,
    http_status,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def error_response(exc: VisionServeError, extra: dict | None = None) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return JSONResponse({"error": exc.message, **(extra or {})}, status_code=http_status(exc), headers=headers)


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, refusing (413) as soon as it passes ``limit`` bytes, and (408) when it
    does not arrive within ``timeout_s`` (a slow client must not hold a worker forever)."""
    if timeout_s is not None:
        try:
            return await asyncio.wait_for(read_body(request, limit), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise PayloadTooLarge(f"body of {int(declared)} bytes is over the limit of {limit} "
                                      "(setting max_body_bytes)")
        except ValueError:
            raise InvalidInput(f"bad Content-Length {declared!r}") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body is over the limit of {limit} bytes (setting max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


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


def create_app(engine: Engine, settings: ServerSettings, routers: tuple = ()) -> FastAPI:
    app = FastAPI(
        title="visionserve",
        version=__version__,
        description="Batched inference for industrial vision: Open Inference Protocol v2 "
                    "(KServe v2 / Triton) and an inspect API for line controllers.",
    )
    app.state.engine = engine
    app.state.settings = settings

    @app.exception_handler(VisionServeError)
    async def _vs_error(request: Request, exc: VisionServeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return client_gone_response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": f"bad request: {errs}"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(request.method, request.url.path)

    from . import inspect, v2

    app.include_router(v2.router)
    app.include_router(inspect.router)
    for extra in routers:
        app.include_router(extra)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await engine_of(request).metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def engine_of(request: Request) -> Engine:
    return request.app.state.engine


def settings_of(request: Request) -> ServerSettings:
    return request.app.state.settings


def not_ready() -> Unavailable:
    return Unavailable("not ready")
