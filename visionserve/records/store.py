"""Where records are kept: SQLite in WAL mode (the default, one file in the data folder), or
PostgreSQL (``postgresql://...``, the ``records-pg`` extra), behind one interface.

One table, ``records``, indexed by part id and time, the task's result and the timings as JSON;
beside it ``labels``: what a user says a captured frame shows (a flag or the review queue's
label), every label kept, the latest of a record the one in force.
Writes come from one writer thread (:mod:`.writer`), a batch per transaction; reads (the part's
history, the export) open their own connection, so they never wait for the writer's batches
(SQLite's WAL lets readers run beside the writer) and never stall it.

A store that cannot be used now (disk full, read-only, gone, I/O error, the database server
down) raises :class:`StoreFault`; the writer counts it, says so and tries again later.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import ConfigError, Unavailable
from ..extras import require
from ..storage import open_sqlite, sqlite_fault
from .record import COLUMNS, Record, iso

#: the part's history: at most this many records in one answer
MAX_HISTORY = 1000
#: the listing (``GET /v1/records``): at most this many records in one page
MAX_PAGE = 500
#: rows fetched at a time by an export
EXPORT_CHUNK = 2000
#: rows deleted per statement by retention (short transactions: the writer goes on between them)
DELETE_CHUNK = 5000


class StoreFault(Unavailable):
    """The record store cannot be used now (HTTP 503 for a read); the same call may work later."""

    RETRY_AFTER_S = 5.0

    def __init__(self, where: str, cause: BaseException | str) -> None:
        super().__init__(f"the record store cannot be used now ({cause}): {where}",
                         retry_after_s=self.RETRY_AFTER_S)
        self.cause = str(cause)
        #: the disk (or the database's quota) is full: retention may make room
        self.full = "full" in self.cause.lower() or "no space" in self.cause.lower()


@dataclass(frozen=True)
class RecordQuery:
    """Which records a listing wants: each field set narrows it (equality; ``since <= time <
    until``); ``before``: (time, id) of the previous page's last row, for the next page."""

    verdict: str | None = None
    model: str | None = None
    label: str | None = None
    part_id: str | None = None
    since: float | None = None
    until: float | None = None
    before: tuple[float, int] | None = None
    limit: int = 100
    #: only records whose frame was captured (an image is stored): the console's NG gallery
    captured: bool = False

    def where(self, mark: str, time_sql: str = "?") -> tuple[str, tuple]:
        """The WHERE clause (``mark``: the dialect's placeholder, ``time_sql`` the expression a
        time parameter goes into) and its parameters."""
        terms: list[str] = []
        args: list = []
        for column in ("verdict", "model", "label", "part_id"):
            value = getattr(self, column)
            if value is not None:
                terms.append(f"{column} = {mark}")
                args.append(value)
        if self.captured:  # also what the partial indexes of captured records name
            terms.append("image IS NOT NULL")
        if self.since is not None:
            terms.append(f"time >= {time_sql}")
            args.append(self.since)
        if self.until is not None:
            terms.append(f"time < {time_sql}")
            args.append(self.until)
        if self.before is not None:  # keyset: strictly after the last row, newest first
            terms.append(f"(time < {time_sql} OR (time = {time_sql} AND id < {mark}))")
            args += [self.before[0], self.before[0], self.before[1]]
        return (" WHERE " + " AND ".join(terms)) if terms else "", tuple(args)


#: where a label came from: a flag (``POST /v1/records/{id}/flag``) or the review queue
LABEL_SOURCES = ("flag", "review")


@dataclass(frozen=True)
class Label:
    """What a user said a captured frame shows: ``label`` the validated body (``{"label": ...}``
    or ``{"boxes": [...]}``, :mod:`.labels`), ``by`` the user's name (or ``admin-token``),
    ``time`` seconds since the epoch, ``source`` one of LABEL_SOURCES."""

    record_id: int
    label: dict[str, Any]
    by: str
    time: float
    source: str

    @classmethod
    def from_row(cls, row: Any, prefix: str = "") -> Label:
        value = row[f"{prefix}label"]
        return cls(row[f"{prefix}record_id"], json.loads(value) if isinstance(value, str)
                   else value, row[f"{prefix}labelled_by"], row[f"{prefix}time"],
                   row[f"{prefix}source"])

    def to_dict(self) -> dict[str, Any]:
        return {"record_id": self.record_id, **self.label, "labelled_by": self.by,
                "time": iso(self.time), "timestamp": self.time, "source": self.source}


