"""The FastAPI application: OIP v2 routes, the inspect API, /metrics. It only translates."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import ServerSettings
from ..dataplane import DataPlane
from ..errors import VisionServeError, describe_validation
from ..security import ADMIN, classify
from ..users.store import Users, users_db_path
from . import cameras, inspect, live, recipes, signin, v2, verdict
from .common import (
    ClientGone,
    client_gone_response,
    engine_of,
    error_response,
    internal_error_response,
)
from .schemas import PROTECTED


def create_app(engine: DataPlane, settings: ServerSettings, routers: tuple = ()) -> FastAPI:
    docs = settings.api_docs  # off by default: the pages load their scripts from a CDN
    app = FastAPI(
        docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        title="visionserve",
        version=__version__,
        description="Batched inference for industrial vision: Open Inference Protocol v2 "
                    "(KServe v2 / Triton) and an inspect API for line controllers.",
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.users = Users(users_db_path(settings.users_db))  # opened once the file exists

    @app.exception_handler(VisionServeError)
    async def _vs_error(request: Request, exc: VisionServeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return client_gone_response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = "; ".join(describe_validation(exc))
        return JSONResponse({"error": f"bad request: {errs}"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(request.method, request.url.path)

    app.include_router(v2.router)
    app.include_router(inspect.router)
    app.include_router(verdict.router)
    app.include_router(recipes.router)
    app.include_router(signin.router)
    app.include_router(live.router)
    app.include_router(cameras.router)
    for extra in routers:
        app.include_router(extra)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await engine_of(request).metrics_text(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the answers of the access rules on the protected routes."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for path, operations in schema.get("paths", {}).items():
                for method, operation in operations.items():
                    if classify(method.upper(), path) == ADMIN:
                        operation["responses"] = {**{str(k): v for k, v in PROTECTED.items()},
                                                  **operation.get("responses", {})}
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    return app
