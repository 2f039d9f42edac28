"""``python -m visionserve_tools.benchshadow``, tiny: a real server with a candidate in shadow
beside it, real client processes, one off/on window pair. No timing assertions: the ratios are
reported, not asserted, on a shared CPU."""

from __future__ import annotations

import json

import pytest

from tests.tooling.toolrun import run_tool

pytestmark = pytest.mark.slow


def test_a_tiny_run_reports_the_ratios_and_the_shadows_counts(tmp_path):
    out = tmp_path / "shadow.json"
    rc, output = run_tool("benchshadow", "--out", str(out), "--rounds", "1", "--window-s", "4",
                          "--saturation-s", "2", "--rate", "8", "--processes", "1", timeout=240)
    assert rc == 0, output[-4000:]
    res = json.loads(out.read_text())
    assert res["rate_per_s"] == 8.0 and res["errors"] == 0
    assert res["without_shadow"]["count"] > 0 and res["with_shadow"]["count"] > 0
    assert res["ratios"]["p50"] > 0 and res["ratios"]["p99"] > 0
    assert len(res["pair_ratios"]) == 1 and res["median_pair_ratios"]["p99"] > 0
    (shadow_run,) = res["shadow_runs"]
    assert shadow_run["state"] == "stopped" and shadow_run["reason"].startswith("stopped by")
    assert res["shadow"]["judged"] > 0
    assert res["shadow"]["handed"] + res["shadow"]["dropped"] >= res["shadow"]["judged"]
    assert "ratios" in output or "p50 x" in output
