"""The gRPC front end with Triton's own clients (tritonclient.grpc sync, aio, streaming) and the
raw generated stub, against a real ``visionserve serve`` on loopback."""

from __future__ import annotations

import asyncio
import queue
import signal
import struct
import time

import cv2
import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from conftest import assert_same_answer, inspect_answer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from visionserve import oip
from visionserve.grpc.convert import deadline_ms

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tiny_server):
    c = grpcclient.InferenceServerClient(tiny_server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(tiny_server):
    channel = grpc.insecure_channel(tiny_server.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def rgb_frame(h: int = 48, w: int = 64, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def bytes_input(images: list[bytes], name: str = "image") -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, [len(images)], "BYTES")
    inp.set_data_from_numpy(np.array(images, dtype=np.object_))
    return inp


# --- health, metadata, configuration ------------------------------------------------------------

def test_live_ready_and_model_ready(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("no-such-model")
    assert not client.is_model_ready(MODEL, "7")


def test_server_metadata_lists_the_supported_extensions(client):
    md = client.get_server_metadata(as_json=True)
    assert md["name"] == "visionserve"
    assert md["extensions"] == oip.EXTENSIONS


def test_model_metadata_and_config(client):
    md = client.get_model_metadata(MODEL, as_json=True)
    assert md["name"] == MODEL and md["versions"] == ["1"]
    assert md["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": ["-1", "1"]}]
    assert [o["name"] for o in md["outputs"]] == ["scores", "label", "verdict"]
    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert config["max_batch_size"] == 8
    assert config["input"][0]["name"] == "image" and config["input"][0]["data_type"] == "TYPE_STRING"
    assert config["dynamic_batching"]["preferred_batch_size"] == [1, 2, 4, 8]
    assert config["parameters"]["labels"]["string_value"] == "ok,dent,scratch"


def test_unknown_model_metadata_is_not_found(client):
    for call in (client.get_model_metadata, client.get_model_config):
        with pytest.raises(InferenceServerException) as err:
            call("no-such-model")
        assert err.value.status() == "StatusCode.NOT_FOUND"
        assert "no-such-model" in err.value.message()


def test_health_service_says_serving(tiny_server):
    with grpc.insecure_channel(tiny_server.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            # the health service follows readiness within a poll period (0.2 s) of HTTP's
            end = time.monotonic() + 10
            while True:
                answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                if answer.status == health_pb2.HealthCheckResponse.SERVING or time.monotonic() > end:
                    break
                time.sleep(0.05)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_unsupported_rpcs_answer_unimplemented(client):
    for call in (client.get_system_shared_memory_status, client.get_trace_settings):
        status, message = _status(call)
        assert status == "StatusCode.UNIMPLEMENTED" and "visionserve does not implement" in message
    # the repository extension is there (test_repository_control.py); this server's mode refuses
    status, message = _status(lambda: client.load_model(MODEL))
    assert status == "StatusCode.FAILED_PRECONDITION" and "--model-control-mode none" in message


# --- inference ----------------------------------------------------------------------------------

def test_bytes_jpeg_frames_match_the_inspect_api(client, tiny_server, jpeg_bytes):
    _ok, png = cv2.imencode(".png", cv2.cvtColor(rgb_frame(), cv2.COLOR_RGB2BGR))
    images = [jpeg_bytes, png.tobytes(), jpeg_bytes]
    result = client.infer(MODEL, [bytes_input(images)], request_id="req-1")
    assert result.get_response().id == "req-1"
    assert result.as_numpy("scores").shape == (3, 3)
    assert result.as_numpy("scores").dtype == np.float32
    assert result.as_numpy("label").shape == (3,)
    for i, (image, kind) in enumerate(zip(images, ["image/jpeg", "image/png", "image/jpeg"])):
        assert_same_answer(result, i, inspect_answer(tiny_server, image, kind))


def test_bytes_input_of_shape_n_by_1(client, jpeg_bytes):
    inp = grpcclient.InferInput("image", [2, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[jpeg_bytes], [jpeg_bytes]], dtype=np.object_))
    result = client.infer(MODEL, [inp])
    assert result.as_numpy("scores").shape == (2, 3)


def test_uint8_nhwc_frames_match_the_inspect_api(client, tiny_server):
    frames = np.stack([rgb_frame(seed=s) for s in (1, 2)])
    inp = grpcclient.InferInput("image", list(frames.shape), "UINT8")
    inp.set_data_from_numpy(frames)
    result = client.infer(MODEL, [inp], outputs=[grpcclient.InferRequestedOutput("scores"),
                                                 grpcclient.InferRequestedOutput("label"),
                                                 grpcclient.InferRequestedOutput("verdict")])
    for i in range(2):
        answer = inspect_answer(tiny_server, frames[i].tobytes(), "application/octet-stream", "48x64x3")
        assert_same_answer(result, i, answer)


def test_only_the_requested_outputs_come_back(client, jpeg_bytes):
    result = client.infer(MODEL, [bytes_input([jpeg_bytes])],
                          outputs=[grpcclient.InferRequestedOutput("verdict")])
    assert [o.name for o in result.get_response().outputs] == ["verdict"]
    assert result.as_numpy("verdict")[0] in (b"OK", b"NG")


def test_typed_contents_instead_of_raw_input_contents(stub, jpeg_bytes):
    """Clients other than tritonclient may fill the typed ``contents`` fields."""
    request = service_pb2.ModelInferRequest(model_name=MODEL, id="typed")
    inp = request.inputs.add(name="image", datatype="BYTES", shape=[1])
    inp.contents.bytes_contents.append(jpeg_bytes)
    response = stub.ModelInfer(request, timeout=30)
    assert response.id == "typed"
    assert [o.name for o in response.outputs] == ["scores", "label", "verdict"]
    scores = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
    assert scores.shape == (3,) and abs(float(scores.sum()) - 1.0) < 1e-4
    (length,) = struct.unpack_from("<I", response.raw_output_contents[2])
    assert response.raw_output_contents[2][4:4 + length] in (b"OK", b"NG")

    frame = rgb_frame(8, 8)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    inp = request.inputs.add(name="image", datatype="UINT8", shape=[1, 8, 8, 3])
    inp.contents.uint_contents.extend(frame.reshape(-1).tolist())
    assert stub.ModelInfer(request, timeout=30).outputs[0].shape == [1, 3]


@pytest.fixture(scope="module")
def png_1080p() -> bytes:
    noise = np.random.default_rng(3).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    _ok, png = cv2.imencode(".png", noise, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    return png.tobytes()


def test_a_1080p_png_fits_the_default_message_size(client, png_1080p):
    assert len(png_1080p) > 4 * 1024**2  # bigger than gRPC's 4 MiB default
    result = client.infer(MODEL, [bytes_input([png_1080p])], client_timeout=60)
    assert result.as_numpy("scores").shape == (1, 3)


def test_statistics_count_inferences(client, jpeg_bytes):
    client.infer(MODEL, [bytes_input([jpeg_bytes])])
    stats = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
    assert stats["name"] == MODEL and stats["version"] == "1"
    assert int(stats["inference_count"]) >= 1
    assert int(stats["inference_stats"]["success"]["count"]) >= 1
    every = client.get_inference_statistics(as_json=True)["model_stats"]
    assert [s["name"] for s in every] == [MODEL]


# --- errors -------------------------------------------------------------------------------------

def _status(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def test_errors_map_to_grpc_status_codes(client, jpeg_bytes):
    status, message = _status(lambda: client.infer("no-such-model", [bytes_input([jpeg_bytes])]))
    assert status == "StatusCode.NOT_FOUND" and "no-such-model" in message
    status, message = _status(lambda: client.infer(MODEL, [bytes_input([jpeg_bytes])], model_version="9"))
    assert status == "StatusCode.NOT_FOUND"
    status, message = _status(lambda: client.infer(MODEL, [bytes_input([jpeg_bytes], name="pixels")]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "pixels" in message
    status, message = _status(lambda: client.infer(MODEL, [bytes_input([b"not an image at all"])]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "image 0" in message
    status, message = _status(lambda: client.infer(MODEL, [bytes_input([jpeg_bytes[:2000]])]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "truncated" in message
    status, message = _status(lambda: client.infer(
        MODEL, [bytes_input([jpeg_bytes])], outputs=[grpcclient.InferRequestedOutput("boxes")]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "boxes" in message
    wrong = grpcclient.InferInput("image", [1], "FP32")
    wrong.set_data_from_numpy(np.zeros(1, np.float32))
    status, message = _status(lambda: client.infer(MODEL, [wrong]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "FP32" in message
    short = grpcclient.InferInput("image", [1, 8, 8, 3], "UINT8")
    short.set_data_from_numpy(np.zeros((1, 8, 8, 3), np.uint8))
    short._raw_content = short._raw_content[:-1]
    status, message = _status(lambda: client.infer(MODEL, [short]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "192" in message


def test_deadline_parameter_and_grpc_deadline(client, jpeg_bytes, png_1080p):
    # timeout parameter (microseconds): 1 us cannot be met
    status, _message = _status(lambda: client.infer(MODEL, [bytes_input([jpeg_bytes])], timeout=1))
    assert status == "StatusCode.DEADLINE_EXCEEDED"
    # the client's gRPC deadline (decoding four 1080p PNGs takes far longer than 5 ms): answered
    # DEADLINE_EXCEEDED by the server or by the channel, whichever notices first
    status, _ = _status(lambda: client.infer(MODEL, [bytes_input([png_1080p] * 4)], client_timeout=0.005))
    assert status == "StatusCode.DEADLINE_EXCEEDED"
    # the server is fine afterwards
    assert client.infer(MODEL, [bytes_input([jpeg_bytes])], client_timeout=30).as_numpy("label").shape == (1,)


def test_tighter_of_timeout_parameter_and_grpc_deadline_wins():
    assert deadline_ms(None, None) is None
    assert deadline_ms(500.0, None) == 500.0
    assert deadline_ms(None, 0.25) == pytest.approx(250.0)
    assert deadline_ms(500.0, 0.25) == pytest.approx(250.0)
    assert deadline_ms(100.0, 0.25) == 100.0
    assert 0 < deadline_ms(100.0, -1.0) < 0.01  # already past: tiny, so the engine answers late


# --- asyncio client and streaming ---------------------------------------------------------------

def test_aio_client_concurrent_requests(tiny_server, jpeg_bytes):
    async def main() -> list:
        async with grpcaio.InferenceServerClient(tiny_server.grpc_url) as c:
            assert await c.is_server_ready()
            inputs = []
            for _ in range(6):
                inp = grpcaio.InferInput("image", [1], "BYTES")
                inp.set_data_from_numpy(np.array([jpeg_bytes], dtype=np.object_))
                inputs.append(inp)
            results = await asyncio.gather(*(c.infer(MODEL, [inp], request_id=str(i))
                                             for i, inp in enumerate(inputs)))
            with pytest.raises(InferenceServerException) as err:
                await c.infer("no-such-model", [inputs[0]])
            assert err.value.status() == "StatusCode.NOT_FOUND"
            return results

    results = asyncio.run(main())
    assert [r.get_response().id for r in results] == [str(i) for i in range(6)]
    first = results[0].as_numpy("scores")
    for r in results:
        np.testing.assert_allclose(r.as_numpy("scores"), first, atol=1e-5)


def test_stream_answers_every_request_and_survives_an_error(client, jpeg_bytes):
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        ids = [f"part-{i}" for i in range(6)]
        for part_id in ids:
            image = b"garbage, not a frame" if part_id == "part-2" else jpeg_bytes
            client.async_stream_infer(MODEL, [bytes_input([image])], request_id=part_id)
        got = [answers.get(timeout=30) for _ in ids]
    finally:
        client.stop_stream()
    errors = [e for _, e in got if e is not None]
    results = {r.get_response().id: r for r, e in got if e is None}
    assert len(errors) == 1 and "not an image" in errors[0].message()
    assert set(results) == set(ids) - {"part-2"}
    for r in results.values():
        assert r.as_numpy("verdict")[0] in (b"OK", b"NG")


def test_stream_error_answer_carries_the_request_id(stub, jpeg_bytes):
    def requests():
        for part_id, image in (("a", jpeg_bytes), ("b", b"\xff\xd8\xff broken"), ("c", jpeg_bytes)):
            request = service_pb2.ModelInferRequest(model_name=MODEL, id=part_id)
            request.inputs.add(name="image", datatype="BYTES", shape=[1])
            request.raw_input_contents.append(oip.serialize_bytes(np.array([image], dtype=object)))
            yield request

    answers = list(stub.ModelStreamInfer(requests(), timeout=30))
    by_id = {a.infer_response.id: a for a in answers}
    assert set(by_id) == {"a", "b", "c"}
    assert by_id["b"].error_message and not by_id["b"].infer_response.outputs
    assert not by_id["a"].error_message and len(by_id["a"].infer_response.raw_output_contents) == 3


# --- limits and shutdown (own server) -----------------------------------------------------------

def test_message_size_limit_and_health_through_shutdown(tiny_repo, server_factory, jpeg_bytes):
    server = server_factory(tiny_repo, "--grpc-max-message-bytes", "65536")
    big = np.random.default_rng(0).integers(0, 256, (1, 160, 160, 3), dtype=np.uint8)  # 76800 bytes
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        inp = grpcclient.InferInput("image", list(big.shape), "UINT8")
        inp.set_data_from_numpy(big)
        status, _ = _status(lambda: c.infer(MODEL, [inp]))
        assert status == "StatusCode.RESOURCE_EXHAUSTED"
        assert c.infer(MODEL, [bytes_input([jpeg_bytes])]).as_numpy("scores").shape == (1, 3)

    with grpc.insecure_channel(server.grpc_url) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                          timeout=30)
        statuses = [next(watch).status]
        assert statuses == [health_pb2.HealthCheckResponse.SERVING]
        server.proc.send_signal(signal.SIGTERM)
        try:
            for answer in watch:
                statuses.append(answer.status)
                if answer.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
        except grpc.RpcError:
            pass
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    assert server.proc.wait(30) == 0


def test_stream_read_slowly_holds_a_bounded_number_of_answers(stub, tiny_server):
    """A client that sends fast and does not read: the server stops taking its requests once the
    answers it could not write yet reach the stream's bound (gRPC flow control then holds the
    client back), instead of computing every frame and keeping the answers in memory."""
    from visionserve.grpc.servicer import STREAM_INFLIGHT

    _, png = cv2.imencode(".png", np.full((32, 32, 3), 77, np.uint8))
    # the answer's size (one frame's scores, label and verdict) padded with a long request id, so
    # that what the transport buffers (socket buffers, HTTP/2 windows) holds few answers
    pad = "x" * 4000
    total = 16 * STREAM_INFLIGHT

    def requests():
        for i in range(total):
            request = service_pb2.ModelInferRequest(model_name=MODEL, id=f"{i}-{pad}")
            request.inputs.add(name="image", datatype="BYTES", shape=[1])
            request.raw_input_contents.append(oip.serialize_bytes(np.array([png.tobytes()], dtype=object)))
            yield request

    def served() -> int:
        return httpx.get(f"{tiny_server.url}/v2/models/{MODEL}/stats", timeout=10).json()[
            "model_stats"][0]["inference_count"]

    before = served()
    answers = stub.ModelStreamInfer(requests(), timeout=120)
    last, still = -1, time.monotonic()
    end = time.monotonic() + 30
    while time.monotonic() < end and time.monotonic() - still < 1.5:  # until the server stops taking
        time.sleep(0.1)
        now = served() - before
        if now != last:
            last, still = now, time.monotonic()
    held = served() - before
    assert held < total // 2, f"{held} of {total} computed for a client that read none"
    # now read them all: each request answered once (some may be refused: the queue is short)
    ids = [int(a.infer_response.id.split("-")[0]) for a in answers]
    assert sorted(ids) == list(range(total))
