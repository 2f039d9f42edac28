"""The guard's acceptance run (issue 8) on a real GPU, in quick form.

``python -m visionserve_tools.benchguard --device cuda --quick`` as a subprocess: the server with its
budget and the hosted guard serves an open-loop paced load at half its measured saturation; the
project's own train.py runs through the guard on the same GPU, then a hostile job allocates GPU
memory until it fails. Asserted: zero inference errors, zero OOM lines in the server log, the
training job succeeded, the hostile job stopped by the watchdog with its reason recorded. The p99
ratio (training / baseline) is reported in the JSON, not asserted (a timing figure).
About 2-3 minutes on an H200. Skips cleanly where CUDA is absent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# gpu_alone: the guard reads the card's free memory; the load is paced to the saturation it measured
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_alone, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")


def _brief(res: dict) -> str:
    keep = ("error", "conditions", "p99_ratio_training_over_baseline", "phases", "oom_lines",
            "gpu_memory", "hostile_job", "training_job", "training_needs_missing")
    return json.dumps({k: res.get(k) for k in keep if k in res}, indent=1, default=str)[-6000:]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_acceptance_run_core(cuda, tmp_path):
    from visionserve_tools.benchguard import kill_jobs

    out = tmp_path / "result.json"
    old = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO) + (os.pathsep + old if old else "")}
    p = subprocess.Popen(
        [sys.executable, "-m", "visionserve_tools.benchguard", "--device", "cuda", "--quick",
         "--hostile-policy", "stop", "--out", str(out), "--log-dir", str(tmp_path)],
        cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        output, _ = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the script, its server and its client processes
        output, _ = p.communicate()
        pytest.fail(f"benchguard did not finish in {TIMEOUT_S} s:\n{output[-4000:]}")
    finally:
        for db in tmp_path.glob("guard-*.sqlite"):  # guard jobs outlive the server: stop them
            kill_jobs(db)
    assert out.exists(), output[-4000:]
    res = json.loads(out.read_text())
    brief = _brief(res)
    print(brief)  # the figures, in the test log
    assert p.returncode == 0 and "error" not in res, output[-4000:] + "\n" + brief

    phases = res["phases"]
    assert set(phases) == {"baseline", "training", "hostile", "all"}, brief
    for name, ph in phases.items():
        assert ph["count"] > 0, f"no requests in phase {name}\n{brief}"
    # zero inference errors, in every phase, hostile included
    assert phases["all"]["errors"] == 0, brief
    assert res["conditions"]["zero_inference_errors"] is True, brief
    # zero OOMs: the server never ran out of memory
    assert res["oom_lines"] == [], brief
    # the project's own training script ran through the guard on the GPU and finished
    job = res["training_job"]
    assert job["state"] == "succeeded" and job["exit_code"] == 0, brief
    # the hostile job was stopped by the watchdog, with its reason recorded
    h = res["hostile_job"]
    assert h["state_when_acted"] == "killed", brief
    assert h["by_watchdog"] is True, brief
    reason = h["reason_when_acted"] or ""
    assert "over its declared" in reason or "inference floor" in reason, brief
    assert h["state"] == "killed", brief
    assert res["jobs_killed_at_cleanup"] == [], brief
