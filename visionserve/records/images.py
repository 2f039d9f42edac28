"""Captured images read back by their record: ``GET /v1/records/{id}/image`` and ``/overlay``
(:mod:`.http`), the console's NG parts pages.

A request names a record by its id; the image is where that record (written by the server)
says it is: a key of the capture folder, or an ``s3://`` URL of the configured bucket. The key
must have the form the server writes (:data:`.capture.OWN_KEY`) and the file must lie inside the
capture folder, so no text of a request ever becomes a path. An image in a bucket is read through
the capture's own S3 client, from the local spool while it waits there for its upload.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from ..config import ServerSettings
from ..errors import NotFound, Unavailable
from .capture import OWN_KEY, S3Bucket
from .record import Record

#: a bucket that does not answer: the client is asked again after this many seconds
S3_RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class Stored:
    """A captured image as stored, and its sidecar's bytes (b"" where there is none)."""

    data: bytes
    ext: str  #: jpg, png, bmp or npy
    sidecar: bytes


class ImageSource:
    """Reads captured images from the capture folder (``folder``) or an S3 bucket (``bucket``:
    ``s3://bucket/prefix``, with its ``endpoint`` and the local ``spool``); threads may call
    :meth:`read` at once."""

    def __init__(self, folder: Path, bucket: str | None = None, endpoint: str | None = None,
                 spool: Path | None = None) -> None:
        self.folder = Path(folder).absolute()
        self._bucket_url, self._endpoint = bucket, endpoint
        self.spool = Path(spool).absolute() if spool is not None else None
        self._bucket: S3Bucket | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: ServerSettings, records_folder: Path) -> ImageSource:
        """Where ``settings`` capture to (as :func:`.capture.open_target` chooses it)."""
        target = settings.capture_target
        if target and target.startswith("s3://"):
            return cls(records_folder / "captures", target, settings.capture_s3_endpoint,
                       records_folder / "capture-spool")
        return cls(Path(target) if target else records_folder / "captures")

    def read(self, row_id: int, record: Record, sidecar: bool = False) -> Stored:
        """The image of ``record`` (the store's record ``row_id``), and its sidecar if asked;
        NotFound with the reason where there is none, Unavailable while its bucket does not
        answer."""
        location = record.image
        if not location:
            raise NotFound(f"record {row_id} has no captured image (the capture policy, "
                           "--capture, did not keep its frame)")
        if location.startswith("s3://"):
            return self._from_bucket(row_id, location, sidecar)
        return self._from_folder(row_id, self.folder, location, sidecar)

    @staticmethod
    def _checked(row_id: int, key: str) -> str:
        if not OWN_KEY.fullmatch(key):
            raise NotFound(f"record {row_id} names an image {key!r} that this server did not "
                           "write")
        return key

    def _from_folder(self, row_id: int, folder: Path, key: str, sidecar: bool) -> Stored:
        path = (folder / self._checked(row_id, key)).resolve()
        if not path.is_relative_to(folder.resolve()):  # a date folder linked elsewhere
            raise NotFound(f"the image of record {row_id} lies outside {folder}")
        try:
            data = path.read_bytes()
        except OSError:
            raise NotFound(f"the image of record {row_id} ({key}) is no longer in "
                           f"{folder}: the capture quota deletes the oldest images first, or "
                           "the folder was moved (--capture-target)") from None
        try:
            meta = path.with_name(path.name + ".json").read_bytes() if sidecar else b""
        except OSError:
            meta = b""
        return Stored(data, key.rsplit(".", 1)[-1], meta)

    def _from_bucket(self, row_id: int, location: str, sidecar: bool) -> Stored:
        bucket = self._s3(row_id, location)
        key = bucket.key(location)
        if key is None:
            raise NotFound(f"the image of record {row_id} is in {location}, not in this "
                           f"server's bucket {bucket.location('')}")
        self._checked(row_id, key)
        if self.spool is not None and (self.spool / key).is_file():  # not uploaded yet
            try:
                return self._from_folder(row_id, self.spool, key, sidecar)
            except NotFound:
                pass  # uploaded meanwhile
        return Stored(self._get(bucket, row_id, key), key.rsplit(".", 1)[-1],
                      self._get(bucket, row_id, key + ".json", True) if sidecar else b"")

    def _s3(self, row_id: int, location: str) -> S3Bucket:
        if self._bucket_url is None:
            raise NotFound(f"the image of record {row_id} is in {location}, and this server "
                           "captures to a folder (--capture-target names no bucket)")
        with self._lock:
            if self._bucket is None:
                self._bucket = S3Bucket(self._bucket_url, self._endpoint)
            return self._bucket

    @staticmethod
    def _get(bucket: S3Bucket, row_id: int, key: str, optional: bool = False) -> bytes:
        from minio.error import S3Error

        try:
            response = bucket.client.get_object(bucket.name, bucket.object(key))
        except S3Error as exc:
            if optional:
                return b""
            if exc.code in ("NoSuchKey", "NoSuchBucket"):
                raise NotFound(f"the image of record {row_id} is no longer in "
                               f"{bucket.location(key)} (the bucket's lifecycle rule deletes "
                               "old images)") from None
            raise Unavailable(f"the bucket refused the image of record {row_id}: {exc.code}",
                              retry_after_s=S3_RETRY_AFTER_S) from None
        except Exception as exc:  # noqa: BLE001 - the network, the endpoint: may work later
            if optional:
                return b""
            raise Unavailable(f"the bucket {bucket.where} cannot be reached for the image of "
                              f"record {row_id}: {exc}", retry_after_s=S3_RETRY_AFTER_S) from None
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

