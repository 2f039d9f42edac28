"""`visionserve serve --guard`: the supervisor runs inside the server, its API under /v1/guard/jobs."""

from __future__ import annotations

import sys
import time

import httpx
import pytest


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_serve_hosts_the_guard(tiny_repo, server_factory, tmp_path, frontends):
    """With front-end processes, each serves the guard's API from the same SQLite queue; the one
    supervisor runs in the serving process."""
    db = tmp_path / "guard.sqlite"
    s = server_factory(tiny_repo, "--guard", "--guard-db", str(db), "--frontends", frontends, grpc=False)
    marker = tmp_path / "ran.txt"
    r = httpx.post(s.url + "/v1/guard/jobs", json={
        "name": "fine-tune", "command": [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"]})
    assert r.status_code in (200, 201), r.text
    job_id = r.json()["id"]
    end = time.monotonic() + 60
    state = None
    while time.monotonic() < end:
        state = httpx.get(f"{s.url}/v1/guard/jobs/{job_id}").json()["state"]
        if state in ("succeeded", "failed", "killed"):
            break
        time.sleep(0.2)
    assert state == "succeeded"
    assert marker.read_text() == "x"
    assert httpx.get(s.url + "/v1/guard/jobs/99999").status_code == 404
    # inference keeps working beside it
    assert httpx.get(s.url + "/v2/health/ready").status_code == 200
    assert "serial job queue" in s.log()


def _server_with_a_running_job(server_factory, tiny_repo, tmp_path, *extra: str):
    """A server hosting the guard with a latency budget of 0.001 ms (every frame misses it) and a
    job running under it: (server, job id, a function that reads the job)."""
    s = server_factory(tiny_repo, "--guard", "--guard-db", str(tmp_path / "guard.sqlite"),
                       "--guard-latency-budget-ms", "0.001", *extra, grpc=False)
    r = httpx.post(s.url + "/v1/guard/jobs", json={"name": "ft", "command": [sys.executable, "-c",
                                                                               "import time; time.sleep(60)"]})
    job_id = r.json()["id"]

    def state():
        return httpx.get(f"{s.url}/v1/guard/jobs/{job_id}").json()

    end = time.monotonic() + 30
    while state()["state"] != "running" and time.monotonic() < end:
        time.sleep(0.1)
    assert state()["state"] == "running"
    return s, job_id, state


def test_latency_budget_pauses_a_job_while_the_line_is_slow(tiny_repo, server_factory, tmp_path, jpeg_bytes):
    """End to end: the engine's own p99 drives the hosted guard. A budget of 0.001 ms is missed by
    every frame, so the job is paused once the server answers frames, and resumes when it stops
    (a second later the window is empty: no p99, no reason to hold training back)."""
    s, job_id, state = _server_with_a_running_job(server_factory, tiny_repo, tmp_path)
    with httpx.Client(timeout=30) as c:
        for _ in range(40):
            assert c.post(s.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                          headers={"Content-Type": "image/jpeg"}).status_code == 200
    end = time.monotonic() + 10
    while state()["state"] != "paused" and time.monotonic() < end:
        time.sleep(0.05)
    job = state()
    assert job["state"] == "paused" and "over the latency budget 0.001 ms" in job["reason"], job
    end = time.monotonic() + 10
    while state()["state"] != "running" and time.monotonic() < end:
        time.sleep(0.1)
    assert state()["state"] == "running" and "served p99 n/a" in state()["reason"]
    assert "pause while the served p99 is over 0.001 ms" in s.log()
    assert httpx.post(f"{s.url}/v1/guard/jobs/{job_id}/cancel").status_code == 200


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_late_answers_count_in_the_latency_budget(tiny_repo, server_factory, tmp_path, jpeg_bytes, frontends):
    """Frames answered LATE (504: the deadline passed before they ran) are in the served p99, at
    least at their deadline: a line that misses every deadline pauses the job and keeps it paused
    (they used to be left out, so the p99 read "n/a" and training resumed exactly then)."""
    s, job_id, _ = _server_with_a_running_job(server_factory, tiny_repo, tmp_path, "--frontends", frontends)
    with httpx.Client(timeout=30) as c:
        def late_frames():
            for _ in range(10):
                r = c.post(s.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                           headers={"Content-Type": "image/jpeg", "X-Deadline-Ms": "0.01"})
                assert r.status_code == 504 and r.json()["verdict"] == "LATE", r.text
            return c.get(f"{s.url}/v1/guard/jobs/{job_id}").json()

        end = time.monotonic() + 10
        while (job := late_frames())["state"] != "paused":
            assert time.monotonic() < end, f"only late frames, and the job was not paused: {job}"
        assert "over the latency budget 0.001 ms" in job["reason"], job
        for _ in range(30):  # nothing but late frames for a while: the job stays paused
            assert (job := late_frames())["state"] == "paused", job
    assert httpx.post(f"{s.url}/v1/guard/jobs/{job_id}/cancel").status_code == 200


def test_guard_mps_without_a_gpu_says_why_and_serves(tiny_repo, server_factory, tmp_path):
    """--guard-mps where MPS cannot run (no GPU here): the server starts, says why at start-up,
    reports it on /metrics, and its jobs run as before."""
    s = server_factory(tiny_repo, "--guard", "--guard-db", str(tmp_path / "guard.sqlite"),
                       "--guard-mps", grpc=False)
    assert "guard: CUDA MPS not used: no GPU" in s.log()
    assert "visionserve_guard_mps_active 0.0" in httpx.get(s.url + "/metrics").text
    r = httpx.post(s.url + "/v1/guard/jobs", json={"name": "t", "command": [sys.executable, "-c",
                                                                              "print('ran')"]})
    assert r.status_code == 201, r.text
    end = time.monotonic() + 60
    while time.monotonic() < end:
        job = httpx.get(f"{s.url}/v1/guard/jobs/{r.json()['id']}").json()
        if job["state"] in ("succeeded", "failed", "killed"):
            break
        time.sleep(0.2)
    assert job["state"] == "succeeded" and job["mechanism"] != "mps", job
