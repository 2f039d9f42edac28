"""Cooperative yielding, the protocol (issue 22): the server's busy word in shared memory, the
hook's wait and its limits, its statistics, the environment that injects it. In-process (the hook
against the real torch on the CPU); the subprocess cases are in
tests/integration/test_guard_yield.py.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from visionserve.guard import share, yieldhook
from visionserve.guard.launcher import LaunchSettings, job_env, write_site_dir
from visionserve.guard.sharing import JobSharing
from visionserve.guard.store import Job


class Batcher:
    """What share.note keys on: a batcher's identity and its ``_loop_task`` (None: closed)."""

    _loop_task = object()


@pytest.fixture
def word(tmp_path):
    share._state.clear()  # batchers other tests left behind (this process's state is global)
    path = share.publish(str(tmp_path / "busy.share"))
    yield path
    share.unpublish()
    share._state.clear()


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_word_follows_the_batchers_and_is_written_only_on_a_change(word):
    a, b = Batcher(), Batcher()
    assert share.read_word(word).running == 0 and share.read_word(word).owner == os.getpid()
    share.note(a, share.QUEUED)
    w = share.read_word(word)
    assert (w.running, w.busy, w.periods) == (0, 1, 1)
    share.note(a, share.RUNNING)
    share.note(b, share.RUNNING)
    w = share.read_word(word)
    assert (w.running, w.busy, w.periods) == (2, 2, 1)  # one busy period: it never went idle
    share.note(a, share.IDLE)
    assert share.read_word(word).running == 1
    share.note(b, share.IDLE)
    w = share.read_word(word)
    assert (w.running, w.busy) == (0, 0)
    share.note(a, share.RUNNING)
    assert share.read_word(word).periods == 2


def test_note_costs_a_lookup_when_nothing_changes(word, monkeypatch):
    a = Batcher()
    share.note(a, share.RUNNING)
    calls = []
    monkeypatch.setattr(share, "_changed", lambda *args: calls.append(args))
    for _ in range(1000):
        share.note(a, share.RUNNING)
    assert calls == []  # the hot path: no store, no system call (its cost is not timed here)


def test_closed_batcher_is_forgotten(word):
    a = Batcher()
    share.note(a, share.RUNNING)
    assert share.read_word(word).running == 1
    a._loop_task = None  # closed with a batch still counted as running
    share.prune()
    assert share.read_word(word).running == 0 and not share.serving()


def test_unpublish_clears_the_word_and_stale_words_are_removed(word, tmp_path):
    share.note(Batcher(), share.RUNNING)
    share.unpublish()
    assert not os.path.exists(word)
    dead = tmp_path / f"{share.PREFIX}999999999.share"  # a pid that cannot exist
    dead.write_bytes(b"\0" * share.WORD_SIZE)
    alive = tmp_path / f"{share.PREFIX}{os.getpid()}.share"
    alive.write_bytes(b"\0" * share.WORD_SIZE)
    assert share.remove_stale(str(tmp_path)) == [str(dead)]
    assert alive.exists()


def test_server_named_by_the_environment_publishes_there(tmp_path, monkeypatch):
    path = str(tmp_path / "named.share")
    monkeypatch.setenv(share.SHARE_ENV, path)
    monkeypatch.setattr(share, "_tried_env", False)
    try:
        share.note(Batcher(), share.RUNNING)
        assert share.read_word(path).running == 1
    finally:
        share.unpublish()
        share._state.clear()


@pytest.mark.parametrize("guard, named, watched", [
    (False, False, False), (True, False, True), (False, True, True)])
def test_the_server_watches_its_batchers_with_a_guard_or_beside_one(guard, named, watched,
                                                                    tmp_path, monkeypatch):
    """The assembly installs the word's writer as the batchers' state observer with --guard (the
    hosted guard publishes the word) or when VISIONSERVE_GUARD_SHARE names one; otherwise the
    batchers report to nobody. The batcher itself imports nothing of the guard."""
    import ast

    from visionserve import batching
    from visionserve.config import ServerSettings
    from visionserve.runtime.hosted import watch_batchers

    monkeypatch.delenv(share.SHARE_ENV, raising=False)
    if named:
        monkeypatch.setenv(share.SHARE_ENV, str(tmp_path / "named.share"))
    monkeypatch.setattr(batching, "_observer", None)
    assert watch_batchers(ServerSettings(guard=guard)) is watched
    assert batching._observer is (share.note if watched else None)
    tree = ast.parse(Path(batching.__file__).read_text(encoding="utf-8"))
    names = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {n for n in names if n.startswith(("guard", "visionserve.guard"))}, names


def _yielder(torch, word, tmp_path, **kw):
    return yieldhook.Yielder(torch, word, str(tmp_path / "job.yield"), **kw)


