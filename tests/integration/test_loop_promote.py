"""Promote and roll back (docs/closed-loop.md) on a real server with the shipped classifier,
``--guard --records --capture learn --model-control-mode explicit``: a candidate is trained (a
few steps of the last layer, a real guard job on the CPU) and compared, then promoted and rolled
back while a client sends frames without a pause: every frame is answered 200, by the version
in force at its time. The refusals (not compared, promoted already, nothing to roll back), who
may do it (viewer 403, no token 401, the CSRF rule), the audit entries; a poll-mode server that
promotes a copied candidate through a front-end process and a server without model control that
refuses to; a model that takes a second approver."""

from __future__ import annotations

import shutil
import threading
import time
from typing import Self

import httpx
import pytest
from conftest import start_server, wait_for

from tests.integration.test_console_users import add_users, quality_session, session_client
from tests.integration.test_loop_candidates import (
    ADMIN,
    BASE,
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
from visionserve.loop import candidates as cands
from visionserve_tools import synthetic

FRAME = synthetic.encode(synthetic.generate("scratch", seed=7))
ROLLBACK = f"/v1/models/{CLASSIFIER}/rollback"


def start(tmp, *extra: str, guard: bool = False, models: tuple[str, ...] = (CLASSIFIER,),
          nice: int = 0):
    """A server with the shipped ``models``, signed-in users, records and the admin token
    (:data:`TOKEN`); with ``guard``, the hosted guard; ``nice``: start_server's."""
    add_users(tmp / "xdg")
    s = start_server(shipped_repo(tmp / "repo", models), tmp,
                     "--host", "0.0.0.0", "--trusted-proxies", "127.0.0.1",
                     "--admin-token", TOKEN, "--records", "--records-dir", str(tmp / "data"),
                     *extra, *(("--guard", "--guard-db", str(tmp / "guard.sqlite")) if guard
                               else ()),
                     grpc=False, env={"XDG_DATA_HOME": str(tmp / "xdg")}, nice=nice)
    s.repo = tmp / "repo"
    return s


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start(tmp_path_factory.mktemp("promote"), "--capture", "learn",
              "--capture-sample-percent", "100", "--model-control-mode", "explicit", guard=True)
    send_looks(s)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def quality(server):
    yield from quality_session(server, "198.51.100.221")


@pytest.fixture(scope="module")
def trained(server, quality):
    """c-1, trained on every capture (labelled with its look), not compared yet."""
    for rec in records(server):
        look = LOOKS[int(rec["part_id"][2:])][0]
        r = quality.put(f"/v1/records/{rec['id']}/label", json={"label": look})
        assert r.status_code == 200, r.text
    r = quality.post(BASE, json=TRAIN)
    assert r.status_code == 202, r.text
    done = wait_state(quality, f"{BASE}/c-1")
    assert done["state"] == "done", (done, server.log()[-3000:])
    return server.repo / CLASSIFIER / "candidates" / "c-1"


class Line:
    """A client that sends frames without a pause until stopped: each answer's status and
    version, in order."""

    def __init__(self, url: str) -> None:
        self.url, self.answers = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                r = client.post(f"{self.url}/v1/models/{CLASSIFIER}/inspect", content=FRAME,
                                headers={"Content-Type": "image/jpeg", "X-Deadline-Ms": "20000"})
                self.answers.append((r.status_code, r.json().get("version"), r.text[:200]))

    def __enter__(self) -> Self:
        self._thread.start()
        wait_for(lambda: len(self.answers) >= 3, 30, "the line's first answers")
        return self

    def __exit__(self, *exc) -> None:
        n = len(self.answers)
        wait_for(lambda: len(self.answers) >= n + 3, 30, "answers after the change")
        self._stop.set()
        self._thread.join(60)

    def versions(self) -> list[str]:
        failed = [a for a in self.answers if a[0] != 200]
        assert not failed, failed[:3]
        return [v for _, v, _ in self.answers]


def switched_once(versions: list[str], old: str, new: str) -> None:
    """The answers are ``old`` up to one frame and ``new`` from there on."""
    assert versions[0] == old and versions[-1] == new, versions
    first = versions.index(new)
    assert set(versions[:first]) == {old} and set(versions[first:]) == {new}, versions


def test_refusals_before_a_comparison(server, quality, trained):
    r = quality.post(f"{BASE}/c-1/promote")
    assert r.status_code == 409 and "no comparison" in r.json()["error"], r.text
    assert quality.post(f"{BASE}/c-9/promote").status_code == 404
    assert quality.post("/v1/models/nope/candidates/c-1/promote").status_code == 404
    r = quality.post(ROLLBACK)
    assert r.status_code == 409 and "no promotion" in r.json()["error"], r.text
    r = quality.post(f"{BASE}/c-1/promote", json={"why": 1})
    assert r.status_code == 400 and "why" in r.json()["error"], r.text
    assert sorted(p.name for p in (server.repo / CLASSIFIER).iterdir()) == [
        "1", "README.md", "candidates", "confusion_matrix.png", "model.toml"]


def test_who_may_promote_and_roll_back(server, quality):
    viewer, vcsrf = session_client(server, "otto", "198.51.100.222")
    with viewer:
        for path in (f"{BASE}/c-1/promote", ROLLBACK):
            r = viewer.post(path, json={}, headers={"X-CSRF-Token": vcsrf})
            assert r.status_code == 403, (path, r.text)
            r = httpx.post(server.url + path, json={}, timeout=10)
            assert r.status_code == 401, (path, r.text)
            r = quality.post(path, json={}, headers={"X-CSRF-Token": "forged"})
            assert r.status_code == 403, r.text
            r = quality.post(path, json={}, headers={"Origin": "http://evil.example"})
            assert r.status_code == 403 and "cross-site" in r.json()["error"]
            r = quality.post(path, content=b"a=1",
                             headers={"Content-Type": "application/x-www-form-urlencoded"})
            assert r.status_code == 415
    assert not audit(server, "promote") and not audit(server, "rollback")


def test_promote_and_roll_back_without_a_failed_frame(server, quality, trained):
    r = httpx.post(f"{server.url}{BASE}/c-1/evaluate", headers=ADMIN, timeout=10)
    assert r.status_code == 202, r.text
    result = wait_state(quality, f"{BASE}/c-1/comparison", 120)
    assert result["state"] == "done", (result, server.log()[-3000:])

    with Line(server.url) as line:
        r = quality.post(f"{BASE}/c-1/promote")
        assert r.status_code == 200, r.text
    switched_once(line.versions(), "1", "2")
    done = r.json()
    assert done["version"] == 2 and done["from_version"] == 1 and done["candidate"] == "c-1"
    assert done["approved_by"] == "qe-anna" and done["versions"] == ["1", "2"]
    folder = server.repo / CLASSIFIER / "2"
    for name in ("model.onnx", "weights.pt", "candidate.json", "comparison.json",
                 "promotion.json"):
        assert (folder / name).is_file(), name
    assert not (folder / "job.json").exists()
    assert "default_version = 2" in (server.repo / CLASSIFIER / "model.toml").read_text()
    assert not list((server.repo / CLASSIFIER).glob(".promote-*"))
    shown = quality.get(f"{BASE}/c-1").json()
    assert shown["state"] == "promoted" and shown["promotion"]["version"] == 2
    (entry,) = audit(server, "promote")
    assert entry["user"] == "qe-anna" and entry["target"] == f"model {CLASSIFIER}"
    assert entry["old"] == {"version": 1}
    assert entry["new"] == {"version": 2, "candidate": "c-1", "approved_by": "qe-anna"}
    r = quality.post(f"{BASE}/c-1/promote")
    assert r.status_code == 409 and "promoted already" in r.json()["error"], r.text

    with Line(server.url) as line:
        r = httpx.post(server.url + ROLLBACK, headers=ADMIN, timeout=60)
        assert r.status_code == 200, r.text
    switched_once(line.versions(), "2", "1")
    back = r.json()
    assert back["version"] == 2 and back["from_version"] == 1
    assert back["rolled_back"]["by"] == "admin-token" and back["versions"] == ["1"]
    assert (server.repo / CLASSIFIER / "retired" / "2" / "model.onnx").is_file()
    assert not folder.exists()
    assert "default_version = 1" in (server.repo / CLASSIFIER / "model.toml").read_text()
    assert quality.get(f"{BASE}/c-1").json()["state"] == "rolled-back"
    (entry,) = audit(server, "rollback")
    assert entry["user"] == "admin-token" and entry["old"] == {"version": 2}
    assert entry["new"] == {"version": 1, "candidate": "c-1"}
    r = quality.post(ROLLBACK)
    assert r.status_code == 409 and "rolled back already" in r.json()["error"], r.text
    meta = httpx.get(f"{server.url}/v2/models/{CLASSIFIER}", timeout=10).json()
    assert meta["versions"] == ["1"]
    trail = quality.get(f"{BASE}/c-1/trace").json()
    assert trail["state"] == "rolled-back"
    (kept,) = trail["promotions"]
    assert kept["approved_by"] == "qe-anna" and kept["version"] == 2
    assert kept["rolled_back"]["by"] == "admin-token"


def copy_candidate(source, repo) -> None:
    """A trained and compared candidate, copied into another repository's candidates area."""
    dest = repo / CLASSIFIER / "candidates" / "c-1"
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("heldout"))
    for path in [dest.parent, dest, *dest.rglob("*")]:
        path.chmod(path.stat().st_mode & 0o755)


