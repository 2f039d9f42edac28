"""The OIP v2 HTTP front end with Triton's own HTTP client (tritonclient.http, sync and aio), in
the binary tensor extension (tritonclient's default) and in plain JSON (``binary_data=False``)."""

from __future__ import annotations

import asyncio
import base64

import cv2
import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from conftest import assert_same_answer, inspect_answer
from tritonclient.utils import InferenceServerException

from visionserve import oip

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tiny_server):
    c = httpclient.InferenceServerClient(tiny_server.url.removeprefix("http://"))
    yield c
    c.close()


def rgb_frame(h: int = 48, w: int = 64, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def bytes_input(images: list[bytes], binary: bool = True, name: str = "image") -> httpclient.InferInput:
    """BYTES input. JSON cannot carry raw bytes, so in JSON mode each image goes as base64 text."""
    inp = httpclient.InferInput(name, [len(images)], "BYTES")
    data = images if binary else [base64.b64encode(i) for i in images]
    inp.set_data_from_numpy(np.array(data, dtype=np.object_), binary_data=binary)
    return inp


def outputs(binary: bool) -> list[httpclient.InferRequestedOutput]:
    return [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("scores", "label", "verdict")]


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("no-such-model")
    assert client.get_server_metadata()["extensions"] == oip.EXTENSIONS
    md = client.get_model_metadata(MODEL)
    assert md["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1, 1]}]
    config = client.get_model_config(MODEL)
    assert config["max_batch_size"] == 8 and config["input"][0]["name"] == "image"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("no-such-model")
    assert err.value.status() == "404"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bytes_frames_match_the_inspect_api(client, tiny_server, jpeg_bytes, binary):
    ok, png = cv2.imencode(".png", cv2.cvtColor(rgb_frame(), cv2.COLOR_RGB2BGR))
    images = [jpeg_bytes, png.tobytes()]
    result = client.infer(MODEL, [bytes_input(images, binary)], outputs=outputs(binary), request_id="r1")
    assert result.get_response()["id"] == "r1"
    assert result.as_numpy("scores").shape == (2, 3)
    for i, kind in enumerate(["image/jpeg", "image/png"]):
        assert_same_answer(result, i, inspect_answer(tiny_server, images[i], kind))


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_uint8_nhwc_frames_match_the_inspect_api(client, tiny_server, binary):
    frames = np.stack([rgb_frame(24, 32, seed=s) for s in (4, 5, 6)])
    inp = httpclient.InferInput("image", list(frames.shape), "UINT8")
    inp.set_data_from_numpy(frames, binary_data=binary)
    result = client.infer(MODEL, [inp], outputs=outputs(binary))
    for i in range(3):
        answer = inspect_answer(tiny_server, frames[i].tobytes(), "application/octet-stream", "24x32x3")
        assert_same_answer(result, i, answer)


def test_default_outputs_and_statistics(client, jpeg_bytes):
    result = client.infer(MODEL, [bytes_input([jpeg_bytes])])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["scores", "label", "verdict"]
    stats = client.get_inference_statistics(MODEL)["model_stats"][0]
    assert stats["inference_count"] >= 1 and stats["inference_stats"]["success"]["count"] >= 1


def _status(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_errors_map_to_http_status(client, jpeg_bytes, binary):
    status, message = _status(lambda: client.infer("no-such-model", [bytes_input([jpeg_bytes], binary)]))
    assert status == "404" and "no-such-model" in message
    status, message = _status(lambda: client.infer(MODEL, [bytes_input([jpeg_bytes], binary, name="pixels")]))
    assert status == "400" and "pixels" in message
    status, message = _status(lambda: client.infer(MODEL, [bytes_input([b"corrupt \x00 frame"], binary)]))
    assert status == "400" and "image 0" in message
    status, message = _status(lambda: client.infer(MODEL, [bytes_input([jpeg_bytes[:1500]], binary)]))
    assert status == "400" and "truncated" in message
    status, message = _status(lambda: client.infer(MODEL, [bytes_input([jpeg_bytes], binary)], timeout=1))
    assert status == "504"


def test_json_bytes_that_are_not_base64_are_refused(tiny_server):
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["%%% not base64"]}]}
    r = httpx.post(f"{tiny_server.url}/v2/models/{MODEL}/infer", json=body, timeout=10)
    assert r.status_code == 400 and "base64" in r.json()["error"]


def test_aio_client(tiny_server, jpeg_bytes):
    import tritonclient.http.aio as httpaio

    async def main():
        c = httpaio.InferenceServerClient(tiny_server.url.removeprefix("http://"))
        try:
            assert await c.is_server_ready()
            inputs = []
            for _ in range(4):
                inp = httpaio.InferInput("image", [1], "BYTES")
                inp.set_data_from_numpy(np.array([jpeg_bytes], dtype=np.object_))
                inputs.append(inp)
            return await asyncio.gather(*(c.infer(MODEL, [i]) for i in inputs))
        finally:
            await c.close()

    results = asyncio.run(main())
    assert len(results) == 4
    first = results[0].as_numpy("scores")
    for r in results:
        np.testing.assert_allclose(r.as_numpy("scores"), first, atol=1e-5)
