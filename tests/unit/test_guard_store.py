"""The SQLite job store: validation, ordering, conditional transitions, the supervisor lease."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import sys

import pytest

from visionserve.errors import InvalidInput, NotFound
from visionserve.guard import proc
from visionserve.guard.store import JobSpec, JobStateError, JobStore, SupervisorRunning


@pytest.fixture
def store(tmp_path) -> JobStore:
    return JobStore(tmp_path / "guard.sqlite")


def _spec(**kw) -> JobSpec:
    kw.setdefault("command", [sys.executable, "-c", "pass"])
    return JobSpec(**kw)


def test_submit_persists_every_field_and_uses_wal(store, tmp_path):
    job = store.submit(_spec(name="train", env={"A": "1"}, gpu_mem=123, priority=3,
                             policy="stop", cwd=str(tmp_path)))
    again = JobStore(store.path).get(job.id)  # a second process would see the same
    assert again == job
    assert (job.state, job.name, job.env, job.gpu_mem, job.priority, job.policy) == \
        ("queued", "train", {"A": "1"}, 123, 3, "stop")
    assert job.log_path.endswith(f"job-{job.id}.log") and job.submitted_at > 0
    mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_submit_resolves_the_program_on_path(store):
    job = store.submit(_spec(command=["sh", "-c", "true"]))
    assert os.path.isabs(job.command[0]) and job.command[1:] == ["-c", "true"]


@pytest.mark.parametrize("kw, words", [
    ({"command": []}, "empty command"),
    ({"command": ["no-such-program-xyz"]}, "not found"),
    ({"cwd": "/no/such/dir"}, "does not exist"),
    ({"policy": "explode"}, "policy"),
    ({"gpu_mem": -1}, "gpu_mem"),
    ({"priority": 10**6}, "priority"),
    ({"env": {"BAD KEY": "x"}}, "variable name"),
])
def test_submit_refuses_bad_specs_with_a_clear_message(store, kw, words):
    with pytest.raises(InvalidInput, match=words):
        store.submit(_spec(**kw))


def test_next_queued_is_priority_then_fifo(store):
    a = store.submit(_spec(priority=0))
    b = store.submit(_spec(priority=5))
    c = store.submit(_spec(priority=5))
    order = []
    while (j := store.next_queued()) is not None:
        order.append(j.id)
        store.claim(j.id)
    assert order == [b.id, c.id, a.id]


def test_claim_is_conditional(store):
    job = store.submit(_spec())
    assert store.claim(job.id).state == "running"
    assert store.claim(job.id) is None  # nobody starts a job twice
    assert store.get(job.id).starts == 1


def _claim_in_child(path: str, job_id: int, q) -> None:
    q.put(JobStore(path).claim(job_id) is not None)


def test_only_one_of_two_processes_can_claim_a_job(store):
    job = store.submit(_spec())
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    ps = [ctx.Process(target=_claim_in_child, args=(store.path, job.id, q)) for _ in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(20)
    assert sorted([q.get(timeout=5), q.get(timeout=5)]) == [False, True]


def test_cancel_queued_running_and_finished(store):
    queued = store.submit(_spec())
    assert store.request_cancel(queued.id).state == "cancelled"
    running = store.submit(_spec())
    store.claim(running.id)
    j = store.request_cancel(running.id)
    assert j.state == "running" and j.cancel_requested
    assert store.cancel_requested_ids() == [running.id]
    assert store.finish(running.id, "cancelled", exit_code=-15, reason="cancelled by user")
    assert not store.finish(running.id, "failed", exit_code=1, reason="x")  # already terminal
    with pytest.raises(JobStateError, match="already ended"):
        store.request_cancel(running.id)
    with pytest.raises(NotFound, match="no guard job with id 999"):
        store.request_cancel(999)


def test_pause_and_resume_transitions(store):
    job = store.submit(_spec())
    assert not store.set_paused(job.id, "x")  # queued jobs cannot be paused
    store.claim(job.id)
    assert store.set_paused(job.id, "paused: low")
    assert store.get(job.id).state == "paused"
    assert store.set_resumed(job.id, "resumed")
    assert store.get(job.id).state == "running"


def test_one_supervisor_per_database(store):
    me = (os.getpid(), proc.starttime(os.getpid()))
    store.acquire_lease(*me, None, proc.is_alive)
    store.acquire_lease(*me, None, proc.is_alive)  # re-entrant for the holder
    other = JobStore(store.path)
    with pytest.raises(SupervisorRunning, match=str(os.getpid())):
        other.acquire_lease(1, 12345, None, lambda pid, st: True)
    # a dead holder's lease is taken over
    other.acquire_lease(1, 12345, None, lambda pid, st: False)
    assert store.supervisor()["pid"] == 1
    other.release_lease(1)
    assert store.supervisor() is None


def test_bad_db_location_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidInput, match="does not exist"):
        JobStore(tmp_path / "nope" / "db.sqlite")
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(InvalidInput, match="cannot open"):
        JobStore(bad)
