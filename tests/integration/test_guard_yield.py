"""Cooperative yielding with real job processes (issue 22), on the CPU: a tiny torch training
loop started by the guard's launcher and supervisor gets the hook through its environment (no
change to its script), yields while the server's busy word says a batch runs, proceeds after its
max wait, and the guard records which mechanism applied; a job without torch, or one that opts
out, is left to the process-level policies. The busy word here is a file the test publishes, as
the server's batchers do (``share.note``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import make_slow_model, wait_for
from test_guard_supervisor import Guard as SupervisedGuard

from visionserve.guard import proc, share
from visionserve.guard.launcher import LaunchSettings, launch, write_site_dir
from visionserve.guard.sharing import audit_sched
from visionserve.guard.store import TERMINAL, JobSpec, JobStore

pytest.importorskip("torch")
pytestmark = pytest.mark.slow


# A training loop that knows nothing of the guard: STEPS steps of a small MLP, then one JSON line.
TRAIN = """
import json, os, sys, time
import torch
torch.set_num_threads(1)
steps = int(sys.argv[1])
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
print("ready", flush=True)
t0 = time.monotonic()
for _ in range(steps):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
print(json.dumps({"steps": steps, "seconds": round(time.monotonic() - t0, 3),
                  "hook": "visionserve_guard_yield" in sys.modules}), flush=True)
"""

# The same with a data loader whose two forked workers stay alive while the job sleeps.
LOADER = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self): return 64
    def __getitem__(self, i):
        time.sleep(0.2)
        return torch.zeros(4)
it = iter(DataLoader(Slow(), batch_size=2, num_workers=2))
next(it)
open(sys.argv[1], "w").write("up")
time.sleep(60)
"""


class Batcher:
    _loop_task = object()


@pytest.fixture
def word(tmp_path, monkeypatch):
    """The server's busy word, named to the guard as a separate server would be."""
    share._state.clear()  # batchers other tests left behind (this process's state is global)
    path = share.publish(str(tmp_path / "busy.share"))
    monkeypatch.setenv(share.SHARE_ENV, path)
    yield path
    share.unpublish()
    share._state.clear()


