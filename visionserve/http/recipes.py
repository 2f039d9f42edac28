"""The stations' recipes, read and switched while the line runs: ``GET /v1/recipes``,
``GET /v1/stations/{station}``, ``POST /v1/stations/{station}/recipe``.

The engine checks and applies a switch (:meth:`DataPlane.switch_recipe`, see
:mod:`visionserve.recipes`); this only translates. The caller
(:func:`.common.caller_of`) goes to the audit line, as for the verdict settings.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from ..errors import InvalidInput
from .common import caller_of, engine_of, parse_json, read_body, settings_of
from .schemas import CONFLICT, ERRORS

router = APIRouter(tags=["Recipes"])

MAX_BODY = 16 * 1024


class StationRecipe(BaseModel):
    station: str
    recipe: str | None = Field(..., description="The recipe the station runs (null: none yet).")
    model: str | None = None
    version: int | None = Field(None, description="null: the model's default version.")
    verdict: dict[str, Any] = Field(default_factory=dict,
                                    description="[verdict] fields the recipe sets.")
    cameras: list[str] = Field(default_factory=list)


class SwitchAnswer(BaseModel):
    station: str
    recipe: str
    model: str
    version: int = Field(..., description="The version its frames go to now.")
    previous: str | None
    changeover_ms: float = Field(..., description="From the request to the switch in force.")
    persisted: bool = Field(..., description="Written to the state file: a restart resumes it.")


_POST_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"type": "object", "properties": {"recipe": {"type": "string"}},
               "required": ["recipe"]},
    "example": {"recipe": "housing-black"}}}},
    "parameters": [{"name": "X-Operator", "in": "header", "required": False,
                    "schema": {"type": "string"},
                    "description": "Who says they make the change: the audit line's "
                                   "operator_declared (unchecked)."}]}


@router.get("/v1/recipes", summary="Every recipe, and what each station runs")
async def get_recipes(request: Request) -> JSONResponse:
    return JSONResponse(engine_of(request).recipes.view())


@router.get("/v1/stations/{station}", response_model=StationRecipe, responses=ERRORS,
            summary="The recipe a station runs")
async def get_station(request: Request, station: str) -> JSONResponse:
    engine = engine_of(request)
    _, recipe = engine.recipe_for(station, None)  # 404 for an unknown station
    view = engine.recipes.view()["stations"][station]
    return JSONResponse({"station": station, **(recipe.view() if recipe else {"recipe": None}),
                         "cameras": view["cameras"]})


@router.post("/v1/stations/{station}/recipe", response_model=SwitchAnswer,
             responses={**ERRORS, **CONFLICT}, openapi_extra=_POST_BODY,
             summary="Switch the recipe a station runs")
async def switch_recipe(request: Request, station: str) -> JSONResponse:
    engine = engine_of(request)
    wanted = parse_json(await read_body(request, MAX_BODY, settings_of(request).body_timeout_s))
    if not isinstance(wanted, dict) or not isinstance(wanted.get("recipe"), str):
        raise InvalidInput('the body must be {"recipe": "<recipe id>"}')
    return JSONResponse(await engine.switch_recipe(station, wanted["recipe"], caller_of(request)))
