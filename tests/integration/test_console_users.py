"""The console's users on a real server (docs/security.md, "Users and the console's sign-in"):
`visionserve users` against a real data directory, the sign-in form and its cookie, failed
sign-ins slowed down, roles on protected routes, CSRF, sign-out, and sessions shared by
`--frontends 2` processes. Servers bind 0.0.0.0 (protected routes need a credential) and are
reached over 127.0.0.1; each test signs in from its own X-Forwarded-For address (the server
trusts 127.0.0.1 as a proxy), so that the failed-login counters of one never slow another."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import REPO, TINY_TOML, make_tiny_model, start_server, wait_for

from tests.integration.test_frontends import children

TOML = TINY_TOML + """\
[verdict]
ok_labels = ["ok"]
ok_threshold = 0.0
"""
PASSWORD = "line 4 quality pass"
USERS = {"otto": "viewer", "qe-anna": "quality", "max": "admin"}


def users_cmd(data, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "visionserve", "users", *args],
                          input=stdin, capture_output=True, text=True, timeout=120, cwd=REPO,
                          check=False, env={**_env(data), "PYTHONPATH": str(REPO)})


def _env(data) -> dict[str, str]:
    import os

    return {**os.environ, "XDG_DATA_HOME": str(data)}


def add_users(data) -> None:
    for name, role in USERS.items():
        r = users_cmd(data, "add", name, "--role", role, "--password-file", "-",
                      stdin=PASSWORD + "\n")
        assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console-users")
    make_tiny_model(tmp / "repo" / "tiny", TOML)
    add_users(tmp / "data")
    s = start_server(tmp / "repo", tmp, "--host", "0.0.0.0", "--trusted-proxies", "127.0.0.1",
                     "--model-control-mode", "explicit", "--log-json", grpc=False,
                     env={"XDG_DATA_HOME": str(tmp / "data")})
    s.repo = tmp / "repo"
    yield s
    s.stop()


def sign_in(server, user: str, password: str = PASSWORD, address: str = "198.51.100.1",
            **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/ui/login", data={"user": user, "password": password},
                      headers={"X-Forwarded-For": address, **headers}, timeout=30)


def session_client(server, user: str, address: str) -> tuple[httpx.Client, str]:
    """A client with ``user``'s session cookie, and the session's CSRF token."""
    r = sign_in(server, user, address=address)
    assert r.status_code == 200, r.text
    client = httpx.Client(base_url=server.url, timeout=30,
                          cookies={"visionserve_session": r.cookies["visionserve_session"]})
    return client, r.json()["csrf_token"]


def quality_session(server, address: str) -> Iterator[httpx.Client]:
    """(a module fixture's body) qe-anna's session, its CSRF token sent with every request."""
    client, csrf = session_client(server, "qe-anna", address)
    client.headers["X-CSRF-Token"] = csrf
    yield client
    client.close()


def _audits(server) -> list[dict]:
    return [json.loads(x)["audit"] for x in server.log().splitlines()
            if x.startswith("{") and '"audit"' in x]


def test_the_cli_manages_users_in_the_data_directory(tmp_path):
    data = tmp_path / "data"
    secret = tmp_path / "secret"
    secret.write_text(PASSWORD + "\n")
    r = users_cmd(data, "list")
    assert r.returncode == 0 and "no users" in r.stdout
    r = users_cmd(data, "add", "qe-anna", "--role", "quality", "--password-file", str(secret))
    assert r.returncode == 0 and "added qe-anna (quality)" in r.stdout, r.stderr
    db = data / "visionserve" / "users.sqlite"
    assert db.is_file() and oct(db.stat().st_mode & 0o777) == "0o600"
    assert PASSWORD.encode() not in db.read_bytes()
    r = users_cmd(data, "add", "otto", "--role", "viewer", "--password-file", "-",
                  stdin=PASSWORD + "\n")
    assert r.returncode == 0, r.stderr
    r = users_cmd(data, "list")
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["NAME", "ROLE"]
    assert [ln.split()[:2] for ln in lines[1:]] == [["otto", "viewer"], ["qe-anna", "quality"]]
    # no terminal and no file: a clear refusal, nothing added
    r = users_cmd(data, "add", "eve", "--role", "admin", stdin="")
    assert r.returncode == 2 and "--password-file" in r.stderr
    # a password on the command line is no option at all
    r = users_cmd(data, "add", "eve", "--role", "admin", "--password", PASSWORD)
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr
    r = users_cmd(data, "add", "otto", "--role", "admin", "--password-file", str(secret))
    assert r.returncode == 1 and "exists" in r.stderr
    r = users_cmd(data, "add", "eve", "--role", "operator", "--password-file", str(secret))
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = users_cmd(data, "passwd", "otto", "--password-file", "-", stdin="short\n")
    assert r.returncode == 2 and "8 to 1024" in r.stderr
    assert users_cmd(data, "role", "otto", "quality").returncode == 0
    assert users_cmd(data, "passwd", "otto", "--password-file", "-",
                     stdin="a new password\n").returncode == 0
    assert users_cmd(data, "remove", "qe-anna").returncode == 0
    r = users_cmd(data, "remove", "qe-anna")
    assert r.returncode == 1 and "no user 'qe-anna'" in r.stderr
    assert [ln.split()[:2] for ln in users_cmd(data, "list").stdout.splitlines()[1:]] == [
        ["otto", "quality"]]
    r = users_cmd(data, "--help")
    assert r.returncode == 0 and "never taken from the command line" in r.stdout


def test_sign_in_sets_the_session_cookie(server):
    page = httpx.get(f"{server.url}/ui/login", timeout=10)
    assert page.status_code == 200 and '<form method="post" action="/ui/login">' in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "http" not in page.text.split("<form")[0].replace("http-equiv", "")  # no assets
    r = sign_in(server, "otto", address="198.51.100.10")
    assert r.status_code == 200, r.text
    cookie = r.headers["set-cookie"]
    attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")}
    assert {"httponly", "path", "max-age", "samesite"} <= attributes and "secure" not in attributes
    assert "SameSite=strict" in cookie or "samesite=strict" in cookie.lower()
    assert "Max-Age=28800" in cookie and "Path=/" in cookie
    body = r.json()
    assert body["user"] == "otto" and body["role"] == "viewer" and body["expires_in_s"] > 28000
    token = r.cookies["visionserve_session"]
    r = httpx.get(f"{server.url}/ui/session", cookies={"visionserve_session": token}, timeout=10)
    assert r.status_code == 200 and r.json()["csrf_token"] == body["csrf_token"]
    assert httpx.get(f"{server.url}/ui/session", timeout=10).status_code == 401
    # over TLS (here: a trusted proxy's X-Forwarded-Proto) the cookie is Secure
    r = sign_in(server, "otto", address="198.51.100.10", **{"X-Forwarded-Proto": "https"})
    assert "secure" in r.headers["set-cookie"].lower()
    # a browser's form is sent on to the console
    r = sign_in(server, "otto", address="198.51.100.10", Accept="text/html")
    assert r.status_code == 303 and r.headers["location"] == "/ui"
    assert PASSWORD not in server.log()
    # other bodies: 415; a missing field: 400
    r = httpx.post(f"{server.url}/ui/login", content=b"user=otto",
                   headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 415, r.text
    r = httpx.post(f"{server.url}/ui/login", json={"user": "otto"}, timeout=10)
    assert r.status_code == 400 and "password" in r.json()["error"]


def test_a_failed_sign_in_never_says_whether_the_user_exists(server):
    known = sign_in(server, "otto", "wrong password", address="198.51.100.20")
    unknown = sign_in(server, "nobody", "wrong password", address="198.51.100.21")
    assert known.status_code == unknown.status_code == 401
    assert known.json() == unknown.json() == {"error": "wrong user name or password"}
    assert "set-cookie" not in known.headers
    page = sign_in(server, "nobody", "wrong password", address="198.51.100.22", Accept="text/html")
    assert page.status_code == 401 and "wrong user name or password" in page.text


def test_repeated_failures_are_slowed_down(server):
    address = "198.51.100.30"
    for _ in range(3):
        assert sign_in(server, "qe-anna", "guess", address=address).status_code == 401
    r = sign_in(server, "qe-anna", address=address)  # even the right password must wait
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert "too many failed sign-ins" in r.json()["error"]
    # the user name is slowed down from another address too; the address for another name
    assert sign_in(server, "qe-anna", address="198.51.100.31").status_code == 429
    assert sign_in(server, "max", "guess", address=address).status_code == 429
    time.sleep(int(r.headers["retry-after"]) + 0.2)
    assert sign_in(server, "qe-anna", "guess", address=address).status_code == 401
    r = sign_in(server, "qe-anna", address=address)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 2  # growing
    time.sleep(int(r.headers["retry-after"]) + 0.2)
    assert sign_in(server, "qe-anna", address=address).status_code == 200


def test_roles_decide_and_the_audit_names_the_user(server):
    toml = server.repo / "tiny" / "model.toml"
    before = toml.read_text()
    viewer, viewer_csrf = session_client(server, "otto", "198.51.100.40")
    r = viewer.put("/v1/models/tiny/verdict", json={"ok_threshold": 0.5},
                   headers={"X-CSRF-Token": viewer_csrf})
    assert r.status_code == 403 and "needs the role quality" in r.json()["error"], r.text
    assert toml.read_text() == before
    quality, csrf = session_client(server, "qe-anna", "198.51.100.41")
    r = quality.put("/v1/models/tiny/verdict", json={"ok_threshold": 0.5},
                    headers={"X-CSRF-Token": csrf, "X-Operator": "someone else"})
    assert r.status_code == 200, r.text
    assert "ok_threshold = 0.5" in toml.read_text()
    audit = wait_for(lambda: _audits(server), what="the audit line")[-1]
    assert audit["caller"]["operator"] == "qe-anna"
    assert audit["caller"]["operator_declared"] == "someone else"
    r = quality.post("/v2/repository/models/tiny/unload", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 403 and "needs the role admin" in r.json()["error"]
    admin, admin_csrf = session_client(server, "max", "198.51.100.42")
    for action in ("unload", "load"):
        r = admin.post(f"/v2/repository/models/tiny/{action}",
                       headers={"X-CSRF-Token": admin_csrf})
        assert r.status_code == 200, (action, r.text)
    wait_for(lambda: httpx.get(f"{server.url}/v2/models/tiny/ready").status_code == 200,
             what="the model to load")
    # without a session nothing changes (0.0.0.0: the admin token is asked for)
    r = httpx.put(f"{server.url}/v1/models/tiny/verdict", json={"ok_threshold": 0.1}, timeout=10)
    assert r.status_code == 401 and "admin token" in r.json()["error"]


def test_a_change_without_the_csrf_token_is_refused(server):
    toml = server.repo / "tiny" / "model.toml"
    before = toml.read_text()
    quality, csrf = session_client(server, "qe-anna", "198.51.100.50")
    for headers in ({}, {"X-CSRF-Token": "forged"}, {"X-CSRF-Token": csrf[:-1]}):
        r = quality.put("/v1/models/tiny/verdict", json={"ok_threshold": 0.9}, headers=headers)
        assert r.status_code == 403 and "CSRF token" in r.json()["error"], (headers, r.text)
    assert toml.read_text() == before


def test_sign_out_ends_the_session(server):
    quality, csrf = session_client(server, "qe-anna", "198.51.100.60")
    assert quality.post("/ui/logout").status_code == 403  # a change: the CSRF token
    r = quality.post("/ui/logout", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200 and r.json() == {"signed_out": "qe-anna"}
    assert "max-age=0" in r.headers["set-cookie"].lower()
    # the old cookie, sent again, opens nothing
    assert quality.get("/ui/session").status_code == 401
    r = quality.put("/v1/models/tiny/verdict", json={"ok_threshold": 0.2},
                    headers={"X-CSRF-Token": csrf})
    assert r.status_code == 401 and "sign in again" in r.json()["error"]


def _front_ends(server) -> list[int]:
    kids = children(server.proc.pid)
    return [k for k in kids
            if b"visionserve.runtime.frontend" in Path(f"/proc/{k}/cmdline").read_bytes()]


@contextmanager
def only(front_end: int, others: list[int]):
    """Every other front end stopped (SIGSTOP): new connections reach ``front_end`` only."""
    stopped = [p for p in others if p != front_end]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


def test_sessions_hold_in_every_front_end_and_a_server_without_users_is_unchanged(tmp_path):
    """--frontends 2: a session made in one process is valid in the other, and its end ends it
    in both. The server starts with no users (the rules as without the console) and takes the
    ones `visionserve users` adds while it runs."""
    make_tiny_model(tmp_path / "repo" / "tiny", TOML)
    data = tmp_path / "data"
    s = start_server(tmp_path / "repo", tmp_path, "--host", "0.0.0.0", "--frontends", "2",
                     grpc=False, env={"XDG_DATA_HOME": str(data)})
    try:
        assert "console sign-in: no users" in s.log()
        assert sign_in(s, "qe-anna").status_code == 401
        assert "set-cookie" not in sign_in(s, "qe-anna").headers
        r = httpx.put(f"{s.url}/v1/models/tiny/verdict", json={"ok_threshold": 0.5},
                      cookies={"visionserve_session": "anything"}, timeout=10)
        assert r.status_code == 401 and "admin token" in r.json()["error"]
        add_users(data)
        first, second = fronts = _front_ends(s)
        assert len(fronts) == 2
        with only(first, fronts):
            # X-Forwarded-Proto from a proxy nobody named: not TLS, no Secure
            r = sign_in(s, "qe-anna", **{"X-Forwarded-Proto": "https"})
            assert r.status_code == 200 and "secure" not in r.headers["set-cookie"].lower()
            token = r.cookies["visionserve_session"]
        cookies = {"visionserve_session": token}
        with only(second, fronts):
            r = httpx.get(f"{s.url}/ui/session", cookies=cookies, timeout=10)
            assert r.status_code == 200 and r.json()["user"] == "qe-anna", r.text
        csrf = r.json()["csrf_token"]
        r = httpx.put(f"{s.url}/v1/models/tiny/verdict", json={"ok_threshold": 0.5},
                      cookies=cookies, headers={"X-CSRF-Token": csrf}, timeout=30)
        assert r.status_code == 200, r.text
        with only(second, fronts):
            r = httpx.post(f"{s.url}/ui/logout", cookies=cookies, headers={"X-CSRF-Token": csrf},
                           timeout=10)
            assert r.status_code == 200
        with only(first, fronts):
            assert httpx.get(f"{s.url}/ui/session", cookies=cookies, timeout=10).status_code == 401
            r = httpx.put(f"{s.url}/v1/models/tiny/verdict", json={"ok_threshold": 0.25},
                          cookies=cookies, headers={"X-CSRF-Token": csrf}, timeout=10)
            assert r.status_code == 401 and "sign in again" in r.json()["error"]
    finally:
        s.stop()


def test_over_tls_the_cookie_is_secure(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    make_tiny_model(tmp_path / "repo" / "tiny", TOML)
    add_users(tmp_path / "data")
    s = start_server(tmp_path / "repo", tmp_path, "--tls-cert", str(cert), "--tls-key", str(key),
                     grpc=False, wait=False, env={"XDG_DATA_HOME": str(tmp_path / "data")})
    url = f"https://127.0.0.1:{s.http_port}"
    ctx = ssl.create_default_context(cafile=str(cert))
    try:
        wait_for(lambda: _ready(url, ctx), timeout=120, what="the TLS server")
        r = httpx.post(f"{url}/ui/login", data={"user": "otto", "password": PASSWORD},
                       verify=ctx, timeout=30)
        assert r.status_code == 200, r.text
        assert "secure" in {a.strip().lower() for a in r.headers["set-cookie"].split(";")}
    finally:
        s.stop()


def _ready(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        return httpx.get(url + "/v2/health/ready", verify=ctx, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_every_role_reads_the_console_pages_and_acts_by_its_role(server):
    """The /ui pages open to a signed-in user of any role (and to nobody without a credential
    on this 0.0.0.0 bind); an action from a page is judged by the role its route needs: a viewer
    and a quality user cannot unload a model, an admin can (and loads it back)."""
    for path in ("/ui", "/ui/live", "/ui/models", "/ui/stations", "/ui/system"):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 401, path
    for n, user in enumerate(USERS):
        client, csrf = session_client(server, user, f"198.51.100.{120 + n}")
        with client:
            for path in ("/ui", "/ui/live", "/ui/models", "/ui/stations", "/ui/system"):
                r = client.get(path, follow_redirects=True)
                assert r.status_code == 200 and "text/html" in r.headers["content-type"], \
                    (user, path, r.status_code)
            r = client.post("/v2/repository/models/tiny/unload", json={},
                            headers={"X-CSRF-Token": csrf})
            if USERS[user] == "admin":
                assert r.status_code == 200, r.text
                assert client.post("/v2/repository/models/tiny/load", json={},
                                   headers={"X-CSRF-Token": csrf}).status_code == 200
            else:
                assert r.status_code == 403 and "needs the role admin" in r.json()["error"], \
                    (user, r.text)


def test_a_viewer_reads_the_line_live_page_and_what_it_polls(server):
    """The Line live page and the summary its script reads every few seconds: a viewer's
    session opens both; without a credential (this 0.0.0.0 bind) both are 401."""
    for path in ("/ui/live", "/ui/live?model=tiny", "/v1/live/summary?model=tiny"):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 401, path
    client, _ = session_client(server, "otto", "198.51.100.140")
    with client:
        page = client.get("/ui/live?model=tiny")
        assert page.status_code == 200 and "<h1>Line live</h1>" in page.text, page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        summary = client.get("/v1/live/summary", params={"model": "tiny", "minutes": 10})
        assert summary.status_code == 200 and len(summary.json()["minutes"]) == 10, summary.text
        assert client.get("/ui/live?model=nope").status_code == 404
