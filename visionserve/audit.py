"""The audit trail: who changed what, and when (docs/security.md, "The audit trail").

Every change of the server's state is one :class:`Entry` (the action, its target, the old and new
values, and the caller: who the credential says, the client's address, the request id), and
:meth:`AuditTrail.record` is the one place that turns it into both of its forms: a line of the
logger ``visionserve.audit`` (with ``--log-json``, the field ``audit``), and a row of a SQLite
file, ``audit.sqlite`` beside the users file (setting ``audit_db``), kept for
``audit_retention_days``.

One file that every process writes: the serving process (verdict rules, recipes, models, the
guard's jobs), each ``--frontends`` process (sign-ins and sign-outs land where the request lands)
and ``visionserve users`` (user changes, by the OS user who runs it). SQLite's WAL lets them: a
writer waits a few milliseconds for another, readers never wait. Changes are rare, so a write
costs nothing that matters; the server's routes still make it off the event loop
(:meth:`AuditTrail.arecord`) and answer once it is kept. Old entries are deleted by the server,
at most once an hour per process, with one DELETE on the indexed time column.

A write that fails (disk full, read-only) does not undo the change: the log line still says it,
and an error line says the entry was not kept.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ServerSettings, users_db_path
from .storage import open_sqlite, sqlite_fault

#: "visionserve.audit": the audit lines (journald and log shippers filter on this name), and an
#: error line where an entry could not be kept
log = logging.getLogger(__name__)

AUDIT_ENV = "VISIONSERVE_AUDIT_DB"
FILE_NAME = "audit.sqlite"
#: the server deletes entries past the retention at most this often (per process)
PRUNE_EVERY_S = 3600.0
#: the most entries one read returns
MAX_LIMIT = 500

#: every action an entry can name, as the API's ``action`` filter takes it
ACTIONS = ("verdict", "recipe", "model-load", "model-unload", "job-submit", "job-cancel",
           "user-add", "user-remove", "user-role", "user-password", "sign-in", "sign-out",
           "sign-in-failed", "flag", "label", "candidate", "candidate-evaluate",
           "promote-approval", "promote", "rollback", "candidate-shadow", "candidate-shadow-stop")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, user TEXT NOT NULL,
    declared TEXT, client TEXT NOT NULL, request_id TEXT, action TEXT NOT NULL,
    target TEXT NOT NULL, old TEXT, new TEXT);
CREATE INDEX IF NOT EXISTS audit_time ON audit (time);
CREATE INDEX IF NOT EXISTS audit_user ON audit (user, id);
CREATE INDEX IF NOT EXISTS audit_action ON audit (action, id);
"""


