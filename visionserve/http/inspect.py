"""The inspect API for line controllers: one frame in the body, one verdict a PLC can act on."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import Headers

from .. import imaging
from ..dataplane import Origin, inspect_answer
from ..errors import DeadlineExceeded, InvalidInput, VisionServeError
from ..execution.results import FrameResult
from ..tasks import Task, annotate
from .common import (
    ClientGone,
    check_declared_length,
    client_gone_response,
    engine_of,
    error_response,
    internal_error_response,
    read_body,
    settings_of,
    unless_disconnected,
)
from .schemas import CONFLICT, ERRORS, InspectError, InspectResult

router = APIRouter(tags=["Inspect"])

_IMAGE = {"schema": {"type": "string", "format": "binary"}}
_BODY = {
    "requestBody": {
        "required": True,
        "description": "The frame as the camera software sent it. Raw pixels need X-Image-Shape.",
        "content": {"image/jpeg": _IMAGE, "image/png": _IMAGE, "image/bmp": _IMAGE,
                    "application/octet-stream": _IMAGE},
    },
    "parameters": [
        {"name": "X-Part-Id", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "Echoed in the answer."},
        {"name": "X-Camera-Id", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "Echoed in the answer; a station's camera (recipes.toml) makes the frame "
                        "that station's."},
        {"name": "X-Station-Id", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "The frame's station: decided under the recipe it runs; kept in the "
                        "part's record."},
        {"name": "X-Deadline-Ms", "in": "header", "required": False, "schema": {"type": "number"},
         "description": "Budget from arrival in ms; default: the model's takt_ms."},
        {"name": "X-Priority", "in": "header", "required": False, "schema": {"type": "integer"},
         "description": "Higher runs first; 0..priority_levels-1."},
        {"name": "X-Image-Shape", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "HxWxC for application/octet-stream raw uint8 pixels (RGB or grey)."},
    ],
}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERRORS, 415: {"model": InspectError, "description": "Unsupported media type"},
    **CONFLICT,
    504: {"model": InspectError,
          "description": "Deadline missed (in the queue, during decode, or before the verdict was "
          "ready): verdict LATE, no decision; late_ms says how late"}}


_N = TypeVar("_N", int, float)


def _header_number(headers: Headers, name: str, kind: type[_N]) -> _N | None:
    raw = headers.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = kind(raw.strip())
    except ValueError:
        raise InvalidInput(f"header {name}: {raw!r} is not "
                           f"{'an integer' if kind is int else 'a number'}") from None
    if kind is float and math.isnan(value):
        raise InvalidInput(f"header {name}: {raw!r} is not a number")
    return value


@dataclass(frozen=True, slots=True)
class InspectHead:
    """What an inspect request's head says, checked (and the frame admitted) before its body."""

    arrival: float
    part_id: str | None
    camera_id: str | None
    kind: imaging.Kind
    deadline_ms: float | None
    priority: int | None
    model: str  # the model and version it goes to: the URL's, or its station's recipe's
    version: str
    station: str | None = None  # the station it belongs to, and the recipe that station runs
    recipe: str | None = None


# where InspectFastPath leaves a head it read and admitted, for the route (scope key)
_HEAD_KEY = "visionserve.inspect_head"


