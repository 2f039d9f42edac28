"""Shutdown and client disconnects on a real server process.

SIGTERM under load needs work that is still queued when the signal arrives, so these tests use a
deliberately slow model (a few 3x3 convolutions at 256x256 on one CPU thread: about 0.1 s a
frame) next to the tiny one.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from conftest import make_slow_model, start_server


@pytest.fixture(scope="module")
def slow_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slowrepo")
    make_slow_model(root / "slow")
    return root


def post_frame(url: str, jpeg: bytes, part: str, results: dict, client: httpx.Client) -> None:
    try:
        r = client.post(url, content=jpeg, headers={"Content-Type": "image/jpeg", "X-Part-Id": part})
        results[part] = (r.status_code, r.json())
    except httpx.HTTPError as exc:  # a cut connection: recorded, asserted on below
        results[part] = (None, repr(exc))


class Burst:
    """``n`` clients, each with one frame in flight; returns once the first answer is in (the
    first batch ran; by then every request has long been read and the rest are queued)."""

    def __init__(self, url: str, jpeg: bytes, n: int, live_url: str) -> None:
        self.n = n
        self.clients = [httpx.Client(timeout=120) for _ in range(n)]
        for c in self.clients:  # connect first, so the burst is only the requests
            assert c.get(live_url).status_code == 200
        self.results: dict[str, tuple] = {}
        self.threads = [threading.Thread(target=post_frame, args=(url, jpeg, f"p{i}", self.results, c))
                        for i, c in enumerate(self.clients)]
        for t in self.threads:
            t.start()
        end = time.monotonic() + 120
        while not self.results and time.monotonic() < end:
            time.sleep(0.01)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout)
        for c in self.clients:
            c.close()


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_sigterm_under_load_drains_and_exits_0(slow_repo, tmp_path, jpeg_bytes, frontends):
    drain_timeout = 60.0
    s = start_server(slow_repo, tmp_path, "--drain-timeout-s", str(drain_timeout), "--frontends", frontends,
                     grpc=False)
    try:
        url = s.url + "/v1/models/slow/inspect"
        n = 12  # three batches of 4 at ~0.1 s a frame: still queued when the signal comes
        burst = Burst(url, jpeg_bytes, n, s.url + "/v2/health/live")
        results = burst.results
        assert results, "no answer at all"
        assert len(results) < n, "everything finished before SIGTERM; the model is too fast for this test"
        signal_at = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)

        # during the drain: not ready, new work refused with 503 and Retry-After
        with httpx.Client(timeout=30) as late:
            ready = late.get(s.url + "/v2/health/ready")
            refused = late.post(url, content=jpeg_bytes, headers={"Content-Type": "image/jpeg",
                                                                  "X-Part-Id": "after"})
            model_ready = late.get(s.url + "/v2/models/slow/ready")
        assert len(results) < n, "the drain was over before the probes; cannot check the 503s"
        assert ready.status_code == 503 and ready.json() == {"ready": False}
        assert model_ready.status_code == 503
        assert refused.status_code == 503, refused.text
        assert "shutting down" in refused.json()["error"]
        assert refused.json()["part_id"] == "after"
        assert int(refused.headers["Retry-After"]) >= 1

        # every request accepted before the signal gets its answer
        burst.join(timeout=drain_timeout + 30)
        assert sorted(results) == sorted(f"p{i}" for i in range(n))
        for part, (status, body) in results.items():
            assert status == 200, (part, body)
            assert body["part_id"] == part and body["verdict"] in ("OK", "NG")
        code = s.proc.wait(timeout=drain_timeout + 30)
        assert code == 0, s.log()
        assert time.monotonic() - signal_at < drain_timeout
        log = s.log()
        assert "draining" in log
        assert "Traceback" not in log
    finally:
        s.stop(signal.SIGKILL)


def test_drain_timeout_answers_the_rest_503_and_exits_0(slow_repo, tmp_path, jpeg_bytes):
    drain_timeout = 0.2
    s = start_server(slow_repo, tmp_path, "--drain-timeout-s", str(drain_timeout), grpc=False)
    try:
        url = s.url + "/v1/models/slow/inspect"
        n = 60  # fifteen batches: far more than 0.2 s of work, even on a quiet machine
        burst = Burst(url, jpeg_bytes, n, s.url + "/v2/health/live")
        results = burst.results
        s.proc.send_signal(signal.SIGTERM)
        burst.join(timeout=60)
        code = s.proc.wait(timeout=60)
        assert code == 0, s.log()
        statuses = [results[f"p{i}"][0] for i in range(n)]
        # nobody is left hanging or cut off: each got an answer or a clean 503
        assert set(statuses) <= {200, 503}, results
        assert statuses.count(200) >= 4 and statuses.count(503) >= 1, statuses
        shut = [b for st, b in results.values() if st == 503]
        assert all("shut down" in b["error"] or "shutting down" in b["error"] for b in shut), shut
        assert "drain timeout" in s.log()
    finally:
        s.stop(signal.SIGKILL)


def test_disconnected_client_is_dropped_before_compute(tiny_repo, tmp_path, jpeg_bytes):
    s = start_server(tiny_repo, tmp_path, "--max-queue-delay-ms", "1500", grpc=False)
    try:
        url = s.url + "/v1/models/tiny/inspect"
        with pytest.raises(httpx.TimeoutException):
            # the frame waits 1.5 s for company; the client gives up after 0.3 s and hangs up
            httpx.post(url, content=jpeg_bytes, headers={"Content-Type": "image/jpeg"}, timeout=0.3)
        time.sleep(2.5)  # well past the queue delay: had it stayed queued, it would have run by now
        stats = httpx.get(s.url + "/v2/models/tiny/stats", timeout=30).json()["model_stats"][0]
        assert stats["execution_count"] == 0 and stats["inference_count"] == 0, stats
        log = s.log()
        assert "client disconnected before its answer; request dropped" in log
        assert "Exception in ASGI application" not in log and "Traceback" not in log
        # the server is fine and the next client gets its answer
        r = httpx.post(url, content=jpeg_bytes, headers={"Content-Type": "image/jpeg"}, timeout=60)
        assert r.status_code == 200, r.text
        stats = httpx.get(s.url + "/v2/models/tiny/stats", timeout=30).json()["model_stats"][0]
        assert stats["execution_count"] == 1 and stats["inference_count"] == 1
        assert httpx.get(s.url + "/v2/health/ready", timeout=30).status_code == 200
    finally:
        assert s.stop() == 0


def test_sigterm_when_idle_exits_0_promptly(tiny_repo, tmp_path):
    s = start_server(tiny_repo, tmp_path, grpc=False)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    try:
        assert s.proc.wait(timeout=30) == 0
    except subprocess.TimeoutExpired:
        s.stop(signal.SIGKILL)
        raise
    assert time.monotonic() - t0 < 20  # less than the default drain timeout: nothing to wait for


def test_ctrl_c_to_the_process_group_with_front_ends_drains(slow_repo, tmp_path, jpeg_bytes):
    """Ctrl-C in a terminal signals every process of the group: the front ends leave shutdown to
    the serving process, so frames already accepted are still answered."""
    import os

    s = start_server(slow_repo, tmp_path, "--frontends", "2", "--drain-timeout-s", "60", grpc=False,
                     new_session=True)
    try:
        burst = Burst(s.url + "/v1/models/slow/inspect", jpeg_bytes, 8, s.url + "/v2/health/live")
        assert burst.results and len(burst.results) < 8, "the model is too fast for this test"
        os.killpg(s.proc.pid, signal.SIGINT)
        burst.join(timeout=90)
        assert sorted(burst.results) == sorted(f"p{i}" for i in range(8))
        assert all(status == 200 for status, _ in burst.results.values()), burst.results
        assert s.proc.wait(timeout=90) == 0, s.log()
    finally:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)


def _burst_with_sigterm(s, jpeg: bytes, clients: int = 48, requests: int = 96,
                        signal_after_s: float = 0.15) -> list:
    """``clients`` threads send ``requests`` inspect requests in all, each on a new connection;
    SIGTERM comes ``signal_after_s`` after the first answer. Returns each request's outcome: (status,
    Retry-After) or the exception's name."""
    outcomes: list = []
    per_client = requests // clients
    go = threading.Event()

    def client() -> None:
        go.wait()
        for _ in range(per_client):
            try:
                with httpx.Client(timeout=30) as c:  # a new connection for every request
                    r = c.post(s.url + "/v1/models/tiny/inspect", content=jpeg,
                               headers={"Content-Type": "image/jpeg"})
                outcomes.append((r.status_code, r.headers.get("retry-after")))
            except httpx.ConnectError:  # refused: the listener was closed, nothing was accepted
                outcomes.append("refused")
            except httpx.HTTPError as exc:
                outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    go.set()
    end = time.monotonic() + 30
    while not outcomes and time.monotonic() < end:  # the burst has reached the server
        time.sleep(0.005)
    time.sleep(signal_after_s)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    return outcomes


