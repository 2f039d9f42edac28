"""The job's wrapper: the process group leader the guard starts, stdlib only, run as a script.

    python -I jobwrap.py --status FILE --nice N [--sched-idle] [--cpus LIST] -- CMD ARGS...

It lowers its CPU priority (inherited by the job and every process it starts: nice N, and with
``--sched-idle`` the SCHED_IDLE policy, so the job only gets CPU time the server does not want:
a training job's data-loading workers must not slow the line's inference), with ``--cpus`` (e.g.
``4-15``) keeps it and its children on those CPUs, makes itself the host OOM killer's preferred
victim, starts the job, and waits for it while ignoring SIGTERM/SIGINT/SIGHUP (those reach the job
directly: the guard signals the whole process group). When the job ends it writes its exit status
to FILE. That file is what lets a *restarted* guard, which is not the job's parent and cannot
``wait()`` for it, still record the real exit code of a job it re-adopted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


def _write_status(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def parse_cpus(text: str) -> set[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError("empty CPU list")
    return out


def main(argv: list[str]) -> int:
    if "--" not in argv:
        sys.stderr.write("usage: jobwrap.py --status FILE --nice N [--sched-idle] [--cpus LIST] -- "
                         "CMD ARGS...\n")
        return 2
    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1:]
    status = opts[opts.index("--status") + 1]
    nice = int(opts[opts.index("--nice") + 1]) if "--nice" in opts else 0
    if nice:
        os.nice(nice)
    if "--sched-idle" in opts and hasattr(os, "SCHED_IDLE"):
        try:  # lowering one's own policy needs no privilege
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            sys.stderr.write(f"visionserve guard: SCHED_IDLE refused ({exc}); running at nice "
                             f"{nice}\n")
    if "--cpus" in opts:
        try:
            os.sched_setaffinity(0, parse_cpus(opts[opts.index("--cpus") + 1]))
        except (ValueError, OSError) as exc:
            sys.stderr.write(f"visionserve guard: CPU set not applied ({exc}); running on all "
                             "CPUs\n")
    try:  # raising one's own oom_score_adj needs no privilege
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("500")
    except OSError:
        pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # a Python handler (not SIG_IGN, which exec would pass on): the job gets default handling
        signal.signal(sig, lambda *_: None)
    try:
        child = subprocess.Popen(cmd)
    except OSError as exc:
        prog = cmd[0] if cmd else "(nothing)"
        sys.stderr.write(f"visionserve guard: cannot start {prog}: {exc}\n")
        _write_status(status, {"returncode": 127, "error": str(exc)})
        return 127
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            continue
    _write_status(status, {"returncode": rc})
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
