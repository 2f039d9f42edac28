"""Detectors served by a real ``visionserve serve``, held to an independent reference (issue 17).

Each model is a ``model.toml`` and an ONNX file exported here with plain torch
(``tests/tools/detmodels.py``): every output format (``yolo`` [B, 4+nc, A] and its transpose,
``yolo-objectness``, ``end2end``, ``boxes`` with a count) and every resize (letterbox, stretch,
centre crop), with frames of other sizes and aspects than the models' inputs. What the server
answers over the inspect API, OIP HTTP in JSON and in the binary extension (tritonclient.http)
and gRPC (tritonclient.grpc) must equal what ``tests/tools/detref.py`` computes from the same
ONNX file with onnxruntime, torchvision's NMS and its own decoding and geometry:

- the same objects: same count, each with the same class;
- boxes within :data:`BOX_TOL` frame pixels (the inspect API rounds to 0.01 px; the reference
  and the server run the same file, so anything larger is a decoding or geometry fault: a
  letterbox offset off by half a model pixel moves a box by several frame pixels here);
- scores within :data:`SCORE_TOL`.

Also: a model.toml that does not fit its model is refused at load with the model, the output and
the expected and actual shapes named; a frame with nothing in it is a normal answer; degenerate
boxes from a model, and boxes wholly in the letterbox padding, are dropped (and counted), never
a 500 or a box of no size; a JPEG's EXIF orientation is ignored, so boxes are in its stored
pixels.
"""

from __future__ import annotations

import base64
import re
import signal
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server

from tests.tools import detmodels as dm
from tests.tools import detref, jpegs
from tests.tools.detmodels import FRAMES, MEDIA, decoded, encoded

BOX_TOL = 0.1  # frame pixels
SCORE_TOL = 1e-4
#: det-padding answers only the frame made for it (test_boxes_in_the_letterbox_padding_...)
MODELS = [m for m in dm.DETECTORS if m != "det-padding"]
OIP = ("num_detections", "detection_boxes", "detection_scores", "detection_classes")

