"""Detection accuracy as COCO reports it: mean average precision, in plain numpy.

For each class and IoU threshold (.50:.05:.95): each image's detections of the class, best
score first, at most ``max_dets`` of them, are matched one by one to the unmatched ground-truth
box they overlap most (IoU at least the threshold); over all images, sorted by score, that gives
a precision/recall curve; its precision envelope read at the 101 recall points 0, 0.01, ..., 1
(0 past the highest recall reached), averaged, is the AP. mAP averages over the classes that
have ground truth. All boxes count (no crowd or area ranges: synthetic scenes have neither).
Boxes are x1, y1, x2, y2 in any one pixel frame (continuous: no +1 on widths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IOU_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
RECALL_POINTS = np.linspace(0.0, 1.0, 101)


@dataclass
class ImageDetections:
    boxes: np.ndarray      # [K, 4] float
    scores: np.ndarray     # [K]
    classes: np.ndarray    # [K] int


@dataclass
class ImageTruth:
    boxes: np.ndarray      # [M, 4] float
    classes: np.ndarray    # [M] int


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[K, 4]`` x ``[M, 4]`` -> ``[K, M]`` IoU."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    iw = np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0])
    ih = np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1])
    inter = np.clip(iw, 0, None) * np.clip(ih, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def _match(iou: np.ndarray, threshold: float) -> np.ndarray:
    """Detections (rows, best score first) -> True where one matched a ground-truth box."""
    taken = np.zeros(iou.shape[1], bool)
    hit = np.zeros(iou.shape[0], bool)
    t = min(threshold, 1 - 1e-10)
    if not iou.shape[1]:
        return hit
    for d in range(iou.shape[0]):
        free = np.where(taken, -1.0, iou[d])
        g = int(np.argmax(free))
        if free[g] >= t:
            taken[g] = True
            hit[d] = True
    return hit


def average_precision(scores: np.ndarray, hits: np.ndarray, n_truth: int) -> float:
    """AP of detections (any order) with their match flags, against ``n_truth`` boxes: COCO's
    101-point interpolated precision."""
    if n_truth == 0:
        return float("nan")
    order = np.argsort(-np.asarray(scores), kind="mergesort")
    tp = np.cumsum(hits[order])
    fp = np.cumsum(~hits[order])
    recall = tp / n_truth
    precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    idx = np.searchsorted(recall, RECALL_POINTS, side="left")
    q = np.zeros(len(RECALL_POINTS))
    reached = idx < len(envelope)
    q[reached] = envelope[idx[reached]]
    return float(np.mean(q))


def evaluate(detections: Sequence[ImageDetections], truths: Sequence[ImageTruth],
             labels: Sequence[str], max_dets: int = 100,
             thresholds: Sequence[float] = IOU_THRESHOLDS) -> dict:
    """-> ``{"mAP@0.5", "mAP@0.5:0.95", "AP@0.5" {label: AP}, "AP@0.5:0.95" {label: AP},
    "truth" {label: count}, "detections"}``; a class without ground truth is left out of the
    means (its AP is None)."""
    if len(detections) != len(truths):
        raise ValueError(f"{len(detections)} images of detections for {len(truths)} of truth")
    ap = np.full((len(labels), len(thresholds)), np.nan)
    counts = {}
    for c, label in enumerate(labels):
        scores: list[np.ndarray] = []
        hits: list[list[np.ndarray]] = [[] for _ in thresholds]
        n_truth = 0
        for det, tru in zip(detections, truths):
            gt = np.asarray(tru.boxes).reshape(-1, 4)[np.asarray(tru.classes) == c]
            n_truth += len(gt)
            mine = np.flatnonzero(np.asarray(det.classes) == c)
            mine = mine[np.argsort(-np.asarray(det.scores)[mine], kind="mergesort")][:max_dets]
            if not len(mine):
                continue
            iou = iou_matrix(np.asarray(det.boxes)[mine], gt)
            scores.append(np.asarray(det.scores, np.float64)[mine])
            for k, t in enumerate(thresholds):
                hits[k].append(_match(iou, t))
        counts[label] = n_truth
        all_scores = np.concatenate(scores) if scores else np.zeros(0)
        for k in range(len(thresholds)):
            h = np.concatenate(hits[k]) if hits[k] else np.zeros(0, bool)
            ap[c, k] = average_precision(all_scores, h, n_truth)

    def label_map(v: np.ndarray) -> dict[str, float | None]:
        return {lab: (None if np.isnan(x) else round(float(x), 4)) for lab, x in zip(labels, v)}

    has = ~np.isnan(ap[:, 0])
    i50 = list(thresholds).index(0.5) if 0.5 in thresholds else 0
    return {
        "mAP@0.5": round(float(ap[has, i50].mean()), 4) if has.any() else None,
        "mAP@0.5:0.95": round(float(ap[has].mean()), 4) if has.any() else None,
        "AP@0.5": label_map(ap[:, i50]),
        "AP@0.5:0.95": label_map(ap.mean(1)),
        "truth": counts,
        "detections": int(sum(len(d.scores) for d in detections)),
    }
