"""The guard's job API runs commands: a protected route, which needs the admin token unless the
server listens on loopback only (docs/security.md). Real servers, bound to a non-loopback address inside a
network namespace the test makes for itself: nothing outside the test can reach them, even if the
refusal were broken. Where no namespace can be made (not root), the server binds 0.0.0.0 and the
test connects over loopback: the rule is about the bind address, not the client's."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import wait_for

ADDR = "10.231.0.1"  # lives only on the namespace's own lo
TOKEN = "plant-7-secret"
ADMIN = "plant-7-admin"
CLONE_NEWNET = 0x40000000


def isolated(fn):
    """``fn(bind, connect)`` in a thread of its own network namespace (only ``lo``, up, with ADDR
    on it), which the servers it starts inherit; else in this one with ``0.0.0.0``."""
    out: dict = {}

    def body() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            out["fallback"] = os.strerror(ctypes.get_errno())
            return
        try:
            for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{ADDR}/32", "dev", "lo"]):
                subprocess.run(cmd, check=True, capture_output=True, timeout=10)
            out["value"] = fn(ADDR, ADDR)
        except FileNotFoundError as exc:  # no `ip`: the namespace has no address to bind
            out["fallback"] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=body)  # a thread: the namespace ends with it
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    if "fallback" in out:
        return fn("0.0.0.0", "127.0.0.1")
    return out["value"]


def guard_server(server_factory, tiny_repo, tmp_path, bind: str, connect: str, *extra: str):
    s = server_factory(tiny_repo, "--guard", "--guard-db", str(tmp_path / "guard.sqlite"), "--host", bind,
                       *extra, grpc=False, wait=False)
    url = f"http://{connect}:{s.http_port}"

    def ready() -> bool:
        assert s.proc.poll() is None, s.log()
        try:
            return httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout=120, what="server ready")
    return s, url


def job(marker) -> dict:
    return {"name": "probe", "command": [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ran')"]}


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_guard_api_refused_without_the_admin_token_beyond_loopback(tiny_repo, server_factory, tmp_path,
                                                                   jpeg_bytes, frontends):
    """With front-end processes each one serves the guard's API, and each one refuses it."""
    marker = tmp_path / "ran.txt"

    def check(bind: str, connect: str) -> None:
        s, url = guard_server(server_factory, tiny_repo, tmp_path, bind, connect, "--frontends", frontends,
                              "--auth-token", TOKEN, "--admin-token", ADMIN)
        r = httpx.post(url + "/v1/guard/jobs", json=job(marker))
        assert r.status_code == 401, r.text
        assert "admin token" in r.json()["error"]
        inference = {"Authorization": f"Bearer {TOKEN}"}
        for method, path in (("POST", "/v1/guard/jobs"), ("GET", "/v1/guard/jobs"), ("GET", "/v1/guard/jobs/1"),
                             ("GET", "/v1/guard/jobs/1/logs"), ("POST", "/v1/guard/jobs/1/cancel")):
            assert httpx.request(method, url + path).status_code == 401, path
            # the inference token opens no protected route
            assert httpx.request(method, url + path, headers=inference).status_code == 403, path
        # the rest of the server is unchanged
        r = httpx.post(url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                       headers={"Content-Type": "image/jpeg", **inference})
        assert r.status_code == 200, r.text
        assert "access: protected" in s.log() and "need the admin token" in s.log()

    isolated(check)
    time.sleep(1.0)  # a queued job would have started by now
    assert not marker.exists()
    from visionserve.guard.store import JobStore

    assert JobStore(str(tmp_path / "guard.sqlite")).list(None) == []


def test_guard_api_needs_the_admin_token_beyond_loopback(tiny_repo, server_factory, tmp_path):
    marker = tmp_path / "ran.txt"

    def check(bind: str, connect: str) -> None:
        s, url = guard_server(server_factory, tiny_repo, tmp_path, bind, connect, "--auth-token", TOKEN,
                              "--admin-token", ADMIN)
        assert httpx.post(url + "/v1/guard/jobs", json=job(marker)).status_code == 401
        assert httpx.post(url + "/v1/guard/jobs", json=job(marker),
                          headers={"Authorization": "Bearer nope"}).status_code == 401
        r = httpx.post(url + "/v1/guard/jobs", json=job(marker), headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 201, r.text
        wait_for(marker.exists, timeout=60, what="the job to run")
        # open with auth on: health (probes) and /metrics (scrapers); all else needs a token
        assert httpx.get(url + "/v2/health/ready").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        for path in ("/v2", "/v2/models/tiny", "/v2/models/tiny/config", "/v2/models/stats", "/docs",
                     "/openapi.json", "/v1/guard/jobs"):
            assert httpx.get(url + path).status_code == 401, path

    isolated(check)
