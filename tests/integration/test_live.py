"""The live results (``GET /v1/live``, ``GET /v1/live/summary``) on real servers, read by real
httpx streaming clients: every answer reaches every stream within a second, in every front-end
process; filters, the replay on connect, the stream limit, the slow-client protections that must
not cut a stream, access, the summary's counts, and shutdown with a stream open."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_server, wait_for

INSPECT = "/v1/models/tiny/inspect"
RECIPES = """\
[recipe.plain]
model = "tiny"

[station.S1]
recipe = "plain"
cameras = ["cam-1"]

[station.S2]
recipe = "plain"
"""


@pytest.fixture(scope="module")
def repo(tiny_repo, tmp_path_factory) -> Path:
    """The tiny model, and two stations that run it."""
    root = tmp_path_factory.mktemp("liverepo")
    shutil.copytree(tiny_repo / "tiny", root / "tiny")
    (root / "recipes.toml").write_text(RECIPES)
    return root


def _png(level: int = 90) -> bytes:
    import cv2
    import numpy as np

    return cv2.imencode(".png", np.full((32, 32, 3), level, np.uint8))[1].tobytes()


class Listener:
    """A browser's EventSource, as far as the test needs one: an httpx stream of ``/v1/live``
    read in a thread; ``events`` the parsed ``data:`` events (with ``_id`` and ``_at``, the
    monotonic time they came), ``named`` the named ones (``dropped``, ``shutdown``)."""

    def __init__(self, url: str, query: str = "", headers: dict | None = None) -> None:
        self.events: list[dict] = []
        self.named: list[tuple[str, dict]] = []
        self.status: int | None = None
        self.local_port: int | None = None
        self.error: Exception | None = None
        self.ended = threading.Event()
        self._client = httpx.Client(timeout=httpx.Timeout(30, read=None))
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url + "/v1/live" + query,
                                                                headers or {}), daemon=True)
        self._thread.start()
        assert self._opened.wait(30), "the stream did not answer"

    def _run(self, url: str, headers: dict) -> None:
        try:
            with self._client.stream("GET", url, headers=headers) as r:
                self.status = r.status_code
                stream = r.extensions.get("network_stream")
                if stream is not None:
                    self.local_port = stream.get_extra_info("client_addr")[1]
                self.headers = r.headers
                if r.status_code != 200:
                    r.read()
                    self.body = r.text
                    self._opened.set()  # with its body: the test reads it at once
                    return
                self._opened.set()
                fields: dict[str, str] = {}
                for line in r.iter_lines():
                    if line.startswith(":"):
                        continue
                    if line:
                        name, _, value = line.partition(":")
                        fields[name] = value.strip()
                        continue
                    if "data" in fields:
                        data = json.loads(fields["data"])
                        if "event" in fields:
                            self.named.append((fields["event"], data))
                        else:
                            self.events.append({**data, "_id": fields.get("id"),
                                                "_at": time.monotonic()})
                    fields = {}
        except Exception as exc:  # noqa: BLE001 - closed by the test, or by the server
            self.error = exc
        finally:
            self._opened.set()
            self.ended.set()

    def parts(self) -> list[str]:
        return [e["part_id"] for e in self.events]

    def close(self) -> None:
        self._client.close()
        self._thread.join(10)


def _inspect(url: str, part: str, **headers: str) -> httpx.Response:
    return httpx.post(url + INSPECT, content=_png(), timeout=30,
                      headers={"Content-Type": "image/png", "X-Part-Id": part, **headers})


def _seen_within(listeners: list[Listener], part: str, sent: float, within_s: float = 1.0) -> None:
    for li in listeners:
        event = wait_for(lambda li=li: next((e for e in li.events if e["part_id"] == part), None),
                         timeout=5, what=f"part {part} on the stream")
        assert event["_at"] - sent < within_s, f"part {part} came after {event['_at'] - sent:.2f} s"


# --- which front-end process serves a connection (Linux: /proc) ---------------------------------

def _server_socket_inode(server_port: int, client_port: int) -> str | None:
    local, remote = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[1] == local and cols[2] == remote:
            return cols[9]
    return None


def _serving_pid(pids: list[int], server_port: int, client_port: int) -> int | None:
    inode = _server_socket_inode(server_port, client_port)
    if inode is None:
        return None
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    return None


def _front_end_pids(server) -> list[int]:
    kids = []
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        kids += [int(c) for c in (task / "children").read_text().split()]
    return [k for k in kids
            if b"visionserve.runtime.frontend" in Path(f"/proc/{k}/cmdline").read_bytes()]


def _inspect_through(server, pids: list[int], part: str) -> int | None:
    """One inspect on a connection of its own; the front-end process that answered it."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", INSPECT, body=_png(), headers={"Content-Type": "image/png",
                                                            "X-Part-Id": part})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        r.read()
        return _serving_pid(pids, server.http_port, conn.sock.getsockname()[1])
    finally:
        conn.close()


