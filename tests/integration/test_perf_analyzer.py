"""Triton's perf_analyzer, unchanged, against a real server over HTTP, gRPC and gRPC streaming.

perf_analyzer lives in its own venv (``tests/tools/setup_perf_analyzer.sh`` makes it) so that it
does not pin the project's tritonclient; without that venv these tests skip and say so.
"""

from __future__ import annotations

import base64
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WRAPPER = REPO / "tests" / "tools" / "perf_analyzer"
VENV = REPO / ".work" / "perf-venv"



def _not_ready() -> str | None:
    """Why perf_analyzer cannot run here (absent, or it does not start), or None."""
    if not (VENV / "bin" / "perf_analyzer").exists():
        return f"perf_analyzer is not set up ({VENV} is absent): run tests/tools/setup_perf_analyzer.sh"
    try:
        run = subprocess.run([str(WRAPPER), "--version"], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"perf_analyzer does not start: {exc}"
    if run.returncode == 127 or "error while loading shared libraries" in run.stderr:
        return (f"perf_analyzer does not start: {run.stderr.strip()[:200]} "
                "(tests/tools/setup_perf_analyzer.sh says what to install)")
    return None


_WHY = _not_ready()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def perf_input(jpeg: bytes, folder: Path) -> Path:
    """perf_analyzer's --input-data file, made by the documented tool (tests/tools/perf_input.py):
    a BYTES tensor as base64 of its binary form (4-byte little-endian length, then the JPEG)."""
    image = folder / "part.jpg"
    image.write_bytes(jpeg)
    made = subprocess.run([sys.executable, str(REPO / "tests" / "tools" / "perf_input.py"), str(image)],
                          capture_output=True, text=True, check=True)
    entry = json.loads(made.stdout)["data"][0]["image"]["b64"]
    assert base64.b64decode(entry) == struct.pack("<I", len(jpeg)) + jpeg
    path = folder / "input.json"
    path.write_text(made.stdout)
    return path


@pytest.mark.parametrize("protocol,extra", [
    ("http", []),
    ("grpc", ["-b", "2"]),
    ("grpc", ["--streaming"]),
], ids=["http", "grpc-batch2", "grpc-streaming"])
def test_perf_analyzer_runs_and_reports_throughput(tiny_server, jpeg_bytes, tmp_path, protocol, extra):
    url = tiny_server.url.removeprefix("http://") if protocol == "http" else tiny_server.grpc_url
    csv = tmp_path / "perf.csv"
    cmd = [str(WRAPPER), "-m", "tiny", "-i", protocol, "-u", url,
           "--input-data", str(perf_input(jpeg_bytes, tmp_path)), "--shape", "image:1",
           "--concurrency-range", "2",
           "--measurement-mode", "count_windows", "--measurement-request-count", "40",
           "--stability-percentage", "50", "--max-trials", "6", "-f", str(csv), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    m = re.search(r"Concurrency: 2, throughput: ([0-9.]+) infer/sec", out)
    assert m and float(m.group(1)) > 0, out
    # the server-side statistics perf_analyzer read back through the statistics extension
    assert re.search(r"Inference count: [1-9]", out), out
    header, row = csv.read_text().splitlines()[:2]
    assert header.startswith("Concurrency,Inferences/Second")
    assert float(row.split(",")[1]) > 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_against_a_detector(server_factory, jpeg_bytes, tmp_path, protocol):
    """A detector's outputs (num_detections, fixed-capacity boxes/scores/classes, reasons) as
    model configuration and answers that perf_analyzer reads unchanged (issue 17)."""
    from tests.tools import detmodels

    repo = detmodels.make_repo(tmp_path / "repo", ["det-yolo"])
    s = server_factory(repo)
    url = s.url.removeprefix("http://") if protocol == "http" else s.grpc_url
    cmd = [str(WRAPPER), "-m", "det-yolo", "-i", protocol, "-u", url,
           "--input-data", str(perf_input(jpeg_bytes, tmp_path)), "--shape", "image:1",
           "--concurrency-range", "2", "--measurement-mode", "count_windows",
           "--measurement-request-count", "40", "--stability-percentage", "50",
           "--max-trials", "6"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    m = re.search(r"Concurrency: 2, throughput: ([0-9.]+) infer/sec", out)
    assert m and float(m.group(1)) > 0, out