@dataclass(frozen=True)
class ReviewQuery:
    """The review queue's page: the captured records of ``model`` without a label
    (``labelled`` False) or with one (True), newest first; ``before`` as RecordQuery's."""

    model: str
    labelled: bool = False
    before: tuple[float, int] | None = None
    limit: int = 50


class RecordStore(ABC):
    """``write`` from one thread (the writer); the reads from any thread."""

    #: how the store is named in logs, doctor and errors (no password)
    where: str

    @abstractmethod
    def write(self, records: Sequence[Record]) -> None:
        """Append ``records`` in one transaction (all or none)."""

    @abstractmethod
    def history(self, part_id: str, limit: int = 100) -> list[Record]:
        """The part's records, newest first."""

    @abstractmethod
    def record(self, row_id: int) -> Record | None:
        """The record with this id (a listing's), None when there is none (never written, or
        deleted by retention)."""

    @abstractmethod
    def listing(self, query: RecordQuery) -> list[tuple[int, Record]]:
        """Up to ``query.limit`` (at most MAX_PAGE) records ``query`` names, newest first (by
        time, then id), each with its id (the next page's ``before``)."""

    @abstractmethod
    def add_label(self, record_id: int, label: dict[str, Any], by: str, source: str,
                  now: float | None = None) -> Label:
        """Keep a label of a record (from any thread: a connection of its own)."""

    @abstractmethod
    def labels(self, record_id: int) -> list[Label]:
        """The record's labels, newest (the one in force) first."""

    @abstractmethod
    def set_image(self, record_id: int, image: str, kept_for: str) -> None:
        """Name the image of a record written without one (a frame captured later, for a flag);
        a record that has an image keeps it (from any thread: a connection of its own)."""

    @abstractmethod
    def review(self, query: ReviewQuery) -> list[tuple[int, Record, Label | None]]:
        """A page of the review queue: (id, record, its label in force or None)."""

    @abstractmethod
    def labelled_images(self) -> set[str]:
        """Where the images of labelled records are (their ``image``): the capture quota never
        deletes them."""

    def select(self, since: float | None = None, until: float | None = None) -> Iterator[Record]:
        """Records with ``since <= time < until``, oldest first (:meth:`exported`'s)."""
        for _, record, _ in self.exported(since, until):
            yield record

    def exported(self, since: float | None = None, until: float | None = None
                 ) -> Iterator[tuple[int, Record, Label | None]]:
        """(id, record, its label in force or None) of the records with ``since <= time <
        until``, oldest first, fetched a chunk at a time (by id: a long export holds no
        transaction open)."""
        lo = 0.0 if since is None else since
        hi = 1.0e11 if until is None else until  # the year 5138
        last = -1
        while True:
            rows = self._chunk(last, lo, hi, EXPORT_CHUNK)
            yield from _labelled_rows(rows)
            if len(rows) < EXPORT_CHUNK:
                return
            last = rows[-1]["id"]

    @abstractmethod
    def _chunk(self, after_id: int, since: float, until: float, n: int) -> list:
        """Up to ``n`` rows (mappings with ``id``, COLUMNS and the label in force as ``l_*``
        columns, :func:`_with_label`) with id > ``after_id`` and ``since <= time < until``,
        by id."""

    @abstractmethod
    def retain(self, max_age_s: float, max_bytes: int, now: float | None = None) -> int:
        """Delete records older than ``max_age_s`` and, past ``max_bytes``, the oldest until the
        store is under 90% of it; returns how many went."""

    @abstractmethod
    def size(self) -> int:
        """Bytes the records take."""

    def close(self) -> None:
        """Release the writer's connection (reads open their own)."""

    @property
    def folder(self) -> Path | None:
        """The folder the store's files are in (None: a database server's)."""
        return None

    def reclaim(self) -> None:
        """On a full disk: give back the space the store holds beyond its records, if any."""


