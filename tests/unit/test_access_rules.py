"""The access rules of visionserve.security: the route table, who passes, the cross-site
checks, and the admin token a server makes for itself."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from visionserve.audit import AuditTrail
from visionserve.config import ServerSettings
from visionserve.errors import ConfigError
from visionserve.security import (
    ADMIN,
    ROUTES,
    SIGNIN,
    STATIC,
    Access,
    HttpSecurity,
    classify,
    is_loopback,
    route_of,
    with_admin_token,
)
from visionserve.users.store import QUALITY, VIEWER


@pytest.mark.parametrize("host, local", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False), ("line-pc.plant", False),
])
def test_is_loopback(host, local):
    assert is_loopback(host) is local


def test_every_route_of_the_app_is_in_the_table():
    """A new route must be classified: none of the server's routes falls to the default."""
    from visionserve.console.pages import make_router as console_router
    from visionserve.guard.http import make_router as guard_router
    from visionserve.http.app import create_app
    from visionserve.loop.http import make_router as loop_router
    from visionserve.loop.shadow import Shadows
    from visionserve.records.http import make_router as records_router
    from visionserve.records.images import ImageSource

    settings = ServerSettings(api_docs=True)
    console = console_router(settings)
    images = ImageSource(Path("/nonexistent"))
    app = create_app(None, settings, (guard_router(None, AuditTrail.from_settings(settings)),
                                      records_router(None, images),
                                      loop_router(None, images, None, Shadows()), console))
    schema = app.openapi()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    routes += [("GET", p) for p in ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc",
                                    "/openapi.json")]
    # the console's pages are no API: outside the OpenAPI document, in the table all the same
    pages = [(m, r.path) for r in console.routes for m in sorted(r.methods)]
    assert len(pages) == 11, pages
    routes += pages
    for method, path in routes:
        assert any(r.matches(method, path) for r in ROUTES), (method, path)
    assert len(routes) >= 35
    put = schema["paths"]["/v1/models/{model_name}/verdict"]["put"]["responses"]
    assert {"401", "403", "415"} <= set(put)
    assert "401" not in schema["paths"]["/v2/models/{model_name}/infer"]["post"]["responses"]


@pytest.mark.parametrize("method, path, kind", [
    ("PUT", "/v1/models/m/verdict", ADMIN), ("GET", "/v1/models/m/verdict", "inference"),
    ("POST", "/v2/repository/models/m/unload", ADMIN), ("GET", "/v1/guard/jobs/3/logs", ADMIN),
    ("GET", "/v1/parts/A-1", ADMIN), ("GET", "/openapi.json", ADMIN), ("GET", "/docs", ADMIN),
    ("GET", "/v1/live", ADMIN), ("GET", "/v1/live/summary", ADMIN),
    ("POST", "/v1/stations/s/recipe", ADMIN), ("GET", "/v1/stations/s", "inference"),
    ("POST", "/v1/models/m/inspect", "inference"), ("HEAD", "/v2/health/ready", "health"),
    ("GET", "/metrics", "metrics"), ("GET", "/nowhere", ADMIN), ("DELETE", "/v2/models/m", ADMIN),
    ("GET", "/ui", ADMIN), ("GET", "/ui/live", ADMIN), ("GET", "/ui/models", ADMIN),
    ("GET", "/ui/stations", ADMIN), ("GET", "/ui/parts", ADMIN), ("GET", "/ui/parts/P-1", ADMIN),
    ("GET", "/v1/records/7/image", ADMIN), ("GET", "/v1/records/7/overlay", ADMIN),
    ("GET", "/v1/records/7/8/image", ADMIN),
    ("GET", "/ui/system", ADMIN), ("HEAD", "/ui/system", ADMIN),
    ("GET", "/ui/static/console.css", STATIC),
    ("GET", "/ui/static/a/b.js", ADMIN), ("POST", "/ui/static/console.js", ADMIN),
    ("GET", "/ui/session", SIGNIN), ("GET", "/ui/nowhere", ADMIN),
    ("GET", "/v1/audit", ADMIN), ("GET", "/ui/audit", ADMIN), ("POST", "/v1/audit", ADMIN),
    ("POST", "/v1/models/m/candidates/c-1/promote", ADMIN),
    ("POST", "/v1/models/m/rollback", ADMIN), ("GET", "/v1/models/m/rollback", ADMIN),
    ("GET", "/ui/models/m/candidates", ADMIN),
])
def test_classify(method, path, kind):
    assert classify(method, path) == kind


