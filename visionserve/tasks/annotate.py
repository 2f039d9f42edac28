"""Drawing a frame's answer on the frame, for HMI screens and for people checking a model.

The inspect API returns it with ``Accept: image/jpeg`` (or ``?annotate=1``): the front end
decodes the frame again and the model's task draws on it (:meth:`Task.annotate`); nothing of
this runs on the batch path. It costs a decode, the drawing and a JPEG encode per frame
(docs/benchmarks.md, "Annotated images"): do not ask for it on every part of a fast line.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import imaging

#: BGR colours: OK green, NG red, a counted object orange, an uncounted one grey, zones
OK_COLOUR = (60, 180, 60)
NG_COLOUR = (40, 40, 220)
HIT_COLOUR = (0, 140, 255)
OBJECT_COLOUR = (255, 200, 0)
ROI_COLOUR = (255, 255, 0)
EXCLUDE_COLOUR = (160, 160, 160)
#: a heat map kept beside a captured image (:func:`compact_heat`): its longer side in pixels
HEAT_MAP_SIDE = 160


def _scale(img: np.ndarray) -> tuple[int, float]:
    """Line thickness and font scale for a frame of this size."""
    side = min(img.shape[:2])
    return max(1, round(side / 300)), max(0.4, side / 900)


def banner(img: np.ndarray, verdict: str, lines: Sequence[str] = ()) -> None:
    """The verdict (and a few reasons) in the top-left corner."""
    cv2 = imaging._cv2()
    thick, font = _scale(img)
    colour = OK_COLOUR if verdict == "OK" else NG_COLOUR
    y = 0
    for i, text in enumerate([verdict, *lines[:4]]):
        f = font * (1.6 if i == 0 else 0.8)
        (w, h), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, f, thick)
        cv2.rectangle(img, (0, y), (w + 8, y + h + base + 8), colour, -1)
        cv2.putText(img, text, (4, y + h + 4), cv2.FONT_HERSHEY_SIMPLEX, f, (255, 255, 255),
                    thick, cv2.LINE_AA)
        y += h + base + 8


def polygons(img: np.ndarray, polys: Sequence[Sequence[Sequence[float]]],
             colour: tuple[int, int, int]) -> None:
    cv2 = imaging._cv2()
    thick, _ = _scale(img)
    for p in polys:
        pts = np.round(np.asarray(p, dtype=np.float64)).astype(np.int32).reshape(-1, 1, 2)
        cv2.polylines(img, [pts], True, colour, thick, cv2.LINE_AA)


def box(img: np.ndarray, xyxy: Sequence[float], text: str, colour: tuple[int, int, int]) -> None:
    cv2 = imaging._cv2()
    thick, font = _scale(img)
    x1, y1, x2, y2 = (round(v) for v in xyxy)
    cv2.rectangle(img, (x1, y1), (x2, y2), colour, thick)
    (w, h), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, font * 0.7, 1)
    ty = y1 - 2 if y1 - h - base - 2 >= 0 else y2 + h + 2
    cv2.rectangle(img, (x1, ty - h - base + 1), (x1 + w + 2, ty + 1), colour, -1)
    cv2.putText(img, text, (x1 + 1, ty - base + 1), cv2.FONT_HERSHEY_SIMPLEX, font * 0.7,
                (0, 0, 0), 1, cv2.LINE_AA)


def tint(img: np.ndarray, mask: np.ndarray, colour: tuple[int, int, int], alpha: float = 0.45
         ) -> None:
    """Blend ``colour`` over the pixels of a boolean ``mask`` (the frame's size)."""
    if mask.any():
        sel = img[mask].astype(np.float32)
        img[mask] = (sel * (1 - alpha) + np.array(colour, np.float32) * alpha).astype(np.uint8)


def heat(img: np.ndarray, score_map: np.ndarray, alpha: float = 0.45) -> None:
    """Overlay a [0, 1] map (the frame's size) as a colour heat map."""
    cv2 = imaging._cv2()
    m = np.clip(np.nan_to_num(score_map), 0.0, 1.0)
    colour = cv2.applyColorMap((m * 255).astype(np.uint8), cv2.COLORMAP_JET)
    img[...] = cv2.addWeighted(img, 1 - alpha, colour, alpha, 0)


def compact_heat(score_map: np.ndarray) -> dict[str, Any]:
    """A [0, 1] map over the frame, kept to be drawn later (a captured image's sidecar): its
    longer side at most :data:`HEAT_MAP_SIDE` pixels, 8 bits, as a base64 PNG (a few KB)."""
    cv2 = imaging._cv2()
    h, w = score_map.shape
    f = min(1.0, HEAT_MAP_SIDE / max(h, w))
    small = cv2.resize(np.clip(np.nan_to_num(score_map.astype(np.float32)), 0.0, 1.0),
                       (max(1, round(w * f)), max(1, round(h * f))), interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".png", np.round(small * 255).astype(np.uint8))
    if not ok:
        raise RuntimeError("PNG encoding of the heat map failed")
    return {"png": base64.b64encode(buf.tobytes()).decode("ascii")}


def expand_heat(kept: dict[str, Any], width: int, height: int) -> np.ndarray:
    """A map of :func:`compact_heat` -> [0, 1] floats of ``[height, width]``; ValueError when
    it is not one."""
    cv2 = imaging._cv2()
    try:
        raw = np.frombuffer(base64.b64decode(kept["png"], validate=True), np.uint8)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a kept heat map: {exc}") from None
    small = cv2.imdecode(raw, cv2.IMREAD_GRAYSCALE)
    if small is None:
        raise ValueError("not a kept heat map: the PNG cannot be decoded")
    return cv2.resize(small.astype(np.float32) / 255.0, (width, height),
                      interpolation=cv2.INTER_LINEAR)


def encode_jpeg(img: np.ndarray, quality: int = 85) -> bytes:
    cv2 = imaging._cv2()
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError("JPEG encoding of the annotated frame failed")
    return buf.tobytes()
