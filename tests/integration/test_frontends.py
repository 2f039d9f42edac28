"""``visionserve serve --frontends N``: several front-end processes, one engine, real clients.

The answers must be the ones the in-process front end gives; the protocol behaviour (errors,
statistics, metrics, health, gRPC) the same; a front end that dies is replaced while the others
keep serving. SIGTERM under load is in test_shutdown.py (run with and without front ends).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import start_server, wait_for

INSPECT = "/v1/models/tiny/inspect"
JPEG = {"Content-Type": "image/jpeg"}


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended since the listing
            continue
        out += [int(c) for c in text]
    return out


@pytest.fixture(scope="module")
def fe_server(tiny_repo, tmp_path_factory):
    s = start_server(tiny_repo, tmp_path_factory.mktemp("fe"), "--frontends", "2")
    yield s
    s.stop()


def test_a_front_end_decodes_under_the_servers_pixel_limit_not_its_environments(tiny_repo,
                                                                                   tmp_path):
    """The annotated answer's image is decoded in the front-end process: with OpenCV's limit
    at 1,000 pixels in the environment the server starts from, a 640x480 PNG within the
    server's ``--max-image-pixels`` still comes back annotated (it was a 500)."""
    import cv2

    s = start_server(tiny_repo, tmp_path, "--frontends", "1", grpc=False,
                     env={"OPENCV_IO_MAX_IMAGE_PIXELS": "1000"})
    try:
        ok, png = cv2.imencode(".png", np.full((480, 640, 3), 90, np.uint8))
        r = httpx.post(s.url + INSPECT, content=png.tobytes(), timeout=30,
                       headers={"Content-Type": "image/png", "Accept": "image/jpeg"})
        assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg", r.text
        assert cv2.imdecode(np.frombuffer(r.content, np.uint8), cv2.IMREAD_COLOR).shape[:2] \
            == (480, 640)
    finally:
        s.stop()


def test_two_front_end_processes_are_started(fe_server):
    kids = children(fe_server.proc.pid)
    assert len(kids) >= 2
    cmdlines = [Path(f"/proc/{k}/cmdline").read_bytes() for k in kids]
    assert sum(b"visionserve.runtime.frontend" in c for c in cmdlines) == 2


def test_answers_equal_the_in_process_front_end(fe_server, tiny_server, jpeg_bytes):
    with httpx.Client(timeout=30) as c:
        for body in (jpeg_bytes, np.full((32, 48, 3), 90, np.uint8).tobytes()):
            headers = JPEG if body is jpeg_bytes else {"Content-Type": "application/octet-stream",
                                                       "X-Image-Shape": "32x48x3"}
            a = c.post(fe_server.url + INSPECT, content=body, headers={**headers, "X-Part-Id": "p7"})
            b = c.post(tiny_server.url + INSPECT, content=body, headers=headers)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            ja, jb = a.json(), b.json()
            assert ja["part_id"] == "p7"
            assert (ja["verdict"], ja["label"]) == (jb["verdict"], jb["label"])
            assert ja["scores"] == pytest.approx(jb["scores"], abs=1e-5)


def test_many_clients_at_once_each_get_their_own_answer(fe_server, tiny_repo):
    """Frames of different content through both front ends at once: nobody gets another's answer."""
    import cv2

    bodies = {}
    for v in range(0, 256, 16):  # 16 distinct images, each with a known answer
        _ok, buf = cv2.imencode(".png", np.full((40, 40, 3), v, np.uint8))
        bodies[v] = buf.tobytes()
    with httpx.Client(timeout=30) as c:
        expected = {v: c.post(fe_server.url + INSPECT, content=b,
                              headers={"Content-Type": "image/png"}).json()["scores"]
                    for v, b in bodies.items()}
    errors, mismatches = [], []

    def client(k: int) -> None:
        with httpx.Client(timeout=30) as c:
            for i in range(12):
                v = list(bodies)[(k + i) % len(bodies)]
                r = c.post(fe_server.url + INSPECT, content=bodies[v],
                           headers={"Content-Type": "image/png", "X-Part-Id": f"{k}-{i}-{v}"})
                if r.status_code != 200:
                    errors.append(r.text)
                elif r.json()["part_id"] != f"{k}-{i}-{v}" or \
                        r.json()["scores"] != pytest.approx(expected[v], abs=1e-5):
                    mismatches.append((k, i, v))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not mismatches


