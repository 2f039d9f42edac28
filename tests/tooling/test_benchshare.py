"""``python -m visionserve_tools.benchshare --device cpu --quick``: the GPU-sharing run of issue 22
as a dry run on this machine (a real server with the hosted guard and its latency budget, real
client processes, the training job of visionserve_tools.trainloop submitted three times through
the guard's API). Checks that every piece of the prepared GPU run works; no timing assertions."""

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


def test_cpu_dry_run_of_the_sharing_benchmark(tmp_path):
    pytest.importorskip("torchvision")
    from visionserve_tools.benchguard import kill_jobs

    out = tmp_path / "share.json"
    old = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO) + (os.pathsep + old if old else "")}
    p = subprocess.Popen([sys.executable, "-m", "visionserve_tools.benchshare", "--device", "cpu",
                          "--quick", "--rate", "6", "--processes", "2", "--baseline-s", "4",
                          "--alone-s", "3", "--share-s", "4", "--out", str(out),
                          "--log-dir", str(tmp_path)], cwd=str(REPO), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        output, _ = p.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        output, _ = p.communicate()
        pytest.fail(f"benchshare did not finish:\n{output[-4000:]}")
    finally:
        for db in tmp_path.glob("guard-*.sqlite"):
            kill_jobs(db)
    assert p.returncode == 0, output[-4000:]
    res = json.loads(out.read_text())
    assert "error" not in res, res["error"]
    assert set(res["phases"]) == {"baseline", "process", "yield", "yield_bound", "all"}
    for name, ph in res["phases"].items():
        assert ph["count"] > 0 and ph["errors"] == 0, (name, ph)
        assert ph["server_p99_ms"] <= ph["rtt_p99_ms"] + 1e-6, (name, ph)  # inside the round trip
        assert "send_lag_p99_ms" in ph and "client_wake_lag_p99_ms" in ph
    for name in ("train_alone", "train_process", "train_yield", "train_yield_bound"):
        job = res[name]
        assert job["state"] == "succeeded", job
        assert job["train"]["steps_per_s"] > 0
    # the guard recorded which mechanism applied: the hook in the yield phase, none otherwise
    assert res["train_yield"]["mechanism"] == "yield" and res["train_yield"]["train"]["hook"]
    assert res["train_yield"]["sharing"]["hooks"] > 0
    assert res["train_yield_bound"]["sharing"]["mode"] == "bound"
    assert res["train_yield"]["sharing"]["mode"] == "wait"
    assert res["train_process"]["mechanism"] == "process"
    assert not res["train_process"]["train"]["hook"]
    assert res["cpu"]["yield"]["jobs"]["threads_not_sched_idle_max"] == 0
    assert res["ratios"]["yield"]["steps_ratio_vs_alone"] > 0
    assert res["conditions"]["zero_inference_errors"] and res["conditions"]["zero_oom_lines"]
    assert "p99 ratio over baseline" in output
    assert output.rstrip().splitlines()[-1].startswith("pass")
