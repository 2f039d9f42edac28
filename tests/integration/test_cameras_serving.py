"""Cameras as sources of a real server (issue 50): folder cameras on real files, triggered over
HTTP, through the same engine path as inspect (records, stations, faults, reconnects)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
from conftest import REPO, TINY_TOML, export_onnx, start_server, wait_for

TOKEN = "camera-test-admin-token"


def _bright_model(folder: Path) -> Path:
    """Model ``bright``: "ok" for a bright frame, "dent" (NG) for a dark one."""
    import torch

    class Bright(torch.nn.Module):
        def forward(self, x):
            m = x.mean(dim=(1, 2, 3))[:, None] * 10
            return torch.cat([m - 5, 5 - m, m * 0 - 10], dim=1)

    return export_onnx(Bright(), folder, (2, 3, 32, 32), TINY_TOML)


def _jpeg(value: int) -> bytes:
    ok, buf = cv2.imencode(".jpg", np.full((120, 160, 3), value, np.uint8))
    assert ok
    return buf.tobytes()


WHITE, BLACK = _jpeg(255), _jpeg(0)


@pytest.fixture(scope="module")
def bright_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("camrepo")
    _bright_model(root / "bright")
    return root


@pytest.fixture
def line(bright_repo, tmp_path) -> tuple[Path, Path]:
    """(model repository with a recipes file, the cameras' drop folders' parent): station st1
    with folder cameras cam-a and cam-b, cam-gone whose folder does not exist yet."""
    drops = tmp_path / "drops"
    for name in ("a", "b"):
        (drops / name).mkdir(parents=True)
    repo = tmp_path / "repo"
    repo.mkdir()
    os.symlink(bright_repo / "bright", repo / "bright")
    (repo / "recipes.toml").write_text(f"""\
[recipe.parts]
model = "bright"

[station.st1]
recipe = "parts"
cameras = ["cam-a", "cam-b"]

[camera.cam-a]
source = "folder:{drops / 'a'}"

[camera.cam-b]
source = "folder:{drops / 'b'}"
settings = {{ done = "delete" }}

