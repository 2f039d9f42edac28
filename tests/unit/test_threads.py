"""The model's threads below the event loop's priority (visionserve/threads.py; Linux)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from visionserve.threads import lower_this_thread, run_lowered, switching_fast, thread_nice

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")


def _nice_of(tid: int) -> int:
    stat = open(f"/proc/self/task/{tid}/stat").read()
    return int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice


def test_run_lowered_runs_below_the_caller_and_so_do_the_threads_it_starts():
    base = thread_nice()

    def work():
        seen = {}
        child = threading.Thread(target=lambda: seen.setdefault("child", thread_nice()))
        child.start()
        child.join()
        return thread_nice(), seen["child"]

    own, child = asyncio.run(run_lowered(3, work))
    assert own == child == min(19, base + 3)
    assert thread_nice() == base  # the event loop's thread is left as it was
    assert _nice_of(threading.get_native_id()) == base


def test_run_lowered_hands_the_exception_to_the_caller():
    def broken():
        raise ValueError("bad model file")

    with pytest.raises(ValueError, match="bad model file"):
        asyncio.run(run_lowered(2, broken))


def test_run_lowered_starts_its_thread_off_the_event_loop(monkeypatch):
    """Thread.start waits until the new thread runs, up to 8 ms beside busy processes on the
    2-core machine (a model swap starts several): the event loop keeps running meanwhile."""
    slow_start = threading.Thread.start

    def start(self):
        import time

        time.sleep(0.3)  # a thread that waits long for a core
        slow_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)

    async def scenario():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        assert await run_lowered(2, lambda: "loaded") == "loaded"
        ticker.cancel()
        return ticks

    assert asyncio.run(scenario()) >= 10


def test_nice_zero_leaves_threads_alone():
    got = {}

    def probe():
        lower_this_thread(0)
        got["nice"] = thread_nice()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert got["nice"] == thread_nice()


def test_the_serving_process_runs_its_model_threads_below_the_event_loop(tiny_repo, server_factory):
    s = server_factory(tiny_repo, "--worker-nice", "7", grpc=False)
    pid = s.proc.pid
    nice = {int(tid): int(open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])
            for tid in os.listdir(f"/proc/{pid}/task")}
    names = {tid: open(f"/proc/{pid}/task/{tid}/comm").read().strip() for tid in nice}
    assert nice[pid] == 0, "the event loop's thread keeps the process's priority"
    lowered = [tid for tid, n in nice.items() if n == 7]
    # the runner's prep and compute threads and onnxruntime's intra-op pool at least
    assert len(lowered) >= 3, (nice, names)


def test_loads_switch_the_interpreter_faster_and_the_last_one_out_restores_it():
    serving = sys.getswitchinterval()
    with switching_fast(0.00005):
        assert sys.getswitchinterval() == pytest.approx(0.00005)
        with switching_fast(0.001):  # a second load at the same time: one setting for both
            assert sys.getswitchinterval() == pytest.approx(0.00005)
        assert sys.getswitchinterval() == pytest.approx(0.00005)
    assert sys.getswitchinterval() == serving
    with switching_fast(serving * 10):  # never slower than serving
        assert sys.getswitchinterval() == serving
    with pytest.raises(ValueError), switching_fast(0.00005):
        raise ValueError("a failed load restores it too")
    assert sys.getswitchinterval() == serving


def test_a_model_loads_with_the_fast_switch_interval(tiny_repo, monkeypatch):
    from visionserve.backends.onnx import OnnxBackend
    from visionserve.config import ServerSettings
    from visionserve.engine import Engine

    seen = []
    load = OnnxBackend.load

    def recording(self, *args):
        seen.append(sys.getswitchinterval())
        return load(self, *args)

    monkeypatch.setattr(OnnxBackend, "load", recording)
    monkeypatch.setattr("visionserve.engine.LOAD_SWITCH_INTERVAL_S", 0.00002)

    async def scenario():
        engine = Engine(ServerSettings(models=tiny_repo), device="cpu")
        await engine.start()
        await engine.close()

    serving = sys.getswitchinterval()
    asyncio.run(scenario())
    assert seen and all(v == pytest.approx(0.00002) for v in seen), seen
    assert sys.getswitchinterval() == serving


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a second core to leave out")
def test_a_server_given_fewer_cores_sizes_its_pools_to_them(tiny_repo):
    """taskset / docker --cpuset-cpus: onnxruntime's pool and the decode pool use the cores the
    process may run on, not the machine's."""
    import subprocess

    code = f"""
import os
from pathlib import Path
os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
from visionserve import imaging
from visionserve.backends.onnx import OnnxBackend
from visionserve.repository import load_entry
from visionserve.threads import usable_cpus
entry = load_entry(Path({str(tiny_repo / 'tiny')!r}))
b = OnnxBackend()
b.load(entry.versions[1], entry.config, "cpu")
print(usable_cpus(), b._session.get_session_options().intra_op_num_threads,
      imaging._decode_pool()._max_workers)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1"]