def test_oip_http_and_grpc_through_front_ends(fe_server, jpeg_bytes):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    arr = np.array([[jpeg_bytes]], dtype=object)
    hc = httpclient.InferenceServerClient(f"127.0.0.1:{fe_server.http_port}")
    inp = httpclient.InferInput("image", [1, 1], "BYTES")
    inp.set_data_from_numpy(arr, binary_data=True)
    h = hc.infer("tiny", [inp]).as_numpy("label")
    gc = grpcclient.InferenceServerClient(fe_server.grpc_url)
    assert gc.is_server_ready() and gc.is_model_ready("tiny")
    ginp = grpcclient.InferInput("image", [1, 1], "BYTES")
    ginp.set_data_from_numpy(arr)
    g = gc.infer("tiny", [ginp]).as_numpy("label")
    assert h.tolist() == g.tolist()
    assert gc.get_model_metadata("tiny").name == "tiny"
    stats = gc.get_inference_statistics("tiny")
    assert stats.model_stats[0].inference_count >= 2
    with pytest.raises(Exception, match="unknown model"):
        gc.infer("nope", [ginp])


def test_errors_stats_metrics_and_health(fe_server, jpeg_bytes):
    with httpx.Client(timeout=30) as c:
        assert c.get(fe_server.url + "/v2/health/ready").json() == {"ready": True}
        assert c.get(fe_server.url + "/v2/models/tiny/ready").status_code == 200
        r = c.post(fe_server.url + INSPECT, content=b"not an image", headers=JPEG)
        assert r.status_code == 400 and "not an image" in r.json()["error"]
        r = c.post(fe_server.url + "/v1/models/nope/inspect", content=jpeg_bytes, headers=JPEG)
        assert r.status_code == 404
        r = c.post(fe_server.url + INSPECT, content=jpeg_bytes, headers={**JPEG, "X-Priority": "99"})
        assert r.status_code == 400 and "priority" in r.json()["error"]  # the engine's check, sent back
        r = c.post(fe_server.url + INSPECT, content=jpeg_bytes, headers={**JPEG, "X-Deadline-Ms": "0.001"})
        assert r.status_code == 504 and r.json()["verdict"] == "LATE"
        before = c.get(fe_server.url + "/v2/models/tiny/stats").json()["model_stats"][0]["inference_count"]
        assert c.post(fe_server.url + INSPECT, content=jpeg_bytes, headers=JPEG).status_code == 200
        after = c.get(fe_server.url + "/v2/models/tiny/stats").json()["model_stats"][0]["inference_count"]
        assert after == before + 1  # counted once, in the engine, whichever front end took it
        metrics = c.get(fe_server.url + "/metrics").text
        assert 'visionserve_model_ready{model="tiny",version="1"} 1.0' in metrics
        assert "visionserve_batch_size_bucket" in metrics
    assert "Traceback" not in fe_server.log()


def test_frames_larger_than_the_arena_are_served(tiny_repo, tmp_path):
    s = start_server(tiny_repo, tmp_path, "--frontends", "1", "--frontend-arena-bytes", str(1024**2),
                     grpc=False)
    try:
        pixels = np.random.default_rng(0).integers(0, 255, (800, 600, 3), dtype=np.uint8)  # 1.44 MB
        with httpx.Client(timeout=30) as c:
            r = c.post(s.url + INSPECT, content=pixels.tobytes(),
                       headers={"Content-Type": "application/octet-stream", "X-Image-Shape": "800x600x3"})
        assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0


def test_a_dead_front_end_is_replaced_and_the_server_keeps_serving(tiny_repo, tmp_path, jpeg_bytes):
    s = start_server(tiny_repo, tmp_path, "--frontends", "2", grpc=False)
    try:
        first = set(children(s.proc.pid))
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            kids = set(children(s.proc.pid)) - {victim}
            if len(kids) >= 2 and kids != first - {victim}:
                break
            time.sleep(0.1)
        else:
            pytest.fail("no new front end after 60 s:\n" + s.log())
        s.wait_ready()
        with httpx.Client(timeout=30) as c:  # new connections land on either process
            codes = [c.post(s.url + INSPECT, content=jpeg_bytes, headers={**JPEG, "Connection": "close"})
                     .status_code for _ in range(20)]
        assert codes == [200] * 20
        assert f"front end 0 (pid {victim})" in s.log() or f"(pid {victim}) exited" in s.log()
    finally:
        assert s.stop() == 0


