"""The takt line test (loadtest/locustfile.py) against a real server: CSVs, exit codes."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
LOCUST = Path(sys.executable).with_name("locust")

pytestmark = pytest.mark.skipif(not LOCUST.exists(), reason="locust is not installed (extra 'load')")


@pytest.fixture(scope="module")
def image_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("imgcache"))


def _locust(server_url: str, csv_prefix: Path, image_cache: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(LOCUST), "-f", str(LOCUSTFILE), "--headless", "-u", "2", "-r", "2", "-t", "4s",
           "--host", server_url, "--csv", str(csv_prefix), "--model", "tiny", "--images", "gen:320x240:n=3",
           "--takt-ms", "200", "--only-summary", *extra]
    env = {**os.environ, "VISIONSERVE_IMAGE_CACHE": image_cache, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO))


def _names(stats_csv: Path) -> set[str]:
    with open(stats_csv, newline="") as f:
        return {row["Name"] for row in csv.DictReader(f)}


@pytest.fixture(scope="module")
def http_server(tiny_repo, tmp_path_factory):
    from conftest import start_server

    s = start_server(tiny_repo, tmp_path_factory.mktemp("locustsrv"), grpc=False)
    yield s
    s.stop()


def test_line_test_within_takt_exits_zero_and_writes_csv(http_server, tmp_path, image_cache):
    out = _locust(http_server.url, tmp_path / "line", image_cache, "--budget-ms", "5000")
    assert out.returncode == 0, out.stderr[-3000:]
    for suffix in ("stats", "failures", "exceptions", "stats_history"):
        assert (tmp_path / f"line_{suffix}.csv").is_file()
    names = _names(tmp_path / "line_stats.csv")
    assert "inspect" in names and "Aggregated" in names
    assert "PASS" in out.stderr


def test_impossible_budget_exits_nonzero_with_misses_named(http_server, tmp_path, image_cache):
    out = _locust(http_server.url, tmp_path / "tight", image_cache, "--budget-ms", "0.01")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "inspect deadline-miss" in _names(tmp_path / "tight_stats.csv")
    assert "FAIL" in out.stderr


def test_bad_image_folder_is_a_clear_error(http_server, tmp_path, image_cache):
    out = _locust(http_server.url, tmp_path / "bad", image_cache, "--images", str(tmp_path / "missing"))
    assert out.returncode != 0
    assert "does not exist" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(importlib.util.find_spec("visionserve.grpc.server") is None,
                    reason="the gRPC front end is not in this checkout yet")
def test_grpc_stations(tiny_repo, server_factory, tmp_path, image_cache):
    s = server_factory(tiny_repo)
    out = _locust(s.url, tmp_path / "grpc", image_cache, "--protocol", "grpc", "--grpc-target", s.grpc_url,
                  "--budget-ms", "5000")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ModelInfer" in _names(tmp_path / "grpc_stats.csv")


# -- issue 15, item 9 ------------------------------------------------------------------------------
def test_unknown_model_stops_the_run_before_it_starts(http_server, tmp_path, image_cache):
    """No whole test run on 404s: the model is looked up first, and the served ones are named."""
    out = _locust(http_server.url, tmp_path / "nomodel", image_cache, "--model", "nope",
                  "--budget-ms", "5000")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "--model 'nope'" in out.stderr and "it serves: tiny" in out.stderr
    assert "PASS" not in out.stderr and "p99" not in out.stderr and "Traceback" not in out.stderr


def test_errors_are_named_by_class_and_a_run_without_verdicts_fails(http_server, tmp_path, image_cache):
    """Every frame refused (400, bodies naming the part): one failures row for the class, not one
    per part, no latency figures over the errors, and exit 1 even when errors are tolerated."""
    folder = tmp_path / "broken"
    folder.mkdir()
    for i in range(3):
        (folder / f"frame{i}.jpg").write_bytes(b"not a jpeg %d" % i)
    out = _locust(http_server.url, tmp_path / "broken", image_cache, "--images", str(folder),
                  "--budget-ms", "5000", "--max-error-ratio", "1")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "no valid answers" in out.stderr and "HTTP 400 Bad Request" in out.stderr
    assert "PASS" not in out.stderr
    with open(tmp_path / "broken_failures.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["Name"], r["Error"]) for r in rows] == [("inspect error", "HTTP 400 Bad Request")]
    assert int(rows[0]["Occurrences"]) > 3
    assert "first HTTP 400 Bad Request" in out.stderr  # the detail, once