@dataclass(frozen=True)
class Entry:
    """One change. ``kind`` and ``name`` are its target (``model``, ``station``, ``job``,
    ``user``, and its name); ``old`` and ``new`` are JSON values (None: none, as for a model not
    loaded before); ``caller`` is who made it: ``operator`` (the credential's identity, a signed-in
    user's name, or the OS user of a command), ``operator_declared`` (the ``X-Operator`` header,
    unchecked), ``client`` and ``request_id``."""

    action: str
    kind: str
    name: str
    old: Any = None
    new: Any = None
    caller: Mapping[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"{self.kind} {self.name}"

    @property
    def user(self) -> str:
        return str(self.caller.get("operator") or "")

    def by(self) -> str:
        """Who, as an audit line names it: the operator and the client's address."""
        client = self.caller.get("client") or "?"
        return f"{self.user} from {client}" if self.user else str(client)

    def log_fields(self) -> dict[str, Any]:
        """The ``audit`` field of the log line (``--log-json``). A failed sign-in's name is left
        out: it may be a password typed into the wrong field, which the audit file (mode 0600,
        read by quality and admin) may hold but every reader of the log must not see."""
        name = None if self.action == "sign-in-failed" else self.name
        return {"action": self.action, self.kind: name, "old": self.old, "new": self.new,
                "caller": dict(self.caller)}


@dataclass(frozen=True)
class Row:
    """An entry as kept: ``time`` in seconds since the epoch, ``old`` and ``new`` decoded."""

    id: int
    time: float
    user: str
    declared: str | None
    client: str
    request_id: str | None
    action: str
    target: str
    old: Any
    new: Any


@dataclass(frozen=True)
class Filters:
    """Which entries a reader asks for: ``since`` <= time < ``until`` (seconds since the epoch),
    of ``user`` and ``action`` where given."""

    since: float | None = None
    until: float | None = None
    user: str = ""
    action: str = ""


def command_caller(command: str) -> dict[str, str]:
    """The caller of a change made from the command line: the OS user who runs ``command``, on
    this machine."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a UID without a name (a container's)
        user = f"uid {os.getuid()}"
    return {"operator": user, "client": f"{command} on {socket.gethostname()}"}


def audit_db_path(configured: Path | None = None, users_db: Path | None = None) -> Path:
    """The audit file: ``configured`` (the setting audit_db), else ``$VISIONSERVE_AUDIT_DB``,
    else ``audit.sqlite`` in the users file's folder (``users_db``, as :func:`users_db_path`
    finds it): the same for the server and ``visionserve users``."""
    if configured:
        return Path(configured)
    env = os.environ.get(AUDIT_ENV)
    return Path(env) if env else users_db_path(users_db).parent / FILE_NAME


class AuditTrail:
    """The audit file of one process, opened (and made: mode 0600, its folder 0700) at the first
    write or read. ``retention_days``: entries older are deleted (0 or None: kept). Safe to use
    from several threads (a connection each) and processes (SQLite's locks)."""

    def __init__(self, path: Path, retention_days: float | None = None) -> None:
        self.path = Path(path)
        self.retention_s = retention_days * 86400.0 if retention_days else None
        self._local = threading.local()
        self._made = False
        self._lock = threading.Lock()
        self._pruned = 0.0

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> AuditTrail:
        return cls(audit_db_path(settings.audit_db, settings.users_db),
                   settings.audit_retention_days)

    @property
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            with self._lock:
                if not self._made:
                    self._create()
            db = open_sqlite(str(self.path), 5.0)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                if not self._made:
                    db.executescript(_SCHEMA)
                    self._made = True
            except BaseException:
                db.close()
                raise
            self._local.db = db
        return db

    def _create(self) -> None:
        """Make the file with mode 0600 where it is missing. Only with O_EXCL: closing a
        descriptor of a file drops every POSIX lock this process holds on it, those of its
        SQLite connections included, and another process could then take the file as unused
        (and checkpoint and delete the WAL that this process still writes)."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass

    # --- writing ------------------------------------------------------------------------------

    def record(self, entry: Entry, message: str, *args: Any, level: int = logging.INFO) -> bool:
        """Log ``message % args`` (at ``level``) as the audit line of ``entry`` and keep the
        entry; False (and an error line) when the file cannot be written. Blocks for the write:
        on an event loop, await :meth:`arecord`."""
        extra: dict[str, Any] = {"audit": entry.log_fields()}
        if entry.kind == "model":
            extra["model"] = entry.name
        log.log(level, message, *args, extra=extra)
        try:
            self._insert(entry)
        except (sqlite3.Error, OSError) as exc:  # OSError: its folder cannot be made
            if isinstance(exc, sqlite3.Error) and not sqlite_fault(exc):
                raise  # a wrong statement: a bug
            log.error("audit: the entry (%s of %s by %s) could not be kept in %s: %s",
                      entry.action, entry.target, entry.by(), self.path, exc)
            return False
        return True

    async def arecord(self, entry: Entry, message: str, *args: Any,
                      level: int = logging.INFO) -> bool:
        """:meth:`record`, off the event loop."""
        return await asyncio.to_thread(lambda: self.record(entry, message, *args, level=level))

    def _insert(self, entry: Entry) -> None:
        now = time.time()
        caller = entry.caller
        row = (now, entry.user, caller.get("operator_declared"), str(caller.get("client") or "?"),
               caller.get("request_id"), entry.action, entry.target, _json(entry.old),
               _json(entry.new))
        db = self._db
        db.execute("INSERT INTO audit (time, user, declared, client, request_id, action, target, "
                   "old, new) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
        if self.retention_s is not None and now - self._pruned >= PRUNE_EVERY_S:
            self.prune(now)

    def prune(self, now: float | None = None) -> int:
        """Delete the entries past the retention; how many went."""
        if self.retention_s is None:
            return 0
        now = time.time() if now is None else now
        self._pruned = now
        return self._db.execute("DELETE FROM audit WHERE time < ?",
                                (now - self.retention_s,)).rowcount

    # --- reading ------------------------------------------------------------------------------

    def read(self, filters: Filters = Filters(), *, before: int | None = None,
             after: int | None = None, limit: int = 50) -> list[Row]:
        """Entries of ``filters``, newest first, at most ``limit``: those before entry id
        ``before`` (the next older page), or the ``limit`` oldest after id ``after`` (the next
        newer page)."""
        where: list[str] = []
        values: list[float | str | int] = []
        for clause, value in (("time >= ?", filters.since), ("time < ?", filters.until),
                              ("user = ?", filters.user or None),
                              ("action = ?", filters.action or None), ("id < ?", before),
                              ("id > ?", after)):
            if value is not None:
                where.append(clause)
                values.append(value)
        order = "ASC" if after is not None and before is None else "DESC"
        sql = ("SELECT id, time, user, declared, client, request_id, action, target, old, new "
               f"FROM audit {'WHERE ' + ' AND '.join(where) if where else ''} "
               f"ORDER BY id {order} LIMIT ?")
        rows = [Row(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], _unjson(r[8]),
                    _unjson(r[9]))
                for r in self._db.execute(sql, (*values, max(1, min(limit, MAX_LIMIT))))]
        return rows[::-1] if order == "ASC" else rows

    def has(self, filters: Filters, *, before: int | None = None,
            after: int | None = None) -> bool:
        """Whether an entry of ``filters`` lies before (older) or after (newer) an id."""
        return bool(self.read(filters, before=before, after=after, limit=1))


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _unjson(text: str | None) -> Any:
    return None if text is None else json.loads(text)
