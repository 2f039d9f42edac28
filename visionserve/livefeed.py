"""The live results feed: every frame's final answer as a small event, for the console's live
page (``GET /v1/live``, ``GET /v1/live/summary``), in every front-end process.

Engine side, :class:`LiveSource`: a result tap (``Engine.tap``) that turns each final answer
(OK, NG, LATE, refused at admission, an error) into a :class:`LiveEvent`, keeps the last
``RING`` events of each model for a page that just opened and a per-minute aggregate of each
model (counts, latency histogram) for the summary, and hands the events of one event-loop turn
to its sinks together: this process's streams, and one :class:`Outbox` per ``--frontends``
process that has a stream open. It is tapped only while a console listens: from the first
stream (or summary read) until ``LINGER_S`` after the last one; the rest of the time an answer
costs it nothing. The open streams of all front ends count against one limit
(``--max-live-streams``), kept here.

Front-end side, :class:`LiveStreams`: the open streams of one process, each a
:class:`LiveStream` with its filter and a bounded queue (a slow browser loses its oldest
events, counted, and is told). :class:`LocalFeed` is the feed of the serving process (the
engine's :class:`LiveSource` at hand); ``frontends.remote`` has the one of a front-end process
(the same streams, fed by the hub's messages).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple, Protocol

from . import metrics
from .errors import DeadlineExceeded, Unavailable, VisionServeError
from .logs import current_request_id

log = logging.getLogger(__name__)

#: events kept per model for a page that just opened (replayed on connect)
RING = 300
#: events waiting for one browser; past it the oldest go (counted, and the stream is told)
STREAM_QUEUE = 1000
#: a stream gives what came at most once in this long: at a line's pace every answer alone would
#: cost each open page a wake-up and a write of its own (the server's event loop, per page)
STREAM_BATCH_S = 0.1
#: events waiting for one front-end process; past it the oldest go (counted)
OUTBOX = 2000
#: a front-end process's channel with more unsent bytes than this gets no live events until it
#: catches up (its answers go first)
OUTBOX_BACKLOG_BYTES = 1 << 20
#: how often held events are offered again to a backed-up front-end process
OUTBOX_RETRY_S = 0.05
#: minutes of per-minute aggregates kept, the longest summary
WINDOW_MIN = 60
#: the feed stays tapped this long after the last stream closed or summary was read
LINGER_S = WINDOW_MIN * 60.0
#: reasons an event carries at most (an NG's rules, a refusal's message)
MAX_REASONS = 5
#: the kinds of answer an event gives, and the summary counts
KINDS = ("OK", "NG", "LATE", "REFUSED", "ERROR")
#: latency histogram: bins of 5 % from 0.01 ms up (the last one holds all over 45 minutes),
#: for p50 / p99
_BIN_BASE_MS = 0.01
_BIN_GROWTH = math.log(1.05)
_BINS = 400


class LiveEvent(NamedTuple):
    """One frame's final answer, as the live page shows it (:meth:`to_json`)."""

    seq: int  # the engine's running number: the stream's ``id:`` with ``boot``
    boot: str  # the engine process's own id: an id of another run is not resumed
    model: str
    version: str
    station: str | None
    camera: str | None
    part_id: str | None
    verdict: str  # one of KINDS
    label: str | None
    reasons: tuple[str, ...]  # why NG, LATE, refused or failed
    latency_ms: float  # arrival to answer (0 for a refusal)
    time: float  # the answer's wall-clock time, epoch seconds
    request_id: str | None
    captured: bool  # the capture policy kept the frame's image (docs/records.md)

    @property
    def id(self) -> str:
        return f"{self.boot}-{self.seq}"

    def to_json(self) -> dict:
        return {"id": self.id, "model": self.model, "version": self.version,
                "station": self.station, "camera": self.camera, "part_id": self.part_id,
                "verdict": self.verdict, "label": self.label, "reasons": list(self.reasons),
                "latency_ms": round(self.latency_ms, 3), "time": round(self.time, 3),
                "request_id": self.request_id, "captured": self.captured}


