"""rtsp:// cameras against a real RTSP stream: GStreamer's RTSP server (tests/tools/rtsp_server.py)
on loopback, H.264 over TCP, with a user and password. Each frame carries the server's wall-clock
time as a bar code, so a test can tell how old a grabbed frame is: a grab after a pause returns a
frame made after it, never one buffered from before. Credentials work, and a wrong password is a
clear fault; a server that is killed or stalls is a fault within the grab's timeout (never a
hang), and frames come again after its restart; and the same through a real server: ``--camera``,
credentials from the environment, ``POST /v1/cameras/{name}/trigger``."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from conftest import start_server, wait_for
from rtsp_support import RtspServer, skip_reason

from tests.tools.rtsp_server import stamp_of
from visionserve.cameras import pixels
from visionserve.cameras.source import CameraFault, Source, open_source
from visionserve.errors import ConfigError

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

USER, PASSWORD = "viewer", "pa:ss@w/rd%"  # characters a URL must escape
#: timeouts for tests that are not about them: on a loaded CI machine the test camera's encoder
#: can take seconds to start a stream, which the defaults (5 s to open, 2 s per frame) would
#: call a fault
ROOMY = {"open_timeout_s": 15.0, "read_timeout_s": 5.0}


@pytest.fixture
def camera(tmp_path):
    """The test camera, asking for USER and PASSWORD, running."""
    server = RtspServer(tmp_path, USER, PASSWORD)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def opened(camera):
    """Open sources on the camera with ``opened(**settings)`` (its credentials unless given);
    all are closed afterwards."""
    sources = []

    def make(**settings):
        source = open_source("cam1", camera.url, {"user": USER, "password": PASSWORD,
                                                  **ROOMY, **settings})
        sources.append(source)
        source.open()
        return source

    yield make
    for source in sources:
        source.close()


def test_open_and_grab_gives_the_stream_s_frames(camera, opened):
    source = opened()
    assert isinstance(source, Source) and source.describe() == camera.url
    asked = time.time()
    frame = source.grab(5.0)
    assert frame.pixel_format == "BGR8" and frame.pixels.shape == (480, 640, 3)
    rgb = pixels.to_rgb8(frame.pixels, frame.pixel_format)
    assert rgb.shape == (480, 640, 3) and rgb.dtype == np.uint8
    # the bar code reads as the server's clock, and the first frame is no leftover of the
    # packets FFmpeg read to learn the stream while it opened
    assert asked - 0.25 < stamp_of(rgb) < time.time()
    second = source.grab(5.0)
    assert not np.array_equal(frame.pixels, second.pixels), "the square moves every frame"
    assert stamp_of(second.pixels) > stamp_of(frame.pixels)
    stats = source.stats()
    assert stats["frames"] == 2 and stats["decoded"] >= 2
    assert stats["drops"] == 0 and stats["reconnects"] == 0


def test_tcp_and_udp_cameras_open_at_once_and_the_environment_is_left_as_it_was(opened,
                                                                                monkeypatch):
    monkeypatch.delenv("OPENCV_FFMPEG_CAPTURE_OPTIONS", raising=False)
    with ThreadPoolExecutor(4) as pool:
        sources = list(pool.map(lambda t: opened(transport=t), ["tcp", "udp", "tcp", "udp"]))
    for source in sources:
        assert source.grab(5.0).pixels.shape == (480, 640, 3)
    assert "OPENCV_FFMPEG_CAPTURE_OPTIONS" not in os.environ


def test_a_grab_after_a_pause_returns_a_frame_made_after_it(opened):
    source = opened()
    source.grab(5.0)
    for pause in (0.5, 1.5):
        time.sleep(pause)  # the stream goes on meanwhile: its frames are not kept for later
        asked = time.time()
        frame = source.grab(5.0)
        made = stamp_of(frame.pixels)
        # made after the call, but for the time the server takes to encode and send (tens of
        # ms): a frame buffered from before the pause would be `pause` seconds older
        assert made > asked - 0.25, f"a frame {asked - made:.3f} s older than the grab"
    assert source.stats()["frames"] == 3


def test_free_running_never_hands_out_a_frame_twice(opened):
    source = opened(trigger="free", rate_hz=30)
    stamps = [stamp_of(source.grab(1.0).pixels) for _ in range(10)]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps), stamps


@pytest.mark.parametrize("digest", [False, True], ids=["basic", "digest"])
def test_credentials_are_needed_and_a_wrong_password_is_a_clear_fault(tmp_path, digest):
    camera = RtspServer(tmp_path, USER, PASSWORD, digest=digest)
    try:
        camera.start()
        _refused(camera)
        source = open_source("cam1", camera.url, {"user": USER, "password": PASSWORD, **ROOMY})
        source.open()
        assert source.grab(5.0).pixels.shape == (480, 640, 3)
        source.close()
    finally:
        camera.close()


def _refused(camera: RtspServer) -> None:
    for settings, words in [({}, "asks for a user and password"),
                            ({"user": USER, "password": "wrong"},
                             "refused the user or password")]:
        source = open_source("cam1", camera.url, settings)
        start = time.monotonic()
        with pytest.raises(CameraFault) as fault:
            source.open()
        assert time.monotonic() - start < 5.0
        assert fault.value.reason == "config" and words in fault.value.message
        assert "wrong" not in fault.value.message and source.describe() == camera.url
        with pytest.raises(CameraFault) as grab_fault:
            source.grab(0.1)
        assert grab_fault.value.reason == "disconnected"
        source.close()


def test_a_camera_that_is_not_there_or_has_no_such_stream(camera):
    source = open_source("cam1", camera.url.replace("/test", "/nothing"),
                         {"user": USER, "password": PASSWORD})
    with pytest.raises(CameraFault) as fault:
        source.open()
    assert fault.value.reason == "not_found", fault.value.message
    camera.kill()
    source = open_source("cam1", camera.url, {"user": USER, "password": PASSWORD})
    start = time.monotonic()
    with pytest.raises(CameraFault) as fault:
        source.open()
    assert fault.value.reason == "not_found" and "nothing listens" in fault.value.message
    assert time.monotonic() - start < 1.0


def test_a_killed_server_is_a_fault_within_the_timeout_and_frames_come_after_its_restart(
        camera, opened):
    source = opened(read_timeout_s=1.0)
    source.grab(5.0)
    camera.kill()
    # frames already on their way when the server died (in the socket, in the decoder) may
    # still come, for a moment on a busy machine; after them, never a frame
    drained = time.monotonic() + 2.0
    while time.monotonic() < drained:
        try:
            source.grab(0.5)
        except CameraFault:
            break
    for _ in range(3):  # no hang, and never a frame
        start = time.monotonic()
        with pytest.raises(CameraFault) as fault:
            source.grab(0.5)
        assert time.monotonic() - start < 0.5 + 0.2
        assert fault.value.reason in ("disconnected", "timeout")
    assert fault.value.reason == "disconnected"
    assert source.stats()["drops"] == 1
    start = time.monotonic()
    source.close()
    assert time.monotonic() - start < 0.7
    camera.start()
    source.open()  # the camera service reopens a disconnected source
    assert source.grab(5.0).pixels.shape == (480, 640, 3)
    assert source.stats()["reconnects"] == 1


def test_a_stream_that_stalls_is_a_timeout_then_disconnected_and_close_is_prompt(camera, opened):
    source = opened(read_timeout_s=1.0)
    source.grab(5.0)
    camera.pause()
    try:
        start = time.monotonic()
        with pytest.raises(CameraFault) as fault:
            source.grab(0.3)
        assert fault.value.reason == "timeout" and time.monotonic() - start < 0.3 + 0.2
        time.sleep(1.0)  # past read_timeout_s: the reader gave the stream up
        with pytest.raises(CameraFault) as fault:
            source.grab(0.3)
        assert fault.value.reason == "disconnected"
        start = time.monotonic()
        source.close()
        assert time.monotonic() - start < 0.7
    finally:
        camera.resume()


@pytest.mark.parametrize("uri, settings, message", [
    ("rtsp://127.0.0.1/x", {"trigger": "hardware"}, "no trigger input"),
    ("rtsp://127.0.0.1/x", {"transport": "http"}, "transport 'http'"),
    ("rtsp://127.0.0.1/x", {"latency": 1}, "unknown rtsp setting(s) latency"),
    ("rtsp://127.0.0.1/x", {"read_timeout_s": 0}, "above 0"),
    ("rtsp://127.0.0.1/x", {"password": "x"}, "a password without a user"),
    ("rtsp:///x", {}, "expected rtsp://HOST"),
    ("rtsp://u:secret@127.0.0.1/x", {}, "no user or password in the URI"),
])
def test_bad_settings_are_config_errors(uri, settings, message):
    with pytest.raises(ConfigError) as err:
        open_source("cam1", uri, settings)
    assert message in err.value.message and "secret" not in err.value.message


def test_a_server_inspects_the_stream_with_credentials_from_the_environment(camera, tiny_repo,
                                                                           tmp_path):
    env = {"VISIONSERVE_CAMERA_CAM1_USER": USER, "VISIONSERVE_CAMERA_CAM1_PASSWORD": PASSWORD}
    server = start_server(tiny_repo, tmp_path, "--camera", f"cam1={camera.url}", grpc=False,
                          env=env)
    try:
        wait_for(lambda: httpx.get(f"{server.url}/v1/cameras", timeout=10).json()["cameras"][0]
                 ["state"] == "up", 20, "cam1 up")
        answer = httpx.post(f"{server.url}/v1/cameras/cam1/trigger",
                            headers={"X-Part-Id": "P-1"}, timeout=30)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["verdict"] in ("OK", "NG") and body["camera_id"] == "cam1"
        assert body["part_id"] == "P-1" and body["model"] == "tiny"
        listed = httpx.get(f"{server.url}/v1/cameras", timeout=10).json()["cameras"][0]
        assert listed["source"] == camera.url and listed["source_stats"]["frames"] >= 1
        scraped = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'visionserve_camera_source_decoded_total{camera="cam1"}' in scraped
        camera.kill()
        gone = httpx.post(f"{server.url}/v1/cameras/cam1/trigger",
                          headers={"X-Part-Id": "G-1"}, timeout=30)
        assert gone.status_code == 503 and gone.json()["verdict"] == "ERROR", gone.text
        assert gone.json()["fault"] in ("disconnected", "timeout")
        camera.start()
        wait_for(lambda: httpx.post(f"{server.url}/v1/cameras/cam1/trigger",
                                    headers={"X-Part-Id": "B-1"}, timeout=30).status_code == 200,
                 20, "a verdict after the camera's return")
        camera.pause()  # a stream stalled at shutdown: the server still ends cleanly
        try:
            assert server.stop() == 0
        finally:
            camera.resume()
        assert PASSWORD not in server.log_path.read_text()
    finally:
        server.stop()


def test_a_free_running_camera_of_the_recipes_file_with_a_credentials_file(camera, tiny_repo,
                                                                          tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    os.symlink(tiny_repo / "tiny", repo / "tiny")
    (repo / "recipes.toml").write_text(f'[camera.door]\nsource = "{camera.url}"\nmodel = "tiny"\n'
                                       'trigger = "free"\nrate_hz = 5\n')
    secrets = tmp_path / "cameras.toml"
    secrets.write_text(f'[door]\nuser = "{USER}"\npassword = "{PASSWORD}"\n')
    secrets.chmod(0o600)
    server = start_server(repo, tmp_path, "--camera-credentials", str(secrets), grpc=False)
    try:
        def door() -> dict:
            return httpx.get(f"{server.url}/v1/cameras", timeout=10).json()["cameras"][0]

        wait_for(lambda: door()["frames"] >= 5, 20, "free-running frames inspected")
        listed = door()
        assert listed["state"] == "up" and listed["trigger"] == "free"
        stats = listed["source_stats"]
        # 5 of the stream's 30 frames a second are taken: the others are decoded only
        assert stats["frames"] < stats["decoded"] / 2, stats
        assert stats["drops"] == 0, stats
    finally:
        server.stop()