@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = dm.make_repo(tmp_path_factory.mktemp("detrepo"), [*MODELS, "det-padding"])
    # det-yolo with a rule: objects in the frame's top-left quarter (480x320 frames) don't count
    excl = root / "det-yolo-exclude"
    dm.make("det-yolo", excl)
    excl.joinpath("model.toml").write_text(excl.joinpath("model.toml").read_text() + EXCLUDE)
    return root


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    s = start_server(repo, tmp_path_factory.mktemp("detsrv"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(repo):
    """``expected(model, frame)`` -> the reference's objects (computed once each)."""
    return dm.expectations(repo, [*MODELS, "det-padding"])


def check(want: list[detref.Det], got: list[dict]) -> None:
    assert len(got) == len(want), f"expected {len(want)} objects, served {len(got)}"
    detref.match(want, got, box_tol=BOX_TOL, score_tol=SCORE_TOL)
    scores = [g["score"] for g in got]
    assert scores == sorted(scores, reverse=True), "detections not highest score first"


def from_oip(arrays: dict[str, np.ndarray], i: int, labels: tuple[str, ...]) -> list[dict]:
    """Frame ``i``'s detections from the EfficientNMS-style tensors; rows past the count zero."""
    n = int(arrays["num_detections"][i])
    boxes, scores = arrays["detection_boxes"][i], arrays["detection_scores"][i]
    classes = arrays["detection_classes"][i]
    assert not boxes[n:].any() and not scores[n:].any() and not classes[n:].any()
    return [{"label": labels[int(classes[j])], "score": float(scores[j]),
             "box": boxes[j].tolist()} for j in range(n)]


def labels_of(model: str) -> tuple[str, ...]:
    return dm.LABELS


# --- the models and the reference agree with the drawing --------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_the_reference_finds_the_drawn_rectangles(expected, model):
    """Not the server: a check that the test models and the reference do what the frames are
    drawn for, so that the comparisons below compare something. The best object of each colour
    lies mostly on its rectangle (a centre crop cuts the blue one; the boxes model counts only
    its best few); the empty frame has none."""
    w, h, rects, _ = FRAMES["landscape"]
    dets = expected(model, "landscape")
    if model == "det-boxes":
        rects = [r for r in rects if any(d.label == r[0] for d in dets)]
        assert len(rects) >= 2
    for label, x1, y1, x2, y2 in rects:
        b = max((d for d in dets if d.label == label), key=lambda d: d.score).box
        inter = max(0, min(b[2], x2 * w) - max(b[0], x1 * w)) * \
            max(0, min(b[3], y2 * h) - max(b[1], y1 * h))
        assert inter >= 0.4 * (b[2] - b[0]) * (b[3] - b[1]), (label, b)
    assert expected(model, "empty") == []
    assert expected(model, "small") != []


def test_nms_has_work_to_do_and_the_class_agnostic_model_does_it_across_classes(expected):
    ref = expected.refs["det-yolo"]
    boxes, scores, classes, _ = ref.candidates(ref.raw([decoded("landscape")]), 0)
    passing = detref.select(boxes, scores, classes, threshold=0.3, iou=None, top_k=10_000)
    kept = detref.select(boxes, scores, classes, threshold=0.3, iou=0.45, top_k=10_000)
    assert len(passing) - len(kept) >= 10
    ref = expected.refs["det-objectness"]
    boxes, scores, classes, _ = ref.candidates(ref.raw([decoded("touching")]), 0)
    aware = detref.select(boxes, scores, classes, threshold=0.3, iou=0.45, top_k=300)
    agnostic = detref.select(boxes, scores, classes, threshold=0.3, iou=0.45, agnostic=True,
                             top_k=300)
    assert len(agnostic) < len(aware) < 300
    assert [d.score for d in expected("det-objectness", "touching")] == scores[agnostic].tolist()


def test_the_boxes_model_has_rows_past_its_count_that_would_pass_the_threshold(expected):
    """So a server that read past ``num`` would answer more than the reference."""
    ref = expected.refs["det-boxes"]
    out = ref.raw([decoded("landscape")])
    n = int(out["num"][0])
    assert n < out["scores"].shape[1] and (out["scores"][0, n:] >= 0.3).any()


# --- the same answers over every protocol ----------------------------------------------------

@pytest.mark.parametrize("frame", list(FRAMES))
@pytest.mark.parametrize("model", MODELS)
def test_inspect_api(server, expected, model, frame):
    r = httpx.post(f"{server.url}/v1/models/{model}/inspect", content=encoded(frame),
                   headers={"Content-Type": MEDIA[FRAMES[frame][3]], "X-Part-Id": frame},
                   timeout=30)
    assert r.status_code == 200, r.text
    a = r.json()
    want = expected(model, frame)
    check(want, a["detections"])
    for d in a["detections"]:
        assert dm.LABELS[d["class"]] == d["label"]
        x1, y1, x2, y2 = d["box"]
        assert d["area"] == pytest.approx((x2 - x1) * (y2 - y1), rel=1e-3, abs=0.5)
    # no [verdict] section: every label is a defect, so any object makes the part NG
    assert a["verdict"] == ("NG" if want else "OK") and a["part_id"] == frame
    assert {x["rule"] for x in a["reasons"]} == {f"defect:{d.label}" for d in want}


@pytest.mark.parametrize("model", MODELS)
def test_oip_http_json(server, expected, model):
    """All frames in one request (mixed sizes in one batch: each keeps its own geometry)."""
    req = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(FRAMES)],
                       "data": [base64.b64encode(b).decode() for b in dm.encoded_frames()]}]}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=req, timeout=60)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert list(out) == [*OIP, "reasons", "verdict"]
    k = next(o for o in out.values() if o["name"] == "detection_scores")["shape"][1]
    n = len(FRAMES)
    assert out["detection_boxes"]["shape"] == [n, k, 4]
    assert (out["num_detections"]["datatype"], out["detection_classes"]["datatype"]) == \
        ("INT32", "INT32")
    arrays = {name: np.asarray(out[name]["data"]).reshape(out[name]["shape"]) for name in OIP}
    for i, frame in enumerate(FRAMES):
        check(expected(model, frame), from_oip(arrays, i, labels_of(model)))
    verdicts = out["verdict"]["data"]
    assert verdicts == ["NG" if expected(model, f) else "OK" for f in FRAMES]


@pytest.mark.parametrize("model", MODELS)
def test_oip_http_binary_with_tritonclient(server, expected, model):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        inp = httpclient.InferInput("image", [len(FRAMES)], "BYTES")
        inp.set_data_from_numpy(np.array(dm.encoded_frames(), dtype=object), binary_data=True)
        res = client.infer(model, [inp], outputs=[
            httpclient.InferRequestedOutput(n, binary_data=True) for n in (*OIP, "verdict")])
        arrays = {n: res.as_numpy(n) for n in OIP}
        assert arrays["detection_boxes"].dtype == np.float32
        for i, frame in enumerate(FRAMES):
            check(expected(model, frame), from_oip(arrays, i, labels_of(model)))
    finally:
        client.close()