# --- tests --------------------------------------------------------------------------------------

def test_every_stream_shows_each_part_within_a_second(repo, tmp_path):
    s = start_server(repo, tmp_path, grpc=False)
    listeners = [Listener(s.url), Listener(s.url)]
    try:
        assert all(li.status == 200 for li in listeners)
        assert listeners[0].headers["content-type"].startswith("text/event-stream")
        for i in range(10):
            sent = time.monotonic()
            r = _inspect(s.url, f"P-{i}", **{"X-Station-Id": "S1", "X-Camera-Id": "cam-1"})
            assert r.status_code == 200, r.text
            _seen_within(listeners, f"P-{i}", sent)
        e = listeners[0].events[0]
        answer = _inspect(s.url, "P-last").json()
        last = wait_for(lambda: next((x for x in listeners[1].events
                                      if x["part_id"] == "P-last"), None), what="P-last")
        assert (last["verdict"], last["label"]) == (answer["verdict"], answer["label"])
        assert (e["model"], e["version"], e["station"], e["camera"]) == ("tiny", "1", "S1", "cam-1")
        assert e["verdict"] in ("OK", "NG") and e["latency_ms"] > 0 and e["captured"] is False
        assert abs(e["time"] - time.time()) < 60 and e["request_id"] and e["_id"] == e["id"]
        ids = [int(x["id"].rsplit("-", 1)[1]) for x in listeners[0].events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
    finally:
        for li in listeners:
            li.close()
        s.stop()


def test_with_two_front_ends_every_stream_sees_the_other_front_ends_answers(repo, tmp_path):
    s = start_server(repo, tmp_path, "--frontends", "2", grpc=False)
    listeners: list[Listener] = []
    try:
        pids = wait_for(lambda: len(_front_end_pids(s)) == 2 and _front_end_pids(s),
                        what="two front ends")
        # streams until both front-end processes hold one (the kernel picks who accepts)
        by_pid: dict[int, Listener] = {}
        for _ in range(16):
            li = Listener(s.url)
            assert li.status == 200
            pid = wait_for(lambda li=li: _serving_pid(pids, s.http_port, li.local_port),
                           what="the stream's front end")
            if pid in by_pid:
                li.close()
            else:
                by_pid[pid] = li
            if len(by_pid) == 2:
                break
        assert len(by_pid) == 2, "every stream went to one front end"
        listeners = list(by_pid.values())
        for i in range(12):
            sent = time.monotonic()
            assert _inspect_through(s, pids, f"F-{i}") in pids
            # both streams: one of them is in the other front end
            _seen_within(listeners, f"F-{i}", sent)
    finally:
        for li in listeners:
            li.close()
        s.stop()


def test_filters_replay_and_last_event_id(repo, tmp_path):
    s = start_server(repo, tmp_path, grpc=False)
    first = Listener(s.url)  # the feed keeps answers while a console listens
    try:
        for i in range(6):
            assert _inspect(s.url, f"R-{i}", **{"X-Station-Id": "S1" if i % 2 else "S2"}
                            ).status_code == 200
        wait_for(lambda: len(first.events) == 6, what="six events")
        # a page that just opened: the kept events first, in order
        again = Listener(s.url)
        s1 = Listener(s.url, "?station=S1")
        tiny = Listener(s.url, "?model=tiny&station=S2")
        try:
            wait_for(lambda: len(again.events) == 6, what="the replay")
            assert again.parts() == [f"R-{i}" for i in range(6)]
            wait_for(lambda: len(s1.events) == 3 and len(tiny.events) == 3, what="filtered replay")
            assert s1.parts() == ["R-1", "R-3", "R-5"] and tiny.parts() == ["R-0", "R-2", "R-4"]
            assert _inspect(s.url, "R-6", **{"X-Station-Id": "S1"}).status_code == 200
            wait_for(lambda: "R-6" in s1.parts() and "R-6" in again.parts(), what="R-6")
            time.sleep(0.3)
            assert "R-6" not in tiny.parts()
            # a reconnecting browser sends the last id it had: only what came after
            resumed = Listener(s.url, headers={"Last-Event-ID": again.events[3]["id"]})
            try:
                wait_for(lambda: len(resumed.events) == 3, what="resumed replay")
                assert resumed.parts() == ["R-4", "R-5", "R-6"]
            finally:
                resumed.close()
        finally:
            for li in (again, s1, tiny):
                li.close()
        # a model the repository does not hold; a filter value out of range
        r = httpx.get(s.url + "/v1/live?model=nope", timeout=10)
        assert r.status_code == 404 and "nope" in r.json()["error"]
        r = httpx.get(s.url + "/v1/live/summary?model=tiny&minutes=0", timeout=10)
        assert r.status_code == 400, r.text
    finally:
        first.close()
        s.stop()


def test_the_stream_limit_answers_503_and_requests_still_work(repo, tmp_path):
    # with --max-connections 3, three open streams would take every connection if they counted
    s = start_server(repo, tmp_path, "--max-live-streams", "3", "--max-connections", "3",
                     grpc=False)
    listeners = [Listener(s.url) for _ in range(3)]
    try:
        assert [li.status for li in listeners] == [200, 200, 200]
        over = Listener(s.url)
        assert over.status == 503 and "max_live_streams" in over.body
        assert int(over.headers["retry-after"]) >= 1
        over.close()
        for i in range(4):  # several connections at once: none is refused for the streams
            with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
                ra = a.post(s.url + INSPECT, content=_png(), headers={"Content-Type": "image/png"})
                rb = b.get(s.url + "/v2/models/tiny", timeout=10)
                assert (ra.status_code, rb.status_code) == (200, 200), (ra.text, rb.text)
        listeners.pop().close()  # one closes: a new one may open
        again = wait_for(lambda: (li := Listener(s.url)).status == 200 and li or li.close(),
                         what="a stream after one closed")
        listeners.append(again)
        # a refused or closed stream is let go when its connection's close reaches the server
        wait_for(lambda: "visionserve_live_streams 3.0" in
                 httpx.get(s.url + "/metrics", timeout=10).text, what="three streams counted")
    finally:
        for li in listeners:
            li.close()
        s.stop()


def test_a_stream_stays_open_past_the_slow_client_timeouts(repo, tmp_path):
    s = start_server(repo, tmp_path, "--header-timeout-s", "0.5", "--min-body-rate-bytes-s",
                     "100000", "--body-timeout-s", "1", grpc=False)
    li = Listener(s.url)
    try:
        time.sleep(3.5)  # past every timeout, with nothing sent on the stream
        assert not li.ended.is_set()
        sent = time.monotonic()
        assert _inspect(s.url, "late-part").status_code == 200
        # still open, and the part comes (the 1 s bound is the other tests'; an idle stream's
        # first event may wait on a busy 2-core machine)
        _seen_within([li], "late-part", sent, within_s=3.0)
    finally:
        li.close()
        s.stop()


def test_protected_off_loopback(repo, tmp_path):
    data = tmp_path / "data"
    s = start_server(repo, tmp_path, "--host", "0.0.0.0", grpc=False,
                     env={"XDG_DATA_HOME": str(data)})
    try:
        for path in ("/v1/live", "/v1/live/summary?model=tiny"):
            r = httpx.get(s.url + path, timeout=10)
            assert r.status_code == 401 and "admin token" in r.json()["error"], (path, r.text)
        token = (data / "visionserve" / "admin-token").read_text().strip()
        admin = {"Authorization": f"Bearer {token}"}
        r = httpx.get(s.url + "/v1/live", timeout=10,
                      headers={**admin, "Origin": "http://evil.example"})
        assert r.status_code == 403 and "Origin" in r.json()["error"]
        assert httpx.get(s.url + "/v1/live/summary?model=tiny", headers=admin,
                         timeout=10).status_code == 200
        li = Listener(s.url, headers=admin)
        try:
            assert li.status == 200
            sent = time.monotonic()
            assert _inspect(s.url, "T-1").status_code == 200  # inference stays open
            _seen_within([li], "T-1", sent)
        finally:
            li.close()
    finally:
        s.stop()


def test_summary_counts_match_the_requests_sent(repo, tmp_path):
    s = start_server(repo, tmp_path, grpc=False)
    li = Listener(s.url)
    try:
        verdicts = {"OK": 0, "NG": 0, "LATE": 0, "REFUSED": 0}
        for i in range(8):
            r = _inspect(s.url, f"S-{i}")
            verdicts[r.json()["verdict"]] += 1
        for i in range(3):  # a deadline no frame can meet: LATE or refused at once
            r = _inspect(s.url, f"L-{i}", **{"X-Deadline-Ms": "0.001"})
            assert r.status_code in (503, 504), r.text
            verdicts["LATE" if r.status_code == 504 else "REFUSED"] += 1
        wait_for(lambda: len(li.events) == 11, what="eleven events")
        body = httpx.get(s.url + "/v1/live/summary?model=tiny&minutes=5", timeout=10).json()
        assert body["model"] == "tiny" and body["takt_ms"] == 2000 and body["since"] > 0
        rows = body["minutes"]
        assert len(rows) == 5 and rows == sorted(rows, key=lambda m: m["minute"])
        totals = {k: sum(m[k.lower()] for m in rows) for k in verdicts}
        assert totals == verdicts and sum(m["error"] for m in rows) == 0
        with_latency = [m for m in rows if m["p50_ms"] is not None]
        assert with_latency and all(0 < m["p50_ms"] <= m["p99_ms"] for m in with_latency)
        late = [e for e in li.events if e["part_id"].startswith("L-")]
        assert {e["verdict"] for e in late} <= {"LATE", "REFUSED"}
        assert all(e["reasons"] for e in late)
        r = httpx.get(s.url + "/v1/live/summary?model=nope", timeout=10)
        assert r.status_code == 404
    finally:
        li.close()
        s.stop()


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_shutdown_with_an_open_stream_is_prompt(repo, tmp_path, frontends):
    s = start_server(repo, tmp_path, "--frontends", frontends, "--drain-timeout-s", "20",
                     grpc=False)
    li = Listener(s.url)
    assert li.status == 200
    assert _inspect(s.url, "D-1").status_code == 200
    wait_for(lambda: "D-1" in li.parts(), what="D-1")
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(15) == 0
    took = time.monotonic() - start
    assert li.ended.wait(5)
    li.close()
    assert took < 8, f"shutdown took {took:.1f} s with a stream open"
    assert [name for name, _ in li.named] == ["shutdown"]


def test_an_event_says_whether_the_frames_image_was_captured(repo, tmp_path):
    s = start_server(repo, tmp_path, "--records", "--records-dir", str(tmp_path / "rec"),
                     "--capture", "ng", grpc=False)
    li = Listener(s.url)
    try:
        verdicts = [_inspect(s.url, f"C-{i}").json()["verdict"] for i in range(4)]
        wait_for(lambda: len(li.events) == 4, what="four events")
        assert [e["captured"] for e in li.events] == [v == "NG" for v in verdicts]
    finally:
        li.close()
        s.stop()
