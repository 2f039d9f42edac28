"""Segmenters served by a real ``visionserve serve``, held to an independent reference (issue 17).

The models (``tests/tools/detmodels.py``): a YOLO-seg model (head ``[B, 4+nc+32, A]`` and
prototypes ``[B, 32, H/4, W/4]``, letterboxed) and semantic models (logits ``[B, 1+nc, H/2,
W/2]``, letterboxed and centre-cropped), each a ``model.toml`` and an ONNX file exported here.
The frames are those of the detection tests. ``tests/tools/detref.py`` computes the expected
objects from the same ONNX file with onnxruntime and its own code:

- YOLO-seg: boxes, classes and scores as a detector's (:data:`BOX_TOL` frame pixels,
  :data:`SCORE_TOL`); each mask is ``sigmoid(coefficients @ prototypes)`` sampled onto the
  frame bilinearly, thresholded at 0.5 and cut to the box: the frame pixels whose centres lie
  in the box.
- semantic: the logits sampled onto the frame bilinearly, each pixel its best class, the
  8-connected regions of every class but the background; a region's score is its class's
  highest probability inside it, its box that of its pixels.

Every protocol (inspect API, OIP HTTP JSON and binary, gRPC) carries the masks as COCO RLE
(``detection_masks`` holds the ``counts`` of a frame-sized mask); they are decoded here with
detref's own decoder.

Masks are held to the reference pixel for pixel (IoU >= MASK_IOU): YOLO-seg masks cut to the
pixels whose centres lie in the box, semantic maps resized to the frame before each pixel takes
its best class, and nothing outside what a centre crop kept.
"""

from __future__ import annotations

import base64
import math
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server

from tests.tools import detmodels as dm
from tests.tools import detref
from tests.tools.detmodels import FRAMES, MEDIA, encoded
from visionserve.config import InputSpec

