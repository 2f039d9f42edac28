"""A model's verdict settings, read and changed while it serves: ``GET``/``PUT
/v1/models/{m}/verdict``, and ``POST /v1/models/{m}/verdict/preview``: what a change would make
of the model's last answered frames (``--preview-frames``), validated as the ``PUT``, nothing
changed.

The body of a ``PUT`` is a JSON object of ``[verdict]`` fields to set (the others keep their
values; ``null`` puts a field back to its default). The engine validates it by the model's
``model.toml`` schema, writes the file and swaps the served settings (:meth:`DataPlane.verdict`);
this route only translates. The caller (:func:`.common.caller_of`) goes to the audit line.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from .common import caller_of, engine_of, read_json_object
from .schemas import ERRORS

router = APIRouter(tags=["Verdict"])

#: a [verdict] section is a few numbers and polygons
MAX_BODY = 256 * 1024


class VerdictAnswer(BaseModel):
    model: str
    verdict: dict[str, Any] = Field(
        ..., description="The model's [verdict] in force (every field, defaults included).")


_PUT_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"type": "object", "additionalProperties": True},
    "example": {"image_threshold": 0.6}}},
    "description": "[verdict] fields of the model's model.toml to set; null: back to the "
                   "default. Validated like model.toml; 400 and nothing changed otherwise."},
    "parameters": [{"name": "X-Operator", "in": "header", "required": False,
                    "schema": {"type": "string"},
                    "description": "Who says they make the change: the audit line's "
                                   "operator_declared (unchecked)."}]}


@router.get("/v1/models/{model_name}/verdict", response_model=VerdictAnswer, responses=ERRORS,
            summary="The model's verdict settings")
async def get_verdict(request: Request, model_name: str) -> JSONResponse:
    values = await engine_of(request).verdict(model_name)
    return JSONResponse({"model": model_name, "verdict": values})


@router.put("/v1/models/{model_name}/verdict", response_model=VerdictAnswer, responses=ERRORS,
            openapi_extra=_PUT_BODY, summary="Change the model's verdict settings")
async def put_verdict(request: Request, model_name: str) -> JSONResponse:
    engine = engine_of(request)
    engine.entry(model_name)  # 404 before the body
    changes = await read_json_object(request, MAX_BODY, " of [verdict] fields to change")
    values = await engine.verdict(model_name, changes, caller_of(request))
    return JSONResponse({"model": model_name, "verdict": values})


class ChangedFrame(BaseModel):
    request_id: str | None
    part_id: str | None
    frame_index: int
    version: str
    old: str = Field(..., description="The verdict it was answered with.")
    new: str = Field(..., description="The verdict it would get under the change.")
    time: str = Field(..., description="When it arrived, ISO 8601 UTC.")
    timestamp: float


class PreviewAnswer(BaseModel):
    model: str
    frames: int = Field(..., description="The model's kept answered frames (--preview-frames).")
    changed: int = Field(..., description="How many of them would change verdict.")
    frames_changed: list[ChangedFrame] = Field(..., description="Those, newest first.")
    unavailable: int = Field(..., description="Frames that could not be judged again: the rule "
                                              "needs outputs that are not kept.")
    why: str | None


@router.post("/v1/models/{model_name}/verdict/preview", response_model=PreviewAnswer,
             responses=ERRORS, openapi_extra={"requestBody": _PUT_BODY["requestBody"]},
             summary="What a change of the verdict settings would make of the last frames")
async def preview_verdict(request: Request, model_name: str) -> JSONResponse:
    engine = engine_of(request)
    engine.entry(model_name)  # 404 before the body, as the PUT
    changes = await read_json_object(request, MAX_BODY, " of [verdict] fields to change")
    answer = await engine.preview_verdict(model_name, changes)
    return JSONResponse({"model": model_name, **answer})