def _shutdown_under(load, repo: Path, tmp_path: Path, jpeg: bytes, frontends: str) -> list:
    """Start a server with ``--frontends``, put it under ``load`` (which sends SIGTERM), check
    that it exits 0; returns the outcomes ``load`` returns."""
    s = start_server(repo, tmp_path, "--frontends", frontends, grpc=False)
    try:
        outcomes = load(s, jpeg)
        assert s.proc.wait(timeout=60) == 0, s.log()
    finally:
        s.stop(signal.SIGKILL)
    return outcomes


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_every_accepted_connection_is_answered_at_sigterm(tiny_repo, tmp_path, jpeg_bytes,
                                                          frontends):
    """A connection the kernel accepted gets an answer (its verdict, or 503 with Retry-After while
    the server shuts down), never a silent close, however late in the shutdown it came."""
    bad = []
    for run in range(6):
        outcomes = _shutdown_under(_burst_with_sigterm, tiny_repo, tmp_path, jpeg_bytes, frontends)
        assert len(outcomes) == 96
        print(f"run {run}: {sorted(Counter(map(str, outcomes)).items())}")
        for o in outcomes:
            if o == "refused" or (isinstance(o, tuple) and o[0] in (200, 504)):
                continue
            if isinstance(o, tuple) and o[0] == 503 and o[1] is not None:
                continue
            bad.append((run, o))
    assert not bad, bad


