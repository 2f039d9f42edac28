"""A candidate in shadow (docs/closed-loop.md, "Shadow") on a real server with the shipped
classifier and ``--records``: the candidate (the shipped version with its "scratch" output
pushed up, so that it judges every frame a scratch: it disagrees with the live version on the
good parts) judges the live frames in its own process; its verdicts are stored beside it with
the live verdict of each frame, never in the records, the live feed or an answer; every live
frame is answered normally; stop works; under a flood the shadow drops frames instead of
delaying a live answer. The routes' roles, CSRF and Origin rules, refusals and audit entries."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import onnx
import pytest
from conftest import start_server, wait_for
from onnx import numpy_helper

from tests.integration.test_console_users import add_users, quality_session, session_client
from tests.integration.test_live import Listener
from tests.integration.test_records_images import shipped_repo
from visionserve_tools import synthetic
from visionserve_tools.benchshadow import make_candidate

CLASSIFIER = "defect-classifier"
TOKEN = "shadow-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
BASE = f"/v1/models/{CLASSIFIER}/candidates"
SHADOW = f"{BASE}/c-1/shadow"
LOOKS = ("ok", "scratch", "ok", "spot", "ok", "scratch")


def scratch(folder: Path) -> None:
    """The candidate's final layer's "scratch" bias raised: it says scratch to every frame."""
    model = onnx.load(folder / "model.onnx")
    for init in model.graph.initializer:
        if init.name == "4.bias":
            bias = numpy_helper.to_array(init).copy()
            bias[1] += 50.0  # labels: ok, scratch, spot, crack, contamination
            init.CopyFrom(numpy_helper.from_array(bias, init.name))
    onnx.save(model, folder / "model.onnx")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shadow")
    add_users(tmp / "xdg")
    repo = shipped_repo(tmp / "repo", (CLASSIFIER,))
    s = start_server(repo, tmp, "--host", "0.0.0.0", "--trusted-proxies", "127.0.0.1",
                     "--admin-token", TOKEN, "--records", "--records-dir", str(tmp / "data"),
                     grpc=False, env={"XDG_DATA_HOME": str(tmp / "xdg")})
    s.candidate = make_candidate(repo / CLASSIFIER, edit=scratch)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def quality(server):
    yield from quality_session(server, "198.51.100.221")


def inspect(server, part: str, look: str, seed: int = 0) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/models/{CLASSIFIER}/inspect", timeout=60,
                      content=synthetic.encode(synthetic.generate(look, seed=seed)),
                      headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                               "X-Deadline-Ms": "20000"})


def records(server, part: str | None = None) -> list[dict]:
    params = {"limit": 500, "model": CLASSIFIER, **({"part_id": part} if part else {})}
    return httpx.get(f"{server.url}/v1/records", params=params, headers=ADMIN,
                     timeout=10).json()["records"]


def audit(server, action: str) -> list[dict]:
    return httpx.get(f"{server.url}/v1/audit", params={"action": action}, headers=ADMIN,
                     timeout=10).json()["entries"]


def test_who_may_run_a_shadow(server, quality):
    viewer, vcsrf = session_client(server, "otto", "198.51.100.222")
    with viewer:
        for method in ("POST", "GET", "DELETE"):
            r = viewer.request(method, SHADOW, headers={"X-CSRF-Token": vcsrf})
            assert r.status_code == 403, (method, r.text)
            r = httpx.request(method, server.url + SHADOW, timeout=10)
            assert r.status_code == 401, (method, r.text)
    for method in ("POST", "DELETE"):
        r = quality.request(method, SHADOW, headers={"X-CSRF-Token": "forged"})
        assert r.status_code == 403, r.text
        r = quality.request(method, SHADOW, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and "cross-site" in r.json()["error"]
    r = quality.post(SHADOW, content=b"minutes=1",
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    assert not (server.candidate / "shadow.sqlite").exists()  # nothing started


def test_refusals(server, quality):
    assert quality.get(SHADOW).status_code == 404  # never run
    assert quality.post(f"{BASE}/c-9/shadow").status_code == 404
    assert quality.post("/v1/models/nope/candidates/c-1/shadow").status_code == 404
    for body in ({"frames": 0}, {"minutes": -1}, {"minutes": True}, {"speed": 1}):
        r = quality.post(SHADOW, json=body)
        assert r.status_code == 400, (body, r.text)
    r = quality.delete(SHADOW)
    assert r.status_code == 409 and "not running" in r.json()["error"]


def test_the_shadow_judges_live_frames_and_sends_nothing(server, quality):
    feed = Listener(server.url, f"?model={CLASSIFIER}", headers=ADMIN)
    try:
        r = quality.post(SHADOW, json={"minutes": 10})
        assert r.status_code == 200, (r.text, server.log()[-3000:])
        assert r.json()["state"] == "running" and r.json()["run"] == 1
        r = quality.post(SHADOW, json={})
        assert r.status_code == 409 and "already" in r.json()["error"]
        live = {}
        for i, look in enumerate(LOOKS):
            r = inspect(server, f"S-{i}", look, seed=i)
            assert r.status_code == 200, r.text
            live[f"S-{i}"] = (r.json()["verdict"], r.json()["label"])

        def judged():
            # the records are written apart from the answers: a disagreement names its frame's
            # record once the records hold it
            body = quality.get(SHADOW).json()
            return body if body["judged"] == len(LOOKS) and all(
                d["record_id"] is not None for d in body["disagreements"]) else None
        shown = wait_for(judged, 60, "the shadow's verdicts, with their records")
        assert shown["state"] == "running" and shown["dropped"] == 0
        # the console's Candidates page shows the run as the API does
        page = quality.get(f"/ui/models/{CLASSIFIER}/candidates")
        assert page.status_code == 200, page.text[-2000:]
        agreement = shown["agreement"]
        assert (f"running: {len(LOOKS)} frames beside version 1, agreement {agreement}; NG "
                f"{shown['live_ng']} → {len(LOOKS)}; 0 dropped under load") in page.text
        assert shown["handed"] == len(LOOKS) and shown["live_version"] == "1"
        assert shown["candidate_ng"] == len(LOOKS)  # it says scratch to everything
        assert shown["live_ng"] == sum(v == "NG" for v, _ in live.values())
        differ = {p for p, (v, label) in live.items() if (v, label) != ("NG", "scratch")}
        assert differ and shown["disagree"] == len(differ)
        assert shown["agree"] == len(LOOKS) - len(differ)
        rows = {d["part_id"]: d for d in shown["disagreements"]}
        assert set(rows) == differ
        for part, d in rows.items():
            assert (d["live"]["verdict"], d["live"]["label"]) == live[part]
            assert d["candidate"]["verdict"] == "NG" and d["candidate"]["label"] == "scratch"
            assert d["record_id"] == records(server, part)[0]["id"]  # the console's frame
        # stop: the run is closed; frames after it are not judged
        r = quality.delete(SHADOW)
        assert r.status_code == 200 and r.json()["state"] == "stopped", r.text
        assert quality.delete(SHADOW).status_code == 409
        assert inspect(server, "S-after", "ok").status_code == 200
        wait_for(lambda: len(records(server)) == len(LOOKS) + 1, 30, "every record")
        shown = quality.get(SHADOW).json()
        assert shown["state"] == "stopped" and shown["judged"] == len(LOOKS)
        assert shown["stop_reason"] == "stopped by qe-anna"
        page = quality.get(f"/ui/models/{CLASSIFIER}/candidates").text
        assert f"stopped: {len(LOOKS)} frames beside version 1" in page
        # the live feed and the records hold each live frame once, with its live verdict
        wait_for(lambda: len(feed.events) >= len(LOOKS) + 1, 30, "the live feed")
        assert sorted(feed.parts()) == sorted([*live, "S-after"])
        for e in feed.events:
            if e["part_id"] in live:
                assert (e["verdict"], e["label"]) == live[e["part_id"]]
        assert len(records(server)) == len(LOOKS) + 1
    finally:
        feed.close()
    started, stopped = audit(server, "candidate-shadow"), audit(server, "candidate-shadow-stop")
    (entry,) = started
    assert entry["user"] == "qe-anna" and entry["target"] == f"model {CLASSIFIER}"
    assert entry["new"]["candidate"] == "c-1" and entry["new"]["run"] == 1
    (entry,) = stopped
    assert entry["user"] == "qe-anna" and entry["new"]["handed"] == len(LOOKS)


def test_under_a_flood_the_shadow_drops_frames_and_every_live_frame_is_answered(server,
                                                                                 quality):
    r = quality.post(SHADOW, json={"frames": 100000})
    assert r.status_code == 200, r.text
    frames = 240
    jpegs = [synthetic.encode(synthetic.generate(LOOKS[i % len(LOOKS)], seed=i))
             for i in range(12)]

    def send(i: int) -> int:
        return httpx.post(f"{server.url}/v1/models/{CLASSIFIER}/inspect", timeout=60,
                          content=jpegs[i % len(jpegs)],
                          headers={"Content-Type": "image/jpeg", "X-Part-Id": f"F-{i}",
                                   "X-Deadline-Ms": "30000"}).status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(send, range(frames)))
    assert statuses == [200] * frames
    r = quality.delete(SHADOW)
    assert r.status_code == 200, r.text
    shown = quality.get(SHADOW).json()
    assert shown["run"] == 2 and shown["state"] == "stopped"
    assert shown["dropped"] > 0, shown
    assert shown["handed"] + shown["dropped"] == frames
    assert shown["judged"] == shown["handed"]  # what was handed off was judged before it ended
    print(f"flood: {frames} frames, {shown['dropped']} dropped by the shadow, "
          f"{shown['judged']} judged")