BOX_TOL = 0.1  # frame pixels, YOLO-seg boxes
SCORE_TOL = 1e-4
MASK_IOU = 0.98
MODELS = list(dm.SEGMENTERS)
OIP = ("num_detections", "detection_boxes", "detection_scores", "detection_classes",
       "detection_masks")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return dm.make_repo(tmp_path_factory.mktemp("segrepo"), MODELS)


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    s = start_server(repo, tmp_path_factory.mktemp("segsrv"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(repo):
    """``expected(model, frame)`` -> the reference's objects (computed once each)."""
    return dm.expectations(repo, MODELS)


def semantic(model: str) -> bool:
    return dm.SEGMENTERS[model][0] == "semantic"


def labels_of(model: str) -> tuple[str, ...]:
    return dm.SEMANTIC_LABELS if semantic(model) else dm.LABELS


def map_pixel(model: str, frame: str) -> float:
    """The side of one class-map pixel (half the model's resolution) in frame pixels."""
    _, width, height, resize, _ = dm.SEGMENTERS[model]
    spec = InputSpec(width=width, height=height, resize=resize)
    place = detref.Placement.of(spec, *FRAMES[frame][:2])
    return 2 / min(place.kx, place.ky)


def touched(box, width: int, height: int) -> np.ndarray:
    """The frame pixels a box (x1, y1, x2, y2) touches at all."""
    x1, y1 = int(np.clip(math.floor(box[0]), 0, width)), int(np.clip(math.floor(box[1]), 0, height))
    x2, y2 = int(np.clip(math.ceil(box[2]), 0, width)), int(np.clip(math.ceil(box[3]), 0, height))
    out = np.zeros((height, width), bool)
    out[y1:y2, x1:x2] = True
    return out


def band(mask: np.ndarray, r: int) -> np.ndarray:
    """The pixels within ``r`` of the border of ``mask`` (either side)."""
    k = np.ones((2 * r + 1, 2 * r + 1), np.uint8)
    m = mask.astype(np.uint8)
    return (cv2.dilate(m, k) > 0) & ~(cv2.erode(m, k, borderType=cv2.BORDER_REPLICATE) > 0)


def check(model: str, frame: str, want: list[detref.Det], got: list[dict]) -> None:
    """Served objects (label, score, box, mask as a decoded bool array) against the reference:
    count, classes, scores; boxes and masks as close as the known differences allow (see the
    module's docstring)."""
    w, h = FRAMES[frame][:2]
    assert len(got) == len(want), f"expected {len(want)} objects, served {len(got)}"
    scores = [g["score"] for g in got]
    assert scores == sorted(scores, reverse=True), "objects not highest score first"
    for g in got:
        assert g["mask"].shape == (h, w)
    if semantic(model):
        r = math.ceil(map_pixel(model, frame))
        pairs = detref.match(want, got, box_tol=r, score_tol=SCORE_TOL)
        for e, g in pairs:
            stray = (g["mask"] ^ e.mask) & ~band(e.mask, r)
            assert not stray.any(), f"{e.label}: {int(stray.sum())} pixels differ away " \
                f"from the region's border"
        return
    for e, g in detref.match(want, got, box_tol=BOX_TOL, score_tol=SCORE_TOL):
        inside = detref.crop_to_box(g["mask"], e.box)
        assert detref.iou(inside, e.mask) >= MASK_IOU, \
            f"{e.label} {e.score:.4f}: mask IoU {detref.iou(inside, e.mask):.4f} within the box"
        slack = np.array([-BOX_TOL, -BOX_TOL, BOX_TOL, BOX_TOL])  # the box as sent is rounded
        outside = g["mask"] & ~touched(np.asarray(g["box"]) + slack, w, h)
        assert not outside.any(), f"{e.label}: mask pixels outside the box"


def from_inspect(answer: dict) -> list[dict]:
    out = []
    for d in answer["detections"]:
        mask = detref.rle_decode(d["mask"])
        assert d["area"] == pytest.approx(mask.sum()), "area is not the mask's"
        out.append({**d, "mask": mask})
    return out


def from_oip(arrays: dict[str, np.ndarray], i: int, model: str, frame: str) -> list[dict]:
    w, h = FRAMES[frame][:2]
    n = int(arrays["num_detections"][i])
    labels = labels_of(model)
    masks = arrays["detection_masks"][i]
    assert all(m in (b"", "") for m in masks[n:])
    assert not arrays["detection_boxes"][i, n:].any()
    out = []
    for j in range(n):
        counts = masks[j].decode() if isinstance(masks[j], bytes) else masks[j]
        out.append({"label": labels[int(arrays["detection_classes"][i, j])],
                    "score": float(arrays["detection_scores"][i, j]),
                    "box": arrays["detection_boxes"][i, j].tolist(),
                    "mask": detref.rle_decode({"size": [h, w], "counts": counts})})
    return out


def inspect(server, model: str, frame: str) -> dict:
    r = httpx.post(f"{server.url}/v1/models/{model}/inspect", content=encoded(frame),
                   headers={"Content-Type": MEDIA[FRAMES[frame][3]]}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# --- the models and the reference agree with the drawing --------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_the_reference_finds_the_drawn_rectangles(expected, model):
    """Not the server: the test models and the reference do what the frames are drawn for. Each
    colour's best object is a mask mostly on its rectangle; the empty frame has none."""
    w, h, rects, _ = FRAMES["portrait"]
    dets = expected(model, "portrait")
    for label, x1, y1, x2, y2 in rects:
        best = max((d for d in dets if d.label == label), key=lambda d: d.score)
        drawn = np.zeros((h, w), bool)
        drawn[round(y1 * h):round(y2 * h), round(x1 * w):round(x2 * w)] = True
        assert best.mask is not None and best.mask.sum() > 500
        assert (best.mask & drawn).sum() >= 0.8 * best.mask.sum(), label
    if semantic(model):
        assert sorted(d.label for d in dets) == ["blue", "green", "red"]
    assert expected(model, "empty") == []


# --- the same answers over every protocol ----------------------------------------------------

@pytest.mark.parametrize("frame", list(FRAMES))
@pytest.mark.parametrize("model", MODELS)
def test_inspect_api(server, expected, model, frame):
    a = inspect(server, model, frame)
    want = expected(model, frame)
    check(model, frame, want, from_inspect(a))
    assert a["verdict"] == ("NG" if want else "OK")
    assert {x["rule"] for x in a["reasons"]} == {f"defect:{d.label}" for d in want}


@pytest.mark.parametrize("model", ["seg-yolo", "seg-semantic"])
def test_exif_orientation_is_ignored_masks_are_in_the_stored_pixels(server, expected, model):
    """A JPEG tagged EXIF Orientation=6 is answered on its stored pixels, exactly as the same
    file untagged: the same objects, boxes and masks, each mask the size of the header (480x320);
    the same scene turned (its pixels rotated) is answered in its own 320x480."""
    from tests.tools import jpegs

    scene = dm.scene(480, 320, [("red", 0.1, 0.1, 0.35, 0.4), ("blue", 0.6, 0.5, 0.9, 0.9)])
    plain = jpegs.baseline(scene)
    tagged = jpegs.with_orientation(plain, 6)
    turned = jpegs.baseline(cv2.rotate(scene, cv2.ROTATE_90_CLOCKWISE))

    def answer(body: bytes) -> dict:
        r = httpx.post(f"{server.url}/v1/models/{model}/inspect", content=body,
                       headers={"Content-Type": "image/jpeg"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    a_plain, a_tagged = answer(plain), answer(tagged)
    assert a_tagged["detections"] == a_plain["detections"]
    assert a_tagged["frame"] == {"width": 480, "height": 320}
    want = expected.refs[model](cv2.imdecode(np.frombuffer(plain, np.uint8), cv2.IMREAD_COLOR))
    got = from_inspect(a_tagged)
    assert sorted(d.label for d in want) == sorted(g["label"] for g in got) and got
    for g in got:
        assert g["mask"].shape == (320, 480)
        x1, y1, x2, y2 = g["box"]
        assert 0 <= x1 < x2 <= 480 and 0 <= y1 < y2 <= 320
    red = next(g for g in got if g["label"] == "red")
    assert red["mask"][:160, :240].sum() >= 0.9 * red["mask"].sum()  # the top-left quarter
    for g in from_inspect(answer(turned)):
        assert g["mask"].shape == (480, 320)
    # turned clockwise, the red part lies in the top-right quarter
    red = max((g for g in from_inspect(answer(turned)) if g["label"] == "red"),
              key=lambda g: g["score"])
    assert red["mask"][:240, 160:].sum() >= 0.9 * red["mask"].sum()


@pytest.mark.parametrize("model", MODELS)
def test_oip_http_json(server, expected, model):
    req = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(FRAMES)],
                       "data": [base64.b64encode(b).decode() for b in dm.encoded_frames()]}]}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=req, timeout=60)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert list(out) == [*OIP, "reasons", "verdict"]
    assert out["detection_masks"]["datatype"] == "BYTES"
    arrays = {}
    for name in OIP:
        data = out[name]["data"]
        if name == "detection_masks":
            arrays[name] = np.array(data, dtype=object).reshape(out[name]["shape"])
        else:
            arrays[name] = np.asarray(data).reshape(out[name]["shape"])
    for i, frame in enumerate(FRAMES):
        check(model, frame, expected(model, frame), from_oip(arrays, i, model, frame))


