"""Who may call what on a real server (docs/security.md): on the default bind (0.0.0.0, no token)
protected routes need the admin token the server made for itself while inference stays open;
on a loopback bind the cross-site checks still hold (a web page's request to the guard runs
nothing); tokens, forwarded headers, nested JSON and gRPC's listening addresses.

Servers bound to 0.0.0.0 are only ever reached over 127.0.0.1: the rule is about the bind address,
not the client's."""

from __future__ import annotations

import json
import socket
import stat
import sys
import time

import httpx
import pytest
from conftest import TINY_TOML, make_tiny_model, start_server, wait_for

TOML = TINY_TOML + """\
[verdict]
ok_labels = ["ok", "dent", "scratch"]
ok_threshold = 0.0
"""


def _png() -> bytes:
    import cv2
    import numpy as np

    return cv2.imencode(".png", np.full((32, 32, 3), 90, np.uint8))[1].tobytes()


def _put_verdict(server, value: float, headers: dict | None = None) -> httpx.Response:
    return httpx.put(f"{server.url}/v1/models/tiny/verdict", json={"ok_threshold": value},
                     headers=headers or {}, timeout=30)


def _audits(server, action: str = "verdict") -> list[dict]:
    """The audit lines of ``action`` in the server's JSON log."""
    lines = [json.loads(x) for x in server.log().splitlines() if x.startswith("{")]
    return [x["audit"] for x in lines if x.get("audit", {}).get("action") == action]