def test_promotion_and_rollback_are_quality_work():
    for method, path in (("POST", "/v1/models/m/candidates/c-1/promote"),
                         ("POST", "/v1/models/m/rollback"), ("GET", "/ui/models/m/candidates")):
        route = route_of(method, path)
        assert route is not None and route.role == QUALITY, path


def test_a_part_id_may_hold_slashes_and_stays_a_viewers_page():
    """``{name:path}`` takes the rest of the path: a part id such as ``2026/12/A-1`` is still
    the part's page (open to viewers), and nothing past another route's own segment is."""
    for path in ("/ui/parts/2026/12/A-1", "/v1/parts/2026/12/A-1"):
        route = route_of("GET", path)
        assert route is not None and route.role == VIEWER, path
    assert route_of("GET", "/ui/parts/") is None  # no part id: no route
    assert classify("GET", "/v1/records/7/8/image") == ADMIN  # one segment only there


def test_the_audit_trail_opens_to_quality_and_admin():
    """Who changed what names people and addresses: viewers (operators) do not read it."""
    for path in ("/v1/audit", "/ui/audit"):
        route = route_of("GET", path)
        assert route is not None and route.role == "quality", path
    assert route_of("POST", "/v1/audit") is None  # no route writes it: protected, admin


HOSTS_OF_ASSETS = frozenset({"localhost"})


async def _ok(scope, receive, send):
    await PlainTextResponse(scope.get("visionserve.identity") or "ok")(scope, receive, send)


@pytest.mark.parametrize("metrics_open", [True, False])
def test_open_paths_with_the_inference_token(metrics_open):
    client = TestClient(HttpSecurity(_ok, Access(token=b"secret", admin_required=False,
                                                 metrics_open=metrics_open)))
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/metrics").status_code == (200 if metrics_open else 401)
    assert client.get("/v2/models/m").status_code == 401
    assert client.get("/v2/models/m", headers={"Authorization": "Bearer secret"}).status_code == 200


@pytest.mark.parametrize("access", [
    Access(token=b"infer", admin_token=b"adm", hosts=HOSTS_OF_ASSETS),
    Access(token=b"infer", admin_required=False, hosts=HOSTS_OF_ASSETS),
])
def test_console_assets_are_open_but_host_and_origin_checked(access):
    """The console's style sheet and script need no token (a browser sends none for them);
    its pages are protected routes; the Host and Origin checks hold for both."""
    client = TestClient(HttpSecurity(_ok, access))
    here = {"Host": "localhost:8000"}
    assert client.get("/ui/static/console.css", headers=here).status_code == 200
    assert client.get("/ui/models", headers=here).status_code == 401
    assert client.get("/ui/models", headers={**here, "Authorization": "Bearer adm"}
                      ).status_code == (200 if access.admin_token else 401)
    for headers, words in (({"Host": "evil.example:8000"}, "allowed_hosts"),
                           ({**here, "Origin": "http://evil.example"}, "allowed_origins")):
        for path in ("/ui/static/console.js", "/ui/system"):
            r = client.get(path, headers={**headers, "Authorization": "Bearer adm"})
            assert r.status_code == 403 and words in r.json()["error"], (path, r.text)


