"""Each task's ``rejudge`` (the verdict preview) against its own ``postprocess``: a kept answer
judged again under new ``[verdict]`` values gets the verdict the same outputs get under them;
an anomaly answer's regions are found again on its kept map; where the rule needs outputs the
answer does not keep, it says so (Unjudgeable)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit import test_task_anomaly as anomaly
from tests.unit import test_task_detection as detection
from visionserve.backends.checks import TensorSpec
from visionserve.tasks.base import Unjudgeable


@pytest.mark.parametrize("new", [{"image_threshold": 0.35}, {"image_threshold": 0.85},
                                 {"image_threshold": 1.0, "min_region_area": 4000},
                                 {"image_threshold": 1.0, "min_region_area": 12000}])
def test_anomaly_judged_again_as_served(new):
    maps = [anomaly.blob(v) for v in (0.3, 0.4, 0.6, 0.9)] + [anomaly.blob(0.9, x=slice(2, 12))]
    sizes = [(640, 480)] * len(maps)
    old = anomaly.make({"image_threshold": 0.5, "min_region_area": 9000})
    kept = old.postprocess(anomaly.batch(*maps), slice(0, len(maps)), sizes)
    now = anomaly.make({"image_threshold": 0.5, **new})
    want = [v for v, _ in now.postprocess(anomaly.batch(*maps), slice(0, len(maps)), sizes)]
    assert set(want) == {"OK", "NG"}
    assert [old.rejudge(r, old.config, now.config) for _, r in kept] == want


@pytest.mark.parametrize("new", [{"pixel_threshold": 0.7}, {"pixel_threshold": 0.35},
                                 {"roi": [[[0, 0], [200, 0], [200, 200], [0, 200]]]},
                                 {"area_unit": "mm2", "pixels_per_mm": 2.0,
                                  "min_region_area": 2000}])
def test_anomaly_regions_are_found_again_on_the_kept_map(new):
    """Settings that change which map pixels form regions: the kept map (and the frame's
    geometry) gives the verdict the model's outputs would get under them, with no new run."""
    maps = [anomaly.blob(v) for v in (0.3, 0.45, 0.6, 0.9)] + [anomaly.blob(0.9, x=slice(2, 12))]
    sizes = [(640, 480), (1280, 720), (640, 480), (320, 240), (640, 480)]
    base = {"image_threshold": 1.0, "pixel_threshold": 0.5, "min_region_area": 9000}
    old = anomaly.make(base)
    kept = old.postprocess(anomaly.batch(*maps), slice(0, len(maps)), sizes)
    now = anomaly.make({**base, **new})
    want = [v for v, _ in now.postprocess(anomaly.batch(*maps), slice(0, len(maps)), sizes)]
    assert [old.rejudge(r, old.config, now.config) for _, r in kept] == want
    if new == {"pixel_threshold": 0.7}:  # a higher threshold: the blobs' regions shrink
        assert want != [v for v, _ in kept], want


def test_an_answer_without_its_frame_geometry_is_unjudgeable_for_region_settings():
    from dataclasses import replace

    old = anomaly.make({"image_threshold": 0.5, "pixel_threshold": 0.5})
    (_, r), = old.postprocess(anomaly.batch(anomaly.blob(0.9)), slice(0, 1))
    now = anomaly.make({"image_threshold": 0.5, "pixel_threshold": 0.7})
    with pytest.raises(Unjudgeable, match="pixel_threshold"):
        old.rejudge(replace(r, frame=None), old.config, now.config)


@pytest.mark.parametrize("new", [{"defects": {"a": {"min_score": 0.97}}},
                                 {"count": [{"label": "b", "at_least": 5}]},
                                 {"defects": {"a": {}}, "roi": [[[0, 0], [30, 0], [30, 30],
                                                                 [0, 30]]]},
                                 {"defects": {"b": {"min_area_px": 300}}}])
def test_detection_judged_again_as_served(new):
    x = detection.yolo_head(np.random.default_rng(5), batch=6)
    spec = [TensorSpec("out", (detection.N, 6, 12), "float32")]
    output = {"format": "yolo", "labels": ["a", "b"], "score_threshold": 0.2}
    old = detection.make(output)
    old.bind(detection.SUBJECT, spec)
    kept = old.postprocess({"out": x}, slice(0, 6))
    now = detection.make(output, new)
    now.bind(detection.SUBJECT, spec)
    want = [v for v, _ in now.postprocess({"out": x}, slice(0, 6))]
    assert set(want) == {"OK", "NG"}  # the change decides some frames each way
    assert [old.rejudge(r, old.config, now.config) for _, r in kept] == want
