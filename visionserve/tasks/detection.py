"""Detection: boxes with a label and a score, judged by the verdict rules (:mod:`.rules`).

``[output] format`` says what the model gives:

- ``yolo``: the raw head ``[B, 4+nc, A]`` or ``[B, A, 4+nc]`` (centre x, centre y, w, h in model
  input pixels, then one score per class); the server keeps each anchor's best class, filters by
  score and runs non-maximum suppression.
- ``yolo-objectness``: ``[B, A, 5+nc]`` (YOLOv5/v7: box, objectness, class scores); the score is
  objectness x class score.
- ``end2end``: NMS in the graph. ``[B, K, 6]`` rows of x1, y1, x2, y2, score, class (YOLOv10,
  ultralytics ``nms=True``/end-to-end exports), or YOLOv7's onnxruntime end-to-end export
  ``[M, 7]`` rows of batch index, x1, y1, x2, y2, class, score for the whole batch.
- ``boxes``: separate outputs, as TensorRT's EfficientNMS and torchvision-style exports give:
  boxes ``[B, K, 4]`` (x1, y1, x2, y2), scores ``[B, K]``, classes ``[B, K]``, optional count
  ``[B]``.

Boxes come back in the pixels of the frame the client sent, as stored (an EXIF orientation is
ignored; :class:`.geometry.FrameMap` undoes stretch, letterbox or crop). Each box is clipped to
the frame first; then a box of no size (zero width or height once clipped: one in the letterbox
padding, say) or with NaN is dropped and counted (``visionserve_degenerate_boxes_total``), before
NMS and the top ``max_detections``, so it can neither suppress nor crowd out a real one. On a
GPU with the torch backend the score filter, the clipping and NMS
(``torchvision.ops.batched_nms``) run on the device; elsewhere numpy and OpenCV's
``cv2.dnn.NMSBoxesBatched``, with the same results.

OIP outputs, Triton's EfficientNMS convention: ``num_detections`` INT32 ``[N]``,
``detection_boxes`` FP32 ``[N, K, 4]``, ``detection_scores`` FP32 ``[N, K]``,
``detection_classes`` INT32 ``[N, K]`` (K = ``max_detections``; rows past a frame's count are
zeros), ``reasons`` BYTES ``[N]`` (JSON: the rules that made the frame NG), then ``verdict``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np
from prometheus_client import Counter
from pydantic import Field, model_validator

from ..backends.checks import Dim, Subject, TensorSpec, fmt
from ..config import Labels, ModelConfig, _Strict
from ..errors import ConfigError
from .base import OipOutput, Rows, Task, pickled_as_fields
from .geometry import FrameMap, Size, frame_maps, windows
from .rules import Judge, Reason, RegionVerdict

DEGENERATE = Counter(
    "visionserve_degenerate_boxes",
    "Boxes a detection or segmentation model gave with no area within the frame, or NaN, "
    "dropped from answers",
    ["model"])

#: candidates per frame that go into NMS at most (the highest scores): a model that scores
#: every anchor high would otherwise make NMS quadratic in its anchors
MAX_CANDIDATES = 30_000

Format = Literal["yolo", "yolo-objectness", "end2end", "boxes"]


class DetectionOutput(_Strict):
    format: Format = Field(
        ..., description="What the model gives: `yolo` (raw head [N, 4+classes, anchors] or "
        "[N, anchors, 4+classes]; NMS here), `yolo-objectness` ([N, anchors, 5+classes]), "
        "`end2end` (NMS in the graph: [N, K, 6] x1,y1,x2,y2,score,class, or YOLOv7's [M, 7] "
        "batch,x1,y1,x2,y2,class,score), `boxes` (separate boxes/scores/classes/count outputs).")
    labels: Labels = Field(
        ..., min_length=1, description="Class labels in the model's class index order.")
    tensor_name: str | None = Field(
        None, description="The output holding the detections (yolo, yolo-objectness, end2end); "
                          "default: the first output.")
    boxes_tensor: str = Field("boxes", description="`boxes` format: the [N, K, 4] boxes output "
                                                   "(x1, y1, x2, y2).")
    scores_tensor: str = Field("scores", description="`boxes` format: the [N, K] scores output.")
    classes_tensor: str = Field("classes", description="`boxes` format: the [N, K] class output.")
    count_tensor: str | None = Field(
        None, description="`boxes` format: the [N] output counting valid rows (EfficientNMS's "
                          "num_detections); none: rows with a score count.")
    normalized_boxes: bool = Field(
        False, description="Box coordinates are fractions of the model input's width and height "
                           "(0..1) instead of its pixels.")
    score_threshold: float = Field(
        0.25, ge=0.0, le=1.0, description="Detections scoring below this are dropped.")
    iou_threshold: float = Field(
        0.45, gt=0.0, le=1.0, description="NMS: of two boxes overlapping more than this (IoU), "
                                          "the lower-scoring one is dropped.")
    class_agnostic_nms: bool = Field(
        False, description="NMS across classes (a box suppresses overlapping boxes of any "
                           "class); default: per class.")
    max_detections: int = Field(
        100, ge=1, le=10_000, description="Most detections per frame (the highest scores); the "
                                          "OIP outputs' capacity K.")


class DetectionConfig(ModelConfig):
    """Object detection: the model gives boxes with class scores (`[output] format`); the server
    filters them, runs NMS where the model does not, maps them to the frame's pixels and judges
    them by `[verdict]` (defect classes, ROIs, exclusion zones, counts). OIP outputs
    `num_detections`, `detection_boxes`, `detection_scores`, `detection_classes`, `reasons`,
    `verdict`."""

    task: Literal["detection"] = "detection"
    output: DetectionOutput
    verdict: RegionVerdict = RegionVerdict()

    @model_validator(mode="after")
    def _labels(self) -> DetectionConfig:
        self.verdict.check_labels(self.output.labels)
        return self


@pickled_as_fields
@dataclass(frozen=True, slots=True)
class Detection:
    """One object found in a frame; box and area in the frame's pixels."""

    label: str
    index: int  # class index in output.labels
    score: float
    box: tuple[float, float, float, float]  # x1, y1, x2, y2
    area: float  # the mask's pixels where there is one, else the box's area
    mask: Any = None  # segmentation: the object's mask (see segmentation.py)

    def json(self, pixels_per_mm: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label, "class": self.index,
                               "score": round(self.score, 6),
                               "box": [round(v, 2) for v in self.box], "area": round(self.area, 1)}
        if pixels_per_mm is not None:
            x1, y1, x2, y2 = self.box
            out["size_mm"] = [round((x2 - x1) / pixels_per_mm, 3),
                              round((y2 - y1) / pixels_per_mm, 3)]
            out["area_mm2"] = round(self.area / pixels_per_mm ** 2, 3)
        return out


