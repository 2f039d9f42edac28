"""An anomalib-format export served as ``task = "anomaly"``: score and map equal onnxruntime run
directly on the same frames, over the inspect API, OIP HTTP (tritonclient, binary) and gRPC, in
the engine's process and with a front-end process.

anomalib itself is not a test dependency (it pulls lightning and more); the model is a torch
module with anomalib 2.x's output names and its normalisation baked into the graph, the way
anomalib's ``to_onnx`` exports a model: ``pred_score`` and ``anomaly_map`` normalised with
``clip((x - threshold) / (max - min) + 0.5, 0, 1)``, ``pred_label`` and ``pred_mask`` at 0.5.
"""

from __future__ import annotations

import base64
import signal
import warnings
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server

from visionserve import imaging
from visionserve.config import load_model_config

THRESHOLD, MIN, MAX = 0.4, 0.0, 1.0

TOML = f"""\
task = "anomaly"
description = "anomalib-style export: normalisation baked in"
[input]
width = 32
height = 32
tensor_name = "input"
[output]
format = "anomalib"
inspect_map = true
[normalization]
image_threshold = {THRESHOLD}
min = {MIN}
max = {MAX}
[verdict]
min_region_area = 50
[batching]
max_batch_size = 4
preferred_batch_sizes = [1, 2, 4]
takt_ms = 10000
"""


