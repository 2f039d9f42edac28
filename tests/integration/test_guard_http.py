"""The guard's HTTP router mounted in a small FastAPI app (TestClient runs the real ASGI app)."""

from __future__ import annotations

import sys

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from visionserve.audit import AuditTrail
from visionserve.guard.http import make_router
from visionserve.guard.store import JobSpec, JobStore


@pytest.fixture
def client_store(tmp_path):
    store = JobStore(tmp_path / "g.sqlite")
    app = FastAPI()
    app.include_router(make_router(store, AuditTrail(tmp_path / "audit.sqlite")))
    with TestClient(app) as client:
        yield client, store


def test_submit_list_show_cancel(client_store):
    client, store = client_store
    r = client.post("/v1/guard/jobs", json={"command": [sys.executable, "-c", "pass"],
                                             "gpu_mem": "2GiB", "priority": 3, "policy": "stop",
                                             "env": {"A": "1"}, "name": "t"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["state"], job["gpu_mem"], job["policy"], job["name"]) == \
        ("queued", 2 * 1024**3, "stop", "t")
    assert [j["id"] for j in client.get("/v1/guard/jobs").json()] == [job["id"]]
    assert client.get("/v1/guard/jobs", params={"state": "running"}).json() == []
    assert client.get(f"/v1/guard/jobs/{job['id']}").json()["id"] == job["id"]
    r = client.post(f"/v1/guard/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    r = client.post(f"/v1/guard/jobs/{job['id']}/cancel")
    assert r.status_code == 409 and "already ended" in r.json()["error"]
    assert store.get(job["id"]).state == "cancelled"


def test_logs(client_store, tmp_path):
    client, store = client_store
    j = store.submit(JobSpec(command=[sys.executable, "-c", "pass"]))
    assert client.get(f"/v1/guard/jobs/{j.id}/logs").text == ""  # not started yet
    with open(j.log_path, "w") as f:
        f.write("line one\nline two\n")
    assert client.get(f"/v1/guard/jobs/{j.id}/logs").text == "line one\nline two\n"
    assert client.get(f"/v1/guard/jobs/{j.id}/logs", params={"tail_bytes": 9}).text == "line two\n"


@pytest.mark.parametrize("path", ["/v1/guard/jobs/77", "/v1/guard/jobs/77/logs"])
def test_unknown_id_is_404(client_store, path):
    client, _ = client_store
    r = client.get(path)
    assert r.status_code == 404 and r.json() == {"error": "no guard job with id 77"}
    assert client.post("/v1/guard/jobs/77/cancel").status_code == 404


@pytest.mark.parametrize("body, status, words", [
    ({"command": []}, 422, "command"),
    ({"command": ["true"], "gpu_mem": "8XB"}, 422, "not a size"),
    ({"command": ["true"], "policy": "nuke"}, 422, "policy"),
    ({"command": ["true"], "surprise": 1}, 422, "surprise"),
    ({"command": ["no-such-program-xyz"]}, 400, "command not found"),
    ({"command": ["true"], "cwd": "/no/such/dir"}, 400, "does not exist"),
])
def test_bad_bodies_are_clear_errors(client_store, body, status, words):
    client, _ = client_store
    r = client.post("/v1/guard/jobs", json=body)
    assert r.status_code == status and words in r.json()["error"], r.text


def test_body_that_is_not_json(client_store):
    client, _ = client_store
    r = client.post("/v1/guard/jobs", content=b"{nope",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json() == {"error": "body is not valid JSON"}
