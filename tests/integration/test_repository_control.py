"""Model repository control (Triton's extension) on a real server: tritonclient's index, load and
unload over HTTP and gRPC, swaps between versions whose answers differ, broken loads, unloads of a
model in use, the repository poll, and front-end processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import grpc
import httpx
import numpy as np
import pytest

from tests.conftest import TINY_TOML, make_tiny_model, quiet_client_gc, wait_for
from visionserve_tools.benchclient import wire

#: one frame, the same for every request: each version scores it its own way
FRAME = cv2.imencode(".png", np.full((32, 32, 3), 100, np.uint8))[1].tobytes()


def policy(folder: Path, versions: str) -> None:
    """Serve ``versions`` (a TOML array's text) of the model in ``folder`` at its next load."""
    (folder / "model.toml").write_text(TINY_TOML + f"[version_policy]\nspecific = {versions}\n")


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory) -> Path:
    """A model folder ``tiny`` with versions 1 and 2 (different weights: different scores)."""
    root = tmp_path_factory.mktemp("twoversions")
    make_tiny_model(root / "tiny")
    make_tiny_model(root / "scratch", seed=1)
    (root / "tiny" / "2").mkdir()
    shutil.copy(root / "scratch" / "1" / "model.onnx", root / "tiny" / "2" / "model.onnx")
    return root / "tiny"


@pytest.fixture
def repo(tmp_path, two_versions) -> Path:
    """A fresh repository: ``tiny`` (versions 1 and 2, serving 1) and ``idle`` (version 1)."""
    root = tmp_path / "repo"
    shutil.copytree(two_versions, root / "tiny")
    policy(root / "tiny", "[1]")
    shutil.copytree(two_versions, root / "idle", ignore=shutil.ignore_patterns("2"))
    (root / "idle" / "model.toml").write_text(TINY_TOML)
    return root


def inspect(server, model: str = "tiny") -> httpx.Response:
    return httpx.post(f"{server.url}/v1/models/{model}/inspect", content=FRAME,
                      headers={"Content-Type": "image/png"}, timeout=30)


def version_of(server, model: str = "tiny") -> str:
    r = inspect(server, model)
    assert r.status_code == 200, r.text
    return r.json()["version"]


