"""Image capture for retraining: which frames (:class:`Policy`), and where they go (a folder with
a quota, :class:`FolderTarget`, or an S3-compatible bucket, :class:`S3Target`).

An image is kept as the camera sent it (the encoded bytes, no re-encode; raw pixels, a camera's
or an ``X-Image-Shape`` push, as a lossless PNG of exactly those pixels: grey, RGB or RGBA), at
``<date>/<part id>_<request id>.<uid>.<ext>`` (``uid``: random, one per answer, so a retried
request id never overwrites an earlier frame), with its record beside it as ``<same name>.json``.
The folder's quota deletes only names of that form.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import random
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .. import imaging
from ..config import parse_bytes
from ..errors import ConfigError
from ..extras import require
from . import metrics
from .record import Record

log = logging.getLogger(__name__)

POLICIES = ("none", "ng", "uncertain", "sample", "all", "learn")
EXTENSIONS = {"jpeg": "jpg", "png": "png", "bmp": "bmp", "raw": "png"}
#: zlib level of a raw frame's PNG: fast (the capture thread keeps up with the line), still lossless
PNG_COMPRESSION = 1
#: a quota pass deletes down to this share of the quota, so it does not run for every image
QUOTA_LOW_WATER = 0.9
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
#: what the server writes in a capture folder (and so all that its quota may delete): date
#: folders holding ``<name>.<12 hex digits>.<ext>`` and its ``.json`` sidecar (``.npy``: raw
#: frames as earlier versions kept them)
_OWN_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
_OWN_FILE = re.compile(r"[A-Za-z0-9._-]+\.[0-9a-f]{12}\.(?:jpg|png|bmp|npy)(?:\.json)?")
#: an image's key as a record names it (no sidecar): what the image route reads, nothing else
OWN_KEY = re.compile(rf"{_OWN_DAY.pattern}/[A-Za-z0-9._-]+\.[0-9a-f]{{12}}\.(?:jpg|png|bmp|npy)")
#: the share of a capture folder's file system that images leave to the records
RESERVE_SHARE = 0.2
RESERVE_MAX = 256 * 1024**2
#: S3: connect and read timeouts of one upload; the pause between retries of the spool
S3_CONNECT_S, S3_READ_S = 3.0, 30.0
S3_RETRY_MIN_S, S3_RETRY_MAX_S = 2.0, 60.0


class Policy:
    """Which answered frames are captured, and why. ``wants`` runs on the engine's loop for
    every frame: a comparison, a random number or the task's margin, nothing more.

    ``learn`` keeps what a model learns from: NG frames, uncertain ones (the score within
    ``band`` of the threshold) and a ``percent`` sample of the rest; each says which it was
    (the record's ``kept_for``)."""

    def __init__(self, mode: str, band: float = 0.1, percent: float = 1.0,
                 rng: random.Random | None = None) -> None:
        if mode not in POLICIES:
            raise ConfigError(f"capture {mode!r}: one of {', '.join(POLICIES)}")
        self.mode, self.band, self.share = mode, band, percent / 100.0
        self._random = (rng or random.Random()).random

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def wants(self, verdict: str, task: Any, result: Any) -> str | None:
        """Why the frame is kept (one of :data:`.record.KEPT_FOR`), or None: not kept."""
        mode = self.mode
        if mode == "all":
            return "all"
        if mode == "ng":
            return "ng" if verdict == "NG" else None
        if mode == "sample":
            return "sample" if self._random() < self.share else None
        if mode == "uncertain":
            return "uncertain" if self._uncertain(task, result) else None
        if mode == "learn":
            if self._uncertain(task, result):  # an NG near the threshold teaches most
                return "uncertain"
            if verdict == "NG":
                return "ng"
            return "sample" if self._random() < self.share else None
        return None

    def _uncertain(self, task: Any, result: Any) -> bool:
        margin = task.margin(result)
        return margin is not None and margin <= self.band


def image_key(record: Record, kind: str) -> str:
    """``<date>/<part id>_<request id>[-<frame>].<uid>.<ext>`` (the date of the frame's arrival,
    UTC; without a part id, the request id alone; ``uid`` 12 random hex digits: ids repeat, a
    retry or a client's fixed request id, and each answer keeps its own image)."""
    date = _utc_date(record.time)
    parts = [_safe(p) for p in (record.part_id, record.request_id) if p]
    name = "_".join(dict.fromkeys(parts)) or "frame"
    if record.frame_index:
        name += f"-{record.frame_index}"
    return f"{date}/{name}.{secrets.token_hex(6)}.{EXTENSIONS[kind]}"


def _utc_date(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def _safe(text: str) -> str:
    return _UNSAFE.sub("_", text)[:100].strip("._") or "_"


def image_bytes(frame: imaging.Frame) -> bytes:
    """What is written: the encoded file as received, or raw pixels (uint8 ``HxWxC``: grey, RGB
    or RGBA; a Bayer mosaic demosaiced to the RGB the model saw) as a PNG that decodes to
    exactly them (OpenCV writes BGR: the channels are swapped for it). Runs in the capture
    thread."""
    if frame.kind != "raw":
        return bytes(frame.data)
    cv2 = imaging._cv2()
    px = imaging.raw_pixels(frame)
    channels = px.shape[2] if px.ndim == 3 else 1
    if channels in (3, 4):
        px = cv2.cvtColor(px, cv2.COLOR_RGB2BGR if channels == 3 else cv2.COLOR_RGBA2BGRA)
    ok, buf = cv2.imencode(".png", px, [cv2.IMWRITE_PNG_COMPRESSION, PNG_COMPRESSION])
    if not ok:
        raise ValueError(f"a raw frame of shape {px.shape} cannot be written as PNG")
    return buf.tobytes()


def sidecar(record: Record, drawing: dict[str, Any] | None = None) -> bytes:
    """The record as JSON; ``drawing``: what the task keeps to draw its answer on the image
    later (``Task.capture_fields``, e.g. an anomaly model's heat map), under ``"drawing"``."""
    out = record.to_dict()
    if drawing:
        out["drawing"] = drawing
    return json.dumps(out, indent=1).encode()


class NoRoom(Exception):
    """No room for an image: the disk's last share is kept for the records."""


class FolderTarget:
    """A folder of captured images, kept under ``quota`` bytes by deleting the server's oldest
    images (and their sidecars) first.

    Only the files the server wrote count and are ever deleted: ``<date>/<name>.<uid>.<ext>`` and
    its ``.json`` (:data:`_OWN_DAY`, :data:`_OWN_FILE`); anything else in the folder (notes,
    reference images, other folders) is left alone. Images never take the last
    :data:`RESERVE_SHARE` of the file system (at most :data:`RESERVE_MAX`): that room is the
    records'; the writer asks for more (:meth:`free_for_records`) when the records find the disk
    full."""

    def __init__(self, root: Path, quota: int, name: str = "capture",
                 keep: Callable[[], set[str]] | None = None) -> None:
        self.root = Path(root).absolute()
        #: the keys of images never to delete (labelled frames: the record store's
        #: ``labelled_images``), asked at each deletion pass; the last answer stands while the
        #: store cannot be read
        self._keep = keep
        self._kept: set[str] = set()
        self._kept_logged = -60.0
        self.where = str(self.root)
        self.quota = quota
        self.name = name  #: in log lines: "capture", or "capture spool"
        self._lock = threading.Lock()  # put (capture thread) and free_for_records (writer)
        self.used = sum(size for _, _, size in self._files())
        metrics.CAPTURE_BYTES.set(self.used)

    def location(self, key: str) -> str:
        return key

    def _files(self) -> list[tuple[float, Path, int]]:
        """(mtime, path, size) of every file the server wrote here."""
        out: list[tuple[float, Path, int]] = []
        try:
            days = [d.path for d in os.scandir(self.root)
                    if _OWN_DAY.fullmatch(d.name) and d.is_dir(follow_symlinks=False)]
        except OSError:
            return out
        for day in days:
            try:
                entries = list(os.scandir(day))
            except OSError:
                continue
            for e in entries:
                if not _OWN_FILE.fullmatch(e.name) or not e.is_file(follow_symlinks=False):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                out.append((st.st_mtime, Path(e.path), st.st_size))
        return out

    def images(self) -> list[str]:
        """The keys of the images here, oldest first."""
        return [p.relative_to(self.root).as_posix() for _, p, _ in sorted(self._files())
                if not p.name.endswith(".json")]

    def _room(self) -> tuple[int, int]:
        """(free bytes, bytes kept free for the records) on the folder's file system."""
        st = os.statvfs(self.root)
        return (st.f_bavail * st.f_frsize,
                min(RESERVE_MAX, int(st.f_blocks * st.f_frsize * RESERVE_SHARE)))

    def put(self, key: str, data: bytes, meta: bytes) -> str:
        """Write the image and its sidecar; returns its location. NoRoom when only the records'
        share of the disk is left, OSError when the disk refuses."""
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)  # deleted under the server: anew
            need = len(data) + len(meta)
            if self.used + need > self.quota:
                self._free(self.used + need - int(self.quota * QUOTA_LOW_WATER),
                           f"to stay under the quota of {self.quota} bytes")
            free, reserve = self._room()
            if free - need < reserve:
                self._free(reserve + need - free, "to keep room for the records")
                free, reserve = self._room()
                if free - need < reserve:
                    raise NoRoom(f"{self.root}: {free} bytes free, {reserve} of them kept for "
                                 "the records, and no image of ours left to delete")
            try:
                self._write(key, data, meta)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # the disk is full before the quota is: make room among our own images
                self._free(max(need, int(self.used * (1 - QUOTA_LOW_WATER))), "the disk is full")
                self._write(key, data, meta)
            self.used += need
            metrics.CAPTURE_BYTES.set(self.used)
        return self.location(key)

    def remove(self, key: str) -> None:
        """Delete an image and its sidecar (uploaded from the spool)."""
        with self._lock:
            for p in (self.root / key, self.root / f"{key}.json"):
                try:
                    size = p.stat().st_size
                    p.unlink()
                except FileNotFoundError:
                    continue
                self.used -= size
            metrics.CAPTURE_BYTES.set(self.used)

    def free_for_records(self, path: Path) -> int:
        """The records at ``path`` found their disk full: if it is this folder's disk, delete
        our oldest images until twice the records' share is free. Returns the bytes deleted."""
        try:
            if os.stat(self.root).st_dev != os.stat(path).st_dev:
                return 0
        except OSError:
            return 0
        with self._lock:
            free, reserve = self._room()
            if free >= 2 * reserve:
                return 0  # the records' limit is not the disk's
            return self._free(2 * reserve - free, "the records found the disk full")

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

    def _labelled(self) -> set[str]:
        if self._keep is None:
            return set()
        try:
            self._kept = self._keep()
        except Exception as exc:  # noqa: BLE001 - the store down: the last answer stands
            log.warning("%s: which images are labelled cannot be read now (%s); the last "
                        "answer (%d images) is kept", self.name, exc, len(self._kept))
        return self._kept

    def _free(self, amount: int, why: str) -> int:
        """Delete our oldest files until ``amount`` bytes are gone (the folder is rescanned:
        someone may have removed files meanwhile); returns the bytes deleted."""
        files = sorted(self._files())
        self.used = sum(f[2] for f in files)
        freed = deleted = 0
        failed: list[OSError] = []
        kept = self._labelled()
        for _, path, size in files:
            if freed >= amount:
                break
            if kept and path.relative_to(self.root).as_posix().removesuffix(".json") in kept:
                continue  # a labelled frame and its sidecar: kept whatever the quota
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                failed.append(exc)
                continue
            freed += size
            if not path.name.endswith(".json"):
                deleted += 1
        self.used -= freed
        metrics.CAPTURE_BYTES.set(self.used)
        if deleted:
            metrics.CAPTURE_DELETED.inc(deleted)
            log.info("%s: deleted the %d oldest images (%d bytes) in %s: %s", self.name, deleted,
                     freed, self.root, why)
        if failed:
            log.error("%s: %d of the oldest files in %s could not be deleted (%s): %s, and no "
                      "room was made for them", self.name, len(failed), self.root, failed[0], why)
        if freed < amount and kept and time.monotonic() - self._kept_logged >= 60.0:
            self._kept_logged = time.monotonic()  # once a minute: each image would say it
            log.warning("%s: %d labelled images in %s are kept past the quota (%s)", self.name,
                        len(kept), self.root, why)
        for d in sorted((p for p in self.root.glob("*") if _OWN_DAY.fullmatch(p.name)),
                        reverse=True):
            try:
                d.rmdir()  # only our date folders, only when empty
            except OSError:
                pass
        return freed


class S3Bucket:
    """``s3://bucket/prefix`` on the S3-compatible server at ``endpoint``, and the MinIO client
    (the ``s3`` extra) that reaches it: credentials from ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``, ``AWS_REGION``). No retries inside
    the client: an unreachable bucket must not hold a thread for seconds per image."""

    def __init__(self, url: str, endpoint: str | None) -> None:
        minio = require("minio", "image capture to S3")
        import urllib3

        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ConfigError(f"capture_target {url!r}: use s3://bucket/prefix")
        self.name, self.prefix = parts.netloc, parts.path.strip("/")
        ep = urlsplit(endpoint or "https://s3.amazonaws.com")
        if ep.scheme not in ("http", "https") or not ep.netloc:
            raise ConfigError(f"capture_s3_endpoint {endpoint!r}: use http(s)://host:port")
        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=S3_CONNECT_S, read=S3_READ_S),
                                   retries=False, ca_certs=_ca_certs())
        self.client = minio.Minio(
            ep.netloc, access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
            session_token=os.environ.get("AWS_SESSION_TOKEN"), secure=ep.scheme == "https",
            region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
            http_client=http)
        self.where = f"{ep.scheme}://{ep.netloc}/{self.name}/{self.prefix}".rstrip("/")

    def object(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def location(self, key: str) -> str:
        return f"s3://{self.name}/{self.object(key)}"

    def key(self, location: str) -> str | None:
        """The key of a location in this bucket and prefix; None for any other."""
        head = self.location("")
        return location[len(head):] if location.startswith(head) else None


class S3Target:
    """``s3://bucket/prefix`` on an S3-compatible server (MinIO, Ceph, AWS S3): an
    :class:`S3Bucket`; retention is the bucket's lifecycle rule, not a quota here.

    While the bucket cannot be reached, images go to ``spool`` (a local :class:`FolderTarget`)
    and are uploaded from there, oldest first, when it answers again (:meth:`flush`); the
    record names the ``s3://`` URL the image will have. Without a spool a failed upload raises."""

    def __init__(self, bucket: S3Bucket, spool: FolderTarget | None = None) -> None:
        self.bucket = bucket
        self.client, self.where = self.bucket.client, self.bucket.where
        self.spool = spool
        self._down_since: float | None = None
        self._retry_s = S3_RETRY_MIN_S
        self._next_try = 0.0
        self._spooled = len(spool.images()) if spool is not None else 0
        metrics.CAPTURE_SPOOLED.set(self._spooled)

    def location(self, key: str) -> str:
        return self.bucket.location(key)

    def _upload(self, key: str, data: bytes, meta: bytes) -> None:
        name, bucket = self.bucket.object(key), self.bucket.name
        self.client.put_object(bucket, name, io.BytesIO(data), len(data),
                               content_type=_CONTENT_TYPES.get(key.rsplit(".", 1)[-1],
                                                               "application/octet-stream"))
        self.client.put_object(bucket, name + ".json", io.BytesIO(meta), len(meta),
                               content_type="application/json")

    def put(self, key: str, data: bytes, meta: bytes) -> str:
        """Upload (or, while the bucket cannot be reached, spool) the image and its sidecar;
        returns its ``s3://`` location."""
        if self.spool is None or self._down_since is None:
            try:
                self._upload(key, data, meta)
                return self.location(key)
            except Exception as exc:
                if self.spool is None:
                    raise
                self._went_down(exc)
        self.spool.put(key, data, meta)
        self._spooled += 1
        metrics.CAPTURE_SPOOLED.set(self._spooled)
        return self.location(key)

    def flush(self, budget_s: float = 0.5) -> None:
        """Upload spooled images, oldest first, for up to ``budget_s`` (the capture thread calls
        it about once a second); after a failure, not again before the retry pause."""
        if self.spool is None or not self._spooled or time.monotonic() < self._next_try:
            return
        end = time.monotonic() + budget_s
        keys = self.spool.images()
        uploaded = 0
        for key in keys:
            if time.monotonic() > end:
                break
            try:
                data = (self.spool.root / key).read_bytes()
                side = self.spool.root / f"{key}.json"
                meta = side.read_bytes() if side.exists() else b"{}"
            except OSError:
                continue  # deleted meanwhile (the spool's quota)
            try:
                self._upload(key, data, meta)
            except Exception as exc:  # noqa: BLE001 - network, credentials, the bucket: retried
                self._went_down(exc)
                break
            self.spool.remove(key)
            uploaded += 1
        else:
            if self._down_since is not None:
                log.warning("capture: %s answers again after %.0f s; the spooled images are "
                            "uploaded", self.where, time.monotonic() - self._down_since)
            self._down_since, self._retry_s = None, S3_RETRY_MIN_S
        self._spooled = len(keys) - uploaded
        metrics.CAPTURE_SPOOLED.set(self._spooled)

    def _went_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since, self._retry_s = now, S3_RETRY_MIN_S
            assert self.spool is not None
            log.error("capture: %s cannot be reached (%s): images wait in %s and are uploaded "
                      "when it answers (visionserve_capture_spooled)", self.where, exc,
                      self.spool.root)
        else:
            self._retry_s = min(S3_RETRY_MAX_S, self._retry_s * 2)
        self._next_try = now + self._retry_s


def _ca_certs() -> str | None:
    """The CA bundle the MinIO client itself would use (``SSL_CERT_FILE`` or certifi's)."""
    if os.environ.get("SSL_CERT_FILE"):
        return os.environ["SSL_CERT_FILE"]
    try:
        import certifi
    except ImportError:
        return None
    return certifi.where()

_CONTENT_TYPES = {"jpg": "image/jpeg", "png": "image/png", "bmp": "image/bmp"}


def open_target(settings, folder: Path, keep: Callable[[], set[str]] | None = None
                ) -> FolderTarget | S3Target:
    """The capture target of ``settings`` (default: ``captures/`` in the records folder; for a
    bucket, its spool is ``capture-spool/`` there, under the same quota). ``keep``: where the
    labelled images are (the records' ``image``), which neither a folder's quota nor a spool's
    ever deletes; a bucket's retention is its own (its lifecycle rule)."""
    target = settings.capture_target
    quota = parse_bytes(settings.capture_quota)
    if target and target.startswith("s3://"):
        bucket = S3Bucket(target, settings.capture_s3_endpoint)
        spool = FolderTarget(_folder(folder / "capture-spool"), quota, "capture spool",
                             keep=None if keep is None else _spooled(keep, bucket))
        return S3Target(bucket, spool)
    return FolderTarget(_folder(Path(target) if target else folder / "captures"), quota,
                        keep=keep)


def _spooled(keep: Callable[[], set[str]], bucket: S3Bucket) -> Callable[[], set[str]]:
    """``keep`` as the spool's keys: a spooled image's record names its ``s3://`` URL."""
    def keys() -> set[str]:
        return {key for location in keep() if (key := bucket.key(location)) is not None}
    return keys


def _folder(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"capture_target {str(root)!r} cannot be made: {exc}") from None
    return root