def test_poll_mode_promotes_and_no_model_control_refuses(server, trained, tmp_path):
    """A poll-mode server with two front-end processes (no guard: a trained candidate needs
    none) promotes the same way, the swap asked of the serving process; a
    server whose models are fixed at start (--model-control-mode none) refuses and leaves the
    repository as it was."""
    assert (trained / "comparison.json").is_file()  # the test above compared it
    fixed = start(tmp_path / "none")
    try:
        copy_candidate(trained, fixed.repo)
        r = httpx.post(f"{fixed.url}{BASE}/c-1/promote", headers=ADMIN, timeout=60)
        assert r.status_code == 409 and "model-control-mode" in r.json()["error"], r.text
        assert not (fixed.repo / CLASSIFIER / "2").exists()
        assert "default_version = 1" in (fixed.repo / CLASSIFIER / "model.toml").read_text()
    finally:
        fixed.stop()
    polled = start(tmp_path / "poll", "--model-control-mode", "poll",
                   "--repository-poll-secs", "0.1", "--frontends", "2")
    try:
        copy_candidate(trained, polled.repo)
        with Line(polled.url) as line:
            r = httpx.post(f"{polled.url}{BASE}/c-1/promote", headers=ADMIN, timeout=60)
            assert r.status_code == 200, r.text
            time.sleep(0.5)  # polls that read the promoted version after the swap
        switched_once(line.versions(), "1", "2")
        assert "failed" not in polled.log().split("promoted to version 2")[-1].lower()
    finally:
        polled.stop()


