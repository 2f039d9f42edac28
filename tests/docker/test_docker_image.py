"""The CPU image, run as a real container (issue 23).

Each container runs as the compose file runs the server: read-only root filesystem, a tmpfs at
/tmp, the image's own user, HEALTHCHECK, ENTRYPOINT and CMD, ports published on 127.0.0.1 only.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from dockerkit import REPO, Containers, build_image, docker, readable_copy, skip_without_engine

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

SHIPPED = "defect-classifier"
MODELS_IN_IMAGE = "/opt/visionserve/models"


@pytest.fixture(scope="module")
def image() -> str:
    skip_without_engine()
    return build_image()


@pytest.fixture(scope="module")
def containers(image):
    c = Containers(image)
    yield c
    c.remove_all()


@pytest.fixture(scope="module")
def served(containers):
    """One container of the image as shipped (its own models), shared by the read-only checks."""
    c = containers.run()
    c.ready_s = c.wait_ready(60)
    return c


def jpeg(width: int = 640, height: int = 480, seed: int = 0) -> bytes:
    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    img = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 85])
    assert ok
    return buf.tobytes()


def inspect(url: str, model: str, body: bytes, part: str = "p1", client=httpx) -> httpx.Response:
    # a generous deadline: these tests check the API through the container, not the takt; a
    # container's first frame on a loaded CI box took 200.3 ms against the model's 200 ms takt
    return client.post(f"{url}/v1/models/{model}/inspect", content=body,
                       headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                                "X-Deadline-Ms": "10000"}, timeout=30)


# --- health, API, user, filesystem -------------------------------------------------------------

def test_turns_ready_after_start(served):
    """The container answers ready through its published port; the fixture waits up to 60 s, so a
    start-up that hangs fails here. How fast it starts is a benchmark figure, not this test's
    (docs/deployment.md: 1.3 s, the issue's target 10 s, ``tests/tools/image_figures.py``): on a
    loaded 2-core CI box the first container after the build once took 11.4 s."""
    assert 0 < served.ready_s < 60
    print(f"start to ready: {served.ready_s:.1f} s")


def test_healthy_by_its_own_healthcheck(served):
    # the image's HEALTHCHECK runs every 10 s; the first run after start decides
    served.wait_health("healthy", timeout=40)
    log = served.inspect()["State"]["Health"]["Log"]
    assert log and log[-1]["ExitCode"] == 0


def test_inspect_api_and_oip_answer_through_the_published_port(served):
    url = served.url
    assert httpx.get(url + "/v2/health/live").status_code == 200
    meta = httpx.get(f"{url}/v2/models/{SHIPPED}").json()
    assert meta["name"] == SHIPPED and meta["versions"] == ["1"]
    assert httpx.get(f"{url}/v2/models/{SHIPPED}/config").status_code == 200

    r = inspect(url, SHIPPED, jpeg(), part="A-1")
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["part_id"] == "A-1" and answer["verdict"] in ("OK", "NG")

    req = {"id": "r1", "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                   "data": [base64.b64encode(jpeg()).decode()]}]}
    r = httpx.post(f"{url}/v2/models/{SHIPPED}/infer", json=req, timeout=30)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["label"]["data"][0] == answer["label"]
    assert out["verdict"]["data"][0] == answer["verdict"]
    assert "visionserve_requests_total" in httpx.get(url + "/metrics").text


def test_grpc_answers_through_the_published_port(served):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.port(8001)}")
    assert client.is_server_ready()
    assert client.is_model_ready(SHIPPED)


def test_runs_as_the_non_root_user_on_a_read_only_root(served):
    info = served.inspect()
    assert info["Config"]["User"] == "10001:10001"
    assert info["HostConfig"]["ReadonlyRootfs"] is True
    assert served.exec("id", "-u").stdout.strip() == "10001"
    # pid 1 is tini, the server its child, both as 10001
    ps = served.exec("sh", "-c", "for p in /proc/[0-9]*; do echo $(cat $p/comm) $(stat -c %u $p); done")
    procs = dict(line.split() for line in ps.stdout.splitlines() if line.strip())
    assert procs.get("tini") == "10001" and "visionserve" in procs, ps.stdout
    denied = served.exec("touch", "/opt/visionserve/x")
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    assert served.exec("touch", "/tmp/x").returncode == 0          # the tmpfs


def test_doctor_inside_exits_as_expected(served):
    ok = served.exec("visionserve", "doctor")
    assert ok.returncode == 0, ok.stdout + ok.stderr        # the CPU image on a CPU: nothing wrong
    assert "0 failure(s)" in ok.stdout
    # asked for a GPU the container does not have: failures, exit 2, with the fix named
    gpu = served.exec("visionserve", "doctor", "--device", "cuda:0")
    assert gpu.returncode == 2, gpu.stdout + gpu.stderr
    assert "[FAIL] nvidia_driver" in gpu.stdout and "fix:" in gpu.stdout


# --- a model repository mounted from the host; docker stop under load ------------------------

@pytest.fixture(scope="module")
def host_repo(tmp_path_factory) -> Path:
    """A host folder: the shipped model under another name, and a slow model (~0.1 s a frame)."""
    from conftest import make_slow_model

    root = tmp_path_factory.mktemp("hostrepo")
    readable_copy(REPO / "models" / SHIPPED, root / "line3-classifier")
    toml = root / "line3-classifier" / "model.toml"
    toml.write_text(toml.read_text().replace(f'name = "{SHIPPED}"', 'name = "line3-classifier"'))
    make_slow_model(root / "slow")
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


def repo_mount(path: Path) -> str:
    return f"type=bind,src={path},dst={MODELS_IN_IMAGE},readonly"


def test_model_repository_mounted_from_the_host_is_served(containers, host_repo):
    c = containers.run(mounts=(repo_mount(host_repo),))
    c.wait_ready(60)
    url = c.url
    assert httpx.get(f"{url}/v2/models/line3-classifier/ready").status_code == 200
    assert httpx.get(f"{url}/v2/models/{SHIPPED}").status_code == 404    # the image's own, hidden
    r = inspect(url, "line3-classifier", jpeg(), part="L3")
    assert r.status_code == 200 and r.json()["part_id"] == "L3", r.text


def test_docker_stop_under_load_loses_no_request(containers, host_repo):
    """Clients keep frames in flight; `docker stop` (SIGTERM through tini) comes mid-load. Every
    request gets an HTTP answer: 200 for what the server had taken, 503 + Retry-After for what came
    during the drain; a client stops sending at its first 503 (the server is going away), as a line
    controller would. Lost = a request sent on an open connection that got no answer at all."""
    c = containers.run(mounts=(repo_mount(host_repo),), env={"VISIONSERVE_DRAIN_TIMEOUT_S": "20"})
    c.wait_ready(60)
    url = f"{c.url}/v1/models/slow/inspect"
    frame = jpeg(640, 480, seed=3)
    outcomes: dict[str, object] = {}
    lock = threading.Lock()
    first_answers = threading.Barrier(13)

    def client(i: int) -> None:
        n = 0
        arrived = False
        with httpx.Client(timeout=60) as http:
            while True:
                part = f"c{i}-{n}"
                n += 1
                try:
                    r = inspect(url.rsplit("/v1/", 1)[0], "slow", frame, part=part, client=http)
                    result: object = (r.status_code, r.json().get("part_id"), r.headers.get("retry-after"))
                except httpx.ConnectError:
                    result = "refused"            # nothing was sent: the port is closed
                except httpx.HTTPError as exc:
                    result = f"lost: {exc!r}"
                with lock:
                    outcomes[part] = result
                if not arrived:
                    arrived = True
                    try:
                        first_answers.wait(timeout=60)
                    except threading.BrokenBarrierError:
                        pass
                if result == "refused" or not isinstance(result, tuple) or result[0] != 200:
                    return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    first_answers.wait(timeout=60)      # every client has had one answer: the load is steady
    time.sleep(0.3)
    t0 = time.monotonic()
    stop = docker("stop", "-t", "30", c.cid, timeout=60)
    stop_s = time.monotonic() - t0
    for t in threads:
        t.join(timeout=60)
    state = c.state()
    lost = {p: o for p, o in outcomes.items() if isinstance(o, str) and o.startswith("lost")}
    answered = [o for o in outcomes.values() if isinstance(o, tuple)]
    ok = [o for o in answered if o[0] == 200]
    refused = [o for o in answered if o[0] == 503]
    assert not lost, f"{len(lost)} lost of {len(outcomes)}: {lost}"
    assert all(o[0] in (200, 503) for o in answered), answered
    assert all(o[2] for o in refused), "a 503 without Retry-After"
    assert len(ok) >= 12 + 4, "too little load at the stop"
    assert stop.returncode == 0 and state["ExitCode"] == 0, c.logs()
    assert stop_s < 30, f"docker stop took {stop_s:.1f} s: SIGKILLed at the grace period?"
    log = c.logs()
    assert "draining" in log and "Traceback" not in log
    # for the record (docs/deployment.md)
    print(f"\ndocker stop under load: {len(ok)} answered 200, {len(refused)} refused 503, "
          f"{sum(o == 'refused' for o in outcomes.values())} not sent (port closed), 0 lost; "
          f"stop took {stop_s:.2f} s")


# --- bad input ------------------------------------------------------------------------------

def _held(containers, tmp_path, repo: Path, why: str) -> None:
    # the image's HEALTHCHECK command, its timing shortened (start period 180 s in the image)
    c = containers.run(mounts=(repo_mount(repo),), extra=(
        "--restart", "unless-stopped", "--health-start-period", "1s", "--health-interval", "1s",
        "--health-retries", "2"))
    c.wait_health("unhealthy", timeout=40)
    time.sleep(2)
    state = c.state()
    assert state["Running"] and c.inspect()["RestartCount"] == 0, "it crash-loops"
    lines = [ln for ln in c.logs().splitlines() if "not serving" in ln]
    assert len(lines) == 1, c.logs()
    assert why in lines[0] and MODELS_IN_IMAGE in lines[0], lines[0]
    assert "Traceback" not in c.logs()
    t0 = time.monotonic()
    docker("stop", "-t", "20", c.cid)
    assert time.monotonic() - t0 < 10
    assert c.state()["ExitCode"] == 2


def test_empty_mounted_repository_one_clear_line_unhealthy_no_crash_loop(containers, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    _held(containers, tmp_path, empty, "holds no model")


def test_unreadable_mounted_repository_one_clear_line_unhealthy_no_crash_loop(containers, tmp_path):
    locked = tmp_path / "locked"
    readable_copy(REPO / "models" / SHIPPED, locked / SHIPPED)
    locked.chmod(0o700)                       # root's; the container runs as 10001
    _held(containers, tmp_path, locked, "not readable by this process (uid 10001")


def test_missing_host_folder_is_refused_by_docker_naming_it(image, tmp_path):
    missing = tmp_path / "no-such-folder"
    proc = docker("run", "--rm", "--label", "visionserve.test=docker", "--mount", repo_mount(missing),
                  image, check=False)
    assert proc.returncode != 0 and str(missing) in proc.stderr, proc.stderr


def test_read_only_root_without_tmpfs(containers):
    """The CPU server writes nothing at all: read-only without any tmpfs still serves. What does
    need a writable path says which: the hosted guard's job database, without its volume."""
    c = containers.run(tmpfs=False)
    c.wait_ready(60)
    assert inspect(c.url, SHIPPED, jpeg()).status_code == 200
    g = containers.run(tmpfs=False, env={"VISIONSERVE_GUARD": "true"})
    deadline = time.monotonic() + 30
    while "not serving" not in g.logs() and time.monotonic() < deadline:
        time.sleep(0.5)
    lines = [ln for ln in g.logs().splitlines() if "not serving" in ln]
    assert len(lines) == 1 and "/var/lib/visionserve/guard/guard.db" in lines[0], g.logs()


def test_no_build_secret_in_the_image(image):
    """The build host's pip.conf and CA bundle were BuildKit secrets: in no layer, no history."""
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    assert "BEGIN CERTIFICATE" not in history and "pip.conf" not in history.replace("id=pip.conf", "")
    env = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]["Env"]
    assert not any(e.startswith("PIP_") for e in env), env
    look = docker("run", "--rm", "--label", "visionserve.test=docker", "--entrypoint", "sh", image, "-c",
                  "ls /run/secrets 2>/dev/null; ls /root/.cache/pip 2>/dev/null; echo done", check=False)
    assert look.stdout.strip() == "done", look.stdout


