"""CUDA MPS for the hosted guard (visionserve.guard.mps): joining or starting the control daemon,
the server's and the jobs' environments, the mechanism recorded, and every way it cannot run.

This machine has no NVIDIA driver, so ``nvidia-cuda-mps-control`` here is a stand-in script on
PATH that keeps the real one's contract: ``-d`` leaves a daemon process behind and writes its pid
to ``$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid``; ``quit`` on stdin stops it. The real
daemon, the server and a job as its clients run in tests/gpu/test_guard_gpu.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from visionserve.guard import mps
from visionserve.guard.launcher import LaunchSettings, job_env
from visionserve.guard.sharing import JobSharing
from visionserve.guard.store import Job

CONTROL = r'''#!/usr/bin/env python3
import os, subprocess, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
if os.environ.get("FAKE_MPS_FAIL"):
    sys.stderr.write("cannot find a supported GPU\n")
    sys.exit(1)
if sys.argv[1:] == ["-d"]:
    with open(os.path.join(pipe, "started-with"), "w") as f:
        f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "-"))
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(pid_file, "w") as f:
        f.write(str(p.pid))
    sys.exit(0)
if sys.stdin.read().strip() == "quit":
    os.kill(int(open(pid_file).read()), 15)
    os.unlink(pid_file)
'''

UUID = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
ENV_KEYS = (mps.PIPE_ENV, mps.LOG_ENV, mps.PERCENT_ENV, mps.PRIORITY_ENV, mps.MEM_LIMIT_ENV)


@pytest.fixture
def control(tmp_path, monkeypatch) -> Path:
    """The stand-in control binary first on PATH; the MPS variables as the test found them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / mps.CONTROL
    exe.write_text(CONTROL.replace("/usr/bin/env python3", sys.executable, 1))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    yield exe
    for pid_file in tmp_path.rglob(mps.PID_FILE):  # never leave a daemon behind
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # a zombie of the stand-in counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_starts_a_private_daemon_on_the_guarded_gpu_joins_it_and_quits_it(control, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv(mps.PERCENT_ENV, "30")  # the server's environment must not cap the server
    m = mps.start(40, UUID, root=str(tmp_path / "mps"))
    try:
        assert m.active and m.started_here and m.daemon and _alive(m.daemon), m.reason
        assert m.pipe_dir == str(tmp_path / "mps" / "pipe")
        assert (Path(m.pipe_dir) / "started-with").read_text() == UUID  # that GPU only
        assert os.environ[mps.PIPE_ENV] == m.pipe_dir and os.environ[mps.LOG_ENV] == m.log_dir
        assert os.environ[mps.PRIORITY_ENV] == "0" and mps.PERCENT_ENV not in os.environ
        assert m.job_sm_percent == 40
    finally:
        m.stop()
    assert not (Path(m.pipe_dir) / mps.PID_FILE).exists()  # quit through the control binary
    assert os.environ.get(mps.PERCENT_ENV) == "30" and mps.PIPE_ENV not in os.environ


def test_a_daemon_left_in_the_private_directory_is_reused_and_still_quit(control, tmp_path,
                                                                          monkeypatch):
    root = str(tmp_path / "mps")
    first = mps.start(50, UUID, root=root)
    pid = first.daemon
    assert pid is not None
    for key in ENV_KEYS:  # as if that server had died without stopping it: a new process
        monkeypatch.delenv(key, raising=False)
    second = mps.start(50, UUID, root=root)
    assert second.active and second.daemon == pid and second.started_here
    second.stop()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_site_daemon_named_by_the_environment_is_used_and_left_running(control, tmp_path,
                                                                         monkeypatch):
    site = tmp_path / "site-pipe"
    site.mkdir()
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(site))
    subprocess.run([str(control), "-d"], env=env, check=True)
    pid = int((site / mps.PID_FILE).read_text())
    monkeypatch.setenv(mps.PIPE_ENV, str(site))
    m = mps.start(50, UUID, root=str(tmp_path / "unused"))
    assert m.active and m.daemon == pid and not m.started_here
    m.stop()
    assert _alive(pid), "a daemon the server did not start is not the server's to quit"
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("case, expect", [
    ("no gpu", "no GPU"),
    ("no binary", "not on PATH"),
    ("daemon fails", "exited 1 and no daemon runs in .*cannot find a supported GPU"),
])
def test_where_mps_cannot_run_it_is_inactive_and_says_why(control, tmp_path, monkeypatch, case,
                                                          expect):
    if case == "no binary":
        monkeypatch.setenv("PATH", "/nonexistent")
    if case == "daemon fails":
        monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    m = mps.start(50, None if case == "no gpu" else UUID, root=str(tmp_path / "mps"), timeout_s=1)
    assert not m.active and m.daemon is None
    assert re.search(expect, m.reason), m.reason
    assert mps.PIPE_ENV not in os.environ  # the server stays an ordinary CUDA process
    m.stop()  # harmless


def _job(env=None) -> Job:
    return Job(id=7, name="t", command=["true"], cwd="/", env=env or {}, gpu_mem=4 << 30,
               priority=0, policy="pause", state="running", reason=None, submitted_at=0.0,
               started_at=None, ended_at=None, pid=None, pid_starttime=None, exit_code=None,
               log_path="/tmp/job-7.log", cancel_requested=False, starts=1)


def test_a_job_becomes_an_mps_client_with_capped_sms_low_priority_its_memory_and_no_hook():
    s = LaunchSettings(gpu_uuid=UUID, gpu_total=80 << 30, share_path="/dev/shm/word",
                       mps_pipe_dir="/tmp/p/pipe", mps_log_dir="/tmp/p/log", mps_job_sm_percent=35)
    env = job_env(_job(), s, base={mps.PRIORITY_ENV: "0"})  # the server's own value: not the job's
    assert env[mps.PIPE_ENV] == "/tmp/p/pipe" and env[mps.LOG_ENV] == "/tmp/p/log"
    assert env[mps.PERCENT_ENV] == "35" and env[mps.PRIORITY_ENV] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == UUID
    assert env[mps.MEM_LIMIT_ENV] == "0=4096M"  # its declared 4 GiB, enforced by MPS
    assert "VISIONSERVE_GUARD_SHARE" not in env  # kernels run beside the server's: no waiting
    own = job_env(_job({mps.PERCENT_ENV: "80", mps.MEM_LIMIT_ENV: "0=80G"}), s, base={})
    assert own[mps.PERCENT_ENV] == "80" and own[mps.PRIORITY_ENV] == "1"  # the job's own wins
    assert own[mps.MEM_LIMIT_ENV] == "0=4096M"  # but never over its declaration


def test_without_mps_a_job_gets_no_mps_variables_from_the_server():
    s = LaunchSettings(gpu_uuid=UUID, gpu_total=80 << 30, share_path="/dev/shm/word")
    env = job_env(_job(), s, base={mps.PIPE_ENV: "/tmp/p/pipe", mps.PERCENT_ENV: "50"})
    assert not any(k in env for k in ENV_KEYS)
    assert env["VISIONSERVE_GUARD_SHARE"] == "/dev/shm/word"  # cooperative yielding instead


def test_an_mps_job_is_recorded_as_mps_whatever_its_hook_says(tmp_path):
    sh = JobSharing(None, now=100.0, mps=True)
    assert sh.mechanism == "mps" and sh.recorded == "mps" and not sh.cooperative
    assert sh.read(101.0) is False and sh.summary(101.0)["mechanism"] == "mps"
    plain = JobSharing(None, now=100.0)
    assert plain.recorded == "process" and plain.summary(101.0)["mechanism"] == "process"
