"""The cameras the server acquires from: ``POST /v1/cameras/{name}/trigger``,
``POST /v1/stations/{station}/trigger`` and ``GET /v1/cameras`` (docs/cameras.md).

A trigger grabs a frame from the camera (from each camera of the station) and answers with the
inspect JSON, plus ``cameras``: each camera's own answer. The cameras live in the serving
process (:mod:`visionserve.cameras.service`); :meth:`DataPlane.trigger` reaches them from a
``--frontends`` process too. This only translates.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..dataplane import MAX_PART_ID
from ..errors import InvalidInput, VisionServeError
from .common import engine_of, error_response
from .schemas import CONFLICT, ERRORS

router = APIRouter(tags=["Cameras"])

_TRIGGER = {
    "parameters": [{"name": "X-Part-Id", "in": "header", "required": False,
                    "schema": {"type": "string", "maxLength": MAX_PART_ID},
                    "description": "The part the frame is of: in the answer, the record and the "
                                   "PLC result."}]}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERRORS, **CONFLICT,
    200: {"description": "A verdict (OK, NG): the inspect JSON, with each camera's answer "
                         "under cameras"},
    503: {"description": "A camera gave no frame (verdict ERROR, fault says why), or the model "
                         "is not ready: no decision"},
    504: {"description": "Deadline missed: verdict LATE, no decision"}}


def _part_id(request: Request) -> str | None:
    part_id = request.headers.get("x-part-id")
    if part_id is not None and len(part_id) > MAX_PART_ID:
        raise InvalidInput(f"X-Part-Id of {len(part_id)} characters; at most {MAX_PART_ID}")
    return part_id or None


async def _trigger(request: Request, target: str, station: bool) -> Response:
    engine = engine_of(request)
    try:
        status, answer = await engine.trigger(target, _part_id(request), station)
    except VisionServeError as exc:
        return error_response(exc, {"part_id": request.headers.get("x-part-id"),
                                    "station" if station else "camera_id": target})
    return Response(json.dumps(answer, separators=(",", ":")).encode(), status_code=status,
                    media_type="application/json")


@router.post("/v1/cameras/{name}/trigger", summary="Grab a frame from the camera and inspect it",
             openapi_extra=_TRIGGER, responses=_RESPONSES)
async def trigger_camera(request: Request, name: str) -> Response:
    return await _trigger(request, name, False)


@router.post("/v1/stations/{station}/trigger",
             summary="Grab a frame from each camera of the station and inspect the part",
             openapi_extra=_TRIGGER, responses=_RESPONSES)
async def trigger_station(request: Request, station: str) -> Response:
    return await _trigger(request, station, True)


@router.get("/v1/cameras", summary="Each camera: up or down, its last error and counters")
async def cameras(request: Request) -> JSONResponse:
    return JSONResponse({"cameras": await engine_of(request).camera_states()})
