"""``visionserve bench`` against a real server on loopback: the report has every promised field."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def http_server(tiny_repo, tmp_path_factory):
    from conftest import start_server

    grpc = importlib.util.find_spec("visionserve.grpc.server") is not None
    s = start_server(tiny_repo, tmp_path_factory.mktemp("benchsrv"), grpc=grpc)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def image_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("imgcache"))


def _bench(image_cache: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VISIONSERVE_IMAGE_CACHE": image_cache}
    return subprocess.run([sys.executable, "-m", "visionserve", "bench", "--images", "gen:320x240:n=3",
                           "--model", "tiny", *args], check=False, capture_output=True, text=True,
                          timeout=180, env=env, cwd=str(REPO))


def test_closed_loop_with_bare_reference(http_server, tiny_repo, tmp_path, image_cache):
    out = _bench(image_cache, "--url", http_server.url, "--models", str(tiny_repo), "--bare",
                 "--bare-seconds", "0.3", "--concurrency", "4", "--duration-s", "2", "--warmup-s", "0.5",
                 "--processes", "2", "--budget-ms", "5000", "--json", str(tmp_path / "r.json"),
                 "--plots", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    run = report["runs"][0]
    assert run["answered_ok"] > 0 and run["sent"] >= run["answered_ok"]
    assert set(run["latency_ms"]) >= {"p50", "p90", "p99", "p99.9", "max"}
    assert run["latency_ms"]["p50"] <= run["latency_ms"]["p99"] <= run["latency_ms"]["max"]
    assert run["throughput_fps"] > 0
    assert run["miss_ratio"] == 0
    assert run["errors"] == {}
    # server-side batch sizes from /metrics deltas, and per frame from the inspect answers
    server_bs = run["batch_size_server"]
    assert server_bs["batches"] > 0 and server_bs["mean_batch_size"] >= 1
    assert sum(server_bs["distribution"].values()) == server_bs["batches"]
    assert run["batch_size_per_frame"]["mean"] >= 1
    # every served figure against the bare model measured in the same run
    assert set(report["bare"]["batch_sizes"]) == {"1", "8"}
    assert run["vs_bare"]["throughput_over_bare_pipeline_bs1"] > 0
    assert "p50_added_ms_over_bare_pipeline_bs1" in run["vs_bare"]
    assert run["answers_vs_bare"]["checked"] == run["answered_ok"]
    assert run["answers_vs_bare"]["verdict_mismatches"] == 0
    assert run["answers_vs_bare"]["label_mismatches"] == 0
    assert report["meta"]["command"].startswith("visionserve bench")
    assert (tmp_path / "r-cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_open_loop_oip_binary(http_server, tmp_path, image_cache):
    out = _bench(image_cache, "--url", http_server.url, "--protocol", "oip", "--rate", "20",
                 "--arrival", "poisson", "--duration-s", "2", "--warmup-s", "0.3", "--processes", "2",
                 "--budget-ms", "5000", "--json", str(tmp_path / "o.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads((tmp_path / "o.json").read_text())["runs"][0]
    assert run["mode"] == "open-loop" and run["offered_rate"] == 20
    assert run["answered_ok"] > 10 and run["errors"] == {}
    assert run["send_lag_ms"]["p99"] is not None


def test_server_pid_and_threads_say_what_the_servers_threads_do(http_server, tmp_path,
                                                               image_cache):
    """--server-pid: the event loop's CPU per frame; --threads: the server's threads sampled
    through the run (py-spy), in the report and the summary."""
    out = _bench(image_cache, "--url", http_server.url, "--server-pid", str(http_server.proc.pid),
                 "--rate", "20", "--duration-s", "2", "--warmup-s", "0.3", "--processes", "1",
                 "--budget-ms", "5000", "--threads", "--json", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads((tmp_path / "t.json").read_text())["runs"][0]
    # the serving process's event loop: its CPU per frame and its share of a core
    assert run["server_loop_cpu_us_per_frame"] > 0 and 0 < run["server_loop_cpu_share"] <= 1
    threads = run["threads"]
    if "error" in threads:
        pytest.skip(f"py-spy cannot sample the server here: {threads['error']}")
    loop = next(t for name, t in threads["threads"].items() if name.endswith(" MainThread"))
    assert loop["samples"] > 0 and abs(sum(loop["share"].values()) - 1) < 0.01
    assert "interpreter_wait" in out.stdout  # the table's header


def test_sweep_finds_max_rate_and_plots(http_server, tmp_path, image_cache):
    out = _bench(image_cache, "--url", http_server.url, "--sweep", "5,10", "--duration-s", "1",
                 "--warmup-s", "0.3", "--processes", "1", "--budget-ms", "5000",
                 "--json", str(tmp_path / "s.json"), "--plots", str(tmp_path / "s"))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["sweep"]["max_rate_at_slo"] == 10
    assert [r["offered_rate"] for r in report["runs"]] == [5, 10]
    assert (tmp_path / "s-sweep.png").is_file()


def test_impossible_budget_fails_check_with_misses(http_server, tmp_path, image_cache):
    out = _bench(image_cache, "--url", http_server.url, "--rate", "10", "--duration-s", "1", "--warmup-s", "0",
                 "--processes", "1", "--budget-ms", "0.01", "--check", "--json", str(tmp_path / "x.json"))
    assert out.returncode == 1, out.stderr[-3000:]
    run = json.loads((tmp_path / "x.json").read_text())["runs"][0]
    assert run["miss_ratio"] == 1.0 and run["errors"].get("late", 0) > 0


@pytest.mark.skipif(importlib.util.find_spec("visionserve.grpc.server") is None,
                    reason="the gRPC front end is not in this checkout yet")
def test_grpc(http_server, tmp_path, image_cache):
    out = _bench(image_cache, "--url", http_server.url, "--protocol", "grpc", "--grpc-url", http_server.grpc_url,
                 "--concurrency", "2", "--duration-s", "1", "--warmup-s", "0.3", "--processes", "1",
                 "--budget-ms", "5000", "--json", str(tmp_path / "g.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads((tmp_path / "g.json").read_text())["runs"][0]
    assert run["answered_ok"] > 0 and run["errors"] == {}


def test_overload_mode_short(http_server, tmp_path, image_cache):
    """The overload benchmark's command in a short mode: capacity, then 1x and each multiple. The
    report holds what docs/benchmarks.md quotes; the speed targets are the benchmark's, not here."""
    out = _bench(image_cache, "--url", http_server.url, "--overload", "1.5", "--capacity-concurrency", "4",
                 "--duration-s", "1", "--warmup-s", "0.2", "--processes", "1", "--deadline-ms", "500",
                 "--arrival", "poisson", "--json", str(tmp_path / "o.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "o.json").read_text())
    assert [r["phase"] for r in report["runs"]] == ["capacity", "overload", "overload"]
    o = report["overload"]
    assert o["capacity_fps"] > 0 and o["goodput_at_1x_fps"] > 0 and o["deadline_ms"] == 500
    assert [t["multiple"] for t in o["multiples"]] == [1.0, 1.5]
    for t in o["multiples"]:
        assert {"offered_fps", "goodput_fps", "goodput_over_1x", "refused_share", "refusal_p99_ms",
                "refused_without_retry_after", "late", "other"} <= set(t)
        assert t["refused_without_retry_after"] == 0  # every 503 carries Retry-After
    run = report["runs"][1]["overload"]
    assert run["sent"] == (run["in_time"] + run["refused_with_retry_after"] + run["refused_without_retry_after"]
                           + run["late"] + run["other"])
    assert isinstance(o["passed"], bool)
    assert "overload: capacity" in out.stdout and "1.5x:" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--overload", "0"], "multiples must be > 0"),
    (["--overload", "x"], "--overload"),
    (["--overload", "2", "--rounds", "0"], "--rounds must be >= 1"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--sweep", "10:5:1"], "--sweep"),
    (["--bare"], "need --models"),
    (["--images", "gen:12xfoo"], "not WIDTHxHEIGHT"),
    (["--url", "http://127.0.0.1:9"], "cannot reach"),
])
def test_bad_arguments_are_clear_errors(args, message, image_cache):
    out = _bench(image_cache, "--duration-s", "1", *args)
    assert out.returncode in (2, 3)
    assert message in out.stderr
    assert "Traceback" not in out.stderr
