"""The console's users (visionserve.users): the users file, passwords, sessions, failed sign-ins,
and how the access middleware judges a request that carries a session cookie (real SQLite files;
the end-to-end run on a real server is tests/integration/test_console_users.py)."""

from __future__ import annotations

import sqlite3
import stat
import time

import pytest
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from visionserve.config import users_db_path
from visionserve.security import (
    ROUTES,
    SESSION_COOKIE,
    SIGNIN,
    Access,
    HttpSecurity,
    classify,
    route_of,
)
from visionserve.users import store as users_store
from visionserve.users.store import (
    UserConflict,
    UserError,
    Users,
    UserStore,
    login_delay,
    role_covers,
)

PASSWORD = "correct horse battery"


@pytest.fixture
def store(tmp_path) -> UserStore:
    return UserStore(tmp_path / "data" / "users.sqlite", create=True)


def test_the_file_is_private_and_holds_no_password_or_session_id(store):
    store.add("anna", "quality", PASSWORD)
    token, _ = store.open_session("anna", 60)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
    with sqlite3.connect(store.path) as db:
        dump = "\n".join(db.iterdump())
    assert PASSWORD not in dump and token not in dump and "$argon2id$" in dump


def test_users_add_list_change_remove(store):
    store.add("anna", "quality", PASSWORD)
    store.add("otto", "viewer", PASSWORD)
    assert [(u.name, u.role) for u in store.users()] == [("anna", "quality"), ("otto", "viewer")]
    with pytest.raises(UserConflict, match="exists"):
        store.add("anna", "admin", PASSWORD)
    store.set_role("otto", "admin")
    assert store.authenticate("otto", PASSWORD).role == "admin"
    store.set_password("otto", "another password")
    assert store.authenticate("otto", PASSWORD) is None
    assert store.authenticate("otto", "another password") is not None
    store.remove("otto")
    assert store.count() == 1
    for change in (lambda: store.remove("otto"), lambda: store.set_role("otto", "viewer"),
                   lambda: store.set_password("otto", PASSWORD)):
        with pytest.raises(UserConflict, match="no user 'otto'"):
            change()


@pytest.mark.parametrize("name, role, password, words", [
    ("", "viewer", PASSWORD, "bad user name"),
    ("anna smith", "viewer", PASSWORD, "bad user name"),
    ("-x", "viewer", PASSWORD, "bad user name"),
    ("admin-token", "admin", PASSWORD, "reserved"),
    ("loopback", "admin", PASSWORD, "reserved"),
    ("anna", "operator", PASSWORD, "unknown role"),
    ("anna", "viewer", "short", "8 to 1024"),
])
def test_bad_users_are_refused(store, name, role, password, words):
    with pytest.raises(UserError, match=words):
        store.add(name, role, password)
    assert store.count() == 0


def test_roles_are_ordered():
    assert role_covers("admin", "quality") and role_covers("quality", "viewer")
    assert role_covers("viewer", "viewer")
    assert not role_covers("viewer", "quality") and not role_covers("quality", "admin")
    assert not role_covers("root", "viewer")


def test_sessions_live_until_they_expire_end_or_lose_their_user(store):
    store.add("anna", "quality", PASSWORD)
    store.add("otto", "viewer", PASSWORD)
    token, session = store.open_session("anna", 60)
    found = store.session(token)
    assert found == session and found.role == "quality" and len(found.csrf_token) >= 40
    # a second process (another front end) sees the same session, and its end
    other = UserStore(store.path)
    assert other.session(token) == session
    store.set_role("anna", "viewer")  # the role is read at every request
    assert other.session(token).role == "viewer"
    other.end_session(session.key)
    assert store.session(token) is None
    assert store.session("made-up") is None
    # a password change and a removal end the user's sessions
    for end in (lambda: store.set_password("otto", "a new password"),
                lambda: store.remove("otto")):
        token, _ = store.open_session("otto", 60)
        end()
        assert store.session(token) is None
    # expiry
    token, _ = store.open_session("anna", 60)
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE sessions SET expires = ?", (time.time() - 1,))
    assert store.session(token) is None


