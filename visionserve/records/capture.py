"""Image capture for retraining: which frames (:class:`Policy`), and where they go (a folder with
a quota, :class:`FolderTarget`, or an S3-compatible bucket, :class:`S3Target`).

An image is kept as the camera sent it (the encoded bytes, no re-encode; raw pixels as a ``.npy``
file, which keeps their shape), at ``<date>/<part id>_<request id>.<ext>``, with its record
beside it as ``<same name>.json``.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import random
import re
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..config import parse_bytes
from ..errors import ConfigError
from ..extras import require
from . import metrics
from .record import Record

log = logging.getLogger(__name__)

POLICIES = ("none", "ng", "uncertain", "sample", "all")
EXTENSIONS = {"jpeg": "jpg", "png": "png", "bmp": "bmp", "raw": "npy"}
#: a quota pass deletes down to this share of the quota, so it does not run for every image
QUOTA_LOW_WATER = 0.9
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class Policy:
    """Which answered frames are captured. ``wants`` runs on the engine's loop for every frame:
    a comparison, a random number or the task's margin, nothing more."""

    def __init__(self, mode: str, band: float = 0.1, percent: float = 1.0,
                 rng: random.Random | None = None) -> None:
        if mode not in POLICIES:
            raise ConfigError(f"capture {mode!r}: one of {', '.join(POLICIES)}")
        self.mode, self.band, self.share = mode, band, percent / 100.0
        self._random = (rng or random.Random()).random

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def wants(self, verdict: str, task: Any, result: Any) -> bool:
        mode = self.mode
        if mode == "all":
            return True
        if mode == "ng":
            return verdict == "NG"
        if mode == "sample":
            return self._random() < self.share
        if mode == "uncertain":
            margin = task.margin(result)
            return margin is not None and margin <= self.band
        return False


def image_key(record: Record, kind: str) -> str:
    """``<date>/<part id>_<request id>[-<frame>].<ext>`` (the date of the frame's arrival, UTC;
    without a part id, the request id alone)."""
    date = _utc_date(record.time)
    parts = [_safe(p) for p in (record.part_id, record.request_id) if p]
    name = "_".join(dict.fromkeys(parts)) or "frame"
    if record.frame_index:
        name += f"-{record.frame_index}"
    return f"{date}/{name}.{EXTENSIONS[kind]}"


def _utc_date(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d", time.gmtime(t))


def _safe(text: str) -> str:
    return _UNSAFE.sub("_", text)[:100].strip("._") or "_"


def image_bytes(kind: str, data: Any) -> bytes:
    """What is written: the encoded file as received, or raw pixels as ``.npy``."""
    if kind != "raw":
        return bytes(data)
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.asarray(data), allow_pickle=False)
    return buf.getvalue()


def sidecar(record: Record) -> bytes:
    return json.dumps(record.to_dict(), indent=1).encode()


class FolderTarget:
    """A folder, kept under ``quota`` bytes by deleting the oldest images (and their sidecars)
    first; a full disk deletes the oldest too, so capture never stops for want of space."""

    def __init__(self, root: Path, quota: int) -> None:
        self.root = Path(root).absolute()
        self.where = str(self.root)
        self.quota = quota
        self._lock = threading.Lock()  # put (capture thread) and doctor-like reads of ``used``
        self.used = self._scan_size()
        metrics.CAPTURE_BYTES.set(self.used)

    def location(self, key: str) -> str:
        return key

    def _scan_size(self) -> int:
        return sum(size for _, _, size in self._files())

    def _files(self) -> list[tuple[float, Path, int]]:
        out = []
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                p = Path(dirpath) / n
                try:
                    st = p.stat()
                except OSError:
                    continue
                out.append((st.st_mtime, p, st.st_size))
        return out

    def put(self, key: str, data: bytes, meta: bytes) -> None:
        with self._lock:
            need = len(data) + len(meta)
            if self.used + need > self.quota:
                self._free(self.used + need - int(self.quota * QUOTA_LOW_WATER))
            try:
                self._write(key, data, meta)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # the disk is full before the quota is: make room among our own images
                log.warning("capture: %s is full; deleting the oldest images", self.root)
                self._free(max(need, int(self.used * (1 - QUOTA_LOW_WATER))))
                self._write(key, data, meta)
            self.used += need
            metrics.CAPTURE_BYTES.set(self.used)

    def _write(self, key: str, data: bytes, meta: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, content in ((path, data), (path.with_name(path.name + ".json"), meta)):
            tmp = target.with_name(f".{target.name}.tmp")
            try:
                tmp.write_bytes(content)
                os.replace(tmp, target)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise

    def _free(self, amount: int) -> None:
        """Delete the oldest files until ``amount`` bytes are gone (the folder is rescanned:
        someone may have removed or added files meanwhile)."""
        files = sorted(self._files())
        self.used = sum(f[2] for f in files)
        freed = deleted = 0
        for _, path, size in files:
            if freed >= amount:
                break
            try:
                path.unlink()
            except OSError:
                continue
            freed += size
            if not path.name.endswith(".json"):
                deleted += 1
        self.used -= freed
        if deleted:
            metrics.CAPTURE_DELETED.inc(deleted)
            log.info("capture: deleted the %d oldest images (%d bytes) to stay under the quota "
                     "of %d bytes", deleted, freed, self.quota)
        for d in sorted((p for p in self.root.glob("*") if p.is_dir()), reverse=True):
            try:
                d.rmdir()  # only empty date folders go
            except OSError:
                pass


class S3Target:
    """``s3://bucket/prefix`` on an S3-compatible server (MinIO, Ceph, AWS S3), through the
    MinIO client (the ``s3`` extra). Credentials from ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``, ``AWS_REGION``); retention is the
    bucket's lifecycle rule, not a quota here."""

    def __init__(self, url: str, endpoint: str | None) -> None:
        minio = require("minio", "image capture to S3")
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ConfigError(f"capture_target {url!r}: use s3://bucket/prefix")
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        ep = urlsplit(endpoint or "https://s3.amazonaws.com")
        if ep.scheme not in ("http", "https") or not ep.netloc:
            raise ConfigError(f"capture_s3_endpoint {endpoint!r}: use http(s)://host:port")
        self.client = minio.Minio(
            ep.netloc, access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
            session_token=os.environ.get("AWS_SESSION_TOKEN"), secure=ep.scheme == "https",
            region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))
        self.where = f"{ep.scheme}://{ep.netloc}/{self.bucket}/{self.prefix}".rstrip("/")

    def _object(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def location(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._object(key)}"

    def put(self, key: str, data: bytes, meta: bytes) -> None:
        name = self._object(key)
        self.client.put_object(self.bucket, name, io.BytesIO(data), len(data),
                               content_type=_CONTENT_TYPES.get(key.rsplit(".", 1)[-1],
                                                               "application/octet-stream"))
        self.client.put_object(self.bucket, name + ".json", io.BytesIO(meta), len(meta),
                               content_type="application/json")


_CONTENT_TYPES = {"jpg": "image/jpeg", "png": "image/png", "bmp": "image/bmp"}


def open_target(settings, folder: Path) -> FolderTarget | S3Target:
    """The capture target of ``settings`` (default: ``captures/`` in the records folder)."""
    target = settings.capture_target
    if target and target.startswith("s3://"):
        return S3Target(target, settings.capture_s3_endpoint)
    root = Path(target) if target else folder / "captures"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"capture_target {str(root)!r} cannot be made: {exc}") from None
    return FolderTarget(root, parse_bytes(settings.capture_quota))
