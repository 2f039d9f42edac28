"""Verdict rules over found objects (detections, segmented regions): ROIs, defects, counts.

``[verdict]`` of a detection or segmentation model::

    pixels_per_mm = 12.5                     # optional: sizes in mm
    roi = [[[40, 40], [600, 40], [600, 440], [40, 440]]]   # polygons, frame pixels
    exclude = [[[280, 200], [360, 200], [360, 280], [280, 280]]]
    roi_match = "centre"                     # or "overlap" (with min_overlap)

    [verdict.defects.scratch]                # a scratch that counts makes the part NG ...
    min_score = 0.5
    min_length_mm = 2.0                      # ... if it is at least this long

    [[verdict.count]]                        # presence: exactly four screws
    label = "screw"
    exactly = 4

An object counts only inside an ROI (all of the frame when there is none) and outside every
exclusion zone, by its box's centre or by the fraction of its box inside, as configured. The
part is NG when a defect rule matches a counted object, or a count rule fails; the answer names
every rule that made it NG with the objects involved (:class:`Reason`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..config import _Strict
from .base import pickled_as_fields
from .geometry import box_polygon_overlap, points_in_polygon

Point = tuple[float, float]
Polygon = tuple[Point, ...]


class DefectRule(_Strict):
    """When an object of this label makes the part NG: every minimum here holds."""

    min_score: float = Field(0.0, ge=0.0, le=1.0, description="Lowest score that counts.")
    min_length_px: float = Field(
        0.0, ge=0.0, description="Its box's longer side, frame pixels, at least this.")
    min_length_mm: float = Field(
        0.0, ge=0.0, description="Its box's longer side at least this many mm (needs "
                                 "verdict.pixels_per_mm).")
    min_area_px: float = Field(
        0.0, ge=0.0, description="Its area (the mask's where there is one, else the box's), "
                                 "frame pixels, at least this.")
    min_area_mm2: float = Field(
        0.0, ge=0.0, description="Its area at least this many mm² (needs verdict.pixels_per_mm).")


class CountRule(_Strict):
    """How many objects of one label a good part shows (presence / absence)."""

    label: str = Field(..., description="The label counted.")
    exactly: int | None = Field(None, ge=0, description="A good part has exactly this many.")
    at_least: int | None = Field(None, ge=0, description="A good part has at least this many.")
    at_most: int | None = Field(None, ge=0, description="A good part has at most this many.")
    min_score: float = Field(0.0, ge=0.0, le=1.0, description="Lowest score that counts.")

    @model_validator(mode="after")
    def _one_bound(self) -> CountRule:
        if self.exactly is None and self.at_least is None and self.at_most is None:
            raise ValueError(f"count rule for {self.label!r} needs exactly, at_least or at_most")
        if self.exactly is not None and (self.at_least is not None or self.at_most is not None):
            raise ValueError(f"count rule for {self.label!r}: exactly excludes at_least/at_most")
        if self.at_least is not None and self.at_most is not None \
                and self.at_least > self.at_most:
            raise ValueError(f"count rule for {self.label!r}: at_least > at_most")
        return self

    def holds(self, n: int) -> bool:
        if self.exactly is not None:
            return n == self.exactly
        return (self.at_least is None or n >= self.at_least) and \
            (self.at_most is None or n <= self.at_most)

    def expected(self) -> str:
        if self.exactly is not None:
            return f"exactly {self.exactly}"
        parts = ([f"at least {self.at_least}"] if self.at_least is not None else []) + \
            ([f"at most {self.at_most}"] if self.at_most is not None else [])
        return " and ".join(parts)


class RegionVerdict(_Strict):
    """``[verdict]`` of a model that finds objects (detection, segmentation)."""

    pixels_per_mm: float | None = Field(
        None, gt=0, description="Frame pixels per millimetre, for the rules' *_mm sizes and the "
                                "answer's sizes in mm.")
    defects: dict[str, DefectRule] | None = Field(
        None, description="Labels that make a part NG, each with its minimums "
        "(`[verdict.defects.<label>]`). Default: every label with no minimum, unless count "
        "rules are given (a presence check: then none).")
    count: tuple[CountRule, ...] = Field(
        (), description="Count rules (`[[verdict.count]]`): label, exactly / at_least / "
                        "at_most, min_score.")
    roi: tuple[Polygon, ...] = Field(
        (), description="Regions of interest: polygons of [x, y] frame pixels; objects outside "
                        "every one do not count. None: the whole frame.")
    exclude: tuple[Polygon, ...] = Field(
        (), description="Exclusion zones: polygons of [x, y] frame pixels; objects in one do not "
                        "count.")
    roi_match: Literal["centre", "overlap"] = Field(
        "centre", description="An object is in a polygon when its box's centre is (centre), or "
                              "when at least min_overlap of its box's area is (overlap).")
    min_overlap: float = Field(
        0.5, gt=0.0, le=1.0, description="The fraction of a box inside a polygon that puts it in "
                                         "(roi_match = \"overlap\").")

    @field_validator("roi", "exclude")
    @classmethod
    def _polygons(cls, v: tuple[Polygon, ...]) -> tuple[Polygon, ...]:
        for poly in v:
            if len(poly) < 3:
                raise ValueError(f"a polygon needs at least 3 points, got {len(poly)}")
        return v

    @model_validator(mode="after")
    def _mm(self) -> RegionVerdict:
        mm = [f"defects.{k}" for k, r in (self.defects or {}).items()
              if r.min_length_mm or r.min_area_mm2]
        if mm and self.pixels_per_mm is None:
            raise ValueError(f"{', '.join(mm)} give sizes in mm: set verdict.pixels_per_mm")
        return self

    def check_labels(self, labels: Sequence[str]) -> None:
        """ValueError naming rules for labels the model does not have."""
        unknown = sorted({*(self.defects or {})} - set(labels)) + \
            [r.label for r in self.count if r.label not in labels]
        if unknown:
            raise ValueError(f"verdict rules name labels {unknown} that are not in "
                             f"output.labels {list(labels)}")

    def defect_rules(self, labels: Sequence[str]) -> dict[str, DefectRule]:
        if self.defects is not None:
            return dict(self.defects)
        return {} if self.count else {label: DefectRule() for label in labels}


@pickled_as_fields
@dataclass(frozen=True, slots=True)
class Reason:
    """One rule that made a part NG, and the objects (indices in the answer) involved."""

    rule: str  # "defect:scratch", "count:screw"
    message: str
    objects: tuple[int, ...]

    def json(self) -> dict[str, object]:
        return {"rule": self.rule, "message": self.message, "detections": list(self.objects)}


class Judge:
    """A :class:`RegionVerdict` applied to one frame's objects; immutable, shared by threads."""

    def __init__(self, spec: RegionVerdict, labels: Sequence[str]) -> None:
        self.spec = spec
        self.defects = spec.defect_rules(labels)
        self.roi = [np.asarray(p, dtype=np.float64) for p in spec.roi]
        self.exclude = [np.asarray(p, dtype=np.float64) for p in spec.exclude]

    def counted(self, boxes: np.ndarray) -> np.ndarray:
        """``[K, 4]`` frame boxes -> ``[K]`` bool: inside an ROI and outside every exclusion."""
        keep = np.ones(len(boxes), dtype=bool)
        if not len(boxes):
            return keep
        if self.roi:
            keep &= np.any([self._inside(boxes, p) for p in self.roi], axis=0)
        for p in self.exclude:
            keep &= ~self._inside(boxes, p)
        return keep

    def _inside(self, boxes: np.ndarray, poly: np.ndarray) -> np.ndarray:
        if self.spec.roi_match == "overlap":
            return box_polygon_overlap(boxes, poly) >= self.spec.min_overlap
        centres = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2], 1)
        return points_in_polygon(centres, poly)

    def judge(self, labels: Sequence[str], scores: Sequence[float], boxes: np.ndarray,
              areas: Sequence[float]) -> tuple[str, tuple[Reason, ...]]:
        """One frame's objects (label, score, frame box, area in frame pixels each) ->
        (verdict, reasons)."""
        ppm = self.spec.pixels_per_mm
        counted = self.counted(boxes)
        reasons: list[Reason] = []
        hits: dict[str, list[tuple[int, str]]] = {}
        for i, (label, score) in enumerate(zip(labels, scores)):
            rule = self.defects.get(label)
            if rule is None or not counted[i] or score < rule.min_score:
                continue
            length = float(max(boxes[i, 2] - boxes[i, 0], boxes[i, 3] - boxes[i, 1]))
            area = float(areas[i])
            if length < rule.min_length_px or area < rule.min_area_px:
                continue
            if ppm is not None and (length / ppm < rule.min_length_mm
                                    or area / ppm**2 < rule.min_area_mm2):
                continue
            size = (f"{length / ppm:.2f} mm long, {area / ppm ** 2:.2f} mm²" if ppm is not None
                    else f"{length:.0f} px long, {area:.0f} px²")
            hits.setdefault(label, []).append((i, f"#{i} score {score:.2f}, {size}"))
        for label, found in hits.items():
            reasons.append(Reason(f"defect:{label}", f"{len(found)} {label} found: "
                                  + "; ".join(text for _, text in found),
                                  tuple(i for i, _ in found)))
        for c in self.spec.count:
            ids = tuple(i for i, (label, score) in enumerate(zip(labels, scores))
                        if label == c.label and counted[i] and score >= c.min_score)
            if not c.holds(len(ids)):
                reasons.append(Reason(f"count:{c.label}", f"{len(ids)} {c.label} found, "
                                      f"expected {c.expected()}", ids))
        return ("NG" if reasons else "OK"), tuple(reasons)