def test_failed_sign_ins_slow_down_per_key(store, monkeypatch):
    assert [login_delay(n) for n in range(7)] == [0, 0, 0, 1, 2, 4, 8]
    assert login_delay(100) == users_store.MAX_DELAY_S
    keys = ("user:anna", "addr:10.0.0.5")
    for _ in range(users_store.FREE_FAILURES - 1):
        store.login_failed(keys)
        assert store.login_wait(keys) == 0
    store.login_failed(keys)
    assert 0 < store.login_wait(keys) <= 1
    assert 0 < store.login_wait(("user:someone-else", "addr:10.0.0.5")) <= 1  # the address
    assert store.login_wait(("user:someone-else", "addr:10.0.0.6")) == 0
    store.login_failed(keys)
    assert 1 < store.login_wait(keys) <= 2  # growing
    store.login_succeeded("user:anna")
    assert store.login_wait(("user:anna", "addr:10.0.0.7")) == 0
    # counters are forgotten an hour after the last failure
    now = time.time()
    monkeypatch.setattr(users_store.time, "time", lambda: now + users_store.FORGET_S + 1)
    assert store.login_wait(keys) == 0


def test_a_name_nobody_has_takes_a_hash_check_too(store):
    store.add("anna", "quality", PASSWORD)
    assert store.authenticate("nobody", PASSWORD) is None
    assert store._dummy is not None and store._dummy.startswith("$argon2id$")


def test_the_server_opens_the_file_once_it_exists(tmp_path, monkeypatch):
    path = tmp_path / "users.sqlite"
    monkeypatch.setenv("VISIONSERVE_USERS_DB", str(tmp_path / "env.sqlite"))
    assert users_db_path(path) == path and users_db_path(None) == tmp_path / "env.sqlite"
    users = Users(path)
    assert users.store() is None and not users.any_user() and users.session("x") is None
    assert "no users" in users.describe()
    UserStore(path, create=True).add("anna", "admin", PASSWORD)
    assert users.any_user() and "1 users" in users.describe() and "admin 1" in users.describe()


# --- the middleware ---------------------------------------------------------------------------

def test_the_sign_in_routes_are_classified():
    assert classify("GET", "/ui/login") == classify("POST", "/ui/login") == SIGNIN
    assert classify("POST", "/ui/logout") == classify("GET", "/ui/session") == SIGNIN
    assert [r.path for r in ROUTES if r.form] == ["/ui/login"]  # the one form body
    assert route_of("PUT", "/v1/models/m/verdict").role == "quality"
    assert route_of("POST", "/v1/stations/s/recipe").role == "quality"
    assert route_of("GET", "/v1/parts/p").role == "viewer"
    assert route_of("GET", "/v1/guard/jobs/3/logs").role == "viewer"
    assert route_of("POST", "/v1/guard/jobs").role == "admin"
    assert route_of("POST", "/v2/repository/models/m/load").role == "admin"
    assert route_of("GET", "/nowhere") is None  # protected, admin


async def _who(scope, receive, send):
    await PlainTextResponse(scope.get("visionserve.identity") or "ok")(scope, receive, send)


@pytest.fixture
def signed_in(store):
    """(client, {role: (cookie token, session)}) on a server off loopback with an admin token."""
    sessions = {}
    for role in ("viewer", "quality", "admin"):
        store.add(f"{role}-user", role, PASSWORD)
        sessions[role] = store.open_session(f"{role}-user", 60)
    access = Access(admin_token=b"adm", hosts=None)
    return TestClient(HttpSecurity(_who, access, Users(store.path))), sessions


def _with(client, token: str, csrf: str | None = None, method: str = "PUT",
          path: str = "/v1/models/m/verdict", **kw):
    client.cookies.clear()
    client.cookies.set(SESSION_COOKIE, token)
    headers = {"X-CSRF-Token": csrf} if csrf is not None else {}
    return client.request(method, path, headers={**headers, **kw.pop("headers", {})}, **kw)


def test_a_session_opens_what_its_role_covers(signed_in):
    client, sessions = signed_in
    (viewer, v), (quality, q), (admin, a) = (sessions[r] for r in ("viewer", "quality", "admin"))
    r = _with(client, viewer, v.csrf_token, json={})
    assert r.status_code == 403 and "needs the role quality" in r.json()["error"]
    r = _with(client, quality, q.csrf_token, json={})
    assert r.status_code == 200 and r.text == "quality-user"
    r = _with(client, quality, q.csrf_token, "POST", "/v2/repository/models/m/load")
    assert r.status_code == 403 and "needs the role admin" in r.json()["error"]
    r = _with(client, admin, a.csrf_token, "POST", "/v2/repository/models/m/load")
    assert r.status_code == 200 and r.text == "admin-user"
    assert _with(client, viewer, None, "GET", "/v1/parts/P-1").text == "viewer-user"