@pickled_as_fields
@dataclass(frozen=True, slots=True)
class Detected:
    """One frame's detections (highest score first) and why it is NG, if it is."""

    detections: tuple[Detection, ...]
    reasons: tuple[Reason, ...] = field(default=())


@dataclass(slots=True)
class Kept:
    """A batch's detections after the score filter and NMS, on the host: rows sorted by frame,
    then score (highest first); ``frame`` indexes ``rows``, ``anchor`` the model's rows (mask
    coefficients of YOLO-seg)."""

    frame: np.ndarray  # [M] int
    boxes: np.ndarray  # [M, 4] float32, x1 y1 x2 y2, model input pixels, clipped to the frame
    scores: np.ndarray  # [M] float32
    classes: np.ndarray  # [M] int
    anchor: np.ndarray  # [M] int
    dropped: int = 0  # degenerate boxes left out


#: where a mismatch between model.toml and a detection model is explained
DOCS = 'docs/detection.md, "Output formats"'
_NAME_IT = "name the model output that holds the detections (output.tensor_name)"


class DetectionTask(Task):
    name = "detection"
    schema: ClassVar[type[ModelConfig]] = DetectionConfig
    on_device = True
    geometry = True
    config: DetectionConfig

    def __init__(self, config: DetectionConfig) -> None:
        super().__init__(config)
        out = config.output
        self.labels = out.labels
        self.nc = len(out.labels)
        self.judge = Judge(config.verdict, out.labels)
        self._model = config.name or ""
        self._tensor: str | None = None  # the detections output (bound at load)
        self._channels_first = True  # yolo: [B, 4+nc, A]
        self._flat = False  # end2end: YOLOv7's [M, 7] for the whole batch
        #: values per anchor after the class scores (YOLO-seg's mask coefficients)
        self.extra_columns = 0

    # --- the model ----------------------------------------------------------------------------

    def bind(self, subject: Subject, outputs: Sequence[TensorSpec]) -> tuple[str, ...]:
        subject = replace(subject, see=DOCS)
        self._model = self.config.name or subject.file.parent.parent.name
        if self.config.output.format == "boxes":
            return self._bind_boxes(subject, outputs)
        out = self._output(subject, outputs, self.config.output.tensor_name, "output.tensor_name")
        if out is None:
            return ()
        self._tensor = out.name
        if out.dims is not None:
            self._check_dims(subject, "output.tensor_name", list(out.dims))
        return (out.name, *self._extra(subject, outputs))

    def _extra(self, subject: Subject, outputs: Sequence[TensorSpec]) -> tuple[str, ...]:
        """More outputs a subclass reads (YOLO-seg's prototypes)."""
        return ()

    def _output(self, subject: Subject, outputs: Sequence[TensorSpec], want: str | None,
                fld: str) -> TensorSpec | None:
        if not outputs:
            return None
        if want is None or not outputs[0].named:
            return outputs[0]
        found = next((o for o in outputs if o.name == want), None)
        if found is None:
            raise subject.error(fld, f"no model output is called {want!r}", want,
                                str([o.name for o in outputs]), "name one of the model's outputs")
        return found

    def _columns(self) -> int:
        """Values per candidate in a yolo / yolo-objectness head."""
        return self._first_class() + self.nc + self.extra_columns

    def _first_class(self) -> int:
        """The column of the first class score in a yolo / yolo-objectness head."""
        return 5 if self.config.output.format == "yolo-objectness" else 4

    def _check_dims(self, subject: Subject, fld: str, dims: list[Dim]) -> None:
        fmt_ = self.config.output.format
        cols = self._columns()
        if fmt_ == "end2end":
            if len(dims) == 3 and dims[2] in (6, (0, None)) or len(dims) == 2 and dims[1] == 7:
                self._flat = len(dims) == 2
                return
            raise subject.error(fld, "an end2end model gives [N, K, 6] rows of x1, y1, x2, y2, "
                                "score, class (or YOLOv7's [M, 7])", "[N, K, 6]", fmt(dims),
                                _NAME_IT)
        if len(dims) != 3:
            raise subject.error(fld, f"a {fmt_} head has rank 3", f"[N, {cols}, A] or "
                                f"[N, A, {cols}]", fmt(dims), _NAME_IT)
        if fmt_ == "yolo-objectness":
            if dims[2] != cols and isinstance(dims[2], int):
                raise self._classes_error(subject, dims, dims[2] - 5 - self.extra_columns, cols,
                                          "[N, A, 5+classes]")
            self._channels_first = False
            return
        if dims[1] == cols:
            self._channels_first = True
        elif dims[2] == cols:
            self._channels_first = False
        elif isinstance(dims[1], int) and isinstance(dims[2], int):
            got = min(dims[1], dims[2]) - 4 - self.extra_columns  # the short axis: classes
            form = "[N, 4+classes+masks, A]" if self.extra_columns else "[N, 4+classes, A]"
            raise self._classes_error(subject, dims, got, cols, form)

    def _classes_error(self, subject: Subject, dims: list[Dim], got: int, cols: int,
                       form: str) -> ConfigError:
        form = form.replace("masks", str(self.extra_columns))
        return subject.error("output.labels", f"{self.nc} labels, but the model's head gives "
                             f"{got} class scores ({form})", form.replace("classes", str(self.nc))
                             + f" = {cols} values per anchor", fmt(dims),
                             f"list one label per class the model was trained on ({got})")

    def _bind_boxes(self, subject: Subject, outputs: Sequence[TensorSpec]) -> tuple[str, ...]:
        o = self.config.output
        want = [("output.boxes_tensor", o.boxes_tensor, 3), ("output.scores_tensor",
                                                               o.scores_tensor, 2),
                ("output.classes_tensor", o.classes_tensor, 2)]
        if o.count_tensor is not None:
            want.append(("output.count_tensor", o.count_tensor, 1))
        names = {t.name: t for t in outputs}
        for fld, name, rank in want:
            spec = names.get(name)
            if spec is None:
                if outputs and outputs[0].named:
                    raise subject.error(fld, f"no model output is called {name!r}", name,
                                        str(list(names)), "name the model's output")
                continue
            dims = spec.dims
            if dims is None:
                continue
            ok = len(dims) == rank or (fld == "output.count_tensor" and len(dims) == 2
                                       and dims[1] == 1)
            if ok and fld == "output.boxes_tensor":
                ok = dims[2] == 4
            if not ok:
                shape = {3: "[N, K, 4]", 2: "[N, K]", 1: "[N]"}[rank]
                raise subject.error(fld, f"output {name!r} has the wrong shape", shape, fmt(dims),
                                    "name the right output")
        return tuple(name for _, name, _ in want)

    def check_warmup(self, subject: Subject, batch: int, outputs: Mapping[str, Any]) -> None:
        subject = replace(subject, see=DOCS)
        if self.config.output.format == "boxes":
            o = self.config.output
            for fld, name, shape in (("output.boxes_tensor", o.boxes_tensor, (batch, None, 4)),
                                     ("output.scores_tensor", o.scores_tensor, (batch, None)),
                                     ("output.classes_tensor", o.classes_tensor, (batch, None))):
                got = tuple(outputs[name].shape)
                if len(got) != len(shape) or any(s is not None and s != g
                                                 for s, g in zip(shape, got)):
                    want = "[" + ", ".join("K" if s is None else str(s) for s in shape) + "]"
                    raise subject.error(fld, f"output {name!r} has the wrong shape for a batch "
                                        f"of {batch}", want, fmt(list(got)), "name the right "
                                        "output")
            return
        x = outputs[self._name(outputs)]
        dims: list[Dim] = list(x.shape)
        if not self._flat and dims and dims[0] != batch:
            raise subject.error("output.tensor_name", f"one row per frame for a batch of {batch}",
                                f"[{batch}, ...]", fmt(dims), _NAME_IT)
        self._check_dims(subject, "output.tensor_name", dims)

    def _name(self, outputs: Mapping[str, Any]) -> str:
        return self._tensor if self._tensor is not None else next(iter(outputs))

    # --- results ------------------------------------------------------------------------------

    def postprocess(self, outputs: Mapping[str, Any], rows: Rows,
                    sizes: Sequence[Size] | None = None) -> list[tuple[str, Detected]]:
        maps = frame_maps(self.config.input, sizes, len(row_ids(rows)))
        kept = self.select(outputs, rows, windows(maps))
        if kept.dropped:
            DEGENERATE.labels(self._model).inc(kept.dropped)
        return self.answers(kept, maps, outputs, rows, self.judge)

    def reconfigure(self, config: ModelConfig) -> None:
        """New ``[verdict]`` rules: built first, then swapped whole; a batch reads them once."""
        assert isinstance(config, DetectionConfig)
        self.judge = Judge(config.verdict, config.output.labels)
        self.config = config

    def answers(self, kept: Kept, maps: Sequence[FrameMap], outputs: Mapping[str, Any],
                rows: Rows, judge: Judge) -> list[tuple[str, Detected]]:
        """One (verdict, Detected) per frame from the batch's kept detections."""
        bounds = np.searchsorted(kept.frame, np.arange(len(maps) + 1))
        out = []
        for j, m in enumerate(maps):
            a, b = bounds[j], bounds[j + 1]
            boxes = m.boxes(kept.boxes[a:b])
            out.append(self.frame(judge, boxes, kept.scores[a:b], kept.classes[a:b], None))
        return out

    def frame(self, judge: Judge, boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray,
              masks: Sequence[Any] | None, areas: Sequence[float] | None = None
              ) -> tuple[str, Detected]:
        """A frame's detections in frame pixels -> its verdict and answer."""
        if areas is None:
            areas = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).tolist()
        labels = [self.labels[c] for c in classes.tolist()]
        verdict, reasons = judge.judge(labels, scores.tolist(), boxes, areas)
        dets = tuple(Detection(label, int(c), float(s), (float(bx[0]), float(bx[1]),
                                                          float(bx[2]), float(bx[3])),
                               float(ar), masks[i] if masks is not None else None)
                     for i, (label, c, s, bx, ar) in enumerate(zip(labels, classes.tolist(),
                                                                   scores.tolist(), boxes, areas)))
        return verdict, Detected(dets, reasons)

    def rejudge(self, result: Detected, judged: ModelConfig, config: ModelConfig) -> str:
        """The kept objects (label, score, box, area: all the rules read) under the new rules."""
        assert isinstance(config, DetectionConfig)
        dets = result.detections
        boxes = np.array([d.box for d in dets], np.float64).reshape(len(dets), 4)
        verdict, _ = Judge(config.verdict, config.output.labels).judge(
            [d.label for d in dets], [d.score for d in dets], boxes, [d.area for d in dets])
        return verdict

    def select(self, outputs: Mapping[str, Any], rows: Rows, bounds: np.ndarray) -> Kept:
        """Score filter, boxes clipped to their frames (``bounds``: ``[N, 4]``, each frame's
        :meth:`.geometry.FrameMap.window`) and those of no size dropped, NMS (where the model
        has none), top-k per frame, for the N frames of ``rows``."""
        fmt_ = self.config.output.format
        first = next(iter(outputs.values()))
        if type(first).__module__.startswith("torch"):
            return select_on_device(self, outputs, rows, bounds)
        if fmt_ == "boxes":
            return self._select_boxes(outputs, rows, bounds)
        x = np.asarray(outputs[self._name(outputs)])
        if fmt_ == "end2end":
            return self._select_end2end(x, rows, bounds)
        x = x[rows]
        # the best score of every anchor, reduced along the head's own layout (a transposed
        # view would make numpy stride across memory); classes only for the candidates
        cf = self._channels_first
        c0 = self._first_class()
        cls = x[:, c0:c0 + self.nc, :] if cf else x[..., c0:c0 + self.nc]
        axis = 1 if cf else 2
        best = cls.max(axis)
        if fmt_ == "yolo-objectness":  # max over classes of class x objectness
            obj = x[:, 4, :] if cf else x[..., 4]
            best = np.maximum(best * obj, cls.min(axis) * obj)
        f, a = np.nonzero((best >= self.config.output.score_threshold) | np.isnan(best))
        cand = cls[f, :, a] if cf else cls[f, a, :]  # [M, nc]
        if fmt_ == "yolo-objectness":
            cand = cand * (x[f, 4, a] if cf else x[f, a, 4])[:, None]
        classes = cand.argmax(-1) if len(f) else np.zeros(0, np.int64)
        scores = best[f, a].astype(np.float32)
        b = (x[f, 0:4, a] if cf else x[f, a, 0:4]).astype(np.float32)
        xyxy = np.concatenate([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], 1)
        return self._nms(f, clipped(xyxy, bounds[f]), scores, classes, a)

    def _valid(self, xyxy: np.ndarray, scores: np.ndarray) -> np.ndarray:
        return (np.isfinite(xyxy).all(1) & np.isfinite(scores)
                & (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1]))

    def _nms(self, f: np.ndarray, xyxy: np.ndarray, scores: np.ndarray, classes: np.ndarray,
             a: np.ndarray) -> Kept:
        import cv2

        valid = self._valid(xyxy, scores)
        dropped = int((~valid).sum())
        f, xyxy, scores, classes, a = f[valid], xyxy[valid], scores[valid], classes[valid], \
            a[valid]
        o = self.config.output
        if len(f) > MAX_CANDIDATES:
            top = np.argsort(-scores, kind="stable")[:MAX_CANDIDATES]
            f, xyxy, scores, classes, a = f[top], xyxy[top], scores[top], classes[top], a[top]
        group = f if o.class_agnostic_nms else f * self.nc + classes
        xywh = np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], 1).astype(np.float64)
        nms: Any = cv2.dnn.NMSBoxesBatched  # its stubs take sequences; arrays are what it wants
        keep = np.asarray(nms(xywh, scores, group.astype(np.int32), -1.0, o.iou_threshold),
                          dtype=np.int64)
        keep = keep.reshape(-1)
        return self._topk(f[keep], xyxy[keep], scores[keep], classes[keep], a[keep], dropped)

    def _topk(self, f: np.ndarray, xyxy: np.ndarray, scores: np.ndarray, classes: np.ndarray,
              a: np.ndarray, dropped: int) -> Kept:
        """Sort by frame, then score (highest first; equal scores by anchor, then class: the same
        order whichever NMS ran), and keep max_detections per frame."""
        order = np.lexsort((classes, a, -scores, f))
        f, xyxy, scores, classes, a = f[order], xyxy[order], scores[order], classes[order], \
            a[order]
        if len(f):
            start = np.searchsorted(f, f)  # each row's frame's first row
            rank = np.arange(len(f)) - start
            top = rank < self.config.output.max_detections
            f, xyxy, scores, classes, a = f[top], xyxy[top], scores[top], classes[top], a[top]
        return Kept(f.astype(np.int64), xyxy.astype(np.float32), scores.astype(np.float32),
                    classes.astype(np.int64), a.astype(np.int64), dropped)

    def _scale(self, xyxy: np.ndarray) -> np.ndarray:
        if self.config.output.normalized_boxes:
            s = self.config.input
            return xyxy * np.array([s.width, s.height, s.width, s.height], dtype=np.float32)
        return xyxy

    def _filtered(self, f: np.ndarray, xyxy: np.ndarray, scores: np.ndarray,
                  classes: np.ndarray, bounds: np.ndarray) -> Kept:
        """Detections the model already suppressed: score filter, clipped to the frame, valid
        boxes and classes, top-k."""
        thr = self.config.output.score_threshold
        take = (scores >= thr) | np.isnan(scores)
        f, scores, classes = f[take], scores[take], classes[take]
        xyxy = clipped(self._scale(xyxy[take].astype(np.float32)), bounds[f])
        valid = self._valid(xyxy, scores) & (classes >= 0) & (classes < self.nc)
        dropped = int((~valid).sum())
        a = np.zeros(int(valid.sum()), dtype=np.int64)
        return self._topk(f[valid], xyxy[valid], scores[valid], classes[valid].astype(np.int64),
                          a, dropped)

    def _select_end2end(self, x: np.ndarray, rows: Rows, bounds: np.ndarray) -> Kept:
        if self._flat:  # YOLOv7: [M, 7] = batch, x1, y1, x2, y2, class, score
            which = row_ids(rows)
            pos = {int(r): j for j, r in enumerate(which)}
            b = x[:, 0].astype(np.int64)
            take = np.isin(b, which)
            x = x[take]
            f = np.array([pos[int(v)] for v in b[take]], dtype=np.int64)
            return self._filtered(f, x[:, 1:5], x[:, 6].astype(np.float32),
                                  _classes(x[:, 5]), bounds)
        x = x[rows]
        f = np.repeat(np.arange(len(x)), x.shape[1])
        x = x.reshape(-1, x.shape[2])
        return self._filtered(f, x[:, 0:4], x[:, 4].astype(np.float32), _classes(x[:, 5]),
                              bounds)

    def _select_boxes(self, outputs: Mapping[str, Any], rows: Rows, bounds: np.ndarray) -> Kept:
        o = self.config.output
        boxes = np.asarray(outputs[o.boxes_tensor])[rows]
        scores = np.asarray(outputs[o.scores_tensor])[rows].astype(np.float32)
        classes = _classes(np.asarray(outputs[o.classes_tensor])[rows])
        k = boxes.shape[1]
        live = np.ones(scores.shape, dtype=bool)
        if o.count_tensor is not None:
            count = np.asarray(outputs[o.count_tensor])[rows].reshape(len(boxes), -1)[:, 0]
            live = np.arange(k)[None, :] < count[:, None]
        f = np.repeat(np.arange(len(boxes)), k).reshape(len(boxes), k)
        return self._filtered(f[live], boxes[live], scores[live], classes[live], bounds)

    # --- the answer ---------------------------------------------------------------------------

    def oip_outputs(self) -> tuple[OipOutput, ...]:
        k = self.config.output.max_detections
        return (OipOutput("num_detections", "INT32"),
                OipOutput("detection_boxes", "FP32", (k, 4), count="num_detections"),
                OipOutput("detection_scores", "FP32", (k,), count="num_detections"),
                OipOutput("detection_classes", "INT32", (k,), count="num_detections"),
                OipOutput("reasons", "BYTES"))

    def oip_tensors(self, results: Sequence[Detected]) -> dict[str, np.ndarray]:
        k, n = self.config.output.max_detections, len(results)
        num = np.zeros(n, np.int32)
        boxes = np.zeros((n, k, 4), np.float32)
        scores = np.zeros((n, k), np.float32)
        classes = np.zeros((n, k), np.int32)
        for i, r in enumerate(results):
            num[i] = len(r.detections)
            for j, d in enumerate(r.detections):
                boxes[i, j] = d.box
                scores[i, j] = d.score
                classes[i, j] = d.index
        reasons = np.array([json.dumps([x.json() for x in r.reasons],
                                       separators=(",", ":")).encode() for r in results],
                           dtype=object)
        return {"num_detections": num, "detection_boxes": boxes, "detection_scores": scores,
                "detection_classes": classes, "reasons": reasons}

    def oip_parameters(self) -> dict[str, str]:
        o = self.config.output
        return {"labels": ",".join(self.labels), "format": o.format,
                "score_threshold": str(o.score_threshold), "iou_threshold": str(o.iou_threshold),
                "max_detections": str(o.max_detections),
                "verdict": self.config.verdict.model_dump_json(exclude_defaults=True)}

    def inspect_fields(self, result: Detected) -> dict[str, Any]:
        ppm = self.config.verdict.pixels_per_mm
        return {"detections": [d.json(ppm) for d in result.detections],
                "reasons": [r.json() for r in result.reasons]}

    def annotate(self, image: np.ndarray, verdict: str, result: Detected) -> None:
        """ROIs (cyan), exclusion zones (grey), masks, boxes: orange where a rule names the
        object, blue otherwise; the verdict and the reasons in the corner."""
        from . import annotate

        v = self.config.verdict
        annotate.polygons(image, v.roi, annotate.ROI_COLOUR)
        annotate.polygons(image, v.exclude, annotate.EXCLUDE_COLOUR)
        named = {i for r in result.reasons for i in r.objects}
        for i, d in enumerate(result.detections):
            colour = annotate.HIT_COLOUR if i in named else annotate.OBJECT_COLOUR
            mask = self.mask_pixels(d, image.shape[1], image.shape[0])
            if mask is not None:
                annotate.tint(image, mask, colour)
            annotate.box(image, d.box, f"{d.label} {d.score:.2f}", colour)
        annotate.banner(image, verdict, [r.message for r in result.reasons])

    def mask_pixels(self, d: Detection, width: int, height: int) -> np.ndarray | None:
        """A detection's mask as a boolean ``[height, width]`` image (segmentation), else None."""
        return None

    def reasons(self, result: Detected) -> tuple[str, ...]:
        return tuple(r.message for r in result.reasons)

    def summary(self, result: Detected) -> tuple[str, int, float]:
        """The top reason's first object, else the best detection."""
        dets = result.detections
        pick = next((dets[r.objects[0]] for r in result.reasons if r.objects), None)
        if pick is None and dets:
            pick = dets[0]
        return (pick.label, pick.index, pick.score) if pick is not None \
            else ("", -1, float("nan"))


