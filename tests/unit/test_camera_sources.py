"""The camera sources without a server: the folder source on real files, opening a source by its
URI's scheme, the camera settings and credentials, and a frame from what a camera sends."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from visionserve.cameras.folder import FolderSource, incomplete
from visionserve.cameras.service import credentials, to_frame
from visionserve.cameras.source import CameraFault, Grabbed, open_source, redact, scheme_of
from visionserve.config import ServerSettings
from visionserve.errors import ConfigError
from visionserve.recipes import CameraSpec, load


def _image(ext: str, value: int = 200) -> bytes:
    img = np.full((48, 64, 3), value, np.uint8)
    img[10:20, 10:30] = 255 - value
    ok, buf = cv2.imencode(ext, img)
    assert ok
    return buf.tobytes()


def _folder(path: Path, **settings) -> FolderSource:
    source = open_source("cam", f"folder:{path}", settings)
    assert isinstance(source, FolderSource)
    source.open()
    return source


def _put(path: Path, data: bytes, age_s: float = 0.0) -> Path:
    path.write_bytes(data)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def test_a_complete_file_is_the_frame_and_moved_to_done(tmp_path):
    jpeg = _image(".jpg")
    source = _folder(tmp_path)
    _put(tmp_path / "a.jpg", jpeg)
    g = source.grab(1.0)
    assert (g.pixel_format, g.encoded, g.pixels) == ("encoded", jpeg, None)
    assert g.camera_time is not None
    assert not (tmp_path / "a.jpg").exists() and (tmp_path / "done" / "a.jpg").read_bytes() == jpeg
    assert source.stats() == {"frames": 1, "drops": 0, "incomplete": 0}
    with pytest.raises(CameraFault) as fault:  # nothing new: a timeout, not a hang
        t0 = time.monotonic()
        source.grab(0.1)
    assert fault.value.reason == "timeout" and time.monotonic() - t0 < 1.0


def test_done_delete_and_a_custom_done_folder(tmp_path):
    drop, done = tmp_path / "drop", tmp_path / "elsewhere"
    drop.mkdir()
    source = _folder(drop, done="delete")
    _put(drop / "a.png", _image(".png"))
    source.grab(1.0)
    assert list(drop.iterdir()) == [] or list(drop.iterdir()) == [drop / "done"]
    assert not (drop / "done").exists()
    moved = _folder(drop, done="move", done_dir=str(done))
    _put(drop / "b.bmp", _image(".bmp"))
    assert moved.grab(1.0).encoded == (done / "b.bmp").read_bytes()


@pytest.mark.parametrize("ext", [".jpg", ".png", ".bmp"])
def test_a_half_written_file_never_becomes_a_frame(tmp_path, ext):
    data = _image(ext)
    assert incomplete(data) is None
    assert incomplete(data[: len(data) // 2]) is not None
    source = _folder(tmp_path)
    path = _put(tmp_path / f"a{ext}", data[: len(data) // 2])
    with pytest.raises(CameraFault) as fault:
        source.grab(0.2)
    assert fault.value.reason == "incomplete" and path.exists()
    # the writer finishes while a grab waits: the whole file is the frame
    threading.Timer(0.1, lambda: path.write_bytes(data)).start()
    assert source.grab(2.0).encoded == data


def test_a_jpeg_without_its_end_marker_is_incomplete(tmp_path):
    jpeg = _image(".jpg")
    assert incomplete(jpeg[:-2]) is not None  # all but the EOI marker
    source = _folder(tmp_path, incomplete_after_s=0.15)
    path = _put(tmp_path / "a.jpg", jpeg[:-2])
    with pytest.raises(CameraFault):
        source.grab(0.05)
    # the writer gave up: after incomplete_after_s unchanged the file is put away, a drop
    with pytest.raises(CameraFault):
        source.grab(0.4)
    assert not path.exists() and (tmp_path / "done" / "a.jpg").exists()
    assert source.stats()["drops"] == 1 and source.stats()["incomplete"] == 1


def test_newest_first_at_a_trigger_and_in_order_when_free_running(tmp_path):
    files = {name: _image(".png", value) for name, value in (("a", 10), ("b", 20), ("c", 30))}
    for age, (name, data) in zip((3, 2, 1), files.items()):
        _put(tmp_path / f"{name}.png", data, age_s=age)
    triggered = _folder(tmp_path)
    assert triggered.grab(1.0).encoded == files["c"]  # the newest; older ones are stale drops
    assert triggered.stats()["drops"] == 2 and not list(tmp_path.glob("*.png"))
    for age, (name, data) in zip((3, 2, 1), files.items()):
        _put(tmp_path / f"{name}.png", data, age_s=age)
    free = _folder(tmp_path, trigger="free", rate_hz=10)
    assert [free.grab(1.0).encoded for _ in range(3)] == list(files.values())


def test_a_folder_that_goes_away_is_a_disconnected_camera(tmp_path):
    drop = tmp_path / "drop"
    missing = open_source("cam", f"folder:{drop}", {})
    with pytest.raises(CameraFault) as fault:
        missing.open()
    assert fault.value.reason == "not_found"
    drop.mkdir()
    source = _folder(drop)
    (drop / "done").rmdir()
    drop.rmdir()
    with pytest.raises(CameraFault) as fault:
        source.grab(0.1)
    assert fault.value.reason == "disconnected"


def test_sources_by_scheme_and_their_settings(tmp_path):
    assert scheme_of("folder:/srv/x") == "folder" and scheme_of("gige://Fake") == "gige"
    with pytest.raises(ConfigError, match="no scheme"):
        scheme_of("/srv/x")
    with pytest.raises(ConfigError, match="not available"):
        open_source("cam", "nosuch://x", {})
    with pytest.raises(ConfigError, match="unknown folder setting"):
        open_source("cam", f"folder:{tmp_path}", {"exposure_us": 5})
    with pytest.raises(ConfigError, match="move"):
        open_source("cam", f"folder:{tmp_path}", {"done": "keep"})
    assert redact("rtsp://user:pw@cam.local:554/s1") == "rtsp://cam.local:554/s1"
    assert redact("folder:/srv/x") == "folder:/srv/x"


def test_camera_settings_in_the_recipes_file(tmp_path):
    path = tmp_path / "recipes.toml"
    path.write_text('[recipe.r]\nmodel = "m"\n[station.st]\nrecipe = "r"\ncameras = ["c1"]\n'
                    '[camera.c1]\nsource = "folder:/srv/c1"\nsettings = { done = "delete" }\n'
                    '[camera.c2]\nsource = "gige://Fake"\nmodel = "m"\ntrigger = "free"\n'
                    'rate_hz = 30\nsettings = { exposure_us = 5000, roi = [0, 0, 640, 480] }\n')
    book = load(path)
    assert book.sources["c1"].source_settings() == {"done": "delete", "trigger": "software",
                                                    "rate_hz": None}
    assert book.sources["c2"].settings["roi"] == [0, 0, 640, 480]
    for bad, message in (('source = "rtsp://u:secret@h/x"', "password"),
                         ('source = "folder:/x"\ntrigger = "free"', "rate_hz"),
                         ('source = "folder:/x"\nexposure = 3', "unknown field")):
        path.write_text(f"[camera.c]\n{bad}\n")
        with pytest.raises(ConfigError, match=message) as exc:
            load(path)
        assert "secret" not in exc.value.message


def test_camera_options_on_the_command_line():
    s = ServerSettings(camera=["c1=folder:/srv/a", "c2=gige://Fake"])
    assert s.camera == ["c1=folder:/srv/a", "c2=gige://Fake"]
    for bad, message in ((["c1=rtsp://u:pw@h/x"], "password"), (["c1"], "NAME=URI"),
                         (["c1=folder:/a", "c1=folder:/b"], "more than once")):
        with pytest.raises(ValueError, match=message):
            ServerSettings(camera=bad)


def test_credentials_from_a_private_file_or_the_environment(tmp_path):
    path = tmp_path / "cameras.toml"
    path.write_text('[c1]\nuser = "op"\npassword = "s3cret"\n')
    path.chmod(0o644)
    settings = ServerSettings(camera_credentials=path)
    with pytest.raises(ConfigError, match="chmod 600"):
        credentials(settings, ["c1"])
    path.chmod(0o600)
    env = {"VISIONSERVE_CAMERA_LINE_2_USER": "u2", "VISIONSERVE_CAMERA_LINE_2_PASSWORD": "p2"}
    assert credentials(settings, ["c1", "line-2"], env) == {
        "c1": {"user": "op", "password": "s3cret"}, "line-2": {"user": "u2", "password": "p2"}}


def test_frames_from_what_cameras_send():
    mono = np.arange(12, dtype=np.uint8).reshape(3, 4)
    f = to_frame(Grabbed(mono, "Mono8"))
    assert (f.kind, f.width, f.height, f.channels) == ("raw", 4, 3, 1)
    bgr = np.zeros((3, 4, 3), np.uint8)
    bgr[..., 0] = 255  # blue
    f = to_frame(Grabbed(bgr, "BGR8"))
    assert isinstance(f.data, np.ndarray) and f.data[0, 0].tolist() == [0, 0, 255]
    jpeg = _image(".jpg")
    assert to_frame(Grabbed(None, "encoded", jpeg)).data == jpeg
    deep = to_frame(Grabbed(np.full((4, 4), 4095, np.uint16), "Mono12"))  # scaled by 4095
    assert deep.data.max() == 255 and deep.channels == 1
    half = to_frame(Grabbed(np.full((4, 4), 2048, np.uint16), "Mono16"), max_value=4096)
    assert int(half.data[0, 0, 0]) == 128  # the model's raw_max_value, not the format's
    bayer = to_frame(Grabbed(np.zeros((4, 6), np.uint8), "BayerRG8"))  # the mosaic travels
    assert (bayer.width, bayer.height, bayer.channels, bayer.bayer) == (6, 4, 1, "RG")
    with pytest.raises(CameraFault, match="not supported") as fault:
        to_frame(Grabbed(np.zeros((4, 4), np.uint16), "YUV422_8"))
    assert fault.value.reason == "config"
    with pytest.raises(CameraFault) as fault:
        to_frame(Grabbed(None, "encoded", jpeg[:-2]))
    assert fault.value.reason == "incomplete"


def test_a_camera_spec_keeps_no_password():
    with pytest.raises(ValueError, match="password"):
        CameraSpec(source="rtsp://admin:admin@10.0.0.9/stream")


def test_camera_routes_are_classified_and_credentials_are_no_settings():
    from visionserve.config import unknown_variables
    from visionserve.security import ADMIN, INFERENCE, ROUTES, classify
    from visionserve.users.store import VIEWER

    assert classify("POST", "/v1/cameras/cam-7/trigger") == INFERENCE  # inspect's rule
    assert classify("POST", "/v1/stations/st1/trigger") == INFERENCE
    assert classify("GET", "/v1/cameras") == ADMIN
    assert [r.role for r in ROUTES if r.path == "/v1/cameras"] == [VIEWER]
    env = {"VISIONSERVE_CAMERA_CAM_7_USER": "u", "VISIONSERVE_CAMERA_CAM_7_PASSWORD": "p",
           "VISIONSERVE_CAMERA": "[]", "VISIONSERVE_CAMERA_CREDENTIALS": "/x",
           "VISIONSERVE_CAMERAS": "x"}
    assert [w.split(" ")[0] for w in unknown_variables(env)] == ["VISIONSERVE_CAMERAS"]


def test_a_camera_address_of_this_host_is_told_from_a_remote_one():
    """A camera at one of this host's own addresses (a simulator, a camera in a container)
    sends its stream over lo, where Aravis's packet socket does not listen: the source opens it
    without that socket. Loopback and an interface's address are this host's; TEST-NET is not."""
    import socket

    from visionserve.cameras.gige import _of_this_host

    assert _of_this_host("127.0.0.1") and _of_this_host("127.0.0.2")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: the route names this host's address
        own = s.getsockname()[0]
    assert _of_this_host(own)
    assert not _of_this_host("192.0.2.1")
