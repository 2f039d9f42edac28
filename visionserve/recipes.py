"""Recipes: which model, version and verdict settings a station inspects with, switched while the
line runs (``recipes.toml``; ``POST /v1/stations/{station}/recipe``).

A line changes product several times a shift. Each product variant is a *recipe*: a model, its
version, and ``[verdict]`` settings. Each *station* (a place on the line, with its cameras) runs
one recipe at a time::

    [recipe.housing-black]
    description = "Housing, black ABS"
    model = "defect-classifier"
    version = 1                     # optional: the model's default version
    verdict = { ok_threshold = 0.6 } # optional: [verdict] fields while this recipe runs

    [station.line1-st3]
    recipe = "housing-black"        # at start, until switched
    cameras = ["cam-7", "cam-8"]    # optional: frames from these cameras are this station's

``[camera.NAME]`` tables are the cameras the server acquires from itself (:class:`CameraSpec`;
docs/cameras.md); ``--camera NAME=URI`` adds more (:func:`with_cameras`).

A frame belongs to a station by its ``X-Station-Id`` header (or OIP parameter ``station_id``),
else by its camera id when a station lists that camera. A station's frames are inspected with the
recipe's model and version, and every answer names the recipe it was decided under. A switch is
atomic: a frame admitted before it is decided under the old recipe, a frame after it under the
new one. The switch applies the recipe's verdict settings through the model's own
verdict settings (the same as ``PUT /v1/models/{m}/verdict``: validated, written to model.toml,
audited), so two stations may share a model only with the same verdict settings: a switch that
would change the settings under another station's recipe is refused (409).

The stations' recipes in force are kept in a state file beside the recipes file
(``<recipes>.active.json``, written atomically), so a restart resumes them.

This module holds the book (parse, check, who runs what); the engine applies a switch
(:meth:`visionserve.engine.Engine.switch_recipe`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config import PASSWORD_IN_URI, has_password, parse_camera_option
from .errors import ConfigError, NotFound, describe_validation

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger(__name__)

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"


class RecipeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    model: str = Field(..., min_length=1, description="The served model this recipe inspects with.")
    version: int | None = Field(None, ge=1, description="Its version (default: the model's).")
    verdict: dict[str, Any] = Field(
        default_factory=dict, description="[verdict] fields set while this recipe runs.")


class StationSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    recipe: str | None = Field(None, description="The recipe at start (until switched).")
    cameras: list[str] = Field(default_factory=list,
                               description="Camera ids whose frames belong to this station.")


class CameraSpec(BaseModel):
    """A camera the server acquires from itself (``[camera.NAME]``; docs/cameras.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(..., min_length=1,
                        description="folder:PATH, gige://DEVICE or rtsp://HOST/PATH (no password "
                                    "in it: credentials come from --camera-credentials or the "
                                    "environment).")
    model: str | None = Field(None, description="The model its frames go to when no station "
                                                "lists it (a station's go to its recipe's).")
    version: int | None = Field(None, ge=1, description="That model's version (default: its "
                                                        "default).")
    trigger: Literal["software", "hardware", "free"] = Field(
        "software", description="software: a trigger call grabs a frame; hardware: the camera's "
                                "own input triggers, each frame is inspected; free: free-running.")
    rate_hz: float | None = Field(None, gt=0, le=1000,
                                  description="Frames per second when free-running.")
    timeout_s: float = Field(1.0, gt=0, le=60, description="How long a grab may take.")
    settings: dict[str, Any] = Field(default_factory=dict,
                                     description="The source's own settings (docs/cameras.md).")

    @field_validator("source")
    @classmethod
    def _no_password(cls, uri: str) -> str:
        if has_password(uri):
            raise ValueError(PASSWORD_IN_URI)
        return uri.strip()

    @model_validator(mode="after")
    def _rate(self) -> CameraSpec:
        if self.trigger == "free" and self.rate_hz is None:
            raise ValueError("trigger 'free' needs rate_hz (frames per second)")
        return self

    def source_settings(self) -> dict[str, Any]:
        """What the source is opened with: its own settings, and how it is triggered."""
        return {**self.settings, "trigger": self.trigger, "rate_hz": self.rate_hz}


class RecipeFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    recipe: dict[str, RecipeSpec] = Field(default_factory=dict)
    station: dict[str, StationSpec] = Field(default_factory=dict)
    camera: dict[str, CameraSpec] = Field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    """A product variant: what its frames are inspected with."""

    id: str
    model: str
    version: int | None = None
    verdict: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    def view(self) -> dict[str, Any]:
        return {"recipe": self.id, "model": self.model, "version": self.version,
                "verdict": dict(self.verdict), "description": self.description}


@dataclass(frozen=True)
class Assignments:
    """Who runs what, as one value: a switch replaces it whole (readers never see half of one).
    ``stations``: station -> recipe id (None: no recipe yet); ``cameras``: camera -> station;
    ``sources``: the cameras the server acquires from itself (``[camera.NAME]``, ``--camera``)."""

    recipes: Mapping[str, Recipe]
    stations: Mapping[str, str | None]
    cameras: Mapping[str, str]
    sources: Mapping[str, CameraSpec] = field(default_factory=dict)

    def station_of(self, station: str | None, camera: str | None) -> str | None:
        """The station a frame belongs to: named, else by its camera (None: no station)."""
        if station:
            return station
        return self.cameras.get(camera) if camera else None

    def recipe_of(self, station: str | None) -> Recipe | None:
        """The recipe ``station`` runs (None: no station, or one without a recipe). An unknown
        station is a 404: a typo must not quietly inspect with the URL's model."""
        if station is None:
            return None
        if station not in self.stations:
            raise NotFound(f"unknown station {station!r}; stations: {sorted(self.stations)}")
        rid = self.stations[station]
        return None if rid is None else self.recipes[rid]

    def view(self) -> dict[str, Any]:
        return {"recipes": {rid: r.view() for rid, r in sorted(self.recipes.items())},
                "stations": {s: {"recipe": rid,
                                 "cameras": sorted(c for c, st in self.cameras.items() if st == s)}
                             for s, rid in sorted(self.stations.items())}}


NO_RECIPES = Assignments({}, {}, {})


def load(path: Path) -> Assignments:
    """The recipes file ``path``, checked (names, each station's recipe and cameras), with the
    state file's recipes in force over the file's starting ones. ConfigError names what is wrong.
    Whether the models, versions and verdict fields exist is the engine's check (it has them)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"recipes file {path}: cannot be read: {exc}") from None
    cameras_table = data.get("camera")
    for name, cam in (cameras_table.items() if isinstance(cameras_table, dict) else ()):
        if isinstance(cam, dict) and isinstance(cam.get("source"), str) \
                and has_password(cam["source"]):  # said without repeating the URI
            raise ConfigError(f"recipes file {path}: camera {name!r}: {PASSWORD_IN_URI}")
    try:
        spec = RecipeFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"recipes file {path}: "
                          + "; ".join(describe_validation(exc, field=True, got=True))) from None
    for kind, names in (("recipe", spec.recipe), ("station", spec.station),
                        ("camera", spec.camera)):
        for name in names:
            if not re.match(_NAME, name):
                raise ConfigError(f"recipes file {path}: {kind} name {name!r}: use letters, digits "
                                  "and _.:- (at most 64)")
    recipes = {rid: Recipe(rid, r.model, r.version, dict(r.verdict), r.description)
               for rid, r in spec.recipe.items()}
    cameras: dict[str, str] = {}
    for name, st in spec.station.items():
        if st.recipe is not None and st.recipe not in recipes:
            raise ConfigError(f"recipes file {path}: station {name!r} runs recipe {st.recipe!r}, "
                              f"which is not defined (recipes: {sorted(recipes)})")
        for cam in st.cameras:
            if cam in cameras:
                raise ConfigError(f"recipes file {path}: camera {cam!r} is listed by stations "
                                  f"{cameras[cam]!r} and {name!r}")
            cameras[cam] = name
    stations: dict[str, str | None] = {name: st.recipe for name, st in spec.station.items()}
    for name, rid in read_state(state_path(path)).items():
        if name in stations and rid in recipes:
            stations[name] = rid
        else:
            log.warning("recipes state %s: station %r with recipe %r is no longer in %s; ignored",
                        state_path(path), name, rid, path)
    return Assignments(recipes, stations, cameras, dict(spec.camera))


def with_cameras(book: Assignments, options: list[str]) -> Assignments:
    """``book`` with the cameras of ``--camera NAME=URI`` options: a new camera with the
    defaults, or a recipes-file camera's source replaced (its settings kept)."""
    if not options:
        return book
    sources = dict(book.sources)
    for option in options:
        name, uri = parse_camera_option(option)  # checked when the settings were read
        known = sources.get(name)
        sources[name] = CameraSpec(source=uri) if known is None \
            else known.model_copy(update={"source": uri})
    return replace(book, sources=sources)


def state_path(path: Path) -> Path:
    """Where the stations' recipes in force are kept, beside the recipes file."""
    return path.with_name(path.name + ".active.json")


def read_state(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("recipes state %s cannot be read (%s); starting from the recipes file", path,
                    exc)
        return {}
    stations = data.get("stations") if isinstance(data, dict) else None
    if not isinstance(stations, dict):
        return {}
    return {str(k): str(v) for k, v in stations.items() if isinstance(v, str)}


def write_state(path: Path, stations: Mapping[str, str | None]) -> None:
    """Write the stations' recipes atomically (a reader sees the old file or the new one)."""
    from .verdicts import write_atomic

    text = json.dumps({"stations": {s: r for s, r in sorted(stations.items()) if r is not None}},
                      indent=2) + "\n"
    write_atomic(path, text)
