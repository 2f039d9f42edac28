"""The guard's pure parts: admission, watchdog rule, device resolution, /proc parsing, job env."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from visionserve.errors import ConfigError
from visionserve.gpu.nvml import SimulatedNvml, simulated_gpu
from visionserve.guard import admission, proc, watchdog
from visionserve.guard.launcher import LaunchSettings, allocator_cap, job_env
from visionserve.guard.memory import (SimulatedMemorySource, open_nvml_source,
                                      simulate_usage, write_simulation)
from visionserve.guard.store import Job

GIB = 1024**3


def test_admission_waits_until_free_minus_floor_covers_need():
    d = admission.decide(need=4 * GIB, total=80 * GIB, free=10 * GIB, floor=8 * GIB)
    assert not d.admit and not d.impossible and "waiting" in d.reason
    assert admission.decide(need=4 * GIB, total=80 * GIB, free=12 * GIB, floor=8 * GIB).admit


def test_admission_counts_memory_promised_to_running_jobs():
    d = admission.decide(need=4 * GIB, total=80 * GIB, free=20 * GIB, floor=8 * GIB,
                         promised=10 * GIB)
    assert not d.admit


def test_admission_refuses_a_job_that_can_never_fit():
    d = admission.decide(need=75 * GIB, total=80 * GIB, free=80 * GIB, floor=8 * GIB)
    assert d.impossible and not d.admit and "at most" in d.reason


def _view(state="running", policy="pause", need=4 * GIB, used=GIB):
    return watchdog.JobView(1, policy, state, need, used)


def test_watchdog_pauses_or_stops_on_low_headroom_by_policy():
    [a] = watchdog.decide([_view()], free=GIB, floor=2 * GIB, hysteresis=GIB)
    assert (a.kind, a.trigger) == ("pause", "low_headroom") and "floor" in a.reason
    [a] = watchdog.decide([_view(policy="stop")], free=GIB, floor=2 * GIB, hysteresis=GIB)
    assert (a.kind, a.trigger) == ("stop", "low_headroom")


def test_watchdog_acts_on_a_job_over_its_declared_need_even_with_headroom():
    [a] = watchdog.decide([_view(used=5 * GIB)], free=50 * GIB, floor=2 * GIB, hysteresis=GIB)
    assert (a.kind, a.trigger) == ("pause", "over_need") and "declared" in a.reason


def test_watchdog_resumes_only_above_floor_plus_hysteresis():
    paused = [_view(state="paused")]
    assert watchdog.decide(paused, free=int(2.5 * GIB), floor=2 * GIB, hysteresis=GIB) == []
    [a] = watchdog.decide(paused, free=3 * GIB, floor=2 * GIB, hysteresis=GIB)
    assert a.kind == "resume"
    # still over its own need: stays paused
    assert watchdog.decide([_view(state="paused", used=5 * GIB)], free=50 * GIB, floor=0,
                           hysteresis=0) == []


def test_watchdog_leaves_healthy_jobs_alone():
    assert watchdog.decide([_view()], free=50 * GIB, floor=2 * GIB, hysteresis=GIB) == []


def test_latency_over_budget_pauses_whatever_the_policy():
    slow = watchdog.Latency(p99_ms=45.0, budget_ms=20.0)
    for policy in ("pause", "stop"):
        [a] = watchdog.decide([_view(policy=policy)], free=50 * GIB, floor=2 * GIB, hysteresis=GIB,
                              latency=slow)
        assert (a.kind, a.trigger) == ("pause", "latency")
        assert "served p99 45.0 ms is over the latency budget 20 ms" in a.reason
    # no GPU sample (serial mode, or NVML failed): the latency rule still works
    [a] = watchdog.decide([_view()], free=None, floor=0, hysteresis=0, latency=slow)
    assert a.kind == "pause"


def test_memory_triggers_win_over_latency():
    slow = watchdog.Latency(p99_ms=45.0, budget_ms=20.0)
    [a] = watchdog.decide([_view(policy="stop", used=5 * GIB)], free=50 * GIB, floor=2 * GIB,
                          hysteresis=GIB, latency=slow)
    assert (a.kind, a.trigger) == ("stop", "over_need")


def test_latency_pause_resumes_under_the_resume_fraction_and_with_memory_back():
    paused = [_view(state="paused")]
    at = lambda ms: watchdog.Latency(p99_ms=ms, budget_ms=20.0)  # noqa: E731
    assert watchdog.decide(paused, free=50 * GIB, floor=0, hysteresis=0, latency=at(19.0)) == []
    [a] = watchdog.decide(paused, free=50 * GIB, floor=0, hysteresis=0, latency=at(15.0))
    assert a.kind == "resume" and "served p99 15.0 ms <= 0.8 x budget 20 ms" in a.reason
    # too few frames to tell (a quiet line): no reason to hold training back
    [a] = watchdog.decide(paused, free=None, floor=0, hysteresis=0, latency=at(None))
    assert a.kind == "resume"
    # latency fine but memory not back: stays paused
    assert watchdog.decide(paused, free=GIB, floor=2 * GIB, hysteresis=GIB, latency=at(5.0)) == []
    # and no p99 never pauses a running job
    assert watchdog.decide([_view()], free=None, floor=0, hysteresis=0, latency=at(None)) == []


def test_source_device_by_index_uuid_and_bus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = SimulatedNvml([simulated_gpu(0), simulated_gpu(1)])
    devs = nvml.devices()
    assert open_nvml_source("auto", nvml).uuid == devs[0].uuid
    assert open_nvml_source("cuda:1", nvml).uuid == devs[1].uuid
    assert open_nvml_source(devs[1].uuid, nvml).uuid == devs[1].uuid
    assert open_nvml_source(devs[1].pci_bus_id.lower()[4:], nvml).uuid == devs[1].uuid
    for bad in ("cuda:7", "GPU-ffff", "zz:00.0x", "nonsense"):
        with pytest.raises(ConfigError):
            open_nvml_source(bad, nvml)


def test_open_nvml_source_without_gpu_is_serial_mode_unless_a_device_was_named():
    nogpu = SimulatedNvml([])
    assert open_nvml_source("auto", nogpu) is None
    assert open_nvml_source("cpu", SimulatedNvml([simulated_gpu(0)])) is None
    with pytest.raises(ConfigError):
        open_nvml_source("0", nogpu)
    src = open_nvml_source("0", SimulatedNvml([simulated_gpu(0, memory_used=GIB)]))
    total, free = src.device_memory()
    assert total - free == GIB


def test_simulated_source_counts_live_pids_only(tmp_path):
    path = str(tmp_path / "gpu.json")
    write_simulation(path, total=16 * GIB, base_used=2 * GIB)
    simulate_usage(path, GIB)  # this process
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    simulate_usage(path, 5 * GIB, pid=int(dead.stdout))
    s = SimulatedMemorySource(path).sample()
    assert s.total == 16 * GIB
    assert s.free == 13 * GIB
    assert s.used_by_pid == {os.getpid(): GIB}


def test_a_job_declares_its_usage_without_the_side_files_lock(tmp_path):
    """The guard stops (pauses) a job at any instruction: a job stopped while it held the side
    file's lock would stall the server's and the other jobs' writes. A job's declaration takes
    no lock, and the source reads it beside the file's own pids."""
    import fcntl
    import threading

    path = str(tmp_path / "gpu.json")
    write_simulation(path, total=16 * GIB, base_used=2 * GIB, pids={12345678: GIB})
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held, as by a stopped process
    try:
        t = threading.Thread(target=simulate_usage, args=(path, 3 * GIB))
        t.start()
        t.join(5)
        assert not t.is_alive()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    s = SimulatedMemorySource(path).sample()
    assert s.used_by_pid == {os.getpid(): 3 * GIB}  # the dead pid of the file is not counted
    assert s.free == 16 * GIB - 2 * GIB - 3 * GIB