def test_hook_waits_while_a_batch_runs_and_goes_on_when_it_ends(word, torch, tmp_path):
    y = _yielder(torch, word, tmp_path, max_wait_s=5.0, min_share=0.0)
    b = Batcher()
    share.note(b, share.RUNNING)
    threading.Timer(0.3, share.note, (b, share.IDLE)).start()
    t0 = time.monotonic()
    y.point()
    waited = time.monotonic() - t0
    assert 0.25 < waited < 2.0, waited
    assert (y.yields, y.forced) == (1, 0)
    t0 = time.monotonic()
    y.point()  # idle: no wait
    assert time.monotonic() - t0 < 0.5  # far under any wait (max_wait_s 5); a loaded CI box is slow
    y.flush()  # (the hook writes its file at each wait and every 0.25 s of points)
    st = share.read_stats(str(tmp_path / "job.yield"))
    assert st.pid == os.getpid() and st.hooks == 2 and st.yields == 1 and st.waited_s >= 0.25


def test_hook_never_waits_longer_than_its_max(word, torch, tmp_path):
    y = _yielder(torch, word, tmp_path, max_wait_s=0.05, min_share=0.0)
    share.note(Batcher(), share.RUNNING)  # and it never ends
    t0 = time.monotonic()
    for _ in range(4):
        y.point()
    took = time.monotonic() - t0
    assert 0.18 < took < 1.5, took
    assert (y.yields, y.forced) == (4, 4)


def test_hook_keeps_its_minimum_share_of_time(word, torch, tmp_path):
    """A line that is busy for ever slows the job to its minimum share; it never stops it."""
    y = _yielder(torch, word, tmp_path, max_wait_s=0.05, min_share=0.5)
    share.note(Batcher(), share.RUNNING)
    t0 = time.monotonic()
    mid = None
    while time.monotonic() - t0 < 5.0:
        y.point()
        time.sleep(0.005)  # the job's own work between points
        if mid is None and time.monotonic() - t0 >= 3.0:
            mid = y.waited_ns / 1e9
    # a fresh job may first wait (1 - share) of the ~2 s window; then it keeps its share
    last = y.waited_ns / 1e9 - mid
    assert 0.5 < last < 0.5 * 2.0 + 0.4, last
    assert y.forced > 10


def test_hook_ignores_the_word_of_a_dead_server(word, torch, tmp_path):
    y = _yielder(torch, word, tmp_path, max_wait_s=5.0, min_share=0.0)
    share.note(Batcher(), share.RUNNING)
    y.owner = 999_999_999  # the server that wrote it is gone
    t0 = time.monotonic()
    y.point()
    assert time.monotonic() - t0 < 0.1 and y.yields == 0


def test_duty_cycle_throttles_the_job(word, torch, tmp_path):
    y = _yielder(torch, word, tmp_path, max_wait_s=0.05, min_share=0.2)
    assert share.set_duty(0.5)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.0:
        y.point()
        time.sleep(0.002)
    assert y.slept_ns / 1e9 > 0.4  # about half of the window, after the first one
    share.set_duty(None)
    assert share.read_word(word) is not None


def test_hooks_run_in_a_real_training_step(word, torch, tmp_path):
    """Forward pre-hooks, gradient hooks in backward and the optimizer step hook all land in the
    yielder; in-place activations (ReLU(inplace=True)) are not disturbed."""
    y = yieldhook.install(torch, {"VISIONSERVE_GUARD_SHARE": word,
                                  "VISIONSERVE_GUARD_YIELD_STATS": str(tmp_path / "s.yield"),
                                  "VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS": "20"})
    assert y is not None and yieldhook.install(torch) is y  # once per process
    try:
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True),
                                  torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x, t = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
        loss = torch.nn.functional.cross_entropy(net(x), t)
        forward = y.hooks
        assert forward == 4  # Sequential + its three modules
        loss.backward()
        assert y.hooks > forward  # gradient hooks in backward
        before = y.hooks
        opt.step()
        assert y.hooks == before + 1
        assert all(p.grad is not None for p in net.parameters())
    finally:
        y.disable()  # the global hooks stay registered for this process: make them no-ops


def test_environment_injects_the_hook_and_a_job_may_opt_out(tmp_path):
    site = write_site_dir(str(tmp_path / "site"))
    assert os.path.exists(os.path.join(site, "visionserve_guard_yield.py"))
    s = LaunchSettings(gpu_uuid="GPU-abc", gpu_total=80 * 2**30, site_dir=site,
                       share_path="/dev/shm/w.share", yield_max_wait_ms=30, yield_min_share=0.4,
                       yield_depth=2, yield_queue_ms=3)
    env = job_env(_job(), s, base={"VISIONSERVE_GUARD_YIELD_STATS": "/elsewhere"})
    assert env["VISIONSERVE_GUARD_SHARE"] == "/dev/shm/w.share"
    assert env["VISIONSERVE_GUARD_YIELD_STATS"] == "/logs/job-7.log.yield"
    assert env["VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS"] == "30"
    assert env["VISIONSERVE_GUARD_YIELD_MIN_SHARE"] == "0.4"
    assert env["VISIONSERVE_GUARD_YIELD_DEPTH"] == "2"
    assert env["VISIONSERVE_GUARD_YIELD_QUEUE_MS"] == "3"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == site
    mine = job_env(_job({"VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS": "5"}), s, base={})
    assert mine["VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS"] == "5"  # the job's own value wins
    out = job_env(_job({"VISIONSERVE_GUARD_YIELD": "0"}), s, base={})
    assert "VISIONSERVE_GUARD_SHARE" not in out and "VISIONSERVE_GUARD_YIELD_STATS" not in out
    # no busy word (a guard that is its own process, no server named): nothing injected
    none = job_env(_job(), LaunchSettings("GPU-abc", 80 * 2**30, site_dir=site),
                   base={"VISIONSERVE_GUARD_SHARE": "/inherited"})
    assert "VISIONSERVE_GUARD_SHARE" not in none


