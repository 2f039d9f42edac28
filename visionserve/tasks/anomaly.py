"""Anomaly detection: a model that learnt good parts only scores how unlike them a frame is.

The model gives an image score ``[N]`` and, where it has one, an anomaly map ``[N, 1, h, w]``
(PatchCore, PaDiM, EfficientAD; anomalib is the reference). Two formats:

* ``anomalib``: anomalib's export (``pred_score``, ``pred_label``, ``anomaly_map``,
  ``pred_mask``), normalised inside the graph: ``clip((x - threshold) / (max - min) + 0.5, 0,
  1)``, so 0.5 is the threshold it calibrated. Only ``pred_score`` and ``anomaly_map`` are read:
  the verdict is this server's, from ``[verdict]``, so that it can change while serving. The raw
  score is recovered from the normalisation's values where they are known: ``[normalization]``
  in model.toml, else the ``metadata.json`` anomalib 1.x wrote next to the model
  (``image_threshold``, ``pixel_threshold``, ``pred_scores.min/max``, ``anomaly_maps.min/max``);
  anomalib 2.x bakes them into the graph and writes no file, so without ``[normalization]`` the
  raw score is unknown (null).
* ``raw``: the model's own scale (``visionserve anomaly fit`` exports this); the server normalises
  score and map with ``[normalization]`` (or the version's ``metadata.json``), the same formula.

The verdict: NG when the normalised image score is at or above ``verdict.image_threshold``, or
when a connected region of the map at or above ``verdict.pixel_threshold`` (inside the ROI
polygons, if any) covers ``verdict.min_region_area`` or more. Regions are found on the model's
map (:mod:`.regions`) and given in frame pixels (:class:`.geometry.FrameMap`).
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..backends.checks import Subject, TensorSpec, fmt
from ..config import ModelConfig, _Strict
from .base import OipOutput, Rows, Task, Unjudgeable, pickled_as_fields
from .geometry import FrameMap, Size, frame_maps
from .regions import find_regions, inside

log = logging.getLogger(__name__)

#: anomalib's output names (``InferenceBatch``'s fields)
ANOMALIB_SCORE, ANOMALIB_MAP = "pred_score", "anomaly_map"
#: anomalib 1.x: the normalisation's values, written next to the exported model
ANOMALIB_METADATA = "metadata.json"

_FLOATS = ("float32", "float16", "float64", "bfloat16")


class AnomalyOutput(_Strict):
    format: Literal["anomalib", "raw"] = Field(
        "anomalib", description="`anomalib`: score and map normalised inside the model (0.5 = "
        "its threshold), as anomalib exports them; `raw`: the model's own scale, normalised by the "
        "server with `[normalization]` (what `visionserve anomaly fit` exports).")
    score: str | None = Field(
        None, description="Model output holding the image score `[N]` or `[N, 1]`; default "
        "`pred_score`, and without such an output the map's maximum.")
    map: str | None = Field(
        None, description="Model output holding the anomaly map `[N, 1, h, w]` or `[N, h, w]` "
        "over the model input; default `anomaly_map`, and without such an output no map (the "
        "image score alone decides).")
    max_regions: int = Field(
        16, ge=1, le=1024, description="Regions an answer lists, largest first (OIP: the "
        "capacity of `region_boxes`); more still count for the verdict.")
    inspect_map: bool = Field(
        False, description="Put the normalised map in the inspect answer (`anomaly_map`: shape "
        "and base64 of float32 little-endian, row-major). Large: for set-up and tests.")


class Normalization(_Strict):
    """The values of anomalib's min-max normalisation, on the model's raw scale."""

    image_threshold: float = Field(
        ..., description="Raw image score that normalises to 0.5 (the calibrated threshold).")
    min: float = Field(..., description="Lowest raw score of the calibration; `max - min` is "
                       "the scale: a score `max - min` above the threshold normalises to 1.")
    max: float = Field(..., description="Highest raw score of the calibration (see `min`).")
    pixel_threshold: float | None = Field(
        None, description="Raw map value that normalises to 0.5; default `image_threshold`.")
    pixel_min: float | None = Field(None, description="The map's min; default `min`.")
    pixel_max: float | None = Field(None, description="The map's max; default `max`.")

    @model_validator(mode="after")
    def _scale(self) -> Normalization:
        for lo, hi, what in ((self.min, self.max, "min/max"),
                             (self.pixel_min if self.pixel_min is not None else self.min,
                              self.pixel_max if self.pixel_max is not None else self.max,
                              "pixel_min/pixel_max")):
            if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
                raise ValueError(f"normalization {what} must be finite with max > min, got "
                                 f"{lo}, {hi}")
        return self

    def image(self) -> tuple[float, float]:
        """(threshold, scale) of the image score."""
        return self.image_threshold, self.max - self.min

    def pixel(self) -> tuple[float, float]:
        t = self.pixel_threshold if self.pixel_threshold is not None else self.image_threshold
        lo = self.pixel_min if self.pixel_min is not None else self.min
        hi = self.pixel_max if self.pixel_max is not None else self.max
        return t, hi - lo


Point = tuple[float, float]


class AnomalyVerdict(_Strict):
    image_threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="NG when the normalised image score is >= this (0.5: "
        "the threshold the model was calibrated with; higher rejects fewer parts).")
    pixel_threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="Map pixels at or above this (normalised) form regions.")
    min_region_area: float | None = Field(
        None, ge=0.0, description="NG when a region covers at least this area (`area_unit`); "
        "unset: regions are reported but do not decide.")
    area_unit: Literal["px", "mm2"] = Field(
        "px", description="Unit of `min_region_area` and of region areas in answers: frame "
        "pixels, or mm^2 (needs `pixels_per_mm`).")
    pixels_per_mm: float | None = Field(
        None, gt=0.0, description="Frame pixels per millimetre on the part, for `mm2`.")
    roi: tuple[tuple[Point, ...], ...] = Field(
        (), description="Polygons in frame pixels (`[[[x, y], ...], ...]`): only map pixels "
        "inside one of them form regions. Empty: the whole frame. The image score is the "
        "model's, over the whole frame.")

    @field_validator("roi")
    @classmethod
    def _polygons(cls, v: tuple[tuple[Point, ...], ...]) -> tuple[tuple[Point, ...], ...]:
        for i, poly in enumerate(v):
            if len(poly) < 3:
                raise ValueError(f"roi polygon {i} has {len(poly)} points; a polygon needs 3 or "
                                 "more")
            if not all(math.isfinite(c) for p in poly for c in p):
                raise ValueError(f"roi polygon {i} has a point that is not a finite number")
        return v

    @model_validator(mode="after")
    def _unit(self) -> AnomalyVerdict:
        if self.area_unit == "mm2" and self.pixels_per_mm is None:
            raise ValueError("area_unit = \"mm2\" needs pixels_per_mm")
        return self


class AnomalyConfig(ModelConfig):
    """Anomaly detection (PatchCore, PaDiM, anomalib exports): an image score and an anomaly map
    per frame; NG when the score or a large enough region of the map passes its threshold.
    OIP outputs: `score` FP32 `[N]` (normalised 0..1), `raw_score` FP32 `[N]` (the model's scale,
    NaN when unknown), `anomaly_map` FP32 `[N, h, w]` (normalised, the model's map resolution;
    only for a model with a map), `num_regions` INT32 `[N]`, `region_boxes` FP32 `[N, K, 4]`
    (x1, y1, x2, y2 in frame pixels), `region_areas` FP32 `[N, K]`, `region_peaks` FP32
    `[N, K]` (K = `output.max_regions`), then `verdict` BYTES `[N]`."""

    task: Literal["anomaly"] = "anomaly"
    output: AnomalyOutput = AnomalyOutput()
    normalization: Normalization | None = Field(
        None, description="The normalisation's values, for every version; default: each "
        "version's `metadata.json` (anomalib 1.x's keys `image_threshold`, `pixel_threshold`, "
        "`pred_scores.min/max`, `anomaly_maps.min/max`; `visionserve anomaly fit` writes it). "
        "Needed for `raw`; for `anomalib` it only gives the raw scores.")
    verdict: AnomalyVerdict = AnomalyVerdict()


def normalize(x: np.ndarray, threshold: float, scale: float) -> np.ndarray:
    """anomalib's min-max normalisation: 0.5 at ``threshold``, clipped to [0, 1]."""
    return np.clip((x.astype(np.float32) - np.float32(threshold)) / np.float32(scale)
                   + np.float32(0.5), 0.0, 1.0)


