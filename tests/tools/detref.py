"""An independent reference for served detection and segmentation answers (issue 17).

It reads a model folder as the server does (``model.toml`` and ``1/model.onnx``), preprocesses a
frame through the server's shared input path (:mod:`visionserve.imaging`: decode, resize,
normalise; that path is not under test here), runs the ONNX file with onnxruntime itself, and
then does everything a detection or segmentation task does with its own code: decode the output
format, drop degenerate boxes, filter by score, NMS with ``torchvision.ops`` (``batched_nms``
per class, ``nms`` class-agnostic), keep the top k, map boxes to the frame's pixels, assemble
YOLO-seg masks (``sigmoid(coefficients @ prototypes)``, sampled onto the frame bilinearly,
cropped to the box, thresholded at 0.5), and turn a semantic map into per-class regions. It
imports nothing of ``visionserve.tasks``.

Conventions it holds the server to: boxes are x1, y1, x2, y2 in frame pixels, clipped to the
frame, and in the pixels the file stores (an EXIF orientation is ignored); a score at the
threshold passes; boxes are clipped to the frame, then degenerate ones (no area, NaN) are
dropped, before NMS;
detections come highest score first; a YOLO-seg mask is cut to the frame pixels whose centres
lie in its box; a semantic map's logits are resized to the frame before each pixel takes its
best class (as HF transformers' and mmsegmentation's post-processing do); a region's box is x1,
y1, x2 + 1, y2 + 1 of its pixels. YOLOv7's flat end2end rows ``[M, 7]`` go to the frame their
batch index names.
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from visionserve import imaging
from visionserve.config import InputSpec


@dataclass
class Det:
    """One expected object, in frame pixels."""

    label: str
    index: int
    score: float
    box: np.ndarray  # [4] x1, y1, x2, y2
    mask: np.ndarray | None = None  # [frame h, frame w] bool

    @property
    def area(self) -> float:
        if self.mask is not None:
            return float(self.mask.sum())
        return float((self.box[2] - self.box[0]) * (self.box[3] - self.box[1]))


# --- output formats -> candidates (model input pixels) --------------------------------------

def xyxy(cxcywh: np.ndarray) -> np.ndarray:
    c, s = cxcywh[:, :2], cxcywh[:, 2:4]
    return np.concatenate([c - s / 2, c + s / 2], axis=1)


def decode_yolo(head: np.ndarray, nc: int, objectness: bool = False
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One frame's raw head, ``[4+nc(+extra), A]`` or ``[A, 4+nc(+extra)]`` (``objectness``:
    ``[A, 5+nc]``) -> (boxes xyxy [A, 4], scores [A], classes [A], extra columns [A, E]). The
    candidates axis is the long one."""
    rows = head if objectness or head.shape[0] > head.shape[1] else head.T
    rows = rows.astype(np.float32)
    start = 5 if objectness else 4
    cls = rows[:, start:start + nc]
    if objectness:
        cls = cls * rows[:, 4:5]
    classes = cls.argmax(axis=1)
    scores = cls[np.arange(len(cls)), classes]
    return xyxy(rows[:, :4]), scores, classes, rows[:, start + nc:]


