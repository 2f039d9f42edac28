"""/metrics against the answers actually given: a known mix of requests (answered, 400, 404, 413,
415, LATE) over the inspect API, OIP HTTP and gRPC, with the front ends in the serving process
and in ``--frontends 2`` processes. A plant alerts on these counters, so each answer must be
counted exactly once, whichever part of the server gave it, and the queue depth must read 0
once the last request is answered.
"""

from __future__ import annotations

import base64
import time
from collections import Counter

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2_grpc

from tests.conftest import start_server
from visionserve_tools.benchclient import wire

MAX_BODY = 256 * 1024
UNKNOWN = "no-such-model-from-a-client"


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, (sorted label items)): value} of every visionserve_ sample."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("visionserve_")}


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def inspect(url: str, body: bytes, content_type: str = "image/jpeg", model: str = "tiny",
            **headers) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/{model}/inspect", content=body, timeout=60,
                      headers={"Content-Type": content_type, **headers})


def oip_json(url: str, image: bytes, model: str = "tiny", input_name: str = "image",
             timeout_us: int | None = None) -> httpx.Response:
    req: dict = {"inputs": [{"name": input_name, "shape": [1], "datatype": "BYTES",
                             "data": [base64.b64encode(image).decode()]}]}
    if timeout_us is not None:
        req["parameters"] = {"timeout": timeout_us}
    return httpx.post(f"{url}/v2/models/{model}/infer", json=req, timeout=60)


def grpc_status(stub, image: bytes, model: str = "tiny", deadline_ms: float | None = None) -> str:
    try:
        stub.ModelInfer(wire.grpc_request(model, image, deadline_ms), timeout=60)
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


@pytest.fixture(scope="module", params=[(), ("--frontends", "2")], ids=["in-process", "frontends-2"])
def server(request, tiny_repo, tmp_path_factory):
    s = start_server(tiny_repo, tmp_path_factory.mktemp("metrics"), "--max-body-bytes", str(MAX_BODY),
                     *request.param)
    yield s
    s.stop()


def test_every_counter_matches_the_answers_given(server, jpeg_bytes):
    assert len(jpeg_bytes) < MAX_BODY
    url = server.url
    before = scrape(url)
    got: Counter = Counter()  # (api, status) as received

    def note(api: str, r: httpx.Response) -> None:
        got[(api, r.status_code)] += 1
        if r.status_code == 504 and api == "inspect":
            body = r.json()
            assert body["verdict"] == "LATE" and body["deadline_met"] is False and body["late_ms"] >= 0

    for _ in range(5):
        note("inspect", inspect(url, jpeg_bytes))
    note("inspect", inspect(url, b"this is not an image"))
    note("inspect", inspect(url, b"\xff\xd8\xff\xd9"))  # a JPEG with no image in it
    note("inspect", inspect(url, jpeg_bytes, **{"X-Deadline-Ms": "soon"}))
    note("inspect", inspect(url, jpeg_bytes, **{"X-Deadline-Ms": "-5"}))  # refused by the engine
    for i in range(2):
        note("inspect", inspect(url, jpeg_bytes, model=f"{UNKNOWN}-{i}"))
    for _ in range(2):
        note("inspect", inspect(url, jpeg_bytes, content_type="text/plain"))
    note("inspect", inspect(url, b"\0" * (MAX_BODY + 1)))
    for _ in range(3):
        note("inspect", inspect(url, jpeg_bytes, **{"X-Deadline-Ms": "0.001"}))

    note("oip", oip_json(url, jpeg_bytes))
    note("oip", oip_json(url, jpeg_bytes, model=UNKNOWN))
    note("oip", oip_json(url, jpeg_bytes, input_name="pixels"))
    note("oip", oip_json(url, jpeg_bytes, timeout_us=1))

    channel = grpc.insecure_channel(server.grpc_url)
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for model, deadline_ms in (("tiny", None), (UNKNOWN, None), ("tiny", 0.001)):
            got[("grpc", grpc_status(stub, jpeg_bytes, model, deadline_ms))] += 1
    finally:
        channel.close()

    # the mix came back as intended (else the counts below would test something else)
    assert got == Counter({("inspect", 200): 5, ("inspect", 400): 4, ("inspect", 404): 2,
                           ("inspect", 415): 2, ("inspect", 413): 1, ("inspect", 504): 3,
                           ("oip", 200): 1, ("oip", 404): 1, ("oip", 400): 1, ("oip", 504): 1,
                           ("grpc", "OK"): 1, ("grpc", "NOT_FOUND"): 1,
                           ("grpc", "DEADLINE_EXCEEDED"): 1}), got
    answered, late = 5 + 1 + 1, 3 + 1 + 1
    want = {
        ("visionserve_requests_total", "tiny", "success"): answered,
        ("visionserve_requests_total", "tiny", "invalid_input"): 4 + 1,
        ("visionserve_requests_total", "_unknown", "not_found"): 2 + 1 + 1,
        ("visionserve_requests_total", "tiny", "unsupported_media_type"): 2,
        ("visionserve_requests_total", "tiny", "too_large"): 1,
        ("visionserve_requests_total", "tiny", "deadline"): late,
        ("visionserve_frames_total", "tiny", "verdict"): answered,  # OK + NG
        ("visionserve_frames_total", "tiny", "late"): late,
        ("visionserve_frames_total", "tiny", "invalid"): 1,  # the engine's 400 (front ends' are not frames)
        ("visionserve_deadline_misses_total", "tiny", None): late,
        ("visionserve_request_duration_seconds_count", "tiny", None): answered,
    }

    def counted() -> tuple[dict, dict]:
        after = scrape(url)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()
                 if k[0].endswith("_total") or k[0].endswith("_count")}
        out: Counter = Counter()
        for (name, labels), d in delta.items():
            if not d or name not in {k[0] for k in want}:
                continue
            lab = dict(labels)
            outcome = lab.get("outcome")
            if name == "visionserve_frames_total" and outcome in ("OK", "NG"):
                outcome = "verdict"
            out[(name, lab.get("model"), outcome)] += d
        return dict(out), after

    # with front-end processes a front end's count reaches the serving process on its own channel,
    # which may be read after the scrape that another front end forwards: wait for it, briefly
    end = time.monotonic() + 10
    while True:
        have, after = counted()
        if have == want or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert have == want
    assert value(after, "visionserve_queue_depth", model="tiny") == 0
    assert value(after, "visionserve_inflight_batches", model="tiny") == 0
    assert not [k for k in after if any(UNKNOWN in v for _, v in k[1])], "a client's string became a label"