@pytest.mark.parametrize("model", MODELS)
def test_grpc(server, expected, model):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inp = grpcclient.InferInput("image", [len(FRAMES)], "BYTES")
        inp.set_data_from_numpy(np.array(dm.encoded_frames(), dtype=object))
        res = client.infer(model, [inp])
        arrays = {n: res.as_numpy(n) for n in OIP}
        for i, frame in enumerate(FRAMES):
            check(expected(model, frame), from_oip(arrays, i, labels_of(model)))
        verdicts = [v.decode() for v in res.as_numpy("verdict")]
        assert verdicts == ["NG" if expected(model, f) else "OK" for f in FRAMES]
    finally:
        client.close()


@pytest.mark.parametrize("model", ["det-yolo", "det-objectness"])
def test_raw_rgb_frames(server, expected, model):
    """UINT8 NHWC RGB pixels (no codec) over gRPC: the same boxes as the encoded frames'."""
    names = ["landscape", "touching"]
    frames = [cv2.resize(decoded(f), (400, 300), interpolation=cv2.INTER_NEAREST) for f in names]
    ref = expected.refs[model]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        pixels = np.stack([cv2.cvtColor(f, cv2.COLOR_BGR2RGB) for f in frames])
        inp = grpcclient.InferInput("image", list(pixels.shape), "UINT8")
        inp.set_data_from_numpy(pixels)
        res = client.infer(model, [inp])
        arrays = {n: res.as_numpy(n) for n in OIP}
        for i, f in enumerate(frames):
            want = ref(f)
            assert want
            check(want, from_oip(arrays, i, labels_of(model)))
    finally:
        client.close()


def test_model_metadata_and_config(server):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        md = client.get_model_metadata("det-yolo")
        assert md["outputs"] == [
            {"name": "num_detections", "datatype": "INT32", "shape": [-1]},
            {"name": "detection_boxes", "datatype": "FP32", "shape": [-1, 40, 4]},
            {"name": "detection_scores", "datatype": "FP32", "shape": [-1, 40]},
            {"name": "detection_classes", "datatype": "INT32", "shape": [-1, 40]},
            {"name": "reasons", "datatype": "BYTES", "shape": [-1]},
            {"name": "verdict", "datatype": "BYTES", "shape": [-1]}]
        params = client.get_model_config("det-yolo")["parameters"]
        assert params["labels"] == {"string_value": "red,green,blue"}
        assert params["format"] == {"string_value": "yolo"}
    finally:
        client.close()


# --- bad input -------------------------------------------------------------------------------

