"""A captured image with its model's answer drawn on it, from what its record keeps: a
detector's boxes with label and score (orange where a rule names the object), a segmenter's
masks as a translucent tint, an anomaly model's heat map (kept in the sidecar,
``Task.capture_fields``) and its regions; the verdict and the reasons in the corner. Also the
image alone, and either as a thumbnail (the console's gallery).

Drawn from the stored answer, not by the model's task: the model may be unloaded or changed
since, and the picture must show what was decided then. Runs in a worker thread (decode, draw,
encode: milliseconds for a camera frame).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import imaging
from ..errors import NotFound
from ..tasks import annotate
from .images import Stored
from .record import Record

#: a thumbnail's longer side: from, to (pixels)
THUMB_MIN, THUMB_MAX = 32, 1024
MEDIA = {"jpg": "image/jpeg", "png": "image/png", "bmp": "image/bmp"}


def render(stored: Stored, record: Record, *, overlay: bool, size: int | None = None
           ) -> tuple[bytes, str]:
    """(body, media type): the stored image as it is (a raw ``.npy`` frame as PNG), or, with
    ``overlay`` or ``size`` (longer side in pixels, never enlarged), a JPEG drawn from it."""
    if not overlay and size is None and stored.ext in MEDIA:
        return stored.data, MEDIA[stored.ext]
    cv2 = imaging._cv2()
    image = _decode(stored)
    h, w = image.shape[:2]
    f = 1.0 if size is None else min(1.0, size / max(h, w))
    if f < 1.0:
        image = cv2.resize(image, (max(1, round(w * f)), max(1, round(h * f))),
                           interpolation=cv2.INTER_AREA)
    if overlay:
        draw(image, record, _drawing(stored.sidecar), f)
    elif size is None:  # a raw frame, whole
        _, buf = cv2.imencode(".png", image)
        return buf.tobytes(), "image/png"
    return annotate.encode_jpeg(image), "image/jpeg"


def frame_size(stored: Stored) -> tuple[int, int]:
    """(width, height) of the stored frame: what a label's boxes must lie inside."""
    h, w = _decode(stored).shape[:2]
    return w, h


def _decode(stored: Stored) -> np.ndarray:
    """BGR pixels of the stored file."""
    cv2 = imaging._cv2()
    if stored.ext == "npy":
        px = np.load(io.BytesIO(stored.data), allow_pickle=False)
        if px.ndim == 2:
            px = px[:, :, None]
        code = {1: cv2.COLOR_GRAY2BGR, 3: cv2.COLOR_RGB2BGR, 4: cv2.COLOR_RGBA2BGR}[px.shape[2]]
        return np.ascontiguousarray(cv2.cvtColor(px, code))
    img = cv2.imdecode(np.frombuffer(stored.data, np.uint8),
                       cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if img is None:
        raise NotFound("the stored image cannot be decoded (the file is damaged)")
    return img


def _drawing(sidecar: bytes) -> Mapping[str, Any]:
    if not sidecar:
        return {}
    try:
        out = json.loads(sidecar).get("drawing") or {}
    except (ValueError, AttributeError):
        return {}
    return out if isinstance(out, dict) else {}


def draw(image: np.ndarray, record: Record, drawing: Mapping[str, Any], f: float = 1.0) -> None:
    """Draw ``record``'s answer on ``image`` (BGR, in place), the frame scaled by ``f``."""
    result = record.result or {}
    h, w = image.shape[:2]
    if "heat_map" in drawing:
        try:
            annotate.heat(image, annotate.expand_heat(drawing["heat_map"], w, h))
        except ValueError:
            pass  # a damaged sidecar: the boxes and the verdict still show
    detections = result.get("detections") or []
    named = {i for r in result.get("reasons") or [] if isinstance(r, dict)
             for i in r.get("detections") or []}
    for i, d in enumerate(detections):
        colour = annotate.HIT_COLOUR if i in named else annotate.OBJECT_COLOUR
        if d.get("mask"):
            annotate.tint(image, _mask(d["mask"], w, h), colour)
        annotate.box(image, [v * f for v in d["box"]], f"{d['label']} {d['score']:.2f}", colour)
    for r in result.get("regions") or []:
        annotate.box(image, [v * f for v in r["box"]], f"{r['peak']:.2f}", annotate.HIT_COLOUR)
    lines = record.reasons()
    if not lines and record.label:
        lines = [record.label if record.score is None else f"{record.label} {record.score:.2f}"]
    annotate.banner(image, record.verdict, lines)


def _mask(rle: Mapping[str, Any], w: int, h: int) -> np.ndarray:
    """A segmenter's mask (COCO RLE over the frame) at the drawn size."""
    from ..tasks.segmentation import rle_decode

    cv2 = imaging._cv2()
    m = rle_decode(rle)
    if m.shape != (h, w):
        m = cv2.resize(m.astype(np.uint8), (w, h), interpolation=cv2.INTER_NEAREST) > 0
    return m
