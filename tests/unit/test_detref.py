"""The reference that served detection and segmentation answers are held to
(``tests/tools/detref.py``), checked on synthetic model outputs whose answer is known by hand:
a wrong reference would pass a wrong server."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tools import detref
from visionserve.config import InputSpec


def spec(width: int, height: int, resize: str) -> InputSpec:
    return InputSpec(width=width, height=height, resize=resize)


def test_yolo_heads_in_either_orientation_decode_alike():
    # 3 anchors, 2 classes: cx, cy, w, h, then the class scores
    head = np.array([[10, 20, 4, 6, 0.1, 0.8],
                     [30, 30, 10, 10, 0.7, 0.2],
                     [5, 5, 2, 2, 0.05, 0.01]], np.float32)
    pad = np.zeros((5, 6), np.float32)  # more anchors than columns, as in every real head
    rows = np.concatenate([head, pad])
    for x in (rows, rows.T):
        boxes, scores, classes, extra = detref.decode_yolo(x, nc=2)
        np.testing.assert_allclose(boxes[:2], [[8, 17, 12, 23], [25, 25, 35, 35]])
        np.testing.assert_allclose(scores[:3], [0.8, 0.7, 0.05], rtol=1e-6)
        assert classes[:3].tolist() == [1, 0, 0] and extra.shape == (8, 0)


def test_objectness_multiplies_the_class_scores():
    rows = np.array([[10, 10, 4, 4, 0.5, 0.2, 0.9]] + [[0] * 7] * 3, np.float32)
    _, scores, classes, _ = detref.decode_yolo(rows, nc=2, objectness=True)
    assert scores[0] == pytest.approx(0.45) and classes[0] == 1


def test_yolo_seg_columns_after_the_classes_are_the_mask_coefficients():
    head = np.zeros((40, 4 + 2 + 32), np.float32)
    head[0, :6] = [10, 10, 4, 4, 0.2, 0.9]
    head[0, 6:] = np.arange(32)
    _, _, classes, extra = detref.decode_yolo(head.T, nc=2)
    assert classes[0] == 1 and extra.shape == (40, 32)
    np.testing.assert_array_equal(extra[0], np.arange(32))


BOXES = np.array([[0, 0, 10, 10],     # 0: best red
                  [1, 0, 11, 10],     # 1: red, IoU 0.82 with 0: suppressed
                  [1, 0, 11, 10],     # 2: green, same place: kept per class, not agnostic
                  [20, 20, 30, 30],   # 3: red elsewhere
                  [40, 40, 40, 50],   # 4: zero width
                  [50, 50, 60, 45],   # 5: negative height
                  [np.nan, 0, 5, 5],  # 6: NaN
                  [60, 60, 70, 70]],  # 7: under the threshold
                 np.float32)
SCORES = np.array([0.9, 0.8, 0.7, 0.6, 0.99, 0.98, 0.97, 0.29], np.float32)
CLASSES = np.array([0, 0, 1, 0, 0, 0, 0, 0])


def test_select_per_class_drops_degenerate_boxes_and_keeps_score_order():
    keep = detref.select(BOXES, SCORES, CLASSES, threshold=0.3, iou=0.45)
    assert keep.tolist() == [0, 2, 3]


def test_select_class_agnostic_suppresses_across_classes():
    keep = detref.select(BOXES, SCORES, CLASSES, threshold=0.3, iou=0.45, agnostic=True)
    assert keep.tolist() == [0, 3]


def test_select_without_nms_top_k_and_an_inclusive_threshold():
    assert detref.select(BOXES, SCORES, CLASSES, threshold=0.3, iou=None).tolist() == [0, 1, 2, 3]
    assert detref.select(BOXES, SCORES, CLASSES, threshold=0.3, iou=None, top_k=2).tolist() \
        == [0, 1]
    assert 7 in detref.select(BOXES, SCORES, CLASSES, threshold=np.float32(0.29), iou=None)


@pytest.mark.parametrize("resize, frame, model_box, frame_box", [
    # 640x480 into 96x64 letterbox: scale 64/480, 85x64 placed at x 5
    ("letterbox", (640, 480), [5, 0, 90, 64], [0, 0, 640, 480]),
    ("letterbox", (640, 480), [47.5, 32, 90, 64], [320, 240, 640, 480]),
    # stretch: each axis on its own
    ("stretch", (480, 480), [0, 0, 48, 32], [0, 0, 240, 240]),
    # centre crop of 480x480 into 96x64: 96x96 intermediate, rows 16..80 kept
    ("center_crop", (480, 480), [0, 0, 96, 64], [0, 80, 480, 400]),
    # clipped to the frame: the letterbox pad is outside it
    ("letterbox", (640, 480), [0, -3, 96, 64], [0, 0, 640, 480]),
])
def test_boxes_back_to_the_frame(resize, frame, model_box, frame_box):
    place = detref.Placement.of(spec(96, 64, resize), *frame)
    got = place.boxes(np.array([model_box], np.float64))[0]
    np.testing.assert_allclose(got, frame_box, atol=1e-9)


@pytest.mark.parametrize("resize", ["letterbox", "stretch", "center_crop"])
def test_a_map_sampled_onto_the_frame_lands_where_the_box_does(resize):
    s = spec(96, 64, resize)
    place = detref.Placement.of(s, 500, 400)
    # a quarter-resolution map (24x16) with a block at map pixels x 6..12, y 4..10
    m = np.zeros((1, 16, 24), np.float32)
    m[0, 4:10, 6:12] = 1.0
    sampled = place.sample(m, 96, 64)[0] > 0.5
    box = place.boxes(np.array([[24, 16, 48, 40]], np.float64))[0]  # the block, model pixels
    ys, xs = np.nonzero(sampled)
    # the 0.5 contour of a bilinear block runs through its edge: within a frame pixel
    assert abs(xs.min() - box[0]) <= 1 and abs(xs.max() + 1 - box[2]) <= 1
    assert abs(ys.min() - box[1]) <= 1 and abs(ys.max() + 1 - box[3]) <= 1


def test_crop_to_box_by_pixel_centres():
    mask = np.ones((4, 6), bool)
    # columns whose centres are in [1, 3.5): 1, 2 (3.5 is out); rows in [0.6, 4): 1, 2, 3
    out = detref.crop_to_box(mask, np.array([1.0, 0.6, 3.5, 4.0]))
    assert out.sum() == 2 * 3 and out[1:4, 1:3].all()


def test_semantic_regions_are_connected_components_of_each_class_but_the_background():
    classes = np.zeros((10, 12), np.int64)
    classes[1:3, 1:4] = 1  # a red blob, 6 px
    classes[6:9, 8:12] = 1  # another, 12 px
    classes[5, 0] = 2  # one green pixel
    out = detref.regions(classes, ("background", "red", "green"), background=0)
    assert [(label, int(mask.sum()), box.tolist()) for label, _, box, mask in out] == [
        ("red", 12, [8, 6, 12, 9]), ("red", 6, [1, 1, 4, 3]), ("green", 1, [0, 5, 1, 6])]


def _coco_string(counts: list[int]) -> str:
    """pycocotools' rleToString (the encoder of what detref decodes)."""
    out = []
    for i, x in enumerate(counts):
        if i > 2:
            x -= counts[i - 2]
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = (x != -1) if c & 0x10 else (x != 0)
            if more:
                c |= 0x20
            out.append(chr(c + 48))
    return "".join(out)


