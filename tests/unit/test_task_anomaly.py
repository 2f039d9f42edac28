"""The anomaly task on model outputs alone: normalisation, the verdict rule, regions in frame
pixels, ROI and mm^2, swapping the verdict settings, and the checks against model.toml."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from visionserve import tasks
from visionserve.backends.checks import Subject, TensorSpec
from visionserve.config import ModelConfig
from visionserve.errors import ConfigError
from visionserve.tasks.anomaly import normalize
from visionserve.tasks.regions import find_regions, inside

N = (1, None)  # a dynamic batch axis
OUTPUTS = [TensorSpec("pred_score", (N,), "float32"),
           TensorSpec("pred_label", (N,), "bool"),
           TensorSpec("anomaly_map", (N, 1, 16, 16), "float32"),
           TensorSpec("pred_mask", (N, 1, 16, 16), "bool")]


def make(verdict: dict | None = None, output: dict | None = None, norm: dict | None = None,
         outputs=OUTPUTS, folder: Path = Path("/nonexistent/m/1")):
    data: dict = {"task": "anomaly", "input": {"width": 64, "height": 64},
                  "output": output or {}, "verdict": verdict or {}}
    if norm is not None:
        data["normalization"] = norm
    task = tasks.create(ModelConfig.model_validate(data))
    task.bind(Subject(folder / "model.onnx"), outputs)
    return task


def batch(*maps: np.ndarray) -> dict[str, np.ndarray]:
    m = np.stack(maps)[:, None].astype(np.float32)
    return {"pred_score": m.reshape(len(maps), -1).max(axis=1), "anomaly_map": m}


def blob(value: float = 0.9, y=slice(4, 8), x=slice(4, 6)) -> np.ndarray:
    m = np.full((16, 16), 0.1, np.float32)
    m[y, x] = value
    return m


def test_normalisation_is_anomalibs():
    x = np.array([0.0, 1.0, 2.0, 3.0, 10.0], np.float32)
    np.testing.assert_allclose(normalize(x, 2.0, 4.0), [0.0, 0.25, 0.5, 0.75, 1.0])


def test_anomalib_scores_pass_through_and_decide():
    t = make()
    (v0, good), (v1, bad) = t.postprocess(batch(blob(0.3), blob(0.9)), slice(0, 2))
    assert (v0, v1) == ("OK", "NG")
    assert good.score == pytest.approx(0.3) and bad.score == pytest.approx(0.9)
    assert np.isnan(good.raw_score)  # anomalib 2.x: the normalisation is inside the graph only
    assert bad.reasons == ("image score 0.9000 >= image_threshold 0.5",)
    np.testing.assert_array_equal(bad.map, blob(0.9))


def test_at_the_threshold_is_ng():
    (v, _), = make().postprocess(batch(blob(0.5)), slice(0, 1))
    assert v == "NG"


def test_raw_format_normalised_by_model_toml():
    t = make(output={"format": "raw"}, norm={"image_threshold": 2.0, "min": 0.0, "max": 4.0})
    m = np.zeros((16, 16), np.float32)
    m[0, 0] = 3.0
    (v, a), = t.postprocess(batch(m), slice(0, 1))
    assert (v, a.score, a.raw_score) == ("NG", 0.75, 3.0)
    assert a.map[0, 0] == 0.75 and a.map[1, 1] == 0.0


def test_raw_needs_normalization_at_load(tmp_path):
    with pytest.raises(ConfigError, match="field 'normalization'.*a raw-scale model needs"):
        make(output={"format": "raw"}, folder=tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps({
        "image_threshold": 2.0, "pred_scores.min": 0.0, "pred_scores.max": 4.0}))
    t = make(output={"format": "raw"}, folder=tmp_path)  # the version's own normalisation
    (_, a), = t.postprocess(batch(np.full((16, 16), 3.0, np.float32)), slice(0, 1))
    assert (a.score, a.raw_score) == (0.75, 3.0)


def test_anomalib_1x_metadata_gives_raw_scores(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps({
        "image_threshold": 10.0, "pixel_threshold": 12.0, "pred_scores.min": 0.0,
        "pred_scores.max": 20.0, "anomaly_maps.min": 0.0, "anomaly_maps.max": 30.0}))
    t = make(folder=tmp_path)
    (_, a), = t.postprocess(batch(blob(0.75)), slice(0, 1))
    assert a.raw_score == pytest.approx((0.75 - 0.5) * 20 + 10)


def test_regions_in_frame_pixels_and_area_rule():
    t = make(verdict={"image_threshold": 1.0, "min_region_area": 9000})
    # 16x16 map over a 64x64 input, frames 640x480 stretched: a map pixel is 40x30 frame pixels
    (v, a), = t.postprocess(batch(blob(0.9)), slice(0, 1), [(640, 480)])
    assert v == "NG" and a.region_count == 1
    r = a.regions[0]
    assert r.box == (160.0, 120.0, 240.0, 240.0) and r.area == 8 * 1200
    assert r.peak == pytest.approx(0.9)
    assert "region(s) of area >= min_region_area 9000 px" in a.reasons[0]
    t2 = make(verdict={"image_threshold": 1.0, "min_region_area": 9601})
    (v, a), = t2.postprocess(batch(blob(0.9)), slice(0, 1), [(640, 480)])
    assert v == "OK" and a.regions and not a.reasons  # reported, too small to decide


def test_letterbox_regions_map_back():
    data = {"task": "anomaly", "input": {"width": 64, "height": 64, "resize": "letterbox"}}
    t = tasks.create(ModelConfig.model_validate(data))
    t.bind(Subject(Path("/x/m/1/model.onnx")), OUTPUTS)
    # a 128x64 frame letterboxed into 64x64: scale 0.5, 16 pad rows top and bottom
    m = np.zeros((16, 16), np.float32)
    m[4:12, 0:16] = 0.9  # model rows 16..48: the frame's whole height
    (_, a), = t.postprocess(batch(m), slice(0, 1), [(128, 64)])
    assert a.regions[0].box == (0.0, 0.0, 128.0, 64.0)
    assert a.regions[0].area == pytest.approx(128 * 64)


def test_a_hot_letterbox_padding_is_no_region():
    """Map pixels over the padding are not on the frame: a region there would be a box of no
    size with an area; only the part on the frame counts."""
    data = {"task": "anomaly", "input": {"width": 64, "height": 64, "resize": "letterbox"},
            "verdict": {"image_threshold": 1.0, "min_region_area": 1}}
    t = tasks.create(ModelConfig.model_validate(data))
    t.bind(Subject(Path("/x/m/1/model.onnx")), OUTPUTS)
    # a 128x64 frame letterboxed into 64x64: map rows 0..3 and 12..15 are padding
    m = np.zeros((16, 16), np.float32)
    m[0:4, :] = 0.9  # the top padding only
    (v, a), = t.postprocess(batch(m), slice(0, 1), [(128, 64)])
    assert (v, a.regions, a.region_count) == ("OK", (), 0)
    m[0:6, 2:4] = 0.9  # into the frame by two map rows: 2x2 map pixels of 8x8 frame pixels
    (v, a), = t.postprocess(batch(m), slice(0, 1), [(128, 64)])
    assert v == "NG" and [r.box for r in a.regions] == [(16.0, 0.0, 32.0, 16.0)]
    assert a.regions[0].area == pytest.approx(4 * 64)


def test_roi_and_mm2():
    # ROI: the frame's left half (frames 640x480); the blob at the left counts, the right not
    roi = [[[0, 0], [320, 0], [320, 480], [0, 480]]]
    t = make(verdict={"image_threshold": 1.0, "min_region_area": 1.0, "area_unit": "mm2",
                      "pixels_per_mm": 10.0, "roi": roi})
    right = blob(0.9, x=slice(10, 12))
    (v, a), = t.postprocess(batch(right), slice(0, 1), [(640, 480)])
    assert v == "OK" and a.regions == ()
    (v, a), = t.postprocess(batch(blob(0.9)), slice(0, 1), [(640, 480)])
    assert v == "NG" and a.regions[0].area == pytest.approx(9600 / 100)


def test_mm2_needs_pixels_per_mm():
    with pytest.raises(ValueError, match="needs pixels_per_mm"):
        make(verdict={"area_unit": "mm2"})


def test_reconfigure_swaps_the_rule_whole():
    t = make()
    out = batch(blob(0.6))
    assert t.postprocess(out, slice(0, 1))[0][0] == "NG"
    cfg = t.config.model_copy(update={"verdict": t.config.verdict.model_copy(
        update={"image_threshold": 0.7})})
    t.reconfigure(cfg)
    assert t.postprocess(out, slice(0, 1))[0][0] == "OK"
    assert t.oip_parameters()["image_threshold"] == "0.7"


def test_oip_tensors_fixed_capacity():
    t = make(output={"max_regions": 2}, verdict={"pixel_threshold": 0.5})
    m = np.zeros((16, 16), np.float32)
    m[0:2, 0:2] = m[5:8, 5:8] = m[12, 12] = 0.9
    results = [r for _, r in t.postprocess(batch(m, blob(0.2)), slice(0, 2))]
    out = t.oip_tensors(results)
    names = [o.name for o in t.oip_outputs()]
    assert names == ["score", "raw_score", "anomaly_map", "num_regions", "region_boxes",
                     "region_areas", "region_peaks"]
    assert out["num_regions"].tolist() == [2, 0] and results[0].region_count == 3
    assert out["region_boxes"].shape == (2, 2, 4) and out["anomaly_map"].shape == (2, 16, 16)
    assert out["region_areas"][0].tolist() == [9 * 16, 4 * 16]  # largest first, frame = input


def test_score_from_the_map_when_no_score_output():
    t = make(outputs=[OUTPUTS[2]])
    (_, a), = t.postprocess({"anomaly_map": blob(0.8)[None, None]}, slice(0, 1))
    assert a.score == pytest.approx(0.8)


@pytest.mark.parametrize("outputs, output, field, expected", [
    ([TensorSpec("pred_score", (N, 3), "float32")], {}, "output.score", "[N] or [N, 1]"),
    ([TensorSpec("anomaly_map", (N, 2, 8, 8), "float32")], {}, "output.map", "[N, 1, h, w]"),
    ([TensorSpec("pred_score", (N,), "int64")], {}, "output.score", "float32"),
    ([TensorSpec("logits", (N, 5), "float32")], {}, "output.score", "neither"),
    (OUTPUTS, {"map": "heat"}, "output.map", "'heat'"),
])
def test_outputs_that_do_not_fit_are_refused_at_load(outputs, output, field, expected):
    with pytest.raises(ConfigError) as e:
        make(outputs=outputs, output=output)
    assert f"field '{field}'" in str(e.value) and expected in str(e.value)


def test_warmup_checks_the_map_size():
    t = make(outputs=[TensorSpec("anomaly_map", (N, 1, (1, None), (1, None)), "float32")])
    subject = Subject(Path("/x/m/1/model.onnx"))
    t.check_warmup(subject, 2, {"anomaly_map": np.zeros((2, 1, 8, 8), np.float32)})
    assert [o.dims for o in t.oip_outputs() if o.name == "anomaly_map"] == [(8, 8)]
    with pytest.raises(ConfigError, match="field 'output.map'"):
        t.check_warmup(subject, 4, {"anomaly_map": np.zeros((4, 1, 9, 8), np.float32)})


def test_find_regions_boxes_areas_peaks_masks():
    hit = np.zeros((6, 8), bool)
    hit[1:3, 1:4] = True
    hit[5, 7] = True
    scores = np.arange(48, dtype=np.float32).reshape(6, 8)
    big, small = find_regions(hit, scores, masks=True)
    assert (big.box, big.area, big.peak) == ((1, 1, 4, 3), 6, float(scores[2, 3]))
    assert (small.box, small.area) == ((7, 5, 8, 6), 1)
    assert big.mask is not None and big.mask.shape == (2, 3) and big.mask.all()
    assert find_regions(np.zeros((4, 4), bool)) == []


def test_inside_takes_pixel_centres():
    m = inside(np.ones((4, 8), bool), [np.array([[0, 0], [4, 0], [4, 2], [0, 2]], float)])
    assert m[:2, :4].all() and not m[2:].any() and not m[:, 4:].any()
