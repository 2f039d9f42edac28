"""Drawing a stored answer on its captured image (visionserve.records.overlay): a detector's
boxes, a segmenter's masks, an anomaly model's heat map (kept compact in the sidecar), the
thumbnail sizes, and a raw ``.npy`` frame served as PNG."""

from __future__ import annotations

import io
import json

import cv2
import numpy as np

from visionserve.records.images import Stored
from visionserve.records.overlay import draw, render
from visionserve.records.record import Record
from visionserve.tasks import annotate
from visionserve.tasks.segmentation import rle


def _frame(w: int = 320, h: int = 240) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.dstack([(x * 200 // w) + 20, (y * 200 // h) + 20, np.full_like(x, 90)]
                     ).astype(np.uint8)


def _record(result: dict, verdict: str = "NG") -> Record:
    return Record(1.8e9, "P-1", None, None, "m", "1", None, verdict, "spot", 0.9, result,
                  {"total_ms": 2.0}, "r1", image="2027-01-15/P-1.0123456789ab.png")


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16)).sum(axis=2) > 40


def test_a_segmenters_mask_is_tinted_and_its_box_drawn():
    img = _frame()
    mask = np.zeros(img.shape[:2], bool)
    mask[150:200, 200:280] = True
    result = {"detections": [{"label": "spot", "score": 0.9, "box": [200, 150, 280, 200],
                              "mask": rle(mask)}],
              "reasons": [{"rule": "defect:spot", "message": "1 spot found", "detections": [0]}]}
    drawn = img.copy()
    draw(drawn, _record(result), {})
    changed = _changed(img, drawn)
    assert changed[160:190, 210:270].mean() > 0.9  # inside the mask: tinted
    assert not changed[60:130, 20:180].any()  # elsewhere (below the banner): untouched


def test_a_thumbnail_scales_the_boxes_with_the_frame():
    img = _frame(640, 480)
    _, png = cv2.imencode(".png", img)
    result = {"detections": [{"label": "scratch", "score": 0.8, "box": [400, 300, 560, 420]}],
              "reasons": []}
    body, media = render(Stored(png.tobytes(), "png", b""), _record(result), overlay=True,
                         size=320)
    thumb = cv2.imdecode(np.frombuffer(body, np.uint8), cv2.IMREAD_COLOR)
    assert media == "image/jpeg" and thumb.shape == (240, 320, 3)
    plain = cv2.resize(img, (320, 240), interpolation=cv2.INTER_AREA)
    changed = _changed(plain, thumb)
    assert changed[150:210, 200].mean() > 0.8  # the box's left edge, at half the coordinates
    assert not changed[120:140, 20:180].any()


def test_an_anomaly_heat_map_kept_compact_is_drawn_over_the_frame():
    score = np.zeros((480, 640), np.float32)
    score[200:300, 300:450] = 1.0
    kept = annotate.compact_heat(score)
    assert len(json.dumps(kept)) < 10_000
    back = annotate.expand_heat(kept, 640, 480)
    assert back.shape == (480, 640) and back[250, 375] > 0.9 and back[50, 50] < 0.05
    img = _frame(640, 480)
    _, png = cv2.imencode(".png", img)
    side = json.dumps({"drawing": {"heat_map": kept}}).encode()
    record = _record({"regions": [{"box": [300, 200, 450, 300], "area": 15000, "peak": 1.0}],
                      "reasons": ["image score 1.0 >= image_threshold 0.5"]})
    body, _ = render(Stored(png.tobytes(), "png", side), record, overlay=True)
    drawn = cv2.imdecode(np.frombuffer(body, np.uint8), cv2.IMREAD_COLOR)
    assert _changed(img, drawn).mean() > 0.5  # the map tints the whole frame
    # a damaged sidecar costs the heat map only
    body, _ = render(Stored(png.tobytes(), "png", b"{not json"), record, overlay=True)
    assert cv2.imdecode(np.frombuffer(body, np.uint8), cv2.IMREAD_COLOR).shape == img.shape


def test_the_image_alone_is_the_stored_file_and_a_raw_frame_is_png():
    img = _frame()
    _, jpg = cv2.imencode(".jpg", img)
    assert render(Stored(jpg.tobytes(), "jpg", b""), _record({}), overlay=False) == \
        (jpg.tobytes(), "image/jpeg")
    buf = io.BytesIO()
    np.save(buf, img[:, :, ::-1], allow_pickle=False)  # raw frames are RGB
    body, media = render(Stored(buf.getvalue(), "npy", b""), _record({}), overlay=False)
    assert media == "image/png"
    assert np.array_equal(cv2.imdecode(np.frombuffer(body, np.uint8), cv2.IMREAD_COLOR), img)
    grey = io.BytesIO()
    np.save(grey, img[:, :, 0], allow_pickle=False)
    body, media = render(Stored(grey.getvalue(), "npy", b""), _record({}), overlay=True, size=64)
    assert media == "image/jpeg"


def test_reasons_read_the_tasks_kept_reasons_or_the_error():
    assert _record({"reasons": [{"message": "1 spot found"}]}).reasons() == ["1 spot found"]
    assert _record({"reasons": ["image score 0.9"]}).reasons() == ["image score 0.9"]
    assert _record({"label": "ok"}).reasons() == []
    late = Record(1.8e9, "P", None, None, "m", "1", None, "LATE", None, None, None, {}, "r",
                  error="deadline: too late")
    assert late.reasons() == ["deadline: too late"]