def select_on_device(task: DetectionTask, outputs: Mapping[str, Any], rows: Rows,
                     bounds: np.ndarray) -> Kept:
    """The score filter and NMS on the device (a torch backend on a GPU), in the host path's
    order: the best class per anchor, the filter, the boxes clipped to their frames and those of
    no size dropped, one ``torchvision.ops.batched_nms`` over the whole batch (frames and, for
    per-class NMS, classes kept apart by the group index) and one copy of what survives to the
    host. Formats with NMS in the graph have few rows: copied to the host, the numpy path."""
    import torch
    from torchvision.ops import batched_nms

    o = task.config.output
    if o.format in ("end2end", "boxes"):
        host = {k: v.cpu().numpy() for k, v in outputs.items()}
        return task.select(host, rows, bounds)
    x = outputs[task._name(outputs)]
    if not isinstance(rows, slice):
        x = x.index_select(0, torch.as_tensor(row_ids(rows), device=x.device))
    else:
        x = x[rows]
    if task._channels_first:
        x = x.transpose(1, 2)
    boxes = x[..., :4]
    c0 = task._first_class()
    cls = x[..., c0:c0 + task.nc]
    if o.format == "yolo-objectness":
        cls = cls * x[..., 4:5]
    scores, classes = cls.max(-1)
    cand = (scores >= o.score_threshold) | torch.isnan(scores)
    f, a = cand.nonzero(as_tuple=True)
    s = scores[f, a]
    c = classes[f, a]
    b = boxes[f, a]
    xyxy = torch.cat([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], 1).float()
    win = torch.as_tensor(bounds, device=xyxy.device)[f]
    xyxy = torch.minimum(torch.maximum(xyxy, win[:, [0, 1, 0, 1]]), win[:, [2, 3, 2, 3]])
    valid = torch.isfinite(xyxy).all(1) & torch.isfinite(s) & (xyxy[:, 2] > xyxy[:, 0]) \
        & (xyxy[:, 3] > xyxy[:, 1])
    dropped = int(f.numel() - int(valid.sum()))  # one sync, with the nonzero above
    f, a, s, c, xyxy = f[valid], a[valid], s[valid], c[valid], xyxy[valid]
    if f.numel() > MAX_CANDIDATES:
        top = s.topk(MAX_CANDIDATES).indices
        f, a, s, c, xyxy = f[top], a[top], s[top], c[top], xyxy[top]
    group = f if o.class_agnostic_nms else f * task.nc + c
    keep = batched_nms(xyxy.float(), s.float(), group, o.iou_threshold)
    packed = torch.cat([xyxy[keep].float(), s[keep, None].float(), c[keep, None].float(),
                        f[keep, None].float(), a[keep, None].float()], 1).cpu().numpy()
    return task._topk(packed[:, 6].astype(np.int64), packed[:, :4], packed[:, 4],
                      packed[:, 5].astype(np.int64), packed[:, 7].astype(np.int64), dropped)


def clipped(xyxy: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Boxes ``[M, 4]`` (x1, y1, x2, y2) clipped to their frames' windows ``[M, 4]``, model input
    pixels; NaN stays NaN (dropped as invalid)."""
    return np.minimum(np.maximum(xyxy, bounds[:, [0, 1, 0, 1]]), bounds[:, [2, 3, 2, 3]])


def row_ids(rows: Rows) -> np.ndarray:
    """The batch rows that answer frames, as indices."""
    if isinstance(rows, slice):
        return np.arange(rows.start or 0, rows.stop, dtype=np.int64)
    return np.asarray(rows, dtype=np.int64)


def _classes(x: np.ndarray) -> np.ndarray:
    """Class column (float or int) -> int64; NaN -> -1 (dropped as invalid)."""
    x = np.asarray(x)
    if x.dtype.kind == "f":
        return np.where(np.isfinite(x), x, -1).astype(np.int64)
    return x.astype(np.int64)
