"""Slow request bodies and oversized request heads cannot hold the server's connections, on real
servers over loopback. The scenarios of a DoS review, scaled down: clients that fill the
connection limit with requests whose declared body (50 MB) comes a byte at a time, with and
without a token, while a real client must still get its answers."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from conftest import wait_for

LIMIT = 20  # --max-connections
SLOW_HEAD = (b"POST /v1/models/tiny/inspect HTTP/1.1\r\nHost: slow\r\nContent-Type: image/jpeg\r\n"
             b"Content-Length: 50000000\r\n\r\n")


class SlowBodies:
    """``n`` hostile clients: each sends SLOW_HEAD, then a byte every ``every_s``, and keeps sending
    after any answer until the server has closed the connection (a write fails); then it connects
    again, until :meth:`stop`. Runs on its own event loop in a thread."""

    def __init__(self, port: int, n: int, every_s: float = 0.3, head: bytes = SLOW_HEAD) -> None:
        self.port, self.n, self.every_s, self.head = port, n, every_s, head
        self.lifetimes: list[float] = []  # seconds from connect to the server's close
        self.answers: list[bytes] = []    # the status line of each answer
        self.open = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the slow clients did not stop"

    async def _main(self) -> None:
        await asyncio.gather(*(self._one() for _ in range(self.n)))

    async def _one(self) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            opened = time.monotonic()
            self.open += 1
            read = asyncio.ensure_future(reader.readline())
            answered = False
            try:
                writer.write(self.head)
                while not self._stop.is_set():
                    await asyncio.sleep(self.every_s)
                    if not answered and read.done() and read.result():  # record it, go on
                        answered = True
                        self.answers.append(read.result().rstrip())
                        read = asyncio.ensure_future(reader.read())  # the rest: not an answer
                    writer.write(b"x")
                    await writer.drain()
                    if writer.transport.is_closing():
                        break
            except OSError:  # the server closed the connection: our write was reset
                pass
            finally:
                self.open -= 1
                read.cancel()
                writer.close()
            if not self._stop.is_set():
                self.lifetimes.append(time.monotonic() - opened)


def _legit_inspect(url: str, jpeg: bytes, headers: dict, within_s: float) -> tuple[int, float]:
    """(status, seconds) of an inspect request on a new connection, retried on 503 (the
    connection limit's answer) for up to ``within_s``."""
    t0 = time.monotonic()
    while True:
        r = httpx.post(url + "/v1/models/tiny/inspect", content=jpeg, timeout=within_s,
                       headers={"Content-Type": "image/jpeg", **headers})
        if r.status_code != 503 or time.monotonic() - t0 > within_s:
            return r.status_code, time.monotonic() - t0
        time.sleep(0.1)


@pytest.mark.parametrize("token", [None, "s3cret"], ids=["no-auth", "auth"])
def test_slow_bodies_cannot_lock_real_clients_out(tiny_repo, server_factory, jpeg_bytes, token):
    args = ["--max-connections", str(LIMIT), "--min-body-rate-bytes-s", "1000"]
    if token:  # the slow clients send no token: each gets its 401, and must lose its slot
        args += ["--auth-token", token, "--body-timeout-s", "5"]
    s = server_factory(tiny_repo, *args, grpc=False)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    attack = SlowBodies(s.http_port, LIMIT)
    attack.start()
    answered = []
    try:
        wait_for(lambda: attack.open >= LIMIT, timeout=10, what=f"{LIMIT} slow connections")
        end = time.monotonic() + 8
        while time.monotonic() < end:
            answered.append(_legit_inspect(s.url, jpeg_bytes, headers, within_s=5))
            time.sleep(0.2)
    finally:
        attack.stop()
    print(f"\nlegit: {len(answered)} answers, slowest {max(t for _, t in answered):.2f} s; slow "
          f"clients: {len(attack.lifetimes)} closed by the server, longest "
          f"{max(attack.lifetimes, default=0):.2f} s; answers {sorted(set(attack.answers))}")
    assert all(code == 200 and t <= 5 for code, t in answered), answered
    # the slow clients were answered and their connections closed: none held one for long
    assert len(attack.lifetimes) >= LIMIT, attack.lifetimes
    assert max(attack.lifetimes) < 8, attack.lifetimes
    expected = {b"HTTP/1.1 401 Unauthorized"} if token else \
        {b"HTTP/1.1 408 Request Timeout", b"HTTP/1.1 503 Service Unavailable"}
    assert attack.answers and set(attack.answers) <= expected, set(attack.answers)


def test_an_answer_before_the_body_closes_the_connection(tiny_repo, server_factory):
    """401 from the head while the body is still coming: the connection ends (no second request
    on it), though the client goes on sending."""
    s = server_factory(tiny_repo, "--auth-token", "s3cret", grpc=False)
    with socket.create_connection(("127.0.0.1", s.http_port)) as sock:
        sock.settimeout(10)
        sock.sendall(SLOW_HEAD)
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 401"), answer
        assert b"connection: close" in answer.lower()
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < 8:  # go on sending: the server must end it anyway
            try:
                sock.sendall(b"x" * 100)
                if sock.recv(4096, socket.MSG_DONTWAIT) == b"" and not closed:
                    closed = True  # the server's end is closed: no next request will be read
            except BlockingIOError:
                pass
            except OSError:  # reset: the server closed the connection for good
                break
            time.sleep(0.1)
        else:
            pytest.fail("the server kept the connection of an answered request")
        assert closed and time.monotonic() - t0 < 5


def test_a_body_slower_than_the_minimum_rate_gets_408_and_is_closed(tiny_repo, server_factory):
    s = server_factory(tiny_repo, "--min-body-rate-bytes-s", "1000", grpc=False)
    with socket.create_connection(("127.0.0.1", s.http_port)) as sock:
        sock.settimeout(15)
        sock.sendall(SLOW_HEAD.replace(b"50000000", b"100000") + b"\xff\xd8")
        t0 = time.monotonic()
        answer = sock.recv(4096)
        took = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"min_body_rate_bytes_s" in answer and b"connection: close" in answer.lower()
    assert took < 6, took  # 2 s of grace, then it is behind at once (not the 30 s body timeout)
    # a body at a normal rate is unaffected, and the server logged no traceback
    r = httpx.get(s.url + "/v2/health/ready", timeout=5)
    assert r.status_code == 200
    assert "Traceback" not in s.log()


@pytest.mark.parametrize("how", ["one header", "many headers"])
def test_a_request_head_over_64_kib_gets_431(tiny_server, how):
    headers = {"X-Big": "a" * 1_000_000} if how == "one header" else \
        {f"X-H{i}": "b" * 1000 for i in range(1000)}
    r = httpx.get(tiny_server.url + "/v2/health/ready", headers=headers, timeout=10)
    assert r.status_code == 431, r.text
    assert "request head" in r.json()["error"]
    assert r.headers["connection"] == "close"
    # a head just under the limit is still served
    r = httpx.get(tiny_server.url + "/v2/health/ready", headers={"X-Big": "a" * 60_000}, timeout=10)
    assert r.status_code == 200
