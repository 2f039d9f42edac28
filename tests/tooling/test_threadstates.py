"""visionserve_tools.threadstates: what each thread of a process does, from py-spy's samples."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from visionserve_tools import threadstates as ts

LOOP = "Runner.run (asyncio/runners.py:118)"


@pytest.mark.parametrize(("frames", "state", "site"), [
    # Python on top: it holds the interpreter
    ([LOOP, "Channel._flush (visionserve/frontends/channel.py:81)"], "python", "Channel._flush"),
    # a call that released the interpreter, waiting to take it back (CPython's take_gil)
    (["prepare (visionserve/gpu/preprocess.py:200)", "THPVariable_add (libtorch_python.so)",
      "pthread_cond_timedwait (libc.so.6)", "0x7f878bca3f16 (libc.so.6)"],
     "interpreter_wait", "prepare > pthread_cond_timedwait"),
    # waiting for the GPU, whatever the deepest frame
    (["_compute (visionserve/runner.py:280)", "cudaStreamSynchronize (libcudart.so.13)",
      "0x7f00 (libcuda.so.1)", "sched_yield (libc.so.6)"],
     "gpu_wait", "_compute > sched_yield"),
    # blocked, waiting for work: a lock, the loop's poll
    (["Queue.get (queue.py:171)", "lock_PyThread_acquire_lock (_threadmodule.c:83)",
      "sem_clockwait (libc.so.6)", "0x7f00 (libc.so.6)"], "idle", "Queue.get > sem_clockwait"),
    (["Condition.wait (threading.py:327)", "PyThread_acquire_lock_timed (libpython3.11.so.1.0)",
      "0x7f00 (libc.so.6)"], "idle", "Condition.wait > PyThread_acquire_lock_timed"),
    ([LOOP, "uv__io_poll (loop.cpython-311-x86_64-linux-gnu.so)", "epoll_wait (libc.so.6)"],
     "idle", "Runner.run > epoll_wait"),
    # native work: a torch op, uvloop's own code, an unnamed library address
    (["decode (visionserve/imaging.py:233)", "cv::imdecode (libopencv_imgcodecs.so)"],
     "native", "decode > cv::imdecode"),
    (["busy (x.py:5)", "0x7f878bcabcae (libc.so.6)"], "native", "busy > libc.so.6"),
    # a thread with no Python frame at all
    (["start_thread (libc.so.6)", "epoll_wait (libc.so.6)"], "idle",
     "(native thread) > epoll_wait"),
])
def test_a_sample_is_classified_by_the_native_frames_below_its_last_python_frame(frames, state,
                                                                                 site):
    assert ts.classify(frames) == (state, site)


def test_the_summary_gives_each_thread_its_shares_and_top_sites():
    raw = textwrap.dedent(f"""\
        thread (101): MainThread;{LOOP};Link.on_message (hub.py:95) 6
        thread (101): MainThread;{LOOP};epoll_wait (libc.so.6) 4
        thread (102): prep;_prep_loop (runner.py:154);pthread_cond_timedwait (libc.so.6) 3
        thread (102): prep;_prep_loop (runner.py:154);at::empty (libtorch_cpu.so) 1
        not a sample line
        """)
    s = ts.summarise(raw)["threads"]
    assert list(s) == ["101 MainThread", "102 prep"]  # most samples first
    assert s["101 MainThread"]["samples"] == 10
    assert s["101 MainThread"]["share"] == {"python": 0.6, "idle": 0.4}
    assert s["101 MainThread"]["sites"]["python"] == [["Link.on_message", 0.6]]
    assert s["102 prep"]["share"] == {"interpreter_wait": 0.75, "native": 0.25}
    assert "interpreter_wait" in ts.table({"threads": s})


def test_samples_without_the_thread_name_count_for_the_named_thread_of_that_id():
    """py-spy leaves the name out where it could not read it (CI saw this once): one entry per
    thread id all the same, named when any sample names it."""
    raw = textwrap.dedent(f"""\
        thread (101): MainThread;{LOOP};epoll_wait (libc.so.6) 4
        thread (101);{LOOP};Link.on_message (hub.py:95) 1
        thread (103);start_thread (libc.so.6);epoll_wait (libc.so.6) 2
        """)
    s = ts.summarise(raw)["threads"]
    assert list(s) == ["101 MainThread", "103 (unnamed)"]
    assert s["101 MainThread"]["samples"] == 5
    assert s["101 MainThread"]["share"] == {"python": 0.2, "idle": 0.8}


def test_no_py_spy_is_said_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("PY_SPY", str(tmp_path / "missing-py-spy"))
    out = ts.finish(ts.start(1, 1.0, tmp_path / "t.raw"), tmp_path / "t.raw")
    assert "error" in out


SPINNER = """
import hashlib, os, threading, time
data = os.urandom(1 << 20)
def spin():
    x = 0
    while True:
        x += 1
