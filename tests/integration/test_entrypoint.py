"""The image's entrypoint, exercised outside Docker.

Reads the Dockerfile's ENTRYPOINT + CMD and ENV for each runtime target, runs that same command
line as a subprocess (models pointed at the repo's models/, free loopback ports substituted),
waits for ``/v2/health/ready`` to answer 200, then sends SIGTERM as ``docker stop`` / the kubelet
would and expects exit code 0 within the drain timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from visionserve.config import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
MODELS = ROOT / "models"
READY_TIMEOUT_S = 120.0
# Interpreter and CUDA teardown after the drain; the drain itself is bounded by drain_timeout_s.
EXIT_SLACK_S = 5.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("visionserve.runtime.serve") is None,
                       reason="visionserve.runtime.serve (the serve command) is not in the package yet"),
]


def _image_command(target: str) -> tuple[list[str], dict[str, str]]:
    """ENTRYPOINT + CMD (exec form) and ENV of a build target, following `FROM <stage>` chains."""
    dfp = pytest.importorskip("dockerfile_parse", reason="pip install dockerfile-parse")
    stages: dict[str, dict] = {}
    current: dict | None = None
    for ins in dfp.DockerfileParser(path=str(DOCKERFILE)).structure:
        if ins["instruction"] == "FROM":
            words = ins["value"].split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"#{len(stages)}"
            current = {"parent": stages.get(words[0]), "ins": []}
            stages[name] = current
        elif current is not None:
            current["ins"].append(ins)
    assert target in stages, f"Dockerfile has no stage {target}"

    def chain(stage: dict | None) -> list[dict]:
        return chain(stage["parent"]) + stage["ins"] if stage else []

    entry: list[str] = []
    cmd: list[str] = []
    env: dict[str, str] = {}
    for ins in chain(stages[target]):
        if ins["instruction"] in ("ENTRYPOINT", "CMD"):
            value = ins["value"].strip()
            assert value.startswith("["), f"{ins['instruction']} must be exec form: {value}"
            if ins["instruction"] == "ENTRYPOINT":
                entry, cmd = json.loads(value), []   # a new ENTRYPOINT resets an inherited CMD
            else:
                cmd = json.loads(value)
        elif ins["instruction"] == "ENV":
            parts = shlex.split(ins["value"])
            env.update(p.split("=", 1) for p in parts if "=" in p)
    return entry + cmd, env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_option(argv: list[str], flag: str, value: str) -> list[str]:
    """Replace `flag VALUE` / `flag=VALUE` in argv, or append it."""
    out, i, found = [], 0, False
    while i < len(argv):
        if argv[i] == flag:
            out += [flag, value]
            i += 2
            found = True
            continue
        if argv[i].startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(argv[i])
        i += 1
    return out if found else out + [flag, value]


def _local_argv(image_argv: list[str]) -> list[str]:
    """The image's command with tini (if not installed here) and the console script resolved."""
    argv = list(image_argv)
    if os.path.basename(argv[0]) == "tini":
        tini = shutil.which("tini")
        head = [tini] + argv[1:argv.index("--") + 1] if tini else []
        argv = head + argv[argv.index("--") + 1:]
    else:
        head = []
    body = argv[len(head):]
    assert body[:2] == ["visionserve", "serve"], f"the image runs {image_argv}"
    script = Path(sys.executable).with_name("visionserve")
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "visionserve"]
    return head + exe + body[1:]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


# ids avoid the word "gpu": tests/conftest.py skips items with that keyword where CUDA is absent,
# and the default (GPU) image's command runs on a CPU-only machine too (device auto -> cpu).
@pytest.mark.parametrize("target", ["gpu", "cpu"], ids=["default-image", "cpu-image"])
def test_entrypoint_serves_and_drains_on_sigterm(target, tmp_path):
    image_argv, image_env = _image_command(target)
    http_port, grpc_port = _free_port(), _free_port()
    argv = _local_argv(image_argv)
    argv = _set_option(argv, "--models", str(MODELS))
    argv = _set_option(argv, "--http-port", str(http_port))
    argv = _set_option(argv, "--grpc-port", str(grpc_port))
    argv = _set_option(argv, "--host", "127.0.0.1")   # keep the test server on loopback

    env = dict(os.environ)
    env.update({k: v for k, v in image_env.items() if k != "PATH"})
    # image paths that do not exist outside it
    env.update(VISIONSERVE_MODELS=str(MODELS), VISIONSERVE_HOST="127.0.0.1",
               VISIONSERVE_HTTP_PORT=str(http_port), VISIONSERVE_GRPC_PORT=str(grpc_port),
               XDG_CACHE_HOME=str(tmp_path / "cache"), CUDA_CACHE_PATH=str(tmp_path / "nv"))
    drain_s = ServerSettings().drain_timeout_s if "VISIONSERVE_DRAIN_TIMEOUT_S" not in env \
        else float(env["VISIONSERVE_DRAIN_TIMEOUT_S"])

    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        status = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{shlex.join(argv)} exited {proc.returncode} before ready:\n{_tail(log)}")
            try:
                status, _ = _get(base + "/v2/health/ready")
            except OSError:
                status = None
            if status == 200:
                break
            time.sleep(0.25)
        assert status == 200, f"not ready within {READY_TIMEOUT_S:.0f} s (last {status}):\n{_tail(log)}"

        assert _get(base + "/v2/health/live")[0] == 200
        # the HorizontalPodAutoscaler in deploy/k8s scales on this metric
        code, metrics = _get(base + "/metrics")
        assert code == 200 and "visionserve_queue_depth" in metrics

        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=drain_s + EXIT_SLACK_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {drain_s + EXIT_SLACK_S:.0f} s after SIGTERM:\n{_tail(log)}")
        assert rc == 0, f"exit code {rc} after SIGTERM:\n{_tail(log)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
