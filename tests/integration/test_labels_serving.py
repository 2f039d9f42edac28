"""Collect, flag, review and label (docs/closed-loop.md) on a real server with the shipped
classifier, anomaly model and detector, ``--records --capture learn``, a real SQLite store, users
and an admin token: each captured record says why it was kept; flags and labels round trip
through the API and the store for each task and are audit entries; bad labels are 400s that say
why, a frame not captured a 409; who may flag, label and read the queue (viewer 403, quality,
the admin token, no credential 401), CSRF and Origin; the Review page's queue and its form."""

from __future__ import annotations

import dataclasses
import re

import httpx
import pytest
from conftest import start_server, wait_for

from tests.integration.test_console_users import add_users, quality_session, session_client
from tests.integration.test_records_images import shipped_repo
from visionserve.records.store import SqliteStore
from visionserve_tools import synthetic

CLASSIFIER, ANOMALY, DETECTOR = "defect-classifier", "surface-anomaly", "defect-detector"
TOKEN = "labels-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
#: what each model is shown: (part id, what the frame shows)
FRAMES = {CLASSIFIER: [("C-1", "scratch"), ("C-2", "ok"), ("C-3", "spot")],
          ANOMALY: [("A-1", "ok"), ("A-2", "crack")],
          DETECTOR: [("D-1", "scratch"), ("D-2", "ok")]}


def inspect(server, model: str, part: str, look: str, seed: int = 0) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/models/{model}/inspect", timeout=60,
                      content=synthetic.encode(synthetic.generate(look, seed=seed)),
                      headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                               "X-Deadline-Ms": "10000"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labels")
    add_users(tmp / "xdg")
    s = start_server(shipped_repo(tmp / "repo", (CLASSIFIER, ANOMALY, DETECTOR)), tmp,
                     "--host", "0.0.0.0", "--trusted-proxies", "127.0.0.1",
                     "--admin-token", TOKEN, "--records", "--records-dir", str(tmp / "data"),
                     "--capture", "learn", "--capture-sample-percent", "100", grpc=False,
                     env={"XDG_DATA_HOME": str(tmp / "xdg")})
    s.store = SqliteStore(tmp / "data" / "records.sqlite")
    n = 0
    for model, frames in FRAMES.items():
        for i, (part, look) in enumerate(frames):
            assert inspect(s, model, part, look, seed=i).status_code == 200
            n += 1
    wait_for(lambda: len(records(s)) >= n, 30, "every record")
    # a record whose frame was not captured (as the server keeps them under --capture ng)
    s.store.write([dataclasses.replace(s.store.history("C-1")[0], part_id="C-bad",
                                       image=None, kept_for=None)])
    yield s
    s.stop()


def records(server, **params) -> list[dict]:
    return httpx.get(f"{server.url}/v1/records", params={"limit": 500, **params},
                     headers=ADMIN, timeout=10).json()["records"]


def record_of(server, part: str) -> dict:
    return records(server, part_id=part)[0]


@pytest.fixture(scope="module")
def quality(server):
    yield from quality_session(server, "198.51.100.201")


def test_capture_learn_keeps_ng_uncertain_and_sampled_frames_and_says_why(server):
    kept = {r["part_id"]: r for r in records(server)}
    for model, frames in FRAMES.items():
        for part, _ in frames:
            r = kept[part]
            assert r["image"] and r["model"] == model, r
            # NG: kept as NG or, near the threshold, as uncertain; OK: uncertain or the sample
            assert r["kept_for"] in (("ng", "uncertain") if r["verdict"] == "NG"
                                     else ("uncertain", "sample")), r
    # the store says the same as the API
    (row,) = [r for r in server.store.history("C-1")]
    assert row.kept_for == kept["C-1"]["kept_for"]


def _audit(server, action: str) -> list[dict]:
    return httpx.get(f"{server.url}/v1/audit", params={"action": action}, headers=ADMIN,
                     timeout=10).json()["entries"]


