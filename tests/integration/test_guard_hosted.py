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