def test_a_model_that_takes_two_approvers_waits_for_the_second(server, trained, tmp_path):
    """``[training] approvers = 2``: qe-anna's approval is kept and waits (202, audited, shown on
    the Candidates page); her second one is refused; another user's promotes, the promotion
    naming both; after a rollback, promoting it again takes two approvals again."""
    assert (trained / "comparison.json").is_file()  # compared above
    s = start(tmp_path / "two", "--model-control-mode", "explicit")
    try:
        toml = s.repo / CLASSIFIER / "model.toml"
        toml.write_text(toml.read_text() + "\n[training]\napprovers = 2\n")
        copy_candidate(trained, s.repo)
        r = httpx.post(f"{s.url}/v2/repository/models/{CLASSIFIER}/load", headers=ADMIN,
                       timeout=60)
        assert r.status_code == 200, r.text
        anna, csrf = session_client(s, "qe-anna", "198.51.100.223")
        anna.headers["X-CSRF-Token"] = csrf
        r = anna.post(f"{BASE}/c-1/promote")
        assert r.status_code == 202, r.text
        waiting = r.json()
        assert waiting["state"] == "awaiting-approval" and waiting["approvers"] == 2
        assert [a["by"] for a in waiting["approvals"]] == ["qe-anna"]
        assert httpx.get(f"{s.url}/v2/models/{CLASSIFIER}").json()["versions"] == ["1"]
        (entry,) = audit(s, "promote-approval")
        assert entry["user"] == "qe-anna" and entry["new"]["candidate"] == "c-1"
        assert not audit(s, "promote")
        page = anna.get(f"/ui/models/{CLASSIFIER}/candidates").text
        assert "two approvers" in page and "approved by qe-anna; waiting" in page
        r = anna.post(f"{BASE}/c-1/promote")
        assert r.status_code == 409 and "approved by qe-anna already" in r.json()["error"]

        r = httpx.post(f"{s.url}{BASE}/c-1/promote", headers=ADMIN, timeout=60)
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["version"] == 2 and done["approved_by"] == "admin-token"
        assert [a["by"] for a in done["approvals"]] == ["qe-anna", "admin-token"]
        (entry,) = audit(s, "promote")
        assert entry["new"]["approvers"] == ["qe-anna", "admin-token"]
        assert not (s.repo / CLASSIFIER / "2" / "approvals.json").exists()
        promoted = cands.read_json(s.repo / CLASSIFIER / "2" / "promotion.json")
        assert [a["by"] for a in promoted["approvals"]] == ["qe-anna", "admin-token"]

        assert httpx.post(s.url + ROLLBACK, headers=ADMIN, timeout=60).status_code == 200
        r = httpx.post(f"{s.url}{BASE}/c-1/promote", headers=ADMIN, timeout=60)
        assert r.status_code == 202 and r.json()["state"] == "awaiting-approval", r.text
    finally:
        s.stop()
