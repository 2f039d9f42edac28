"""mAP as COCO computes it (visionserve_tools.training.detmap), on cases worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from visionserve_tools.training import detmap
from visionserve_tools.training.detmap import ImageDetections, ImageTruth

LABELS = ("a", "b")


def dets(*rows: tuple[float, float, float, float, float, int]) -> ImageDetections:
    arr = np.array(rows, np.float64).reshape(-1, 6)
    return ImageDetections(arr[:, :4], arr[:, 4], arr[:, 5].astype(int))


def truth(*rows: tuple[float, float, float, float, int]) -> ImageTruth:
    arr = np.array(rows, np.float64).reshape(-1, 5)
    return ImageTruth(arr[:, :4], arr[:, 4].astype(int))


def test_perfect_detections_score_one_and_none_score_zero():
    gt = [truth((0, 0, 10, 10, 0), (20, 20, 40, 30, 1)), truth((5, 5, 9, 9, 0))]
    perfect = [dets((0, 0, 10, 10, 0.9, 0), (20, 20, 40, 30, 0.8, 1)), dets((5, 5, 9, 9, 0.7, 0))]
    r = detmap.evaluate(perfect, gt, LABELS)
    assert r["mAP@0.5"] == 1.0 and r["mAP@0.5:0.95"] == 1.0
    assert r["truth"] == {"a": 2, "b": 1}
    r = detmap.evaluate([dets(), dets()], gt, LABELS)
    assert r["mAP@0.5"] == 0.0 and r["mAP@0.5:0.95"] == 0.0


def test_interpolated_precision_at_101_recall_points():
    # two boxes; by score: hit, miss, hit -> recall .5 .5 1, precision 1 .5 .67; the envelope is
    # 1 up to recall .5 (51 points) and 2/3 above it (50 points)
    gt = [truth((0, 0, 10, 10, 0), (50, 50, 60, 60, 0))]
    d = [dets((0, 0, 10, 10, 0.9, 0), (100, 100, 110, 110, 0.8, 0), (50, 50, 60, 60, 0.7, 0))]
    r = detmap.evaluate(d, gt, LABELS)
    assert r["AP@0.5"]["a"] == pytest.approx((51 + 50 * 2 / 3) / 101, abs=1e-4)
    # a miss ranked first: precision .5 at recall .5, but the envelope takes the best precision
    # at any higher recall (2/3 at recall 1)
    d = [dets((100, 100, 110, 110, 0.95, 0), (0, 0, 10, 10, 0.9, 0), (50, 50, 60, 60, 0.7, 0))]
    assert detmap.evaluate(d, gt, LABELS)["AP@0.5"]["a"] == pytest.approx(2 / 3, abs=1e-4)


def test_iou_thresholds_and_duplicates():
    gt = [truth((0, 0, 10, 10, 0))]
    # IoU 0.6 (a box shifted by 2.5 px): a hit at .50, .55, .60 of the ten thresholds
    shifted = [dets((2.5, 0, 12.5, 10, 0.9, 0))]
    assert detmap.iou_matrix(shifted[0].boxes, gt[0].boxes)[0, 0] == pytest.approx(0.6)
    r = detmap.evaluate(shifted, gt, LABELS)
    assert r["mAP@0.5"] == 1.0 and r["mAP@0.5:0.95"] == pytest.approx(0.3)
    # a second box on the same object is a false positive, after recall 1: AP stays 1; before
    # the true one, it costs precision
    assert detmap.evaluate([dets((0, 0, 10, 10, 0.9, 0), (0, 0, 10, 11, 0.8, 0))], gt,
                           LABELS)["mAP@0.5"] == 1.0
    assert detmap.evaluate([dets((0, 0, 10, 10, 0.8, 0), (0, 0, 10, 11, 0.9, 0))], gt,
                           LABELS)["mAP@0.5"] == 1.0      # either box matches: the first one wins
    assert detmap.evaluate([dets((30, 30, 40, 40, 0.9, 0), (0, 0, 10, 10, 0.8, 0))], gt,
                           LABELS)["mAP@0.5"] == 0.5


def test_classes_are_kept_apart_and_a_class_without_truth_is_left_out():
    gt = [truth((0, 0, 10, 10, 0))]
    r = detmap.evaluate([dets((0, 0, 10, 10, 0.9, 1), (0, 0, 10, 10, 0.5, 0))], gt, LABELS)
    assert r["AP@0.5"] == {"a": 1.0, "b": None}       # the wrong-class box does not count for a
    assert r["mAP@0.5"] == 1.0


def test_at_most_max_dets_per_image_and_class():
    gt = [truth((0, 0, 10, 10, 0))]
    misses = [(100 + i, 100, 110 + i, 110, 0.9, 0) for i in range(3)]
    d = [dets(*misses, (0, 0, 10, 10, 0.5, 0))]
    assert detmap.evaluate(d, gt, LABELS, max_dets=3)["mAP@0.5"] == 0.0
    assert detmap.evaluate(d, gt, LABELS, max_dets=4)["mAP@0.5"] == pytest.approx(0.25)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="images"):
        detmap.evaluate([dets()], [], LABELS)