def _nested(depth: int = 100_000) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.fixture
def repo(tmp_path):
    make_tiny_model(tmp_path / "repo" / "tiny", TOML)
    return tmp_path / "repo"


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_default_bind_protects_changes_and_keeps_inference_open(repo, tmp_path, frontends):
    data = tmp_path / "data"
    server = start_server(repo, tmp_path, "--host", "0.0.0.0", "--log-json", "--frontends",
                          frontends, "--model-control-mode", "explicit",
                          env={"XDG_DATA_HOME": str(data)})
    try:
        toml = (repo / "tiny" / "model.toml").read_text()
        # the reproduction: every label OK, threshold 0, no credential
        r = _put_verdict(server, 0.5)
        assert r.status_code == 401 and "admin token" in r.json()["error"], r.text
        assert (repo / "tiny" / "model.toml").read_text() == toml
        # the token the server made: 0600 in the data directory, named in the log, never shown
        token_file = data / "visionserve" / "admin-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert str(token_file) in server.log() and token not in server.log()
        assert "access: protected" in server.log()
        admin = {"Authorization": f"Bearer {token}"}
        for _ in range(4):  # every front-end process has the same token
            r = _put_verdict(server, 0.5, {**admin, "X-Operator": "qe-anna",
                                           "X-Forwarded-For": "203.0.113.9"})
            assert r.status_code == 200, r.text
        assert "ok_threshold = 0.5" in (repo / "tiny" / "model.toml").read_text()
        # the audit names the credential; X-Operator is what the client says; X-Forwarded-For
        # from a proxy nobody named changes nothing
        audit = wait_for(lambda: _audits(server), what="the audit line")[0]
        assert audit["caller"]["operator"] == "admin-token"
        assert audit["caller"]["operator_declared"] == "qe-anna"
        assert audit["caller"]["client"].startswith("127.0.0.1:")
        # inference needs nothing
        r = httpx.post(f"{server.url}/v1/models/tiny/inspect", content=_png(),
                       headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/v2/models/tiny/config", timeout=10).status_code == 200
        # records, guard, docs: protected (docs are off: 404 even with the token)
        for path in ("/v1/parts/A-1", "/v1/guard/jobs", "/openapi.json", "/docs"):
            assert httpx.get(server.url + path, timeout=10).status_code == 401, path
        assert httpx.get(server.url + "/openapi.json", headers=admin, timeout=10).status_code == 404
        # the console: its pages behind the admin token (rendered in whichever process takes
        # the connection), its style sheet and script open
        for path in ("/ui", "/ui/live", "/ui/models", "/ui/stations", "/ui/system"):
            assert httpx.get(server.url + path, timeout=10).status_code == 401, path
        for _ in range(4):
            page = httpx.get(server.url + "/ui/system", headers=admin, timeout=30)
            assert page.status_code == 200 and "System" in page.text, page.text
            assert ("2 of 2 alive" if frontends == "2" else "run in the serving process") \
                in page.text
        assert httpx.get(server.url + "/ui/models", headers=admin, timeout=30).status_code == 200
        for name in ("console.css", "console.js", "live.css", "live.js"):
            assert httpx.get(f"{server.url}/ui/static/{name}", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/ui/static/nothing.js", timeout=10).status_code == 404
        # nested JSON is a bad request
        r = httpx.post(f"{server.url}/v2/repository/index", content=_nested(), timeout=30,
                       headers={**admin, "Content-Type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"], r.text
        # gRPC: the repository behind the admin token, inference open
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.get_model_metadata("tiny").name == "tiny"
        with pytest.raises(InferenceServerException) as err:
            client.unload_model("tiny")
        assert "UNAUTHENTICATED" in str(err.value.status()) and "admin token" in str(err.value)
        assert client.is_model_ready("tiny")
        client.get_model_repository_index(headers={"authorization": f"Bearer {token}"})
    finally:
        server.stop()
    # the next start reuses the token
    again = start_server(repo, tmp_path, "--host", "0.0.0.0", env={"XDG_DATA_HOME": str(data)},
                         grpc=False)
    try:
        assert token_file.read_text().strip() == token
        assert _put_verdict(again, 0.25, admin).status_code == 200
        assert _put_verdict(again, 0.25).status_code == 401
    finally:
        again.stop()


def test_grpc_listens_on_ipv4_only_for_0_0_0_0(repo, tmp_path):
    """HTTP on 0.0.0.0 is IPv4 only; gRPC was on every IPv6 address too."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    server = start_server(repo, tmp_path, "--host", "0.0.0.0",
                          env={"XDG_DATA_HOME": str(tmp_path / "data")})
    try:
        for port in (server.http_port, server.grpc_port):
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
            with socket.socket(socket.AF_INET6) as s6:
                s6.settimeout(5)
                try:
                    s6.connect(("::1", port))
                except OSError:
                    continue
                pytest.fail(f"port {port} answers on ::1")
    finally:
        server.stop()


def _guard_job(marker) -> bytes:
    return json.dumps({"name": "probe", "command": [
        sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ran')"]}).encode()


def test_a_web_page_cannot_drive_a_loopback_server(repo, tmp_path):
    """The issue's reproduction on the documented "this machine only" mode: what a browser
    sends without a preflight (text/plain, a foreign Origin, a rebound Host) is refused, and
    the command never runs."""
    marker = tmp_path / "ran.txt"
    db = tmp_path / "guard.sqlite"
    server = start_server(repo, tmp_path, "--guard", "--guard-db", str(db), "--log-json",
                          "--model-control-mode", "explicit", grpc=False)
    url = server.url
    browser = {"Content-Type": "text/plain;charset=UTF-8", "Origin": "http://evil.example",
               "Host": f"evil.example:{server.http_port}"}
    try:
        r = httpx.post(url + "/v1/guard/jobs", content=_guard_job(marker), headers=browser)
        assert r.status_code == 403 and "allowed_hosts" in r.json()["error"], r.text
        one_at_a_time = [
            ({"Host": f"evil.example:{server.http_port}"}, 403, "allowed_hosts"),
            ({"Origin": "http://evil.example"}, 403, "allowed_origins"),
            ({"Content-Type": "text/plain;charset=UTF-8"}, 415, "JSON"),
            ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "JSON"),
        ]
        for headers, status, words in one_at_a_time:
            r = httpx.post(url + "/v1/guard/jobs", content=_guard_job(marker),
                           headers={"Content-Type": "application/json", **headers})
            assert r.status_code == status and words in r.json()["error"], (headers, r.text)
        # the same for the repository and the recipes
        r = httpx.post(url + "/v2/repository/models/tiny/unload", content=b"{}",
                       headers={"Content-Type": "text/plain"})
        assert r.status_code == 415, r.text
        r = httpx.post(url + "/v1/stations/st1/recipe", content=b'{"recipe": "a"}',
                       headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert r.status_code == 403, r.text
        assert httpx.get(url + "/v2/models/tiny/ready").status_code == 200
        time.sleep(1.0)  # a queued job would have started by now
        assert not marker.exists()
        from visionserve.guard.store import JobStore

        assert JobStore(str(db)).list(None) == []
        # nested JSON to the guard and the verdict: 400, not 500
        for path, method in (("/v1/guard/jobs", "POST"), ("/v1/models/tiny/verdict", "PUT")):
            r = httpx.request(method, url + path, content=_nested(50_000),
                              headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code == 400, (path, r.text)
        # the server's own clients still work: a JSON job from this machine, an unload
        # without a body (curl -X POST), tritonclient's load (a JSON body, no Content-Type)
        r = httpx.post(url + "/v1/guard/jobs", content=_guard_job(marker),
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 201, r.text
        wait_for(marker.exists, timeout=60, what="the job to run")
        r = httpx.post(url + "/v2/repository/models/tiny/unload")
        assert r.status_code == 200, r.text
        import tritonclient.http as httpclient

        httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}").load_model("tiny")
        assert httpx.get(url + "/v2/models/tiny/ready").status_code == 200
        # on a loopback bind the operator is "loopback"
        r = _put_verdict(server, 0.5, {"X-Operator": "someone"})
        assert r.status_code == 200, r.text
        audit = wait_for(lambda: _audits(server), what="the audit line")[0]
        assert (audit["caller"]["operator"], audit["caller"]["operator_declared"]) \
            == ("loopback", "someone")
    finally:
        server.stop()


def test_console_pages_and_files_refuse_a_foreign_host_or_origin(repo, tmp_path):
    """A loopback bind opens the console's pages to this machine; a rebound Host or a foreign
    Origin is refused on them and on its files; --no-console serves neither."""
    server = start_server(repo, tmp_path, grpc=False)
    try:
        for path in ("/ui/models", "/ui/static/console.js"):
            assert httpx.get(server.url + path, timeout=30).status_code == 200, path
            for headers, words in (({"Host": f"evil.example:{server.http_port}"}, "allowed_hosts"),
                                   ({"Origin": "http://evil.example"}, "allowed_origins")):
                r = httpx.get(server.url + path, headers=headers, timeout=10)
                assert r.status_code == 403 and words in r.json()["error"], (path, r.text)
        page = httpx.get(server.url + "/ui/models", timeout=30)
        assert "default-src 'self'" in page.headers["content-security-policy"]
    finally:
        server.stop()
    off = start_server(repo, tmp_path, "--no-console", grpc=False)
    try:
        for path in ("/ui", "/ui/models", "/ui/static/console.css"):
            assert httpx.get(off.url + path, timeout=10).status_code == 404, path
    finally:
        off.stop()


def test_forwarded_for_only_from_trusted_proxies(repo, tmp_path):
    server = start_server(repo, tmp_path, "--log-json", "--trusted-proxies", "127.0.0.1",
                          grpc=False)
    try:
        r = _put_verdict(server, 0.5, {"X-Forwarded-For": "203.0.113.9"})
        assert r.status_code == 200, r.text
        audit = wait_for(lambda: _audits(server), what="the audit line")[0]
        assert audit["caller"]["client"].startswith("203.0.113.9:")
    finally:
        server.stop()


def test_non_ascii_tokens(repo, tmp_path):
    """HTTP headers travel as bytes: a UTF-8 token is compared as its UTF-8 bytes."""
    token, admin = "Zürich-Straße-7", "Bühne-ädmin-9"
    server = start_server(repo, tmp_path, "--host", "0.0.0.0", "--auth-token", token,
                          "--admin-token", admin, grpc=False,
                          env={"XDG_DATA_HOME": str(tmp_path / "data")})
    try:
        def inspect(value: bytes | None) -> int:
            headers: dict = {"Content-Type": "image/png"}
            if value is not None:
                headers["Authorization"] = b"Bearer " + value
            return httpx.post(f"{server.url}/v1/models/tiny/inspect", content=_png(),
                              headers=headers, timeout=30).status_code

        assert inspect(token.encode()) == 200
        assert inspect(admin.encode()) == 200  # the admin token opens inference too
        assert inspect(b"Zurich-Strasse-7") == 401
        assert inspect(None) == 401
        assert _put_verdict(server, 0.5, {"Authorization": b"Bearer " + admin.encode()}) \
            .status_code == 200
        r = _put_verdict(server, 0.5, {"Authorization": b"Bearer " + token.encode()})
        assert r.status_code == 403 and "inference token does not open" in r.json()["error"]
        assert not (tmp_path / "data" / "visionserve" / "admin-token").exists()
    finally:
        server.stop()


def test_grpc_repository_on_a_loopback_bind_needs_no_admin_token(repo, tmp_path):
    server = start_server(repo, tmp_path, "--model-control-mode", "explicit")
    try:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.get_model_repository_index().models[0].name == "tiny"
    finally:
        server.stop()
