"""Detection and segmentation tasks on raw model outputs (issue 17): formats, NMS, geometry back
to the frame, verdict rules, the host and the device path giving the same answers. Serving them
end to end over every protocol: tests/integration/test_detection_serving.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from visionserve import tasks
from visionserve.backends.checks import Subject, TensorSpec
from visionserve.config import InputSpec, ModelConfig
from visionserve.errors import ConfigError
from visionserve.tasks import detection
from visionserve.tasks.geometry import FrameMap, box_polygon_overlap, points_in_polygon
from visionserve.tasks.rules import Judge, RegionVerdict
from visionserve.tasks.segmentation import rle_decode

SUBJECT = Subject(Path("/repo/det/1/model.onnx"))
N = (1, None)  # a dynamic batch axis


def make(output: dict, verdict: dict | None = None, task: str = "detection", **inp):
    data = {"task": task, "input": {"width": 64, "height": 64, **inp}, "output": output}
    if verdict is not None:
        data["verdict"] = verdict
    return tasks.create(ModelConfig.model_validate(data))


def yolo_head(rng, batch=3, anchors=12, nc=2, extra=0, channels_first=True):
    x = np.zeros((batch, 4 + nc + extra, anchors), np.float32)
    x[:, 0:2] = rng.uniform(12, 52, (batch, 2, anchors))
    x[:, 2:4] = rng.uniform(4, 24, (batch, 2, anchors))
    x[:, 4:4 + nc] = rng.uniform(0, 1, (batch, nc, anchors))
    x[:, 4 + nc:] = rng.normal(0, 2, (batch, extra, anchors))
    return x if channels_first else x.transpose(0, 2, 1).copy()


def answer(results):
    return [(v, [(d.label, round(d.score, 5), tuple(round(b, 2) for b in d.box))
                 for d in r.detections]) for v, r in results]


# --- geometry ---------------------------------------------------------------------------------

@pytest.mark.parametrize("resize", ["stretch", "letterbox", "center_crop"])
def test_frame_map_undoes_the_resize(resize):
    spec = InputSpec(width=64, height=64, resize=resize)
    m = FrameMap.of(spec, (200, 100))
    # a frame point -> model pixels by the preprocessing's own geometry -> back
    from visionserve import imaging

    nh, nw, y0, x0, cy, cx = imaging.geometry(spec, 100, 200)
    fx, fy = 120.0, 40.0
    mx, my = fx * nw / 200 + x0 - cx, fy * nh / 100 + y0 - cy
    back = m.boxes(np.array([[mx, my, mx, my]], np.float32))[0]
    assert back[0] == pytest.approx(fx, abs=1e-3) and back[1] == pytest.approx(fy, abs=1e-3)


def test_frame_map_masks_land_on_the_frame():
    spec = InputSpec(width=64, height=64, resize="letterbox")
    m = FrameMap.of(spec, (128, 64))  # 128x64 -> 64x32 at y 16..48
    model_mask = np.zeros((64, 64), np.float32)
    model_mask[16:32, 0:32] = 1.0  # the frame's top-left quarter
    frame = m.mask(model_mask, 64, 64) > 0.5
    assert frame.shape == (64, 128)
    assert frame[:32, :64].mean() > 0.95 and frame[32:, :].mean() < 0.05
    window = m.mask(model_mask, 64, 64, (10, 5, 80, 50)) > 0.5
    assert np.array_equal(window, frame[5:50, 10:80])


def test_polygon_helpers():
    square = np.array([[0, 0], [10, 0], [10, 10], [0, 10]], float)
    assert points_in_polygon(np.array([[5, 5], [10, 5], [11, 5]], float), square).tolist() == \
        [True, True, False]
    overlap = box_polygon_overlap(np.array([[5, 0, 15, 10], [20, 20, 30, 30]], float), square)
    assert overlap == pytest.approx([0.5, 0.0])


# --- verdict rules ----------------------------------------------------------------------------

def judge(verdict, labels=("scratch", "screw")):
    return Judge(RegionVerdict.model_validate(verdict), labels)


BOXES = np.array([[10, 10, 30, 14], [100, 100, 104, 104], [200, 10, 210, 20]], np.float32)


def test_every_label_is_a_defect_by_default_and_reasons_name_the_objects():
    verdict, reasons = judge({}).judge(["scratch", "screw", "scratch"], [0.9, 0.8, 0.3], BOXES,
                                       [80, 16, 100])
    assert verdict == "NG"
    assert {r.rule: r.objects for r in reasons} == {"defect:scratch": (0, 2),
                                                     "defect:screw": (1,)}


def test_per_class_score_and_size_in_mm():
    j = judge({"pixels_per_mm": 10, "defects": {"scratch": {"min_score": 0.5,
                                                             "min_length_mm": 1.5}}})
    # #0 is 2 mm long and scores 0.9; #2 is 1 mm long; the screw is no defect
    v, reasons = j.judge(["scratch", "screw", "scratch"], [0.9, 0.99, 0.95], BOXES, [80, 16, 100])
    assert v == "NG" and reasons[0].objects == (0,) and "2.00 mm" in reasons[0].message
    v, _ = j.judge(["scratch"], [0.4], BOXES[:1], [80])
    assert v == "OK"  # below its class's score


def test_mm_rules_need_a_scale():
    with pytest.raises(ValueError, match="pixels_per_mm"):
        RegionVerdict.model_validate({"defects": {"scratch": {"min_area_mm2": 1}}})


def test_roi_and_exclusion_zone():
    roi = [[[0, 0], [150, 0], [150, 150], [0, 150]]]
    j = judge({"roi": roi, "exclude": [[[90, 90], [120, 90], [120, 120], [90, 120]]]})
    v, reasons = j.judge(["scratch", "scratch", "scratch"], [0.9] * 3, BOXES, [80, 16, 100])
    # #0 in the ROI; #1 in the exclusion zone; #2 outside the ROI
    assert v == "NG" and reasons[0].objects == (0,)
    v, _ = j.judge(["scratch"], [0.9], BOXES[1:2], [16])
    assert v == "OK"


def test_roi_by_overlap():
    roi = [[[0, 0], [20, 0], [20, 40], [0, 40]]]  # half of box #0 (x 10..30) is inside
    assert judge({"roi": roi, "roi_match": "overlap", "min_overlap": 0.4}).judge(
        ["scratch"], [0.9], BOXES[:1], [80])[0] == "NG"
    assert judge({"roi": roi, "roi_match": "overlap", "min_overlap": 0.6}).judge(
        ["scratch"], [0.9], BOXES[:1], [80])[0] == "OK"


@pytest.mark.parametrize("rule,found,verdict", [
    ({"exactly": 2}, 2, "OK"), ({"exactly": 2}, 1, "NG"), ({"exactly": 2}, 3, "NG"),
    ({"at_least": 2}, 3, "OK"), ({"at_least": 2}, 1, "NG"),
    ({"at_most": 1}, 1, "OK"), ({"at_most": 1}, 2, "NG")])
def test_count_rules(rule, found, verdict):
    j = judge({"count": [{"label": "screw", "min_score": 0.5, **rule}]})
    boxes = np.tile(BOXES[:1], (found + 1, 1))
    labels = ["screw"] * found + ["screw"]
    scores = [0.9] * found + [0.2]  # the last one scores too low to count
    v, reasons = j.judge(labels, scores, boxes, [80] * (found + 1))
    assert v == verdict
    if verdict == "NG":
        assert reasons[0].rule == "count:screw" and f"{found} screw found" in reasons[0].message


def test_rules_for_unknown_labels_are_refused():
    with pytest.raises(Exception, match="not in output.labels"):
        make({"format": "yolo", "labels": ["a"]}, {"count": [{"label": "b", "exactly": 1}]})


# --- formats ----------------------------------------------------------------------------------

def test_yolo_host_and_device_paths_agree_with_nms():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    t = make({"format": "yolo", "labels": ["a", "b"], "score_threshold": 0.2}, resize="letterbox")
    t.bind(SUBJECT, [TensorSpec("out", (N, 6, 12), "float32")])
    x = yolo_head(rng)
    sizes = [(128, 64), (64, 64), (64, 128)]
    host = t.postprocess({"out": x}, slice(0, 3), sizes)
    device = t.postprocess({"out": torch.from_numpy(x)}, slice(0, 3), sizes)
    assert answer(host) == answer(device)
    # NMS: no two kept boxes of a class overlap more than the threshold
    from torchvision.ops import box_iou

    for _, r in host:
        for c in ("a", "b"):
            b = torch.tensor([d.box for d in r.detections if d.label == c]).reshape(-1, 4)
            iou = box_iou(b, b).fill_diagonal_(0)
            assert (iou <= 0.45 + 1e-6).all()
    # rows picked out of a batch answer the same as alone
    picked = t.postprocess({"out": x}, [2, 0], [sizes[2], sizes[0]])
    assert answer(picked) == [answer(host)[2], answer(host)[0]]


def test_yolo_transposed_head_is_read_by_its_shape():
    rng = np.random.default_rng(2)
    first = make({"format": "yolo", "labels": ["a", "b"]})
    first.bind(SUBJECT, [TensorSpec("out", (N, 6, 12), "float32")])
    last = make({"format": "yolo", "labels": ["a", "b"]})
    last.bind(SUBJECT, [TensorSpec("out", (N, 12, 6), "float32")])
    x = yolo_head(rng)
    assert answer(first.postprocess({"out": x}, slice(0, 3))) == \
        answer(last.postprocess({"out": x.transpose(0, 2, 1).copy()}, slice(0, 3)))


def test_objectness_multiplies_the_class_score():
    t = make({"format": "yolo-objectness", "labels": ["a", "b"], "score_threshold": 0.3})
    t.bind(SUBJECT, [TensorSpec("out", (N, 2, 7), "float32")])
    x = np.array([[[20, 20, 10, 10, 0.5, 0.9, 0.1], [40, 40, 10, 10, 0.2, 0.9, 0.1]]], np.float32)
    (_, r), = t.postprocess({"out": x}, slice(0, 1))
    assert [(d.label, round(d.score, 3)) for d in r.detections] == [("a", 0.45)]


def test_end2end_both_layouts_and_padding_rows():
    t = make({"format": "end2end", "labels": ["a", "b"], "score_threshold": 0.3})
    t.bind(SUBJECT, [TensorSpec("out", (N, 4, 6), "float32")])
    x = np.zeros((2, 4, 6), np.float32)
    x[0, 0] = [1, 2, 11, 12, 0.9, 1]
    x[0, 1] = [5, 5, 9, 9, 0.2, 0]  # under the threshold
    x[1, 0] = [3, 3, 13, 13, 0.8, 0]
    r = t.postprocess({"out": x}, slice(0, 2))
    assert answer(r) == [("NG", [("b", 0.9, (1, 2, 11, 12))]), ("NG", [("a", 0.8, (3, 3, 13, 13))])]
    v7 = make({"format": "end2end", "labels": ["a", "b"], "score_threshold": 0.3})
    v7.bind(SUBJECT, [TensorSpec("out", ((0, None), 7), "float32")])
    flat = np.array([[1, 3, 3, 13, 13, 0, 0.8], [0, 1, 2, 11, 12, 1, 0.9]], np.float32)
    assert answer(v7.postprocess({"out": flat}, slice(0, 2))) == answer(r)


def test_boxes_format_with_count_and_normalised_boxes():
    t = make({"format": "boxes", "labels": ["a", "b"], "count_tensor": "num",
              "normalized_boxes": True})
    t.bind(SUBJECT, [TensorSpec("boxes", (N, 3, 4)), TensorSpec("scores", (N, 3)),
                     TensorSpec("classes", (N, 3)), TensorSpec("num", (N,))])
    boxes = np.array([[[0.1, 0.1, 0.5, 0.5], [0, 0, 0.25, 0.25], [0.5, 0.5, 1, 1]]], np.float32)
    out = {"boxes": boxes, "scores": np.array([[0.9, 0.8, 0.95]], np.float32),
           "classes": np.array([[1, 0, 0]], np.int32), "num": np.array([2], np.int32)}
    (_, r), = t.postprocess(out, slice(0, 1))
    assert [(d.label, d.box) for d in r.detections] == [
        ("b", pytest.approx((6.4, 6.4, 32.0, 32.0))), ("a", (0.0, 0.0, 16.0, 16.0))]


def test_degenerate_boxes_are_dropped_and_counted():
    t = make({"format": "yolo", "labels": ["a"], "score_threshold": 0.1})
    t.bind(Subject(Path("/repo/degen/1/model.onnx")), [TensorSpec("out", (N, 5, 4), "float32")])
    # anchors: two good boxes, one of negative width, one of NaN height
    x = np.array([[[20, 50, 30, 40], [20, 50, 30, 40], [10, 10, -1, 5], [10, 10, 5, np.nan],
                   [0.9, 0.8, 0.7, 0.6]]], np.float32)
    before = detection.DEGENERATE.labels("degen")._value.get()
    (verdict, r), = t.postprocess({"out": x}, slice(0, 1))
    assert len(r.detections) == 2 and verdict == "NG"
    assert detection.DEGENERATE.labels("degen")._value.get() - before == 2


def test_boxes_in_the_padding_are_clipped_then_dropped_on_both_paths():
    """Clip to the frame first, then drop and count what has no size, then NMS and top-k: a box
    wholly in the letterbox padding (the best-scoring one here) takes no place among a frame's
    max_detections, on the host and on the device path alike."""
    torch = pytest.importorskip("torch")
    t = make({"format": "yolo", "labels": ["a"], "score_threshold": 0.1, "max_detections": 1},
             resize="letterbox")
    t.bind(Subject(Path("/repo/pad/1/model.onnx")), [TensorSpec("out", (N, 5, 3), "float32")])
    # a 128x64 frame letterboxed into 64x64 fills rows 16..48: a box in rows 2..10 (padding),
    # one straddling the top edge (rows 10..30), one on the frame
    x = np.array([[[32, 32, 40], [6, 20, 40], [40, 20, 8], [8, 20, 8], [0.9, 0.8, 0.7]]],
                 np.float32)
    for out in ({"out": x}, {"out": torch.from_numpy(x)}):
        before = detection.DEGENERATE.labels("pad")._value.get()
        (_, r), = t.postprocess(out, slice(0, 1), [(128, 64)])
        assert detection.DEGENERATE.labels("pad")._value.get() - before == 1
        assert [(round(d.score, 3), d.box, d.area) for d in r.detections] == \
            [(0.8, (44.0, 0.0, 84.0, 28.0), 40.0 * 28.0)]  # clipped at the frame's top edge


def test_zero_detections_is_an_ok_answer():
    t = make({"format": "yolo", "labels": ["a"], "score_threshold": 0.5})
    t.bind(SUBJECT, [TensorSpec("out", (N, 5, 4), "float32")])
    (verdict, r), = t.postprocess({"out": np.zeros((1, 5, 4), np.float32)}, slice(0, 1))
    assert verdict == "OK" and r.detections == ()
    arrays = t.oip_tensors([r])
    assert arrays["num_detections"].tolist() == [0] and arrays["detection_boxes"].shape == \
        (1, 100, 4)


@pytest.mark.parametrize("fmt,dims,match", [
    ("yolo", (N, 84, 8400), r"2 labels, but the model's head gives 80 class scores"),
    ("yolo", (N, 6), "has rank 3"),
    ("yolo-objectness", (N, 8400, 85), "gives 80 class scores"),
    ("end2end", (N, 100, 5), r"\[N, K, 6\]")])
def test_outputs_that_do_not_fit_are_refused_at_load(fmt, dims, match):
    t = make({"format": fmt, "labels": ["a", "b"]})
    with pytest.raises(ConfigError, match=match) as info:
        t.bind(SUBJECT, [TensorSpec("out", dims, "float32")])
    assert "model det version 1" in str(info.value) and "expected" in str(info.value)
    assert str(info.value).endswith('(see docs/detection.md, "Output formats")')  # not a classifier's


def test_a_segmentation_model_without_prototypes_is_refused():
    t = make({"format": "yolo-seg", "labels": ["a"]}, task="segmentation")
    with pytest.raises(ConfigError, match='proto_tensor.*see docs/detection.md, "Output formats"'):
        t.bind(SUBJECT, [TensorSpec("out", (N, 37, 100), "float32")])


# --- segmentation -----------------------------------------------------------------------------

def test_yolo_seg_masks_host_and_device_agree():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    t = make({"format": "yolo-seg", "labels": ["a", "b"], "score_threshold": 0.3},
             task="segmentation", resize="letterbox")
    t.bind(SUBJECT, [TensorSpec("out", (N, 10, 12), "float32"),
                     TensorSpec("proto", (N, 4, 16, 16), "float32")])
    x = yolo_head(rng, batch=2, extra=4)
    p = rng.normal(0, 1, (2, 4, 16, 16)).astype(np.float32)
    sizes = [(128, 64), (64, 64)]
    host = t.postprocess({"out": x, "proto": p}, slice(0, 2), sizes)
    device = t.postprocess({"out": torch.from_numpy(x), "proto": torch.from_numpy(p)},
                           slice(0, 2), sizes)
    assert answer(host) == answer(device)
    for (_, a), (_, b), (w, h) in zip(host, device, sizes):
        for da, db in zip(a.detections, b.detections):
            m = rle_decode(da.mask)
            assert m.shape == (h, w) and da.area == m.sum()
            assert np.array_equal(m, rle_decode(db.mask))
            ys, xs = np.nonzero(m)
            if len(xs):  # the mask stays inside its box
                assert xs.min() >= np.floor(da.box[0]) and xs.max() < np.ceil(da.box[2])


def test_semantic_regions_in_frame_pixels():
    t = make({"format": "semantic", "labels": ["bg", "a", "b"], "background": "bg"},
             {"defects": {"b": {"min_area_px": 100}}}, task="segmentation",
             resize="center_crop")
    t.bind(SUBJECT, [TensorSpec("out", (N, 3, 64, 64), "float32")])
    x = np.zeros((1, 3, 64, 64), np.float32)
    x[0, 0] = 1
    x[0, 1, 10:20, 10:30] = 5
    x[0, 2, 40:60, 40:50] = 5
    (verdict, r), = t.postprocess({"out": x}, slice(0, 1), [(128, 64)])  # crop x offset 32
    got = {d.label: (d.box, d.area) for d in r.detections}
    assert got == {"a": ((42.0, 10.0, 62.0, 20.0), 200.0), "b": ((72.0, 40.0, 82.0, 60.0), 200.0)}
    assert verdict == "NG" and [x.rule for x in r.reasons] == ["defect:b"]
    fields = t.inspect_fields(r)
    assert rle_decode(fields["detections"][0]["mask"]).sum() == 200
    assert t.oip_tensors([r])["detection_masks"].shape == (1, 100)


def test_annotated_frame_shows_boxes_and_verdict():
    t = make({"format": "end2end", "labels": ["a"]}, {"roi": [[[0, 0], [60, 0], [60, 60]]]})
    t.bind(SUBJECT, [TensorSpec("out", (N, 1, 6), "float32")])
    (verdict, r), = t.postprocess({"out": np.array([[[10, 10, 40, 40, 0.9, 0]]], np.float32)},
                                  slice(0, 1))
    img = np.full((64, 64, 3), 128, np.uint8)
    t.annotate(img, verdict, r)
    assert (img != 128).any(axis=2).sum() > 200  # banner, ROI and box drawn


def test_new_verdict_rules_apply_from_the_next_batch():
    t = make({"format": "end2end", "labels": ["a"]})
    t.bind(SUBJECT, [TensorSpec("out", (N, 1, 6), "float32")])
    out = {"out": np.array([[[10, 10, 40, 40, 0.9, 0]]], np.float32)}
    assert t.postprocess(out, slice(0, 1))[0][0] == "NG"
    data = t.config.model_dump() | {"verdict": {"defects": {"a": {"min_score": 0.95}}}}
    t.reconfigure(type(t.config).model_validate(data))
    assert t.postprocess(out, slice(0, 1))[0][0] == "OK"


def test_the_presence_check_example_is_valid_and_judges_counts():
    from visionserve.config import load_model_config

    cfg = load_model_config(Path(__file__).parents[2] / "docs" / "examples" /
                            "presence-check.model.toml")
    j = Judge(cfg.verdict, cfg.output.labels)
    screws = np.array([[200 + 100 * i, 200, 230 + 100 * i, 230] for i in range(4)], np.float32)
    label = np.array([[600, 500, 700, 560]], np.float32)
    clamp = np.array([[600, 950, 640, 990]], np.float32)  # in the exclusion zone
    boxes = np.concatenate([screws, label, clamp])
    labels = ["screw"] * 4 + ["label", "foreign"]
    assert j.judge(labels, [0.9] * 6, boxes, [900] * 6)[0] == "OK"
    verdict, reasons = j.judge(labels[1:], [0.9] * 5, boxes[1:], [900] * 5)
    assert verdict == "NG" and [r.rule for r in reasons] == ["count:screw"]
