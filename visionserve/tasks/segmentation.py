"""Segmentation: objects with a mask, judged by the same rules as detections (:mod:`.rules`).

``[output] format``:

- ``yolo-seg``: instance masks, YOLO-style. A head ``[B, 4+nc+nm, A]`` (or ``[B, A, 4+nc+nm]``):
  a box, class scores and ``nm`` mask coefficients per anchor, and prototypes ``[B, nm, h, w]``
  (``proto_tensor``). Boxes go through the score filter and NMS as a detector's do
  (:class:`.detection.DetectionTask`, on the device where it can); each kept box's mask is
  ``sigmoid(coefficients @ prototypes)``, brought to the frame's pixels, cut to its box and
  thresholded at ``mask_threshold``.
- ``semantic``: a class map ``[B, C, H, W]`` (logits, or probabilities with ``activation =
  "none"``), e.g. UNet or SegFormer exports: each pixel takes its best class; the connected
  regions of every class but ``background`` (:mod:`.regions`) are the objects, their score the
  highest probability inside.

Every object carries its mask in the frame's pixels as COCO run-length encoding (``{"size":
[h, w], "counts": "..."}``, ``pycocotools.mask.decode`` reads it): exact, a few hundred bytes for
a defect, and the form COCO tools, CVAT and Label Studio read. The area the rules judge is the
mask's. OIP outputs: the detection outputs plus ``detection_masks`` BYTES ``[N, K]``, each the
``counts`` string of a mask of the frame's size (empty past ``num_detections``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from ..backends.checks import Subject, TensorSpec, fmt
from ..config import ModelConfig
from .base import OipOutput, Rows
from .classification import activate
from .detection import (
    DOCS,
    Detected,
    DetectionConfig,
    DetectionOutput,
    DetectionTask,
    Kept,
    row_ids,
)
from .geometry import FrameMap, Size, frame_maps
from .regions import find_regions
from .rules import Judge


class SegmentationOutput(DetectionOutput):
    format: Literal["yolo-seg", "semantic"] = Field(  # type: ignore[assignment]
        ..., description="`yolo-seg`: instance masks (a YOLO head with mask coefficients, "
        "[N, 4+classes+coefficients, anchors], and prototypes [N, coefficients, h, w]); "
        "`semantic`: a class map [N, classes, H, W].")
    tensor_name: str | None = Field(
        None, description="The head (yolo-seg) or the class map (semantic); default: the first "
                          "output.")
    proto_tensor: str | None = Field(
        None, description="yolo-seg: the prototypes output [N, coefficients, h, w]; default: "
                          "the second output.")
    mask_threshold: float = Field(
        0.5, gt=0.0, lt=1.0, description="yolo-seg: a pixel is in an object's mask when its "
                                         "mask value (after the sigmoid) is above this.")
    activation: Literal["softmax", "sigmoid", "none"] = Field(
        "softmax", description="semantic: turns the class map into probabilities (none: it "
                               "already is).")
    background: str | None = Field(
        None, description="semantic: the label of pixels that are no object (e.g. "
                          "\"background\"); its regions are not reported.")
    min_area_px: int = Field(
        1, ge=1, description="semantic: regions smaller than this (frame pixels) are noise and "
                             "left out.")


class SegmentationConfig(DetectionConfig):
    """Segmentation: instance masks (`yolo-seg`) or a class map (`semantic`). Objects are
    answered as detections (label, score, box, area) with a mask in COCO RLE, in the frame's
    pixels, and judged by `[verdict]` as detections are (the area is the mask's). OIP outputs:
    those of detection plus `detection_masks`."""

    task: Literal["segmentation"] = "segmentation"  # type: ignore[assignment]
    output: SegmentationOutput

    @model_validator(mode="after")
    def _background(self) -> SegmentationConfig:
        bg = self.output.background
        if bg is not None and bg not in self.output.labels:
            raise ValueError(f"output.background {bg!r} is not in output.labels")
        return self


def rle(mask: np.ndarray) -> dict[str, Any]:
    """A boolean ``[h, w]`` mask -> COCO RLE (``counts`` as text)."""
    from pycocotools import mask as coco

    r = coco.encode(np.asfortranarray(mask, dtype=np.uint8))
    return {"size": [int(v) for v in r["size"]], "counts": r["counts"].decode("ascii")}


def rle_decode(r: Mapping[str, Any]) -> np.ndarray:
    from pycocotools import mask as coco

    counts = r["counts"]
    data = {"size": list(r["size"]), "counts": counts.encode() if isinstance(counts, str)
            else counts}
    return coco.decode(data).astype(bool)


class SegmentationTask(DetectionTask):
    name = "segmentation"
    schema: ClassVar[type[ModelConfig]] = SegmentationConfig
    config: SegmentationConfig

    def __init__(self, config: SegmentationConfig) -> None:
        super().__init__(config)
        self.semantic = config.output.format == "semantic"
        self._proto: str | None = None
        if not self.semantic:
            self.extra_columns = 32  # YOLO's usual; the prototypes say at load

    def _columns(self) -> int:
        return 4 + self.nc + self.extra_columns

    def _first_class(self) -> int:
        return 4

    # --- the model ----------------------------------------------------------------------------

    def bind(self, subject: Subject, outputs: Sequence[TensorSpec]) -> tuple[str, ...]:
        subject = replace(subject, see=DOCS)
        self._model = self.config.name or subject.file.parent.parent.name
        out = self._output(subject, outputs, self.config.output.tensor_name, "output.tensor_name")
        if out is None:
            return ()
        self._tensor = out.name
        if self.semantic:
            if out.dims is not None:
                self._check_semantic(subject, list(out.dims))
            return (out.name,)
        want = self.config.output.proto_tensor
        if want is None:
            rest = [o for o in outputs if o.name != out.name]
            if not rest:
                raise subject.error("output.proto_tensor", "a yolo-seg model gives prototypes "
                                    "next to its head, and this one has a single output",
                                    "[N, 32, h, w]", "none", "export the segmentation model "
                                    "with its prototype output")
            proto = rest[0]
        else:
            found = self._output(subject, outputs, want, "output.proto_tensor")
            assert found is not None
            proto = found
        self._proto = proto.name
        if proto.dims is not None:
            self._check_proto(subject, list(proto.dims))
        if out.dims is not None:
            self._check_dims(subject, "output.tensor_name", list(out.dims))
        return (out.name, proto.name)

    def _check_proto(self, subject: Subject, dims: list[Any]) -> None:
        if len(dims) != 4:
            raise subject.error("output.proto_tensor", "prototypes are [N, coefficients, h, w]",
                                "[N, 32, h, w]", fmt(dims), "name the prototype output")
        if isinstance(dims[1], int):
            self.extra_columns = dims[1]

    def _check_semantic(self, subject: Subject, dims: list[Any]) -> None:
        if len(dims) != 4:
            raise subject.error("output.tensor_name", "a semantic model gives a class map "
                                "[N, classes, H, W]", f"[N, {self.nc}, H, W]", fmt(dims),
                                "name the class map output")
        if isinstance(dims[1], int) and dims[1] != self.nc:
            raise subject.error("output.labels", f"{self.nc} labels, but the class map has "
                                f"{dims[1]} classes", f"[N, {self.nc}, H, W]", fmt(dims),
                                "list one label per class, background included")

    def check_warmup(self, subject: Subject, batch: int, outputs: Mapping[str, Any]) -> None:
        subject = replace(subject, see=DOCS)
        x = outputs[self._name(outputs)]
        if self.semantic:
            dims = list(x.shape)
            if dims[0] != batch:
                raise subject.error("output.tensor_name", f"one map per frame for a batch of "
                                    f"{batch}", f"[{batch}, {self.nc}, H, W]", fmt(dims),
                                    "name the class map output")
            self._check_semantic(subject, dims)
            return
        assert self._proto is not None
        self._check_proto(subject, list(outputs[self._proto].shape))
        super().check_warmup(subject, batch, outputs)

    # --- results ------------------------------------------------------------------------------

    def postprocess(self, outputs: Mapping[str, Any], rows: Rows,
                    sizes: Sequence[Size] | None = None) -> list[tuple[str, Detected]]:
        if not self.semantic:
            return super().postprocess(outputs, rows, sizes)
        x = outputs[self._name(outputs)]
        n = len(row_ids(rows))
        maps = frame_maps(self.config.input, sizes, n)
        if type(x).__module__.startswith("torch"):  # one copy of the frames' rows to the host
            import torch

            x = x.index_select(0, torch.as_tensor(row_ids(rows), device=x.device))
            x = x.float().cpu().numpy()
        else:
            x = np.asarray(x, dtype=np.float32)[rows]
        judge = self.judge
        return [self._semantic_frame(x[j], m, judge) for j, m in enumerate(maps)]

    def _semantic_frame(self, raw: np.ndarray, m: FrameMap, judge: Judge
                        ) -> tuple[str, Detected]:
        """One frame's class map ``[C, H, W]`` as the model gave it -> regions of each class.
        The map is brought to the frame's pixels first (bilinear), then each pixel takes its
        best class, as HF transformers' and mmsegmentation's post-processing do; frame pixels a
        centre crop cut away take none. A region's score: its highest probability."""
        o = self.config.output
        iw, ih = self.config.input.width, self.config.input.height
        logits = np.stack([m.mask(raw[c], iw, ih) for c in range(len(raw))])
        frame = activate_map(logits[None], o.activation)[0]
        best = frame.argmax(0)
        if m.cropped:  # what a centre crop cut away is no class
            cols, rows = m.seen(iw, ih)
            best[:, ~cols] = -1
            best[~rows, :] = -1
        bg = self.labels.index(o.background) if o.background is not None else -1
        boxes, scores, classes, masks, areas = [], [], [], [], []
        for c in range(len(raw)):  # find_regions of a class that wins nowhere costs an any()
            if c == bg:
                continue
            hit = best == c
            for r in find_regions(hit, np.where(hit, frame[c], 0.0), masks=True):
                if r.area < o.min_area_px:
                    continue
                x1, y1, x2, y2 = r.box
                full = np.zeros((m.height, m.width), dtype=bool)
                assert r.mask is not None
                full[y1:y2, x1:x2] = r.mask
                boxes.append(r.box)
                scores.append(r.peak)
                classes.append(c)
                masks.append(rle(full))
                areas.append(float(r.area))
        order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
        order = order[:o.max_detections]
        b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)[order]
        return self.frame(judge, b, np.asarray(scores, np.float32)[order],
                          np.asarray(classes, np.int64)[order], [masks[i] for i in order],
                          [areas[i] for i in order])

    def answers(self, kept: Kept, maps: Sequence[FrameMap], outputs: Mapping[str, Any],
                rows: Rows, judge: Judge) -> list[tuple[str, Detected]]:
        """YOLO-seg: each kept box's mask from its coefficients and its frame's prototypes."""
        assert self._proto is not None
        low = self._low_res_masks(kept, outputs, rows)  # [M, h, w] after the sigmoid
        iw, ih = self.config.input.width, self.config.input.height
        thr = self.config.output.mask_threshold
        bounds = np.searchsorted(kept.frame, np.arange(len(maps) + 1))
        out = []
        for j, m in enumerate(maps):
            a, b = bounds[j], bounds[j + 1]
            boxes = m.boxes(kept.boxes[a:b])
            masks, areas = [], []
            for k in range(a, b):
                x1, y1, x2, y2 = _pixel_window(boxes[k - a], m.width, m.height)
                inside = m.mask(low[k], iw, ih, (x1, y1, x2, y2)) > thr
                full = np.zeros((m.height, m.width), dtype=bool)
                full[y1:y2, x1:x2] = inside
                masks.append(rle(full))
                areas.append(float(inside.sum()))
            out.append(self.frame(judge, boxes, kept.scores[a:b], kept.classes[a:b], masks, areas))
        return out

    def _low_res_masks(self, kept: Kept, outputs: Mapping[str, Any], rows: Rows) -> np.ndarray:
        """``sigmoid(coefficients @ prototypes)`` of each kept box, at the prototypes' size."""
        assert self._proto is not None
        x, protos = outputs[self._name(outputs)], outputs[self._proto]
        ids = row_ids(rows)[kept.frame]
        c0 = 4 + self.nc
        if type(x).__module__.startswith("torch"):
            import torch

            if not len(ids):
                return np.zeros((0, *protos.shape[2:]), np.float32)
            r = torch.as_tensor(ids, device=x.device)
            a = torch.as_tensor(kept.anchor, device=x.device)
            coef = x[r, c0:, a] if self._channels_first else x[r, a, c0:]
            p = protos[r].float()  # [M, nm, h, w]
            m = torch.einsum("mc,mchw->mhw", coef.float(), p).sigmoid()
            return m.cpu().numpy()
        x, protos = np.asarray(x), np.asarray(protos)
        if not len(ids):
            return np.zeros((0, *protos.shape[2:]), np.float32)
        coef = x[ids, c0:, kept.anchor] if self._channels_first else x[ids, kept.anchor, c0:]
        m = np.einsum("mc,mchw->mhw", coef.astype(np.float32), protos[ids].astype(np.float32))
        return 1.0 / (1.0 + np.exp(-np.clip(m, -80.0, 80.0)))

    # --- the answer ---------------------------------------------------------------------------

    def oip_outputs(self) -> tuple[OipOutput, ...]:
        det = super().oip_outputs()
        k = self.config.output.max_detections
        return (*det[:-1], OipOutput("detection_masks", "BYTES", (k,), count="num_detections"),
                det[-1])

    def oip_tensors(self, results: Sequence[Detected]) -> dict[str, np.ndarray]:
        out = super().oip_tensors(results)
        k = self.config.output.max_detections
        masks = np.full((len(results), k), b"", dtype=object)
        for i, r in enumerate(results):
            for j, d in enumerate(r.detections):
                masks[i, j] = d.mask["counts"].encode("ascii")
        out["detection_masks"] = masks
        return out

    def oip_parameters(self) -> dict[str, str]:
        out = super().oip_parameters()
        out["mask_encoding"] = "coco_rle"
        return out

    def inspect_fields(self, result: Detected) -> dict[str, Any]:
        out = super().inspect_fields(result)
        for d, j in zip(result.detections, out["detections"]):
            j["mask"] = d.mask
        return out

    def mask_pixels(self, d: Any, width: int, height: int) -> np.ndarray | None:
        if d.mask is None:
            return None
        m = rle_decode(d.mask)
        return m if m.shape == (height, width) else None


def activate_map(x: np.ndarray, activation: str) -> np.ndarray:
    """``[B, C, H, W]`` -> probabilities over the class axis."""
    b, c, h, w = x.shape
    flat = np.moveaxis(x, 1, -1).reshape(-1, c)
    return np.moveaxis(activate(flat, activation).reshape(b, h, w, c), -1, 1)


def _pixel_window(box: np.ndarray, width: int, height: int) -> tuple[int, int, int, int]:
    """The frame pixels whose centres lie in a box (x1, y1, x2, y2, continuous; the rule
    :func:`.regions.inside` uses for polygons): x from ceil(x1 - 0.5) to floor(x2 - 0.5)."""
    x1 = int(np.clip(np.ceil(box[0] - 0.5), 0, width))
    y1 = int(np.clip(np.ceil(box[1] - 0.5), 0, height))
    x2 = int(np.clip(np.floor(box[2] - 0.5) + 1, x1, width))
    y2 = int(np.clip(np.floor(box[3] - 0.5) + 1, y1, height))
    return x1, y1, x2, y2

