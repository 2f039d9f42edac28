"""Train and compare (docs/closed-loop.md) on a real server with the shipped classifier, ``--guard
--records --capture learn``: frames of the synthetic generator are captured and labelled through
the API, a candidate is fine-tuned by a real guard job on the CPU (a few steps of the last layer),
lands in the model's candidates area with its traceability and is not served; the comparison
with the live version on the held-out labelled frames round trips. The routes' roles, CSRF and
Origin rules, their refusals and audit entries; and a poll-mode server that never serves a
candidates area."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest
from conftest import start_server, wait_for

from tests.integration.test_console_users import add_users, quality_session, session_client
from tests.integration.test_records_images import shipped_repo
from visionserve_tools import synthetic

CLASSIFIER, ANOMALY = "defect-classifier", "surface-anomaly"
TOKEN = "loop-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
BASE = f"/v1/models/{CLASSIFIER}/candidates"
#: what the frames show: each look three times
LOOKS = [(look, seed) for seed in range(3) for look in synthetic.LABELS]
#: a tiny fine-tune of the last layer: the test is about the loop, not the model's accuracy
TRAIN = {"steps": 3, "original_share": 0.3, "layers": "last", "lr": 0.003}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    add_users(tmp / "xdg")
    s = start_server(shipped_repo(tmp / "repo", (CLASSIFIER, ANOMALY)), tmp,
                     "--host", "0.0.0.0", "--trusted-proxies", "127.0.0.1",
                     "--admin-token", TOKEN, "--records", "--records-dir", str(tmp / "data"),
                     "--capture", "learn", "--capture-sample-percent", "100",
                     "--guard", "--guard-db", str(tmp / "guard.sqlite"), grpc=False,
                     env={"XDG_DATA_HOME": str(tmp / "xdg")})
    s.repo = tmp / "repo"
    send_looks(s)
    yield s
    s.stop()


def send_looks(server) -> None:
    """Each of LOOKS inspected (part ids ``L-<index>``), and its record kept."""
    for i, (look, seed) in enumerate(LOOKS):
        r = httpx.post(f"{server.url}/v1/models/{CLASSIFIER}/inspect", timeout=60,
                       content=synthetic.encode(synthetic.generate(look, seed=seed)),
                       headers={"Content-Type": "image/jpeg", "X-Part-Id": f"L-{i}",
                                "X-Deadline-Ms": "10000"})
        assert r.status_code == 200, r.text
    wait_for(lambda: len(records(server)) >= len(LOOKS), 30, "every record")


@pytest.fixture(scope="module")
def quality(server):
    yield from quality_session(server, "198.51.100.211")


def records(server) -> list[dict]:
    return httpx.get(f"{server.url}/v1/records", params={"limit": 500, "model": CLASSIFIER},
                     headers=ADMIN, timeout=10).json()["records"]


def audit(server, action: str) -> list[dict]:
    return httpx.get(f"{server.url}/v1/audit", params={"action": action}, headers=ADMIN,
                     timeout=10).json()["entries"]


def wait_state(client: httpx.Client, path: str, timeout: float = 240) -> dict:
    def settled():
        body = client.get(path).json()
        return body if body["state"] in ("done", "failed") else None
    return wait_for(settled, timeout, f"{path} to finish")


def test_refusals_before_anything_is_labelled(server, quality):
    r = quality.post(BASE, json=TRAIN)
    assert r.status_code == 409 and "no labelled captures" in r.json()["error"], r.text
    assert not (server.repo / CLASSIFIER / "candidates" / "c-1").exists()  # nothing left behind
    r = quality.post(f"/v1/models/{ANOMALY}/candidates", json={})  # a refit: nothing captured
    assert r.status_code == 409 and "no good parts" in r.json()["error"], r.text
    assert quality.post("/v1/models/nope/candidates", json={}).status_code == 404
    r = quality.post(BASE, json={"from_version": 7})
    assert r.status_code == 404 and "version 7" in r.json()["error"], r.text
    r = quality.post(BASE, json={"steps": 0})
    assert r.status_code == 400 and "steps" in r.json()["error"]
    r = quality.post(BASE, json={"original_share": 1.5})
    assert r.status_code == 400 and "original_share" in r.json()["error"]
    r = quality.post(BASE, json={"layers": "head"})
    assert r.status_code == 400 and "'all' or 'last'" in r.json()["error"], r.text
    for lr in (0, 5, "0.001", True):
        r = quality.post(BASE, json={"lr": lr})
        assert r.status_code == 400 and "lr" in r.json()["error"], (lr, r.text)
    r = quality.post(BASE, content=b"[1]", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert quality.get(BASE).json() == {"model": CLASSIFIER, "count": 0, "candidates": []}
    assert quality.get(f"{BASE}/c-1").status_code == 404
    assert quality.post(f"{BASE}/c-1/evaluate").status_code == 404


def test_who_may_train_list_and_compare(server, quality):
    viewer, vcsrf = session_client(server, "otto", "198.51.100.212")
    routes = (("POST", BASE, TRAIN), ("GET", BASE, None), ("GET", f"{BASE}/c-1", None),
              ("POST", f"{BASE}/c-1/evaluate", {}), ("GET", f"{BASE}/c-1/comparison", None))
    with viewer:
        for method, path, body in routes:
            r = viewer.request(method, path, json=body, headers={"X-CSRF-Token": vcsrf})
            assert r.status_code == 403, (path, r.text)
            r = httpx.request(method, server.url + path, json=body, timeout=10)
            assert r.status_code == 401, (path, r.text)
    # a change without the session's CSRF token, from a foreign origin, or form-encoded
    for path in (BASE, f"{BASE}/c-1/evaluate"):
        r = quality.post(path, json=TRAIN, headers={"X-CSRF-Token": "forged"})
        assert r.status_code == 403, r.text
        r = quality.post(path, json=TRAIN, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and "cross-site" in r.json()["error"]
        r = quality.post(path, content=b"steps=3",
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415
    assert not (server.repo / CLASSIFIER / "candidates" / "c-1").exists()


def test_a_candidate_is_trained_on_the_labels_kept_apart_and_compared(server, quality):
    labelled = {}
    for i, rec in enumerate(sorted(records(server), key=lambda r: r["part_id"])):
        look = LOOKS[int(rec["part_id"][2:])][0]
        client = quality if i % 2 else httpx.Client(base_url=server.url, headers=ADMIN)
        r = client.put(f"/v1/records/{rec['id']}/label", json={"label": look})
        assert r.status_code == 200, r.text
        labelled[rec["id"]] = (look, "qe-anna" if i % 2 else "admin-token")
    t0 = time.monotonic()
    r = quality.post(BASE, json=TRAIN)
    assert r.status_code == 202, r.text
    shown = r.json()
    assert shown["id"] == "c-1" and shown["state"] in ("queued", "running")
    assert shown["from_version"] == 1
    # a candidate still training is not compared
    assert quality.post(f"{BASE}/c-1/evaluate").status_code == 409
    # the training is a guard job like any other
    job = httpx.get(f"{server.url}/v1/guard/jobs/{shown['job']['id']}", headers=ADMIN).json()
    assert "visionserve_tools.training.train" in job["command"] and "--out" in job["command"]
    done = wait_state(quality, f"{BASE}/c-1")
    assert done["state"] == "done", (done, server.log()[-3000:])
    print(f"candidate trained in {time.monotonic() - t0:.1f} s")
    c = done["candidate"]
    trained = {x["record_id"]: (x["label"], x["labelled_by"]) for x in c["trained_on"]}
    held = {x["record_id"]: (x["label"], x["labelled_by"]) for x in c["held_out"]}
    assert trained and held and not set(trained) & set(held)
    assert {**trained, **held} == labelled
    assert c["model"] == CLASSIFIER and c["created_by"] == "qe-anna"
    assert c["job"]["id"] == shown["job"]["id"] and c["recipe"]["steps"] == 3
    assert c["recipe"]["original_share"] == 0.3 and c["recipe"]["labelled_frames"] == len(trained)
    assert c["metrics"]["steps"] == 3 and c["metrics"]["freeze_backbone"] is True
    assert c["metrics"]["keep_batch_norm"] is False and c["recipe"]["lr"] == 0.003
    assert c["recipe"]["trains"] == "the last layer (--freeze-backbone)"
    assert c["finished"] and c["created"]
    folder = server.repo / CLASSIFIER / "candidates" / "c-1"
    for name in ("weights.pt", "model.onnx", "model.pt2", "metrics.json", "export.json",
                 "candidate.json"):
        assert (folder / name).is_file(), name
    assert not (folder / "train").exists() and (folder / "heldout").is_dir()
    # never served: the model's versions are what they were
    meta = httpx.get(f"{server.url}/v2/models/{CLASSIFIER}", timeout=10).json()
    assert meta["versions"] == ["1"]
    listing = quality.get(BASE).json()
    assert [x["id"] for x in listing["candidates"]] == ["c-1"]
    assert listing["candidates"][0]["state"] == "done"
    (entry,) = audit(server, "candidate")
    assert entry["user"] == "qe-anna" and entry["target"] == f"model {CLASSIFIER}"
    assert entry["new"]["candidate"] == "c-1" and entry["new"]["job"] == shown["job"]["id"]
    assert entry["new"]["layers"] == "last" and entry["new"]["lr"] == 0.003

    # the comparison on the held-out frames
    assert quality.get(f"{BASE}/c-1/comparison").status_code == 404  # not asked yet
    r = httpx.post(f"{server.url}{BASE}/c-1/evaluate", headers=ADMIN, timeout=10)
    assert r.status_code == 202, r.text
    assert r.json()["evaluation"]["live_version"] == 1
    result = wait_state(quality, f"{BASE}/c-1/comparison", 120)
    assert result["state"] == "done", (result, server.log()[-3000:])
    assert {x["record_id"] for x in result["records"]} == set(held)
    for row in result["records"]:
        assert row["label"] == held[row["record_id"]][0]
        for which in ("live", "candidate"):
            assert row[which]["verdict"] in ("OK", "NG") and 0 <= row[which]["score"] <= 1
    summary = result["summary"]
    for which in ("live", "candidate"):
        assert set(summary[which]) >= {"accuracy", "ng_recall", "false_reject_rate"}
        assert summary[which]["frames"] == len(held)
    assert [x["record_id"] for x in result["disagreements"]] == summary["disagree"]
    (entry,) = audit(server, "candidate-evaluate")
    assert entry["user"] == "admin-token" and entry["new"]["candidate"] == "c-1"


def test_without_the_guard_a_candidate_is_refused_and_a_poll_never_serves_one(tmp_path):
    """A poll-mode server without --guard: the candidates area is not served, nor read by the
    poll when a candidate appears; training asks for --guard."""
    repo = shipped_repo(tmp_path / "repo", (CLASSIFIER,))
    area = repo / CLASSIFIER / "candidates"
    (area / "c-1").mkdir(parents=True)
    shutil.copy(repo / CLASSIFIER / "1" / "model.onnx", area / "c-1" / "model.onnx")
    s = start_server(repo, tmp_path, "--admin-token", TOKEN, "--records", "--records-dir",
                     str(tmp_path / "data"), "--capture", "learn", "--model-control-mode", "poll",
                     "--repository-poll-secs", "0.2", grpc=False)
    try:
        r = httpx.post(f"{s.url}{BASE}", json={}, headers=ADMIN, timeout=10)
        assert r.status_code == 409 and "--guard" in r.json()["error"], r.text
        shutil.copytree(area / "c-1", area / "c-2")  # while it polls
        (area / "2").mkdir()
        shutil.copy(repo / CLASSIFIER / "1" / "model.onnx", area / "2" / "model.onnx")
        time.sleep(1.0)
        meta = httpx.get(f"{s.url}/v2/models/{CLASSIFIER}", timeout=10).json()
        assert meta["versions"] == ["1"]
        assert httpx.get(f"{s.url}/v2/models/{CLASSIFIER}/versions/2/ready",
                         timeout=10).status_code != 200
    finally:
        s.stop()
