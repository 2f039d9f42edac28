"""What each thread of a running Python process does, sampled: runs Python, waits for the
interpreter, waits for the GPU, runs native code, or waits for work. For the serving process under
load this says what waits for what (issue 19: the event loop, the prep and compute threads share
one interpreter).

    python -m visionserve_tools.threadstates --pid PID --seconds 20 --out threads.json
    python -m visionserve_tools.threadstates --from-raw threads.raw   # classify a recording again

It runs py-spy (``pip install py-spy``; ``$PY_SPY`` or the ``py-spy`` next to this Python) as
``py-spy record --native --idle --threads -f raw``: every sample is a thread's Python stack with
the native frames below it. py-spy stops the process for each sample while it unwinds the native
stacks, which is slow (milliseconds), so it samples 5 times a second by default (``RATE``): take
20 s or more, and read the load's throughput during the sampling beside the one measured without
it. It needs the right to trace the process (root, or ``kernel.yama.ptrace_scope`` 0).

A sample's state comes from its native frames below the last Python frame:

* ``python``: none: the thread runs Python, holding the interpreter (GIL);
* ``interpreter_wait``: the deepest named frame is ``pthread_cond_timedwait``, the wait in
  CPython's ``take_gil`` (3.11, 3.12): the thread has finished a call that released the
  interpreter, or was preempted, and waits to take it back. Python's own locks
  (``threading.Lock``, ``queue``) wait in ``sem_clockwait`` instead, so they count as idle. A
  native library waiting on a timed condition variable would count here too: the sites named in
  the output show which it is;
* ``gpu_wait``: a frame below is a CUDA synchronisation (``cudaStreamSynchronize`` ...);
* ``idle``: the deepest named frame is a blocking call (``epoll_wait``, ``sem_clockwait``,
  ``clock_nanosleep`` ...): waiting for work. Not ``read`` or ``recv``: the event loop's sockets
  do not block, so there they are work;
* ``native``: anything else: C/C++ work with the interpreter released or held (a torch op,
  OpenCV, pickling, uvloop's own code).

Each thread's share of its samples per state, and its three most frequent sites per state
(last Python frame > deepest named native frame).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

#: samples a second. py-spy stops the process for each sample to unwind its native stacks, and
#: that costs: on the 2-core CPU machine, serving the shipped model at saturation, 100 a second
#: cut its throughput by 92% and 5 a second by 9%
RATE = 5
STATES = ("python", "interpreter_wait", "gpu_wait", "native", "idle")

INTERPRETER_WAIT = {"pthread_cond_timedwait", "__pthread_cond_timedwait",
                    "___pthread_cond_timedwait", "pthread_cond_timedwait64"}
GPU_WAIT = re.compile(r"^cu(da)?(Stream|Event|Ctx|Device)Synchronize")
IDLE = {
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "__poll", "ppoll", "select", "__select",
    "pselect", "pselect6", "clock_nanosleep", "__clock_nanosleep", "nanosleep", "__nanosleep",
    "sem_wait", "sem_timedwait", "sem_clockwait", "__new_sem_wait_slow", "do_futex_wait",
    "__new_sem_wait_slow64", "futex_wait", "__futex_abstimed_wait_common",
    "__futex_abstimed_wait_common64", "pthread_cond_wait", "__pthread_cond_wait",
    "___pthread_cond_wait", "pthread_cond_clockwait", "__pthread_cond_clockwait",
    "pthread_join", "__pthread_clockjoin_ex", "waitpid", "__waitpid", "wait4", "sigtimedwait",
    "sigwaitinfo", "pause",
    # a Python lock (threading, queue) where libc's frames have no symbols
    "PyThread_acquire_lock_timed", "_queue_SimpleQueue_get_impl",
}
_FRAME = re.compile(r"^(?P<func>.*) \((?P<where>[^()]*)\)$")


def _parse(frame: str) -> tuple[str, str]:
    m = _FRAME.match(frame)
    return (m["func"], m["where"]) if m else (frame, "")


def _is_python(where: str) -> bool:
    return bool(re.search(r"\.py(:\d+)?$", where)) or where.startswith("<")


def classify(frames: list[str]) -> tuple[str, str]:
    """(state, site) of one sample's stack, outermost frame first (py-spy's order)."""
    parsed = [_parse(f) for f in frames]
    last_py = max((i for i, (_, w) in enumerate(parsed) if _is_python(w)), default=-1)
    python_site = parsed[last_py][0] if last_py >= 0 else "(native thread)"
    tail = parsed[last_py + 1:]
    if not tail:
        return "python", python_site
    named = [f for f, _ in tail if not f.startswith("0x")]
    deepest = named[-1] if named else tail[-1][1]
    site = f"{python_site} > {deepest}"
    if deepest in INTERPRETER_WAIT:
        return "interpreter_wait", site
    if any(GPU_WAIT.match(f) for f in named):
        return "gpu_wait", site
    if deepest in IDLE:
        return "idle", site
    return "native", site


def summarise(raw: str) -> dict:
    """Per thread (``tid name``): samples, share per state, top sites per state.

    A thread is one entry per id: py-spy leaves the name out of some samples (it could not read
    it then), and those count for the named thread of the same id. A thread never seen with a
    name is ``tid (unnamed)``."""
    counts: dict[str, Counter] = {}
    sites: dict[str, dict[str, Counter]] = {}
    names: dict[str, str] = {}
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        thread, *frames = stack.split(";")
        m = re.match(r"thread \((\w+)\)(?::\s*(.*))?", thread)
        tid, name = (m[1], (m[2] or "").strip()) if m else (thread, "")
        if name:
            names.setdefault(tid, name)
        state, site = classify(frames)
        counts.setdefault(tid, Counter())[state] += int(n)
        sites.setdefault(tid, {}).setdefault(state, Counter())[site] += int(n)
    threads = {}
    for tid, c in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        threads[f"{tid} {names.get(tid, '(unnamed)')}"] = {
            "samples": total,
            "share": {s: round(c[s] / total, 3) for s in STATES if c[s]},
            "sites": {s: [[site, round(k / total, 3)] for site, k in sites[tid][s].most_common(3)]
                      for s in STATES if c[s]},
        }
    return {"threads": threads}


def py_spy() -> str | None:
    """``$PY_SPY``, the ``py-spy`` on PATH, or the one beside this Python (a venv not activated)."""
    beside = Path(sys.executable).with_name("py-spy")
    return (os.environ.get("PY_SPY") or shutil.which("py-spy")
            or (str(beside) if beside.exists() else None))


def start(pid: int, seconds: float, raw_path: Path, rate: int = RATE,
          ready_timeout_s: float = 60.0) -> subprocess.Popen | str:
    """Start recording ``pid`` for ``seconds`` (or until :func:`finish` stops it), and return
    once the sampling has begun (py-spy first reads the symbols of every library the process has
    loaded: seconds for torch's); the py-spy process, or why it could not start."""
    exe = py_spy()
    if exe is None:
        return "py-spy not found (pip install py-spy, or set PY_SPY)"
    try:
        proc = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
             "--rate", str(rate), "--native", "--idle", "--threads", "--format", "raw",
             "--output", str(raw_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        return f"py-spy ({exe}) cannot run: {exc}"
    assert proc.stdout is not None
    end = time.monotonic() + ready_timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line or b"Sampling" in line:  # ended (finish() says why), or sampling
            return proc
    proc.kill()
    proc.communicate()
    return f"py-spy did not start sampling within {ready_timeout_s:.0f} s"


def finish(proc: subprocess.Popen | str, raw_path: Path, timeout_s: float = 60.0,
           stop: bool = False) -> dict:
    """Wait for a recording from :func:`start` (``stop``: end it now, as Control-C does) and
    summarise it, or say why there is none."""
    if isinstance(proc, str):
        return {"error": proc}
    if stop and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if not raw_path.exists() or not raw_path.stat().st_size:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        return {"error": f"py-spy exited {proc.returncode} with no samples: {' | '.join(tail)}"}
    out = summarise(raw_path.read_text())
    out["raw"] = str(raw_path)
    return out


def table(summary: dict) -> str:
    """The summary as text: one line per thread, its shares, then its top sites."""
    if "error" in summary:
        return f"no thread states: {summary['error']}"
    lines = [f"{'thread (id name)':36} {'samples':>7} " + " ".join(f"{s:>16}" for s in STATES)]
    for name, t in summary["threads"].items():
        lines.append(f"{name[-36:]:36} {t['samples']:>7} "
                     + " ".join(f"{t['share'].get(s, 0.0):>16.1%}" for s in STATES))
        for s, top in t["sites"].items():
            for site, share in top:
                lines.append(f"    {s:16} {share:6.1%}  {site}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m visionserve_tools.threadstates",
                                 description=(__doc__ or "").splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--pid", type=int, help="the process to sample")
    src.add_argument("--from-raw", type=Path, help="classify a py-spy raw recording again")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=RATE, help="samples a second [%(default)s]")
    ap.add_argument("--raw", type=Path, default=None,
                    help="where py-spy writes its recording [threads.raw beside --out]")
    ap.add_argument("--out", type=Path, default=None, help="the summary as JSON")
    args = ap.parse_args(argv)
    if args.from_raw:
        summary = summarise(args.from_raw.read_text())
    else:
        raw = args.raw or (args.out.with_suffix(".raw") if args.out else Path("threads.raw"))
        summary = finish(start(args.pid, args.seconds, raw, args.rate), raw,
                         timeout_s=args.seconds + 60)
    print(table(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if "error" in summary else 0


if __name__ == "__main__":
    sys.exit(main())
