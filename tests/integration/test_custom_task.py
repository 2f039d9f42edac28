"""A task added in test code only: a regression model (one number per frame, OK within a
tolerance of a target) served over the inspect API, OIP HTTP in JSON and in the binary tensor
extension, and gRPC, without a line of the server changed.

The task (``plugins/regression_task.py``) reaches the server the way a plant team's package
would: a distribution on the server's path whose entry point, in the group
``visionserve.tasks``, names it; ``task = "regression"`` in model.toml selects it. The model is a
real ONNX file exported here: the mean pixel value, scaled to [0, 1], so a solid grey frame of
level g reads g / 255.
"""

from __future__ import annotations

import base64
import os
import warnings
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server

PLUGINS = Path(__file__).resolve().parent / "plugins"

TOML = """\
task = "regression"
description = "toy regression: the mean grey level of the frame, 0..1"
[input]
width = 16
height = 16
[output]
tensor_name = "level"
unit = "fill"
[verdict]
target = 0.5
tolerance = 0.02
[batching]
max_batch_size = 4
preferred_batch_sizes = [1, 2, 4]
max_queue_delay_ms = 2
takt_ms = 10000
"""

#: grey level -> (value, verdict): 122/255 = 0.478 is just outside the tolerance
FRAMES = {128: "OK", 64: "NG", 122: "NG", 130: "OK"}


def install_plugin(site: Path) -> str:
    """A distribution in ``site`` whose entry point registers the task; the PYTHONPATH to use."""
    dist = site / "toy_regression-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-regression\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[visionserve.tasks]\nregression = regression_task:Regression\n")
    return os.pathsep.join(p for p in (str(site), str(PLUGINS), os.environ.get("PYTHONPATH")) if p)


def export_model(folder: Path) -> Path:
    import torch

    class Level(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=(1, 2, 3)).unsqueeze(1)  # [N, 1]

    (folder / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Level().eval(), (torch.zeros(2, 3, 16, 16),),
                          str(folder / "1" / "model.onnx"), input_names=["input"],
                          output_names=["level"],
                          dynamic_axes={"input": {0: "batch"}, "level": {0: "batch"}},
                          opset_version=17, dynamo=False)
    (folder / "model.toml").write_text(TOML)
    return folder


@pytest.fixture(scope="module", params=[(), ("--frontends", "1")], ids=["engine", "frontends"])
def server(request, tmp_path_factory):
    """The server, in the engine's process, and with a front-end process (results pickled)."""
    root = tmp_path_factory.mktemp("toyrepo")
    export_model(root / "toy")
    path = install_plugin(tmp_path_factory.mktemp("site"))
    s = start_server(root, tmp_path_factory.mktemp("srv"), *request.param, env={"PYTHONPATH": path})
    yield s
    s.stop()


def png(level: int) -> bytes:
    ok, buf = cv2.imencode(".png", np.full((24, 32, 3), level, np.uint8))
    assert ok
    return buf.tobytes()


def check(values, verdicts) -> None:
    verdicts = [v.decode() if isinstance(v, bytes) else v for v in verdicts]
    np.testing.assert_allclose(np.asarray(values, np.float64).reshape(-1),
                               [g / 255 for g in FRAMES], atol=1e-5)
    assert verdicts == list(FRAMES.values())


def test_inspect_api(server):
    for level, verdict in FRAMES.items():
        r = httpx.post(f"{server.url}/v1/models/toy/inspect", content=png(level),
                       headers={"Content-Type": "image/png", "X-Part-Id": f"p{level}"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["verdict"] == verdict and body["part_id"] == f"p{level}"
        assert body["value"] == pytest.approx(level / 255, abs=1e-5)
        assert (body["unit"], body["target"], body["tolerance"]) == ("fill", 0.5, 0.02)
        assert "label" not in body and body["batch_size"] >= 1 and body["deadline_met"]


def test_oip_http_json(server):
    req = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(FRAMES)],
                       "data": [base64.b64encode(png(g)).decode() for g in FRAMES]}]}
    r = httpx.post(f"{server.url}/v2/models/toy/infer", json=req, timeout=30)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert list(out) == ["value", "verdict"]
    assert (out["value"]["datatype"], out["value"]["shape"]) == ("FP32", [len(FRAMES)])
    check(out["value"]["data"], out["verdict"]["data"])


def test_oip_http_binary_with_tritonclient(server):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        pixels = np.stack([np.full((16, 16, 3), g, np.uint8) for g in FRAMES])
        inp = httpclient.InferInput("image", list(pixels.shape), "UINT8")
        inp.set_data_from_numpy(pixels, binary_data=True)
        res = client.infer("toy", [inp], outputs=[
            httpclient.InferRequestedOutput(n, binary_data=True) for n in ("value", "verdict")])
        check(res.as_numpy("value"), res.as_numpy("verdict"))
        md = client.get_model_metadata("toy")
        assert md["outputs"] == [{"name": "value", "datatype": "FP32", "shape": [-1]},
                                 {"name": "verdict", "datatype": "BYTES", "shape": [-1]}]
        config = client.get_model_config("toy")
        assert [o["name"] for o in config["output"]] == ["value", "verdict"]
        assert config["parameters"]["target"] == {"string_value": "0.5"}
    finally:
        client.close()


def test_grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inp = grpcclient.InferInput("image", [len(FRAMES)], "BYTES")
        inp.set_data_from_numpy(np.array([png(g) for g in FRAMES], dtype=object))
        res = client.infer("toy", [inp])
        check(res.as_numpy("value"), res.as_numpy("verdict"))
        md = client.get_model_metadata("toy", as_json=True)
        assert [o["name"] for o in md["outputs"]] == ["value", "verdict"]
    finally:
        client.close()


def test_an_output_the_task_does_not_give_is_refused(server):
    req = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                       "data": [base64.b64encode(png(128)).decode()]}],
           "outputs": [{"name": "scores"}]}
    r = httpx.post(f"{server.url}/v2/models/toy/infer", json=req, timeout=30)
    assert r.status_code == 400
    assert "unknown output 'scores'; outputs are ['value', 'verdict']" in r.text
