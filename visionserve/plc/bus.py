"""The result bus: every answered frame, once, from the engine to the PLC servers.

The engine hands each admitted frame to :meth:`ResultBus.watch` (and each refused one to
:meth:`ResultBus.refused`); when the frame's answer is final (a verdict, LATE, or an error) a
:class:`ResultEvent` goes into a bounded queue, and whoever :meth:`~ResultBus.bind` s to the bus is
woken to drain it: in the server, the link to the PLC server processes
(:mod:`visionserve.plc.service`), which sends each result as a compact tuple
(:meth:`ResultEvent.wire`) over a socket pair. Publishing costs the engine's event loop a few
microseconds and never waits: when the queue is full the result is dropped and counted
(``visionserve_plc_bus_dropped_total``); the PLC sees the gap in the sequence numbers and, with no
result in its window, rejects the part.

A station trigger (one part, a frame from each of the station's cameras) gives the PLC one
result for the part: its frames are marked (``Origin.part_frame``) and only counted here, and the
cameras' service publishes the part's combined answer (:meth:`ResultBus.publish_part`) on the
PLC station named like the station.

Fail-safe: anything but a verdict reached inside the deadline is published as
``ResultCode.NO_DECISION`` (LATE, refused, errors, and frames whose client hung up), which the
PLC must treat as reject. Frames refused before they reach the engine (a malformed request, an
unknown model) have no station or model to publish to; the PLC's window covers them.

The bus also keeps what the watchdog needs: frames outstanding, and when the engine last
computed one.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import partial

from ..dataplane import Origin, PartResult
from ..errors import ConfigError, VisionServeError
from . import metrics


class ResultCode(IntEnum):
    """What a station's result says; the same numbers on OPC UA and Modbus."""

    NONE = 0  #: no result (yet)
    OK = 1
    NG = 2
    NO_DECISION = 3  #: LATE, refused or failed: the PLC must reject the part


class Reason(IntEnum):
    """Why a result is ``NO_DECISION`` (0 for verdicts)."""

    NONE = 0
    LATE = 1  #: the deadline passed before (or while) the frame was computed
    UNAVAILABLE = 2  #: refused: not ready, draining, or overloaded (503)
    INVALID_INPUT = 3  #: the frame could not be used (bad image, bad request)
    INTERNAL = 4  #: a fault inside the server
    CANCELLED = 5  #: the client hung up before the answer


_REASON_OF_KIND = {"deadline": Reason.LATE, "unavailable": Reason.UNAVAILABLE,
                   "invalid_input": Reason.INVALID_INPUT, "too_large": Reason.INVALID_INPUT,
                   "unsupported_media_type": Reason.INVALID_INPUT,
                   "not_found": Reason.INVALID_INPUT}

#: a station part's HTTP status (no decision) as the PLC's reason
_REASON_OF_STATUS = {503: Reason.UNAVAILABLE, 504: Reason.LATE, 400: Reason.INVALID_INPUT,
                     404: Reason.INVALID_INPUT, 413: Reason.INVALID_INPUT,
                     415: Reason.INVALID_INPUT, 422: Reason.INVALID_INPUT}
#: where :attr:`~visionserve.dataplane.Origin.part_frame` is in an origin tuple
_PART_FRAME = Origin._fields.index("part_frame")


def _part_frame(origin: tuple | None) -> bool:
    """A camera's frame of a station's part (its result is the part's, not its own)."""
    return origin is not None and len(origin) > _PART_FRAME and bool(origin[_PART_FRAME])


_LABELS = {ResultCode.OK: "OK", ResultCode.NG: "NG", ResultCode.NO_DECISION: "no_decision"}

#: OPC 40100 ResultStateDataType: 1 Completed, 3 Aborted, 4 Failed
RESULT_STATE = {Reason.NONE: 1, Reason.LATE: 3, Reason.CANCELLED: 3}
RESULT_STATE_FAILED = 4

#: a part id made only of these, and below 2**32, is sent to Modbus as that number
_DIGITS = frozenset("0123456789")


def part_number(part_id: str | None) -> tuple[int, int]:
    """A part id as the 32-bit number Modbus carries, and how it was made: (0, 0) for none,
    (n, 1) for a decimal id below 2**32, (CRC-32 of its UTF-8, 2) for any other."""
    if not part_id:
        return 0, 0
    if len(part_id) <= 10 and _DIGITS.issuperset(part_id) and int(part_id) < 2**32:
        return int(part_id), 1
    return zlib.crc32(part_id.encode("utf-8")), 2


