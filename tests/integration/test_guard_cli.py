"""``visionserve guard`` as a user runs it: real CLI processes, a real supervisor process that is
SIGKILLed and restarted, and jobs that count their own runs in a file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_for

from visionserve.guard import proc
from visionserve.guard.memory import write_simulation
from visionserve.guard.store import JobStore

REPO = str(Path(__file__).resolve().parents[2])
GIB = 1024**3




@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, PYTHONPATH=REPO, VISIONSERVE_GUARD_DB=str(tmp_path / "g.sqlite"))
    yield e
    # leave no job behind, whatever the test did
    for job in JobStore(e["VISIONSERVE_GUARD_DB"]).list(("running", "paused")):
        if job.pid and proc.is_alive(job.pid, job.pid_starttime):
            proc.signal_group(job.pid, signal.SIGKILL)


def cli(env, *args, timeout=30):
    return subprocess.run([sys.executable, "-m", "visionserve", "guard", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def start_supervisor(env, tmp_path, *extra):
    gpu = str(tmp_path / "gpu.json")
    if not os.path.exists(gpu):
        write_simulation(gpu, total=16 * GIB)
    return subprocess.Popen([sys.executable, "-m", "visionserve", "guard", "run", "--poll-hz", "20",
                             "--simulate-memory", gpu, "--margin", "0", *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def job_state(env, job_id):
    return JobStore(env["VISIONSERVE_GUARD_DB"]).get(job_id)


def counting_job(tmp_path, seconds):
    runs = tmp_path / "runs.txt"
    return runs, ["--", sys.executable, "-c",
                  f"import time; open({str(runs)!r}, 'a').write('run\\n'); time.sleep({seconds})"]


@pytest.mark.parametrize("args, words", [
    (["submit", "--gpu-mem", "8XB", "--", "true"], "not a size: '8XB'"),
    (["submit", "true"], "missing '--'"),
    (["submit", "--"], "empty command"),
    (["submit", "--env", "NOEQUALS", "--", "true"], "KEY=VALUE"),
    (["show", "4242"], "no guard job with id 4242"),
    (["cancel", "4242"], "no guard job with id 4242"),
    (["logs", "4242"], "no guard job with id 4242"),
    (["run", "--poll-hz", "2"], "--poll-hz"),
    (["run", "--margin", "lots"], "--margin"),
])
def test_bad_input_is_a_one_line_error(env, args, words):
    r = cli(env, *args)
    assert r.returncode != 0
    assert words in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_submit_list_show_logs_cancel(env, tmp_path):
    r = cli(env, "submit", "--name", "hello", "--gpu-mem", "1GiB", "--priority", "2",
            "--env", "GREETING=hi", "--", sys.executable, "-c",
            "import os; print(os.environ['GREETING'], os.environ['VISIONSERVE_GUARD_JOB_ID'])")
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout)
    listed = json.loads(cli(env, "list", "--json").stdout)
    assert [(j["id"], j["state"], j["gpu_mem"]) for j in listed] == [(job_id, "queued", GIB)]
    assert "hello" in cli(env, "list").stdout
    queued_only = int(cli(env, "submit", "--", "true").stdout)
    r = cli(env, "cancel", str(queued_only))
    assert r.returncode == 0 and "cancelled" in r.stdout
    assert cli(env, "cancel", str(queued_only)).returncode != 0  # already ended
    sup = start_supervisor(env, tmp_path)
    try:
        wait_for(lambda: job_state(env, job_id).state == "succeeded", what="job to succeed")
        r = cli(env, "logs", str(job_id))
        assert f"hi {job_id}" in r.stdout
        shown = json.loads(cli(env, "show", str(job_id)).stdout)
        assert shown["exit_code"] == 0 and shown["state"] == "succeeded"
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.wait(10)


def test_cancel_running_job_via_supervisor_and_follow_logs(env, tmp_path):
    sup = start_supervisor(env, tmp_path)
    try:
        job_id = int(cli(env, "submit", "--", sys.executable, "-u", "-c",
                         "import time; print('tick', flush=True); time.sleep(60)").stdout)
        wait_for(lambda: job_state(env, job_id).pid, what="job to run")
        follower = subprocess.Popen([sys.executable, "-m", "visionserve", "guard", "logs",
                                     str(job_id), "--follow"], env=env, stdout=subprocess.PIPE,
                                    text=True)
        r = cli(env, "cancel", str(job_id))
        assert r.returncode == 0 and "cancelled" in r.stdout, r.stderr
        out, _ = follower.communicate(timeout=10)  # --follow ends with the job
        assert "tick" in out
        assert job_state(env, job_id).state == "cancelled"
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.wait(10)


def test_second_supervisor_on_the_same_db_is_refused(env, tmp_path):
    sup = start_supervisor(env, tmp_path)
    try:
        wait_for(lambda: JobStore(env["VISIONSERVE_GUARD_DB"]).supervisor(), what="lease")
        r = cli(env, "run", "--device", "cpu")
        assert r.returncode != 0 and "another guard supervisor" in r.stderr
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.wait(10)


def test_supervisor_sigkill_mid_job_then_restart_readopts_and_never_reruns(env, tmp_path):
    runs, cmd = counting_job(tmp_path, 1.5)
    job_id = int(cli(env, "submit", *cmd).stdout)
    sup = start_supervisor(env, tmp_path)
    wait_for(lambda: runs.exists(), what="job to start")
    sup.kill()  # SIGKILL: no chance to clean up
    sup.wait(10)
    running = job_state(env, job_id)
    assert running.state == "running" and proc.is_alive(running.pid, running.pid_starttime)
    sup2 = start_supervisor(env, tmp_path)
    try:
        done = wait_for(lambda: (j := job_state(env, job_id)).state != "running" and j,
                        timeout=15, what="re-adopted job to end")
        assert done.state == "succeeded" and done.exit_code == 0  # from the wrapper's status
        assert done.starts == 1
        assert runs.read_text().count("run") == 1
    finally:
        sup2.send_signal(signal.SIGTERM)
        sup2.wait(10)
    assert "re-adopted job" in sup2.stdout.read()


def test_job_that_died_with_the_guard_is_marked_not_rerun(env, tmp_path):
    runs, cmd = counting_job(tmp_path, 60)
    job_id = int(cli(env, "submit", *cmd).stdout)
    sup = start_supervisor(env, tmp_path)
    wait_for(lambda: runs.exists() and job_state(env, job_id).pid, what="job to start")
    sup.kill()
    sup.wait(10)
    proc.signal_group(job_state(env, job_id).pid, signal.SIGKILL)  # the job dies too
    wait_for(lambda: not proc.is_alive(job_state(env, job_id).pid, None), what="job gone")
    sup2 = start_supervisor(env, tmp_path)
    try:
        done = wait_for(lambda: (j := job_state(env, job_id)).state != "running" and j,
                        what="recovery")
        assert done.state == "killed"
        assert done.reason == "guard restarted; job was running, not re-run"
        time.sleep(0.3)  # a few supervisor ticks: it must not start the job again
        assert runs.read_text().count("run") == 1 and job_state(env, job_id).starts == 1
    finally:
        sup2.send_signal(signal.SIGTERM)
        sup2.wait(10)


def test_sigterm_leaves_running_jobs_running_and_stops_starting_new_ones(env, tmp_path):
    runs, cmd = counting_job(tmp_path, 60)
    first = int(cli(env, "submit", *cmd).stdout)
    second = int(cli(env, "submit", "--", "true").stdout)
    sup = start_supervisor(env, tmp_path)
    wait_for(lambda: job_state(env, first).pid, what="first job to start")
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(10) == 0
    job = job_state(env, first)
    assert job.state == "running" and proc.is_alive(job.pid, job.pid_starttime)
    assert job_state(env, second).state == "queued"
    assert JobStore(env["VISIONSERVE_GUARD_DB"]).supervisor() is None  # lease released


def test_stop_jobs_on_exit(env, tmp_path):
    _, cmd = counting_job(tmp_path, 60)
    job_id = int(cli(env, "submit", *cmd).stdout)
    sup = start_supervisor(env, tmp_path, "--stop-jobs-on-exit", "--grace", "2")
    wait_for(lambda: job_state(env, job_id).pid, what="job to start")
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(15) == 0
    job = job_state(env, job_id)
    assert job.state == "killed" and "shut down" in job.reason
    assert not proc.is_alive(job.pid, job.pid_starttime)


def test_cancel_without_a_supervisor_stops_the_job_itself(env, tmp_path):
    runs, cmd = counting_job(tmp_path, 60)
    job_id = int(cli(env, "submit", *cmd).stdout)
    sup = start_supervisor(env, tmp_path)
    wait_for(lambda: runs.exists() and job_state(env, job_id).pid, what="job to start")
    sup.kill()
    sup.wait(10)
    r = cli(env, "cancel", str(job_id), "--grace", "2")
    assert r.returncode == 0, r.stderr
    job = job_state(env, job_id)
    assert job.state == "cancelled"
    assert not proc.is_alive(job.pid, job.pid_starttime)


# -- issue 15, item 10: the traps a first-time user hit -------------------------------------------
def test_default_database_is_one_fixed_place_whatever_the_working_directory(tmp_path):
    """Without --db or $VISIONSERVE_GUARD_DB: $XDG_DATA_HOME/visionserve/guard.sqlite, so `list`
    from another folder shows the same queue, and each command says which database it uses."""
    data = tmp_path / "xdg-data"
    env = {k: v for k, v in os.environ.items() if k != "VISIONSERVE_GUARD_DB"}
    env.update(PYTHONPATH=REPO, XDG_DATA_HOME=str(data))
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()

    def run(cwd, *args):
        return subprocess.run([sys.executable, "-m", "visionserve", "guard", *args], env=env,
                              cwd=cwd, capture_output=True, text=True, timeout=30)

    r = run(here, "submit", "--name", "from-here", "--", "true")
    assert r.returncode == 0, r.stderr
    db = data / "visionserve" / "guard.sqlite"
    assert db.is_file() and not list(here.iterdir())
    assert str(db) in r.stderr
    listed = run(there, "list")
    assert "from-here" in listed.stdout and str(db) in listed.stdout
    shown = json.loads(run(there, "show", r.stdout.strip()).stdout)
    assert shown["database"] == str(db)
    assert "XDG_DATA_HOME" in run(there, "list", "--help").stdout
    # an empty queue says where it looked
    env["XDG_DATA_HOME"] = str(tmp_path / "other-data")
    empty = run(there, "list")
    assert empty.returncode == 0 and "no jobs in" in empty.stdout
    assert str(tmp_path / "other-data" / "visionserve" / "guard.sqlite") in empty.stdout


def test_server_hosted_guard_uses_the_same_default_database(tmp_path, monkeypatch):
    from visionserve.guard.store import default_db_path

    monkeypatch.delenv("VISIONSERVE_GUARD_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_db_path() == str(tmp_path / "visionserve" / "guard.sqlite")
    assert (tmp_path / "visionserve").is_dir()
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")  # the XDG spec: relative is ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_path() == str(tmp_path / "home" / ".local" / "share" / "visionserve" /
                                    "guard.sqlite")


def test_queued_job_without_a_supervisor_says_why_it_waits(env, tmp_path):
    r = cli(env, "submit", "--name", "waiting", "--", "true")
    job_id = int(r.stdout)
    assert "no supervisor runs on this database" in r.stderr
    assert "no supervisor runs on this database" in cli(env, "list").stdout
    [listed] = json.loads(cli(env, "list", "--json").stdout)
    assert "visionserve guard run" in listed["reason"]
    assert "no supervisor" in json.loads(cli(env, "show", str(job_id)).stdout)["reason"]
    sup = start_supervisor(env, tmp_path)
    try:
        wait_for(lambda: job_state(env, job_id).state == "succeeded", what="job to run")
        second = int(cli(env, "submit", "--", sys.executable, "-c", "import time; time.sleep(30)")
                     .stdout)
        wait_for(lambda: job_state(env, second).pid, what="second job to start")
        third = cli(env, "submit", "--", "true")  # queued behind it, a supervisor is running
        assert "no supervisor" not in third.stderr
        assert "no supervisor" not in cli(env, "list").stdout
        cli(env, "cancel", str(second))
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.wait(10)


def test_show_prints_iso_local_times(env):
    job_id = int(cli(env, "submit", "--", "true").stdout)
    shown = json.loads(cli(env, "show", str(job_id)).stdout)
    from datetime import datetime

    submitted = datetime.fromisoformat(shown["submitted_at"])
    assert submitted.tzinfo is not None  # local time, with its offset
    assert abs(submitted.timestamp() - time.time()) < 60
    assert shown["started_at"] is None and shown["ended_at"] is None


def test_bare_python_is_resolved_on_the_submitters_path_and_says_so(env, tmp_path):
    """`python` in a job is the submitter's PATH's python: the CLI shows the absolute path it
    stored and, when it is not the Python visionserve runs in, says which one that is."""
    other = tmp_path / "otherbin"
    other.mkdir()
    (other / "python").symlink_to(sys.executable)  # "a different python" on the PATH
    env = dict(env, PATH=f"{other}{os.pathsep}{env.get('PATH', '')}")
    r = cli(env, "submit", "--", "python", "-c", "pass")
    assert r.returncode == 0, r.stderr
    assert f"{other / 'python'} -c pass" in r.stderr
    assert "not the Python visionserve runs in" in r.stderr and sys.executable in r.stderr
    assert job_state(env, int(r.stdout)).command[0] == str(other / "python")
    # the interpreter visionserve runs in: no note
    r = cli(env, "submit", "--", sys.executable, "-c", "pass")
    assert "note:" not in r.stderr