def test_connection_queued_when_the_front_ends_are_gone_is_answered(tiny_repo, tmp_path):
    """A connection the kernel queued on the front ends' listener while the last of them left
    (here: stopped, then killed during the shutdown) is answered 503 with Retry-After by the
    serving process, not reset with the listener."""
    import contextlib
    import os
    import socket

    s = start_server(tiny_repo, tmp_path, "--frontends", "2", grpc=False)
    kids = [int(k) for task in Path(f"/proc/{s.proc.pid}/task").iterdir()
            for k in (task / "children").read_text().split()
            if b"runtime.frontend" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert len(kids) == 2
    try:
        for k in kids:
            os.kill(k, signal.SIGSTOP)  # nobody accepts: the connection waits in the backlog
        conn = socket.create_connection(("127.0.0.1", s.http_port), timeout=30)
        conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the serving process is waiting for its front ends to stop
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        conn.close()
        head = answer.split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 503"), answer
        assert b"retry-after: 1" in head, answer
        assert s.proc.wait(timeout=60) == 0, s.log()
    finally:
        s.stop(signal.SIGKILL)



def _answer(sock, part: str) -> tuple | str:
    """Read one connection's answer to its end: (status, Retry-After, whether a 200 carried the
    request's part id), or what went wrong instead."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "no answer in 30 s"
    finally:
        sock.close()
    if not data:
        return "closed without an answer"
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    own = status != 200 or json.loads(body)["part_id"] == part
    return status, headers.get("retry-after"), own


def _pour_through_shutdown(s, jpeg: bytes, in_flight: int = 64) -> list:
    """Inspect requests, each on a new connection, opened without waiting for the answers
    (``in_flight`` at a time) from before SIGTERM until the listener is gone (a connect is
    refused): the kernel has connections queued in the listener's backlog at every moment of the
    shutdown, the moment the listener closes included. SIGTERM comes after the first answers.
    Returns each request's outcome (see :func:`_answer`), and "refused" once."""
    outcomes: list = []
    pending: set = set()
    lock = threading.Condition()
    refused = threading.Event()

    def read(sock, part: str) -> None:
        outcome = _answer(sock, part)
        with lock:
            outcomes.append(outcome)
            pending.discard(sock)
            lock.notify()

    def pour() -> None:
        end = time.monotonic() + 60
        for i in range(10_000_000):
            with lock:
                lock.wait_for(lambda: len(pending) < in_flight, timeout=30)
            if time.monotonic() > end:
                outcomes.append("still accepting after 60 s")
                return
            part = f"p{i}"
            head = (f"POST /v1/models/tiny/inspect HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Content-Type: image/jpeg\r\nX-Part-Id: {part}\r\n"
                    f"Content-Length: {len(jpeg)}\r\nConnection: close\r\n\r\n")
            try:
                sock = socket.create_connection(("127.0.0.1", s.http_port), timeout=30)
            except ConnectionRefusedError:  # the listener is closed: nothing was accepted
                outcomes.append("refused")
                refused.set()
                return
            try:
                sock.sendall(head.encode() + jpeg)
            except OSError as exc:  # reset before the request was even sent
                outcomes.append(type(exc).__name__)
                sock.close()
                continue
            with lock:
                pending.add(sock)
            threading.Thread(target=read, args=(sock, part), daemon=True).start()

    pourer = threading.Thread(target=pour)
    pourer.start()
    end = time.monotonic() + 30
    while len(outcomes) < 4 and time.monotonic() < end:  # the requests reach the engine
        time.sleep(0.005)
    s.proc.send_signal(signal.SIGTERM)
    pourer.join(timeout=90)
    with lock:
        lock.wait_for(lambda: not pending, timeout=60)
    return list(outcomes)


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_connections_pouring_in_through_the_whole_shutdown_are_all_answered(
        tiny_repo, tmp_path, jpeg_bytes, frontends):
    """Connections opened without a pause through the drain, the quiet wait and the close of the
    listener: every connection the kernel accepted gets its own verdict or 503 with Retry-After,
    never a reset or a close without an answer; the only other outcome is a refused connect
    once the listener is gone."""
    outcomes = _shutdown_under(_pour_through_shutdown, tiny_repo, tmp_path, jpeg_bytes, frontends)
    counts = sorted(Counter(map(str, outcomes)).items())
    print(counts)
    assert outcomes.count("refused") == 1, counts  # it ran until the listener closed
    bad = [o for o in outcomes if o != "refused" and not (
        isinstance(o, tuple) and ((o[0] == 200 and o[2]) or (o[0] == 503 and o[1] is not None)))]
    assert not bad, counts
    assert any(isinstance(o, tuple) and o[0] == 503 for o in outcomes), counts