@dataclass(frozen=True, slots=True)
class ResultEvent:
    """One frame's final answer, as both PLC servers publish it."""

    result_id: str  #: unique in this server's life (OPC 40100 ResultId)
    station: int  #: index into :attr:`Stations.names`
    part_id: str | None
    camera_id: str | None
    model: str
    version: str
    index: int  #: the frame's place in its request (0 for inspect)
    code: ResultCode
    reason: Reason
    verdict: str  #: OK, NG, LATE or ERROR
    label: str
    label_index: int  #: into the model's labels; -1 without a verdict
    score: float  #: NaN without a verdict
    queue_ms: float
    compute_ms: float
    total_ms: float  #: arrival to final answer
    arrival_time: float  #: wall clock (time.time()) at arrival
    final_time: float  #: wall clock at the final answer
    final_mono: float  #: monotonic clock at the final answer (bus delay metric)
    message: str = ""  #: the error's message for NO_DECISION

    def wire(self) -> tuple:
        """The event as a tuple of plain values (pickled small and fast, for the PLC processes)."""
        return (self.result_id, self.station, self.part_id, self.camera_id, self.model,
                self.version, self.index, int(self.code), int(self.reason), self.verdict,
                self.label, self.label_index, self.score, self.queue_ms, self.compute_ms,
                self.total_ms, self.arrival_time, self.final_time, self.final_mono, self.message)

    @classmethod
    def from_wire(cls, t: tuple) -> ResultEvent:
        fields = list(t)
        fields[7], fields[8] = ResultCode(fields[7]), Reason(fields[8])
        return cls(*fields)


class Stations:
    """Which station (OPC UA object, Modbus unit id) a frame's camera id goes to.

    ``spec``: camera ids, comma-separated; station N (1-based) is the N-th. ``*`` takes every
    camera no other entry names, and frames without a camera id.
    """

    def __init__(self, spec: str) -> None:
        names = [n.strip() for n in spec.split(",")]
        if not spec.strip() or any(not n for n in names):
            raise ConfigError(f"--plc-stations {spec!r}: camera ids separated by commas, or * "
                              "(every camera)")
        if len(set(names)) != len(names):
            raise ConfigError(f"--plc-stations {spec!r}: a camera id is named twice")
        if len(names) > 247:  # Modbus unit ids 1..247
            raise ConfigError(f"--plc-stations: {len(names)} stations; at most 247")
        self.names: tuple[str, ...] = tuple(names)
        self._index = {n: i for i, n in enumerate(names) if n != "*"}
        self._rest = names.index("*") if "*" in names else None

    def __len__(self) -> int:
        return len(self.names)

    def route(self, camera_id: str | None) -> int | None:
        if camera_id is None:
            return self._rest
        return self._index.get(camera_id, self._rest)