def test_proc_stat_parses_own_process():
    st = proc.stat(os.getpid())
    assert st is not None and st.pid == os.getpid() and st.starttime > 0
    assert proc.is_alive(os.getpid(), st.starttime)
    assert not proc.is_alive(os.getpid(), st.starttime + 1)  # same pid, another process
    with pytest.raises(ValueError):
        proc.signal_group(1, 0)


def _job(gpu_mem: int, env=None) -> Job:
    return Job(id=7, name="t", command=["true"], cwd="/", env=env or {}, gpu_mem=gpu_mem,
               priority=0, policy="pause", state="running", reason=None, submitted_at=0.0,
               started_at=None, ended_at=None, pid=None, pid_starttime=None, exit_code=None,
               log_path=None, cancel_requested=False, starts=1)


def test_job_env_pins_the_gpu_and_caps_memory():
    s = LaunchSettings(gpu_uuid="GPU-abc", gpu_total=80 * GIB, context_reserve=GIB,
                       site_dir="/site")
    env = job_env(_job(8 * GIB, {"PYTHONPATH": "/mine"}), s, base={"PATH": "/bin"})
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-abc"
    assert env["VISIONSERVE_GUARD_JOB_ID"] == "7"
    assert env["VISIONSERVE_GPU_MEM_LIMIT"] == str(8 * GIB)
    assert env["VISIONSERVE_GUARD_ALLOCATOR_CAP"] == str(7 * GIB)
    assert float(env["VISIONSERVE_GPU_MEM_FRACTION"]) == pytest.approx(7 / 80, abs=1e-6)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["PYTHONPATH"] == "/site" + os.pathsep + "/mine"
    # no declared GPU memory: no GPU at all
    assert job_env(_job(0), s, base={})["CUDA_VISIBLE_DEVICES"] == ""
    # serial-queue mode (no GPU known): no pinning
    assert "CUDA_VISIBLE_DEVICES" not in job_env(_job(GIB), LaunchSettings(None, None), base={})
    assert allocator_cap(GIB, 768 * 1024**2) == GIB // 2


def test_sitecustomize_hook_caps_torch_lazily(tmp_path):
    """The injected sitecustomize queues set_per_process_memory_fraction on torch import (run in a
    subprocess against a fake ``torch`` package so the test needs no CUDA)."""
    from visionserve.guard.launcher import write_site_dir

    site = write_site_dir(str(tmp_path / "site"))
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "class cuda:\n"
        "    calls = []\n"
        "    @staticmethod\n"
        "    def _lazy_call(fn): cuda.calls.append(fn)\n"
        "    @staticmethod\n"
        "    def set_per_process_memory_fraction(f): cuda.fraction = f\n")
    code = ("import torch; assert len(torch.cuda.calls) == 1; torch.cuda.calls[0](); "
            "print(torch.cuda.fraction)")
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{tmp_path / 'fake'}",
               VISIONSERVE_GPU_MEM_FRACTION="0.25")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.25"
