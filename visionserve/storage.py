"""SQLite as the server's stores use it (the guard's job queue, the traceability records): one
way to open a connection, and one rule for which of SQLite's errors are the file's or the disk's
(a fault that may pass: full, read-only, I/O, gone, locked) rather than the code's."""

from __future__ import annotations

import sqlite3


def sqlite_fault(exc: BaseException) -> bool:
    """SQLite's errors that are the file's or the disk's (full, read-only, I/O, cannot open,
    locked, corrupt), not a wrong statement or a broken constraint (a bug: left to propagate)."""
    return isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError


def open_sqlite(path: str, timeout_s: float) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit: ``BEGIN IMMEDIATE``), rows as
    ``sqlite3.Row``, waiting up to ``timeout_s`` for another writer, and ``synchronous=NORMAL``
    (with WAL: durable across process crashes, one fsync per checkpoint instead of per commit).
    Raises ``sqlite3.Error`` as SQLite does."""
    c = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
    try:
        c.row_factory = sqlite3.Row
        c.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
        c.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        c.close()
        raise
    return c
