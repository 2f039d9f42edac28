"""Connected regions of a boolean map: box, area, peak score and mask of each.

A task whose model gives a map (an anomaly map, a semantic segmentation's class map) turns the
pixels that pass its threshold into regions here, so that every task counts a region the same
way: 8-connected pixels (OpenCV's ``connectedComponentsWithStats``), the box as x1, y1, x2, y2
with x2/y2 one past the last pixel (the box of one pixel at (3, 4) is (3, 4, 4, 5)), the area as
a pixel count, the peak as the largest score inside the region. Everything is in the map's own
pixels; :class:`visionserve.tasks.geometry.FrameMap` takes boxes to frame pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import imaging
from .geometry import points_in_polygon


@dataclass(frozen=True, slots=True)
class Region:
    """One connected region, in the pixels of the map it was found on."""

    box: tuple[int, int, int, int]  # x1, y1, x2, y2 (x2, y2 exclusive)
    area: int  # pixels
    peak: float  # largest score inside (1.0 when no scores were given)
    #: its pixels inside ``box`` (``[y2 - y1, x2 - x1]`` bool), when asked for
    mask: np.ndarray | None = None


def find_regions(hit: np.ndarray, scores: np.ndarray | None = None, *, masks: bool = False,
                 connectivity: int = 8) -> list[Region]:
    """Regions of the true pixels of ``hit`` (``[h, w]`` bool), largest area first (then highest
    peak); ``scores`` (``[h, w]``, the map that was thresholded) gives each its peak. A map with
    no true pixel costs one ``any``: most frames of a good line end there."""
    if hit.ndim != 2:
        raise ValueError(f"a region map is [h, w], got shape {hit.shape}")
    if not hit.any():
        return []
    cv2 = imaging._cv2()
    n, labels, stats, _ = cv2.connectedComponentsWithStats(
        np.ascontiguousarray(hit, dtype=np.uint8), connectivity=connectivity, ltype=cv2.CV_32S)
    if scores is not None:
        peaks = np.full(n, -np.inf, dtype=np.float64)
        np.maximum.at(peaks, labels.ravel(), np.asarray(scores, np.float64).ravel())
    out = []
    for k in range(1, n):  # label 0 is the background
        x, y, w, h, area = (int(v) for v in stats[k])
        mask = labels[y:y + h, x:x + w] == k if masks else None
        peak = float(peaks[k]) if scores is not None else 1.0
        out.append(Region((x, y, x + w, y + h), area, peak, mask))
    out.sort(key=lambda r: (-r.area, -r.peak))
    return out


def inside(hit: np.ndarray, polygons: Sequence[np.ndarray]) -> np.ndarray:
    """``hit`` with only the pixels whose centres lie inside one of ``polygons`` (each ``[P, 2]``
    x, y in the map's pixels; on an edge counts as inside). Only the true pixels are tested."""
    ys, xs = np.nonzero(hit)
    out = np.zeros_like(hit, dtype=bool)
    if not len(ys):
        return out
    centres = np.stack([xs + 0.5, ys + 0.5], axis=1).astype(np.float64)
    keep = np.zeros(len(ys), bool)
    for poly in polygons:
        keep |= points_in_polygon(centres, np.asarray(poly, np.float64))
    out[ys[keep], xs[keep]] = True
    return out