def valid(boxes: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Boxes with an area and finite numbers."""
    with np.errstate(invalid="ignore"):
        return (np.isfinite(boxes).all(axis=1) & np.isfinite(scores)
                & (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1]))


def select(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, *, threshold: float,
           iou: float | None, agnostic: bool = False, top_k: int = 100) -> np.ndarray:
    """Indices of the kept candidates, highest score first: degenerate boxes out, score >=
    threshold, NMS (``iou`` None: none, the model did it), at most ``top_k``."""
    import torch
    from torchvision.ops import batched_nms, nms

    keep = np.nonzero(valid(boxes, scores) & (scores >= threshold))[0]
    if iou is not None and len(keep):
        b = torch.from_numpy(boxes[keep].astype(np.float32))
        s = torch.from_numpy(scores[keep].astype(np.float32))
        if agnostic:
            kept = nms(b, s, iou)
        else:
            kept = batched_nms(b, s, torch.from_numpy(classes[keep].astype(np.int64)), iou)
        keep = keep[kept.numpy()]
    keep = keep[np.argsort(-scores[keep], kind="stable")]
    return keep[:top_k]


# --- geometry: model input pixels -> frame pixels -----------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where the model input's pixels lie in a frame: ``model = frame * k + offset``, per axis."""

    frame_w: int
    frame_h: int
    kx: float
    ky: float
    ox: float
    oy: float

    @classmethod
    def of(cls, spec: InputSpec, frame_w: int, frame_h: int) -> Placement:
        nh, nw, y0, x0, cy, cx = imaging.geometry(spec, frame_h, frame_w)
        return cls(frame_w, frame_h, nw / frame_w, nh / frame_h, x0 - cx, y0 - cy)

    def boxes(self, b: np.ndarray) -> np.ndarray:
        out = np.empty_like(b, dtype=np.float64)
        out[:, 0::2] = np.clip((b[:, 0::2] - self.ox) / self.kx, 0, self.frame_w)
        out[:, 1::2] = np.clip((b[:, 1::2] - self.oy) / self.ky, 0, self.frame_h)
        return out

    def window(self, b: np.ndarray) -> np.ndarray:
        """Boxes in model input pixels clipped to the frame's extent there."""
        lo = np.array([self.ox, self.oy] * 2)
        hi = lo + np.array([self.frame_w * self.kx, self.frame_h * self.ky] * 2)
        return np.minimum(np.maximum(b, lo), hi).astype(np.float32)

    def seen(self, input_w: int, input_h: int) -> np.ndarray:
        """``[frame h, frame w]``: the frame pixels whose centres the model input covers (all of
        them but what a centre crop cut away)."""
        u = (np.arange(self.frame_w) + 0.5) * self.kx + self.ox
        v = (np.arange(self.frame_h) + 0.5) * self.ky + self.oy
        return ((v >= 0) & (v < input_h))[:, None] & ((u >= 0) & (u < input_w))[None, :]

    def sample(self, maps: np.ndarray, input_w: int, input_h: int) -> np.ndarray:
        """``[C, h, w]`` maps over the model input (any resolution proportional to it) ->
        ``[C, frame h, frame w]``: each frame pixel's centre looked up bilinearly, the map's
        edge values extended beyond it (as a resize with align_corners=False does)."""
        _, h, w = maps.shape
        u = (np.arange(self.frame_w) + 0.5) * self.kx + self.ox  # model input pixels
        v = (np.arange(self.frame_h) + 0.5) * self.ky + self.oy
        mx = np.broadcast_to((u * w / input_w - 0.5)[None, :], (self.frame_h, self.frame_w))
        my = np.broadcast_to((v * h / input_h - 0.5)[:, None], (self.frame_h, self.frame_w))
        mx, my = mx.astype(np.float32), my.astype(np.float32)
        return np.stack([cv2.remap(np.ascontiguousarray(m, np.float32), mx, my, cv2.INTER_LINEAR,
                                   borderMode=cv2.BORDER_REPLICATE)
                         for m in maps])


def crop_to_box(mask: np.ndarray, box: np.ndarray) -> np.ndarray:
    """Pixels whose centres lie outside ``box`` (frame pixels) set False."""
    h, w = mask.shape
    xs, ys = np.arange(w) + 0.5, np.arange(h) + 0.5
    inside = ((ys >= box[1]) & (ys < box[3]))[:, None] & ((xs >= box[0]) & (xs < box[2]))[None, :]
    return mask & inside


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# --- semantic maps -> regions --------------------------------------------------------------

def regions(classes: np.ndarray, labels: tuple[str, ...], background: int | None
            ) -> list[tuple[str, int, np.ndarray, np.ndarray]]:
    """A class map ``[h, w]`` -> (label, class, box x1 y1 x2+1 y2+1, mask) for every
    8-connected region of each class but the background, largest first."""
    out = []
    for c, label in enumerate(labels):
        if c == background:
            continue
        hit = (classes == c).astype(np.uint8)
        if not hit.any():
            continue
        n, lab, stats, _ = cv2.connectedComponentsWithStats(hit, connectivity=8)
        for k in range(1, n):
            x, y, w, h, _ = stats[k]
            out.append((label, c, np.array([x, y, x + w, y + h], np.float64), lab == k))
    out.sort(key=lambda r: -int(r[3].sum()))
    return out


# --- the reference --------------------------------------------------------------------------

class Reference:
    """What a model folder's served answers should be, for BGR frames."""

    def __init__(self, folder: Path) -> None:
        import onnxruntime as ort

        cfg = tomllib.loads((folder / "model.toml").read_text())
        self.task: str = cfg["task"]
        self.spec = InputSpec.model_validate(cfg["input"])
        self.out: dict[str, Any] = cfg["output"]
        self.labels: tuple[str, ...] = tuple(self.out["labels"])
        self.format: str = self.out["format"]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(folder / "1" / "model.onnx"), opts,
                                            providers=["CPUExecutionProvider"])

    # the server's input path, shared and not under test
    def tensor(self, frames: list[np.ndarray]) -> np.ndarray:
        pixels = np.stack([imaging.to_model_pixels(f, self.spec) for f in frames])
        return imaging.normalize(pixels, self.spec)

    def raw(self, frames: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs for ``frames``, by name (one onnxruntime call per frame: the
        reference never batches, so it cannot share the server's batching faults)."""
        name = self.session.get_inputs()[0].name
        names = [o.name for o in self.session.get_outputs()]
        per = [self.session.run(None, {name: self.tensor([f])}) for f in frames]
        if self.format == "end2end" and per[0][0].ndim == 2:  # YOLOv7's rows: number frames
            for j, p in enumerate(per):
                p[0][:, 0] = j
        return {n: np.concatenate([p[i] for p in per]) for i, n in enumerate(names)}

    def __call__(self, frame: np.ndarray) -> list[Det]:
        return self.answer(self.raw([frame]), 0, frame.shape[1], frame.shape[0])

    def answer(self, outputs: dict[str, np.ndarray], row: int, frame_w: int, frame_h: int
               ) -> list[Det]:
        """Frame ``row`` of a batch's outputs -> its expected objects, in frame pixels."""
        place = Placement.of(self.spec, frame_w, frame_h)
        if self.format == "semantic":
            return self._semantic(outputs, row, place)
        boxes, scores, classes, extra = self.candidates(outputs, row)
        boxes = place.window(boxes)
        o = self.out
        nms = self.format in ("yolo", "yolo-objectness", "yolo-seg")
        keep = select(boxes, scores, classes, threshold=o.get("score_threshold", 0.25),
                      iou=o.get("iou_threshold", 0.45) if nms else None,
                      agnostic=o.get("class_agnostic_nms", False),
                      top_k=o.get("max_detections", 100))
        frame_boxes = place.boxes(boxes[keep])
        masks: list[np.ndarray | None] = [None] * len(keep)
        if self.format == "yolo-seg" and len(keep):
            protos = self._output(outputs, 1)[row]  # [32, h, w]
            probs = sigmoid(np.einsum("kc,chw->khw", extra[keep].astype(np.float64),
                                      protos.astype(np.float64)))
            sampled = place.sample(probs, self.spec.width, self.spec.height)
            masks = [crop_to_box(m > 0.5, b) for m, b in zip(sampled, frame_boxes)]
        return [Det(self.labels[int(c)], int(c), float(s), b, m)
                for c, s, b, m in zip(classes[keep], scores[keep], frame_boxes, masks)]

    def _output(self, outputs: dict[str, np.ndarray], i: int) -> np.ndarray:
        names = [o.name for o in self.session.get_outputs()]
        return outputs[names[i]]

    def candidates(self, outputs: dict[str, np.ndarray], row: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(boxes xyxy, scores, classes, extra columns) of one frame, model input pixels."""
        fmt, nc = self.format, len(self.labels)
        o = self.out
        if fmt == "boxes":
            boxes = outputs[o["boxes_tensor"]][row].astype(np.float32)
            scores = outputs[o["scores_tensor"]][row].astype(np.float32)
            classes = outputs[o["classes_tensor"]][row].astype(np.int64)
            if "count_tensor" in o:
                n = int(np.asarray(outputs[o["count_tensor"]][row]).reshape(-1)[0])
                boxes, scores, classes = boxes[:n], scores[:n], classes[:n]
            return boxes, scores, classes, np.zeros((len(boxes), 0), np.float32)
        head = outputs[o["tensor_name"]] if "tensor_name" in o else self._output(outputs, 0)
        if fmt == "end2end" and head.ndim == 2:  # YOLOv7: [M, 7] batch, box, class, score
            rows = head[head[:, 0] == row].astype(np.float32)
            head = np.concatenate([rows[:, 1:5], rows[:, 6:7], rows[:, 5:6]], axis=1)
        else:
            head = head[row]
        if fmt == "end2end":
            rows = head.astype(np.float32)
            cls = np.where(np.isfinite(rows[:, 5]), rows[:, 5], -1).astype(np.int64)
            ok = (cls >= 0) & (cls < nc)
            return rows[ok, :4], rows[ok, 4], cls[ok], np.zeros((int(ok.sum()), 0), np.float32)
        return decode_yolo(head, nc, objectness=fmt == "yolo-objectness")

    def _semantic(self, outputs: dict[str, np.ndarray], row: int, place: Placement) -> list[Det]:
        """Logits sampled onto the frame (bilinear), each pixel its best class, the 8-connected
        regions of every class but the background; a region's score is the highest
        probability of its class inside it (probabilities sampled onto the frame too)."""
        logits = self._output(outputs, 0)[row].astype(np.float64)  # [C, h, w]
        act = self.out.get("activation", "softmax")
        if act == "softmax":
            e = np.exp(logits - logits.max(axis=0, keepdims=True))
            probs = e / e.sum(axis=0, keepdims=True)
        elif act == "sigmoid":
            probs = sigmoid(logits)
        else:
            probs = logits
        w, h = self.spec.width, self.spec.height
        classes = place.sample(logits, w, h).argmax(axis=0)
        classes[~place.seen(w, h)] = -1  # what a centre crop cut away is no class
        sampled = place.sample(probs, w, h)
        bg = self.out.get("background")
        background = self.labels.index(bg) if bg in self.labels else None
        dets = [Det(label, c, float(sampled[c][mask].max()), box, mask)
                for label, c, box, mask in regions(classes, self.labels, background)
                if mask.sum() >= self.out.get("min_area_px", 1)]
        dets.sort(key=lambda d: -d.score)
        return dets[:self.out.get("max_detections", 100)]


# --- comparing --------------------------------------------------------------------------------

def iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 1.0


def rle_decode(rle: dict[str, Any]) -> np.ndarray:
    """COCO run-length encoding (``counts`` a list, or COCO's compressed string) -> ``[h, w]``
    bool. Runs alternate 0s and 1s, column-major (Fortran order), starting with 0s."""
    h, w = rle["size"]
    counts = rle["counts"]
    if isinstance(counts, str):
        counts = _coco_string(counts)
    flat = np.zeros(h * w, dtype=bool)
    pos, value = 0, False
    for n in counts:
        flat[pos:pos + n] = value
        pos += n
        value = not value
    return flat.reshape((w, h)).T


def _coco_string(s: str) -> list[int]:
    """pycocotools' ``rleFrString``: 5 bits per character, +48, continuation bit 0x20, runs
    from the third on stored as differences to the run two before."""
    counts: list[int] = []
    p = 0
    while p < len(s):
        x, k, more = 0, 0, True
        while more:
            c = ord(s[p]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and (c & 0x10):
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def match(expected: list[Det], got: list[dict[str, Any]], *, box_tol: float, score_tol: float
          ) -> list[tuple[Det, dict[str, Any]]]:
    """Pair each expected object with a served one (``label``, ``score``, ``box``) of the same
    label, score within ``score_tol`` and every box coordinate within ``box_tol``; an
    AssertionError listing what is missing or extra otherwise."""
    left = list(got)
    pairs, missing = [], []
    for e in expected:
        found = next((g for g in left if g["label"] == e.label
                      and abs(g["score"] - e.score) <= score_tol
                      and np.all(np.abs(np.asarray(g["box"], np.float64) - e.box) <= box_tol)),
                     None)
        if found is None:
            missing.append(e)
        else:
            left.remove(found)
            pairs.append((e, found))
    if missing or left:
        raise AssertionError(
            f"expected {len(expected)} objects, served {len(got)}; not served: "
            + "; ".join(f"{e.label} {e.score:.5f} {np.round(e.box, 2).tolist()}" for e in missing)
            + " | served, not expected: "
            + "; ".join(f"{g['label']} {g['score']:.5f} {np.round(g['box'], 2).tolist()}"
                        for g in left))
    return pairs