def parse_id(event_id: str | None) -> tuple[str, int] | None:
    """(boot, seq) of an event id (``Last-Event-ID``), None when it is no id of ours."""
    if not event_id:
        return None
    boot, _, seq = event_id.strip().rpartition("-")
    return (boot, int(seq)) if boot and seq.isdigit() else None


# --- the per-minute aggregate --------------------------------------------------------------------

class _Minute:
    __slots__ = ("bins", "counts")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(KINDS, 0)
        self.bins: dict[int, int] = {}  # latency bin -> frames

    def add(self, verdict: str, latency_ms: float) -> None:
        self.counts[verdict] += 1
        if verdict in ("OK", "NG", "LATE"):  # answered: a refusal or an error took no compute
            b = 0 if latency_ms <= _BIN_BASE_MS else \
                min(_BINS - 1, int(math.log(latency_ms / _BIN_BASE_MS) / _BIN_GROWTH) + 1)
            self.bins[b] = self.bins.get(b, 0) + 1

    def quantile(self, q: float) -> float | None:
        """The latency (ms, the upper edge of its 5 % bin) under which a share ``q`` lies."""
        total = sum(self.bins.values())
        if not total:
            return None
        want, seen = q * total, 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen >= want:
                return round(_BIN_BASE_MS * math.exp(b * _BIN_GROWTH), 3)
        return None  # pragma: no cover - the loop reaches the total