@pickled_as_fields
@dataclass(frozen=True, slots=True)
class FrameRegion:
    """A region of the thresholded map, in frame pixels."""

    box: tuple[float, float, float, float]  # x1, y1, x2, y2
    area: float  # in the verdict's area_unit
    peak: float  # the largest normalised map value inside


@pickled_as_fields
@dataclass(frozen=True, slots=True)
class Anomaly:
    """One frame's answer."""

    score: float  # normalised, 0..1
    raw_score: float  # the model's scale; nan when unknown
    regions: tuple[FrameRegion, ...]  # the largest max_regions, largest first
    region_count: int  # all of them
    reasons: tuple[str, ...]  # why NG; empty for OK
    map: np.ndarray | None  # [h, w] float32, normalised (a copy of the model's)
    #: the frame's geometry, with a map: what finds its regions again under other settings
    frame: FrameMap | None = None

    @property
    def anomalous(self) -> bool:
        return bool(self.reasons)


#: the [verdict] fields that decide which map pixels form regions, and their areas
_REGION_FIELDS = frozenset({"pixel_threshold", "roi", "area_unit", "pixels_per_mm"})


@dataclass(frozen=True)
class _Rule:
    """The verdict settings in the form postprocess reads them: one object, swapped whole when
    they change (runner threads read it once per batch)."""

    verdict: AnomalyVerdict
    roi: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, verdict: AnomalyVerdict) -> _Rule:
        return cls(verdict, tuple(np.asarray(p, np.float64) for p in verdict.roi))