[camera.cam-gone]
source = "folder:{drops / 'gone'}"
model = "bright"
timeout_s = 0.3
""")
    return repo, drops


def _trigger(server, camera: str, part: str | None = None, station: bool = False,
             **headers) -> httpx.Response:
    kind = "stations" if station else "cameras"
    return httpx.post(f"{server.url}/v1/{kind}/{camera}/trigger", timeout=30,
                      headers={**({"X-Part-Id": part} if part else {}), **headers})


def _metric(server, name: str, **labels) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")) and all(w in line for w in want))


@pytest.mark.parametrize("frontends", [0, 1])
def test_a_trigger_inspects_the_camera_s_file_and_records_it(line, tmp_path, frontends):
    repo, drops = line
    server = start_server(repo, tmp_path, "--records", "--records-dir", str(tmp_path / "data"),
                          "--auth-token", TOKEN, "--frontends", str(frontends), grpc=False)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        (drops / "a" / "frame-1.jpg").write_bytes(WHITE)
        r = _trigger(server, "cam-a", "P-1", **auth)
        assert r.status_code == 200, r.text
        a = r.json()
        assert (a["verdict"], a["part_id"], a["camera_id"], a["station"], a["recipe"]) == \
            ("OK", "P-1", "cam-a", "st1", "parts")
        assert a["model"] == "bright" and a["label"] == "ok" and "camera_time" in a
        assert a["cameras"]["cam-a"]["verdict"] == "OK" and a["timing"]["grab_ms"] >= 0
        assert (drops / "a" / "done" / "frame-1.jpg").read_bytes() == WHITE  # done = move
        # the same engine path as inspect: the part's record names the camera and station
        history = wait_for(lambda: (h := httpx.get(f"{server.url}/v1/parts/P-1", headers=auth,
                                                   timeout=10)).status_code == 200 and h.json(),
                           20, "the record")
        record = history["records"][0]
        assert (record["camera"], record["station"], record["verdict"]) == ("cam-a", "st1", "OK")
        # the station: one trigger acquires from each camera; NG if any camera's is
        (drops / "a" / "frame-2.jpg").write_bytes(WHITE)
        (drops / "b" / "frame-2.jpg").write_bytes(BLACK)
        r = _trigger(server, "st1", "P-2", station=True, **auth)
        assert r.status_code == 200, r.text
        part = r.json()
        assert (part["verdict"], part["part_id"], part["station"]) == ("NG", "P-2", "st1")
        assert {c: v["verdict"] for c, v in part["cameras"].items()} == \
            {"cam-a": "OK", "cam-b": "NG"}
        assert not any((drops / "b").iterdir())  # done = delete
        (drops / "a" / "frame-3.jpg").write_bytes(WHITE)
        (drops / "b" / "frame-3.jpg").write_bytes(WHITE)
        assert _trigger(server, "st1", "P-3", station=True, **auth).json()["verdict"] == "OK"
        # a camera with no new file: a fault, never OK; the station's part is no decision
        (drops / "a" / "frame-4.jpg").write_bytes(WHITE)
        r = _trigger(server, "st1", "P-4", station=True, **auth)
        assert r.status_code == 503 and r.json()["verdict"] == "ERROR", r.text
        assert r.json()["cameras"]["cam-a"]["verdict"] == "OK"
        assert r.json()["cameras"]["cam-b"]["fault"] == "timeout"
        unknown = _trigger(server, "cam-nope", "P-5", **auth)
        assert unknown.status_code == 404 and "cam-nope" in unknown.json()["error"]
        assert _trigger(server, "st9", station=True, **auth).status_code == 404
        assert _metric(server, "visionserve_camera_frames_total", camera="cam-a") == 4
        assert _metric(server, "visionserve_camera_faults_total", camera="cam-b",
                       reason="timeout") == 1
        assert _metric(server, "visionserve_camera_trigger_to_frame_seconds_count",
                       camera="cam-a") == 4
        # what the source counts itself: a stale file left beside a trigger's frame is a drop
        (drops / "a" / "old.jpg").write_bytes(BLACK)
        os.utime(drops / "a" / "old.jpg", (time.time() - 60, time.time() - 60))
        (drops / "a" / "new.jpg").write_bytes(WHITE)
        assert _trigger(server, "cam-a", "P-6", **auth).json()["verdict"] == "OK"
        assert _metric(server, "visionserve_camera_source_drops_total", camera="cam-a") == 1
    finally:
        server.stop()


def test_a_missing_camera_faults_until_its_folder_comes_back(line, tmp_path):
    repo, drops = line
    server = start_server(repo, tmp_path, grpc=False)
    try:
        for part in ("G-1", "G-2"):
            r = _trigger(server, "cam-gone", part)
            assert r.status_code == 503, r.text
            a = r.json()
            assert (a["verdict"], a["part_id"], a["camera_id"]) == ("ERROR", part, "cam-gone")
            assert a["fault"] in ("disconnected", "not_found") and "does not exist" in a["error"]
        # down, shown as such; the server stays ready and the other cameras work
        ready = httpx.get(f"{server.url}/v2/health/ready", timeout=10)
        assert ready.status_code == 200 and ready.json()["cameras"]["cam-a"] == "up"
        assert ready.json()["cameras"]["cam-gone"].startswith("down: ")
        assert _metric(server, "visionserve_camera_up", camera="cam-gone") == 0
        assert _metric(server, "visionserve_camera_up", camera="cam-a") == 1
        # the refusals were answered through the engine: no decision, counted
        assert _metric(server, "visionserve_requests_total", model="bright",
                       outcome="unavailable") >= 2
        (drops / "a" / "x.jpg").write_bytes(BLACK)
        assert _trigger(server, "cam-a", "A-1").json()["verdict"] == "NG"
        # the share comes back after the backoff has grown: the line's triggers bring the
        # reconnect forward, verdicts again within 2 s (faults meanwhile, never an OK)
        time.sleep(3)
        (drops / "gone").mkdir()
        (drops / "gone" / "y.jpg").write_bytes(WHITE)
        back = time.monotonic()
        answers = []
        while time.monotonic() - back < 5:
            r = _trigger(server, "cam-gone", "G-3")
            answers.append((r.status_code, r.json()["verdict"]))
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert answers[-1] == (200, "OK") and time.monotonic() - back < 2.0, answers
        assert all(a == (503, "ERROR") for a in answers[:-1]), answers
        assert httpx.get(f"{server.url}/v2/health/ready").json()["cameras"]["cam-gone"] == "up"
        listed = {c["name"]: c for c in httpx.get(f"{server.url}/v1/cameras").json()["cameras"]}
        assert listed["cam-gone"]["faults"]["not_found"] >= 1
        assert listed["cam-a"]["source"] == f"folder:{drops / 'a'}"
    finally:
        server.stop()


def test_a_free_running_folder_camera_inspects_every_file(bright_repo, tmp_path):
    drop = tmp_path / "drop"
    drop.mkdir()
    repo = tmp_path / "repo"
    repo.mkdir()
    os.symlink(bright_repo / "bright", repo / "bright")
    (repo / "recipes.toml").write_text(f'[camera.free]\nsource = "folder:{drop}"\n'
                                       'trigger = "free"\nrate_hz = 50\n')
    server = start_server(repo, tmp_path, "--records", "--records-dir", str(tmp_path / "data"),
                          grpc=False)
    try:
        for i in range(5):
            (drop / f"f{i}.jpg").write_bytes(WHITE if i % 2 else BLACK)
        wait_for(lambda: len(list((drop / "done").glob("*.jpg"))) == 5, 20, "every file taken")
        wait_for(lambda: _metric(server, "visionserve_frames_total", model="bright") == 5, 20,
                 "every frame answered")
        assert _metric(server, "visionserve_frames_total", model="bright", outcome="NG") == 3
        r = _trigger(server, "free", "P-1")
        assert r.status_code == 409 and "free" in r.json()["error"]
    finally:
        server.stop()


def test_camera_routes_follow_the_access_rules(line, tmp_path):
    repo, drops = line
    data = tmp_path / "data"
    server = start_server(repo, tmp_path, "--host", "0.0.0.0", "--auth-token", "infer-token",
                          grpc=False, env={"XDG_DATA_HOME": str(data)})
    try:
        (drops / "a" / "a.jpg").write_bytes(WHITE)
        # a trigger is inference: the inference token, as inspect
        assert _trigger(server, "cam-a").status_code == 401
        r = _trigger(server, "cam-a", "P-1", Authorization="Bearer infer-token")
        assert r.status_code == 200, r.text
        # the cameras' list is protected (a viewer's): not with the inference token
        assert httpx.get(f"{server.url}/v1/cameras", timeout=10).status_code == 401
        assert httpx.get(f"{server.url}/v1/cameras", timeout=10,
                         headers={"Authorization": "Bearer infer-token"}).status_code == 403
        admin = (data / "visionserve" / "admin-token").read_text().strip()
        r = httpx.get(f"{server.url}/v1/cameras", timeout=10,
                      headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200 and {c["name"] for c in r.json()["cameras"]} == \
            {"cam-a", "cam-b", "cam-gone"}
    finally:
        server.stop()


def test_camera_on_the_command_line_and_a_password_refused(bright_repo, tmp_path):
    drop = tmp_path / "drop"
    drop.mkdir()
    server = start_server(bright_repo, tmp_path, "--camera", f"cli-cam=folder:{drop}", grpc=False)
    try:
        (drop / "a.png").write_bytes(cv2.imencode(".png", np.full((40, 40), 255, np.uint8))[1])
        r = _trigger(server, "cli-cam", "C-1")  # no station, no model: the one served model
        assert r.status_code == 200 and r.json()["verdict"] == "OK", r.text
    finally:
        server.stop()
    done = subprocess.run(
        [sys.executable, "-m", "visionserve", "serve", "--models", str(bright_repo),
         "--camera", "door=rtsp://admin:hunter2@10.0.0.9/stream"],
        check=False, capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert done.returncode == 2
    assert "password" in done.stderr and "--camera-credentials" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout


def test_a_half_written_file_is_no_frame_on_a_real_server(line, tmp_path):
    repo, drops = line
    server = start_server(repo, tmp_path, grpc=False)
    try:
        half = drops / "a" / "part.jpg"
        half.write_bytes(WHITE[: len(WHITE) // 2])
        r = _trigger(server, "cam-a", "H-1")
        assert r.status_code == 503 and r.json()["fault"] == "incomplete", r.text
        assert r.json()["verdict"] == "ERROR" and half.exists()
        with open(half, "ab") as f:  # the upload finishes
            f.write(WHITE[len(WHITE) // 2:])
        time.sleep(0.05)
        r = _trigger(server, "cam-a", "H-2")
        assert r.status_code == 200 and r.json()["verdict"] == "OK", r.text
    finally:
        server.stop()


def test_the_record_keeps_the_camera_time_and_a_raw_capture_is_the_frame_s_pixels(bright_repo,
                                                                                   tmp_path):
    """The camera's timestamp of a triggered frame (a folder's: the file's modification time)
    in the part's record, none for a pushed frame; a raw frame captured as a PNG of exactly its
    pixels. With a front-end process: the origin crosses to the engine."""
    drop, data = tmp_path / "drop", tmp_path / "data"
    drop.mkdir()
    server = start_server(bright_repo, tmp_path, "--camera", f"cam1=folder:{drop}", "--records",
                          "--records-dir", str(data), "--capture", "all", "--frontends", "1",
                          grpc=False)

    def record(part: str) -> dict:
        return wait_for(lambda: (h := httpx.get(f"{server.url}/v1/parts/{part}", timeout=10))
                        .status_code == 200 and h.json()["records"][0], 20, f"{part}'s record")

    try:
        stamp = 1796375551.25  # what the camera's file says: exactly representable
        (drop / "frame-1.jpg").write_bytes(WHITE)
        os.utime(drop / "frame-1.jpg", (stamp, stamp))
        r = _trigger(server, "cam1", "P-1")
        assert r.status_code == 200 and r.json()["camera_time"] == stamp, r.text
        triggered = record("P-1")
        assert (triggered["camera"], triggered["camera_time"]) == ("cam1", stamp)
        listed = httpx.get(f"{server.url}/v1/records", params={"part_id": "P-1"}, timeout=10)
        assert listed.json()["records"][0]["camera_time"] == stamp
        page = httpx.get(f"{server.url}/ui/parts/P-1", timeout=10)  # the console's part page
        assert page.status_code == 200 and "<dt>Camera time</dt><dd>1796375551.250000 s" in \
            page.text
        # a raw push: no camera time; its capture decodes to exactly its pixels, red as red
        px = np.random.default_rng(7).integers(0, 256, (45, 61, 3), dtype=np.uint8)
        px[0, 0] = (255, 0, 0)
        r = httpx.post(f"{server.url}/v1/models/bright/inspect", content=px.tobytes(), timeout=30,
                       headers={"Content-Type": "application/octet-stream", "X-Part-Id": "P-2",
                                "X-Image-Shape": "45x61x3"})
        assert r.status_code == 200, r.text
        pushed = wait_for(lambda: (p := record("P-2"))["image"] and p, 20, "the capture")
        assert pushed["camera_time"] is None and pushed["image"].endswith(".png")
        stored = (data / "captures" / pushed["image"]).read_bytes()
        bgr = cv2.imdecode(np.frombuffer(stored, np.uint8), cv2.IMREAD_UNCHANGED)
        assert np.array_equal(bgr[:, :, ::-1], px) and tuple(bgr[0, 0]) == (0, 0, 255)
        image = httpx.get(f"{server.url}/v1/records", params={"part_id": "P-2"}, timeout=10)
        rid = image.json()["records"][0]["id"]
        served = httpx.get(f"{server.url}/v1/records/{rid}/image", timeout=10)
        assert served.headers["content-type"] == "image/png" and served.content == stored
    finally:
        server.stop()
