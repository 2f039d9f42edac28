"""Slow and surplus HTTP clients cannot take the port (issue 14, defect 7), on a real server over
loopback: 1,000 connections that send their request head a few bytes at a time (slowloris), the
default --max-connections, while health and inspect requests must keep being answered."""

from __future__ import annotations

import asyncio
import resource
import socket
import statistics
import threading
import time

import httpx
import pytest
from conftest import wait_for

SLOW = 1000  # the default --max-connections
HEADER_TIMEOUT_S = 1.5
ATTACK_S = 6.0
SLACK_S = 3.0  # a loaded 2-core box: the server's timers and the test's own threads run late


class Slowloris:
    """``n`` connections, each sending a request head a header line at a time, never ending it. A
    connection the server closes is opened again until :meth:`stop`; the attack runs on its own
    event loop in a thread, and stops by itself after ``max_s``."""

    def __init__(self, port: int, n: int, max_s: float) -> None:
        self.port, self.n, self.max_s = port, n, max_s
        self.lifetimes: list[float] = []  # seconds the server let a connection live
        self.answers: list[bytes] = []    # the status line the server sent before closing, if any
        self._writers: set[asyncio.StreamWriter] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def open(self) -> int:
        return len(self._writers)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "slowloris did not stop"

    async def _main(self) -> None:
        end = time.monotonic() + self.max_s
        tasks = [asyncio.ensure_future(self._one()) for _ in range(self.n)]
        while not self._stop.is_set() and time.monotonic() < end:
            for writer in list(self._writers):  # one more header line on every connection
                writer.write(b"X-Slow: 1\r\n")
            await asyncio.sleep(0.5)
        self._stop.set()
        for writer in list(self._writers):  # our side closes: each read below ends
            writer.close()
        await asyncio.gather(*tasks)

    async def _one(self) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            opened = time.monotonic()
            self._writers.add(writer)
            writer.write(b"GET /v2/health/ready HTTP/1.1\r\nHost: slow\r\n")
            try:
                answer = await reader.read(256)  # until the server answers or closes
            except OSError:  # reset by the server
                answer = b""
            self._writers.discard(writer)
            writer.close()
            if self._stop.is_set():
                return
            self.lifetimes.append(time.monotonic() - opened)
            self.answers.append(answer.split(b"\r\n", 1)[0])


@pytest.fixture(scope="module")
def slow_server(tiny_repo, tmp_path_factory):
    from conftest import start_server

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 4 * SLOW + 1024)  # both ends of every connection live on this machine
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    # the setting goes in the environment: a server without it starts all the same, unprotected
    s = start_server(tiny_repo, tmp_path_factory.mktemp("slow"), grpc=False,
                     env={"VISIONSERVE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)})
    yield s
    s.stop()


def test_slowloris_cannot_take_the_port(slow_server, jpeg_bytes):
    s = slow_server
    health, inspect, open_at_probe = [], [], []
    attack = Slowloris(s.http_port, SLOW, max_s=ATTACK_S + 30)
    attack.start()
    try:
        wait_for(lambda: attack.open >= SLOW * 0.95, timeout=20, what=f"{SLOW} slow connections")
        end = time.monotonic() + ATTACK_S
        while time.monotonic() < end:
            open_at_probe.append(attack.open)
            t0 = time.monotonic()
            r = httpx.get(s.url + "/v2/health/ready", timeout=5)  # a new connection each time
            health.append((r.status_code, time.monotonic() - t0, r.text[:80]))
            t0 = time.monotonic()
            r = httpx.post(s.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                           headers={"Content-Type": "image/jpeg"}, timeout=5)
            inspect.append((r.status_code, time.monotonic() - t0, r.text[:80]))
            time.sleep(0.1)
    finally:
        attack.stop()
    lat = sorted(t for _, t, _ in health)
    print(f"\nslowloris: {len(health)} health checks, p50 {statistics.median(lat) * 1000:.1f} ms, "
          f"max {lat[-1] * 1000:.1f} ms; inspect max {max(t for _, t, _ in inspect) * 1000:.1f} ms; "
          f"slow connections open at each probe: median {statistics.median(open_at_probe)}, "
          f"min {min(open_at_probe)}; {len(attack.lifetimes)} closed by the server, lifetime max "
          f"{max(attack.lifetimes, default=0):.2f} s")
    assert all(code == 200 for code, _, _ in health), [h for h in health if h[0] != 200][:3]
    assert all(code == 200 for code, _, _ in inspect), [i for i in inspect if i[0] != 200][:3]
    assert statistics.median(open_at_probe) >= SLOW * 0.8, "the attack was not at full strength"
    # every slow connection was closed by the server, after the header timeout at the latest
    assert len(attack.lifetimes) >= SLOW, len(attack.lifetimes)
    assert max(attack.lifetimes) <= HEADER_TIMEOUT_S + SLACK_S, max(attack.lifetimes)
    assert {a[:12] for a in attack.answers} <= {b"HTTP/1.1 408", b"HTTP/1.1 503", b""}
    assert b"HTTP/1.1 408" in {a[:12] for a in attack.answers}


def test_a_silent_connection_is_closed_after_the_header_timeout(slow_server):
    with socket.create_connection(("127.0.0.1", slow_server.http_port)) as sock:
        sock.settimeout(HEADER_TIMEOUT_S + SLACK_S + 5)
        t0 = time.monotonic()
        try:
            data = sock.recv(1024)
        except TimeoutError:
            data = None
        assert data == b"", "the server kept a connection that sent nothing"
        assert time.monotonic() - t0 <= HEADER_TIMEOUT_S + SLACK_S


def test_over_the_limit_503_is_json_with_retry_after_and_health_answers(tiny_repo, server_factory):
    """Every connection has a request in progress (bodies still arriving): a new request gets a
    JSON 503 with Retry-After, and health checks are still answered."""
    s = server_factory(tiny_repo, "--max-connections", "3", grpc=False)
    busy = []
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", s.http_port))
            sock.sendall(b"POST /v1/models/tiny/inspect HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                         b"Content-Length: 100000\r\n\r\n" + b"\xff\xd8")
            busy.append(sock)
        time.sleep(0.3)
        r = httpx.get(s.url + "/v2/models/tiny", timeout=5)
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/json"
        assert "max_connections" in r.json()["error"]
        assert int(r.headers["retry-after"]) >= 1
        assert httpx.get(s.url + "/v2/health/ready", timeout=5).status_code == 200
    finally:
        for sock in busy:
            sock.close()
    # the busy ones are gone: served again
    wait_for(lambda: httpx.get(s.url + "/v2/models/tiny", timeout=5).status_code == 200, timeout=10,
             what="service after the busy connections closed")
