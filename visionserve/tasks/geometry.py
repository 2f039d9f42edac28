"""Where a model's pixels are in the camera frame, and which parts of the frame count.

A model sees the frame resized to its input (``[input] resize``: stretch, letterbox or centre
crop, :func:`visionserve.imaging.geometry`); boxes and masks it gives are in those input pixels.
:class:`FrameMap` undoes the resize exactly, so every answer is in the pixels of the frame the
client sent. Polygons (ROIs, exclusion zones of ``[verdict]``) are in frame pixels too.
Plain numpy, the same on every path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import imaging
from ..config import InputSpec

#: a frame's size as it arrived: (width, height)
Size = tuple[int, int]


@dataclass(frozen=True, slots=True)
class FrameMap:
    """Model input pixels -> frame pixels for one frame: ``frame = (model - offset) * scale``."""

    width: int  # the frame's
    height: int
    scale_x: float
    scale_y: float
    offset_x: float  # in model input pixels: the letterbox pad, minus the crop window's origin
    offset_y: float

    @classmethod
    def of(cls, spec: InputSpec, size: Size) -> FrameMap:
        """The map for a frame of ``size`` resized as ``spec`` says (the one geometry the
        preprocessing used: :func:`visionserve.imaging.geometry`)."""
        iw, ih = size
        nh, nw, y0, x0, cy, cx = imaging.geometry(spec, ih, iw)
        return cls(iw, ih, iw / nw, ih / nh, float(x0 - cx), float(y0 - cy))

    def boxes(self, xyxy: np.ndarray) -> np.ndarray:
        """``[K, 4]`` x1, y1, x2, y2 in model pixels -> frame pixels, clipped to the frame."""
        out = np.empty_like(xyxy, dtype=np.float32)
        out[:, 0::2] = (xyxy[:, 0::2] - self.offset_x) * self.scale_x
        out[:, 1::2] = (xyxy[:, 1::2] - self.offset_y) * self.scale_y
        np.clip(out[:, 0::2], 0, self.width, out=out[:, 0::2])
        np.clip(out[:, 1::2], 0, self.height, out=out[:, 1::2])
        return out

    def window(self) -> tuple[float, float, float, float]:
        """The frame's extent in model input pixels (x1, y1, x2, y2): the part of the input the
        frame fills (letterbox), all of it (stretch), or more than it (centre crop). A box
        clipped to it is the box clipped to the frame."""
        return (self.offset_x, self.offset_y, self.offset_x + self.width / self.scale_x,
                self.offset_y + self.height / self.scale_y)

    def on_frame(self, map_w: int, map_h: int, input_w: int, input_h: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(columns, rows) of a ``[map_h, map_w]`` map over the model input (any resolution
        proportional to it) whose pixel centres lie on the frame: all but the letterbox
        padding."""
        x1, y1, x2, y2 = self.window()
        u = (np.arange(map_w) + 0.5) * input_w / map_w
        v = (np.arange(map_h) + 0.5) * input_h / map_h
        return (u >= x1) & (u < x2), (v >= y1) & (v < y2)

    def mask(self, m: np.ndarray, input_w: int, input_h: int,
             window: tuple[int, int, int, int] | None = None) -> np.ndarray:
        """A ``[h, w]`` map over the model input (any resolution proportional to it: a prototype
        mask, a semantic map) -> ``[height, width]`` over the frame, bilinear (pixel centres
        aligned, edges replicated as a resize does); where the model never saw the frame (outside
        a centre crop) it is 0.
        ``window`` (x1, y1, x2, y2 frame pixels, x2/y2 exclusive): only that part of the frame,
        ``[y2 - y1, x2 - x1]``."""
        cv2 = imaging._cv2()
        h, w = m.shape
        x1, y1, x2, y2 = window if window is not None else (0, 0, self.width, self.height)
        sx, sy = w / input_w, h / input_h  # map pixels per model pixel
        ax, ay = sx / self.scale_x, sy / self.scale_y  # map pixels per frame pixel
        # frame pixel u -> map pixel ((u + 0.5) / scale_x + offset_x) * sx - 0.5
        a = np.array([[ax, 0, self.offset_x * sx + (x1 + 0.5) * ax - 0.5],
                      [0, ay, self.offset_y * sy + (y1 + 0.5) * ay - 0.5]], dtype=np.float64)
        src = np.ascontiguousarray(m, dtype=np.float32)
        out = cv2.warpAffine(src, a, (max(0, x2 - x1), max(0, y2 - y1)),
                             flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                             borderMode=cv2.BORDER_REPLICATE)
        if self.cropped:  # the frame outside the crop is 0
            cols, rows = self.seen(input_w, input_h, (x1, y1, x2, y2))
            out[:, ~cols] = 0.0
            out[~rows, :] = 0.0
        return out

    @property
    def cropped(self) -> bool:
        """A centre crop cut part of the frame away."""
        return self.offset_x < 0 or self.offset_y < 0

    def seen(self, input_w: int, input_h: int, window: tuple[int, int, int, int] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """(columns, rows) of the frame (or of ``window``) whose pixel centres the model input
        covers: all but what a centre crop cut away."""
        x1, y1, x2, y2 = window if window is not None else (0, 0, self.width, self.height)
        mx = (np.arange(x1, x2) + 0.5) / self.scale_x + self.offset_x
        my = (np.arange(y1, y2) + 0.5) / self.scale_y + self.offset_y
        return (mx >= 0) & (mx < input_w), (my >= 0) & (my < input_h)


def windows(maps: Sequence[FrameMap]) -> np.ndarray:
    """``[N, 4]`` float32: each frame's :meth:`FrameMap.window`."""
    return np.asarray([m.window() for m in maps], dtype=np.float32).reshape(-1, 4)


def frame_maps(spec: InputSpec, sizes: Sequence[Size] | None, n: int) -> list[FrameMap]:
    """One map per frame; without sizes (a caller that has no frames, e.g. a test on raw model
    outputs) the frames are taken to be the model input's size."""
    if sizes is None:
        sizes = [(spec.width, spec.height)] * n
    return [FrameMap.of(spec, s) for s in sizes]


# --- polygons ---------------------------------------------------------------------------------

def polygon_area(poly: np.ndarray) -> float:
    x, y = poly[:, 0], poly[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2.0)


def points_in_polygon(points: np.ndarray, poly: np.ndarray) -> np.ndarray:
    """``[K, 2]`` points -> ``[K]`` bool: inside (or on the edge of) ``poly`` ``[P, 2]``
    (even-odd rule; a polygon's points in either winding order)."""
    x, y = points[:, 0:1], points[:, 1:2]
    x1, y1 = poly[:, 0][None, :], poly[:, 1][None, :]
    x2, y2 = np.roll(poly[:, 0], -1)[None, :], np.roll(poly[:, 1], -1)[None, :]
    crosses = (y1 > y) != (y2 > y)
    with np.errstate(divide="ignore", invalid="ignore"):
        xint = x1 + (y - y1) * (x2 - x1) / (y2 - y1)
    inside = (crosses & (x < xint)).sum(axis=1) % 2 == 1
    # on an edge counts as inside: the cross product is 0 and the point is within the segment
    cross = (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1)
    within = ((np.minimum(x1, x2) <= x) & (x <= np.maximum(x1, x2))
              & (np.minimum(y1, y2) <= y) & (y <= np.maximum(y1, y2)))
    on_edge = ((np.abs(cross) < 1e-6) & within).any(axis=1)
    return inside | on_edge


def box_polygon_overlap(boxes: np.ndarray, poly: np.ndarray) -> np.ndarray:
    """``[K, 4]`` boxes (x1, y1, x2, y2) -> ``[K]``: the fraction of each box's area inside
    ``poly``, exactly (the box clipped by the polygon: Sutherland-Hodgman, polygon clipped by
    each box edge; a box is convex). A box of no area counts by its centre."""
    out = np.zeros(len(boxes), dtype=np.float64)
    for k, (x1, y1, x2, y2) in enumerate(boxes.astype(np.float64)):
        area = (x2 - x1) * (y2 - y1)
        if area <= 0:
            c = np.array([[(x1 + x2) / 2, (y1 + y2) / 2]])
            out[k] = float(points_in_polygon(c, poly)[0])
            continue
        pts = [tuple(p) for p in poly.astype(np.float64)]
        for axis, bound, keep_below in ((0, x1, False), (0, x2, True), (1, y1, False),
                                        (1, y2, True)):
            pts = _clip(pts, axis, bound, keep_below)
            if not pts:
                break
        out[k] = polygon_area(np.array(pts)) / area if len(pts) >= 3 else 0.0
    return out


def _clip(pts: list[tuple[float, float]], axis: int, bound: float, keep_below: bool
          ) -> list[tuple[float, float]]:
    def inside(p: tuple[float, float]) -> bool:
        return p[axis] <= bound if keep_below else p[axis] >= bound

    out: list[tuple[float, float]] = []
    for i, cur in enumerate(pts):
        prev = pts[i - 1]
        if inside(cur):
            if not inside(prev):
                out.append(_cut(prev, cur, axis, bound))
            out.append(cur)
        elif inside(prev):
            out.append(_cut(prev, cur, axis, bound))
    return out


def _cut(a: tuple[float, float], b: tuple[float, float], axis: int, bound: float
         ) -> tuple[float, float]:
    t = (bound - a[axis]) / (b[axis] - a[axis])
    p = (a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1]))
    return (bound, p[1]) if axis == 0 else (p[0], bound)