def read_head(headers: Headers, engine, settings, model_name: str | None,
              model_version: str, station: str | None = None) -> InspectHead:
    """Check an inspect request from its head alone, and ask the engine for admission: raises
    the request's error (counted by the engine when it is its refusal), 503 for an overloaded
    model above all, so that a refused frame costs no body read, no image check and no copy.
    What is wrong with the request itself is said first (it never succeeds; a 503 says "try
    again"), so a body of unknown size (chunked) is read, and its size checked, before admission
    (``engine.infer`` admits it then).

    A frame of a station (``station`` from the URL, else ``X-Station-Id``, else its camera's)
    goes to the model and version of the recipe the station runs now (``model_name`` None: the
    station's URL); a URL that names another is a 409."""
    arrival = time.monotonic()
    part_id, camera_id = headers.get("x-part-id"), headers.get("x-camera-id")
    route = engine.route(model_name, model_version, station or headers.get("x-station-id"),
                         camera_id)
    model_name, model_version = route.model, route.version
    engine.get(model_name, model_version)
    kind = imaging.media_kind(headers.get("content-type"))
    deadline_ms = _header_number(headers, "X-Deadline-Ms", float)
    priority = _header_number(headers, "X-Priority", int)
    if headers.get("content-length") is not None:
        check_declared_length(headers, settings.max_body_bytes)
        engine.precheck(model_name, model_version, 1, deadline_ms=deadline_ms,
                        priority=priority, arrival=arrival,
                        origin=origin(part_id, camera_id, route.station, route.recipe, headers))
    return InspectHead(arrival, part_id, camera_id, kind, deadline_ms, priority, model_name,
                       model_version, route.station, route.recipe)


def origin(part_id: str | None, camera_id: str | None, station: str | None, recipe: str | None,
           headers: Headers) -> Origin:
    """Part id, camera id, station id and recipe for the PLC result bus and the part's record: the
    station the route found, else the X-Station-Id header."""
    return Origin(part_id, camera_id, station or headers.get("x-station-id") or None, recipe)


def head_error_response(exc: VisionServeError, engine, headers: Headers,
                        model_name: str | None) -> Response:
    if not exc.counted:  # refused here, before the engine (which counts what it answers)
        engine.count_error(model_name or "", exc)
    return error_response(exc, {"part_id": headers.get("x-part-id"), "model": model_name})


@router.post("/v1/models/{model_name}/inspect", response_model=InspectResult, responses=_RESPONSES,
             openapi_extra=_BODY, summary="Inspect one frame")
@router.post("/v1/models/{model_name}/versions/{model_version}/inspect",
             response_model=InspectResult, responses=_RESPONSES, openapi_extra=_BODY,
             summary="Inspect one frame with a model version")
async def inspect(request: Request, model_name: str, model_version: str = "") -> Response:
    return await inspect_frame(request, model_name, model_version)


@router.post("/v1/stations/{station}/inspect", response_model=InspectResult,
             responses=_RESPONSES, openapi_extra=_BODY,
             summary="Inspect one frame with the station's recipe")
async def inspect_station(request: Request, station: str) -> Response:
    return await inspect_frame(request, None, "", station)


async def inspect_frame(request: Request, model_name: str | None, model_version: str = "",
                        station: str | None = None) -> Response:
    engine, settings = engine_of(request), settings_of(request)
    head = request.scope.get(_HEAD_KEY)  # the protocol read the head already (InspectFastPath)
    if head is None:
        try:
            head = read_head(request.headers, engine, settings, model_name, model_version,
                             station)
        except VisionServeError as exc:
            return head_error_response(exc, engine, request.headers, model_name)
    part_id, camera_id, arrival = head.part_id, head.camera_id, head.arrival
    deadline_ms, priority, kind = head.deadline_ms, head.priority, head.kind
    model_name, model_version = head.model, head.version
    try:
        body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        if kind == "raw":
            shape = imaging.parse_shape(request.headers.get("x-image-shape"))
            frame = imaging.raw_frame(body, shape, max_pixels=settings.max_image_pixels)
        else:
            frame = imaging.encoded_frame(body, max_pixels=settings.max_image_pixels, expected=kind)
        served, (r,) = await unless_disconnected(
            request, engine.infer(model_name, model_version, [frame], deadline_ms=deadline_ms,
                                  priority=priority, arrival=arrival,
                                  origin=origin(part_id, camera_id, head.station, head.recipe,
                                                request.headers)))
    except DeadlineExceeded as exc:  # no decision for the PLC, whenever the deadline passed
        late_ms = None if exc.late_ms is None else round(exc.late_ms, 3)
        return error_response(exc, {"part_id": part_id, "model": model_name, "verdict": "LATE",
                                    "deadline_met": False, "late_ms": late_ms})
    except VisionServeError as exc:
        if not exc.counted:  # refused here, before the engine (which counts what it answers)
            engine.count_error(model_name, exc)
        return error_response(exc, {"part_id": part_id, "model": model_name})
    task = served.task
    assert task is not None  # every served version has its task (made when it loads)
    if wants_image(request):
        jpeg = await asyncio.to_thread(annotated, task, frame, r)
        headers = {"X-Verdict": r.verdict, "X-Model": served.name,
                   "X-Model-Version": str(served.version)}
        if part_id is not None:
            headers["X-Part-Id"] = part_id
        if head.recipe is not None:
            headers["X-Recipe"] = head.recipe
        return Response(jpeg, media_type="image/jpeg", headers=headers)
    answer = inspect_answer(served, r, frame, arrival, part_id=part_id, camera_id=camera_id,
                            station=head.station, recipe=head.recipe)
    return Response(json.dumps(answer, separators=(",", ":")).encode(),
                    media_type="application/json")




