"""The access rules of visionserve.security: which paths stay open, and when the guard's job API
is refused."""

from __future__ import annotations

import pytest
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from visionserve.security import HttpSecurity, guard_api_refusal, is_loopback


@pytest.mark.parametrize("host, local", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False), ("line-pc.plant", False),
])
def test_is_loopback(host, local):
    assert is_loopback(host) is local


def test_guard_api_refusal():
    assert guard_api_refusal(None, "127.0.0.1") is None
    assert guard_api_refusal("secret", "0.0.0.0") is None
    why = guard_api_refusal(None, "0.0.0.0")
    assert "runs commands" in why and "--auth-token" in why and "--host 127.0.0.1" in why


async def _ok(scope, receive, send):
    await PlainTextResponse("ok")(scope, receive, send)


@pytest.mark.parametrize("metrics_open", [True, False])
def test_open_paths_with_auth(metrics_open):
    client = TestClient(HttpSecurity(_ok, "secret", metrics_open=metrics_open))
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/metrics").status_code == (200 if metrics_open else 401)
    assert client.get("/v2/models/m").status_code == 401
    assert client.get("/v2/models/m", headers={"Authorization": "Bearer secret"}).status_code == 200


def test_guard_prefix_refused_with_the_reason():
    client = TestClient(HttpSecurity(_ok, None, guard_refusal="off: no token"))
    for path in ("/v1/guard", "/v1/guard/jobs", "/v1/guard/jobs/3/logs"):
        r = client.post(path)
        assert r.status_code == 403 and r.json() == {"error": "off: no token"}, path
        assert r.headers["x-request-id"]
    assert client.get("/v1/guardrails").status_code == 200  # only the guard's own prefix
    assert client.get("/v2/models/m").status_code == 200
