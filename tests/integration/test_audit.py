"""The audit trail on a real server with a real SQLite file (docs/security.md, "The audit
trail"): each change (verdict rules, a recipe switch, a model unload and load, a guard job
submitted and cancelled, users changed with `visionserve users`, sign-in, sign-out, a failed
sign-in) leaves exactly one entry naming who made it; ``GET /v1/audit`` filters and pages them
for the roles quality and admin; with ``--frontends 2`` a sign-in in either front end is kept;
entries past the retention are deleted."""

from __future__ import annotations

import getpass
import json
import sqlite3
import sys
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from conftest import start_server, wait_for

from tests.integration.test_console_users import (
    PASSWORD,
    _front_ends,
    add_users,
    only,
    session_client,
    sign_in,
    users_cmd,
)
from tests.tools.recipe_repo import RECIPES, versioned_tiny
from visionserve.audit import AuditTrail, Entry

ZONE = "Asia/Kolkata"  # +05:30: a zone no test machine runs in by chance


def _db(data: Path) -> Path:
    return data / "visionserve" / "audit.sqlite"


def _entries(data: Path, **where: str) -> list[dict]:
    """The kept entries (oldest first), read from the file itself."""
    clause = " AND ".join(f"{k} = ?" for k in where) or "1"
    with closing(sqlite3.connect(_db(data))) as c:
        c.row_factory = sqlite3.Row
        return [dict(r) for r in c.execute(f"SELECT * FROM audit WHERE {clause} ORDER BY id",
                                           tuple(where.values()))]


def _files(data: Path) -> bytes:
    """The audit file and its write-ahead log, as bytes."""
    return b"".join(p.read_bytes() for p in _db(data).parent.glob("audit.sqlite*")
                    if p.is_file())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audit")
    repo = tmp / "repo"
    versioned_tiny(repo / "tiny")
    (repo / "recipes.toml").write_text(RECIPES)
    data = tmp / "data"
    add_users(data)
    s = start_server(repo, tmp, "--host", "0.0.0.0", "--trusted-proxies", "127.0.0.1",
                     "--model-control-mode", "explicit", "--time-zone", ZONE,
                     "--guard", "--guard-db", str(tmp / "guard.sqlite"), "--log-json",
                     grpc=False, env={"XDG_DATA_HOME": str(data)})
    s.data = data
    yield s
    s.stop()