def test_port_in_use_is_a_clear_error(tiny_repo, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = start_server(tiny_repo, tmp_path, "--frontends", "2", "--http-port", str(port), wait=False)
        assert s.proc.wait(60) == 2
    assert "cannot listen on" in s.log() and "Traceback" not in s.log()


def test_a_model_that_fails_to_load_exits_3_and_leaves_no_front_end(tmp_path):
    import shutil

    from tests.conftest import REPO

    repo = tmp_path / "repo"
    shutil.copytree(REPO / "models" / "defect-classifier", repo / "broken",
                    ignore=shutil.ignore_patterns("*.pt2", "*.pt", "*.png"))
    (repo / "broken" / "model.toml").write_text(
        (repo / "broken" / "model.toml").read_text().replace('name = "defect-classifier"', ""))
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    s = start_server(repo, tmp_path, "--frontends", "2", grpc=False, wait=False)
    from visionserve.guard.proc import starttime

    kids_seen: dict[int, int | None] = {}  # pid -> its start time (a pid is reused once gone)
    end = time.monotonic() + 60
    while s.proc.poll() is None and time.monotonic() < end:
        if Path(f"/proc/{s.proc.pid}").exists():
            for k in children(s.proc.pid):
                kids_seen.setdefault(k, starttime(k))
        time.sleep(0.05)
    assert s.proc.wait(5) == 3, s.log()

    def front_ends_left() -> list[int]:
        left = []
        for k, started in kids_seen.items():
            try:
                if starttime(k) == started and \
                        b"runtime.frontend" in Path(f"/proc/{k}/cmdline").read_bytes():
                    left.append(k)
            except OSError:  # gone
                pass
        return left

    # they leave on their own (the serving process's end of the channel closed, and
    # PR_SET_PDEATHSIG); on a busy machine that may take longer than half a second
    wait_for(lambda: not front_ends_left(), timeout=10, what="front ends to leave")
    assert "start-up failed" in s.log()


# --- a sick serving process ---------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _front_ends(s) -> list[int]:
    kids = [k for k in children(s.proc.pid) if b"runtime.frontend" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert kids, s.log()
    return kids


def _post(client: httpx.Client, url: str, body: bytes, headers: dict, out: list) -> None:
    t0 = time.monotonic()
    try:
        r = client.post(url + INSPECT, content=body, headers=headers)
        out.append((r.status_code, time.monotonic() - t0, r.text))
    except httpx.HTTPError as exc:
        out.append((type(exc).__name__, time.monotonic() - t0, str(exc)))


def _clients(s, n: int) -> list[httpx.Client]:
    """``n`` clients, each connected already (what is timed is the request, not a connection)."""
    clients = [httpx.Client(timeout=30) for _ in range(n)]
    for c in clients:
        assert c.get(s.url + "/v2/health/live").status_code == 200
    return clients


def test_a_frozen_serving_process_answers_deadlines_and_turns_not_ready(tiny_repo, server_factory):
    """SIGSTOP the serving process: the front end answers 504 at each request's own deadline, turns
    not ready within the heartbeat window, and refuses new work with 503; after SIGCONT it serves
    again, and every frame gets its own answer (the arena space of the abandoned requests was not
    handed to new frames while the serving process could still read it)."""
    import cv2

    from visionserve.frontends.remote import HEARTBEAT_TIMEOUT_S

    s = server_factory(tiny_repo, "--frontends", "1", grpc=False)
    bodies = {v: cv2.imencode(".png", np.full((40, 40, 3), v, np.uint8))[1].tobytes() for v in (20, 120, 220)}
    png = {"Content-Type": "image/png"}
    with httpx.Client(timeout=30) as c:
        expected = {v: c.post(s.url + INSPECT, content=b, headers=png).json()["scores"] for v, b in bodies.items()}
    clients = _clients(s, len(bodies))
    try:
        os.kill(s.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out: list = []
        threads = [threading.Thread(target=_post, args=(c, s.url, bodies[v], {**png, "X-Deadline-Ms": "200"}, out))
                   for c, v in zip(clients, bodies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [o[0] for o in out] == [504] * 3, out
        assert all(0.19 < o[1] < 0.6 for o in out), out  # at the deadline, not when the engine wakes
        assert all('"verdict":"LATE"' in o[2] for o in out)
        wait_for(lambda: httpx.get(s.url + "/v2/health/ready", timeout=5).status_code == 503,
                 timeout=HEARTBEAT_TIMEOUT_S + 2, what="readiness false")
        assert time.monotonic() - stopped < HEARTBEAT_TIMEOUT_S + 1.0
        t0 = time.monotonic()
        r = httpx.post(s.url + INSPECT, content=bodies[20], headers={**png, "X-Deadline-Ms": "5000"}, timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after") and time.monotonic() - t0 < 0.5, r.text
        assert "not answering" in r.json()["error"]
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
        for c in clients:
            c.close()
    wait_for(lambda: httpx.get(s.url + "/v2/health/ready", timeout=5).status_code == 200,
             timeout=10, what="ready again")
    with httpx.Client(timeout=30) as c:
        for v in list(bodies) * 3:
            r = c.post(s.url + INSPECT, content=bodies[v], headers=png)
            assert r.status_code == 200 and r.json()["scores"] == pytest.approx(expected[v], abs=1e-5)
    assert "engine process has not answered" in s.log() and "Traceback" not in s.log()
    assert s.stop() == 0


def test_a_killed_serving_process_takes_its_front_ends_along_at_once(tiny_repo, server_factory, jpeg_bytes):
    """SIGKILL the serving process while clients have requests in progress (one waiting for the
    engine, one sending its body slowly, one gRPC stream): the front ends answer 503 and exit within
    a second or two, and both ports can be bound again."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from visionserve import oip

    s = server_factory(tiny_repo, "--frontends", "2")
    fronts = _front_ends(s)
    slow = socket.create_connection(("127.0.0.1", s.http_port))
    slow.sendall(b"POST " + INSPECT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                 b"Content-Length: 100000\r\n\r\n" + jpeg_bytes[:1000])
    channel = grpc.insecure_channel(s.grpc_url)
    release = threading.Event()

    def requests():
        request = service_pb2.ModelInferRequest(model_name="tiny", id="s1")
        request.inputs.add(name="image", datatype="BYTES", shape=[1])
        request.raw_input_contents.append(oip.serialize_bytes(np.array([jpeg_bytes], dtype=object)))
        yield request
        release.wait(30)

    stream = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests(), timeout=60)
    assert next(stream).infer_response.id == "s1"
    out: list = []
    (client,) = _clients(s, 1)
    try:
        os.kill(s.proc.pid, signal.SIGSTOP)  # so that a request is surely in progress in the engine
        waiting = threading.Thread(target=_post, args=(client, s.url, jpeg_bytes,
                                                       {**JPEG, "X-Deadline-Ms": "20000"}, out))
        waiting.start()
        time.sleep(0.3)
        os.kill(s.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        s.proc.wait(10)
        wait_for(lambda: not any(_alive(p) for p in fronts), timeout=10, what="front ends gone")
        gone = time.monotonic() - killed
        waiting.join(10)
        assert out and out[0][0] == 503, out
        assert gone < 2.0, f"front ends exited {gone:.2f} s after the serving process died"
        for port in (s.http_port, s.grpc_port):
            with socket.socket() as again:  # a restart's bind: SO_REUSEADDR, no SO_REUSEPORT
                again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                again.bind(("127.0.0.1", port))
                again.listen()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        release.set()
        slow.close()
        channel.close()
        client.close()
        for p in fronts:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_as_shipped_on_the_cpu_the_front_end_runs_in_the_serving_process(tiny_repo, tmp_path):
    """With no --frontends and no --gpu-batch-processes the server chooses, and says so: on the
    CPU, none of either (the model's threads use the cores)."""
    s = start_server(tiny_repo, tmp_path, grpc=False, as_shipped=True)
    try:
        assert "execution: 0 front-end process(es), 0 batch worker(s) per model instance" \
            in s.log()
        assert not children(s.proc.pid)
        assert httpx.get(f"{s.url}/v2/health/ready").status_code == 200
    finally:
        s.stop()
