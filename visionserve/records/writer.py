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
with a growing pause, for up to ``GIVE_UP_S``; then it is dropped, counted and logged, and the
writer goes on with the next. A full disk is met by making room, records first: the store's own
slack (SQLite's WAL), then the server's oldest captured images on that disk, and only then the
oldest records. The fault is logged when it starts, every ``FAULT_LOG_S`` while it lasts, and
when it ends, and ``visionserve_records_store_fault`` reads 1 while it lasts. Retention runs in
the same thread every ``RETAIN_EVERY_S``.

Frames the capture policy picks (decided on the loop, from the verdict and the task's margin:
the frame's bytes are only kept for those) go, with their record, to a second bounded queue and
thread, so a slow bucket or disk never holds up the other records. That thread stores the image
first and then hands the record on to the writer, naming the image only if it was stored: a
record never points at an image that is not there.

With ``recent`` (:mod:`.recent`), the frames the policy did not keep stay in memory a while:
:meth:`Recorder.capture_recent` (an operator's flag) hands one to the capture thread, which stores
its image as any other, and then names it in the record already written (``kept_for``
``flagged``).

At :meth:`Recorder.close` (shutdown) both threads store what is queued within the given time
(images get the first half of it; after that, records go on without their image); every record
that could not be stored is counted (``reason="shutdown"``) and one line says how many.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from .. import imaging
from ..dataplane import Origin
from ..errors import Unavailable
from ..logs import current_request_id
from . import metrics
from .capture import FolderTarget, NoRoom, Policy, S3Target, image_bytes, image_key, sidecar
from .recent import Recent, RecentFrames
from .record import Record
from .store import RecordStore, StoreFault

log = logging.getLogger(__name__)

BATCH_MAX = 500
BATCH_WINDOW_S = 0.1
RETAIN_EVERY_S = 600.0
FAULT_LOG_S = 60.0
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
#: a batch the store refuses this long is dropped (counted, logged): the next ones get their turn
GIVE_UP_S = 120.0
#: on close, how long the writer may take to store what is queued (the server passes its drain
#: time)
CLOSE_TIMEOUT_S = 10.0
#: past the close time, how long a store call in progress (SQLite's busy wait, a database
#: connect) may still take before what remains is counted lost
STUCK_GRACE_S = 6.0
#: how long the capture thread waits for room in the writer's queue before dropping a record
FORWARD_WAIT_S = 1.0
#: the capture thread's idle poll (when it uploads spooled images)
IDLE_S = 1.0
#: how long a flag waits for its recent frame's image to be stored
FLAG_WAIT_S = 30.0

#: put into the queues at close: wakes a thread that waits on them
_WAKE = object()
_NO_ORIGIN = Origin()
#: an answer's (frame, why it is kept) when its image is not captured
_NOT_KEPT = (None, None)


@dataclasses.dataclass(frozen=True)
class _Flagged:
    """A recent frame to capture for a flag (:meth:`Recorder.capture_recent`); ``done``: where
    its image was stored, or None."""

    record: Record
    recent: Recent
    drawing: Callable[[], dict]
    done: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)


class Recorder:
    """Engine side: ``watch`` and ``refused`` (the event loop). Worker side: the writer thread
    and, with a capture policy, the capture thread."""

    def __init__(self, store: RecordStore, *, max_age_s: float, max_bytes: int,
                 queue_size: int = 10_000, policy: Policy | None = None,
                 target: FolderTarget | S3Target | None = None, capture_queue: int = 256,
                 retain_every_s: float = RETAIN_EVERY_S, recent_bytes: int = 0) -> None:
        self.store = store
        self.max_age_s, self.max_bytes = max_age_s, max_bytes
        self.retain_every_s = retain_every_s
        #: answered frames (tuples) and, from the capture thread, finished records
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.policy = policy if policy is not None and policy.active and target else None
        self.target = target if self.policy is not None else None
        self._captures: queue.Queue = queue.Queue(maxsize=capture_queue)
        #: the frames not captured, a while (with a capture policy and ``recent_bytes``)
        self.recent = RecentFrames(recent_bytes) if self.policy is not None and recent_bytes \
            else None
        self._put = self._queue.put_nowait
        self._threads: list[threading.Thread] = []
        #: the store's refusal while it lasts (doctor and tests read it)
        self.fault: StoreFault | None = None
        self._fault_since = self._fault_logged = 0.0
        self._capture_fault_logged = self._room_fault_logged = 0.0
        self._retry_now = False
        # shutdown: set by close(); the capture thread takes no frame once it has closed
        self._stopping = threading.Event()
        self._capture_done = threading.Event()
        self._capture_lock = threading.Lock()
        self._capture_closed = False
        self._deadline = self._capture_deadline = math.inf
        self._in_flight = 0  # the writer's batch now (for close, should the writer hang)
        #: since start: records written, lost (every reason) and deleted by retention
        self._count_lock = threading.Lock()
        self.written = self.lost = self.deleted = 0
        metrics.QUEUE_DEPTH.set_function(self._queue.qsize)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._run, name="records", daemon=True)]
        if self.policy is not None:
            self._threads.append(threading.Thread(target=self._capture_run, name="capture",
                                                  daemon=True))
        else:
            self._capture_done.set()
        for t in self._threads:
            t.start()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Store what is queued (within ``timeout_s``), then stop the threads; what could not be
        stored is counted lost, and one line says how many."""
        now = time.monotonic()
        self._deadline, self._capture_deadline = now + timeout_s, now + timeout_s / 2
        lost_before = self.lost
        self._stopping.set()
        for q in (self._queue, self._captures):
            try:
                q.put_nowait(_WAKE)
            except queue.Full:
                pass  # a full queue wakes its thread anyway
        for t in self._threads:
            t.join(max(0.0, self._deadline + STUCK_GRACE_S - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        # what no thread will store now: the writer's batch if it hangs, and what is queued
        left = self._in_flight if "records" in stuck else 0
        for q in (self._queue, self._captures):
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                left += item is not _WAKE
        if left:
            self._lose(left, "shutdown")
        lost = self.lost - lost_before
        if lost:
            log.error("records: %d records lost at shutdown: not stored within %.1f s%s "
                      "(visionserve_records_dropped_total); since start %d written, %d lost, %d "
                      "deleted by retention", lost, timeout_s,
                      f", {' and '.join(stuck)} thread hung" if stuck else "", self.written,
                      self.lost, self.deleted)
        else:
            log.info("records: stopped, every queued record stored; since start %d written, %d "
                     "lost, %d deleted by retention", self.written, self.lost, self.deleted)
        self.store.close()

    # --- engine side (its event loop): one callback and one put per frame ------------------------

    def watch(self, served, pending: Sequence, origin: tuple | None) -> None:
        rid = current_request_id()
        for i, item in enumerate(pending):
            item.future.add_done_callback(partial(self._answered, served, origin, rid, i, item))

    def refused(self, served, count: int, origin: tuple | None, exc) -> None:
        rid, wall = current_request_id(), time.time()
        for i in range(count):
            self._offer((wall, served, origin, rid, i, None, exc, 0.0, _NOT_KEPT))

    def _answered(self, served, origin, rid: str | None, index: int, item, future) -> None:
        now = time.monotonic()
        wall = time.time() - (now - item.arrival)
        if future.cancelled():
            self._offer((wall, served, origin, rid, index, None, None, now - item.arrival,
                         _NOT_KEPT))
            return
        exc = future.exception()
        r = None if exc is not None else future.result()
        frame = kept_for = None
        if r is not None and self.policy is not None:
            kept_for = self.policy.wants(r.verdict, served.task, r.result)
            if kept_for is not None:
                # bytes of its own: a frame read in place from a front end's arena would keep
                # that space for as long as it waits in the capture queue
                frame = imaging.owned(item.payload)
                item.captured = True  # the live feed, tapped after the records, says so
            elif self.recent is not None:
                self.recent.add(served.name, rid, index,
                                Recent(wall, origin[0] if origin else None,
                                       imaging.owned(item.payload), served.task, r.result))
        self._offer((wall, served, origin, rid, index, r, exc, now - item.arrival,
                     (frame, kept_for)))

    def _offer(self, item: tuple) -> None:
        try:
            self._put(item)
        except queue.Full:
            self._lose(1, "queue_full")

    def _lose(self, n: int, reason: str) -> None:
        metrics.DROPPED.labels(reason).inc(n)
        with self._count_lock:
            self.lost += n

    # --- the writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        self._retain()
        next_retain = time.monotonic() + self.retain_every_s
        pending: list[Record] = []
        failing_since = 0.0
        while True:
            stopping = self._stopping.is_set()
            if not pending:
                if stopping and self._capture_done.is_set() and self._queue.empty():
                    return
                self._collect(pending, 0.05 if stopping else
                              max(0.0, next_retain - time.monotonic()))
                self._in_flight = len(pending)
            if pending:
                if self._write(pending):
                    pending, failing_since = [], 0.0
                    self._in_flight = 0
                    continue
                now = time.monotonic()
                failing_since = failing_since or now
                if stopping and now >= self._deadline:
                    self._give_up(pending, "shutdown")
                    return  # close() counts what is still queued
                if now - failing_since >= GIVE_UP_S:
                    self._give_up(pending, "store_fault")
                    pending, failing_since = [], 0.0
                elif self._retry_now:
                    self._retry_now = False
                else:  # the store refuses: the batch waits, so does the queue
                    pause = self._backoff()
                    if stopping:
                        pause = min(pause, max(0.0, self._deadline - now), 0.5)
                        time.sleep(pause)
                    else:
                        self._stopping.wait(pause)  # close() ends the pause
            if time.monotonic() >= next_retain and self.fault is None:
                self._retain()
                next_retain = time.monotonic() + self.retain_every_s

    def _give_up(self, batch: list[Record], reason: str) -> None:
        self._lose(len(batch), reason)
        log.error("records: %d records are lost: the store refused them for %.0f s (%s)%s",
                  len(batch), time.monotonic() - self._fault_since,
                  self.fault.cause if self.fault else "?",
                  " and the server is shutting down" if reason == "shutdown" else
                  "; the writer goes on with the next ones")
        self._in_flight = 0

    def _collect(self, out: list[Record], wait_s: float) -> None:
        """Take a batch from the queue into ``out``."""
        try:
            item = self._queue.get(timeout=max(0.01, wait_s))
        except queue.Empty:
            return
        end = time.monotonic() + BATCH_WINDOW_S
        while True:
            # a finished record back from the capture thread, or an answered frame
            record = item if isinstance(item, Record) or item is _WAKE else self._record(item)
            if isinstance(record, Record):
                out.append(record)
            if len(out) >= BATCH_MAX:
                return
            try:
                item = self._queue.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return

    def _record(self, item: tuple) -> Record | None:
        wall, served, origin, rid, index, r, exc, total_s, (frame, kept_for) = item
        o = Origin(*origin) if origin else _NO_ORIGIN
        part, camera, station, recipe = o.part_id, o.camera, o.station, o.recipe
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
                    rid, index, camera_time=o.camera_time, camera_frame=o.camera_frame,
                    kept_for=kept_for)
            else:
                kind = getattr(exc, "kind", "internal") if exc is not None else "cancelled"
                message = (getattr(exc, "message", "") or "internal server error") \
                    if exc is not None else "the client hung up before the answer"
                record = Record(
                    wall, part, station, camera, served.name, str(served.version), recipe,
                    "LATE" if kind == "deadline" else "ERROR", None, None, None,
                    {"total_ms": round(total_s * 1000, 3)}, rid, index, f"{kind}: {message}",
                    camera_time=o.camera_time, camera_frame=o.camera_frame)
        except Exception:
            log.exception("records: a record of model %s could not be made", served.name)
            self._lose(1, "error")
            return None
        if frame is not None:
            assert r is not None
            # what the image's sidecar keeps to draw the answer again: made on the capture thread
            drawing = partial(served.task.capture_fields, r.result, (frame.width, frame.height))
            return self._capture(record, frame, drawing)
        return record

    def _write(self, batch: list[Record]) -> bool:
        try:
            self.store.write(batch)
        except StoreFault as exc:
            metrics.STORE_ERRORS.inc()
            self._failed(exc)
            if exc.full:
                self._retry_now = self._make_room()
            return False
        except Exception:  # a bug, not the store's state: retrying cannot help
            log.exception("records: %d records could not be written", len(batch))
            self._lose(len(batch), "error")
            return True
        metrics.WRITTEN.inc(len(batch))
        with self._count_lock:
            self.written += len(batch)
        self._recovered()
        return True

    def _failed(self, exc: StoreFault) -> None:
        now = time.monotonic()
        first, self.fault = self.fault is None, exc  # the fault before its gauge: readers see both
        if first:
            self._fault_since = self._fault_logged = now
            metrics.STORE_FAULT.set(1)
            log.error("records: %s. Inference goes on; the batch is retried for up to %.0f s, "
                      "records wait in the queue (%d places); what is dropped is counted "
                      "(visionserve_records_dropped_total) and logged", exc.message, GIVE_UP_S,
                      self._queue.maxsize)
        elif now - self._fault_logged >= FAULT_LOG_S:
            self._fault_logged = now
            log.error("records: the store still cannot be written, for %.0f s now (%s); %d "
                      "records queued", now - self._fault_since, exc.cause, self._queue.qsize())

    def _recovered(self) -> None:
        if self.fault is None:
            return
        log.warning("records: the store works again after %.1f s (%s)",
                    time.monotonic() - self._fault_since, self.fault.cause)
        metrics.STORE_FAULT.set(0)  # the gauge before the fault: a reader that sees no fault
        self.fault = None           # sees the gauge at 0

    def _backoff(self) -> float:
        held = time.monotonic() - self._fault_since
        return min(RETRY_MAX_S, max(RETRY_MIN_S, held / 2))

    def _make_room(self) -> bool:
        """The disk (or the database's limit) is full: make room, records first. The store's
        own slack, then our oldest captured images on the store's disk, and only then the
        oldest records. True when room was made (the batch is tried again at once)."""
        try:
            size = self.store.size()
            self.store.reclaim()
            if self.store.size() < size:
                return True
        except StoreFault:
            return False
        folder = self.store.folder
        spool = self.target.spool if isinstance(self.target, S3Target) else self.target
        if folder is not None and spool is not None:
            freed = spool.free_for_records(folder)
            if freed:
                log.warning("records: the disk of %s is full: deleted captured images (%d "
                            "bytes) to make room for the records", self.store.where, freed)
                return True
        try:
            deleted = self.store.retain(self.max_age_s, min(self.max_bytes, int(size * 0.8)))
        except StoreFault as exc:
            now = time.monotonic()
            if now - self._room_fault_logged >= FAULT_LOG_S:
                self._room_fault_logged = now
                log.error("records: the store is full and deleting its oldest records failed "
                          "too (%s): no room could be made (logged once a minute)", exc.cause)
            return False
        if deleted:
            self._deleted(deleted)
            log.warning("records: the store is full; deleted the %d oldest records", deleted)
        return bool(deleted)

    def _deleted(self, n: int) -> None:
        metrics.DELETED.inc(n)
        with self._count_lock:
            self.deleted += n

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
            self._deleted(deleted)
            log.info("records: retention deleted %d records", deleted)

    # --- capture -------------------------------------------------------------------------------

    def _capture(self, record: Record, frame: Any, drawing: Callable[[], dict]
                 ) -> Record | None:
        """Hand the frame and its record to the capture thread, which hands the record back
        once the image is stored (None here); the record itself when there is no room in the
        capture queue, or capture has closed."""
        with self._capture_lock:
            if self._capture_closed:
                metrics.CAPTURE_DROPPED.labels("shutdown").inc()
                return dataclasses.replace(record, kept_for=None)
            try:
                self._captures.put_nowait((record, frame, drawing))
            except queue.Full:
                metrics.CAPTURE_DROPPED.labels("queue_full").inc()
                return dataclasses.replace(record, kept_for=None)
        return None

    def _capture_run(self) -> None:
        assert self.target is not None and self.policy is not None
        flush = getattr(self.target, "flush", None)
        next_flush = 0.0
        try:
            while True:
                stopping = self._stopping.is_set()
                if flush is not None and not stopping and time.monotonic() >= next_flush:
                    # spooled images: also under a steady stream of new ones
                    self._guarded(flush)
                    next_flush = time.monotonic() + IDLE_S
                try:
                    item = self._captures.get(timeout=0.05 if stopping else IDLE_S)
                except queue.Empty:
                    if stopping:
                        break
                    continue
                if item is _WAKE:
                    continue
                if isinstance(item, _Flagged):
                    item.done.set_result(self._put_image(item.record, item.recent.frame,
                                                         item.drawing, "flagged"))
                    continue
                record, frame, drawing = item
                self._store_image(record, frame, drawing,
                                  time.monotonic() < self._capture_deadline)
            with self._capture_lock:
                self._capture_closed = True
            while True:  # what came in meanwhile: its records, without their image
                try:
                    item = self._captures.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Flagged):
                    item.done.set_result(None)
                elif item is not _WAKE:
                    record, frame, drawing = item
                    self._store_image(record, frame, drawing, keep=False)
        finally:
            self._capture_done.set()

    def _store_image(self, record: Record, frame: Any, drawing: Callable[[], dict],
                     keep: bool) -> None:
        """Store the image (``keep``) and hand its record to the writer, naming the image only
        if it is stored."""
        assert self.policy is not None
        image = None
        if not keep:
            metrics.CAPTURE_DROPPED.labels("shutdown").inc()
        else:
            image = self._put_image(record, frame, drawing, self.policy.mode)
        try:
            # a record says why its image was kept only where it was
            self._queue.put(dataclasses.replace(
                record, image=image, kept_for=record.kept_for if image else None),
                timeout=FORWARD_WAIT_S)
        except queue.Full:
            self._lose(1, "queue_full")

    def _put_image(self, record: Record, frame: Any, drawing: Callable[[], dict],
                   why: str) -> str | None:
        """(the capture thread) the frame's image and sidecar stored: where, or None (counted
        and logged); ``why``: the metric's label (the policy, or ``flagged``)."""
        assert self.target is not None
        key = "?"
        try:
            key = image_key(record, frame.kind)
            kept = dataclasses.replace(record, image=self.target.location(key))
            image = self.target.put(key, image_bytes(frame),
                                    sidecar(kept, self._drawing(drawing, record)))
        except NoRoom as exc:
            metrics.CAPTURE_DROPPED.labels("no_room").inc()
            self._capture_failed(key, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a full or gone target must not stop capture
            metrics.CAPTURE_DROPPED.labels("error").inc()
            self._capture_failed(key, exc)
            return None
        metrics.CAPTURED.labels(why).inc()
        return image

    # --- a flag's frame from the recent ones (a worker thread of the server) ------------------

    def capture_recent(self, row_id: int, timeout_s: float = FLAG_WAIT_S) -> str | None:
        """Capture the frame of the store's record ``row_id``, written without an image, from
        the recent frames: its image stored by the capture thread and named in the record
        (``kept_for`` ``flagged``). Where (a record with an image: that one), or None: no
        longer in memory, or not stored; Unavailable while the capture writer is behind or
        closed."""
        record = self.store.record(row_id)
        if record is None or record.image is not None:
            return None if record is None else record.image
        if self.recent is None:
            return None
        recent = self.recent.take(record.model, record.request_id, record.frame_index,
                                  record.part_id, record.time)
        if recent is None:
            return None
        size = (recent.frame.width, recent.frame.height)
        flagged = _Flagged(dataclasses.replace(record, kept_for="flagged"), recent,
                           partial(recent.task.capture_fields, recent.result, size))
        behind = Unavailable(f"record {row_id}: the capture writer is behind; its frame is "
                             "kept a while: flag it again", retry_after_s=2.0)
        with self._capture_lock:
            if self._capture_closed:
                raise Unavailable.shutting_down()
            try:
                self._captures.put_nowait(flagged)
            except queue.Full:
                self.recent.add(record.model, record.request_id, record.frame_index, recent)
                raise behind from None
        try:
            image = flagged.done.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise behind from None
        if image is not None:
            self.store.set_image(row_id, image, "flagged")
        return image

    @staticmethod
    def _drawing(drawing: Callable[[], dict], record: Record) -> dict:
        """What the task keeps to draw the answer on the image later; a task's failure costs
        the drawing, never the image."""
        try:
            return drawing()
        except Exception:
            log.exception("capture: model %s could not keep what draws its answer on %s's "
                          "image", record.model, record.part_id or record.request_id)
            return {}

    def _capture_failed(self, key: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._capture_fault_logged >= FAULT_LOG_S:
            self._capture_fault_logged = now
            assert self.target is not None
            log.error("capture: %s could not be written to %s: %s; its record names no image "
                      "(logged once a minute; visionserve_captures_dropped_total counts them)",
                      key, self.target.where, exc)

    def _guarded(self, fn) -> None:
        try:
            fn()
        except Exception:  # a bug: logged, and the capture thread keeps running
            log.exception("capture: uploading the spooled images failed")
