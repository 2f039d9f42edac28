"""A large OIP JSON request cannot stall the server: it has its own, smaller limit
(max_json_body_bytes), and it is parsed and converted beside the event loop, in pieces, so that
health checks and other requests keep being answered meanwhile."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import numpy as np
import pytest

JSON_LIMIT = 16 * 1024**2  # the default max_json_body_bytes


def _uint8_request(h: int, w: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (h, w, 3))
    return json.dumps({"inputs": [{"name": "image", "shape": [1, h, w, 3], "datatype": "UINT8",
                                   "data": pixels.reshape(-1).tolist()}]},
                      separators=(",", ":")).encode()


@pytest.fixture(scope="module")
def big_json() -> bytes:
    body = _uint8_request(1400, 1050)
    assert JSON_LIMIT - 1024**2 < len(body) < JSON_LIMIT, len(body)
    return body


def test_health_and_frames_are_answered_while_a_large_json_request_is_parsed(
        tiny_server, big_json, jpeg_bytes):
    url = tiny_server.url
    big: dict = {}

    def send_big() -> None:
        t0 = time.monotonic()
        r = httpx.post(url + "/v2/models/tiny/infer", content=big_json, timeout=120,
                       headers={"Content-Type": "application/json"})
        big.update(status=r.status_code, text=r.text[:200], took=time.monotonic() - t0)

    with httpx.Client(timeout=10) as probe:
        probe.get(url + "/v2/health/live")  # connected before the big request
        sender = threading.Thread(target=send_big)
        sender.start()
        probes, inspect = [], None
        while sender.is_alive():
            t0 = time.monotonic()
            assert probe.get(url + "/v2/health/live").status_code == 200
            probes.append(time.monotonic() - t0)
            if inspect is None and len(probes) == 3:  # a line frame beside it, with a deadline
                inspect = probe.post(url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                                     headers={"Content-Type": "image/jpeg",
                                              "X-Deadline-Ms": "1000"})
            time.sleep(0.02)
        sender.join()
    print(f"\nlarge JSON ({len(big_json) / 2**20:.1f} MiB) answered in {big['took']:.2f} s; "
          f"{len(probes)} health probes meanwhile: median {statistics.median(probes) * 1000:.1f} "
          f"ms, max {max(probes) * 1000:.1f} ms")
    assert big["status"] == 200, big
    assert inspect is not None and inspect.status_code == 200, inspect and inspect.text
    assert len(probes) >= 5, probes
    assert max(probes) <= 0.1, [round(p * 1000, 1) for p in probes]


def test_json_over_its_limit_gets_413_naming_the_setting(tiny_server):
    body = _uint8_request(1400, 1400)  # about 20 MiB: under max_body_bytes, over the JSON limit
    assert JSON_LIMIT < len(body) < 64 * 1024**2
    r = httpx.post(tiny_server.url + "/v2/models/tiny/infer", content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert "max_json_body_bytes" in r.json()["error"]


def test_the_binary_extension_keeps_max_body_bytes(tiny_server):
    """The same frame as binary tensor data: 6 MB under the body limit, served."""
    import tritonclient.http as httpclient

    pixels = np.random.default_rng(0).integers(0, 256, (1, 1400, 1400, 3), dtype=np.uint8)
    client = httpclient.InferenceServerClient(tiny_server.url.removeprefix("http://"))
    inp = httpclient.InferInput("image", list(pixels.shape), "UINT8")
    inp.set_data_from_numpy(pixels, binary_data=True)
    result = client.infer("tiny", [inp])
    assert result.as_numpy("verdict").shape == (1,)
