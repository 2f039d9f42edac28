"""Process facts from ``/proc`` and process-group signalling (Linux only, no psutil).

A pid alone does not name a process across a restart: pids are reused. The guard therefore
records ``(pid, starttime)``, where ``starttime`` is field 22 of ``/proc/<pid>/stat`` (clock ticks
after boot), and treats a process as "the same one" only when both match.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str  # R, S, D, T (stopped), t, Z (zombie), X ...
    ppid: int
    pgid: int
    sid: int
    starttime: int


def stat(pid: int) -> ProcStat | None:
    """Parse ``/proc/<pid>/stat``; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ESRCH, errno.ENOENT):
            return None
        raise
    # comm (field 2) is in parentheses and may itself contain spaces and ')': split at the last.
    rest = raw[raw.rfind(")") + 2:].split()
    # rest[0] is field 3 (state); field N is rest[N - 3]
    return ProcStat(pid=pid, state=rest[0], ppid=int(rest[1]), pgid=int(rest[2]),
                    sid=int(rest[3]), starttime=int(rest[19]))


def starttime(pid: int) -> int | None:
    st = stat(pid)
    return st.starttime if st else None


def is_alive(pid: int | None, start: int | None) -> bool:
    """True if ``pid`` exists, is not a zombie, and (if given) started at ``start``."""
    if not pid:
        return False
    st = stat(pid)
    if st is None or st.state in ("Z", "X"):
        return False
    return start is None or st.starttime == start


def session_members(sid: int) -> list[ProcStat]:
    """Every live process in session ``sid`` (a job's whole tree: it runs in its own session)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = stat(int(name))
        if st is not None and st.sid == sid and st.state not in ("Z", "X"):
            out.append(st)
    return out


def session_of(pid: int) -> int | None:
    st = stat(pid)
    return st.sid if st else None


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False if the group no longer exists."""
    if pgid <= 1:  # never signal init's group or "every process" (0/-1 semantics)
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        log.warning("cannot send %s to process group %d: %s", signal.Signals(sig).name, pgid, exc)
        return False
