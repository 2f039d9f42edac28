"""Shared fixtures: a tiny real ONNX model repository, and real servers on free loopback ports."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from visionserve_tools.benchgpu import IN_PROCESS

# the servers' data folder (admin token, users, the audit trail) is the test run's own, never
# the home folder of whoever runs the tests; a test that needs another sets XDG_DATA_HOME itself
if "XDG_DATA_HOME" not in os.environ:
    os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="visionserve-tests-")
    atexit.register(shutil.rmtree, os.environ["XDG_DATA_HOME"], True)

REPO = Path(__file__).resolve().parent.parent
SHIPPED_MODELS = REPO / "models"

TINY_TOML = """\
description = "tiny test model: random weights, 32x32 input"
[input]
width = 32
height = 32
[output]
labels = ["ok", "dent", "scratch"]
[batching]
max_batch_size = 8
preferred_batch_sizes = [1, 2, 4, 8]
max_queue_delay_ms = 2
max_queue_size = 64
takt_ms = 2000
"""


def export_onnx(module, folder: Path, input_shape: tuple[int, ...], toml: str) -> Path:
    """Write ``folder/1/model.onnx`` (dynamic batch; graph names ``input``/``logits``) and
    ``folder/model.toml``: a real model repository entry for tests. Returns ``folder``."""
    import warnings

    import torch

    (folder / "1").mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.zeros(*input_shape),), str(folder / "1" / "model.onnx"),
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                          opset_version=17, dynamo=False)
    (folder / "model.toml").write_text(toml)
    return folder


def make_tiny_model(folder: Path, toml: str = TINY_TOML, seed: int = 0) -> Path:
    """Export a tiny random-weight CNN to ``folder/1/model.onnx`` (+ model.toml); returns folder.
    Another ``seed``: other weights, so other scores for the same frame."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))

    torch.manual_seed(seed)
    return export_onnx(Tiny(), folder, (2, 3, 32, 32), toml)


SLOW_TOML = """\
description = "slow test model: random weights, 256x256, one CPU thread"
[input]
width = 256
height = 256
[output]
labels = ["ok", "dent", "scratch"]
[batching]
max_batch_size = 4
preferred_batch_sizes = [4]
max_queue_delay_ms = 5
max_queue_size = 64
takt_ms = 120000
[runtime]
intra_op_threads = 1
"""


def make_slow_model(folder: Path) -> Path:
    """A deliberately slow model (about 0.1 s a frame on one CPU thread): work that is still queued
    when a test sends SIGTERM. Written like ``make_tiny_model``; returns folder."""
    import torch

    class Slow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1),
                                             *[torch.nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)])
            self.fc = torch.nn.Linear(16, 3)

        def forward(self, x):
            return self.fc(self.convs(x).mean(dim=(2, 3)))

    torch.manual_seed(0)
    return export_onnx(Slow(), folder, (1, 3, 256, 256), SLOW_TOML)


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory) -> Path:
    """A model repository holding one tiny model named ``tiny``."""
    root = tmp_path_factory.mktemp("tinyrepo")
    make_tiny_model(root / "tiny")
    return root