@pytest.mark.parametrize("model", MODELS)
def test_oip_http_binary_with_tritonclient(server, expected, model):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        inp = httpclient.InferInput("image", [len(FRAMES)], "BYTES")
        inp.set_data_from_numpy(np.array(dm.encoded_frames(), dtype=object), binary_data=True)
        res = client.infer(model, [inp], outputs=[
            httpclient.InferRequestedOutput(n, binary_data=True) for n in OIP])
        arrays = {n: res.as_numpy(n) for n in OIP}
        for i, frame in enumerate(FRAMES):
            check(model, frame, expected(model, frame), from_oip(arrays, i, model, frame))
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
            check(model, frame, expected(model, frame), from_oip(arrays, i, model, frame))
        verdicts = [v.decode() for v in res.as_numpy("verdict")]
        assert verdicts == ["NG" if expected(model, f) else "OK" for f in FRAMES]
    finally:
        client.close()


@pytest.mark.parametrize("model", MODELS)
def test_masks_equal_the_reference(server, expected, model):
    """The issue's bar: every mask within IoU 0.98 of the reference's, boxes within 1 px."""
    worst = []
    for frame in FRAMES:
        got = from_inspect(inspect(server, model, frame))
        tol = BOX_TOL if not semantic(model) else 1.0
        for e, g in detref.match(expected(model, frame), got, box_tol=tol, score_tol=SCORE_TOL):
            worst.append((detref.iou(g["mask"], e.mask), frame, e.label, e.box.tolist()))
    assert min(worst, default=(1.0,))[0] >= MASK_IOU, min(worst)


