"""The closed loop's trail for an audit (docs/closed-loop.md, "Traceability"), end to end on a
real server with the shipped classifier, ``--guard --records --capture learn`` and a real SQLite
file: frames are captured, flagged and labelled through the API by two users (one relabelled
before training), a candidate is fine-tuned by a real guard job and compared with the live
version; then its trace names the version and the bytes it came from and came out, the guard
job's command and recipe, every record it was trained and compared on with the label in force,
who set it, when and where (as the store and the audit trail keep them), the records relabelled
since, and the comparison's held-out records and figures. The records that a candidate used
find it back (``?record=N``), the export carries each record's label, and the trace's access
rules are those of the other candidate routes."""

from __future__ import annotations

import csv
import hashlib
import json
from argparse import Namespace

import httpx
import pytest
from conftest import start_server

from tests.integration.test_console_users import add_users, quality_session, session_client
from tests.integration.test_loop_candidates import (
    ADMIN,
    CLASSIFIER,
    LOOKS,
    TOKEN,
    TRAIN,
    audit,
    records,
    send_looks,
    wait_state,
)
from tests.integration.test_records_images import shipped_repo
from visionserve.records import cli
from visionserve.records.store import SqliteStore

BASE = f"/v1/models/{CLASSIFIER}/candidates"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    add_users(tmp / "xdg")
    s = start_server(shipped_repo(tmp / "repo", (CLASSIFIER,)), tmp,
                     "--host", "0.0.0.0", "--trusted-proxies", "127.0.0.1",
                     "--admin-token", TOKEN, "--records", "--records-dir", str(tmp / "data"),
                     "--capture", "learn", "--capture-sample-percent", "100",
                     "--guard", "--guard-db", str(tmp / "guard.sqlite"), grpc=False,
                     env={"XDG_DATA_HOME": str(tmp / "xdg")})
    s.repo, s.data = tmp / "repo", tmp / "data"
    s.store = SqliteStore(tmp / "data" / "records.sqlite")
    send_looks(s)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def quality(server):
    yield from quality_session(server, "198.51.100.221")


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_candidates_trail_from_the_labels_to_its_comparison(server, quality, tmp_path):
    admin = httpx.Client(base_url=server.url, headers=ADMIN, timeout=10)
    rows = sorted(records(server), key=lambda r: int(r["part_id"][2:]))
    ids = [r["id"] for r in rows]
    looks = {r["id"]: LOOKS[int(r["part_id"][2:])][0] for r in rows}
    # the first frame flagged by quality, the second labelled wrong by the admin token and then
    # right by quality (the label in force is the later), the others by either
    r = quality.post(f"/v1/records/{ids[0]}/flag",
                     json={"label": looks[ids[0]], "verdict_was_wrong": True})
    assert r.status_code == 200, r.text
    wrong = "ok" if looks[ids[1]] != "ok" else "scratch"
    assert admin.put(f"/v1/records/{ids[1]}/label", json={"label": wrong}).status_code == 200
    for i, row_id in enumerate(ids[1:], 1):
        client = quality if i % 2 else admin
        r = client.put(f"/v1/records/{row_id}/label", json={"label": looks[row_id]})
        assert r.status_code == 200, r.text
    in_force = {row_id: server.store.labels(row_id)[0] for row_id in ids}
    assert in_force[ids[1]].label == {"label": looks[ids[1]]}

    r = quality.post(BASE, json=TRAIN)
    assert r.status_code == 202, r.text
    cid = r.json()["id"]
    done = wait_state(quality, f"{BASE}/{cid}")
    assert done["state"] == "done", (done, server.log()[-3000:])
    # relabelled after training: the trace says the candidate used the label before
    changed = ids[2]
    assert admin.put(f"/v1/records/{changed}/label", json={"label": wrong}).status_code == 200
    r = admin.post(f"{BASE}/{cid}/evaluate")
    assert r.status_code == 202, r.text
    compared = wait_state(quality, f"{BASE}/{cid}/comparison", 120)
    assert compared["state"] == "done", (compared, server.log()[-3000:])

    r = quality.get(f"{BASE}/{cid}/trace")
    assert r.status_code == 200, r.text
    trace = r.json()
    assert (trace["id"], trace["model"], trace["state"]) == (cid, CLASSIFIER, "done")
    # from which version, which bytes went in and came out
    source = server.repo / CLASSIFIER / "1"
    folder = server.repo / CLASSIFIER / "candidates" / cid
    assert trace["from_version"] == 1
    assert trace["from_files"]["weights.pt"] == sha256(source / "weights.pt")
    assert trace["from_files"]["model.onnx"] == sha256(source / "model.onnx")
    for name in ("weights.pt", "model.onnx", "model.pt2", "metrics.json", "export.json"):
        assert trace["training"]["files"][name] == sha256(folder / name), name
    # the training: who asked, the guard job as the guard ran it, its settings
    training = trace["training"]
    assert training["requested_by"] == "qe-anna" and training["finished"]
    job = admin.get(f"/v1/guard/jobs/{training['job']['id']}").json()
    assert job["command"] == training["job"]["command"] and job["state"] == "succeeded"
    command = training["job"]["command"]
    assert command[command.index("--init") + 1] == str(source / "weights.pt")
    assert command[command.index("--steps") + 1] == str(TRAIN["steps"])
    assert training["recipe"]["steps"] == TRAIN["steps"]
    assert training["recipe"]["original_share"] == TRAIN["original_share"]
    assert training["metrics"]["steps"] == TRAIN["steps"]
    # every labelled record, trained on or held out, with the label in force at the time, as
    # the store keeps it
    used = {x["record_id"]: x for x in trace["trained_on"] + trace["held_out"]}
    assert sorted(used) == sorted(ids)
    assert not {x["record_id"] for x in trace["trained_on"]} & \
        {x["record_id"] for x in trace["held_out"]}
    for row_id, x in used.items():
        label = in_force[row_id].to_dict()
        assert (x["label"], x["labelled_by"], x["labelled_at"], x["source"]) == \
            (label["label"], label["labelled_by"], label["time"], label["source"]), x
        assert x["part_id"] == next(r["part_id"] for r in rows if r["id"] == row_id)
        assert x["verdict"] == next(r["verdict"] for r in rows if r["id"] == row_id)
        assert x["verdict_was_wrong"] is (row_id == ids[0])
        assert (folder / x["file"]).is_file() == (x in trace["held_out"])
    assert (used[ids[0]]["labelled_by"], used[ids[0]]["source"]) == ("qe-anna", "flag")
    assert used[ids[3]]["labelled_by"] == "qe-anna" and used[ids[4]]["labelled_by"] == \
        "admin-token"
    # each label is in the audit trail, with who set it
    for entry in audit(server, "flag") + audit(server, "label"):
        row_id = int(entry["target"].split()[-1])
        if entry["time"] == used[row_id]["labelled_at"]:
            assert entry["user"] == used[row_id]["labelled_by"]
    # relabelled since
    (moved,) = trace["relabelled"]
    assert moved["record_id"] == changed and moved["used"]["label"] == looks[changed]
    assert moved["now"]["label"] == wrong and moved["now"]["labelled_by"] == "admin-token"
    # evaluated how: on the held-out records, against the live version, the figures
    evaluation = trace["evaluation"]
    assert evaluation["state"] == "done" and evaluation["live_version"] == 1
    assert evaluation["requested_by"] == "admin-token"
    assert sorted(evaluation["records"]) == sorted(x["record_id"] for x in trace["held_out"])
    assert evaluation["summary"] == compared["summary"]
    # the candidate as the API shows it says the same
    candidate = quality.get(f"{BASE}/{cid}").json()["candidate"]
    assert candidate["files"] == training["files"] and candidate["trained_on"] == \
        trace["trained_on"]

    # which candidates used a record
    listing = quality.get(BASE, params={"record": ids[0]}).json()
    assert [c["id"] for c in listing["candidates"]] == [cid]
    assert quality.get(BASE, params={"record": 10**9}).json()["candidates"] == []
    r = quality.get(BASE, params={"record": "x"})
    assert r.status_code == 400 and "record" in r.json()["error"], r.text

    # the export: each record with its label in force, who set it and when
    out = tmp_path / "export.csv"
    args = Namespace(records_url=None, records_dir=str(server.data), action="export",
                     since="2000-01-01T00:00Z", until=None, format="csv", out=str(out))
    assert cli.run(args) == 0
    with open(out, newline="") as f:
        exported = {int(r["id"]): r for r in csv.DictReader(f)}
    for row_id in ids:
        label = server.store.labels(row_id)[0]
        assert json.loads(exported[row_id]["labelled"]) == label.label
        assert exported[row_id]["labelled_by"] == label.by
        assert exported[row_id]["labelled_at"] == label.to_dict()["time"]
    admin.close()


def test_who_may_read_a_trace(server, quality):
    viewer, _ = session_client(server, "otto", "198.51.100.222")
    path = f"{BASE}/c-1/trace"
    with viewer:
        r = viewer.get(path)
        assert r.status_code == 403, r.text
    assert httpx.get(server.url + path, timeout=10).status_code == 401
    r = httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    r = httpx.get(server.url + path, headers={**ADMIN, "Host": "evil.example"}, timeout=10)
    assert r.status_code == 403 and "allowed_hosts" in r.text, r.text  # DNS rebinding
    # the admin token passes (c-1 is there once the trail above was made)
    assert httpx.get(server.url + path, headers=ADMIN, timeout=10).status_code in (200, 404)
    r = quality.get(f"{BASE}/c-99/trace")
    assert r.status_code == 404 and "c-99" in r.json()["error"], r.text
    assert quality.get("/v1/models/nope/candidates/c-1/trace").status_code == 404