@contextlib.contextmanager
def quiet_client_gc() -> Iterator[list[float]]:
    """For a test that measures latency from its own process: the objects that exist now (the
    imports of the whole test session, torch among them: a full collection of them takes 0.1-0.3
    s on the 2-core machine) are left out of the garbage collector until the block ends, so the
    client's own pauses do not show as the server's latency. Yields the durations (s) of the full
    collections that still ran in the block."""
    import gc

    pauses: list[float] = []
    started: list[float] = []

    def timer(phase: str, info: dict) -> None:
        if info.get("generation") == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                pauses.append(time.perf_counter() - started.pop())

    gc.collect()
    gc.freeze()
    gc.callbacks.append(timer)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timer)
        gc.unfreeze()


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    """``pred()``'s first truthy value, polled every 20 ms; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def inspect_answer(server, body: bytes, content_type: str, shape: str | None = None,
                   model: str = "tiny") -> dict:
    """The inspect API's answer for one frame (200 asserted): the reference OIP answers are held to."""
    headers = {"Content-Type": content_type}
    if shape:
        headers["X-Image-Shape"] = shape
    r = httpx.post(f"{server.url}/v1/models/{model}/inspect", content=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_answer(result, index: int, answer: dict) -> None:
    """Frame ``index`` of a tritonclient (HTTP or gRPC) result says what the inspect API said."""
    import numpy as np

    labels = list(answer["scores"])
    np.testing.assert_allclose(result.as_numpy("scores")[index], [answer["scores"][k] for k in labels],
                               atol=1e-4)
    label, verdict = result.as_numpy("label")[index], result.as_numpy("verdict")[index]
    assert (label.decode() if isinstance(label, bytes) else label) == answer["label"]
    assert (verdict.decode() if isinstance(verdict, bytes) else verdict) == answer["verdict"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A real ``visionserve serve`` process on loopback."""

    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(models: Path, tmp_path: Path, *extra: str, grpc: bool = True,
                 env: dict[str, str] | None = None, wait: bool = True,
                 new_session: bool = False, as_shipped: bool = False,
                 nice: int = 0) -> ServerProcess:
    """``new_session``: its own process group, so a test can signal the whole group (Ctrl-C);
    ``as_shipped``: the front ends and batch workers the server chooses for the machine;
    ``nice``: the server (and every process it starts) at that CPU nice increment, for a test
    whose load must not slow the tests running beside it."""
    http_port = free_port()
    grpc_port = free_port() if grpc else -1
    log_path = tmp_path / f"server-{http_port}.log"
    args = [sys.executable, "-m", "visionserve", "serve", "--models", str(models), "--host", "127.0.0.1",
            "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--device", "cpu", *extra]
    # unless the test names them (its flags win): no front ends or batch workers, as the
    # server chooses on the CPU; on a GPU it would choose some
    fixed = {} if as_shipped else IN_PROCESS
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **fixed, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=str(REPO),
                                start_new_session=new_session,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
    server = ServerProcess(proc, http_port, grpc_port, log_path, args)
    if wait:
        try:
            server.wait_ready()
        except BaseException:
            server.stop(signal.SIGKILL)
            raise
    return server


@pytest.fixture
def server_factory(tmp_path) -> Iterator:
    """Start servers with ``server_factory(models_dir, *extra_args)``; all are stopped afterwards."""
    started: list[ServerProcess] = []

    def factory(models: Path, *extra: str, **kw) -> ServerProcess:
        s = start_server(models, tmp_path, *extra, **kw)
        started.append(s)
        return s

    yield factory
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def tiny_server(tiny_repo, tmp_path_factory) -> Iterator[ServerProcess]:
    """One server on the tiny model, shared by a test module."""
    s = start_server(tiny_repo, tmp_path_factory.mktemp("srv"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def jpeg_bytes() -> bytes:
    """A 640x480 JPEG (a generated surface when the generator is there, else a gradient)."""
    import cv2
    import numpy as np

    y, x = np.mgrid[0:480, 0:640]
    img = np.dstack([(x * 255 // 639), (y * 255 // 479), ((x + y) % 256)]).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return buf.tobytes()


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests cleanly where CUDA is absent; in the workers of pytest-xdist skip the
    ``gpu_alone`` ones, which need the GPU to themselves (the others measure only their own
    processes, and share the card). Under ``--dist loadgroup`` the ``gpu`` and ``gpu_path`` tests
    marked ``slow`` come first: the scheduler hands tests out in collection order, and a long one
    handed out last would finish alone (tests/gpu/run_on_device.sh)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        has_cuda = False
    in_worker = "PYTEST_XDIST_WORKER" in os.environ
    if getattr(config.option, "loadgroup", False):  # xdist sets it in its workers
        items.sort(key=lambda item: not (item.get_closest_marker("slow") and (
            item.get_closest_marker("gpu") or item.get_closest_marker("gpu_path"))))
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
    elif in_worker:
        alone = pytest.mark.skip(reason="needs the GPU to itself: run it without -n")
        for item in items:
            if item.get_closest_marker("gpu_alone") is not None:
                item.add_marker(alone)


#: the console's browser tests drive these (Debian's chromium and chromium-driver)
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium through its chromedriver, for the console's browser tests
    (tests/browser; they skip where either is absent, browserkit.MARKS)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--force-prefers-reduced-motion"):
        options.add_argument(arg)
    # the driver's path given: Selenium never runs selenium-manager, nothing is downloaded
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