def test_a_classifier_frame_is_flagged_then_labelled_and_both_are_kept_and_audited(server,
                                                                                   quality):
    rid = record_of(server, "C-2")["id"]
    r = quality.post(f"/v1/records/{rid}/flag",
                     json={"verdict_was_wrong": True, "label": "scratch"})
    assert r.status_code == 200, r.text
    flagged = r.json()["labelled"]
    assert flagged["label"] == "scratch" and flagged["verdict_was_wrong"] is True
    assert (flagged["labelled_by"], flagged["source"]) == ("qe-anna", "flag")
    r = httpx.put(f"{server.url}/v1/records/{rid}/label", json={"label": "spot"},
                  headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    assert (r.json()["labelled"]["labelled_by"], r.json()["labelled"]["source"]) == \
        ("admin-token", "review")
    history = server.store.labels(rid)
    assert [(x.label, x.by, x.source) for x in history] == [
        ({"label": "spot"}, "admin-token", "review"),
        ({"label": "scratch", "verdict_was_wrong": True}, "qe-anna", "flag")]
    # the queue: labelled, with the label in force; no longer among the unlabelled
    page = quality.get("/v1/review", params={"model": CLASSIFIER, "state": "labelled"}).json()
    assert page["task"] == "classification" and "scratch" in page["labels"]
    (entry,) = [x for x in page["records"] if x["id"] == rid]
    assert entry["labelled"]["label"] == "spot" and entry["kept_for"]
    todo = quality.get("/v1/review", params={"model": CLASSIFIER}).json()["records"]
    assert rid not in [x["id"] for x in todo] and todo
    # the audit trail: who, which record, what label
    (flag,) = [e for e in _audit(server, "flag") if e["target"] == f"record {rid}"]
    assert flag["user"] == "qe-anna" and flag["new"]["label"] == "scratch"
    (label,) = [e for e in _audit(server, "label") if e["target"] == f"record {rid}"]
    assert label["user"] == "admin-token" and label["new"] == {"label": "spot"}
    assert label["old"]["label"] == "scratch"


def test_an_anomaly_frame_is_labelled_good_or_defective(server, quality):
    rid = record_of(server, "A-1")["id"]
    r = quality.put(f"/v1/records/{rid}/label", json={"label": "good"})
    assert r.status_code == 200, r.text
    assert server.store.labels(rid)[0].label == {"label": "good"}
    r = quality.put(f"/v1/records/{rid}/label", json={"label": "scratch"})
    assert r.status_code == 400 and "one of good, defective" in r.json()["error"]


def test_a_detector_frame_is_labelled_with_boxes_in_the_frame(server, quality):
    rid = record_of(server, "D-1")["id"]
    boxes = [{"label": "scratch", "box": [10, 20, 200, 60.5]}]
    r = quality.post(f"/v1/records/{rid}/flag", json={"boxes": boxes})
    assert r.status_code == 200, r.text
    assert server.store.labels(rid)[0].label == {
        "boxes": [{"label": "scratch", "box": [10.0, 20.0, 200.0, 60.5]}]}
    for body, says in (
            ({"boxes": [{"label": "scratch", "box": [10, 20, 9000, 60]}]}, "outside the frame"),
            ({"boxes": [{"label": "scratch", "box": [50, 20, 40, 60]}]},
             "x2 must be greater than x1"),
            ({"boxes": [{"label": "ok", "box": [1, 1, 2, 2]}]}, "not a label of this model"),
            ({"label": "scratch"}, '{"boxes": [{"label": "scratch"')):
        r = quality.post(f"/v1/records/{rid}/flag", json=body)
        assert r.status_code == 400 and says in r.json()["error"], r.text
    assert len(server.store.labels(rid)) == 1  # nothing kept of a refused label


def test_bad_labels_and_frames_that_were_not_captured_are_refused_with_the_reason(server,
                                                                                  quality):
    rid = record_of(server, "C-3")["id"]
    for body, says in (({"label": "dent"}, "'dent' is not a label of this model"),
                       ({"boxes": []}, 'label is {"label": "ok"}'),
                       ({"label": "ok", "extra": 1}, "not understood: extra")):
        r = quality.put(f"/v1/records/{rid}/label", json=body)
        assert r.status_code == 400 and says in r.json()["error"], r.text
    r = quality.put(f"/v1/records/{rid}/label", content=b"[1]",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]
    bad = record_of(server, "C-bad")["id"]
    r = quality.post(f"/v1/records/{bad}/flag", json={"label": "ok"})
    assert r.status_code == 409 and "--capture learn" in r.json()["error"]
    r = quality.post("/v1/records/999999/flag", json={"label": "ok"})
    assert r.status_code == 404
    r = quality.get("/v1/review", params={"model": CLASSIFIER, "state": "done"})
    assert r.status_code == 400 and "unlabelled or labelled" in r.json()["error"]
    assert quality.get("/v1/review").status_code == 400
    assert server.store.labels(rid) == []


def test_who_may_flag_label_and_review(server, quality):
    rid = record_of(server, "C-1")["id"]
    viewer, vcsrf = session_client(server, "otto", "198.51.100.202")
    with viewer:
        for method, path, body in (("POST", f"/v1/records/{rid}/flag", {"label": "ok"}),
                                   ("PUT", f"/v1/records/{rid}/label", {"label": "ok"}),
                                   ("GET", f"/v1/review?model={CLASSIFIER}", None),
                                   ("GET", "/ui/review", None)):
            r = viewer.request(method, path, json=body, headers={"X-CSRF-Token": vcsrf})
            assert r.status_code == 403, (path, r.text)
            r = httpx.request(method, server.url + path, json=body, timeout=10)
            assert r.status_code == 401, (path, r.text)
        # the viewer's pages have no link to it
        assert "/ui/review" not in viewer.get("/ui/live").text
    assert 'href="/ui/review"' in quality.get("/ui/live").text
    # a change without the session's CSRF token, from a foreign origin, or form-encoded
    r = quality.put(f"/v1/records/{rid}/label", json={"label": "ok"},
                    headers={"X-CSRF-Token": "forged"})
    assert r.status_code == 403
    r = quality.put(f"/v1/records/{rid}/label", json={"label": "ok"},
                    headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-site" in r.json()["error"]
    r = quality.put(f"/v1/records/{rid}/label", content=b"label=ok",
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    assert server.store.labels(rid) == []


def test_the_review_page_lists_the_queue_and_its_form_lands_a_label(server, quality):
    page = quality.get("/ui/review", params={"model": DETECTOR})
    assert page.status_code == 200, page.text
    cards = re.findall(r'<li class="card frame" data-record="(\d+)"', page.text)
    d2 = record_of(server, "D-2")["id"]
    assert str(d2) in cards and f"/v1/records/{d2}/overlay?size=" in page.text
    assert 'data-task="detection"' in page.text and 'name="x1"' in page.text
    # the classifier's form: a select of its labels; the anomaly model's: radio buttons
    text = quality.get("/ui/review", params={"model": CLASSIFIER}).text
    assert '<option value="contamination">' in text
    text = quality.get("/ui/review", params={"model": ANOMALY}).text
    assert 'type="radio" name="label" value="defective"' in text
    # what review.js sends for the card's form: the boxes it holds and the one typed in
    url = re.search(rf'data-url="(/v1/records/{d2}/label)"', page.text).group(1)
    r = quality.put(url, json={"boxes": [{"label": "spot", "box": [5, 5, 50, 50]}]})
    assert r.status_code == 200, r.text
    done = quality.get("/ui/review", params={"model": DETECTOR, "state": "labelled"}).text
    assert f'data-record="{d2}"' in done and "spot [5.0, 5.0, 50.0, 50.0]" in done
    assert f'data-record="{d2}"' not in quality.get(
        "/ui/review", params={"model": DETECTOR}).text
    assert quality.get("/ui/review", params={"model": "nope"}).status_code == 404
