"""The guard's persistent job queue: one SQLite file in WAL mode.

Several processes touch it at once (``guard submit``/``cancel`` from a shell, the supervisor, the
HTTP router inside the server), so every write is one short ``BEGIN IMMEDIATE`` transaction and
every state change is conditional on the state it expects ("UPDATE ... WHERE state = 'queued'"):
two writers can never both believe they moved the same job. A connection is opened per operation;
that costs well under a millisecond and keeps the store safe to share between threads.

A database that cannot be used now (disk full, read-only file system, I/O error, locked past the
busy timeout) raises :class:`StoreFault` from any call: a 503 with Retry-After on the API, a retry
with backoff in the supervisor. The same call may work later; nothing was changed by the failed one.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import data_home
from ..errors import InvalidInput, NotFound, Unavailable, VisionServeError
from ..storage import open_sqlite, sqlite_fault

DB_ENV = "VISIONSERVE_GUARD_DB"
DEFAULT_DB = "$XDG_DATA_HOME/visionserve/guard.sqlite"  # how help texts name the default

STATES = ("queued", "running", "paused", "succeeded", "failed", "cancelled", "killed")
ACTIVE = ("running", "paused")
TERMINAL = ("succeeded", "failed", "cancelled", "killed")
POLICIES = ("pause", "stop")

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    name             TEXT    NOT NULL,
    command          TEXT    NOT NULL,              -- JSON argv list
    cwd              TEXT    NOT NULL,
    env              TEXT    NOT NULL DEFAULT '{}', -- JSON object, added to the supervisor's env
    gpu_mem          INTEGER NOT NULL DEFAULT 0,    -- declared GPU memory need, bytes
    priority         INTEGER NOT NULL DEFAULT 0,    -- higher starts first, then FIFO
    policy           TEXT    NOT NULL CHECK (policy IN ('pause', 'stop')),
    state            TEXT    NOT NULL CHECK (state IN ('queued', 'running', 'paused', 'succeeded',
                                                       'failed', 'cancelled', 'killed')),
    reason           TEXT,
    submitted_at     REAL    NOT NULL,
    started_at       REAL,
    ended_at         REAL,
    pid              INTEGER,
    pid_starttime    INTEGER,                       -- /proc/<pid>/stat field 22
    exit_code        INTEGER,                       -- negative: killed by that signal
    log_path         TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    starts           INTEGER NOT NULL DEFAULT 0,    -- times launched; the guard never makes it 2
    mechanism        TEXT,                          -- how it shares the GPU: mps | yield | process
    sharing          TEXT                           -- JSON: yields, pauses, waits, shares
);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (state, priority DESC, id);
CREATE TABLE IF NOT EXISTS supervisor (
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    pid       INTEGER NOT NULL,
    starttime INTEGER NOT NULL,
    device    TEXT,
    started   REAL NOT NULL,
    heartbeat REAL NOT NULL
);
"""


class JobStateError(VisionServeError):
    """The job exists but is in a state that does not allow the operation (HTTP 409)."""

    kind = "invalid_input"


class StoreFault(Unavailable):
    """The job database cannot be read or written now; transient (HTTP 503 with Retry-After)."""

    RETRY_AFTER_S = 2.0

    def __init__(self, path: str, cause: BaseException) -> None:
        super().__init__(f"the guard's job database cannot be used now ({cause}): {path}; "
                         "nothing was changed, retry later", retry_after_s=self.RETRY_AFTER_S)
        self.cause = str(cause)


class SupervisorRunning(VisionServeError):
    """Another supervisor already holds this database."""

    kind = "unavailable"