def test_protected_routes_need_the_admin_token_off_loopback():
    client = TestClient(HttpSecurity(_ok, Access(token=b"infer", admin_token=b"adm", hosts=None)))
    path = "/v1/models/m/verdict"
    r = client.put(path, json={})
    assert r.status_code == 401 and "admin token" in r.json()["error"]
    r = client.put(path, json={}, headers={"Authorization": "Bearer infer"})
    assert r.status_code == 403 and "inference token does not open" in r.json()["error"]
    r = client.put(path, json={}, headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200 and r.text == "admin-token"
    # admin passes where the inference token is asked for
    assert client.get("/v2/models/m", headers={"Authorization": "Bearer adm"}).status_code == 200
    assert client.get("/v2/models/m", headers={"Authorization": "Bearer infer"}).status_code == 200


def test_loopback_bind_opens_protected_routes_to_this_machine():
    client = TestClient(HttpSecurity(_ok, Access(admin_required=False, hosts=None)))
    r = client.put("/v1/models/m/verdict", json={})
    assert r.status_code == 200 and r.text == "loopback"


def test_a_non_ascii_token_matches_its_utf8_bytes():
    token = "Zürich-Straße-7"
    client = TestClient(HttpSecurity(_ok, Access(token=token.encode(), admin_required=False)))
    good = {"Authorization": b"Bearer " + token.encode()}
    assert client.get("/v2/models/m", headers=good).status_code == 200
    # what the server once compared: the header's bytes read as latin-1, encoded as UTF-8
    access = Access(token=token.encode(), admin_required=False)
    mangled = ("Bearer " + token).encode().decode("latin-1").encode()
    assert access.credential("inference", mangled)[0] == "unauthenticated"
    assert access.credential("inference", b"Bearer " + token.encode())[0] is None


HOSTS = frozenset({"localhost", "line-pc"})


@pytest.mark.parametrize("headers, status, words", [
    ({"Host": "evil.example:8000"}, 403, "allowed_hosts"),
    ({"Host": "LINE-PC:8000"}, 201, ""),
    ({"Host": "10.0.0.5:8000"}, 201, ""),  # an IP literal: no rebinding without a name
    ({"Host": "[::1]:8000"}, 201, ""),
    ({"Host": "localhost:8000", "Origin": "http://evil.example"}, 403, "allowed_origins"),
    ({"Host": "localhost:8000", "Origin": "null"}, 403, "allowed_origins"),
    ({"Host": "localhost:8000", "Origin": "http://localhost:8001"}, 403, "allowed_origins"),
    ({"Host": "localhost:8000", "Origin": "http://localhost:8000"}, 201, ""),
    ({"Host": "localhost", "Origin": "http://localhost"}, 201, ""),
    ({"Host": "localhost:8000", "Origin": "http://hmi.plant:8080"}, 201, ""),
])
def test_host_and_origin(headers, status, words):
    access = Access(admin_required=False, hosts=HOSTS, origins=frozenset({"http://hmi.plant:8080"}))
    client = TestClient(HttpSecurity(_created, access))
    r = client.post("/v1/guard/jobs", json={"command": ["true"]}, headers=headers)
    assert r.status_code == status, r.text
    if words:
        assert words in r.json()["error"]


async def _created(scope, receive, send):
    await PlainTextResponse("made", status_code=201)(scope, receive, send)


@pytest.mark.parametrize("content_type, body, origin, status", [
    ("text/plain;charset=UTF-8", b'{"command": ["true"]}', None, 415),
    ("application/x-www-form-urlencoded", b"a=1", None, 415),
    ("multipart/form-data; boundary=x", b"--x--", None, 415),
    ("application/json", b"{}", None, 201),
    ("application/merge-patch+json; charset=utf-8", b"{}", None, 201),
    (None, b"{}", None, 201),  # tritonclient's load and unload: a JSON body, no Content-Type
    (None, b"{}", "http://localhost:8000", 415),  # a browser's
    ("text/plain", b"", None, 201),  # no body
])
def test_bodies_of_protected_writes_must_be_json(content_type, body, origin, status):
    client = TestClient(HttpSecurity(_created, Access(admin_required=False, hosts=None)))
    headers = {"Host": "localhost:8000"}
    if content_type:
        headers["Content-Type"] = content_type
    if origin:
        headers["Origin"] = origin
    r = client.post("/v2/repository/models/m/unload", content=body, headers=headers)
    assert r.status_code == status, r.text
    # open routes keep taking what they take (a frame)
    r = client.post("/v1/models/m/inspect", content=b"\xff\xd8", headers={
        "Content-Type": "image/jpeg", "Host": "evil.example"})
    assert r.status_code == 201


def test_admin_token_made_once_with_mode_0600(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    first = with_admin_token(ServerSettings(host="0.0.0.0"))
    path = tmp_path / "visionserve" / "admin-token"
    assert first.admin_token_file == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) >= 32
    assert with_admin_token(ServerSettings(host="0.0.0.0")).admin_token_file == path
    assert path.read_text().strip() == token  # reused
    # loopback binds and configured tokens make none
    assert with_admin_token(ServerSettings(host="127.0.0.1")).admin_token_file is None
    assert with_admin_token(ServerSettings(admin_token="a")).admin_token_file is None
    with pytest.raises(ConfigError, match="the same"):
        with_admin_token(ServerSettings(admin_token="a", auth_token="a"))


def test_no_place_for_the_admin_token_closes_the_protected_routes(tmp_path, monkeypatch, caplog):
    """A read-only container without a secret still serves inference."""
    (tmp_path / "ro").write_text("a file where the data folder would be")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "ro"))
    settings = with_admin_token(ServerSettings(host="0.0.0.0"))
    assert settings.admin_token and settings.admin_token_file is None
    assert "protected routes are closed to every client" in caplog.text
    assert settings.admin_token not in caplog.text
