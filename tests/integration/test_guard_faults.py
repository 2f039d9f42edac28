"""The guard when its SQLite file fails for real: a full file system, or one remounted read-only.

The database lives on a file system of its own that the test breaks and mends: a small tmpfs it
fills up, or a bind mount it remounts read-only (root ignores file modes, not a read-only mount).
Needs root (mount); skipped otherwise. Job logs live elsewhere, as a running job holds its log
open (a mount with a writer open cannot be made read-only).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest
from conftest import wait_for
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from tests.tools.disks import mount_disk
from visionserve.audit import AuditTrail
from visionserve.guard import proc
from visionserve.guard.http import make_router
from visionserve.guard.memory import SimulatedMemorySource, write_simulation
from visionserve.guard.store import JobSpec, JobStore, StoreFault
from visionserve.guard.supervisor import Supervisor, SupervisorConfig

GIB = 1024**3


@pytest.fixture(params=["full", "readonly"])
def disk(request, tmp_path):
    return mount_disk(request, tmp_path, request.param)


def metric(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


def test_supervisor_survives_a_database_fault_and_catches_up(disk, tmp_path, caplog):
    """1.5 s of a broken database used to kill the supervisor thread: jobs were accepted after
    it and never ran. Now the job that ended during the fault is recorded once the disk works,
    new jobs run, the metrics read the truth, and the fault is logged once, its end once."""
    caplog.set_level(logging.INFO, logger="visionserve.guard.supervisor")
    gpu = str(tmp_path / "gpu.json")
    write_simulation(gpu, total=16 * GIB, base_used=0, pids={})
    store = JobStore(disk.dir / "guard.sqlite", log_dir=str(tmp_path / "logs"))
    sup = Supervisor(store, SimulatedMemorySource(gpu), SupervisorConfig(poll_hz=50))
    thread = threading.Thread(target=sup.run_forever, daemon=True)
    thread.start()

    def submit(code: str, **kw):
        return store.submit(JobSpec(command=[sys.executable, "-c", code], **kw))

    try:
        first = submit("import time; time.sleep(0.5)")
        wait_for(lambda: store.get(first.id).pid, what="the first job to run")
        disk.fail()
        time.sleep(1.5)  # the first job ends meanwhile
        assert thread.is_alive(), "the supervisor died of the fault"
        assert metric("visionserve_guard_store_fault") == 1
        with pytest.raises(StoreFault):  # a write: on a full disk, reads may still work
            store.set_reason(first.id, "probe")
        disk.mend()
        done = wait_for(lambda: (j := store.get(first.id)).state != "running" and j, 10,
                        "the first job's end to be recorded")
        assert done.state == "succeeded" and done.exit_code == 0
        wait_for(lambda: metric("visionserve_guard_store_fault") == 0, what="the recovery")
        after = submit("pass")
        wait_for(lambda: store.get(after.id).state == "succeeded", 10, "a job after the fault")
        write_simulation(gpu, base_used=15 * GIB)
        wait_for(lambda: metric("visionserve_guard_gpu_free_bytes") == GIB, what="a new sample")
        submit("pass", gpu_mem=4 * GIB)  # cannot fit: stays queued
        wait_for(lambda: metric("visionserve_guard_jobs_queued") == 1, 5, "the queued metric")
        assert thread.is_alive()
    finally:
        for a in list(sup.active.values()):
            proc.signal_group(a.pgid, 9)
        sup.request_stop()
        thread.join(10)
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "cannot be used now" in m]) == 1, said
    assert len([m for m in said if "works again" in m]) == 1, said


def test_api_answers_503_with_retry_after_during_a_fault(disk, tmp_path):
    """The guard's API used to answer unhandled 500s while the database failed."""
    store = JobStore(disk.dir / "guard.sqlite")
    job = store.submit(JobSpec(command=[sys.executable, "-c", "pass"]))
    pid = os.getpid()
    store.acquire_lease(pid, proc.starttime(pid) or 0, None, proc.is_alive)  # as a supervisor
    app = FastAPI()
    app.include_router(make_router(store, AuditTrail(tmp_path / "audit.sqlite")))
    with TestClient(app) as client:
        disk.fail()
        try:
            for method, path, body in [
                    ("GET", "/v1/guard/jobs", None),
                    ("POST", "/v1/guard/jobs", {"command": [sys.executable, "-c", "pass"]}),
                    ("GET", f"/v1/guard/jobs/{job.id}", None),
                    ("POST", f"/v1/guard/jobs/{job.id}/cancel", None),
                    ("GET", "/v1/guard/health", None)]:
                r = client.request(method, path, json=body)
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert int(r.headers["Retry-After"]) >= 1, path
                assert "job database cannot be used now" in r.json()["error"], r.text
        finally:
            disk.mend()
        health = client.get("/v1/guard/health")
        assert health.status_code == 200 and health.json()["ok"] is True, health.text
        assert health.json()["jobs"]["queued"] == 1 and health.json()["supervisor"]["pid"] == pid
        assert client.post("/v1/guard/jobs", json={"command": [sys.executable, "-c", "pass"]}
                           ).status_code == 201
        store.release_lease(pid)
        r = client.get("/v1/guard/health")
        assert r.status_code == 503 and "no guard supervisor" in r.json()["error"], r.text