class AnomalyDetection(Task):
    name = "anomaly"
    geometry = True
    schema = AnomalyConfig
    config: AnomalyConfig

    def __init__(self, config: AnomalyConfig) -> None:
        super().__init__(config)
        self._rule = _Rule.of(config.verdict)
        # bound at load: the outputs read, the map's size, the normalisation's values
        self._score: str | None = None
        self._map: str | None = None
        self._map_hw: tuple[int, int] | None = None
        self._norm: Normalization | None = config.normalization

    def reconfigure(self, config: ModelConfig) -> None:
        assert isinstance(config, AnomalyConfig)
        rule = _Rule.of(config.verdict)
        self.config = config
        self._rule = rule  # one reference: a batch reads the old rule or the new one, whole

    # --- the model ----------------------------------------------------------------------------

    def bind(self, subject: Subject, outputs: Sequence[TensorSpec]) -> tuple[str, ...]:
        out = self.config.output
        by_name = {o.name: o for o in outputs}
        if outputs and not outputs[0].named:
            raise subject.error("output.score", "an anomaly model's outputs are read by name",
                                f"outputs named {ANOMALIB_SCORE!r} and/or {ANOMALIB_MAP!r}",
                                f"{len(outputs)} unnamed outputs", "name them: ONNX "
                                "output_names=[...]; torch.export: return a dict "
                                "{'pred_score': ..., 'anomaly_map': ...}")
        score = self._pick(subject, by_name, "output.score", out.score, ANOMALIB_SCORE)
        amap = self._pick(subject, by_name, "output.map", out.map, ANOMALIB_MAP)
        if score is None and amap is None:
            raise subject.error("output.score", "the model gives neither an image score nor an "
                                "anomaly map", f"an output {ANOMALIB_SCORE!r} [N] or "
                                f"{ANOMALIB_MAP!r} [N, 1, h, w]", str(sorted(by_name)),
                                "name the outputs in [output] score / map")
        if score is not None and score.dims is not None:
            d = list(score.dims)
            if not (len(d) == 1 or (len(d) == 2 and d[1] in (1, (1, 1)))):
                raise subject.error("output.score", "the image score is one number per frame",
                                    "[N] or [N, 1]", fmt(d), "name the score output in "
                                    "[output] score")
            self._check_float(subject, "output.score", score, "[N]")
        if amap is not None and amap.dims is not None:
            d = list(amap.dims)
            if len(d) not in (3, 4) or (len(d) == 4 and d[1] not in (1, (1, 1))):
                raise subject.error("output.map", "the anomaly map is one channel per frame",
                                    "[N, 1, h, w] or [N, h, w]", fmt(d),
                                    "name the map output in [output] map")
            self._check_float(subject, "output.map", amap, "[N, 1, h, w]")
            h, w = d[-2], d[-1]
            if isinstance(h, int) and isinstance(w, int):
                self._map_hw = (h, w)
        self._score = score.name if score is not None else None
        self._map = amap.name if amap is not None else None
        if self._norm is None:
            self._norm = _anomalib_metadata(subject.file.parent / ANOMALIB_METADATA)
        if self._norm is None and self.config.output.format == "raw":
            raise subject.error("normalization", "a raw-scale model needs the normalisation's "
                                "values", f"[normalization] or {ANOMALIB_METADATA} next to the "
                                "model", "neither", "add [normalization] (image_threshold, min, "
                                "max) to model.toml")
        return tuple(n for n in (self._score, self._map) if n is not None)

    @staticmethod
    def _pick(subject: Subject, by_name: Mapping[str, TensorSpec], field: str, want: str | None,
              default: str) -> TensorSpec | None:
        if want is None:
            return by_name.get(default)
        if want not in by_name:
            raise subject.error(field, f"no model output is named {want!r}", repr(want),
                                f"outputs {sorted(by_name)}", f"set {field} to one of them")
        return by_name[want]

    @staticmethod
    def _check_float(subject: Subject, field: str, spec: TensorSpec, shape: str) -> None:
        if spec.dtype is not None and spec.dtype not in _FLOATS:
            raise subject.error(field, "anomaly scores are floating point", f"{shape} float32",
                                spec.dtype, f"name a score output in [{field.split('.')[0]}]")

    def check_warmup(self, subject: Subject, batch: int, outputs: Mapping[str, Any]) -> None:
        if self._score is not None:
            shape = tuple(np.shape(outputs[self._score]))
            if shape not in ((batch,), (batch, 1)):
                raise subject.error("output.score", "the image score is one number per frame",
                                    f"[{batch}] for a batch of {batch}", fmt(list(shape)),
                                    "name the score output in [output] score")
        if self._map is not None:
            shape = tuple(np.shape(outputs[self._map]))
            ok = (len(shape) == 4 and shape[1] == 1) or len(shape) == 3
            if not ok or shape[0] != batch:
                raise subject.error("output.map", "the anomaly map is one channel per frame",
                                    f"[{batch}, 1, h, w] for a batch of {batch}",
                                    fmt(list(shape)), "name the map output in [output] map")
            hw = (int(shape[-2]), int(shape[-1]))
            if self._map_hw is not None and self._map_hw != hw:
                raise subject.error("output.map", "the map's size changes with the batch",
                                    f"[{batch}, 1, {self._map_hw[0]}, {self._map_hw[1]}]",
                                    fmt(list(shape)), "export the map at one size")
            self._map_hw = hw

    # --- results ------------------------------------------------------------------------------

    def postprocess(self, outputs: Mapping[str, Any], rows: Rows,
                    sizes: Sequence[Size] | None = None) -> list[tuple[str, Anomaly]]:
        """NG when the image score, or a large enough region of the map, passes its threshold."""
        rule = self._rule  # once: a verdict change applies from the next batch, whole
        maps = None
        if self._map is not None:
            m = np.asarray(outputs[self._map])[rows]
            maps = m.reshape(m.shape[0], m.shape[-2], m.shape[-1])
        scores = None
        if self._score is not None:
            s = np.asarray(outputs[self._score])[rows]
            scores = s.reshape(s.shape[0])
        n = len(scores) if scores is not None else len(maps)  # type: ignore[arg-type]
        score_n, raw = self._scores(scores, maps)
        map_n = self._normalised_maps(maps)
        fmaps = frame_maps(self.config.input, sizes, n)
        out = []
        for i in range(n):
            fm = map_n[i] if map_n is not None else None
            out.append(self._judge(rule, float(score_n[i]), float(raw[i]), fm, fmaps[i]))
        return out

    def _scores(self, scores: np.ndarray | None, maps: np.ndarray | None
                ) -> tuple[np.ndarray, np.ndarray]:
        """(normalised, raw) image scores; raw is nan where the normalisation is unknown."""
        norm = self._norm
        anomalib = self.config.output.format == "anomalib"
        if scores is None:  # the map's maximum, on the map's scale
            assert maps is not None
            scores = maps.reshape(len(maps), -1).max(axis=1)
            if not anomalib:  # a raw map's maximum is a raw score on the pixel scale
                assert norm is not None
                t, scale = norm.pixel()
                return normalize(scores, t, scale), scores.astype(np.float32)
        scores = scores.astype(np.float32)
        if not anomalib:
            assert norm is not None  # the schema requires it for raw
            t, scale = norm.image()
            return normalize(scores, t, scale), scores
        if norm is None:
            return scores, np.full(len(scores), np.nan, np.float32)
        t, scale = norm.image()
        return scores, ((scores - np.float32(0.5)) * np.float32(scale) + np.float32(t))

    def _normalised_maps(self, maps: np.ndarray | None) -> np.ndarray | None:
        if maps is None:
            return None
        if self.config.output.format == "anomalib":
            return np.array(maps, dtype=np.float32)  # a copy: the outputs are reused
        assert self._norm is not None
        t, scale = self._norm.pixel()
        return normalize(maps, t, scale)

    def _judge(self, rule: _Rule, score: float, raw: float, amap: np.ndarray | None,
               fm: FrameMap) -> tuple[str, Anomaly]:
        v = rule.verdict
        reasons = []
        if score >= v.image_threshold:
            reasons.append(f"image score {score:.4f} >= image_threshold {v.image_threshold:g}")
        regions: list[FrameRegion] = []
        count = 0
        if amap is not None:
            regions = self._regions(rule, amap, fm)
            count = len(regions)
            if v.min_region_area is not None:
                big = [r for r in regions if r.area >= v.min_region_area]
                if big:
                    reasons.append(f"{len(big)} region(s) of area >= min_region_area "
                                   f"{v.min_region_area:g} {v.area_unit} (largest "
                                   f"{big[0].area:.1f})")
        keep = tuple(regions[:self.config.output.max_regions])
        verdict = "NG" if reasons else "OK"
        return verdict, Anomaly(score, raw, keep, count, tuple(reasons), amap,
                                None if amap is None else fm)

    def rejudge(self, result: Anomaly, judged: ModelConfig, config: ModelConfig) -> str:
        """The answer judged as ``postprocess`` judges it under ``config``: the image score
        against the new image_threshold; where the settings that decide which map pixels form
        regions changed, the regions found again on the kept map (each answer keeps its
        normalised map and its frame's geometry), else the kept regions (largest first) against
        the new min_region_area."""
        assert isinstance(judged, AnomalyConfig) and isinstance(config, AnomalyConfig)
        v = config.verdict
        changed = sorted(f for f in _REGION_FIELDS if getattr(judged.verdict, f) != getattr(v, f))
        if result.map is not None and changed:
            if result.frame is None:
                raise Unjudgeable(f"{', '.join(changed)} change the regions, and the answer "
                                  "keeps no frame geometry to find them again")
            return self._judge(_Rule.of(v), result.score, result.raw_score, result.map,
                               result.frame)[0]
        if result.score >= v.image_threshold:
            return "NG"
        big = v.min_region_area is not None and bool(result.regions) \
            and result.regions[0].area >= v.min_region_area
        return "NG" if big else "OK"

    def _regions(self, rule: _Rule, amap: np.ndarray, fm: FrameMap) -> list[FrameRegion]:
        """Regions of the map at or above pixel_threshold, on the frame (not in the letterbox
        padding) and inside the ROI: found on the model's map, given in frame pixels (each map
        pixel covers the same frame area)."""
        v = rule.verdict
        hit = amap >= v.pixel_threshold
        if not hit.any():
            return []
        spec = self.config.input
        h, w = amap.shape
        sx, sy = w / spec.width, h / spec.height  # map pixels per model input pixel
        cols, rows = fm.on_frame(w, h, spec.width, spec.height)
        hit &= rows[:, None] & cols[None, :]  # the letterbox padding is no part of the frame
        if rule.roi:
            # frame -> model input: frame / scale + offset; -> map: * (sx, sy)
            polys = [np.stack([(p[:, 0] / fm.scale_x + fm.offset_x) * sx,
                               (p[:, 1] / fm.scale_y + fm.offset_y) * sy], axis=1)
                     for p in rule.roi]
            hit = inside(hit, polys)
        found = find_regions(hit, amap)
        if not found:
            return []
        per_px = fm.scale_x * fm.scale_y / (sx * sy)  # frame pixels per map pixel
        if v.area_unit == "mm2":
            assert v.pixels_per_mm is not None
            per_px /= v.pixels_per_mm ** 2
        boxes = np.array([r.box for r in found], np.float64)
        boxes[:, 0::2] /= sx
        boxes[:, 1::2] /= sy
        fboxes = fm.boxes(boxes)
        return [FrameRegion(tuple(round(float(c), 2) for c in b),  # type: ignore[arg-type]
                            round(r.area * per_px, 3), r.peak)
                for r, b in zip(found, fboxes)]

    # --- the answer ---------------------------------------------------------------------------

    def _k(self) -> int:
        return self.config.output.max_regions

    def oip_outputs(self) -> tuple[OipOutput, ...]:
        k = self._k()
        outs = [OipOutput("score", "FP32"), OipOutput("raw_score", "FP32")]
        if self._map is not None and self._map_hw is not None:
            outs.append(OipOutput("anomaly_map", "FP32", self._map_hw))
        outs += [OipOutput("num_regions", "INT32"),
                 OipOutput("region_boxes", "FP32", (k, 4), count="num_regions"),
                 OipOutput("region_areas", "FP32", (k,), count="num_regions"),
                 OipOutput("region_peaks", "FP32", (k,), count="num_regions")]
        return tuple(outs)

    def oip_tensors(self, results: Sequence[Anomaly]) -> dict[str, np.ndarray]:
        n, k = len(results), self._k()
        boxes = np.zeros((n, k, 4), np.float32)
        areas = np.zeros((n, k), np.float32)
        peaks = np.zeros((n, k), np.float32)
        for i, r in enumerate(results):
            for j, reg in enumerate(r.regions):
                boxes[i, j], areas[i, j], peaks[i, j] = reg.box, reg.area, reg.peak
        out = {"score": np.array([r.score for r in results], np.float32),
               "raw_score": np.array([r.raw_score for r in results], np.float32),
               "num_regions": np.array([len(r.regions) for r in results], np.int32),
               "region_boxes": boxes, "region_areas": areas, "region_peaks": peaks}
        if self._map is not None and self._map_hw is not None:
            h, w = self._map_hw
            maps = [r.map for r in results if r.map is not None]
            out["anomaly_map"] = np.stack(maps).astype(np.float32) if maps \
                else np.zeros((0, h, w), np.float32)
        return out

    def oip_parameters(self) -> dict[str, str]:
        v = self._rule.verdict
        params = {"format": self.config.output.format,
                  "image_threshold": str(v.image_threshold),
                  "pixel_threshold": str(v.pixel_threshold),
                  "area_unit": v.area_unit}
        if v.min_region_area is not None:
            params["min_region_area"] = str(v.min_region_area)
        if v.pixels_per_mm is not None:
            params["pixels_per_mm"] = str(v.pixels_per_mm)
        if v.roi:
            params["roi"] = json.dumps([[list(p) for p in poly] for poly in v.roi])
        return params

    def inspect_fields(self, result: Anomaly) -> dict[str, Any]:
        v = self._rule.verdict
        out: dict[str, Any] = {
            "label": "anomalous" if result.anomalous else "normal",
            "score": result.score,
            "raw_score": None if math.isnan(result.raw_score) else result.raw_score,
            "image_threshold": v.image_threshold,
            "regions": [{"box": list(r.box), "area": r.area, "peak": round(r.peak, 6)}
                        for r in result.regions],
            "region_count": result.region_count,
            "area_unit": v.area_unit,
            "reasons": list(result.reasons),
        }
        if self.config.output.inspect_map and result.map is not None:
            m = np.ascontiguousarray(result.map, dtype="<f4")
            out["anomaly_map"] = {"shape": list(m.shape), "dtype": "float32",
                                  "data": base64.b64encode(m.tobytes()).decode()}
        return out

    def annotate(self, image: np.ndarray, verdict: str, result: Anomaly) -> None:
        """The normalised map as a heat map over the frame, the ROI (cyan), the regions' boxes
        with their peaks, the verdict and the reasons in the corner."""
        from . import annotate

        h, w = image.shape[:2]
        if result.map is not None:
            spec = self.config.input
            fm = FrameMap.of(spec, (w, h))
            annotate.heat(image, fm.mask(result.map, spec.width, spec.height))
        annotate.polygons(image, self._rule.verdict.roi, annotate.ROI_COLOUR)
        for r in result.regions:
            annotate.box(image, r.box, f"{r.peak:.2f}", annotate.HIT_COLOUR)
        annotate.banner(image, verdict, [f"score {result.score:.3f}", *result.reasons])

    def capture_fields(self, result: Anomaly, size: Size) -> dict[str, Any]:
        """The heat map over the frame, compact (the record keeps only the regions)."""
        from . import annotate

        if result.map is None:
            return {}
        spec = self.config.input
        return {"heat_map": annotate.compact_heat(
            FrameMap.of(spec, size).mask(result.map, spec.width, spec.height))}

    def summary(self, result: Anomaly) -> tuple[str, int, float]:
        return ("anomalous", 1, result.score) if result.anomalous else \
            ("normal", 0, result.score)

    def reasons(self, result: Anomaly) -> tuple[str, ...]:
        return result.reasons

    def margin(self, result: Anomaly) -> float | None:
        """The normalised image score against ``verdict.image_threshold``."""
        return abs(result.score - self._rule.verdict.image_threshold)


def _anomalib_metadata(path: Path) -> Normalization | None:
    """anomalib 1.x's ``metadata.json`` next to the model -> its normalisation, if it has one."""
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        return Normalization(
            image_threshold=float(meta["image_threshold"]),
            pixel_threshold=float(meta.get("pixel_threshold", meta["image_threshold"])),
            min=float(meta["pred_scores.min"]), max=float(meta["pred_scores.max"]),
            pixel_min=_opt(meta.get("anomaly_maps.min")),
            pixel_max=_opt(meta.get("anomaly_maps.max")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: no normalisation read (%s: %s)", path, type(exc).__name__, exc)
        return None


def _opt(x: Any) -> float | None:
    return None if x is None else float(x)