def test_job_sharing_figures(tmp_path, word, torch):
    stats = tmp_path / "job.yield"
    sh = JobSharing(str(stats), now=100.0)
    assert not sh.read(101.0) and sh.mechanism == "process"
    assert sh.summary(101.0)["hook"] == "absent"
    y = yieldhook.Yielder(torch, word, str(stats), max_wait_s=0.01, min_share=0.0)
    assert sh.read(102.0) is False and sh.summary(102.0)["hook"] == "installed"
    y.point()
    y.flush()
    assert sh.read(103.0) is True and sh.mechanism == "yield" and sh.cooperative
    sh.paused(104.0)
    sh.resumed(106.0)
    s = sh.summary(110.0)
    assert s["pauses"] == 1 and s["paused_s"] == 2.0 and s["hooks"] == 1
    assert sh.read(110.0) is True and sh.mechanism == "process"  # no hook call for > 2 s
    sh.remove_stats()
    assert not stats.exists()


def _job(env=None) -> Job:
    return Job(id=7, name="t", command=["true"], cwd="/", env=env or {}, gpu_mem=2**30,
               priority=0, policy="pause", state="running", reason=None, submitted_at=0.0,
               started_at=None, ended_at=None, pid=None, pid_starttime=None, exit_code=None,
               log_path="/logs/job-7.log", cancel_requested=False, starts=1)


class FakeCuda:
    """Just enough of torch.cuda for the hook's run-ahead bound: a GPU that takes ``work_s`` per
    interval between marks, in order, on the real clock."""

    def __init__(self, work_s: float) -> None:
        self.work_s, self.free_at = work_s, 0.0
        gpu = self

        class Event:
            def __init__(self, enable_timing=False, blocking=False):
                assert enable_timing and blocking
                self.done_at = None

            def record(self):
                gpu.free_at = max(gpu.free_at, time.monotonic()) + gpu.work_s
                self.done_at = gpu.free_at

            def query(self):
                return time.monotonic() >= self.done_at

            def synchronize(self):
                time.sleep(max(0.0, self.done_at - time.monotonic()))

            def elapsed_time(self, other):
                assert self.query() and other.query()
                return (other.done_at - self.done_at) * 1000

        self.Event = Event

    @staticmethod
    def is_initialized():
        return True

    @staticmethod
    def is_current_stream_capturing():
        return False

    def queued_s(self) -> float:
        return max(0.0, self.free_at - time.monotonic())


class FakeTorch:
    def __init__(self, work_s: float) -> None:
        self.cuda = FakeCuda(work_s)


def test_hook_bounds_the_gpu_work_queued_ahead(word, tmp_path):
    """The job may queue about queue_ms of GPU work (learnt per point from its events), a quarter
    of it while frames wait for their batch: that bounds how long an arriving batch waits."""
    fake = FakeTorch(work_s=0.001)
    y = yieldhook.Yielder(fake, word, None, queue_ms=4.0, depth=16, max_wait_s=0.0)
    queued = []
    for _ in range(400):  # the CPU runs far ahead of the GPU: only the bound holds it back
        y.point()
        queued.append(fake.cuda.queued_s())
    assert 0.0007 < y.point_ms / 1000 < 0.0015  # learnt: 1 ms per point
    assert max(queued[100:]) < 0.0065, max(queued[100:])  # ~4 ms (+ the interval just queued)
    assert y.syncs > 300
    share.note(Batcher(), share.QUEUED)  # frames wait for their batch: a quarter of it
    for _ in range(20):
        y.point()
        assert fake.cuda.queued_s() < 0.0025


def test_bound_mode_never_waits_and_keeps_one_point_queued_while_a_batch_runs(word, tmp_path):
    fake = FakeTorch(work_s=0.001)
    y = yieldhook.Yielder(fake, word, str(tmp_path / "b.yield"), queue_ms=4.0, depth=16,
                          max_wait_s=1.0, min_share=0.0, mode="bound")
    share.note(Batcher(), share.RUNNING)
    for _ in range(50):
        y.point()
        assert fake.cuda.queued_s() < 0.0015  # the batch shares the GPU with one point at most
    assert y.yields == 0
    y.flush()
    assert share.read_stats(str(tmp_path / "b.yield")).mode == "bound"