# --- bad input -------------------------------------------------------------------------------

def test_a_frame_with_nothing_in_it_is_a_normal_answer(server):
    for model in MODELS:
        a = inspect(server, model, "empty")
        assert (a["verdict"], a["detections"], a["reasons"]) == ("OK", [], [])


MISFITS = {
    "yolo-seg without its prototypes": (
        "det-yolo", 'format = "yolo-seg"', dm.LABELS, "output.proto_tensor",
        ("[N, 32, h, w]", "single output")),
    "semantic on a detection head": (
        "det-yolo", 'format = "semantic"', dm.SEMANTIC_LABELS, "output.tensor_name",
        ("[N, 4, H, W]", "[N, 7, 414]")),
    "semantic, background left out": (
        "seg-semantic", 'format = "semantic"', dm.LABELS, "output.labels",
        ("[N, 3, H, W]", "[N, 4, 32, 48]")),
    "yolo-seg, a label too many": (
        "seg-yolo", 'format = "yolo-seg"', (*dm.LABELS, "white"), "output.labels",
        ("[N, 39, 414]",)),
}


@pytest.mark.parametrize("case", list(MISFITS))
async def test_a_model_toml_that_does_not_fit_the_model_is_refused_at_load(tmp_path, case):
    from visionserve.config import ServerSettings
    from visionserve.engine import Engine
    from visionserve.errors import ConfigError

    source, output, labels, field, says = MISFITS[case]
    dm.make(source, tmp_path / "misfit", output=output, labels=labels, task="segmentation")
    eng = Engine(ServerSettings(models=tmp_path), device="cpu")
    try:
        with pytest.raises(ConfigError) as info:
            await eng.start()
    finally:
        await eng.close()
    msg = info.value.message
    assert "model misfit" in msg and f"field '{field}'" in msg, msg
    assert all(s in msg for s in says), msg


def test_masks_cross_the_front_end_process_unchanged(repo, expected, server_factory):
    """With --frontends, answers are made in the engine's process and rendered in another."""
    s = server_factory(repo, "--frontends", "1")
    for model in ("seg-yolo", "seg-semantic"):
        check(model, "portrait", expected(model, "portrait"),
              from_inspect(inspect(s, model, "portrait")))
        client = grpcclient.InferenceServerClient(s.grpc_url)
        try:
            inp = grpcclient.InferInput("image", [1], "BYTES")
            inp.set_data_from_numpy(np.array([encoded("landscape")], dtype=object))
            res = client.infer(model, [inp])
            arrays = {n: res.as_numpy(n) for n in OIP}
            check(model, "landscape", expected(model, "landscape"),
                  from_oip(arrays, 0, model, "landscape"))
        finally:
            client.close()
