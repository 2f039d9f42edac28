"""A model's verdict settings, read and changed while it serves: ``GET``/``PUT
/v1/models/{m}/verdict``.

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