def _script(tmp_path: Path, text: str, name: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _result(log_path: str) -> dict:
    lines = [ln for ln in Path(log_path).read_text().splitlines() if ln.startswith("{")]
    assert lines, Path(log_path).read_text()[-2000:]
    return json.loads(lines[-1])


def _launch(tmp_path, store, word_path, argv, env=None, **settings):
    job = store.claim(store.submit(JobSpec(command=[sys.executable, *argv], env=env or {},
                                           cwd=str(tmp_path))).id)
    s = LaunchSettings(gpu_uuid=None, gpu_total=None,
                       site_dir=write_site_dir(str(tmp_path / "site")),
                       share_path=word_path, **settings)
    launched = launch(job, s)
    return job, launched


def test_torch_job_yields_while_a_batch_runs_and_proceeds_after_its_max_wait(tmp_path, word):
    store = JobStore(tmp_path / "guard.sqlite")
    train = _script(tmp_path, TRAIN, "train.py")
    b = Batcher()
    share.note(b, share.RUNNING)  # a batch runs, and never ends
    job, launched = _launch(tmp_path, store, word, [train, "20"], yield_max_wait_ms=10,
                            yield_min_share=0.0)
    assert launched.popen.wait(120) == 0, Path(job.log_path).read_text()[-2000:]
    out = _result(job.log_path)
    assert out["hook"] is True  # injected through the environment, the script unchanged
    st = share.read_stats(job.log_path + ".yield")
    assert st is not None and st.hooks >= 20 * 5
    # every point waited its 10 ms, then went on (forced): the job was slowed, never stopped
    assert st.yields == st.hooks and st.forced == st.yields
    assert st.waited_s >= st.yields * 0.009
    assert out["seconds"] >= st.waited_s * 0.9

    share.note(b, share.IDLE)  # the line is idle: the same job runs without waiting
    job2, launched2 = _launch(tmp_path, store, word, [train, "20"], yield_max_wait_ms=10,
                              yield_min_share=0.0)
    assert launched2.popen.wait(120) == 0
    st2 = share.read_stats(job2.log_path + ".yield")
    assert st2.hooks == st.hooks and st2.yields == 0
    assert _result(job2.log_path)["seconds"] < out["seconds"]


def test_yield_ends_when_the_batch_ends(tmp_path, word):
    store = JobStore(tmp_path / "guard.sqlite")
    train = _script(tmp_path, TRAIN, "train.py")
    b = Batcher()
    share.note(b, share.RUNNING)
    job, launched = _launch(tmp_path, store, word, [train, "3"], yield_max_wait_ms=60_000,
                            yield_min_share=0.0)
    log_path = Path(job.log_path)
    wait_for(lambda: log_path.exists() and "ready" in log_path.read_text(), 120,
             "the job to import torch")
    time.sleep(1.0)
    assert launched.popen.poll() is None  # held at its first point
    share.note(b, share.IDLE)
    assert launched.popen.wait(60) == 0
    st = share.read_stats(job.log_path + ".yield")
    assert st.yields == 1 and st.forced == 0 and st.waited_s >= 0.9


class Guard(SupervisedGuard):
    """test_guard_supervisor's guard, started, running argv jobs with this interpreter."""

    def __init__(self, tmp: Path, latency=None, **cfg) -> None:
        super().__init__(tmp, latency, **cfg)
        self.thread.start()

    def run(self, argv, **kw):
        kw.setdefault("cwd", str(Path(self.gpu).parent))
        return self.store.submit(JobSpec(command=[sys.executable, *argv], **kw))

    def wait_state(self, job_id, *states, timeout=60.0):
        return super().wait_state(job_id, *states, timeout=timeout)

    def close(self):
        for a in list(self.sup.active.values()):
            proc.signal_group(a.pgid, signal.SIGKILL)
        self.sup.request_stop()
        self.thread.join(15)


@pytest.fixture
def guard(tmp_path):
    made = []

    def make(**cfg):
        g = Guard(tmp_path, **cfg)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def test_guard_records_the_mechanism_and_leaves_no_stale_state(tmp_path, word, guard):
    """A torch job yields (mechanism "yield"); a job that is not torch, and a torch job that
    opts out, get the process-level policies ("process"). Each job's hook file goes with it."""
    p99 = {"ms": 5.0}
    g = guard(latency_budget_ms=20.0, latency=lambda: p99["ms"])
    train = _script(tmp_path, TRAIN, "train.py")
    share.note(Batcher(), share.RUNNING)

    coop = g.run([train, "150"], env={"VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS": "5"})
    wait_for(lambda: g.store.get(coop.id).mechanism == "yield", 120, "the hook to report")
    p99["ms"] = 45.0  # over the budget: a cooperative job is not paused, its duty cycle drops
    wait_for(lambda: g.sup.duty < 1.0, 10, "the duty cycle to drop")
    assert share.read_word(word) is not None
    assert g.store.get(coop.id).state == "running"
    done = g.wait_state(coop.id, *TERMINAL, timeout=180)
    p99["ms"] = 5.0
    assert done.state == "succeeded", Path(done.log_path).read_text()[-2000:]
    assert done.mechanism == "yield"
    assert done.sharing["yields"] > 0 and done.sharing["hooks"] >= 150 * 5
    assert done.sharing["pauses"] == 0
    assert not os.path.exists(done.log_path + ".yield")  # removed when the job ended

    plain = g.run(["-c", "import time; time.sleep(3)"])
    running = wait_for(lambda: (j := g.store.get(plain.id)).pid and j, 30, "plain job to run")
    p99["ms"] = 45.0
    paused = g.wait_state(plain.id, "paused", timeout=10)  # no hook: paused by the budget
    assert "latency budget" in paused.reason
    p99["ms"] = 5.0
    done = g.wait_state(plain.id, *TERMINAL, timeout=30)
    assert done.state == "succeeded" and done.mechanism == "process"
    assert done.sharing["hook"] == "absent" and done.sharing["pauses"] >= 1
    assert running.pid

    out = g.run([train, "5"], env={"VISIONSERVE_GUARD_YIELD": "0"})
    done = g.wait_state(out.id, *TERMINAL, timeout=120)
    assert done.state == "succeeded" and done.mechanism == "process"
    assert _result(done.log_path)["hook"] is False


def test_job_killed_while_yielding_leaves_nothing_behind(tmp_path, word, guard):
    g = guard()
    train = _script(tmp_path, TRAIN, "train.py")
    b = Batcher()
    share.note(b, share.RUNNING)
    job = g.run([train, "1000"], env={"VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS": "60000",
                                        "VISIONSERVE_GUARD_YIELD_MIN_SHARE": "0"})
    log_path = Path(g.store.get(job.id).log_path)
    wait_for(lambda: log_path.exists() and "ready" in log_path.read_text(), 120, "import")
    running = wait_for(lambda: (j := g.store.get(job.id)).pid and j, 10, "pid")
    time.sleep(0.5)  # waiting in its first point
    proc.signal_group(running.pid, signal.SIGKILL)
    done = g.wait_state(job.id, *TERMINAL, timeout=30)
    assert done.state == "failed"
    assert not os.path.exists(done.log_path + ".yield")
    w = share.read_word(word)
    assert w.running == 1 and w.owner == os.getpid()  # the server's word: the job never wrote it
    share.note(b, share.IDLE)
    nxt = g.run([train, "10"])
    done = g.wait_state(nxt.id, *TERMINAL, timeout=120)
    assert done.state == "succeeded" and done.sharing["yields"] == 0


def test_data_loader_workers_stay_under_sched_idle_across_pause_and_resume(tmp_path):
    """Forked data-loader workers inherit SCHED_IDLE and nice; SIGSTOP/SIGCONT of the job's
    group does not change them (the question of issue 22's lost 300 ms)."""
    store = JobStore(tmp_path / "guard.sqlite")
    up = tmp_path / "up"
    _job, launched = _launch(tmp_path, store, "", ["-c", LOADER, str(up)])
    try:
        wait_for(lambda: up.exists(), 120, "the data loader's workers")
        members = proc.session_members(launched.pid)
        assert len(members) >= 4  # wrapper, job, two workers
        before = audit_sched(launched.pid, want_idle=False)
        assert before["threads"] >= 4 and before["idle"] == before["threads"], before
        proc.signal_group(launched.pid, signal.SIGSTOP)
        wait_for(lambda: all(m.state == "T" for m in proc.session_members(launched.pid)), 10,
                 "stopped")
        proc.signal_group(launched.pid, signal.SIGCONT)
        wait_for(lambda: all(m.state != "T" for m in proc.session_members(launched.pid)), 10,
                 "continued")
        after = audit_sched(launched.pid, want_idle=False)
        assert after["idle"] == after["threads"] >= before["threads"], (before, after)
        nice = min(19, os.nice(0) + 10)
        for m in proc.session_members(launched.pid):
            assert os.getpriority(os.PRIO_PROCESS, m.pid) == nice
    finally:
        proc.signal_group(launched.pid, signal.SIGKILL)
        launched.popen.wait(10)


def test_a_server_beside_a_guard_publishes_its_batches(tmp_path, server_factory, jpeg_bytes):
    """The server itself, started with the guard's busy word named (``VISIONSERVE_GUARD_SHARE``,
    as a guard of its own process gives it): the word reads RUNNING while a batch runs and idle
    once every frame is answered, written by the real batchers through the state observer the
    server installs."""
    make_slow_model(tmp_path / "models" / "slow")
    path = str(tmp_path / "server.share")
    s = server_factory(tmp_path / "models", grpc=False, env={share.SHARE_ENV: path})
    url = s.url + "/v1/models/slow/inspect"
    seen: list[int] = []
    done = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=60) as c:
            for _ in range(12):
                r = c.post(url, content=jpeg_bytes, headers={"Content-Type": "image/jpeg"})
                assert r.status_code == 200, r.text
        done.set()

    clients = [threading.Thread(target=load) for _ in range(2)]
    for t in clients:
        t.start()
    while not done.is_set():
        w = share.read_word(path)
        if w is not None:
            seen.append(w.running)
        time.sleep(0.005)
    for t in clients:
        t.join()
    assert seen and max(seen) >= 1, "the word never read RUNNING while batches ran"
    w = wait_for(lambda: (w := share.read_word(path)) is not None and w.busy == 0 and w, 10,
                 "the word idle after the last answer")
    assert w.running == 0 and w.periods >= 1 and w.owner == s.proc.pid