def test_a_frame_with_nothing_in_it_is_a_normal_answer(server):
    for model in MODELS:
        r = httpx.post(f"{server.url}/v1/models/{model}/inspect", content=encoded("empty"),
                       headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200, r.text
        a = r.json()
        assert (a["verdict"], a["detections"], a["reasons"]) == ("OK", [], [])


#: the degenerate model's broken anchors are the top row's first three 8x8 windows; a frame of
#: the model's aspect (no letterbox pad) with red there makes them score
DEGENERATE_FRAME = dm.scene(480, 320, [("red", 0.0, 0.0, 0.3, 0.2), ("blue", 0.6, 0.5, 0.9, 0.9)])


def test_degenerate_boxes_are_dropped_and_counted(server, expected):
    ref = expected.refs["det-degenerate"]
    boxes, scores, _, _ = ref.candidates(ref.raw([DEGENERATE_FRAME]), 0)
    broken = ~detref.valid(boxes, scores) & (scores >= 0.3)
    assert sorted(np.nonzero(broken)[0].tolist()) == sorted(dm.DEGENERATE)  # they would pass
    want = ref(DEGENERATE_FRAME)
    png = cv2.imencode(".png", DEGENERATE_FRAME)[1]
    r = httpx.post(f"{server.url}/v1/models/det-degenerate/inspect", content=png.tobytes(),
                   headers={"Content-Type": "image/png"}, timeout=30)
    assert r.status_code == 200, r.text
    got = r.json()["detections"]
    for d in got:
        x1, y1, x2, y2 = d["box"]
        assert all(np.isfinite(d["box"])) and x2 > x1 and y2 > y1
    check(want, got)
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    m = re.search(r'^visionserve_degenerate_boxes_total\{model="det-degenerate"\} (\S+)$',
                  metrics, re.MULTILINE)
    assert m is not None and float(m[1]) >= len(dm.DEGENERATE), \
        "degenerate boxes not counted in /metrics"


#: a frame whose left half is red, letterboxed by the 96x64 det-padding into x = 32..64: its
#: windows at x = 32..40 score highest and their boxes lie wholly in the padding to the left
PADDING_FRAME = dm.scene(240, 480, [("red", 0.0, 0.05, 0.5, 0.95), ("blue", 0.6, 0.3, 0.95, 0.6)])


def degenerate_count(server, model: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    m = re.search(rf'^visionserve_degenerate_boxes_total\{{model="{model}"\}} (\S+)$', metrics,
                  re.MULTILINE)
    return float(m[1]) if m is not None else 0.0


def test_boxes_in_the_letterbox_padding_are_dropped_and_counted(server, expected):
    """Clipped to the frame, such a box has no width: it is dropped and counted, not answered
    as a box of no size, and it takes no place among the frame's detections."""
    ref = expected.refs["det-padding"]
    boxes, scores, _, _ = ref.candidates(ref.raw([PADDING_FRAME]), 0)
    outside = (boxes[:, 2] <= dm.ESCAPE_X) & (scores >= 0.3)  # the frame starts at x = 32
    assert outside.sum() >= 5 and scores[outside].max() == scores.max()  # the best of all
    want = ref(PADDING_FRAME)
    assert want and all(d.box[2] > d.box[0] and d.box[3] > d.box[1] for d in want)
    before = degenerate_count(server, "det-padding")
    png = cv2.imencode(".png", PADDING_FRAME)[1]
    r = httpx.post(f"{server.url}/v1/models/det-padding/inspect", content=png.tobytes(),
                   headers={"Content-Type": "image/png"}, timeout=30)
    assert r.status_code == 200, r.text
    got = r.json()["detections"]
    for d in got:
        x1, y1, x2, y2 = d["box"]
        assert x2 > x1 and y2 > y1 and d["area"] > 0, d
        assert 0 <= x1 and x2 <= 240 and 0 <= y1 and y2 <= 480, d
    check(want, got)
    assert degenerate_count(server, "det-padding") - before == outside.sum()


#: det-yolo-exclude's rule: what lies in the top-left quarter of a 480x320 frame is excluded
EXCLUDE = "[verdict]\nexclude = [[[0, 0], [240, 0], [240, 160], [0, 160]]]\n"
#: a 480x320 scene with one red part in its top-left quarter
EXIF_SCENE = dm.scene(480, 320, [("red", 0.1, 0.1, 0.35, 0.4)])


def test_exif_orientation_is_ignored_boxes_are_in_the_stored_pixels(server, expected):
    """The same scene as a JPEG whose pixels were turned (what a camera that rotates writes), and
    as the unturned JPEG tagged EXIF Orientation=6 ("turn to view"): the tagged one is answered
    on its stored pixels, exactly as the untagged file, in the width and height of its header;
    the turned one on its own pixels. An exclusion zone (frame pixels) therefore judges each by
    where its object is in the pixels the answer states."""
    plain = jpegs.baseline(EXIF_SCENE)
    tagged = jpegs.with_orientation(plain, 6)
    turned = jpegs.baseline(cv2.rotate(EXIF_SCENE, cv2.ROTATE_90_CLOCKWISE))

    def inspect(model, body):
        r = httpx.post(f"{server.url}/v1/models/{model}/inspect", content=body,
                       headers={"Content-Type": "image/jpeg"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    stored = cv2.imdecode(np.frombuffer(plain, np.uint8), cv2.IMREAD_COLOR)
    want = expected.refs["det-yolo"](stored)
    assert want and all(d.label == "red" for d in want)
    a_plain, a_tagged = inspect("det-yolo", plain), inspect("det-yolo", tagged)
    check(want, a_tagged["detections"])
    assert a_tagged["detections"] == a_plain["detections"]
    assert a_tagged["frame"] == a_plain["frame"] == {"width": 480, "height": 320}
    for d in a_tagged["detections"]:  # in the 480x320 of the header, on the red part
        x1, y1, x2, y2 = d["box"]
        assert 0 <= x1 < x2 <= 480 and 0 <= y1 < y2 <= 320
    best = a_tagged["detections"][0]["box"]
    assert best[2] <= 240 and best[3] <= 160, best  # the top-left quarter
    turned_px = cv2.imdecode(np.frombuffer(turned, np.uint8), cv2.IMREAD_COLOR)
    assert turned_px.shape[:2] == (480, 320)
    a_turned = inspect("det-yolo", turned)
    assert a_turned["frame"] == {"width": 320, "height": 480}
    check(expected.refs["det-yolo"](turned_px), a_turned["detections"])
    # the rule: the object lies in the zone in the stored pixels of plain and tagged; the turned
    # frame holds it in its top-right corner (x 208..288 of 320), outside the zone
    verdicts = [inspect("det-yolo-exclude", b)["verdict"] for b in (plain, tagged, turned)]
    assert verdicts == ["OK", "OK", "NG"]


# a model.toml that does not fit its model: (model file, [output] lines, labels, task,
# the field / output named, expected, actual)
MISFITS = {
    "wrong rank": ("seg-semantic", 'format = "yolo"', dm.LABELS, "detection",
                   "output.tensor_name", "[N, 7, A] or [N, A, 7]", "[N, 4, 32, 48]"),
    "one label too many": ("det-yolo", 'format = "yolo"', (*dm.LABELS, "white"), "detection",
                           "output.labels", "8 values per anchor", "[N, 7, 414]"),
    "objectness, one label short": ("det-objectness", 'format = "yolo-objectness"',
                                    dm.LABELS[:2], "detection", "output.labels",
                                    "7 values per anchor", "[N, 414, 8]"),
    "end2end on a raw head": ("det-yolo", 'format = "end2end"', dm.LABELS, "detection",
                              "output.tensor_name", "[N, K, 6]", "[N, 7, 414]"),
    "boxes without its count": ("det-boxes", 'format = "boxes"\ncount_tensor = "count"',
                                dm.LABELS, "detection", "output.count_tensor", "count",
                                "['boxes', 'scores', 'classes', 'num']"),
}


@pytest.mark.parametrize("case", list(MISFITS))
async def test_a_model_toml_that_does_not_fit_the_model_is_refused_at_load(tmp_path, case):
    from visionserve.config import ServerSettings
    from visionserve.engine import Engine
    from visionserve.errors import ConfigError

    source, output, labels, task, field, want, got = MISFITS[case]
    dm.make(source, tmp_path / "misfit", output=output, labels=labels, task=task)
    eng = Engine(ServerSettings(models=tmp_path), device="cpu")
    try:
        with pytest.raises(ConfigError) as info:
            await eng.start()
    finally:
        await eng.close()
    msg = info.value.message
    assert "model misfit" in msg and f"field '{field}'" in msg, msg
    assert want in msg and got in msg, msg


def test_the_server_refuses_to_start_on_a_misfit_and_says_why(tmp_path):
    dm.make("det-yolo", tmp_path / "models" / "misfit", labels=(*dm.LABELS, "white"))
    s = start_server(tmp_path / "models", tmp_path, grpc=False, wait=False)
    try:
        rc = s.proc.wait(120)
    finally:
        s.stop(signal.SIGKILL)
    assert rc != 0
    log = s.log()
    assert "misfit" in log and "output.labels" in log and "[N, 7, 414]" in log, log[-2000:]


def test_answers_cross_the_front_end_process_unchanged(repo, expected, server_factory):
    """With --frontends, answers are made in the engine's process and rendered in another."""
    s = server_factory(repo, "--frontends", "1")
    client = grpcclient.InferenceServerClient(s.grpc_url)
    try:
        for model in ("det-yolo", "det-boxes"):
            r = httpx.post(f"{s.url}/v1/models/{model}/inspect", content=encoded("portrait"),
                           headers={"Content-Type": "image/png"}, timeout=30)
            assert r.status_code == 200, r.text
            check(expected(model, "portrait"), r.json()["detections"])
            inp = grpcclient.InferInput("image", [len(FRAMES)], "BYTES")
            inp.set_data_from_numpy(np.array(dm.encoded_frames(), dtype=object))
            res = client.infer(model, [inp])
            arrays = {n: res.as_numpy(n) for n in OIP}
            for i, frame in enumerate(FRAMES):
                check(expected(model, frame), from_oip(arrays, i, labels_of(model)))
    finally:
        client.close()