def export_anomalib_like(folder: Path) -> Path:
    import torch
    import torch.nn.functional as F

    class AnomalibLike(torch.nn.Module):
        def forward(self, x):
            raw = F.avg_pool2d((x - 0.2).abs().mean(dim=1, keepdim=True), 3, 1, 1)  # [N,1,H,W]
            score = raw.amax(dim=(1, 2, 3))

            def norm(t):
                return ((t - THRESHOLD) / (MAX - MIN) + 0.5).clamp(0, 1)

            amap, s = norm(raw), norm(score)
            return s, s > 0.5, amap, amap > 0.5

    (folder / "1").mkdir(parents=True)
    names = ["pred_score", "pred_label", "anomaly_map", "pred_mask"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(AnomalibLike().eval(), (torch.zeros(2, 3, 32, 32),),
                          str(folder / "1" / "model.onnx"), input_names=["input"],
                          output_names=names,
                          dynamic_axes={"input": {0: "batch_size"},
                                        **{n: {0: "batch_size"} for n in names}},
                          opset_version=17, dynamo=False)
    (folder / "model.toml").write_text(TOML)
    return folder


def frames() -> list[np.ndarray]:
    """RGB frames of another size than the model's: plain grey parts and parts with a spot."""
    out = []
    for i, spot in enumerate((False, True, False, True)):
        img = np.full((40, 48, 3), 51 + 3 * i, np.uint8)
        if spot:
            img[8 + i:20 + i, 10:24] = 230
        out.append(img)
    return out


def png(rgb: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", rgb[..., ::-1])
    assert ok
    return buf.tobytes()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("anomalyrepo")
    export_anomalib_like(root / "parts")
    return root


@pytest.fixture(scope="module")
def reference(repo):
    """onnxruntime on the frames, preprocessed by the server's own functions."""
    import onnxruntime as ort

    spec = load_model_config(repo / "parts" / "model.toml").input
    x = imaging.normalize(np.stack([imaging.preprocess(imaging.raw_frame(f, f.shape), spec)
                                    for f in frames()]), spec)
    sess = ort.InferenceSession(str(repo / "parts" / "1" / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    score, amap = sess.run(["pred_score", "anomaly_map"], {"input": x})
    assert score[1] > 0.5 > score[0]  # the frames test both verdicts
    return score, amap[:, 0]


@pytest.fixture(scope="module", params=[(), ("--frontends", "1")], ids=["engine", "frontends"])
def server(request, repo, tmp_path_factory):
    s = start_server(repo, tmp_path_factory.mktemp("srv"), *request.param)
    yield s
    s.stop()


def test_inspect_api(server, reference):
    score, amap = reference
    for i, f in enumerate(frames()):
        r = httpx.post(f"{server.url}/v1/models/parts/inspect", content=png(f),
                       headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["score"] == pytest.approx(float(score[i]), abs=1e-6)
        assert body["raw_score"] == pytest.approx((float(score[i]) - 0.5) * (MAX - MIN)
                                                  + THRESHOLD, abs=1e-6)
        m = body["anomaly_map"]
        got = np.frombuffer(base64.b64decode(m["data"]), "<f4").reshape(m["shape"])
        np.testing.assert_allclose(got, amap[i], atol=1e-6)
        assert body["verdict"] == ("NG" if score[i] >= 0.5 else "OK")
        assert body["label"] == ("anomalous" if body["verdict"] == "NG" else "normal")
        if body["verdict"] == "NG":
            # the spot's region, in frame pixels (48x40 frame, 32x32 map: 1.5 x 1.25 px each)
            x1, y1, x2, y2 = body["regions"][0]["box"]
            assert 8 <= x1 <= 12 and 20 <= x2 <= 26 and body["regions"][0]["area"] >= 50
            assert any("image score" in x for x in body["reasons"])
            assert any("min_region_area 50 px" in x for x in body["reasons"])
        else:
            assert body["regions"] == [] and body["reasons"] == []


def test_oip_http_binary(server, reference):
    score, amap = reference
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        # the frames as files: the server decodes and resizes them as the reference did
        inp = httpclient.InferInput("image", [len(frames())], "BYTES")
        inp.set_data_from_numpy(np.array([png(f) for f in frames()], dtype=object),
                                binary_data=True)
        res = client.infer("parts", [inp], outputs=[
            httpclient.InferRequestedOutput(n, binary_data=True)
            for n in ("score", "anomaly_map", "num_regions", "region_boxes", "verdict")])
        np.testing.assert_allclose(res.as_numpy("score"), score, atol=1e-6)
        np.testing.assert_allclose(res.as_numpy("anomaly_map"), amap, atol=1e-6)
        assert res.as_numpy("num_regions").tolist() == [int(s >= 0.5) for s in score]
        assert res.as_numpy("region_boxes").shape == (len(frames()), 16, 4)
        md = client.get_model_metadata("parts")
        assert {o["name"]: o["shape"] for o in md["outputs"]}["anomaly_map"] == [-1, 32, 32]
        config = client.get_model_config("parts")
        assert config["parameters"]["format"] == {"string_value": "anomalib"}
    finally:
        client.close()


def test_grpc(server, reference):
    score, amap = reference
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inp = grpcclient.InferInput("image", [len(frames())], "BYTES")
        inp.set_data_from_numpy(np.array([png(f) for f in frames()], dtype=object))
        res = client.infer("parts", [inp])
        np.testing.assert_allclose(res.as_numpy("score"), score, atol=1e-6)
        np.testing.assert_allclose(res.as_numpy("anomaly_map"), amap, atol=1e-6)
        verdicts = [v.decode() for v in res.as_numpy("verdict")]
        assert verdicts == ["NG" if s >= 0.5 else "OK" for s in score]
    finally:
        client.close()


def test_verdict_change_applies_to_the_next_frame(server, reference):
    score, _ = reference
    spot = png(frames()[1])

    def verdict() -> str:
        r = httpx.post(f"{server.url}/v1/models/parts/inspect", content=spot,
                       headers={"Content-Type": "image/png"}, timeout=30)
        return r.json()["verdict"]

    assert verdict() == "NG"
    r = httpx.put(f"{server.url}/v1/models/parts/verdict",
                  json={"image_threshold": 1.0, "min_region_area": None})
    assert r.status_code == 200, r.text
    try:
        assert verdict() == ("NG" if score[1] >= 1.0 else "OK")
        r = httpx.put(f"{server.url}/v1/models/parts/verdict", json={"pixel_threshold": 2})
        assert r.status_code == 400 and "verdict.pixel_threshold" in r.json()["error"]
    finally:
        httpx.put(f"{server.url}/v1/models/parts/verdict",
                  json={"image_threshold": 0.5, "min_region_area": 50})


def test_annotated_jpeg(server):
    r = httpx.post(f"{server.url}/v1/models/parts/inspect", content=png(frames()[1]),
                   headers={"Content-Type": "image/png", "Accept": "image/jpeg"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    img = cv2.imdecode(np.frombuffer(r.content, np.uint8), cv2.IMREAD_COLOR)
    assert img.shape == (40, 48, 3)  # the frame's size, heat map and boxes drawn on it


def test_the_server_refuses_a_misfit_and_says_why(tmp_path):
    """A model.toml whose map output is not in the model: no start, the field named."""
    folder = export_anomalib_like(tmp_path / "models" / "misfit")
    toml = folder / "model.toml"
    toml.write_text(toml.read_text().replace("format = \"anomalib\"",
                                             "format = \"anomalib\"\nmap = \"heatmap\""))
    s = start_server(tmp_path / "models", tmp_path, grpc=False, wait=False)
    try:
        rc = s.proc.wait(120)
    finally:
        s.stop(signal.SIGKILL)
    log = s.log()
    assert rc != 0
    assert "field 'output.map'" in log and "no model output is named 'heatmap'" in log, log[-2000:]
    assert "'anomaly_map'" in log and "'pred_score'" in log  # the outputs there are


def test_exif_orientation_is_ignored_regions_are_in_the_stored_pixels(server):
    """A JPEG tagged EXIF Orientation=6 is answered on its stored pixels, as the same file
    untagged: the same score, map and regions, in the 48x40 of its header (also the annotated
    image); the same part turned (its pixels rotated) is answered in its own 40x48."""
    from tests.tools import jpegs

    part = frames()[1][..., ::-1]  # BGR, the spot at x 10..24, y 9..21
    plain = jpegs.baseline(part, quality=95)
    tagged = jpegs.with_orientation(plain, 6)
    turned = jpegs.baseline(cv2.rotate(part, cv2.ROTATE_90_CLOCKWISE), quality=95)

    def inspect(body: bytes, accept: str = "application/json") -> httpx.Response:
        r = httpx.post(f"{server.url}/v1/models/parts/inspect", content=body, timeout=30,
                       headers={"Content-Type": "image/jpeg", "Accept": accept})
        assert r.status_code == 200, r.text
        return r

    a_plain, a_tagged = inspect(plain).json(), inspect(tagged).json()
    same = ("score", "anomaly_map", "regions", "verdict", "reasons")
    assert {k: a_tagged[k] for k in same} == {k: a_plain[k] for k in same}
    assert a_tagged["verdict"] == "NG" and a_tagged["regions"]
    assert a_tagged["frame"] == {"width": 48, "height": 40}
    x1, y1, x2, y2 = a_tagged["regions"][0]["box"]
    assert 8 <= x1 <= 12 and 20 <= x2 <= 26 and y2 <= 26  # the spot, in 48x40 pixels
    img = cv2.imdecode(np.frombuffer(inspect(tagged, "image/jpeg").content, np.uint8),
                       cv2.IMREAD_COLOR)
    assert img.shape == (40, 48, 3)
    a_turned = inspect(turned).json()
    x1, y1, x2, y2 = a_turned["regions"][0]["box"]  # turned clockwise: x = 39 - y, y = x
    assert 14 <= x1 and x2 <= 34 and 8 <= y1 <= 12 and 20 <= y2 <= 26, a_turned["regions"]