def test_each_change_leaves_one_entry_naming_who_made_it(server):
    data = server.data
    anna, csrf = session_client(server, "qe-anna", "198.51.100.70")
    (signed_in,) = _entries(data, action="sign-in", user="qe-anna")
    assert signed_in["client"].startswith("198.51.100.70:")
    assert signed_in["target"] == "user qe-anna"
    assert json.loads(signed_in["new"]) == {"role": "quality"}

    # st1 runs housing-black already: its verdict settings are in force, only the recipe changes
    r = anna.post("/v1/stations/st2/recipe", json={"recipe": "housing-black"},
                  headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    (recipe,) = _entries(data, action="recipe")
    assert (recipe["user"], recipe["target"], recipe["old"], recipe["new"]) == (
        "qe-anna", "station st2", None, '"housing-black"')

    # the rules, through the API with the session cookie and its CSRF token
    r = anna.put("/v1/models/tiny/verdict", json={"ok_threshold": 0.7},
                 headers={"X-CSRF-Token": csrf, "X-Request-Id": "verdict-1",
                          "X-Operator": "anna at line 4"})
    assert r.status_code == 200, r.text
    (verdict,) = _entries(data, action="verdict")
    assert (verdict["user"], verdict["target"], verdict["request_id"], verdict["declared"]) == (
        "qe-anna", "model tiny", "verdict-1", "anna at line 4")
    assert json.loads(verdict["old"])["ok_threshold"] != 0.7
    assert json.loads(verdict["new"])["ok_threshold"] == 0.7
    # the log line is still written, from the same entry
    line = wait_for(lambda: [json.loads(x)["audit"] for x in server.log().splitlines()
                             if x.startswith("{") and '"verdict"' in x and '"audit"' in x],
                    what="the audit line")[-1]
    assert line["caller"]["operator"] == "qe-anna" and line["model"] == "tiny"

    max_, admin_csrf = session_client(server, "max", "198.51.100.71")
    for action in ("unload", "load"):
        r = max_.post(f"/v2/repository/models/tiny/{action}", json={"parameters": {"force": True}},
                      headers={"X-CSRF-Token": admin_csrf})
        assert r.status_code == 200, (action, r.text)
    (unload,) = _entries(data, action="model-unload")
    (load,) = _entries(data, action="model-load")
    assert unload["user"] == load["user"] == "max"
    assert json.loads(unload["old"]) == {"versions": ["1", "2"]}
    assert json.loads(unload["new"]) == {"versions": []} == json.loads(load["old"])
    assert json.loads(load["new"]) == {"versions": ["1", "2"]}

    job = {"name": "audited", "command": [sys.executable, "-c", "import time; time.sleep(60)"],
           "gpu_mem": "1MiB"}
    r = max_.post("/v1/guard/jobs", json=job, headers={"X-CSRF-Token": admin_csrf})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    r = max_.post(f"/v1/guard/jobs/{job_id}/cancel", headers={"X-CSRF-Token": admin_csrf})
    assert r.status_code == 200, r.text
    (submitted,) = _entries(data, action="job-submit")
    (cancelled,) = _entries(data, action="job-cancel")
    assert submitted["target"] == cancelled["target"] == f"job {job_id}"
    assert submitted["user"] == cancelled["user"] == "max"
    assert json.loads(submitted["new"])["command"] == job["command"]

    r = sign_in(server, "nobody", "not the password", address="198.51.100.72")
    assert r.status_code == 401
    (failed,) = _entries(data, action="sign-in-failed")
    assert (failed["user"], failed["target"]) == ("", "user nobody")
    assert b"not the password" not in _files(data)
    failed_line = wait_for(lambda: [x for x in server.log().splitlines()
                                    if "sign-in-failed" in x], what="the failed sign-in's line")
    assert "nobody" not in failed_line[-1]  # perhaps a password typed into the name field

    assert anna.post("/ui/logout", headers={"X-CSRF-Token": csrf}).status_code == 200
    (out,) = _entries(data, action="sign-out")
    assert out["user"] == "qe-anna"


def test_reading_the_trail_needs_quality_or_admin(server):
    anna, _ = session_client(server, "qe-anna", "198.51.100.80")
    otto, _ = session_client(server, "otto", "198.51.100.81")
    url = "/v1/audit"
    # a GET needs no CSRF token: a wrong one does not matter
    r = anna.get(url, headers={"X-CSRF-Token": "forged"})
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["time_zone"] == ZONE and page["entries"]
    assert page["entries"][0]["time"].endswith("+05:30")
    ids = [e["id"] for e in page["entries"]]
    assert ids == sorted(ids, reverse=True)  # newest first
    r = otto.get(url)
    assert r.status_code == 403 and "needs the role quality" in r.json()["error"], r.text
    r = httpx.get(server.url + url, timeout=10)
    assert r.status_code == 401, r.text
    for path in ("/ui/audit",):
        assert otto.get(path).status_code == 403
        assert httpx.get(server.url + path, timeout=10).status_code == 401
    # the nav shows the page to the roles that may open it
    assert 'href="/ui/audit"' in anna.get("/ui/live").text
    assert 'href="/ui/audit"' not in otto.get("/ui/live").text


def test_filters_and_pages(server):
    anna, _ = session_client(server, "qe-anna", "198.51.100.90")
    mine = anna.get("/v1/audit", params={"user": "qe-anna", "action": "sign-in"}).json()
    assert mine["entries"] and {(e["user"], e["action"]) for e in mine["entries"]} == {
        ("qe-anna", "sign-in")}
    every = anna.get("/v1/audit", params={"limit": 500}).json()["entries"]
    assert len(every) >= 6
    first = anna.get("/v1/audit", params={"limit": 2}).json()
    assert [e["id"] for e in first["entries"]] == [e["id"] for e in every[:2]]
    assert first["newer"] is None and first["older"] == every[1]["id"]
    second = anna.get("/v1/audit", params={"limit": 2, "before": first["older"]}).json()
    assert [e["id"] for e in second["entries"]] == [e["id"] for e in every[2:4]]
    back = anna.get("/v1/audit", params={"limit": 2, "after": second["newer"]}).json()
    assert back["entries"] == first["entries"]
    # time, in the server's zone (no offset) or with one
    newest = every[0]["time"]
    assert anna.get("/v1/audit", params={"since": newest}).json()["entries"][0] == every[0]
    local = newest[:19]  # 2026-12-06T23:01:02, read in Asia/Kolkata
    r = anna.get("/v1/audit", params={"until": local, "limit": 500}).json()
    assert every[0] not in r["entries"]
    for params, words in (({"action": "reboot"}, "unknown action"), ({"since": "yesterday"},
                          "not a time"), ({"limit": 0}, "limit"),
                          ({"before": 5, "after": 1}, "not both")):
        r = anna.get("/v1/audit", params=params)
        assert r.status_code == 400 and words in r.json()["error"], (params, r.text)
    # the console's page: the same entries, the filters as a form
    page = anna.get("/ui/audit", params={"action": "verdict"})
    assert page.status_code == 200 and "Verdict rules changed" in page.text
    assert "qe-anna" in page.text and "ok_threshold:" in page.text and ZONE in page.text
    assert "Failed sign-in</td>" not in page.text
    bad = anna.get("/ui/audit", params={"since": "yesterday"})
    assert bad.status_code == 200 and "not a time" in bad.text


def test_user_changes_from_the_command_line_are_audited(tmp_path):
    data = tmp_path / "data"
    add_users(data)  # otto, qe-anna, max
    assert users_cmd(data, "role", "otto", "quality").returncode == 0
    assert users_cmd(data, "passwd", "otto", "--password-file", "-",
                     stdin="another password\n").returncode == 0
    assert users_cmd(data, "remove", "max").returncode == 0
    assert users_cmd(data, "remove", "max").returncode == 1  # nothing changed: no entry
    rows = _entries(data)
    assert [(r["action"], r["target"]) for r in rows] == [
        ("user-add", "user otto"), ("user-add", "user qe-anna"), ("user-add", "user max"),
        ("user-role", "user otto"), ("user-password", "user otto"), ("user-remove", "user max")]
    assert {r["user"] for r in rows} == {getpass.getuser()}
    assert all("visionserve users on " in r["client"] for r in rows)
    assert (rows[3]["old"], rows[3]["new"]) == ('{"role": "viewer"}', '{"role": "quality"}')
    assert rows[4]["old"] is None and rows[4]["new"] is None
    assert rows[5]["old"] == '{"role": "admin"}'
    blob = _files(data)
    assert PASSWORD.encode() not in blob and b"another password" not in blob
    assert oct(_db(data).stat().st_mode & 0o777) == "0o600"


def test_front_ends_keep_sign_ins_and_old_entries_go(tmp_path):
    """--frontends 2: a sign-in is kept by whichever front end it lands in; a model unload sent
    to a front end is kept with its caller. An entry older than --audit-retention-days is
    deleted by the server's first write."""
    from conftest import TINY_TOML, make_tiny_model

    make_tiny_model(tmp_path / "repo" / "tiny", TINY_TOML)
    data = tmp_path / "data"
    add_users(data)
    old = AuditTrail(_db(data))
    old.record(Entry("verdict", "model", "tiny", {"ok_threshold": 0.1}, {"ok_threshold": 0.2},
                     {"operator": "ghost", "client": "192.0.2.1:1"}), "an old change")
    with closing(sqlite3.connect(_db(data))) as c, c:
        c.execute("UPDATE audit SET time = ? WHERE user = 'ghost'", (time.time() - 3 * 86400,))
    s = start_server(tmp_path / "repo", tmp_path, "--host", "0.0.0.0", "--frontends", "2",
                     "--model-control-mode", "explicit",
                     "--trusted-proxies", "127.0.0.1", "--audit-retention-days", "2",
                     grpc=False, env={"XDG_DATA_HOME": str(data)})
    try:
        fronts = _front_ends(s)
        assert len(fronts) == 2
        for n, front in enumerate(fronts):
            with only(front, fronts):
                assert sign_in(s, "qe-anna", address=f"198.51.100.{100 + n}").status_code == 200
        rows = _entries(data, action="sign-in")
        assert sorted(r["client"].split(":")[0] for r in rows) == ["198.51.100.100",
                                                                  "198.51.100.101"]
        assert _entries(data, user="ghost") == []
        # a change through a front end is made, and audited, by the serving process with the
        # front end's caller
        token = (data / "visionserve" / "admin-token").read_text().strip()
        r = httpx.post(f"{s.url}/v2/repository/models/tiny/unload", json={},
                       headers={"Authorization": f"Bearer {token}", "X-Request-Id": "u-1"},
                       timeout=30)
        assert r.status_code == 200, r.text
        (unload,) = _entries(data, action="model-unload")
        assert (unload["user"], unload["request_id"]) == ("admin-token", "u-1")
        assert unload["client"].startswith("127.0.0.1:")
    finally:
        s.stop()


def test_retention_prunes_cheaply(tmp_path):
    path = tmp_path / "audit.sqlite"
    trail = AuditTrail(path, retention_days=1)
    who = {"operator": "anna", "client": "192.0.2.7:5"}
    trail.record(Entry("recipe", "station", "st1", "a", "b", who), "first")
    with closing(sqlite3.connect(path)) as c, c:
        c.execute("UPDATE audit SET time = time - 2 * 86400")
    trail.record(Entry("recipe", "station", "st1", "b", "c", who), "second")
    assert [r.old for r in trail.read()] == ["b", "a"]  # pruned at most once an hour
    assert trail.prune() == 1
    assert [r.old for r in trail.read()] == ["b"]
    forever = AuditTrail(path, retention_days=0)
    assert forever.prune() == 0 and len(forever.read()) == 1


def test_an_entry_that_cannot_be_kept_is_said_and_the_line_stays(tmp_path, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    trail = AuditTrail(blocked / "audit.sqlite")  # its folder cannot be made
    who = {"operator": "anna", "client": "192.0.2.7:5"}
    with caplog.at_level("INFO"):
        kept = trail.record(Entry("recipe", "station", "st1", "a", "b", who), "switched %s", "st1")
    assert not kept
    said = {(r.name, r.levelname, r.getMessage()) for r in caplog.records}
    assert ("visionserve.audit", "INFO", "switched st1") in said
    assert any(name == "visionserve.audit" and level == "ERROR" and "could not be kept" in m
               for name, level, m in said)