def wants_image(request: Request) -> bool:
    """The annotated frame instead of JSON: ``Accept: image/jpeg`` (before any JSON type), or
    ``?annotate=1``."""
    if request.query_params.get("annotate", "").lower() in ("1", "true", "yes"):
        return True
    accept = request.headers.get("accept", "")
    if "image/jpeg" not in accept:
        return False
    json_at = accept.find("application/json")
    return json_at < 0 or accept.find("image/jpeg") < json_at


def annotated(task: Task, frame: imaging.Frame, r: FrameResult) -> bytes:
    """The frame with its answer drawn on it, as JPEG (a thread: decode, draw, encode)."""
    image = imaging.decode(frame, 3)
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    image = np.ascontiguousarray(image)
    task.annotate(image, r.verdict, r.result)
    return annotate.encode_jpeg(image)


class InspectFastPath:
    """ASGI wrapper that serves ``POST .../inspect`` with the route function above, without
    FastAPI's routing and middleware stack. That stack cost more CPU per frame than the route
    itself, and the inspect API is the line's hot path. FastAPI keeps the route for the OpenAPI
    schema, and every other path goes to it unchanged."""

    PATH = re.compile(r"^/v1/(?:models/([^/]+)(?:/versions/([^/]+))?|stations/([^/]+))/inspect$")

    def __init__(self, app) -> None:
        self.app = app

    def answer_from_head(self, scope) -> Response | None:
        """The answer to an inspect request that its head decides (an overloaded model's 503
        above all, or a 4xx), made at once as the head arrives; None for a request whose frame
        was admitted, or any other request (the app serves it; an inspect route finds its head
        read in the scope). The HTTP protocol calls this before it starts the request's task:
        under overload most requests end here, without a task, the app stack or a read body."""
        match = self.PATH.match(scope["path"]) if scope["method"] == "POST" else None
        if match is None:
            return None
        state = self.app.state
        headers = Headers(scope=scope)
        try:
            scope[_HEAD_KEY] = read_head(headers, state.engine, state.settings, match[1],
                                         match[2] or "", match[3])
        except VisionServeError as exc:
            return head_error_response(exc, state.engine, headers, match[1])
        return None

    async def __call__(self, scope, receive, send) -> None:
        match = self.PATH.match(scope["path"]) \
            if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app  # engine_of / settings_of read the app's state
        request = Request(scope, receive, send)
        try:
            response = await inspect_frame(request, match[1], match[2] or "", match[3])
        except ClientGone:
            response = client_gone_response()
        except Exception:  # noqa: BLE001 - a bug: 500, the traceback in the log
            response = internal_error_response("POST", scope["path"])
        await response(scope, receive, send)