class Minutes:
    """One model's last ``WINDOW_MIN`` minutes: answers by kind and a latency histogram each."""

    def __init__(self) -> None:
        self._minutes: deque[tuple[int, _Minute]] = deque()

    def add(self, verdict: str, latency_ms: float, wall: float) -> None:
        minute = int(wall // 60)
        ms = self._minutes
        if not ms or ms[-1][0] < minute:
            ms.append((minute, _Minute()))
            while ms[0][0] <= minute - WINDOW_MIN:
                ms.popleft()
        elif ms[-1][0] > minute:  # the wall clock stepped back: counted in the newest minute
            minute = ms[-1][0]
        ms[-1][1].add(verdict, latency_ms)

    def summary(self, minutes: int, now: float) -> list[dict]:
        """One row per minute of the last ``minutes`` (the current one included), oldest first;
        a minute without answers is a row of zeros."""
        last = int(now // 60)
        have = {m: agg for m, agg in self._minutes}
        rows = []
        for m in range(last - minutes + 1, last + 1):
            agg = have.get(m) or _Minute()
            rows.append({"minute": m * 60, **{k.lower(): agg.counts[k] for k in KINDS},
                         "p50_ms": agg.quantile(0.5), "p99_ms": agg.quantile(0.99)})
        return rows


# --- the engine side -----------------------------------------------------------------------------

Sink = Callable[[list[LiveEvent]], None]


class Tappable(Protocol):
    """What the source taps itself into: the engine (``Engine.tap``)."""

    def tap(self, listener) -> None: ...

    def untap(self, listener) -> None: ...


class LiveSource:
    """The engine's side of the feed (see the module's docstring); on the engine's loop."""

    def __init__(self, engine: Tappable, limit: int) -> None:
        self.engine = engine
        self.limit = limit
        self.boot = uuid.uuid4().hex[:8]
        self.streams = 0  # open in every front end
        self.closing = False
        self.rings: dict[str, deque[LiveEvent]] = {}
        self.minutes: dict[str, Minutes] = {}
        self.sinks: list[Sink] = []
        self.tapped = False
        self.since: float | None = None  # wall time the feed was last tapped
        self._seq = 0
        self._out: list[LiveEvent] = []
        self._used = 0.0  # monotonic: the last stream closed, or the summary was read
        self._untap_timer: asyncio.TimerHandle | None = None

    # --- who listens -------------------------------------------------------------------------

    def reserve(self) -> None:
        """Count one more open stream; 503 past the limit, or while shutting down."""
        if self.closing:
            raise Unavailable.shutting_down()
        if self.streams >= self.limit:
            raise Unavailable(f"{self.limit} live streams are open, the most this server keeps "
                              "(setting max_live_streams); close one or retry later",
                              retry_after_s=5.0)
        self.streams += 1
        metrics.LIVE_STREAMS.set(self.streams)
        self._arm()

    def release(self, n: int = 1) -> None:
        self.streams = max(0, self.streams - n)
        metrics.LIVE_STREAMS.set(self.streams)
        self.touch()

    def touch(self) -> None:
        """A console used the feed now (a summary read, a stream closed): keep it tapped for
        ``LINGER_S`` from now."""
        self._used = time.monotonic()
        self._arm()

    def _arm(self) -> None:
        if not self.tapped:
            self.tapped = True
            self.since = time.time()
            self.engine.tap(self)
            log.info("live results: a console listens; the feed keeps every answer now")
        if self._untap_timer is None:
            self._untap_timer = asyncio.get_running_loop().call_later(LINGER_S, self._idle)

    def _idle(self) -> None:
        self._untap_timer = None
        left = self._used + LINGER_S - time.monotonic()
        if self.streams or left > 0:
            self._untap_timer = asyncio.get_running_loop().call_later(
                max(left, 1.0), self._idle)
            return
        self.tapped = False
        self.engine.untap(self)
        log.info("live results: no console for %.0f s; the feed stops keeping answers",
                 LINGER_S)

    def attach(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def detach(self, sink: Sink) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)

    def close(self) -> None:
        """Shutdown: no new streams; the tap goes."""
        self.closing = True
        if self._untap_timer is not None:
            self._untap_timer.cancel()
            self._untap_timer = None
        if self.tapped:
            self.tapped = False
            self.engine.untap(self)

    # --- what a console reads ----------------------------------------------------------------

    def recent(self, model: str | None, station: str | None,
               last_id: str | None = None) -> list[LiveEvent]:
        """The kept events a new stream with this filter starts with, oldest first: after
        ``last_id`` when it is an id of this run (``Last-Event-ID``), else all that are kept."""
        after = parse_id(last_id)
        start = after[1] if after is not None and after[0] == self.boot else 0
        rings = [self.rings.get(model, ())] if model else list(self.rings.values())
        out = [e for ring in rings for e in ring
               if e.seq > start and (station is None or e.station == station)]
        if len(rings) > 1:
            out.sort(key=lambda e: e.seq)
            out = out[-RING:]
        return out

    def summary(self, model: str, minutes: int) -> dict:
        self.touch()
        agg = self.minutes.get(model) or Minutes()
        return {"model": model, "minutes": agg.summary(minutes, time.time()),
                "since": None if self.since is None else round(self.since, 3)}

    def count_dropped(self, where: str, n: int) -> None:
        metrics.LIVE_DROPPED.labels(where).inc(n)

    # --- the tap (engine's loop) -------------------------------------------------------------

    def watch(self, served, pending: Sequence, origin: tuple | None) -> None:
        rid = current_request_id()
        for item in pending:
            item.future.add_done_callback(partial(self._answered, served, origin, rid, item))

    def refused(self, served, count: int, origin: tuple | None,
                exc: VisionServeError) -> None:
        rid = current_request_id()
        reason = (f"{exc.kind}: {exc.message}",)
        for _ in range(count):
            self._add(served, origin, rid, "REFUSED", None, reason, 0.0, False)

    def _answered(self, served, origin: tuple | None, rid: str | None, item,
                  future: asyncio.Future) -> None:
        latency_ms = (time.monotonic() - item.arrival) * 1000.0
        if future.cancelled():
            self._add(served, origin, rid, "ERROR", None,
                      ("cancelled: the client went away before the answer",), latency_ms, False)
            return
        exc = future.exception()
        if exc is None:
            r = future.result()
            task = served.task
            label = task.summary(r.result)[0] or None
            reasons = task.reasons(r.result)[:MAX_REASONS] if r.verdict == "NG" else ()
            # the record writer, tapped before this feed, has picked the frame (or not) by now
            self._add(served, origin, rid, r.verdict, label, reasons, latency_ms, item.captured)
        elif isinstance(exc, DeadlineExceeded):
            self._add(served, origin, rid, "LATE", None, (exc.message,), latency_ms, False)
        elif isinstance(exc, Unavailable):  # answered 503 (a drain that timed out)
            self._add(served, origin, rid, "REFUSED", None, (f"{exc.kind}: {exc.message}",),
                      latency_ms, False)
        else:
            message = f"{exc.kind}: {exc.message}" if isinstance(exc, VisionServeError) \
                else "internal: internal server error"
            self._add(served, origin, rid, "ERROR", None, (message,), latency_ms, False)

    def _add(self, served, origin: tuple | None, rid: str | None, verdict: str,
             label: str | None, reasons: tuple[str, ...], latency_ms: float,
             captured: bool) -> None:
        part, camera, station = (tuple(origin) + (None,) * 3)[:3] if origin else (None,) * 3
        self._seq += 1
        wall = time.time()
        name = served.name
        event = LiveEvent(self._seq, self.boot, name, str(served.version), station, camera,
                          part, verdict, label, tuple(reasons), latency_ms, wall, rid, captured)
        ring = self.rings.get(name)
        if ring is None:
            ring = self.rings[name] = deque(maxlen=RING)
            self.minutes[name] = Minutes()
        ring.append(event)
        self.minutes[name].add(verdict, latency_ms, wall)
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(event)

    def _flush(self) -> None:
        out, self._out = self._out, []
        for sink in list(self.sinks):
            try:
                sink(out)
            except Exception:  # one sink's bug must not stop the others, nor the loop
                log.exception("live results: a sink failed")


class Outbox:
    """The live events for one front-end process (a sink of the source): sent on its channel at
    once unless the channel is backed up (``backlog()`` bytes unsent over
    ``OUTBOX_BACKLOG_BYTES``); then they wait, at most ``OUTBOX`` of them (the oldest go,
    counted), and are offered again every ``OUTBOX_RETRY_S``. The engine never waits."""

    def __init__(self, send: Callable[[list[LiveEvent]], None], backlog: Callable[[], int],
                 dropped: Callable[[int], None]) -> None:
        self.send = send
        self.backlog = backlog
        self.dropped = dropped
        self._held: deque[LiveEvent] = deque(maxlen=OUTBOX)
        self._retry: asyncio.TimerHandle | None = None

    def __call__(self, events: list[LiveEvent]) -> None:
        held = self._held
        if not held and self.backlog() <= OUTBOX_BACKLOG_BYTES:
            self.send(events)
            return
        over = len(held) + len(events) - OUTBOX
        if over > 0:
            self.dropped(over)
        held.extend(events)
        if self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(OUTBOX_RETRY_S, self._offer)

    def _offer(self) -> None:
        self._retry = None
        if not self._held:
            return
        if self.backlog() > OUTBOX_BACKLOG_BYTES:
            self._retry = asyncio.get_running_loop().call_later(OUTBOX_RETRY_S, self._offer)
            return
        events = list(self._held)
        self._held.clear()
        self.send(events)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._held.clear()


# --- the front-end side --------------------------------------------------------------------------

class LiveStream:
    """One open stream (a browser's ``GET /v1/live``): its filter and its bounded queue.
    :meth:`next` gives what came, at most once in ``STREAM_BATCH_S`` (the first event after a
    quiet spell at once); ``missed`` says how many were dropped since it last gave."""

    def __init__(self, model: str | None, station: str | None, after: int,
                 on_close: Callable[[LiveStream], None]) -> None:
        self.model = model
        self.station = station
        self.after = after  # events up to this seq were replayed: not again
        self.on_close = on_close
        self.queue: deque[LiveEvent] = deque(maxlen=STREAM_QUEUE)
        self.missed = 0  # dropped since the last next()
        self.dropped = 0  # dropped in all
        self.closed = False
        self._wake = asyncio.Event()
        self._gave = -math.inf  # monotonic time next() last gave events

    def offer(self, events: Sequence[LiveEvent]) -> int:
        """Queue the events this stream wants; returns how many old ones went to make room."""
        model, station, queue, after = self.model, self.station, self.queue, self.after
        lost = 0
        for e in events:
            if e.seq > after and (model is None or e.model == model) \
                    and (station is None or e.station == station):
                if len(queue) == STREAM_QUEUE:
                    lost += 1
                queue.append(e)
        if queue:
            self._wake.set()
        if lost:
            self.missed += lost
            self.dropped += lost
        return lost

    async def next(self, timeout_s: float) -> tuple[list[LiveEvent], int] | None:
        """(events, how many were dropped before them) once there are some, ([], 0) after
        ``timeout_s`` without any, None once the stream is closed (server shutdown)."""
        if not self.queue and not self.closed:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout_s)
            except TimeoutError:
                pass
        if self.queue and not self.closed:  # what comes in the rest of the batch goes along
            rest = self._gave + STREAM_BATCH_S - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
        if self.closed and not self.queue:
            return None
        if self.queue:
            self._gave = time.monotonic()
        events = list(self.queue)
        self.queue.clear()
        missed, self.missed = self.missed, 0
        return events, missed

    def end(self) -> None:
        """Shutdown: what is queued is still given, then :meth:`next` says the end."""
        self.closed = True
        self._wake.set()

    def close(self) -> None:
        """The stream's response is over (the browser left, or the end was sent)."""
        self.end()
        on_close, self.on_close = self.on_close, _nothing
        on_close(self)


def _nothing(_stream: LiveStream) -> None:
    pass


class LiveStreams:
    """A process's open streams: the sink its events are delivered to."""

    def __init__(self, dropped: Callable[[int], None]) -> None:
        self.open: set[LiveStream] = set()
        self.dropped = dropped  # counts what slow streams lost (in the engine's metrics)
        self.closing = False

    def add(self, model: str | None, station: str | None, replay: Sequence[LiveEvent],
            on_close: Callable[[LiveStream], None]) -> LiveStream:
        stream = LiveStream(model, station, replay[-1].seq if replay else 0, on_close)
        self.open.add(stream)
        return stream

    def remove(self, stream: LiveStream) -> None:
        self.open.discard(stream)

    def __call__(self, events: list[LiveEvent]) -> None:
        lost = 0
        for stream in self.open:
            lost += stream.offer(events)
        if lost:
            self.dropped(lost)

    def shut(self) -> None:
        """Shutdown: every stream ends (after what it has queued); no new one opens."""
        self.closing = True
        for stream in list(self.open):
            stream.end()


class LiveFeed(Protocol):
    """What the HTTP front end's live routes call: the feed of its process
    (``DataPlane.feed``)."""

    async def open(self, model: str | None, station: str | None, last_id: str | None
                   ) -> tuple[list[LiveEvent], LiveStream]:
        """The kept events to replay and the stream of the ones to come; 503 (Unavailable)
        past ``max_live_streams`` or while shutting down. Close the stream when done."""
        ...

    async def summary(self, model: str, minutes: int) -> dict:
        """``{"model", "minutes": [per-minute rows], "since"}``: :meth:`LiveSource.summary`."""
        ...

    def shut(self) -> None:
        """Shutdown: end every stream, open no new one."""
        ...


class LocalFeed:
    """The feed of the serving process: its streams fed by the engine's source directly."""

    def __init__(self, source: LiveSource) -> None:
        self.source = source
        self.streams = LiveStreams(partial(source.count_dropped, "stream"))
        source.attach(self.streams)

    async def open(self, model: str | None, station: str | None, last_id: str | None
                   ) -> tuple[list[LiveEvent], LiveStream]:
        if self.streams.closing:
            raise Unavailable.shutting_down()
        self.source.reserve()
        replay = self.source.recent(model, station, last_id)
        return replay, self.streams.add(model, station, replay, self._closed)

    def _closed(self, stream: LiveStream) -> None:
        self.streams.remove(stream)
        self.source.release()

    async def summary(self, model: str, minutes: int) -> dict:
        return self.source.summary(model, minutes)

    def shut(self) -> None:
        self.streams.shut()

