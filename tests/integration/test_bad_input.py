"""Every bad input a line controller or a tool can send, against a real server on loopback.

Each case asserts the status code, a JSON ``{"error": ...}`` body whose message says what was
wrong, that a good request sent at the same time by another client is answered normally, and that
the server is still ready afterwards.
"""

from __future__ import annotations

import json
import re
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import cv2
import httpx
import numpy as np
import pytest
from conftest import start_server

from tests.tools import jpegs

LABELS = ["ok", "dent", "scratch"]


@pytest.fixture(scope="module")
def server(tiny_repo, tmp_path_factory):
    s = start_server(tiny_repo, tmp_path_factory.mktemp("bad-input"), grpc=False)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(server, jpeg_bytes) -> dict:
    """The answer to the good frame, sent alone."""
    r = httpx.post(server.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                   headers={"Content-Type": "image/jpeg"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def png_header(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr
            + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)))


def good_request(url: str, image: bytes, content_type: str = "image/jpeg") -> httpx.Response:
    return httpx.post(url + "/v1/models/tiny/inspect", content=image,
                      headers={"Content-Type": content_type, "X-Part-Id": "good"}, timeout=60)


def send_bad_beside_good(server, image: bytes, reference: dict, method: str, path: str,
                         good_type: str = "image/jpeg", **kw) -> httpx.Response:
    """The bad request, and a good one (``image``) from another client at the same time."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        good_f = pool.submit(good_request, server.url, image, good_type)
        bad = httpx.request(method, server.url + path, timeout=60, **kw)
        good = good_f.result()
    assert good.status_code == 200, good.text
    g = good.json()
    assert g["part_id"] == "good" and g["label"] == reference["label"]
    for k in LABELS:
        assert g["scores"][k] == pytest.approx(reference["scores"][k], abs=1e-5)
    ready = httpx.get(server.url + "/v2/health/ready", timeout=30)
    assert ready.status_code == 200, "the server must stay ready after a bad request"
    return bad


def assert_error(r: httpx.Response, status: int, pattern: str) -> dict:
    assert r.status_code == status, f"{r.status_code} {r.text}"
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert isinstance(body.get("error"), str) and body["error"], body
    assert re.search(pattern, body["error"], re.IGNORECASE), body["error"]
    assert "Traceback" not in r.text
    return body


# --- the inspect API ---------------------------------------------------------------------------

RAW = bytes(32 * 32 * 3)


LINE_PNG = cv2.imencode(".png", np.zeros((1, 4000, 3), np.uint8))[1].tobytes()  # a real 4000x1 PNG


def inspect_cases(jpeg: bytes) -> list:
    cases = [
        # (id, path, body, headers, status, message)
        ("empty-body", "", b"", {"Content-Type": "image/jpeg"}, 400, "empty"),
        ("truncated-jpeg", "", jpeg[: len(jpeg) // 2], {"Content-Type": "image/jpeg"}, 400, "truncated JPEG"),
        ("random-bytes", "", np.random.default_rng(7).bytes(20000), {"Content-Type": "image/jpeg"}, 400,
         "not an image"),
        ("png-40000x40000", "", png_header(40000, 40000) + b"\x00" * 100, {"Content-Type": "image/png"}, 413,
         r"40000x40000 .* limit is \d+"),
        # tiny PNGs whose resize would need gigabytes (a centre crop's intermediate, the GPU
        # path's weight matrices): refused at the door by their aspect ratio
        ("png-4000x1", "", LINE_PNG, {"Content-Type": "image/png"}, 400, r"4000x1 .*aspect ratio .* 64:1"),
        ("png-400000x2", "", png_header(400000, 2) + b"\x00" * 100, {"Content-Type": "image/png"}, 400,
         "aspect ratio"),
        ("jpeg-sent-as-png", "", jpeg, {"Content-Type": "image/png"}, 400, "content type says PNG"),
        ("jpeg-12-bit", "", jpegs.twelve_bit(), {"Content-Type": "image/jpeg"}, 400,
         "a 12-bit JPEG: JPEGs of 8 bits per sample are decoded"),
        ("raw-wrong-shape", "", RAW, {"Content-Type": "application/octet-stream", "X-Image-Shape": "10x10x3"},
         400, r"holds 3072 bytes but its shape 10x10x3 needs 300"),
        ("raw-bad-shape-text", "", RAW, {"Content-Type": "application/octet-stream",
                                         "X-Image-Shape": "big"}, 400, "X-Image-Shape 'big'"),
        ("raw-no-shape", "", RAW, {"Content-Type": "application/octet-stream"}, 400, "X-Image-Shape"),
        ("raw-two-channels", "", RAW, {"Content-Type": "application/octet-stream",
                                       "X-Image-Shape": "32x48x2"}, 400, "2 channels"),
        ("wrong-content-type", "", jpeg, {"Content-Type": "text/plain"}, 415, "unsupported content type 'text/plain'"),
        ("form-content-type", "", jpeg, {"Content-Type": "application/x-www-form-urlencoded"}, 415,
         "unsupported content type"),
        ("unknown-model", "/v1/models/nope/inspect", jpeg, {"Content-Type": "image/jpeg"}, 404,
         "unknown model 'nope'"),
        ("unknown-version", "/v1/models/tiny/versions/9/inspect", jpeg, {"Content-Type": "image/jpeg"}, 404,
         "no version 9"),
        ("bad-version", "/v1/models/tiny/versions/latest/inspect", jpeg, {"Content-Type": "image/jpeg"}, 404,
         "no version 'latest'"),
    ]
    for value, pattern in (("-5", "deadline -5.0 ms is out of range"), ("0", "out of range"),
                           ("1e12", "out of range"), ("inf", "out of range"), ("nan", "not a number"),
                           ("soon", "X-Deadline-Ms: 'soon' is not a number")):
        cases.append((f"deadline-{value}", "", jpeg, {"Content-Type": "image/jpeg", "X-Deadline-Ms": value},
                      400, pattern))
    for value, pattern in (("-1", "priority -1 is out of range 0..2"), ("3", "out of range"),
                           ("99999999999999999999999", "out of range"), ("1.5", "not an integer"),
                           ("high", "X-Priority: 'high' is not an integer")):
        cases.append((f"priority-{value}", "", jpeg, {"Content-Type": "image/jpeg", "X-Priority": value},
                      400, pattern))
    return cases


_CASE_IDS = [c[0] for c in inspect_cases(b"\xff\xd8\xff\xd9")]


@pytest.mark.parametrize("case_id", _CASE_IDS)
def test_inspect_bad_input(server, jpeg_bytes, reference, case_id):
    (_, path, body, headers, status, pattern), = [c for c in inspect_cases(jpeg_bytes) if c[0] == case_id]
    headers = {"X-Part-Id": "bad-1", **headers}
    r = send_bad_beside_good(server, jpeg_bytes, reference, "POST", path or "/v1/models/tiny/inspect",
                             content=body, headers=headers)
    err = assert_error(r, status, pattern)
    if status != 404:
        assert err.get("part_id") == "bad-1"  # a PLC gateway can still match the answer to its part


def test_missing_content_type(server, jpeg_bytes, reference):
    r = send_bad_beside_good(server, jpeg_bytes, reference, "POST", "/v1/models/tiny/inspect", content=jpeg_bytes)
    assert_error(r, 415, "unsupported content type")


def test_tiny_deadline_is_answered_late(server, jpeg_bytes, reference):
    r = send_bad_beside_good(server, jpeg_bytes, reference, "POST", "/v1/models/tiny/inspect",
                             content=jpeg_bytes, headers={"Content-Type": "image/jpeg", "X-Deadline-Ms": "0.001",
                                                          "X-Part-Id": "late-1"})
    body = assert_error(r, 504, "deadline passed")
    assert body["verdict"] == "LATE" and body["deadline_met"] is False and body["part_id"] == "late-1"
    assert body["model"] == "tiny" and body["late_ms"] >= 0  # how late: the deadline passed that long ago


def test_late_frames_are_counted(server, jpeg_bytes):
    def misses() -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        m = re.search(r'^visionserve_deadline_misses_total\{model="tiny"\} (\S+)$', text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    before = misses()
    r = httpx.post(server.url + "/v1/models/tiny/inspect", content=jpeg_bytes, timeout=60,
                   headers={"Content-Type": "image/jpeg", "X-Deadline-Ms": "0.001"})
    assert r.status_code == 504
    assert misses() == before + 1


# --- the OIP v2 REST protocol ------------------------------------------------------------------


def uint8_request(shape=(1, 32, 32, 3), name="image", datatype="UINT8", data=None, **top) -> dict:
    n = int(np.prod(shape))
    return {"inputs": [{"name": name, "datatype": datatype, "shape": list(shape),
                        "data": data if data is not None else [7] * n}], **top}


def oip_cases() -> list:
    binary_head = json.dumps({"inputs": [{"name": "image", "datatype": "UINT8", "shape": [1, 32, 32, 3],
                                          "parameters": {"binary_data_size": 3072}}]}).encode()
    return [
        # (id, path, kwargs for httpx, status, message)
        ("unknown-model", "/v2/models/nope/infer", {"json": uint8_request()}, 404, "unknown model 'nope'"),
        ("unknown-version", "/v2/models/tiny/versions/3/infer", {"json": uint8_request()}, 404, "no version 3"),
        ("wrong-tensor-name", "", {"json": uint8_request(name="pixels")}, 400,
         "unknown input 'pixels'.*named 'image'"),
        ("wrong-datatype", "", {"json": uint8_request(datatype="FP32")}, 400, "datatype FP32"),
        ("wrong-shape", "", {"json": uint8_request(shape=(1, 32, 96))}, 400, r"shape \[N,H,W,C\]"),
        ("negative-dim", "", {"json": uint8_request(shape=(1, -32, 32, 3), data=[1])}, 400, "bad dimension"),
        ("data-count-mismatch", "", {"json": uint8_request(data=[1, 2, 3])}, 400, "3 values but shape"),
        ("uint8-out-of-range", "", {"json": uint8_request(data=[300] * 3072)}, 400, "0..255"),
        ("two-inputs", "", {"json": {"inputs": uint8_request()["inputs"] * 2}}, 400, "exactly one input"),
        ("unknown-output", "", {"json": uint8_request(outputs=[{"name": "boxes"}])}, 400, "unknown output 'boxes'"),
        ("bytes-not-base64", "", {"json": {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                                       "data": ["***"]}]}}, 400, "base64"),
        ("malformed-json", "", {"content": b'{"inputs": [', "headers": {"Content-Type": "application/json"}},
         400, "malformed JSON"),
        ("not-a-request", "", {"json": {"hello": 1}}, 400, "inputs"),
        ("empty-body", "", {"content": b"", "headers": {"Content-Type": "application/json"}}, 400,
         "malformed JSON"),
        ("binary-header-longer-than-body", "",
         {"content": binary_head + bytes(3072),
          "headers": {"Inference-Header-Content-Length": str(len(binary_head) + 3072 + 10)}}, 400,
         "does not fit the body"),
        ("binary-header-length-not-int", "",
         {"content": binary_head + bytes(3072), "headers": {"Inference-Header-Content-Length": "lots"}}, 400,
         "not an integer"),
        ("binary-size-mismatch", "",
         {"content": binary_head + bytes(100), "headers": {"Inference-Header-Content-Length": str(len(binary_head))}},
         400, "binary_data_size 3072 does not match"),
        ("timeout-negative", "", {"json": uint8_request(parameters={"timeout": -5000})}, 400,
         "deadline .* out of range"),
        ("timeout-huge", "", {"json": uint8_request(parameters={"timeout": 10**18})}, 400, "out of range"),
        ("timeout-text", "", {"json": uint8_request(parameters={"timeout": "soon"})}, 400, "timeout"),
        ("priority-huge", "", {"json": uint8_request(parameters={"priority": 10**12})}, 400,
         "priority .* out of range"),
        ("priority-negative", "", {"json": uint8_request(parameters={"priority": -2})}, 400, "out of range"),
    ]


@pytest.mark.parametrize("case_id", [c[0] for c in oip_cases()])
def test_oip_bad_input(server, jpeg_bytes, reference, case_id):
    (_, path, kwargs, status, pattern), = [c for c in oip_cases() if c[0] == case_id]
    r = send_bad_beside_good(server, jpeg_bytes, reference, "POST", path or "/v2/models/tiny/infer", **kwargs)
    assert_error(r, status, pattern)


def test_oip_tiny_timeout_is_504(server, jpeg_bytes, reference):
    r = send_bad_beside_good(server, jpeg_bytes, reference, "POST", "/v2/models/tiny/infer",
                             json=uint8_request(parameters={"timeout": 1}))  # 1 microsecond
    assert_error(r, 504, "deadline")


@pytest.mark.parametrize("path", ["/v2/models/nope", "/v2/models/nope/ready", "/v2/models/nope/config",
                                  "/v2/models/nope/stats", "/v2/models/tiny/versions/4",
                                  "/v2/models/tiny/versions/4/ready"])
def test_oip_unknown_model_metadata(server, path):
    r = httpx.get(server.url + path, timeout=30)
    assert_error(r, 404, "unknown model 'nope'|no version 4")


def test_unknown_route_is_json_404(server):
    assert_error(httpx.get(server.url + "/v3/whatever", timeout=30), 404, "not found")


def test_wrong_method_is_json_405(server):
    assert_error(httpx.get(server.url + "/v1/models/tiny/inspect", timeout=30), 405, "not allowed")


# --- limits: body size, queue size -------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server(tiny_repo, tmp_path_factory):
    """Small limits: 2 KiB bodies, one queued frame, and a long queue delay to keep it queued."""
    s = start_server(tiny_repo, tmp_path_factory.mktemp("bad-input-small"), "--max-body-bytes", "2048",
                     "--max-queue-size", "1", "--max-queue-delay-ms", "1500", grpc=False)
    yield s
    s.stop()


def small_frame() -> bytes:
    import cv2

    ok, buf = cv2.imencode(".png", np.zeros((8, 8, 3), np.uint8))
    assert ok and len(buf) < 2048
    return buf.tobytes()


@pytest.fixture(scope="module")
def small_reference(small_server) -> dict:
    r = good_request(small_server.url, small_frame(), "image/png")
    assert r.status_code == 200, r.text
    return r.json()


def test_body_over_the_limit_413(small_server, small_reference, jpeg_bytes):
    assert len(jpeg_bytes) > 2048
    r = send_bad_beside_good(small_server, small_frame(), small_reference, "POST", "/v1/models/tiny/inspect",
                             good_type="image/png", content=jpeg_bytes,
                             headers={"Content-Type": "image/jpeg", "X-Part-Id": "big"})
    body = assert_error(r, 413, r"over the limit of 2048 .*max_body_bytes")
    assert body["part_id"] == "big"
    r = send_bad_beside_good(small_server, small_frame(), small_reference, "POST", "/v2/models/tiny/infer",
                             good_type="image/png", json=uint8_request())
    assert_error(r, 413, "over the limit of 2048")


def test_chunked_body_over_the_limit_413(small_server, small_reference, jpeg_bytes):
    def chunks():  # no Content-Length: the limit must hold while streaming
        for i in range(0, len(jpeg_bytes), 1000):
            yield jpeg_bytes[i:i + 1000]

    r = send_bad_beside_good(small_server, small_frame(), small_reference, "POST", "/v1/models/tiny/inspect",
                             good_type="image/png", content=chunks(), headers={"Content-Type": "image/jpeg"})
    assert_error(r, 413, "over the limit of 2048")


def test_full_queue_is_503_with_retry_after(small_server):
    frame = small_frame()
    url = small_server.url + "/v1/models/tiny/inspect"
    headers = {"Content-Type": "image/png"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        # the first frame waits in the queue (1.5 s delay, queue size 1) ...
        first = pool.submit(httpx.post, url, content=frame, headers=headers, timeout=60)
        for _ in range(200):  # ... until it is there
            text = httpx.get(small_server.url + "/metrics", timeout=30).text
            if 'visionserve_queue_depth{model="tiny"} 1.0' in text:
                break
            if first.done():
                pytest.fail(f"the first frame was answered before it could be seen queued: {first.result().text}")
            time.sleep(0.01)
        else:
            pytest.fail("the first frame never showed up in the queue")
        second = httpx.post(url, content=frame, headers=headers, timeout=60)
        body = assert_error(second, 503, "overloaded.*max_queue_size 1")
        assert int(second.headers["Retry-After"]) >= 1
        assert body["model"] == "tiny"
        assert first.result().status_code == 200


# --- known bugs in the OIP front end (visionserve/http/v2.py, visionserve/oip.py) --------------
# strict: when the fix lands these XPASS and fail, so the marker is removed with it


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"inputs":[{"name":"image","datatype":"UINT8","shape":[1,1,1,1],"data":'
                                  + b"[" * 5000 + b"1" + b"]" * 5000 + b"}]}"], ids=["top", "in-data"])
def test_deeply_nested_json_is_400(server, jpeg_bytes, reference, body):
    r = send_bad_beside_good(server, jpeg_bytes, reference, "POST", "/v2/models/tiny/infer", content=body,
                             headers={"Content-Type": "application/json"})
    assert_error(r, 400, "JSON")


@pytest.mark.parametrize("value", [1.5, True], ids=["float", "bool"])
def test_uint8_data_must_be_integers(server, jpeg_bytes, reference, value):
    r = send_bad_beside_good(server, jpeg_bytes, reference, "POST", "/v2/models/tiny/infer",
                             json=uint8_request(shape=(1, 8, 8, 3), data=[value] * 192))
    assert_error(r, 400, "integers")