def _counts(mask: np.ndarray) -> list[int]:
    flat = mask.T.reshape(-1)
    counts, value, run = [], False, 0
    for v in flat:
        if v == value:
            run += 1
        else:
            counts.append(run)
            value, run = v, 1
    counts.append(run)
    return counts


def test_coco_rle_both_forms():
    rng = np.random.default_rng(3)
    mask = np.zeros((37, 53), bool)
    mask[5:30, 10:40] = True
    mask[rng.integers(0, 37, 80), rng.integers(0, 53, 80)] ^= True
    counts = _counts(mask)
    assert sum(counts) == mask.size
    for c in (counts, _coco_string(counts)):
        np.testing.assert_array_equal(detref.rle_decode({"size": [37, 53], "counts": c}), mask)


def test_match_pairs_and_says_what_differs():
    e = [detref.Det("red", 0, 0.9, np.array([0, 0, 10, 10.0])),
         detref.Det("blue", 2, 0.5, np.array([5, 5, 9, 9.0]))]
    got = [{"label": "blue", "score": 0.50004, "box": [5.05, 5, 9, 9]},
           {"label": "red", "score": 0.9, "box": [0, 0, 10, 10]}]
    pairs = detref.match(e, got, box_tol=0.1, score_tol=1e-4)
    assert [p[1]["label"] for p in pairs] == ["red", "blue"]
    with pytest.raises(AssertionError, match="not served: blue 0.50000"):
        detref.match(e, [got[1], {**got[0], "box": [5.2, 5, 9, 9]}], box_tol=0.1, score_tol=1e-4)
