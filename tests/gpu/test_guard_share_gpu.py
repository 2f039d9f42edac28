"""Cooperative yielding on a real GPU (issue 22), in quick form: ``python -m
visionserve_tools.benchshare --device cuda --quick --no-hostile`` as a subprocess. A ResNet-50
training loop (visionserve_tools.trainloop) runs through the hosted guard beside the served bench
model: alone, with the process-level policy, with the yield hook, with the hook's bound mode.
Asserted: zero inference errors and OOM lines, every job succeeded, the guard recorded the
mechanism each one got, and the hook bounded the job's queued GPU work with CUDA events without
turning itself off. Latency and steps/s ratios are reported in the JSON, not asserted (timing).
About 2 minutes on an H200; tests/gpu/guard_share_on_device.sh runs the full form. Skips where
CUDA is absent. run_on_device.sh runs it after the tests that share the GPU."""

from __future__ import annotations

import json

import pytest

from tests.tooling.toolrun import run_tool

# gpu_alone: the guard reads the card's free memory; the load is paced to the saturation it measured
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_alone, pytest.mark.slow]

TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_training_yields_beside_a_served_model(cuda, tmp_path):
    from visionserve_tools.benchguard import kill_jobs

    out = tmp_path / "share.json"
    try:
        rc, output = run_tool("benchshare", "--device", "cuda", "--quick", "--no-hostile",
                              "--out", str(out), "--log-dir", str(tmp_path), timeout=TIMEOUT_S)
    finally:
        for db in tmp_path.glob("guard-*.sqlite"):
            kill_jobs(db)
    print(output[-3000:])  # the figures, in the test log
    assert rc == 0 and out.exists(), output[-4000:]
    res = json.loads(out.read_text())
    assert "error" not in res, res["error"]
    assert res["phases"]["all"]["errors"] == 0 and res["oom_lines"] == []
    for name in ("train_alone", "train_process", "train_yield", "train_yield_bound"):
        assert res[name]["state"] == "succeeded", res[name]
    assert res["train_process"]["mechanism"] == "process"
    for name in ("train_yield", "train_yield_bound"):
        job = res[name]
        assert job["mechanism"] == "yield", job
        assert job["sharing"]["gpu_bounded"] is True, job["sharing"]
        assert not any("yielding off" in ln for ln in job["guard_lines"]), job["guard_lines"]
