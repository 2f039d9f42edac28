"""A failed request can be traced: the request id a client got with its error is in the log line
that explains the failure, whichever thread wrote it (the runner threads log a batch's failure
with the ids of the requests in it)."""

from __future__ import annotations

import json
import logging

import cv2
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import TINY_TOML, export_onnx, start_server, wait_for
from tritonclient.utils import InferenceServerException

from visionserve.logs import JsonFormatter, RequestIdFilter, batch_ids, request_id


@pytest.fixture(scope="module")
def failing_server(tmp_path_factory):
    """A server on a model that runs on warm-up's black frames but fails on bright ones (an index
    out of range in onnxruntime): every bright frame is a 500."""
    import torch

    class FailsOnBright(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.eye(3))

        def forward(self, x):
            row = (x.amax(dim=(1, 2, 3)) > 0.5).long() * 7  # row 7 of 3: out of range
            return torch.index_select(self.table, 0, row)

    root = tmp_path_factory.mktemp("failing")
    export_onnx(FailsOnBright(), root / "fails", (2, 3, 32, 32), TINY_TOML)
    s = start_server(root, tmp_path_factory.mktemp("srv"))
    yield s
    s.stop()


WHITE = np.full((32, 32, 3), 255, np.uint8)


def _logged(server, rid: str) -> str:
    return wait_for(lambda: "\n".join(ln for ln in server.log().splitlines() if rid in ln), 10,
                    f"a log line naming {rid}")


def test_http_500_is_traceable_by_its_request_id(failing_server):
    r = httpx.post(failing_server.url + "/v1/models/fails/inspect", content=WHITE.tobytes(), timeout=30,
                   headers={"Content-Type": "application/octet-stream", "X-Image-Shape": "32x32x3",
                            "X-Request-Id": "line7-frame-0042"})
    assert r.status_code == 500, r.text
    assert r.headers["x-request-id"] == "line7-frame-0042"
    lines = _logged(failing_server, "line7-frame-0042")
    assert "ERROR" in lines and "failed" in lines


def test_http_500_without_a_client_id_is_traceable_too(failing_server):
    r = httpx.post(failing_server.url + "/v1/models/fails/inspect", content=WHITE.tobytes(), timeout=30,
                   headers={"Content-Type": "application/octet-stream", "X-Image-Shape": "32x32x3"})
    assert r.status_code == 500
    assert "ERROR" in _logged(failing_server, r.headers["x-request-id"])


def test_grpc_internal_error_is_traceable_by_its_request_id(failing_server):
    png = cv2.imencode(".png", WHITE)[1]
    inp = grpcclient.InferInput("image", [1], "BYTES")
    inp.set_data_from_numpy(np.array([png.tobytes()], dtype=np.object_))
    client = grpcclient.InferenceServerClient(failing_server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.infer("fails", [inp], request_id="grpc-frame-0007")
    assert err.value.status() == "StatusCode.INTERNAL"
    assert "ERROR" in _logged(failing_server, "grpc-frame-0007")


# --- the filter and the JSON lines, in this process ----------------------------------------------


def _record(**extra) -> logging.LogRecord:
    logger = logging.getLogger("visionserve.test")
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "batch failed", (), None,
                               extra=extra or None)
    assert RequestIdFilter().filter(record)
    return record


def test_log_records_carry_the_current_request_id_in_both_formats():
    token = request_id.set("req-9")
    try:
        record = _record()
    finally:
        request_id.reset(token)
    assert json.loads(JsonFormatter().format(record))["request_id"] == "req-9"
    plain = logging.Formatter("%(levelname)s [%(request_id)s]: %(message)s").format(record)
    assert plain == "ERROR [req-9]: batch failed"
    assert _record().request_id == "-"  # outside a request


def test_a_batch_line_names_every_request_in_the_batch():
    class Item:
        def __init__(self, rid: str) -> None:
            self.request_id = rid

    record = _record(**batch_ids([Item("a"), Item("b"), Item("a")]))
    assert json.loads(JsonFormatter().format(record))["request_id"] == "a,b"