def hash_loop():  # hashlib releases the interpreter for large inputs, then waits to take it back
    while True:
        hashlib.sha256(data).digest()
threading.Thread(target=spin, name="spin", daemon=True).start()
threading.Thread(target=hash_loop, name="hasher", daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_real_recording_tells_the_spinning_thread_from_the_one_waiting_for_it(tmp_path):
    """py-spy on a real process: one thread spins in Python, one hashes (releasing the
    interpreter, then waiting behind the spinner to take it back), the main thread sleeps."""
    if ts.py_spy() is None:
        pytest.skip("py-spy is not installed")
    proc = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
        raw = tmp_path / "t.raw"
        out = ts.finish(ts.start(proc.pid, 2.0, raw, rate=100), raw)
    finally:
        proc.kill()
        proc.wait()
    if "error" in out:
        pytest.skip(f"py-spy cannot sample here: {out['error']}")
    by_name = {name.split(" ", 1)[1]: t for name, t in out["threads"].items()}
    assert by_name["MainThread"]["share"].get("idle", 0) > 0.9
    assert by_name["spin"]["share"].get("python", 0) > 0.5
    # the hasher spends time waiting for the interpreter the spinner holds
    assert by_name["hasher"]["share"].get("interpreter_wait", 0) > 0.1
    assert Path(out["raw"]).stat().st_size > 0


def test_the_gpu_benchmark_samples_a_real_server_through_a_saturating_load(tmp_path):
    """benchgpu's ``sampled_load`` (``--threads-s``) against a real server (on the CPU here):
    the load is measured, and the serving process's event loop and runner threads are named
    with their states."""
    from tests.tools.integrity import make_repo
    from visionserve_tools import benchgpu

    if ts.py_spy() is None:
        pytest.skip("py-spy is not installed")
    repo = make_repo(tmp_path / "repo")
    server = benchgpu.Server(repo, tmp_path / "server.log", "--frontends", "1", device="cpu")
    try:
        out = benchgpu.sampled_load(server, "means", benchgpu.make_jpegs(4, 48, 64), 1, 4, 2.0,
                                    tmp_path / "t.raw")
    finally:
        server.stop()
    assert out["answers"] > 0 and out["errors"] == 0
    if "error" in out["threads"]:
        pytest.skip(f"py-spy cannot sample here: {out['threads']['error']}")
    names = [n.split(" ", 1)[1] for n in out["threads"]["threads"]]
    assert "MainThread" in names  # the event loop
    # the runner's threads, "means:<version>#<instance>:prep" and ":compute"
    assert any(n.endswith(":prep") for n in names) and any(n.endswith(":compute") for n in names)
    loop = next(t for n, t in out["threads"]["threads"].items() if n.endswith(" MainThread"))
    assert abs(sum(loop["share"].values()) - 1) < 0.01


def test_without_py_spy_the_gpu_benchmark_skips_the_sampled_load(monkeypatch, tmp_path):
    """No py-spy (or one that cannot attach): said in the results, and no load is run for it
    (device time is scarce)."""
    from types import SimpleNamespace

    from visionserve_tools import benchgpu

    monkeypatch.setenv("PY_SPY", str(tmp_path / "missing-py-spy"))
    monkeypatch.setattr(benchgpu, "load", lambda *a, **k: pytest.fail("a load was run"))
    server = SimpleNamespace(proc=SimpleNamespace(pid=1), port=1)
    out = benchgpu.sampled_load(server, "m", [], 1, 1, 20.0, tmp_path / "t.raw")
    assert set(out) == {"threads"} and "cannot run" in out["threads"]["error"]


def test_the_gpu_benchmark_compares_server_settings_side_by_side(tmp_path):
    """benchgpu ``--compare``: the front-end scenario once per setting, each on a real server of
    its own (on the CPU here) started with it; a setting the server refuses is said and the next
    one still runs; VISIONSERVE_FRONTENDS=0 serves in-process; CODE=DIR serves another copy of
    the code; a spec that is no server setting is refused on the command line."""
    import argparse
    import shutil

    import visionserve
    from tests.tools.integrity import make_repo
    from visionserve_tools import benchgpu

    repo = make_repo(tmp_path / "repo")
    other = tmp_path / "other"  # "another commit": this code, saying where it runs from
    shutil.copytree(Path(visionserve.__file__).parent, other / "visionserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "visionserve" / "__init__.py", "a") as f:
        f.write("\nprint('code from', __file__, flush=True)\n")
    specs = [benchgpu.settings_spec(""),
             benchgpu.settings_spec("VISIONSERVE_SWITCH_INTERVAL_MS=-1"),  # refused: gt=0
             benchgpu.settings_spec("VISIONSERVE_SWITCH_INTERVAL_MS=0.05,VISIONSERVE_FRONTENDS=0"),
             benchgpu.settings_spec(f"CODE={other},VISIONSERVE_FRONTENDS=0")]
    res: dict = {}
    bare = {"torch_fp16_cuda_graph": {32: {"img_per_s": 1000}}}
    jpegs = benchgpu.make_jpegs(4, 48, 64)
    benchgpu.compare(specs, {"means": repo}, jpegs, jpegs, tmp_path, True, bare, res,
                     frontends=1, client_procs=1, threads=(1, 2), model="means", device="cpu",
                     extra=(), seconds=0.5)
    assert res["setup"]["bare_bs32_img_per_s"] == 1000
    assert res["setup"]["threads_per_client_process"] == [1, 2]
    runs = [v for k, v in res.items() if k != "setup"]
    assert [r["settings"] for r in runs] == specs
    for run in (runs[0], runs[2], runs[3]):
        assert run["single_client"]["answers"] > 0
        # where a lone frame's time goes, from the server's statistics
        one = run["single_client"]["breakdown"]["per_frame_mean_ms"]
        assert one["compute_infer"] > 0 and one["success"] >= one["compute_infer"]
        for label in ("640x480", "1080p", "640x480@2", "1080p@2"):  # @2: the second count
            sat = run[f"saturation_{label}"]
            assert sat["answers"] > 0 and sat["errors"] == 0
            assert sat["ratio_to_bare_bs32"] == round(sat["throughput_per_s"] / 1000, 3)
    assert "server exited" in runs[1]["error"]
    # each server ran with its settings (its log says them): front ends, or in-process
    assert "--frontends 1" in (tmp_path / "compare-0.log").read_text()
    last = (tmp_path / "compare-2.log").read_text()
    assert "VISIONSERVE_SWITCH_INTERVAL_MS=0.05" in last and "--frontends" not in last
    assert "code from" not in last
    assert f"code from {other / 'visionserve' / '__init__.py'}" in (
        tmp_path / "compare-3.log").read_text()
    with pytest.raises(argparse.ArgumentTypeError, match="holds no visionserve"):
        benchgpu.settings_spec(f"CODE={tmp_path}")
    with pytest.raises(argparse.ArgumentTypeError, match="VISIONSERVE_NAME=VALUE"):
        benchgpu.settings_spec("SWITCH_INTERVAL_MS=0.05")
