"""Bearer-token auth, TLS, request ids and JSON logs on a real server."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

TOKEN = "line-7-secret"


@pytest.fixture(scope="module")
def auth_server(tiny_repo, tmp_path_factory):
    from conftest import start_server

    s = start_server(tiny_repo, tmp_path_factory.mktemp("auth"), "--auth-token", TOKEN, "--log-json",
                     grpc=False)
    yield s
    s.stop()


def test_health_stays_open_with_auth(auth_server):
    assert httpx.get(auth_server.url + "/v2/health/ready").status_code == 200
    assert httpx.get(auth_server.url + "/v2/health/live").status_code == 200


def test_missing_or_wrong_token_is_401(auth_server, jpeg_bytes):
    r = httpx.get(auth_server.url + "/v2/models/tiny")
    assert r.status_code == 401
    assert "bearer" in r.json()["error"].lower()
    assert r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.post(auth_server.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                   headers={"Content-Type": "image/jpeg", "Authorization": "Bearer nope"})
    assert r.status_code == 401


def test_answers_from_the_head_come_after_the_token_check(auth_server, jpeg_bytes):
    """Inspect requests that their head decides are answered in the HTTP protocol, before the
    app's task: the token is still checked first, and the answer names its request."""
    bad_priority = {"Content-Type": "image/jpeg", "X-Priority": "99", "X-Request-Id": "rq-7"}
    r = httpx.post(auth_server.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                   headers=bad_priority)
    assert r.status_code == 401 and r.headers["x-request-id"] == "rq-7"
    r = httpx.post(auth_server.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                   headers={**bad_priority, "Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and "priority 99 is out of range" in r.json()["error"]
    assert r.json()["model"] == "tiny" and r.headers["x-request-id"] == "rq-7"
    r = httpx.post(auth_server.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                   headers={"Content-Type": "image/jpeg", "X-Priority": "99",
                            "Authorization": f"Bearer {TOKEN}"})
    assert len(r.headers["x-request-id"]) == 16  # one made for it


def test_right_token_passes(auth_server, jpeg_bytes):
    r = httpx.post(auth_server.url + "/v1/models/tiny/inspect", content=jpeg_bytes,
                   headers={"Content-Type": "image/jpeg", "Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    assert r.json()["verdict"] in ("OK", "NG")


def test_request_id_echoed_and_logged_as_json(auth_server):
    r = httpx.get(auth_server.url + "/v2/models/nope", headers={"Authorization": f"Bearer {TOKEN}",
                                                                "X-Request-Id": "req-abc-123"})
    assert r.status_code == 404
    assert r.headers["x-request-id"] == "req-abc-123"
    assert httpx.get(auth_server.url + "/v2/health/live").headers["x-request-id"]
    lines = [ln for ln in auth_server.log().splitlines() if ln.startswith("{")]
    assert lines, "no JSON log lines"
    for ln in lines:
        entry = json.loads(ln)
        assert {"ts", "level", "logger", "msg"} <= set(entry)


def test_closed_health_when_asked(tiny_repo, server_factory):
    s = server_factory(tiny_repo, "--auth-token", TOKEN, "--no-auth-health-open", grpc=False, wait=False)
    import time

    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            r = httpx.get(s.url + "/v2/health/ready", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=1)
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert httpx.get(s.url + "/v2/health/ready").status_code == 401


def test_tls(tiny_repo, server_factory, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    s = server_factory(tiny_repo, "--tls-cert", str(cert), "--tls-key", str(key), grpc=False, wait=False)
    import time

    import ssl

    ctx = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{s.http_port}"
    end = time.monotonic() + 120
    status = None
    while time.monotonic() < end:
        try:
            status = httpx.get(url + "/v2/health/ready", verify=ctx, timeout=1).status_code
            if status == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert status == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{s.http_port}/v2/health/ready", timeout=2).raise_for_status()


def test_tls_needs_both_files(tiny_repo, tmp_path):
    import sys

    r = subprocess.run([sys.executable, "-m", "visionserve", "serve", "--models", str(tiny_repo),
                        "--tls-cert", str(tmp_path / "c.pem")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "tls_cert and tls_key go together" in r.stderr


def test_grpc_auth(tiny_repo, server_factory):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    s = server_factory(tiny_repo, "--auth-token", TOKEN)
    client = grpcclient.InferenceServerClient(s.grpc_url)
    assert client.is_server_live()  # health stays open
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("tiny")
    assert "UNAUTHENTICATED" in str(err.value.status()) or "bearer" in str(err.value).lower()
    meta = client.get_model_metadata("tiny", headers={"authorization": f"Bearer {TOKEN}"})
    assert meta.name == "tiny"


def test_grpc_tls(tiny_repo, server_factory, tmp_path):
    import tritonclient.grpc as grpcclient

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    s = server_factory(tiny_repo, "--tls-cert", str(cert), "--tls-key", str(key), wait=False)
    import time

    client = grpcclient.InferenceServerClient(f"localhost:{s.grpc_port}", ssl=True,
                                              root_certificates=str(cert))
    end = time.monotonic() + 120
    ready = False
    while time.monotonic() < end and not ready:
        try:
            ready = client.is_server_ready()
        except Exception:
            time.sleep(0.3)
    assert ready