def test_control_mode_none_refuses_load_and_unload(tiny_server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    r = httpx.post(f"{tiny_server.url}/v2/repository/models/tiny/load")
    assert r.status_code == 409 and "--model-control-mode none" in r.json()["error"]
    r = httpx.post(f"{tiny_server.url}/v2/repository/models/tiny/unload")
    assert r.status_code == 409 and "--model-control-mode explicit" in r.json()["error"]
    with pytest.raises(InferenceServerException, match="not allowed") as err:
        grpcclient.InferenceServerClient(tiny_server.grpc_url).load_model("tiny")
    assert err.value.status() == "StatusCode.FAILED_PRECONDITION"
    # the index is read-only: it answers in every mode
    index = httpclient.InferenceServerClient(tiny_server.url[7:]).get_model_repository_index()
    assert index == [{"name": "tiny", "version": "1", "state": "READY", "reason": ""}]
    assert "model_repository" in httpx.get(f"{tiny_server.url}/v2").json()["extensions"]
    assert version_of(tiny_server) == "1"


def test_tritonclient_repository_calls_over_http_and_grpc(server_factory, repo):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    from tritonclient.utils import InferenceServerException

    server = server_factory(repo, "--model-control-mode", "explicit")
    http = httpclient.InferenceServerClient(server.url[7:])
    rpc = grpcclient.InferenceServerClient(server.grpc_url)
    ready = [{"name": "idle", "version": "1", "state": "READY", "reason": ""},
             {"name": "tiny", "version": "1", "state": "READY", "reason": ""}]
    assert http.get_model_repository_index() == ready
    assert [(m.name, m.version, m.state) for m in rpc.get_model_repository_index().models] == \
        [(r["name"], r["version"], r["state"]) for r in ready]
    one = inspect(server).json()

    policy(repo / "tiny", "[2]")
    http.load_model("tiny")  # returns after the switch
    two = inspect(server).json()
    assert two["version"] == "2" and two["scores"] != one["scores"]
    assert http.get_model_repository_index()[1] == {"name": "tiny", "version": "2",
                                                    "state": "READY", "reason": ""}
    assert http.is_model_ready("tiny", "2") and not http.is_model_ready("tiny", "1")
    policy(repo / "tiny", "[1]")
    rpc.load_model("tiny")
    assert inspect(server).json()["scores"] == one["scores"]

    # a model no line uses unloads without force (tritonclient sends unload_dependents only)
    http.unload_model("idle")
    assert {"name": "idle", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"} in \
        http.get_model_repository_index()
    assert not http.is_model_ready("idle")
    only_ready = httpx.post(f"{server.url}/v2/repository/index", json={"ready": True}).json()
    assert [r["name"] for r in only_ready] == ["tiny"]
    rpc.load_model("idle")
    assert version_of(server, "idle") == "1"  # now in use: a plain unload is refused
    with pytest.raises(InferenceServerException, match="in use") as err:
        rpc.unload_model("idle")
    assert err.value.status() == "StatusCode.FAILED_PRECONDITION"
    request = service_pb2.RepositoryModelUnloadRequest(model_name="idle")
    request.parameters["force"].bool_param = True
    with grpc.insecure_channel(server.grpc_url) as channel:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelUnload(request)
    assert inspect(server, "idle").status_code == 503
    assert "drained and unloaded" in server.log()


def test_a_broken_load_says_why_and_the_old_version_keeps_serving(server_factory, repo):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    server = server_factory(repo, "--model-control-mode", "explicit")
    url = f"{server.url}/v2/repository/models/tiny/load"
    toml = repo / "tiny" / "model.toml"
    good = toml.read_text()

    toml.write_text(good.replace("width = 32", "widht = 32"))  # a typo in model.toml
    r = httpx.post(url, timeout=60)
    assert r.status_code == 400
    assert "field 'input.widht': unknown field" in r.json()["error"]
    assert "version(s) [1] keep serving" in r.json()["error"]
    with pytest.raises(InferenceServerException, match="unknown field") as err:
        grpcclient.InferenceServerClient(server.grpc_url).load_model("tiny")
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert version_of(server) == "1"

    (repo / "tiny" / "3").mkdir()  # a new version whose file is broken
    (repo / "tiny" / "3" / "model.onnx").write_bytes(b"not an onnx file")
    toml.write_text(good.replace("specific = [1]", "latest = 1"))
    r = httpx.post(url, timeout=60)
    assert r.status_code == 400 and "3/model.onnx" in r.json()["error"], r.text
    assert version_of(server) == "1"
    index = httpx.post(f"{server.url}/v2/repository/index").json()
    assert {"name": "tiny", "version": "1", "state": "READY", "reason": ""} in index

    r = httpx.post(url, json={"parameters": {"config": "{}"}})
    assert r.status_code == 400 and "not supported" in r.json()["error"]
    assert httpx.post(f"{server.url}/v2/repository/models/nope/load").status_code == 404
    assert httpx.post(f"{server.url}/v2/repository/models/..%2Ftiny/load").status_code == 404
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200


def test_unload_of_a_model_in_use_is_refused_unless_forced(server_factory, repo):
    server = server_factory(repo, "--model-control-mode", "explicit")
    assert version_of(server) == "1"  # in use: it answered a frame just now
    url = f"{server.url}/v2/repository/models/tiny/unload"
    r = httpx.post(url, json={"parameters": {"unload_dependents": False}})
    assert r.status_code == 409
    assert "in use" in r.json()["error"] and '"force": true' in r.json()["error"]
    assert version_of(server) == "1"

    r = httpx.post(url, json={"parameters": {"force": True}})
    assert r.status_code == 200 and r.json()["unloaded"] == ["1"]
    r = inspect(server)
    assert r.status_code == 503 and "is not loaded" in r.json()["error"]
    v2 = httpx.post(f"{server.url}/v2/models/tiny/infer", json={"inputs": [
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["aGVsbG8="]}]})
    assert v2.status_code == 503
    assert httpx.get(f"{server.url}/v2/models/tiny/ready").status_code == 503
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200
    assert version_of(server, "idle") == "1"  # the other model serves on
    assert httpx.post(f"{server.url}/v2/repository/models/tiny/load", timeout=60).status_code == 200
    assert version_of(server) == "1"
    assert server.proc.poll() is None


def test_poll_mode_swaps_a_changed_model_and_refuses_calls(server_factory, repo):
    server = server_factory(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.3")
    assert version_of(server) == "1"
    policy(repo / "tiny", "[2]")
    wait_for(lambda: version_of(server) == "2", 30, "the poll to swap in version 2")
    (repo / "tiny" / "model.toml").write_text("[input]\nwidth = 'x'\n")  # broken: v2 serves on
    wait_for(lambda: "model tiny not loaded" in server.log(), 30, "the poll to read it")
    assert version_of(server) == "2"
    shutil.rmtree(repo / "idle")
    wait_for(lambda: inspect(server, "idle").status_code == 503, 30, "idle to be unloaded")
    r = httpx.post(f"{server.url}/v2/repository/models/tiny/load")
    assert r.status_code == 409 and "polled" in r.json()["error"]


def test_repository_calls_from_a_front_end_process(server_factory, repo):
    import tritonclient.grpc as grpcclient

    server = server_factory(repo, "--model-control-mode", "explicit", "--frontends", "1")
    assert version_of(server) == "1"
    policy(repo / "tiny", "[2]")
    r = httpx.post(f"{server.url}/v2/repository/models/tiny/load", timeout=60)
    assert r.status_code == 200, r.text
    # the front end names the version the engine admitted the frame to, at once
    assert version_of(server) == "2"
    toml = repo / "tiny" / "model.toml"
    toml.write_text(toml.read_text().replace("[2]", "[7]"))
    with pytest.raises(Exception, match="version.s. \\[7\\] not found") as err:
        grpcclient.InferenceServerClient(server.grpc_url).load_model("tiny")
    assert "INVALID_ARGUMENT" in str(err.value.status())
    index = httpx.post(f"{server.url}/v2/repository/index", json={"ready": True}).json()
    assert [r["version"] for r in index if r["name"] == "tiny"] == ["2"]


def test_ten_swaps_under_load_answer_every_frame_with_the_right_version(server_factory, repo):
    """Half the saturation rate, steady, then 10 swaps between versions 1 and 2: every frame is
    answered 200, by the version that was current when it was admitted (it says which, and its
    scores are that version's), and p99 during the swaps stays near the steady p99."""
    import asyncio
    import time

    server = server_factory(repo, "--model-control-mode", "explicit")
    load_url = f"{server.url}/v2/repository/models/tiny/load"

    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    head, body = wire.inspect_request(host, "tiny", FRAME, "image/png", "", None)

    async def scenario():
        answers: list[tuple[float, float, int, dict]] = []  # (sent, answered, status, body)
        idle: list[wire.HttpConnection] = []  # keep-alive connections, one request at a time
        # the frames go through the load generator's raw HTTP client (tens of microseconds a
        # request): with httpx (about a millisecond) the client took half the two cores itself,
        # and its own backlogs showed as the server's latency
        async with httpx.AsyncClient(timeout=30) as client:
            async def one() -> None:
                conn = idle.pop() if idle else await wire.HttpConnection(host, port).open()
                sent = time.monotonic()
                status, _, data = await conn.request(head, body)
                answers.append((sent, time.monotonic(), status, json.loads(data)))
                idle.append(conn)

            async def closed_loop() -> None:
                end = time.monotonic() + 2.0
                while time.monotonic() < end:
                    await one()

            await asyncio.gather(*(closed_loop() for _ in range(8)))  # saturation, as this client
            rate = len(answers) / 2.0 / 2  # sees it: half of it
            answers.clear()

            async def open_loop(seconds: float, senders: int = 32) -> None:
                # paced sends from a fixed set of senders, as the bench's generator does: the
                # client costs what it costs in the closed loop (no task or connection per frame)
                start, n = time.monotonic(), int(seconds * rate)
                due = iter(start + i / rate for i in range(n))

                async def sender() -> None:
                    for t in due:
                        await asyncio.sleep(max(0.0, t - time.monotonic()))
                        await one()

                await asyncio.gather(*(sender() for _ in range(senders)))

            steady_end = time.monotonic() + 4.0
            switches = [(0.0, "1")]

            async def swap() -> None:
                await asyncio.sleep(4.5)
                for k in range(10):
                    version = "2" if k % 2 == 0 else "1"
                    await asyncio.to_thread(policy, repo / "tiny", f"[{version}]")
                    r = await client.post(load_url)
                    assert r.status_code == 200, r.text
                    assert r.json()["versions"] == [version]
                    switches.append((r.json()["switched_at"], version))
                    await asyncio.sleep(0.4)

            swapping = asyncio.create_task(swap())
            await open_loop(4.0 + 0.5 + 10 * 0.5 + 1.0)
            await swapping
            for conn in idle:
                conn.close()
        return rate, steady_end, switches, answers

    with quiet_client_gc() as gc_pauses:  # the client's own collections are not the server's
        rate, steady_end, switches, answers = asyncio.run(scenario())
    assert len(switches) == 11 and len(answers) > 100
    assert [a[2] for a in answers].count(200) == len(answers), \
        [a[3] for a in answers if a[2] != 200][:3]

    def current(t: float) -> str:
        return [v for at, v in switches if at <= t][-1]

    scores: dict[str, set] = {"1": set(), "2": set()}
    for sent, answered, _, body in answers:
        # admitted between sending and the answer: the version current then (a switch in that
        # window allows either; two switches in it, a version current in between too)
        possible = {current(sent)} | {v for at, v in switches if sent < at <= answered}
        assert body["version"] in possible, (sent, answered, body["version"], switches)
        scores[body["version"]].add(tuple(sorted(body["scores"].items())))
    assert len(scores["1"]) == 1 and len(scores["2"]) == 1 and scores["1"] != scores["2"], \
        "each version answers with its own scores"

    def p99(latencies: list[float]) -> float:
        return float(np.percentile(latencies, 99)) * 1000

    steady = p99([b - a for a, b, _, _ in answers if b < steady_end])
    during = p99([b - a for a, b, _, _ in answers if switches[1][0] - 0.5 <= a <= switches[-1][0]])
    print(f"\nswap under load: {rate:.0f} frames/s, {len(answers)} frames, p99 steady "
          f"{steady:.1f} ms, during swaps {during:.1f} ms")
    # a behavioural bound: on the 2-core machine, shared with this client, either p99 moves by
    # tens of ms from run to run; the measured figures are in docs/benchmarks.md
    # on failure: the slowest answers, when they were sent, and the server's own time for them
    # (a client-side stall shows as a long latency with a short server total_ms)
    slowest = sorted(((b - a, a, body) for a, b, _, body in answers), key=lambda x: x[0])[-5:]
    assert during <= max(2 * steady, steady + 50.0), (steady, during, [
        (f"{lat * 1000:.0f} ms", f"sent {min((a - at for at, _ in switches), key=abs):+.3f} s"
         " from a switch", body["timing"]) for lat, a, body in slowest],
        f"client full collections: {[round(p * 1000) for p in gc_pauses]} ms")