def open_store(url: str | None, folder: Path) -> RecordStore:
    """The store a settings' ``records_url`` names (None: ``records.sqlite`` in ``folder``)."""
    if not url:
        return SqliteStore(folder / "records.sqlite")
    scheme = url.partition(":")[0].lower()
    if scheme == "sqlite":
        path = url.partition(":")[2].removeprefix("//")
        if not path:
            raise ConfigError(f"records_url {url!r}: use sqlite:///absolute/path/records.sqlite")
        return SqliteStore(Path(path))
    if scheme in ("postgresql", "postgres"):
        return PostgresStore(url)
    raise ConfigError(f"records_url {redact(url)!r}: use sqlite:///path/records.sqlite or "
                      "postgresql://user@host:5432/dbname")


def redact(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


# --- SQLite --------------------------------------------------------------------------------------

#: each column's type in SQLite and in PostgreSQL: one table, the two dialects
_TYPES = {
    "time": ("REAL NOT NULL", "TIMESTAMPTZ NOT NULL"),  # SQLite: seconds since the epoch
    "model": ("TEXT NOT NULL", "TEXT NOT NULL"), "version": ("TEXT NOT NULL", "TEXT NOT NULL"),
    "verdict": ("TEXT NOT NULL", "TEXT NOT NULL"),  # OK, NG, LATE, ERROR
    "score": ("REAL", "DOUBLE PRECISION"),
    "result": ("TEXT", "JSONB"), "timings": ("TEXT", "JSONB"),  # JSON
    "frame_index": ("INTEGER NOT NULL DEFAULT 0", "INTEGER NOT NULL DEFAULT 0"),
    "camera_time": ("REAL", "DOUBLE PRECISION"),  # the camera's clock, seconds
    "camera_frame": ("INTEGER", "BIGINT"),  # the camera's frame id
}
#: columns newer than the table's first form: a table made before them gains them when the store
#: opens it (each nullable, so the records already there read None)
_ADDED = ("camera_time", "camera_frame", "kept_for")


def _type(column: str, dialect: int) -> str:
    return _TYPES.get(column, ("TEXT", "TEXT"))[dialect]


def _schema(table: str, dialect: int, key: str) -> str:
    """The table and its indexes (part id and time) in SQLite (0) or PostgreSQL (1)."""
    cols = ",\n    ".join([f"id {key}"] + [f"{c} {_type(c, dialect)}" for c in COLUMNS])
    return (f"CREATE TABLE IF NOT EXISTS {table} (\n    {cols}\n);\n"
            f"CREATE INDEX IF NOT EXISTS {table}_part ON {table} (part_id, time);\n"
            f"CREATE INDEX IF NOT EXISTS {table}_time ON {table} (time);\n"
            # the listing's filters (GET /v1/records), newest first within each
            f"CREATE INDEX IF NOT EXISTS {table}_model ON {table} (model, time);\n"
            f"CREATE INDEX IF NOT EXISTS {table}_label ON {table} (label, time);\n"
            f"CREATE INDEX IF NOT EXISTS {table}_verdict ON {table} (verdict, time);\n"
            # the captured frames (the console's gallery): few of all records, so a filter
            # that matches many records but few images still reads only images' rows
            f"CREATE INDEX IF NOT EXISTS {table}_captured ON {table} (verdict, time) "
            "WHERE image IS NOT NULL;\n"
            f"CREATE INDEX IF NOT EXISTS {table}_captured_model ON {table} (model, time) "
            "WHERE image IS NOT NULL;\n"
            f"CREATE INDEX IF NOT EXISTS {table}_captured_label ON {table} (label, time) "
            "WHERE image IS NOT NULL;\n")


def _labels_schema(table: str, dialect: int, key: str) -> str:
    """The labels table: every label kept, the latest of a record (highest id) in force."""
    time_type, json_type = ("REAL", "TEXT") if dialect == 0 else ("TIMESTAMPTZ", "JSONB")
    return (f"CREATE TABLE IF NOT EXISTS {table} (\n    id {key},\n    record_id BIGINT NOT NULL,"
            f"\n    label {json_type} NOT NULL,\n    labelled_by TEXT NOT NULL,\n"
            f"    time {time_type} NOT NULL,\n    source TEXT NOT NULL\n);\n"
            f"CREATE INDEX IF NOT EXISTS {table}_record ON {table} (record_id, id);\n")


def _with_label(records: str, labels: str, columns: str, label_time: str) -> str:
    """``SELECT`` (and ``FROM``) of records (``r``), each joined to its label in force (``l``,
    as ``l_*`` columns; NULL without one), in either dialect."""
    return (f"SELECT r.id AS id, {columns}, l.record_id AS l_record_id, "
            f"l.label AS l_label, l.labelled_by AS l_labelled_by, {label_time} AS l_time, "
            f"l.source AS l_source FROM {records} r LEFT JOIN {labels} l ON l.id = "
            f"(SELECT max(id) FROM {labels} WHERE record_id = r.id)")


def _review_sql(query: ReviewQuery, records: str, labels: str, mark: str, time_sql: str,
                columns: str, label_time: str) -> tuple[str, tuple]:
    """The review queue's statement in either dialect: captured records of the model, each
    joined to its latest label (``l_*`` columns)."""
    terms = ["r.image IS NOT NULL", f"r.model = {mark}",
             "l.id IS NOT NULL" if query.labelled else "l.id IS NULL"]
    args: list = [query.model]
    if query.before is not None:
        terms.append(f"(r.time < {time_sql} OR (r.time = {time_sql} AND r.id < {mark}))")
        args += [query.before[0], query.before[0], query.before[1]]
    sql = (f"{_with_label(records, labels, columns, label_time)} WHERE {' AND '.join(terms)} "
           f"ORDER BY r.time DESC, r.id DESC LIMIT {mark}")
    return sql, (*args, min(query.limit, MAX_PAGE))


def _labelled_rows(rows: list) -> list[tuple[int, Record, Label | None]]:
    return [(r["id"], Record.from_row(r),
             Label.from_row(r, "l_") if r["l_record_id"] is not None else None) for r in rows]


_SQLITE_SCHEMA = _schema("records", 0, "INTEGER PRIMARY KEY") + _labels_schema(
    "labels", 0, "INTEGER PRIMARY KEY")
#: retention keeps labelled records: a label names its record, the training set both
_UNLABELLED = "id NOT IN (SELECT record_id FROM {})"
_SQLITE_REVIEW_COLUMNS = ", ".join(f"r.{c} AS {c}" for c in COLUMNS)
_INSERT = (f"INSERT INTO records ({', '.join(COLUMNS)}) VALUES "
           f"({', '.join('?' * len(COLUMNS))})")
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM records"


class SqliteStore(RecordStore):
    """One SQLite file in WAL mode, ``auto_vacuum=INCREMENTAL`` (retention gives the space of
    deleted records back to the file system)."""

    def __init__(self, path: Path, busy_timeout_s: float = 5.0) -> None:
        self.path = Path(path).absolute()
        self.where = str(self.path)
        self._timeout = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._inode: tuple[int, int] | None = None

    def _open(self) -> sqlite3.Connection:
        """A writing connection to the file, its table made (or brought up to the columns of
        this version: ``_ADDED``). Raises sqlite3.Error as SQLite does."""
        c = open_sqlite(str(self.path), self._timeout)
        try:
            c.execute("PRAGMA auto_vacuum=INCREMENTAL")  # only takes on a new file
            c.execute("PRAGMA journal_mode=WAL")
            c.executescript(_SQLITE_SCHEMA)
            have = {r[1] for r in c.execute("PRAGMA table_info(records)")}
            for column in _ADDED:
                if column not in have:
                    try:
                        c.execute(f"ALTER TABLE records ADD COLUMN {column} {_type(column, 0)}")
                    except sqlite3.OperationalError as exc:  # another process added it first
                        if "duplicate column" not in str(exc):
                            raise
        except BaseException:
            c.close()
            raise
        return c

    # -- the writer's connection ------------------------------------------------------------------
    def _writer(self) -> sqlite3.Connection:
        """The writer's connection, (re)opened when there is none or when the file it has open
        is no longer the one at ``path`` (deleted or replaced under the server: SQLite would go
        on writing into the unlinked file, and every record would be lost)."""
        try:
            st = self.path.stat()
            inode: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            inode = None
        except OSError as exc:
            raise StoreFault(self.where, exc) from exc
        if self._conn is not None and inode == self._inode:
            return self._conn
        self.close()
        if not self.path.parent.is_dir():
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreFault(self.where, exc) from exc
        try:
            c = self._open()
        except sqlite3.Error as exc:
            if not sqlite_fault(exc):
                raise
            raise StoreFault(self.where, exc) from exc
        st = self.path.stat()
        self._conn, self._inode = c, (st.st_dev, st.st_ino)
        return c

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
        self._conn = self._inode = None

    @property
    def folder(self) -> Path:
        return self.path.parent

    def reclaim(self) -> None:
        """Copy the WAL into the database and truncate it (the WAL only shrinks at a checkpoint:
        on a small disk it can hold much of the space)."""
        try:
            self._writer().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except (sqlite3.Error, StoreFault):
            self.close()

    def _tx(self, statements) -> None:
        """Run ``statements(connection)`` in one write transaction; StoreFault when the file or
        the disk refuses (the connection is dropped: the next call opens a new one)."""
        c = self._writer()
        with self._writer_faults():
            c.execute("BEGIN IMMEDIATE")
            try:
                statements(c)
            except BaseException:
                if c.in_transaction:  # SQLite may have rolled back itself (disk full, I/O error)
                    c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")

    @contextlib.contextmanager
    def _writer_faults(self) -> Iterator[None]:
        """A fault of the file or the disk in the writer's connection: it is dropped (the next
        call opens a new one) and StoreFault raised."""
        try:
            yield
        except sqlite3.Error as exc:
            if not sqlite_fault(exc):
                raise
            self.close()
            raise StoreFault(self.where, exc) from exc

    def write(self, records: Sequence[Record]) -> None:
        self._tx(lambda c: c.executemany(_INSERT, [r.row() for r in records]))

    # -- reads: a connection each -----------------------------------------------------------------
    def _read(self, sql: str, args: tuple, upgraded: bool = False) -> list[sqlite3.Row]:
        if not self.path.exists():  # sqlite3 would make an empty file: nothing recorded yet
            return []
        try:
            c = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True, timeout=self._timeout)
            try:
                c.row_factory = sqlite3.Row
                return c.execute(sql, args).fetchall()
            finally:
                c.close()
        except sqlite3.Error as exc:
            if "no such table" in str(exc):  # the writer is making the file: nothing recorded
                return []
            if "no such column" in str(exc) and not upgraded:
                # a file of an earlier version no writer has opened yet (an export of old
                # records): it gains the new columns, then is read
                self._upgrade()
                return self._read(sql, args, upgraded=True)
            if not sqlite_fault(exc):
                raise
            raise StoreFault(self.where, exc) from exc

    def _upgrade(self) -> None:
        """Bring the file's table up to this version's columns (a connection of its own: the
        writer's belongs to the writer thread)."""
        try:
            self._open().close()
        except sqlite3.Error as exc:
            if not sqlite_fault(exc):
                raise
            raise StoreFault(self.where, f"cannot add this version's columns ({exc})") from exc

    def history(self, part_id: str, limit: int = 100) -> list[Record]:
        rows = self._read(f"{_SELECT} WHERE part_id = ? ORDER BY time DESC, id DESC LIMIT ?",
                          (part_id, min(limit, MAX_HISTORY)))
        return [Record.from_row(r) for r in rows]

    def record(self, row_id: int) -> Record | None:
        rows = self._read(f"{_SELECT} WHERE id = ?", (row_id,))
        return Record.from_row(rows[0]) if rows else None

    def listing(self, query: RecordQuery) -> list[tuple[int, Record]]:
        rows = self._read(*self.listing_sql(query))
        return [(r["id"], Record.from_row(r)) for r in rows]

    @staticmethod
    def listing_sql(query: RecordQuery) -> tuple[str, tuple]:
        """The listing's statement and parameters (its plan is checked to use an index)."""
        where, args = query.where("?")
        sql = (f"SELECT id, {', '.join(COLUMNS)} FROM records{where} "
               "ORDER BY time DESC, id DESC LIMIT ?")
        return sql, (*args, min(query.limit, MAX_PAGE))

    def add_label(self, record_id: int, label: dict[str, Any], by: str, source: str,
                  now: float | None = None) -> Label:
        kept = Label(record_id, label, by, time.time() if now is None else now, source)
        self._apart("INSERT INTO labels (record_id, label, labelled_by, time, source) VALUES "
                    "(?, ?, ?, ?, ?)", (record_id, json.dumps(label), by, kept.time, source))
        return kept

    def _apart(self, sql: str, args: tuple) -> None:
        """One statement on a connection of its own (any thread; the table made where no record
        was written yet); StoreFault when the file or the disk refuses."""
        try:
            c = self._open()
            try:
                c.execute(sql, args)
            finally:
                c.close()
        except sqlite3.Error as exc:
            if not sqlite_fault(exc):
                raise
            raise StoreFault(self.where, exc) from exc

    def labels(self, record_id: int) -> list[Label]:
        rows = self._read("SELECT record_id, label, labelled_by, time, source FROM labels "
                          "WHERE record_id = ? ORDER BY id DESC", (record_id,))
        return [Label.from_row(r) for r in rows]

    def set_image(self, record_id: int, image: str, kept_for: str) -> None:
        self._apart("UPDATE records SET image = ?, kept_for = ? WHERE id = ? AND image IS NULL",
                    (image, kept_for, record_id))

    def review(self, query: ReviewQuery) -> list[tuple[int, Record, Label | None]]:
        return _labelled_rows(self._read(*_review_sql(
            query, "records", "labels", "?", "?", _SQLITE_REVIEW_COLUMNS, "l.time")))

    def labelled_images(self) -> set[str]:
        rows = self._read("SELECT DISTINCT r.image FROM labels l JOIN records r ON "
                          "r.id = l.record_id WHERE r.image IS NOT NULL", ())
        return {r[0] for r in rows}

    def _chunk(self, after_id: int, since: float, until: float, n: int) -> list:
        return self._read(f"{_with_label('records', 'labels', _SQLITE_REVIEW_COLUMNS, 'l.time')}"
                          " WHERE r.id > ? AND r.time >= ? AND r.time < ? ORDER BY r.id LIMIT ?",
                          (after_id, since, until, n))

    # -- retention (the writer's thread) ----------------------------------------------------------
    def size(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.stat(f"{self.path}{suffix}").st_size
            except OSError:
                pass
        return total

    def _used(self, c: sqlite3.Connection) -> int:
        page = c.execute("PRAGMA page_size").fetchone()[0]
        pages = c.execute("PRAGMA page_count").fetchone()[0]
        free = c.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * page

    def retain(self, max_age_s: float, max_bytes: int, now: float | None = None) -> int:
        cutoff = (time.time() if now is None else now) - max_age_s
        deleted = 0
        while True:  # by age, oldest first, a chunk per transaction
            n = self._delete("time < ?", (cutoff,))
            deleted += n
            if n < DELETE_CHUNK:
                break
        c = self._writer()
        with self._writer_faults():
            used = self._used(c)
            if used > max_bytes:
                count = c.execute("SELECT COUNT(*) FROM records").fetchone()[0]
                # rows are about the same size: delete the share that brings it to 90%
                excess = count - int(count * 0.9 * max_bytes / used)
                last = c.execute("SELECT id FROM records ORDER BY id LIMIT 1 OFFSET ?",
                                 (max(0, excess - 1),)).fetchone()
                if last is not None:
                    while True:
                        n = self._delete("id <= ?", (last[0],))
                        deleted += n
                        if n < DELETE_CHUNK:
                            break
            if deleted:
                c = self._writer()
                # sqlite3_exec runs it to the end (execute() frees one page per step)
                c.executescript("PRAGMA incremental_vacuum;")
                c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return deleted

    def _delete(self, where: str, args: tuple) -> int:
        out = [0]

        def run(c: sqlite3.Connection) -> None:
            out[0] = c.execute(f"DELETE FROM records WHERE id IN (SELECT id FROM records WHERE "
                               f"{where} AND {_UNLABELLED.format('labels')} ORDER BY id "
                               f"LIMIT {DELETE_CHUNK})", args).rowcount

        self._tx(run)
        return out[0]


# --- PostgreSQL ----------------------------------------------------------------------------------

_PG_TABLE = "visionserve_records"
_PG_LABELS = "visionserve_labels"
_PG_SCHEMA = _schema(_PG_TABLE, 1, "BIGSERIAL PRIMARY KEY") + _labels_schema(
    _PG_LABELS, 1, "BIGSERIAL PRIMARY KEY") + "".join(
    f"ALTER TABLE {_PG_TABLE} ADD COLUMN IF NOT EXISTS {c} {_type(c, 1)};\n" for c in _ADDED)
_PG_COLUMNS = ", ".join("extract(epoch from time)::float8 AS time" if c == "time" else c
                        for c in COLUMNS)
_PG_REVIEW_COLUMNS = ", ".join("extract(epoch from r.time)::float8 AS time" if c == "time"
                               else f"r.{c} AS {c}" for c in COLUMNS)
_PG_LABEL_COLUMNS = ("record_id, label, labelled_by, extract(epoch from time)::float8 AS time, "
                     "source")
_KEEP_LABELLED_PG = _UNLABELLED.format(_PG_LABELS)
_PG_INSERT = (f"INSERT INTO {_PG_TABLE} ({', '.join(COLUMNS)}) VALUES "
              f"({', '.join('to_timestamp(%s)' if c == 'time' else '%s' for c in COLUMNS)})")


class PostgresStore(RecordStore):
    """A table ``visionserve_records`` in a PostgreSQL database (psycopg 3). Retention by size
    deletes the oldest rows; PostgreSQL's autovacuum reuses their space (the files do not
    shrink)."""

    def __init__(self, url: str, connect_timeout_s: float = 5.0) -> None:
        self.psycopg = require("psycopg", "a PostgreSQL record store")
        self.url = url
        self.where = redact(url)
        self._timeout = connect_timeout_s
        self._conn = None

    def _connect(self):
        try:
            return self.psycopg.connect(self.url, connect_timeout=max(1, int(self._timeout)),
                                        application_name="visionserve-records")
        except self.psycopg.Error as exc:
            raise StoreFault(self.where, _first_line(exc)) from exc

    def _writer(self):
        if self._conn is None or self._conn.closed:
            self._conn = self._schema()
        return self._conn

    def _schema(self):
        """A connection, the table made (or brought up to this version's columns)."""
        c = self._connect()
        try:
            with c.transaction():
                c.execute(_PG_SCHEMA)
        except self.psycopg.Error as exc:
            c.close()
            raise StoreFault(self.where, _first_line(exc)) from exc
        return c

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def _tx(self, statements) -> None:
        c = self._writer()
        try:
            with c.transaction():
                statements(c)
        except self.psycopg.Error as exc:
            self.close()
            raise StoreFault(self.where, _first_line(exc)) from exc

    def write(self, records: Sequence[Record]) -> None:
        def run(c) -> None:
            with c.cursor() as cur:
                cur.executemany(_PG_INSERT, [r.row() for r in records])

        self._tx(run)

    def _read(self, sql: str, args: tuple, upgraded: bool = False) -> list:
        from psycopg.rows import dict_row

        c = self._connect()
        try:
            with c.cursor(row_factory=dict_row) as cur:
                return cur.execute(sql, args).fetchall()
        except self.psycopg.errors.UndefinedTable:
            return []  # nothing recorded yet
        except self.psycopg.errors.UndefinedColumn as exc:
            if upgraded:
                raise StoreFault(self.where, _first_line(exc)) from exc
            # a table of an earlier version no writer has opened yet: it gains the new columns
            c.close()
            self._schema().close()
            return self._read(sql, args, upgraded=True)
        except self.psycopg.Error as exc:
            raise StoreFault(self.where, _first_line(exc)) from exc
        finally:
            c.close()

    def history(self, part_id: str, limit: int = 100) -> list[Record]:
        rows = self._read(f"SELECT {_PG_COLUMNS} FROM {_PG_TABLE} WHERE part_id = %s "
                          "ORDER BY time DESC, id DESC LIMIT %s",
                          (part_id, min(limit, MAX_HISTORY)))
        return [Record.from_row(r) for r in rows]

    def record(self, row_id: int) -> Record | None:
        rows = self._read(f"SELECT {_PG_COLUMNS} FROM {_PG_TABLE} WHERE id = %s", (row_id,))
        return Record.from_row(rows[0]) if rows else None

    def listing(self, query: RecordQuery) -> list[tuple[int, Record]]:
        where, args = query.where("%s", "to_timestamp(%s)")
        rows = self._read(f"SELECT id, {_PG_COLUMNS} FROM {_PG_TABLE}{where} "
                          "ORDER BY time DESC, id DESC LIMIT %s",
                          (*args, min(query.limit, MAX_PAGE)))
        return [(r["id"], Record.from_row(r)) for r in rows]

    def add_label(self, record_id: int, label: dict[str, Any], by: str, source: str,
                  now: float | None = None) -> Label:
        kept = Label(record_id, label, by, time.time() if now is None else now, source)
        c = self._schema()  # a connection of its own: the writer's belongs to the writer thread
        try:
            with c.transaction():
                c.execute(f"INSERT INTO {_PG_LABELS} (record_id, label, labelled_by, time, "
                          "source) VALUES (%s, %s, %s, to_timestamp(%s), %s)",
                          (record_id, json.dumps(label), by, kept.time, source))
        except self.psycopg.Error as exc:
            raise StoreFault(self.where, _first_line(exc)) from exc
        finally:
            c.close()
        return kept

    def labels(self, record_id: int) -> list[Label]:
        rows = self._read(f"SELECT {_PG_LABEL_COLUMNS} FROM {_PG_LABELS} WHERE record_id = %s "
                          "ORDER BY id DESC", (record_id,))
        return [Label.from_row(r) for r in rows]

    def set_image(self, record_id: int, image: str, kept_for: str) -> None:
        c = self._schema()
        try:
            with c.transaction():
                c.execute(f"UPDATE {_PG_TABLE} SET image = %s, kept_for = %s WHERE id = %s AND "
                          "image IS NULL", (image, kept_for, record_id))
        except self.psycopg.Error as exc:
            raise StoreFault(self.where, _first_line(exc)) from exc
        finally:
            c.close()

    def review(self, query: ReviewQuery) -> list[tuple[int, Record, Label | None]]:
        return _labelled_rows(self._read(*_review_sql(
            query, _PG_TABLE, _PG_LABELS, "%s", "to_timestamp(%s)", _PG_REVIEW_COLUMNS,
            "extract(epoch from l.time)::float8")))

    def labelled_images(self) -> set[str]:
        rows = self._read(f"SELECT DISTINCT r.image FROM {_PG_LABELS} l JOIN {_PG_TABLE} r ON "
                          "r.id = l.record_id WHERE r.image IS NOT NULL", ())
        return {r["image"] for r in rows}

    def _chunk(self, after_id: int, since: float, until: float, n: int) -> list:
        select = _with_label(_PG_TABLE, _PG_LABELS, _PG_REVIEW_COLUMNS,
                             "extract(epoch from l.time)::float8")
        return self._read(f"{select} WHERE r.id > %s AND r.time >= to_timestamp(%s) AND "
                          "r.time < to_timestamp(%s) ORDER BY r.id LIMIT %s",
                          (after_id, since, until, n))

    def size(self) -> int:
        try:
            c = self._writer()
            row = c.execute(f"SELECT pg_total_relation_size('{_PG_TABLE}')").fetchone()
            c.commit()
        except self.psycopg.Error as exc:
            self.close()
            raise StoreFault(self.where, _first_line(exc)) from exc
        return int(row[0]) if row else 0

    def retain(self, max_age_s: float, max_bytes: int, now: float | None = None) -> int:
        cutoff = (time.time() if now is None else now) - max_age_s
        deleted = [0]

        def by_age(c) -> None:
            deleted[0] += c.execute(f"DELETE FROM {_PG_TABLE} WHERE time < to_timestamp(%s) "
                                    f"AND {_KEEP_LABELLED_PG}", (cutoff,)).rowcount

        self._tx(by_age)
        used = self.size()
        if used > max_bytes:
            def by_size(c) -> None:
                count = c.execute(f"SELECT count(*) FROM {_PG_TABLE}").fetchone()[0]
                excess = count - int(count * 0.9 * max_bytes / used)
                if excess > 0:
                    deleted[0] += c.execute(
                        f"DELETE FROM {_PG_TABLE} WHERE id IN (SELECT id FROM {_PG_TABLE} "
                        f"WHERE {_KEEP_LABELLED_PG} ORDER BY id LIMIT %s)", (excess,)).rowcount

            self._tx(by_size)
        return deleted[0]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