# --- the GPU image, on this GPU-less machine (opt-in: it is 6.6 GB) ----------------------------

def test_gpu_image_without_a_gpu():
    """VISIONSERVE_TEST_GPU_IMAGE=visionserve:<version> (deploy/build-image.sh --target gpu): the
    CUDA build of torch is inside; with no GPU, doctor passes and `auto` serves on the CPU. What
    only a GPU shows (CUDA, nvJPEG, the budget) is tests/gpu's, on the GPU machine."""
    gpu_image = os.environ.get("VISIONSERVE_TEST_GPU_IMAGE")
    if not gpu_image:
        pytest.skip("VISIONSERVE_TEST_GPU_IMAGE not set (the GPU image is built on request only)")
    skip_without_engine()
    probe = docker("run", "--rm", "--label", "visionserve.test=docker", "--entrypoint", "python", gpu_image,
                   "-c", "import torch, torchvision; print(torch.__version__, torch.version.cuda, "
                         "torch.cuda.is_available())")
    _version, cuda, available = probe.stdout.split()
    assert cuda.startswith("13") and available == "False", probe.stdout
    doctor = docker("run", "--rm", "--label", "visionserve.test=docker", gpu_image, "doctor", check=False)
    assert doctor.returncode == 0, doctor.stdout
    c = Containers(gpu_image)
    try:
        served = c.run()
        assert served.wait_ready(60) <= 10
        assert "no GPU found" in served.logs()
        assert inspect(served.url, SHIPPED, jpeg()).status_code == 200
    finally:
        c.remove_all()