class ResultBus:
    """Engine side: :meth:`watch`, :meth:`refused`. Consumer side: :meth:`bind`, :meth:`drain`."""

    def __init__(self, stations: Stations, capacity: int = 4096) -> None:
        self.stations = stations
        self.capacity = capacity
        self._queue: deque[ResultEvent] = deque()
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]
        self._wake: Callable[[], None] | None = None
        self._signalled = False
        #: frames admitted and not yet final, in all and per station (Busy)
        self.outstanding = 0
        self.inflight = [0] * len(stations)
        #: called on the engine's loop with (station, busy) when a station's frames in flight go
        #: from 0 to some (True) or back to 0 (False); it must never block
        self.on_busy: Callable[[int, bool], None] | None = None
        #: monotonic times: the engine last computed a frame; outstanding went from 0 to 1
        self.last_progress = time.monotonic()
        self.busy_since = self.last_progress
        self._results = [{code: metrics.RESULTS.labels(name, label)
                          for code, label in _LABELS.items()} for name in stations.names]

    # --- consumer side ---------------------------------------------------------------------

    def bind(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called when results are queued (once until the next :meth:`drain`), on
        the engine's loop; it must never block."""
        self._wake = wake

    def unbind(self) -> None:
        self._wake = None

    def drain(self) -> list[ResultEvent]:
        """Every queued result, oldest first. Call after ``ready`` fired, having cleared it."""
        self._signalled = False  # before taking: a result published meanwhile wakes us again
        out = []
        queue = self._queue
        while queue:
            out.append(queue.popleft())
        return out

    # --- engine side (its event loop) --------------------------------------------------------

    def watch(self, served, pending: Sequence, origin: tuple | None) -> None:
        """Publish each admitted frame (``Pending``: future, arrival) once its answer is final;
        a camera's frame of a station's part only counts (the part's result comes by
        :meth:`publish_part`), its station Busy meanwhile."""
        part_id, camera_id = origin[:2] if origin else (None, None)
        own = not _part_frame(origin)
        station = self.stations.route(camera_id if own or origin is None else origin[2])
        if self.outstanding == 0:
            self.busy_since = time.monotonic()
        self.outstanding += len(pending)
        if station is not None:
            if self.inflight[station] == 0 and self.on_busy is not None:
                self.on_busy(station, True)
            self.inflight[station] += len(pending)
        for i, item in enumerate(pending):
            item.future.add_done_callback(partial(
                self._answered, served, station, part_id, camera_id, i, item.arrival, own))

    def refused(self, served, count: int, origin: tuple | None, exc: VisionServeError) -> None:
        """Frames the engine refused at admission (not ready, draining, overloaded, bad request)."""
        if _part_frame(origin):
            return  # the part's result says it
        part_id, camera_id = origin[:2] if origin else (None, None)
        station = self.stations.route(camera_id)
        if station is None:
            metrics.UNROUTED.inc(count)
            return
        now = time.monotonic()
        for i in range(count):
            self.publish(self._failed(served, station, part_id, camera_id, i, now, now, exc))

    def publish_part(self, part: PartResult) -> None:
        """A station's part as one result, on the PLC station named like the station."""
        station = self.stations.route(part.station)
        if station is None:
            metrics.UNROUTED.inc()
            return
        now = time.monotonic()
        if part.verdict in ("OK", "NG"):
            code, reason = (ResultCode.OK if part.verdict == "OK" else ResultCode.NG), Reason.NONE
        else:
            code = ResultCode.NO_DECISION
            reason = Reason.LATE if part.verdict == "LATE" \
                else _REASON_OF_STATUS.get(part.status, Reason.INTERNAL)
        self.publish(ResultEvent(
            self._next_id(), station, part.part_id, ",".join(part.cameras), part.model,
            part.version, 0, code, reason, part.verdict, part.label, part.label_index,
            float(part.score), part.queue_ms, part.compute_ms, (now - part.asked) * 1000,
            *_wall(part.asked, now), now, part.message))

    def _answered(self, served, station: int | None, part_id, camera_id, index: int,
                  arrival: float, own: bool, future: asyncio.Future) -> None:
        now = time.monotonic()
        self.outstanding -= 1
        if station is not None:
            self.inflight[station] -= 1
            if self.inflight[station] == 0 and self.on_busy is not None:
                self.on_busy(station, False)
        if future.cancelled():
            if station is not None and own:
                self.publish(self._failed(served, station, part_id, camera_id, index, arrival, now,
                                          None))
            return
        exc = future.exception()
        if exc is None or getattr(exc, "kind", "") == "invalid_input":
            self.last_progress = now  # the runner worked on it: the engine is alive
        if not own:
            return  # one camera's frame of a station's part: publish_part says the part's
        if station is None:
            metrics.UNROUTED.inc()
            return
        if exc is not None:
            self.publish(self._failed(served, station, part_id, camera_id, index, arrival, now,
                                      exc))
            return
        r = future.result()
        late = not r.deadline_met
        label, label_index, score = served.task.summary(r.result)  # what the task says of it
        self.publish(ResultEvent(
            self._next_id(), station, part_id, camera_id, served.name, str(served.version), index,
            ResultCode.NO_DECISION if late
            else ResultCode.OK if r.verdict == "OK" else ResultCode.NG,
            Reason.LATE if late else Reason.NONE, "LATE" if late else r.verdict, label,
            label_index, float(score), r.queue_ms,
            r.compute_ms, (now - arrival) * 1000, *_wall(arrival, now), now,
            "answered after the deadline" if late else ""))

    def _failed(self, served, station: int, part_id, camera_id, index: int, arrival: float,
                now: float, exc: BaseException | None) -> ResultEvent:
        if exc is None:
            reason, message = Reason.CANCELLED, "the client hung up before the answer"
        else:
            reason = _REASON_OF_KIND.get(getattr(exc, "kind", ""), Reason.INTERNAL)
            message = getattr(exc, "message", "") or "internal server error"
        return ResultEvent(
            self._next_id(), station, part_id, camera_id, served.name, str(served.version), index,
            ResultCode.NO_DECISION, reason, "LATE" if reason is Reason.LATE else "ERROR", "", -1,
            math.nan, 0.0, 0.0, (now - arrival) * 1000, *_wall(arrival, now), now, message)

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def publish(self, event: ResultEvent) -> None:
        """Queue ``event`` for the PLC servers; never waits (a full queue drops it, counted)."""
        self._results[event.station][event.code].inc()
        if len(self._queue) >= self.capacity:
            metrics.BUS_DROPPED.inc()
            return
        self._queue.append(event)
        wake = self._wake
        if not self._signalled and wake is not None:
            self._signalled = True
            try:
                wake()
            except RuntimeError:  # the consumer's loop closed (shutdown): nobody to wake
                self._wake = None


class BusMirror:
    """What a PLC server process knows of the engine's result bus, as the serving process reports
    it (:mod:`visionserve.plc.child`): frames outstanding, the last progress, and which stations
    are busy; the servers and the watchdog read it as they would the bus."""

    def __init__(self, stations: int) -> None:
        self.outstanding = 0
        self.last_progress = self.busy_since = time.monotonic()
        self.inflight = [0] * stations


def _wall(arrival: float, now: float) -> tuple[float, float]:
    """Wall-clock times of two monotonic instants (the PLC wants calendar time stamps)."""
    offset = time.time() - now
    return arrival + offset, now + offset
