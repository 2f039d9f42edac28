"""The supervisor with real job subprocesses and a simulated GPU (side file).

The supervisor runs in a thread of the test process; jobs are real ``python -c`` processes that
declare their GPU use into the simulated GPU's side file.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from visionserve.guard import proc
from visionserve.guard.memory import SimulatedMemorySource, write_simulation
from visionserve.guard.store import TERMINAL, JobSpec, JobStore
from visionserve.guard.supervisor import Supervisor, SupervisorConfig

GIB = 1024**3
REPO = str(Path(__file__).resolve().parents[2])




class Guard:
    def __init__(self, tmp: Path, latency=None, **cfg) -> None:
        self.gpu = str(tmp / "gpu.json")
        write_simulation(self.gpu, total=16 * GIB, base_used=0, pids={})
        self.store = JobStore(tmp / "guard.sqlite")
        cfg.setdefault("poll_hz", 50)
        cfg.setdefault("hysteresis", GIB // 2)
        self.sup = Supervisor(self.store, SimulatedMemorySource(self.gpu), SupervisorConfig(**cfg),
                              latency=latency)
        self.thread = threading.Thread(target=self.sup.run_forever, daemon=True)

    def submit(self, code: str, **kw):
        kw.setdefault("env", {"PYTHONPATH": REPO, "GPU_FILE": self.gpu})
        return self.store.submit(JobSpec(command=[sys.executable, "-c", code], **kw))

    def state(self, job_id: int) -> str:
        return self.store.get(job_id).state

    def wait_running(self, job_id: int):
        """Running with its process recorded (the pid is written just after the claim)."""
        return wait_for(lambda: (j := self.store.get(job_id)).state == "running" and j.pid and j,
                        10.0, f"job {job_id} to run")

    def wait_state(self, job_id: int, *states: str, timeout: float = 10.0):
        return wait_for(lambda: self.store.get(job_id).state in states and self.store.get(job_id),
                        timeout, f"job {job_id} to be {states} (is {self.state(job_id)})")


@pytest.fixture
def guard_factory(tmp_path) -> Iterator[Callable[..., Guard]]:
    made: list[Guard] = []

    def make(**cfg) -> Guard:
        g = Guard(tmp_path, **cfg)
        g.thread.start()
        made.append(g)
        return g

    yield make
    for g in made:
        for a in list(g.sup.active.values()):  # never leave job processes behind
            proc.signal_group(a.pgid, 9)
        g.sup.request_stop()
        g.thread.join(10)


# A job that declares USE bytes on the simulated GPU, then sleeps.
USES = ("import os, time; from visionserve.guard.memory import simulate_usage; "
        "simulate_usage(os.environ['GPU_FILE'], {use}); time.sleep({sleep})")


def test_job_waits_for_memory_and_starts_when_it_frees(guard_factory):
    g = guard_factory(inference_floor=4 * GIB, margin=GIB)
    write_simulation(g.gpu, base_used=9 * GIB)  # free 7 GiB - floor 5 GiB = 2 GiB
    job = g.submit("pass", gpu_mem=3 * GIB)
    wait_for(lambda: (g.store.get(job.id).reason or "").startswith("waiting"), what="wait reason")
    assert g.state(job.id) == "queued"
    write_simulation(g.gpu, base_used=7 * GIB)  # free 9 - 5 = 4 GiB >= 3 GiB
    done = g.wait_state(job.id, "succeeded")
    assert done.exit_code == 0 and done.starts == 1


def test_jobs_run_strictly_one_after_another(guard_factory):
    g = guard_factory()
    jobs = [g.submit("import time; time.sleep(0.3)") for _ in range(3)]
    for j in jobs:
        g.wait_state(j.id, "succeeded", timeout=20)
    done = sorted((g.store.get(j.id) for j in jobs), key=lambda j: j.started_at)
    assert [j.id for j in done] == [j.id for j in jobs]  # FIFO at equal priority
    for before, after in zip(done, done[1:]):
        assert before.ended_at <= after.started_at


def test_higher_priority_starts_first(guard_factory, tmp_path):
    order = tmp_path / "order.txt"
    write = f"open({str(order)!r}, 'a').write('{{}}\\n')"
    g = guard_factory(inference_floor=2 * GIB)
    write_simulation(g.gpu, base_used=14 * GIB)  # nothing fits until memory frees
    low = g.submit(write.format("low"), priority=0, gpu_mem=GIB)
    high = g.submit(write.format("high"), priority=9, gpu_mem=GIB)
    g.wait_state(low.id, "queued")
    write_simulation(g.gpu, base_used=0)
    for j in (low, high):
        g.wait_state(j.id, "succeeded")
    assert order.read_text().split() == ["high", "low"]


def test_low_headroom_pauses_the_job_and_resumes_it(guard_factory):
    g = guard_factory(inference_floor=4 * GIB, margin=0)
    job = g.submit(USES.format(use=GIB, sleep=30), gpu_mem=2 * GIB, policy="pause")
    running = g.wait_running(job.id)
    wait_for(lambda: len(proc.session_members(running.pid)) >= 2, what="job process")
    write_simulation(g.gpu, base_used=12 * GIB)  # free 16-12-1 = 3 GiB < floor 4 GiB
    paused = g.wait_state(job.id, "paused")
    assert "inference floor" in paused.reason
    members = proc.session_members(paused.pid)
    assert len(members) >= 2  # the wrapper and the job itself
    wait_for(lambda: all(m.state == "T" for m in proc.session_members(paused.pid)),
             what="job processes stopped")
    write_simulation(g.gpu, base_used=9 * GIB)  # free 6 GiB >= 4 + 0.5 GiB
    resumed = g.wait_state(job.id, "running")
    assert resumed.reason.startswith("resumed")
    wait_for(lambda: all(m.state != "T" for m in proc.session_members(paused.pid)),
             what="job processes continued")


def test_stop_policy_sigterm_then_sigkill_for_a_job_over_its_need(guard_factory, tmp_path):
    g = guard_factory(grace_s=0.5)
    marker = tmp_path / "got-term"
    code = ("import os, signal, time; from visionserve.guard.memory import simulate_usage; "
            f"signal.signal(signal.SIGTERM, lambda *a: open({str(marker)!r}, 'w').close()); "
            "simulate_usage(os.environ['GPU_FILE'], 3 * 2**30); time.sleep(60)")
    job = g.submit(code, gpu_mem=2 * GIB, policy="stop")
    done = g.wait_state(job.id, "killed", timeout=15)
    assert marker.exists()  # it was asked politely first
    assert "over its declared" in done.reason and "SIGKILL" in done.reason
    assert done.exit_code == -9
    assert not proc.is_alive(done.pid, done.pid_starttime)


def test_cancel_a_running_job(guard_factory):
    g = guard_factory()
    job = g.submit("import time; time.sleep(60)")
    running = g.wait_running(job.id)
    g.store.request_cancel(job.id)
    done = g.wait_state(job.id, "cancelled")
    assert done.reason == "cancelled by user" and done.exit_code == -15
    assert not proc.is_alive(running.pid, None) or not proc.session_members(running.pid)


def test_failures_are_recorded(guard_factory, tmp_path):
    g = guard_factory()
    bad = g.submit("import sys; sys.exit(3)")
    assert g.wait_state(bad.id, "failed").reason == "exited with exit code 3"
    # the job waits behind a running one (concurrency 1) while its directory goes: without
    # that, a busy box could start it before the directory is removed (seen once in CI)
    blocker = g.submit("import time; time.sleep(60)")
    g.wait_running(blocker.id)
    gone = tmp_path / "gone"
    gone.mkdir()
    job = g.submit("pass", cwd=str(gone))
    os.rmdir(gone)
    g.store.request_cancel(blocker.id)
    assert g.wait_state(job.id, "failed").reason.startswith("cannot start")


def test_a_job_that_can_never_fit_fails_instead_of_blocking_the_queue(guard_factory):
    g = guard_factory(inference_floor=10 * GIB)
    huge = g.submit("pass", gpu_mem=8 * GIB)
    small = g.submit("pass", gpu_mem=GIB)
    assert "at most" in g.wait_state(huge.id, "failed").reason
    g.wait_state(small.id, "succeeded")


def test_logs_capture_stdout_and_stderr(guard_factory):
    g = guard_factory()
    job = g.submit("import sys; print('out'); print('err', file=sys.stderr)")
    done = g.wait_state(job.id, "succeeded")
    text = Path(done.log_path).read_text()
    assert "out" in text and "err" in text and f"job {job.id}" in text
    assert all(s in TERMINAL for s in [done.state])


@pytest.mark.parametrize("sched_idle", [True, False])
def test_jobs_run_at_low_cpu_priority(guard_factory, sched_idle):
    """A job (and what it starts, e.g. data-loading workers) runs at nice +10 and, by default,
    under SCHED_IDLE: it gets only CPU time the server does not want."""
    g = guard_factory(sched_idle=sched_idle)
    job = g.submit("import os, subprocess, sys; print('policy', os.sched_getscheduler(0), os.nice(0)); "
                   "subprocess.run([sys.executable, '-c', 'import os; print(\"child\", os.sched_getscheduler(0))'])")
    done = g.wait_state(job.id, "succeeded")
    text = Path(done.log_path).read_text()
    import os as _os

    want = _os.SCHED_IDLE if sched_idle else _os.SCHED_OTHER
    nice = min(19, _os.nice(0) + 10)  # +10 on top of ours (the suite may itself run under nice)
    assert f"policy {want} {nice}" in text and f"child {want}" in text, text


def test_served_latency_over_budget_pauses_the_job_until_it_recovers(guard_factory):
    """The server that hosts the guard reports its p99; over the budget, the running job is paused
    (even with policy stop: it is not at fault), and resumed once the p99 is under 80% of it."""
    p99 = {"ms": 5.0}
    g = guard_factory(latency_budget_ms=20.0, latency=lambda: p99["ms"])
    job = g.submit("import time; time.sleep(60)", policy="stop")
    running = g.wait_running(job.id)
    wait_for(lambda: len(proc.session_members(running.pid)) >= 2, what="job process")
    time.sleep(0.2)
    assert g.state(job.id) == "running"  # 5 ms: nothing to do
    p99["ms"] = 45.0
    paused = g.wait_state(job.id, "paused")
    assert "served p99 45.0 ms is over the latency budget 20 ms" in paused.reason
    wait_for(lambda: all(m.state == "T" for m in proc.session_members(paused.pid)),
             what="job processes stopped")
    p99["ms"] = 18.0  # under the budget, not yet under 80% of it: stays paused
    time.sleep(0.3)
    assert g.state(job.id) == "paused"
    p99["ms"] = 10.0
    resumed = g.wait_state(job.id, "running")
    assert "served p99 10.0 ms" in resumed.reason
    wait_for(lambda: all(m.state != "T" for m in proc.session_members(paused.pid)),
             what="job processes continued")


def test_a_job_under_cuda_mps_gets_the_daemons_variables_and_is_recorded_as_mps(guard_factory,
                                                                                 tmp_path):
    """With the hosted guard's MPS on (serve --guard-mps), a job is launched as a client of the
    server's daemon: its pipe directory, a capped share of the SMs, a lower client priority, no
    yield hook; its record says ``mps``."""
    g = guard_factory(mps_pipe_dir=str(tmp_path / "pipe"), mps_log_dir=str(tmp_path / "log"),
                      mps_job_sm_percent=35)
    job = g.submit("import os; print(*(f'{k}={os.environ.get(k)}' for k in ("
                   "'CUDA_MPS_PIPE_DIRECTORY', 'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', "
                   "'CUDA_MPS_CLIENT_PRIORITY', 'VISIONSERVE_GUARD_SHARE'))); "
                   "import time; time.sleep(1.5)")
    done = g.wait_state(job.id, "succeeded")
    text = Path(done.log_path).read_text()
    assert (f"CUDA_MPS_PIPE_DIRECTORY={tmp_path / 'pipe'} CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=35 "
            "CUDA_MPS_CLIENT_PRIORITY=1 VISIONSERVE_GUARD_SHARE=None") in text, text
    assert done.mechanism == "mps" and done.sharing["mechanism"] == "mps", done


def test_an_mps_job_that_runs_out_of_memory_says_it_hit_its_declared_limit(guard_factory,
                                                                            tmp_path):
    """Under MPS a job is held to its declared memory by MPS itself (an allocation past it fails
    in the job): its record says so, rather than only its exit code."""
    g = guard_factory(mps_pipe_dir=str(tmp_path / "pipe"), mps_log_dir=str(tmp_path / "log"))
    job = g.submit("import os, sys; print(os.environ['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT']); "
                   "sys.exit('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                   "256.00 MiB')", gpu_mem=2 * GIB)
    done = g.wait_state(job.id, "failed")
    assert "0=2048M" in Path(done.log_path).read_text()
    assert "CUDA out of memory at its declared 2.00 GiB (the MPS limit)" in done.reason, done
