"""``python -m visionserve_tools.benchguard --device cpu --quick``: the guard's acceptance run on this
machine, as a real subprocess (real server with ``--guard``, real client processes, the project's
own trainer, ``visionserve_tools.training.train``, submitted through ``POST /v1/guard/jobs``). No
timing assertions: the p99 ratio is reported, not asserted, on a CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(REPO) + (os.pathsep + old if old else "")}


def _run(args: list[str], timeout: float) -> tuple[int, str]:
    p = subprocess.Popen([sys.executable, "-m", "visionserve_tools.benchguard", *args], cwd=str(REPO),
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the script, its server and its clients
        out, _ = p.communicate()
        pytest.fail(f"benchguard did not finish in {timeout} s:\n{out[-4000:]}")
    return p.returncode, out


def test_cpu_quick_acceptance_run(tmp_path):
    from visionserve_tools.benchguard import kill_jobs

    versions_before = sorted(p.name for p in (REPO / "models" / "defect-classifier").iterdir())
    out = tmp_path / "result.json"
    try:
        rc, output = _run(["--device", "cpu", "--quick", "--rate", "6", "--processes", "2",
                           "--out", str(out), "--log-dir", str(tmp_path)], timeout=240)
    finally:
        for db in tmp_path.glob("guard-*.sqlite"):  # never leave a job behind, whatever happened
            kill_jobs(db)
    assert rc == 0, output[-4000:]
    res = json.loads(out.read_text())
    assert "error" not in res, res["error"]

    assert res["saturation"]["answers"] > 0
    assert res["rate_per_s"] == 6.0
    phases = res["phases"]
    assert set(phases) == {"baseline", "training", "all"}
    for name, p in phases.items():
        assert p["count"] > 0, (name, p)
        assert p["errors"] == 0, (name, p["errors_by_status"])
        assert p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"] <= p["max_ms"], (name, p)
    # the training job ran through the guard and finished by itself
    job = res["training_job"]
    assert job["state"] == "succeeded" and job["exit_code"] == 0, job
    assert [t["state"] for t in job["transitions"]][-1] == "succeeded"
    assert "running" in [t["state"] for t in job["transitions"]]
    assert '"epoch": 1' in job["log_tail"], job["log_tail"]
    assert Path(job["log_path"]).is_file()
    # no GPU: no hostile job, said so; that condition is skipped, not failed
    assert "skipped" in res["hostile_job"]
    assert res["conditions"]["hostile_stopped_or_paused_by_watchdog"] is None
    assert res["conditions_skipped"] == ["hostile_stopped_or_paused_by_watchdog"]
    assert res["conditions"]["zero_inference_errors"] is True
    assert res["conditions"]["zero_oom_lines"] is True and res["oom_lines"] == []
    assert res["conditions"]["training_job_succeeded"] is True
    assert isinstance(res["pass"], bool)
    assert res["p99_ratio_training_over_baseline"] > 0
    # nothing left running, nothing written into the repository's model folder
    assert res["jobs_killed_at_cleanup"] == []
    assert sorted(p.name for p in (REPO / "models" / "defect-classifier").iterdir()) == versions_before
    assert Path(res["server_log"]).is_file()


@pytest.mark.parametrize("args, expect", [
    (["--rate", "0"], "--rate must be > 0"),
    (["--load-fraction", "1.5"], "--load-fraction must be in (0, 1]"),
    (["--train-gpu-mem", "8XB"], "--train-gpu-mem"),
    (["--device", "tpu"], "invalid choice"),
])
def test_bad_arguments_are_refused(tmp_path, args, expect):
    rc, output = _run(["--device", "cpu", *args, "--out", str(tmp_path / "r.json")], timeout=60)
    assert rc == 2, output
    assert expect in output, output
    assert "Traceback" not in output
    assert not (tmp_path / "r.json").exists()
