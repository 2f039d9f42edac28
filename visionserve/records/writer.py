"""The record writer: every answered frame into the record store, off the hot path.

:class:`Recorder` is a tap of the engine (``Engine.tap``, as the PLC result bus is): for each
admitted frame it adds a callback to the frame's future; when the answer is final (a verdict,
LATE, an error, or the client hung up) the callback puts one tuple into a bounded queue
(``put_nowait``: a full queue drops the record and counts it, the event loop never waits). Frames
refused at admission are recorded too (verdict ERROR, the refusal in ``error``).

One thread, the writer, takes the tuples, makes the records (the task renders its result as the
inspect answer's fields, here and not on the loop), and appends them in batches, one transaction
each (up to ``BATCH_MAX`` records, or what came within ``BATCH_WINDOW_S`` of the first). When the
store refuses (disk full, read-only, deleted, database down) the batch is kept and tried again
with a growing pause; records wait in the queue meanwhile and, past it, are dropped and counted.
The fault is logged when it starts, every ``FAULT_LOG_S`` while it lasts, and when it ends, and
``visionserve_records_store_fault`` reads 1 while it lasts. Retention runs in the same thread
every ``RETAIN_EVERY_S``.

Frames the capture policy picks (decided on the loop, from the verdict and the task's margin:
the frame's bytes are only kept for those) go, with their record, to a second bounded queue and
thread, so a slow bucket or disk never holds up the records.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from .. import imaging
from ..logs import request_id
from . import metrics
from .capture import FolderTarget, Policy, S3Target, image_bytes, image_key, sidecar
from .record import Record
from .store import RecordStore, StoreFault

log = logging.getLogger(__name__)

BATCH_MAX = 500
BATCH_WINDOW_S = 0.1
RETAIN_EVERY_S = 600.0
FAULT_LOG_S = 60.0
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
#: on close, how long the writer may take to store what is queued
CLOSE_TIMEOUT_S = 10.0

_STOP = object()


class Recorder:
    """Engine side: ``watch`` and ``refused`` (the event loop). Worker side: the writer thread
    and, with a capture policy, the capture thread."""

    def __init__(self, store: RecordStore, *, max_age_s: float, max_bytes: int,
                 queue_size: int = 10_000, policy: Policy | None = None,
                 target: FolderTarget | S3Target | None = None, capture_queue: int = 256,
                 retain_every_s: float = RETAIN_EVERY_S) -> None:
        self.store = store
        self.max_age_s, self.max_bytes = max_age_s, max_bytes
        self.retain_every_s = retain_every_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.policy = policy if policy is not None and policy.active and target else None
        self.target = target if self.policy is not None else None
        self._captures: queue.Queue = queue.Queue(maxsize=capture_queue)
        self._put = self._queue.put_nowait
        self._dropped = metrics.DROPPED.labels("queue_full")
        self._threads: list[threading.Thread] = []
        #: the store's refusal while it lasts (doctor and tests read it)
        self.fault: StoreFault | None = None
        self._fault_since = self._fault_logged = 0.0
        self._capture_fault_logged = 0.0
        metrics.QUEUE_DEPTH.set_function(self._queue.qsize)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._run, name="records", daemon=True)]
        if self.policy is not None:
            self._threads.append(threading.Thread(target=self._capture_run, name="capture",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Store what is queued (within ``timeout_s``), then stop the threads."""
        deadline = time.monotonic() + timeout_s
        for q in (self._queue, self._captures):
            try:
                q.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                log.warning("records: %d records still queued at shutdown are dropped",
                            q.qsize())
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.store.close()

    # --- engine side (its event loop): one callback and one put per frame ------------------------

    def watch(self, served, pending: Sequence, origin: tuple | None) -> None:
        rid = _request_id()
        for i, item in enumerate(pending):
            item.future.add_done_callback(partial(self._answered, served, origin, rid, i, item))

    def refused(self, served, count: int, origin: tuple | None, exc) -> None:
        rid, wall = _request_id(), time.time()
        for i in range(count):
            self._offer((wall, served, origin, rid, i, None, exc, 0.0, None))

    def _answered(self, served, origin, rid: str | None, index: int, item, future) -> None:
        now = time.monotonic()
        wall = time.time() - (now - item.arrival)
        if future.cancelled():
            self._offer((wall, served, origin, rid, index, None, None, now - item.arrival, None))
            return
        exc = future.exception()
        r = None if exc is not None else future.result()
        frame = None
        if r is not None and self.policy is not None \
                and self.policy.wants(r.verdict, served.task, r.result):
            # bytes of its own: a frame read in place from a front end's arena would keep that
            # space for as long as it waits in the capture queue
            frame = imaging.owned(item.payload)
        self._offer((wall, served, origin, rid, index, r, exc, now - item.arrival, frame))

    def _offer(self, item: tuple) -> None:
        try:
            self._put(item)
        except queue.Full:
            self._dropped.inc()

    # --- the writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        self._retain()
        next_retain = time.monotonic() + self.retain_every_s
        pending: list[Record] = []
        stopping = False
        while not (stopping and not pending):
            if not pending:
                stopping = self._collect(pending, max(0.0, next_retain - time.monotonic()))
            if pending:
                if self._write(pending):
                    pending = []
                elif stopping:
                    metrics.DROPPED.labels("store_fault").inc(len(pending))
                    log.error("records: %d records could not be stored before shutdown (%s)",
                              len(pending), self.fault.cause if self.fault else "?")
                    pending = []
                else:  # the store refuses: the batch waits, so does the queue
                    time.sleep(self._backoff())
            if time.monotonic() >= next_retain and self.fault is None:
                self._retain()
                next_retain = time.monotonic() + self.retain_every_s

    def _collect(self, out: list[Record], wait_s: float) -> bool:
        """Take a batch from the queue into ``out``; True when told to stop."""
        try:
            item = self._queue.get(timeout=max(0.01, wait_s))
        except queue.Empty:
            return False
        end = time.monotonic() + BATCH_WINDOW_S
        while True:
            if item is _STOP:
                return True
            record = self._record(item)
            if record is not None:
                out.append(record)
            if len(out) >= BATCH_MAX:
                return False
            try:
                item = self._queue.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return False

    def _record(self, item: tuple) -> Record | None:
        wall, served, origin, rid, index, r, exc, total_s, frame = item
        part, camera, station, recipe = (tuple(origin) + (None,) * 4)[:4] if origin \
            else (None,) * 4
        try:
            if r is not None:
                task = served.task
                label, _, score = task.summary(r.result)
                record = Record(
                    wall, part, station, camera, served.name, str(served.version), recipe,
                    r.verdict, label or None, None if math.isnan(score) else score,
                    task.inspect_fields(r.result),
                    {"queue_ms": round(r.queue_ms, 3), "compute_ms": round(r.compute_ms, 3),
                     "total_ms": round(total_s * 1000, 3), "batch_size": r.batch_size},
                    rid, index)
            else:
                kind = getattr(exc, "kind", "internal") if exc is not None else "cancelled"
                message = (getattr(exc, "message", "") or "internal server error") \
                    if exc is not None else "the client hung up before the answer"
                record = Record(
                    wall, part, station, camera, served.name, str(served.version), recipe,
                    "LATE" if kind == "deadline" else "ERROR", None, None, None,
                    {"total_ms": round(total_s * 1000, 3)}, rid, index, f"{kind}: {message}")
        except Exception:
            log.exception("records: a record of model %s could not be made", served.name)
            metrics.DROPPED.labels("error").inc()
            return None
        if frame is not None:
            record = self._capture(record, frame)
        return record

    def _write(self, batch: list[Record]) -> bool:
        try:
            self.store.write(batch)
        except StoreFault as exc:
            metrics.STORE_ERRORS.inc()
            self._failed(exc)
            if exc.full:
                self._make_room()
            return False
        except Exception:  # a bug, not the store's state: retrying cannot help
            log.exception("records: %d records could not be written", len(batch))
            metrics.DROPPED.labels("error").inc(len(batch))
            return True
        metrics.WRITTEN.inc(len(batch))
        self._recovered()
        return True

    def _failed(self, exc: StoreFault) -> None:
        now = time.monotonic()
        if self.fault is None:
            self._fault_since = self._fault_logged = now
            metrics.STORE_FAULT.set(1)
            log.error("records: %s. Inference goes on; records wait in the queue (%d places) and "
                      "past it are dropped (visionserve_records_dropped_total)", exc.message,
                      self._queue.maxsize)
        elif now - self._fault_logged >= FAULT_LOG_S:
            self._fault_logged = now
            log.error("records: the store still cannot be written, for %.0f s now (%s); %d "
                      "records queued", now - self._fault_since, exc.cause, self._queue.qsize())
        self.fault = exc

    def _recovered(self) -> None:
        if self.fault is None:
            return
        log.warning("records: the store works again after %.1f s (%s)",
                    time.monotonic() - self._fault_since, self.fault.cause)
        self.fault = None
        metrics.STORE_FAULT.set(0)

    def _backoff(self) -> float:
        held = time.monotonic() - self._fault_since
        return min(RETRY_MAX_S, max(RETRY_MIN_S, held / 2))

    def _make_room(self) -> None:
        """The disk (or the database's limit) is full below ``max_bytes``: delete the oldest
        records, so new ones fit where old ones were."""
        try:
            size = self.store.size()
            deleted = self.store.retain(self.max_age_s, min(self.max_bytes, int(size * 0.8)))
        except StoreFault:
            return
        if deleted:
            metrics.DELETED.inc(deleted)
            log.warning("records: the store is full; deleted the %d oldest records", deleted)

    def _retain(self) -> None:
        try:
            deleted = self.store.retain(self.max_age_s, self.max_bytes)
            metrics.STORE_BYTES.set(self.store.size())
        except StoreFault as exc:
            metrics.STORE_ERRORS.inc()
            self._failed(exc)
            return
        except Exception:
            log.exception("records: retention failed")
            return
        if deleted:
            metrics.DELETED.inc(deleted)
            log.info("records: retention deleted %d records", deleted)

    # --- capture -------------------------------------------------------------------------------

    def _capture(self, record: Record, frame: Any) -> Record:
        """Hand the frame to the capture thread; the record names where it goes (if there was
        room in the capture queue)."""
        assert self.target is not None and self.policy is not None
        key = image_key(record, frame.kind)
        kept = dataclasses.replace(record, image=self.target.location(key))
        try:
            self._captures.put_nowait((kept, key, frame))
        except queue.Full:
            metrics.CAPTURE_DROPPED.labels("queue_full").inc()
            return record
        return kept

    def _capture_run(self) -> None:
        assert self.target is not None and self.policy is not None
        captured = metrics.CAPTURED.labels(self.policy.mode)
        while True:
            item = self._captures.get()
            if item is _STOP:
                return
            record, key, frame = item
            try:
                self.target.put(key, image_bytes(frame.kind, frame.data), sidecar(record))
            except Exception as exc:  # noqa: BLE001 - a full or gone target must not stop capture
                metrics.CAPTURE_DROPPED.labels("error").inc()
                now = time.monotonic()
                if now - self._capture_fault_logged >= FAULT_LOG_S:
                    self._capture_fault_logged = now
                    log.error("capture: %s could not be written to %s: %s (logged once a "
                              "minute; visionserve_captures_dropped_total counts them)", key,
                              self.target.where, exc)
                continue
            captured.inc()


def _request_id() -> str | None:
    rid = request_id.get()
    return None if rid == "-" else rid  # "-": outside a request
