"""What ``visionserve doctor`` says of the records and the capture target: can they be written,
is there room, does retention keep up. Each check is (status, detail, fix); status ok, warn,
fail or skip."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

from ..config import ServerSettings, parse_bytes
from ..errors import VisionServeError
from .record import iso
from .service import records_folder, store_of
from .store import SqliteStore, StoreFault

#: (status, detail, fix), as doctor's checks say it
Finding = tuple[Literal["ok", "warn", "fail", "skip"], str, str]

_FREE_FIX = ("free space on that disk, lower records_max_bytes / capture_quota, or point "
             "records_dir / capture_target at a bigger disk")


def _room(folder: Path) -> tuple[bool, int] | None:
    """(read-only file system, free bytes) of the file system holding ``folder`` (or the
    nearest existing parent); None when none can be found."""
    p = folder
    while not p.exists():
        if p.parent == p:
            return None
        p = p.parent
    st = os.statvfs(p)
    return bool(st.f_flag & os.ST_RDONLY), st.f_bavail * st.f_frsize


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


def check_records(settings: ServerSettings | None) -> Finding:
    if settings is None or not settings.records:
        return "skip", "records are off (serve --records)", ""
    try:
        store = store_of(settings)
    except VisionServeError as exc:
        return "fail", exc.message, "fix records_url (docs/records.md)"
    limit = parse_bytes(settings.records_max_bytes)
    if not isinstance(store, SqliteStore):
        try:
            size = store.size()
        except StoreFault as exc:
            return "fail", exc.message, ("check that the database server runs and the user may "
                                         "create and write the table visionserve_records")
        finally:
            store.close()
        return ("warn" if size > 1.1 * limit else "ok",
                f"{store.where}: {_gib(size)} of records_max_bytes {_gib(limit)}",
                ("retention runs every 10 minutes; a store far over its limit means it cannot "
                "delete (see the server log)"))
    path = store.path
    room = _room(path.parent)
    if room is None:
        return "fail", f"{path.parent} cannot be found", "make the folder or fix records_dir"
    read_only, free = room
    if read_only:
        return ("fail", (f"{path} is on a read-only file system: records cannot be written "
                "(the server serves on and counts them dropped)"),
                "remount it read-write, or point records_dir at a writable disk")
    if path.parent.exists() and not os.access(path.parent, os.W_OK):
        return ("fail", f"{path.parent} is not writable for this user",
                "chown/chmod the folder to the user the server runs as")
    if not path.exists():
        return ("warn", (f"no records database at {path} yet: it is made with the first record; "
                "if the server has answered frames, the file was deleted (the server starts a "
                "new one)"), "")
    size = store.size()
    status: Literal["ok", "warn", "fail"] = "ok"
    notes = []
    if free < 64 * 1024**2:
        status = "fail"
        notes.append(f"only {_gib(free)} free on its disk: new records fail")
    elif free < limit - size:
        status = "warn"
        notes.append(f"{_gib(free)} free on its disk, less than the {_gib(limit - size)} the "
                     "store may still grow")
    if size > 1.1 * limit:
        if status == "ok":
            status = "warn"
        notes.append("over records_max_bytes: retention is not keeping up")
    last = _last_record(path)
    detail = (f"{path}: {_gib(size)} of records_max_bytes {_gib(limit)}, {_gib(free)} free"
              + (f", last record {last}" if last else "") + ("; " + "; ".join(notes)
                                                             if notes else ""))
    return status, detail, _FREE_FIX if status != "ok" else ""


def _last_record(path: Path) -> str | None:
    import sqlite3

    try:
        c = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=1.0)
        try:
            row = c.execute("SELECT max(time) FROM records").fetchone()
        finally:
            c.close()
    except sqlite3.Error as exc:
        return f"unreadable ({exc})"
    if not row or row[0] is None:
        return None
    return f"{iso(row[0])} ({time.time() - row[0]:.0f} s ago)"


def check_capture(settings: ServerSettings | None) -> Finding:
    if settings is None or settings.capture == "none":
        return "skip", "image capture is off (serve --capture)", ""
    target = settings.capture_target or ""
    if target.startswith("s3://"):
        from .capture import S3Bucket

        try:
            s3 = S3Bucket(target, settings.capture_s3_endpoint)
            exists = s3.client.bucket_exists(s3.name)
        except VisionServeError as exc:
            return "fail", exc.message, "pip install 'visionserve[s3]'; fix capture_target"
        except Exception as exc:  # noqa: BLE001 - the client's errors: network, credentials
            return ("fail", f"{target}: {exc}", ("check capture_s3_endpoint and the credentials "
                    "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"))
        if not exists:
            return "fail", f"bucket {s3.name} does not exist at {s3.where}", "create it"
        return "ok", f"{s3.where}: bucket reachable", ""
    root = Path(target) if target else records_folder(settings) / "captures"
    quota = parse_bytes(settings.capture_quota)
    room = _room(root)
    if room is None:
        return "fail", f"{root} cannot be found", "make the folder or fix capture_target"
    read_only, free = room
    if read_only:
        return ("fail", f"{root} is on a read-only file system: no image is kept",
                "remount it read-write, or point capture_target at a writable disk")
    from .capture import FolderTarget

    used = FolderTarget(root, quota).used if root.exists() else 0  # the server's own images
    detail = f"{root}: {_gib(used)} of capture_quota {_gib(quota)}, {_gib(free)} free"
    if free < quota - used:
        return ("warn", detail + "; the disk fills before the quota: the oldest images are "
                "deleted then (and counted)", _FREE_FIX)
    return "ok", detail, ""