@dataclass(frozen=True)
class JobSpec:
    """What a submitter asks for. :meth:`validated` checks it and fills defaults."""

    command: list[str]
    name: str | None = None
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    gpu_mem: int = 0
    priority: int = 0
    policy: str = "pause"

    def validated(self, *, resolve_command: bool = True) -> JobSpec:
        cmd = self.command
        if not isinstance(cmd, list) or not cmd:
            raise InvalidInput("empty command: give the job's command after '--'")
        if not all(isinstance(a, str) for a in cmd) or not cmd[0]:
            raise InvalidInput(f"command must be a list of strings, got {cmd!r}")
        cwd = os.path.abspath(self.cwd or os.getcwd())
        if not os.path.isdir(cwd):
            raise InvalidInput(f"working directory does not exist: {cwd}")
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_KEY.match(k):
                raise InvalidInput(f"bad environment variable name: {k!r}")
            if not isinstance(v, str):
                raise InvalidInput(f"environment value of {k} must be a string, got {v!r}")
        if self.policy not in POLICIES:
            raise InvalidInput(f"policy must be 'pause' or 'stop', got {self.policy!r}")
        if isinstance(self.gpu_mem, bool) or not isinstance(self.gpu_mem, int) or self.gpu_mem < 0:
            raise InvalidInput(f"gpu_mem must be a byte count >= 0, got {self.gpu_mem!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) \
                or not -1000 <= self.priority <= 1000:
            raise InvalidInput(f"priority must be an integer in -1000..1000, got {self.priority!r}")
        if resolve_command:
            cmd = [_resolve(cmd[0], cwd, self.env)] + cmd[1:]
        name = self.name or os.path.basename(cmd[0])
        if len(name) > 200:
            raise InvalidInput("job name is longer than 200 characters")
        return JobSpec(command=cmd, name=name, cwd=cwd, env=dict(self.env), gpu_mem=self.gpu_mem,
                       priority=self.priority, policy=self.policy)


def _resolve(prog: str, cwd: str, env: dict[str, str]) -> str:
    """The submitter's view of ``prog`` (their PATH, their cwd), made absolute, so that the job
    runs what was meant even though the supervisor has another environment."""
    if "/" in prog:
        path = prog if os.path.isabs(prog) else os.path.join(cwd, prog)
        if not os.path.exists(path):
            raise InvalidInput(f"command not found: {prog} (looked in {cwd})")
        if not os.access(path, os.X_OK):
            raise InvalidInput(f"command is not executable: {path}")
        return os.path.normpath(path)
    found = shutil.which(prog, path=env.get("PATH", os.environ.get("PATH")))
    if not found:
        raise InvalidInput(f"command not found on PATH: {prog}")
    return os.path.abspath(found)


@dataclass(frozen=True)
class Job:
    id: int
    name: str
    command: list[str]
    cwd: str
    env: dict[str, str]
    gpu_mem: int
    priority: int
    policy: str
    state: str
    reason: str | None
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    pid: int | None
    pid_starttime: int | None
    exit_code: int | None
    log_path: str | None
    cancel_requested: bool
    starts: int
    #: how the job shares the GPU with the server: "mps" (a CUDA MPS client on capped SMs), "yield"
    #: (its hook yields at module boundaries)
    #: or "process" (no hook: pause/resume by the process-level policies); None before it runs
    mechanism: str | None = None
    #: figures of that sharing (yields, forced passes, waits, pauses, shares), see guard.md
    sharing: dict | None = None

    @property
    def status_path(self) -> str | None:
        """Where the job wrapper writes the exit status (see :mod:`.jobwrap`)."""
        return self.log_path + ".exit.json" if self.log_path else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Job:
        d = dict(row)
        d["command"] = json.loads(d["command"])
        d["env"] = json.loads(d["env"])
        d["cancel_requested"] = bool(d["cancel_requested"])
        d["sharing"] = json.loads(d["sharing"]) if d.get("sharing") else None
        return cls(**d)


def default_db_path() -> str:
    """$VISIONSERVE_GUARD_DB, else $XDG_DATA_HOME/visionserve/guard.sqlite (~/.local/share/...).

    One fixed place for the CLI and the server's hosted guard alike: a default relative to the
    working directory made `guard list` elsewhere show an empty queue without a word."""
    if os.environ.get(DB_ENV):
        return os.environ[DB_ENV]
    folder = os.fspath(data_home())
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        pass  # JobStore then names the folder that is missing
    return os.path.join(folder, "guard.sqlite")


class JobStore:
    """The job queue. ``log_dir`` defaults to ``<db stem>-logs`` beside the database."""

    def __init__(self, path: str | os.PathLike[str], *, log_dir: str | None = None,
                 busy_timeout_s: float = 10.0) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.log_dir = os.path.abspath(log_dir or (os.path.splitext(self.path)[0] + "-logs"))
        self._timeout = busy_timeout_s
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise InvalidInput(f"guard database folder does not exist: {parent}")
        try:
            with self._conn() as c:
                # WAL lets readers (list, show, the HTTP router) run while the supervisor writes.
                c.execute("PRAGMA journal_mode=WAL")
                c.executescript(_SCHEMA)
                have = {r[1] for r in c.execute("PRAGMA table_info(jobs)")}
                for column in ("mechanism", "sharing"):  # databases made before these columns
                    if column not in have:
                        try:
                            c.execute(f"ALTER TABLE jobs ADD COLUMN {column} TEXT")
                        except sqlite3.OperationalError as exc:  # another process added it first
                            if "duplicate column" not in str(exc):
                                raise
        except StoreFault as exc:
            raise InvalidInput(f"cannot open guard database {self.path}: {exc.cause}") from None

    # -- plumbing -------------------------------------------------------------------------------
    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        try:
            c = open_sqlite(self.path, self._timeout)
        except sqlite3.Error as exc:
            raise StoreFault(self.path, exc) from exc
        try:
            yield c
        except sqlite3.DatabaseError as exc:
            if not sqlite_fault(exc):
                raise
            raise StoreFault(self.path, exc) from exc
        finally:
            c.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction. IMMEDIATE takes the write lock up front, so a read-then-write
        sequence cannot be overtaken by another process between the read and the write."""
        with self._conn() as c:
            c.execute("BEGIN IMMEDIATE")
            try:
                yield c
            except BaseException:
                if c.in_transaction:  # SQLite may have rolled back itself (disk full, I/O error)
                    with suppress(sqlite3.Error):
                        c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")

    @staticmethod
    def _one(c: sqlite3.Connection, job_id: int) -> Job:
        row = c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise NotFound(f"no guard job with id {job_id}")
        return Job.from_row(row)

    # -- submitters -----------------------------------------------------------------------------
    def submit(self, spec: JobSpec, *, resolve_command: bool = True) -> Job:
        spec = spec.validated(resolve_command=resolve_command)
        try:
            os.makedirs(self.log_dir, exist_ok=True)
        except OSError as exc:
            raise StoreFault(self.log_dir, exc) from exc
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO jobs (name, command, cwd, env, gpu_mem, priority, policy, state,"
                " submitted_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', ?)",
                (spec.name, json.dumps(spec.command), spec.cwd, json.dumps(spec.env),
                 spec.gpu_mem, spec.priority, spec.policy, time.time()))
            job_id = int(cur.lastrowid or 0)  # an INSERT always sets it
            c.execute("UPDATE jobs SET log_path = ? WHERE id = ?",
                      (os.path.join(self.log_dir, f"job-{job_id}.log"), job_id))
            return self._one(c, job_id)

    def get(self, job_id: int) -> Job:
        with self._conn() as c:
            return self._one(c, job_id)

    def list(self, states: tuple[str, ...] | None = None) -> list[Job]:
        with self._conn() as c:
            if states:
                marks = ",".join("?" * len(states))
                rows = c.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id",
                                 states).fetchall()
            else:
                rows = c.execute("SELECT * FROM jobs ORDER BY id").fetchall()
        return [Job.from_row(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._conn() as c:
            rows = c.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        out = dict.fromkeys(STATES, 0)
        out.update({r[0]: r[1] for r in rows})
        return out

    def request_cancel(self, job_id: int) -> Job:
        """Queued: cancelled at once. Running/paused: flagged; the supervisor stops the process
        group and records ``cancelled``. Already finished: :class:`JobStateError`."""
        with self._tx() as c:
            job = self._one(c, job_id)
            if job.state == "queued":
                c.execute("UPDATE jobs SET state = 'cancelled', reason = 'cancelled while queued',"
                          " ended_at = ? WHERE id = ?", (time.time(), job_id))
            elif job.state in ACTIVE:
                c.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            else:
                raise JobStateError(f"job {job_id} already ended ({job.state}); nothing to cancel")
            return self._one(c, job_id)

    # -- the supervisor -------------------------------------------------------------------------
    def next_queued(self) -> Job | None:
        """Highest priority first, then first submitted: strict order, no back-filling."""
        with self._conn() as c:
            row = c.execute("SELECT * FROM jobs WHERE state = 'queued'"
                            " ORDER BY priority DESC, id LIMIT 1").fetchone()
        return Job.from_row(row) if row else None

    def claim(self, job_id: int) -> Job | None:
        """queued -> running (no pid yet). None if someone else moved it first (e.g. cancel)."""
        with self._tx() as c:
            n = c.execute("UPDATE jobs SET state = 'running', started_at = ?, starts = starts + 1"
                          " WHERE id = ? AND state = 'queued'", (time.time(), job_id)).rowcount
            return self._one(c, job_id) if n else None

    def set_process(self, job_id: int, pid: int, starttime: int | None) -> None:
        with self._tx() as c:
            c.execute("UPDATE jobs SET pid = ?, pid_starttime = ? WHERE id = ?",
                      (pid, starttime, job_id))

    def set_paused(self, job_id: int, reason: str) -> bool:
        with self._tx() as c:
            return c.execute("UPDATE jobs SET state = 'paused', reason = ? WHERE id = ? AND"
                             " state = 'running'", (reason, job_id)).rowcount == 1

    def set_resumed(self, job_id: int, note: str) -> bool:
        with self._tx() as c:
            return c.execute("UPDATE jobs SET state = 'running', reason = ? WHERE id = ? AND"
                             " state = 'paused'", (note, job_id)).rowcount == 1

    def set_sharing(self, job_id: int, mechanism: str | None, sharing: dict | None) -> None:
        with self._tx() as c:
            c.execute("UPDATE jobs SET mechanism = ?, sharing = ? WHERE id = ?",
                      (mechanism, json.dumps(sharing) if sharing is not None else None, job_id))

    def set_reason(self, job_id: int, reason: str | None) -> None:
        with self._tx() as c:
            c.execute("UPDATE jobs SET reason = ? WHERE id = ?", (reason, job_id))

    def finish(self, job_id: int, state: str, *, exit_code: int | None,
               reason: str | None) -> bool:
        """Active -> terminal ``state``. False if the job was not active (already finished)."""
        if state not in TERMINAL:
            raise ValueError(f"not a terminal state: {state}")
        with self._tx() as c:
            return c.execute(
                "UPDATE jobs SET state = ?, exit_code = ?, reason = ?, ended_at = ?"
                " WHERE id = ? AND state IN ('running', 'paused')",
                (state, exit_code, reason, time.time(), job_id)).rowcount == 1

    def cancel_requested_ids(self) -> builtins.list[int]:  # (``list`` is a method here)
        with self._conn() as c:
            rows = c.execute("SELECT id FROM jobs WHERE cancel_requested = 1 AND"
                             " state IN ('running', 'paused')").fetchall()
        return [r[0] for r in rows]

    # -- one supervisor per database -----------------------------------------------------------
    def acquire_lease(self, pid: int, starttime: int, device: str | None,
                      alive: Any) -> None:
        """Record this supervisor as the database's owner. ``alive(pid, starttime)`` decides
        whether a recorded owner still runs; a dead owner's lease is taken over."""
        with self._tx() as c:
            row = c.execute("SELECT * FROM supervisor WHERE id = 1").fetchone()
            if row and (row["pid"], row["starttime"]) != (pid, starttime) and \
                    alive(row["pid"], row["starttime"]):
                raise SupervisorRunning(
                    f"another guard supervisor (pid {row['pid']}) already runs on {self.path}")
            now = time.time()
            c.execute("INSERT OR REPLACE INTO supervisor (id, pid, starttime, device, started,"
                      " heartbeat) VALUES (1, ?, ?, ?, ?, ?)", (pid, starttime, device, now, now))

    def heartbeat(self, pid: int) -> None:
        with self._tx() as c:
            c.execute("UPDATE supervisor SET heartbeat = ? WHERE id = 1 AND pid = ?",
                      (time.time(), pid))

    def release_lease(self, pid: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM supervisor WHERE id = 1 AND pid = ?", (pid,))

    def supervisor(self) -> dict[str, Any] | None:
        with self._conn() as c:
            row = c.execute("SELECT * FROM supervisor WHERE id = 1").fetchone()
        return dict(row) if row else None
