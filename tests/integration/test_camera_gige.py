"""gige:// cameras against Aravis's GigE Vision camera simulator on loopback: discovered by serial,
address and id; every pixel format it offers grabbed and converted; features set and read back;
software triggers; a camera killed mid-run is a fault within the grab's timeout (never a hang,
never a frame), and grabs work again within 2 s of its return; and the same through a real
server: ``--camera``, ``POST /v1/cameras/{name}/trigger``, faults while the camera is gone, then
verdicts again."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import start_server, wait_for
from gige_support import ADDRESS, FORMATS, Simulator, skip_reason

from visionserve.cameras import gige, pixels
from visionserve.cameras.source import CameraFault, Grabbed, Source, open_source
from visionserve.errors import ConfigError

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

_SERIALS = itertools.count()
#: a frame may lose packets on a loaded machine (the simulator does not resend): a grab is
#: retried this often before a test counts it a failure
GRAB_TRIES = 5


@pytest.fixture
def sim(tmp_path):
    """A simulated camera with a serial of its own, running."""
    simulator = Simulator(f"VS{os.getpid() % 10000:04d}{next(_SERIALS):02d}", tmp_path)
    try:
        simulator.start()
        yield simulator
    finally:
        simulator.close()


@pytest.fixture
def opened():
    """Open sources with ``opened(uri, **settings)``; all are closed afterwards."""
    sources = []

    def make(uri: str, **settings):
        source = open_source("cam1", uri, settings)
        sources.append(source)
        source.open()
        return source

    yield make
    for source in sources:
        source.close()


def grab(source, timeout_s: float = 2.0) -> Grabbed:
    """A frame, past the occasional incomplete one (counted by the source, and reported)."""
    for attempt in range(GRAB_TRIES):
        try:
            return source.grab(timeout_s)
        except CameraFault as exc:
            if exc.reason not in ("incomplete", "timeout") or attempt == GRAB_TRIES - 1:
                raise
    raise AssertionError("unreachable")


@pytest.mark.parametrize("device", ["serial", "address", "id"])
def test_the_simulator_is_found_by_serial_address_and_id(sim, opened, device):
    name = {"serial": sim.serial, "address": ADDRESS, "id": sim.device_id}[device]
    source = opened(f"gige://{name}")
    assert isinstance(source, Source) and source.describe() == f"gige://{name}"
    frame = grab(source)
    assert frame.pixel_format == "Mono8" and frame.pixels.shape == (512, 512)
    assert frame.frame_id is not None and frame.camera_time is not None
    assert source.stats()["frames"] == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_pixel_format_the_simulator_offers_is_grabbed_and_converted(sim, opened, fmt):
    source = opened(f"gige://{sim.serial}", pixel_format=fmt, roi=[0, 0, 320, 240])
    assert source.applied.pixel_format == fmt
    frame = grab(source)
    spec = pixels.get_format(fmt)
    assert frame.pixel_format == fmt
    assert frame.pixels.dtype == spec.dtype
    assert frame.pixels.shape == ((240, 320, 3) if spec.channels == 3 else (240, 320))
    assert frame.pixels.any(), "the simulator draws a pattern, not a black frame"
    rgb = pixels.to_rgb8(frame.pixels, fmt)
    assert rgb.dtype == np.uint8
    assert rgb.shape == ((240, 320, 1) if spec.layout == "mono" else (240, 320, 3))


def test_features_are_set_and_read_back(sim, opened):
    source = opened(f"gige://{ADDRESS}", exposure_us=2500, gain_db=4.5, roi=[16, 8, 640, 480],
                    pixel_format="Mono16", buffers=3, frame_rate=500)
    applied = source.applied
    assert applied.frame_rate == pytest.approx(500)
    assert applied.exposure_us == pytest.approx(2500)
    assert applied.gain_db == 4.0  # the simulator's gain has whole-dB steps: what it took
    assert applied.roi == (16, 8, 640, 480)
    assert applied.pixel_format == "Mono16" and applied.trigger == "software"
    assert applied.packet_size and applied.packet_size >= 576
    assert grab(source).pixels.shape == (480, 640)


def test_the_largest_frame(sim, opened):
    source = opened(f"gige://{ADDRESS}", pixel_format="BayerRG8", roi=[0, 0, 2048, 2048])
    frame = grab(source, 5.0)
    assert frame.pixels.shape == (2048, 2048)
    assert pixels.to_rgb8(frame.pixels, "BayerRG8").shape == (2048, 2048, 3)


def test_the_first_frame_after_an_open_is_whole(sim):
    """The stream socket holds a whole frame before the first one comes: a 640x480 frame
    (300 KiB) is larger than Linux's default socket buffer (208 KiB), and the simulator does
    not resend what overflowed it."""
    fails = []
    for _ in range(10):
        source = open_source("cam1", f"gige://{ADDRESS}", {"roi": [0, 0, 640, 480]})
        source.open()
        try:
            wanted = max(2 * 640 * 480, gige.SOCKET_BUFFER_MIN)
            kernel_cap = 2 * int(Path("/proc/sys/net/core/rmem_max").read_text())
            assert source.applied.socket_buffer >= min(wanted, kernel_cap)
            try:
                source.grab(2.0)
            except CameraFault as exc:
                fails.append(exc.message)
        finally:
            source.close()
    assert not fails, fails


def test_each_software_trigger_gives_a_new_frame(sim, opened):
    source = opened(f"gige://{sim.serial}", roi=[0, 0, 64, 48])
    ids = [grab(source).frame_id for _ in range(8)]
    assert len(set(ids)) == len(ids), ids
    times = [grab(source).camera_time for _ in range(3)]
    assert times == sorted(times)


def test_free_running_gives_the_newest_frame(sim, opened):
    source = opened(f"gige://{ADDRESS}", trigger="free", rate_hz=50, roi=[0, 0, 64, 48])
    first = grab(source)
    time.sleep(0.3)  # frames pile up meanwhile: the grab takes the newest, the rest are skipped
    second = grab(source)
    assert second.frame_id != first.frame_id
    assert source.stats()["skipped"] >= 1


def test_a_frame_that_lost_packets_is_a_fault_never_a_frame(tmp_path, opened):
    simulator = Simulator(f"VSLOSSY{os.getpid() % 1000:03d}", tmp_path)
    try:
        simulator.start(lost_per_1000=5)  # a 512x512 frame is 188 packets: 6 in 10 lose some
        source = opened(f"gige://{ADDRESS}", buffers=8)
        frames, faults = [], []
        for _ in range(12):
            try:
                frames.append(source.grab(1.0))
            except CameraFault as exc:
                faults.append(exc)
        assert faults and {f.reason for f in faults} <= {"incomplete", "timeout"}, faults
        assert any("incomplete frame (lost packets)" in f.message for f in faults)
        for frame in frames:  # what does come is whole
            assert frame.pixels.shape == (512, 512)
        stats = source.stats()
        assert stats["frames"] == len(frames) and stats["incomplete"] >= 1
        assert stats["missing_packets"] >= stats["incomplete"]
        assert stats["drops"] >= stats["incomplete"]
        simulator.kill()
        start = time.monotonic()
        source.close()  # a camera gone without a word is let go at once
        assert time.monotonic() - start < 1.0
    finally:
        simulator.close()


def test_hardware_trigger_waits_for_the_line_and_no_longer_than_the_timeout(sim, opened):
    source = opened(f"gige://{ADDRESS}", trigger="hardware", trigger_source="Line0")
    assert source.applied.trigger == "hardware"
    start = time.monotonic()
    with pytest.raises(CameraFault) as fault:  # nothing drives the simulator's Line0
        source.grab(0.3)
    assert fault.value.reason == "timeout" and time.monotonic() - start < 0.3 + 0.2


def test_a_camera_killed_mid_run_is_a_fault_within_the_timeout_and_back_within_2_s(sim, opened):
    source = opened(f"gige://{sim.serial}")
    grab(source)
    sim.kill()
    for _ in range(3):  # no hang, and never a frame
        start = time.monotonic()
        with pytest.raises(CameraFault) as fault:
            source.grab(0.5)
        assert time.monotonic() - start < 0.5 + 0.2
        assert fault.value.reason in ("disconnected", "timeout", "incomplete")
    source.close()
    start = time.monotonic()
    with pytest.raises(CameraFault) as gone:
        source.open()  # the service reopens: a missing camera is said at once
    assert gone.value.reason == "not_found"
    assert time.monotonic() - start < 2.0
    sim.start()
    back = time.monotonic()
    source.open()
    frame = grab(source)
    assert time.monotonic() - back < 2.0
    assert frame.pixels.shape == (512, 512)
    for _ in range(20):  # the lost connection's release does not disturb the new one
        grab(source)


def test_open_says_not_found_when_no_camera_answers(tmp_path):
    simulator = Simulator("VSABSENT", tmp_path)  # holds the lock: no other simulator runs
    try:
        source = open_source("cam1", f"gige://{ADDRESS}", {})
        start = time.monotonic()
        with pytest.raises(CameraFault) as fault:
            source.open()
        assert fault.value.reason == "not_found" and time.monotonic() - start < 1.0
        with pytest.raises(CameraFault) as grab_fault:
            source.grab(0.1)
        assert grab_fault.value.reason == "disconnected"
        source.close()
    finally:
        simulator.close()


def test_what_the_camera_refuses_is_a_config_fault(sim):
    source = open_source("cam1", f"gige://{ADDRESS}", {"roi": [0, 0, 4096, 4096]})
    with pytest.raises(CameraFault) as fault:
        source.open()
    assert fault.value.reason == "config" and "2048x2048" in fault.value.message
    source = open_source("cam1", f"gige://{ADDRESS}", {"pixel_format": "BayerRG12"})
    with pytest.raises(CameraFault) as fault:
        source.open()
    assert fault.value.reason == "config" and "Mono8" in fault.value.message
    source = open_source("cam1", f"gige://{ADDRESS}", {"trigger": "hardware",
                                                       "trigger_source": "Line7"})
    with pytest.raises(CameraFault) as fault:
        source.open()
    assert fault.value.reason == "config" and "Line0" in fault.value.message


@pytest.mark.parametrize("settings, message", [
    ({"exposure": 100}, "unknown gige setting(s) exposure"),
    ({"roi": [0, 0, 0, 10]}, "sizes above 0"),
    ({"roi": "full"}, "bad gige setting"),
    ({"pixel_format": "YUV422"}, "not supported"),
    ({"buffers": 1}, "buffers is 2..64"),
    ({"frame_rate": 0}, "frame_rate must be above 0"),
    ({"trigger": "sometimes"}, "trigger 'sometimes'"),
])
def test_bad_settings_are_config_errors(settings, message):
    with pytest.raises(ConfigError) as err:
        open_source("cam1", "gige://127.0.0.1", settings)
    assert message in err.value.message


def _trigger(server, part: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/cameras/cam1/trigger", headers={"X-Part-Id": part},
                      timeout=30)


def test_a_server_inspects_the_simulator_s_frames_and_rides_out_its_restart(sim, tiny_repo,
                                                                           tmp_path):
    server = start_server(tiny_repo, tmp_path, "--camera", f"cam1=gige://{sim.serial}",
                          "--records", "--records-dir", str(tmp_path / "records"), grpc=False)
    try:
        wait_for(lambda: httpx.get(f"{server.url}/v1/cameras", timeout=10).json()["cameras"][0]
                 ["state"] == "up", 15, "cam1 up")
        answers = [_trigger(server, f"P-{i}") for i in range(5)]
        verdicts = [a for a in answers if a.status_code == 200]
        assert len(verdicts) >= 3, [a.text for a in answers]  # a frame may lose packets
        for a in answers:  # the others are said faults: never a verdict without a frame
            assert a.status_code == 200 or (a.status_code == 503 and a.json()["verdict"] ==
                                            "ERROR" and a.json()["fault"] == "incomplete"), a.text
        first = verdicts[0].json()
        assert first["verdict"] in ("OK", "NG") and first["camera_id"] == "cam1"
        assert first["part_id"] == verdicts[0].request.headers["X-Part-Id"]
        assert first["model"] == "tiny" and first["camera_time"] > 0
        # the part's record keeps the camera's frame id (a gap in them is a frame lost)
        part = first["part_id"]
        kept = wait_for(lambda: (h := httpx.get(f"{server.url}/v1/parts/{part}", timeout=10))
                        .status_code == 200 and h.json()["records"][0], 20, f"{part}'s record")
        assert kept["camera_frame"] == first["frame_id"] > 0
        sim.kill()
        for i in range(3):  # gone: fault answers, at most the grab's timeout later, never OK
            start = time.monotonic()
            gone = _trigger(server, f"G-{i}")
            assert time.monotonic() - start < 1.0 + 1.0
            assert gone.status_code == 503, gone.text
            assert gone.json()["verdict"] == "ERROR" and gone.json()["part_id"] == f"G-{i}"
            assert gone.json()["fault"] in ("disconnected", "not_found", "timeout")
        sim.start()
        back = time.monotonic()
        answer = wait_for(lambda: (r := _trigger(server, "B-1")).status_code == 200 and r, 10,
                          "a verdict after the camera's return")
        assert time.monotonic() - back < 2.0, "verdicts again within 2 s of the camera's return"
        assert answer.json()["verdict"] in ("OK", "NG") and answer.json()["part_id"] == "B-1"
        listed = httpx.get(f"{server.url}/v1/cameras", timeout=10).json()["cameras"][0]
        assert listed["state"] == "up" and listed["source"] == f"gige://{sim.serial}"
        assert listed["faults"].get("disconnected", 0) >= 1
        assert listed["source_stats"]["frames"] >= len(verdicts) + 1
        scraped = httpx.get(f"{server.url}/metrics", timeout=10).text
        for counter in ("drops", "incomplete", "resends", "missing_packets", "retriggers"):
            assert f'visionserve_camera_source_{counter}_total{{camera="cam1"}}' in scraped
    finally:
        server.stop()


def test_a_bayer_camera_s_verdicts_are_those_of_its_demosaiced_frame(sim, tiny_repo, tmp_path):
    """A BayerRG8 camera's frames travel as their mosaic and are demosaiced where the model's
    input is prepared: each answer is the answer to the RGB frame OpenCV demosaics, which is
    what the records keep (an RGB PNG, never the mosaic): sent back as an inspect request, the
    captured frame gets the camera's verdict and scores."""
    import cv2

    token = "bayer-test-token"
    auth = {"Authorization": f"Bearer {token}"}
    repo = tmp_path / "repo"
    repo.mkdir()
    os.symlink(tiny_repo / "tiny", repo / "tiny")
    (repo / "recipes.toml").write_text(
        f'[camera.cam1]\nsource = "gige://{sim.serial}"\nmodel = "tiny"\n'
        'settings = { pixel_format = "BayerRG8", roi = [0, 0, 320, 240] }\n')
    data = tmp_path / "data"
    server = start_server(repo, tmp_path, "--records", "--records-dir", str(data), "--capture",
                          "all", "--auth-token", token, grpc=False)
    try:
        wait_for(lambda: httpx.get(f"{server.url}/v1/cameras", timeout=10, headers=auth).json()
                 ["cameras"][0]["state"] == "up", 15, "cam1 up")
        answers = {}
        for i in range(6):
            r = httpx.post(f"{server.url}/v1/cameras/cam1/trigger", timeout=30,
                           headers={"X-Part-Id": f"B-{i}", **auth})
            if r.status_code == 200:
                answers[f"B-{i}"] = r.json()
        assert len(answers) >= 3, "most frames arrive whole"
        for part, answer in answers.items():
            record = wait_for(lambda p=part: (h := httpx.get(
                f"{server.url}/v1/parts/{p}", timeout=10, headers=auth)).status_code == 200
                and h.json()["records"][0].get("image") and h.json()["records"][0], 20,
                f"{part}'s captured image")
            png = (data / "captures" / record["image"]).read_bytes()
            captured = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_UNCHANGED)
            assert captured.shape == (240, 320, 3), "the demosaiced RGB, not the mosaic"
            again = httpx.post(f"{server.url}/v1/models/tiny/inspect", content=png, timeout=30,
                               headers={"Content-Type": "image/png", **auth})
            assert again.status_code == 200, again.text
            assert again.json()["verdict"] == answer["verdict"]
            assert again.json()["label"] == answer["label"]
            assert again.json()["scores"] == pytest.approx(answer["scores"], abs=1e-5)
    finally:
        server.stop()
