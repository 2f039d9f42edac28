"""benchpipe: the served path's two runner threads measured without the serving process."""

from __future__ import annotations

import json
import time

import pytest

from visionserve_tools import benchpipe


def test_the_pipeline_says_which_thread_waits_for_the_other():
    """A preparation slower than the model: the compute thread waits for the prep thread, and
    the rate is the preparation's."""
    out = benchpipe.pipeline(lambda: time.sleep(0.01) or "x", lambda x: time.sleep(0.001), 8,
                             seconds=0.5, warm_s=0.1)
    assert out["batches"] > 0
    assert out["compute_waits_for_prep_ms"] > 5 * out["prep_waits_for_compute_ms"]
    assert out["frames_per_s"] == pytest.approx(out["batches"] * 8 / out["window_s"], rel=0.01)
    # and the other way round
    out = benchpipe.pipeline(lambda: "x", lambda x: time.sleep(0.01), 8, seconds=0.5, warm_s=0.1)
    assert out["prep_waits_for_compute_ms"] > 5 * out["compute_waits_for_prep_ms"]


def test_a_failing_pipeline_is_an_error_not_a_hang():
    def run(x):
        raise ValueError("broken model")

    with pytest.raises(RuntimeError, match="broken model"):
        benchpipe.pipeline(lambda: "x", run, 8, seconds=0.2, warm_s=0.05)


def test_the_pipeline_benchmark_runs_its_cases_in_processes_of_their_own(tmp_path):
    """The whole run on the CPU (the shipped path's decode and the real torch backend): the
    bare model, one batch alone, one process and two at once, each size, as ratios to the bare
    model; the GPU-only case (two streams) is left out."""
    from tests.tools.integrity import make_repo

    repo = make_repo(tmp_path / "repo", backend="torch")
    out = tmp_path / "pipe.json"
    assert benchpipe.main(["--device", "cpu", "--model-dir", str(repo / "means"), "--batch", "8",
                           "--seconds", "0.5", "--processes", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["pipeline"]
    assert res["bare"]["frames_per_s"] > 0
    for size in ("640x480", "1080p"):
        assert res[f"alone_{size}"]["prep_ms"] > 0
        one, two = res[f"one stream, {size}"], res[f"2 processes, {size}"]
        assert len(one["per_process"]) == 1 and len(two["per_process"]) == 2
        for case in (one, two):
            assert case["frames_per_s"] > 0
            assert case["frames_per_s"] == round(sum(p["frames_per_s"]
                                                     for p in case["per_process"]), 1)
            assert case["ratio_to_bare"] == round(case["frames_per_s"]
                                                  / res["bare"]["frames_per_s"], 3)
    assert not any(k.startswith("two streams") for k in res)