def test_a_change_with_a_session_needs_its_csrf_token(signed_in):
    client, sessions = signed_in
    quality, q = sessions["quality"]
    r = _with(client, quality, None, json={})
    assert r.status_code == 403 and "X-CSRF-Token" in r.json()["error"]
    r = _with(client, quality, sessions["admin"][1].csrf_token, json={})  # another session's
    assert r.status_code == 403 and "wrong CSRF token" in r.json()["error"]
    # the admin token wins over a cookie, and needs no CSRF token (API clients)
    r = _with(client, quality, None, json={}, headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200 and r.text == "admin-token"
    # a session's change still takes JSON only
    r = _with(client, quality, q.csrf_token, content=b"a=1",
              headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415


def test_an_ended_session_is_told_to_sign_in_again(signed_in, store):
    client, sessions = signed_in
    token, session = sessions["admin"]
    store.end_session(session.key)
    r = _with(client, token, session.csrf_token, json={})
    assert r.status_code == 401 and "sign in again" in r.json()["error"]
    r = _with(client, "made-up", None, "GET", "/v1/parts/P-1")
    assert r.status_code == 401 and "sign in again" in r.json()["error"]
    # open routes never look at the cookie
    assert _with(client, "made-up", None, "GET", "/v2/models/m").status_code == 200


def test_without_users_a_cookie_changes_nothing(tmp_path):
    off = TestClient(HttpSecurity(_who, Access(admin_token=b"adm", hosts=None),
                                  Users(tmp_path / "none.sqlite")))
    r = _with(off, "anything", None, json={})
    assert r.status_code == 401 and "admin token" in r.json()["error"]
    loopback = TestClient(HttpSecurity(_who, Access(admin_required=False, hosts=None),
                                       Users(tmp_path / "none.sqlite")))
    assert _with(loopback, "anything", None, json={}).text == "loopback"


def test_sign_in_routes_check_host_and_origin_but_take_a_form(signed_in, store):
    _, sessions = signed_in
    access = Access(admin_token=b"adm", hosts=frozenset({"localhost"}))
    strict = TestClient(HttpSecurity(_who, access, Users(store.path)))
    here = {"Host": "localhost:8000"}
    r = strict.post("/ui/login", content=b"user=a&password=b",
                    headers={"Host": "evil.example", "Content-Type": _FORM})
    assert r.status_code == 403 and "allowed_hosts" in r.json()["error"]
    r = strict.post("/ui/login", content=b"user=a&password=b", headers={
        **here, "Origin": "http://evil.example", "Content-Type": _FORM})
    assert r.status_code == 403 and "allowed_origins" in r.json()["error"]
    r = strict.post("/ui/login", content=b"user=a&password=b", headers={
        **here, "Origin": "http://localhost:8000", "Content-Type": _FORM})
    assert r.status_code == 200  # no token needed, the form body passes
    # sign-out is a change: no form body, and with a session its CSRF token
    r = strict.post("/ui/logout", content=b"a=1", headers={**here, "Content-Type": _FORM})
    assert r.status_code == 415
    token, session = sessions["viewer"]
    r = _with(strict, token, None, "POST", "/ui/logout", headers=here)
    assert r.status_code == 403 and "X-CSRF-Token" in r.json()["error"]
    assert _with(strict, token, session.csrf_token, "POST", "/ui/logout",
                 headers=here).status_code == 200


_FORM = "application/x-www-form-urlencoded"


def test_an_unreadable_users_file_refuses_sessions_with_503(signed_in, store):
    client, sessions = signed_in
    token, session = sessions["admin"]
    store.path.write_bytes(b"not a database" * 512)
    for wal in store.path.parent.glob("users.sqlite-*"):
        wal.unlink()
    r = _with(client, token, session.csrf_token, json={})
    assert r.status_code == 503 and "cannot be read" in r.json()["error"]
    assert r.headers["retry-after"] == "5"
