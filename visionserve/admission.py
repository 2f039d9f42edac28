"""Admission: how a request's frames get into a served version's batcher, and how its answer
comes back, counted and recorded once.

``Admission.submit`` checks the request (the server serving, the version ready, the frame count,
deadline and priority in range, room in the queue for frames the load ahead would answer in
time), queues its frames and returns one future for the whole request, set from the frames'
futures by callbacks (no task per request). ``precheck`` runs the same checks from a request's
head, before its body is read. Every frame's final answer, refused ones too, goes to the taps
(``ResultTap``: the PLC result bus, the traceability records) when any listen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from . import enginestats
from .errors import InvalidInput, Unavailable, VisionServeError
from .imaging import Frame
from .latency import LatencyWindow
from .served import Served

MAX_DEADLINE_MS = 3_600_000.0


@dataclass
class Gate:
    """Whether the engine admits frames: once started, and until it drains."""

    started: bool = False
    draining: bool = False


class ResultTap(Protocol):
    """What hears every frame's final answer (``Engine.tap``); called on the engine's loop.
    ``origin``: a :class:`~visionserve.dataplane.Origin`, or a plain tuple of its first fields."""

    def watch(self, served, pending: Sequence, origin: tuple | None) -> None: ...

    def refused(self, served, count: int, origin: tuple | None,
                exc: VisionServeError) -> None: ...


class _Tee:
    """Several taps as one."""

    def __init__(self, taps: tuple[ResultTap, ...]) -> None:
        self.taps = taps

    def watch(self, served, pending: Sequence, origin: tuple | None) -> None:
        for t in self.taps:
            t.watch(served, pending, origin)

    def refused(self, served, count: int, origin: tuple | None,
                exc: VisionServeError) -> None:
        for t in self.taps:
            t.refused(served, count, origin, exc)


class Admission:
    """The frames' way in (see the module's docstring). ``count_error`` counts a request
    answered with an error (``Engine.count_error``)."""

    def __init__(self, gate: Gate,
                 count_error: Callable[[str, VisionServeError | str, int], None]) -> None:
        self.gate = gate
        self.count_error = count_error
        # the last second's answers, kept only when someone reads them (the guard's latency budget)
        self.latency: LatencyWindow | None = None
        # who hears every frame's final answer (verdict, LATE, error), whichever front end asked:
        # the PLC result bus (visionserve.plc.bus.ResultBus) while a PLC server runs, the
        # traceability records (visionserve.records) while they are on; see ``tap``
        self.results: ResultTap | None = None
        self._taps: list[ResultTap] = []

    def submit(self, served: Served, frames: list[Frame], deadline_ms: float | None,
               priority: int | None, arrival: float, origin: tuple | None) -> asyncio.Future:
        """Queue a request's frames: a future of ``(served, results in frame order)``, or of the
        request's VisionServeError (any other error: a bug, the front end answers 500).

        The answer is counted and recorded here, once, whoever waits for it. Cancelling the
        future drops the frames not yet run, uncounted (the one who cancelled answers, and
        counts, the request)."""
        answer = asyncio.get_running_loop().create_future()
        try:
            pending = self.admit(served, frames, deadline_ms, priority, arrival, origin)
        except VisionServeError as exc:
            self.count_error(served.name, exc, len(frames))
            # a refusal needs no traceback, and this one would keep the frames (this function's)
            # and the answer that holds it in a cycle until the collector runs; with
            # zero-copy mode the frames are arena space the front end cannot reuse
            answer.set_exception(exc.with_traceback(None))
            return answer
        except Exception:  # a bug: the front end answers 500
            self.count_error(served.name, "internal", len(frames))
            raise
        futures = [p.future for p in pending]
        done = futures[0] if len(futures) == 1 else asyncio.gather(*futures)

        def answered(f: asyncio.Future) -> None:
            # a gather whose frames were cancelled holds a CancelledError as its exception
            cancelled = f.cancelled() or isinstance(f.exception(), asyncio.CancelledError)
            exc = None if cancelled else f.exception()
            if cancelled or exc is not None:
                for other in futures:  # one frame failed: the request failed, drop the rest
                    other.cancel()
                served.batcher.wake()  # the queue lets them go now
            if answer.done():  # cancelled by the one waiting
                return
            if cancelled:
                answer.cancel()
            elif exc is not None:
                self.count_error(served.name,
                                 exc if isinstance(exc, VisionServeError) else "internal",
                                 len(futures))
                answer.set_exception(exc)
            else:
                results = [f.result()] if len(futures) == 1 else f.result()
                answer.set_result((served, enginestats.finish(served, results, arrival)))

        def abandoned(a: asyncio.Future) -> None:
            if a.cancelled():
                done.cancel()
                # the queue lets the frames go now, not when it next forms a batch (with
                # zero-copy mode a frame held is arena space the front end cannot reuse)
                served.batcher.wake()

        done.add_done_callback(answered)
        answer.add_done_callback(abandoned)
        return answer

    def admit(self, served: Served, frames: list[Frame], deadline_ms: float | None,
              priority: int | None, arrival: float, origin: tuple | None = None) -> list:
        """``_admit``, and each frame's final answer to the taps when any listen (refused frames
        too: the PLC must hear "no decision"). ``origin``: where they come from (``Origin``)."""
        if self.results is None:
            return self._admit(served, frames, deadline_ms, priority, arrival)
        try:
            pending = self._admit(served, frames, deadline_ms, priority, arrival)
        except VisionServeError as exc:
            self.results.refused(served, len(frames), origin, exc)
            raise
        self.results.watch(served, pending, origin)
        return pending

    def refuse(self, served: Served, n: int, origin: tuple | None,
               exc: VisionServeError) -> None:
        """``n`` frames that never came (a camera gave none): counted as an answer with ``exc``
        and told to the taps, as a refusal at admission is, so the PLC hears "no decision"."""
        self.count_error(served.name, exc, n)
        exc.counted = True
        if self.results is not None:
            self.results.refused(served, n, origin, exc)

    def precheck(self, served: Served, n: int, deadline_ms: float | None, priority: int | None,
                 arrival: float, origin: tuple | None = None) -> None:
        """Admission from a request's head, before its body is read: raise (counted, and told to
        the PLC bus) what ``admit`` would raise for ``n`` frames now, the 503 of an overloaded
        model above all. Under overload most requests end here, so a refusal costs the server
        no body read, no image check and no copy; what passes is checked again by ``admit``."""
        try:
            self.check(served, n, deadline_ms, priority, arrival)
        except VisionServeError as exc:
            self.count_error(served.name, exc, n)
            if self.results is not None:
                self.results.refused(served, n, origin, exc)
            raise

    def check(self, served: Served, n: int, deadline_ms: float | None, priority: int | None,
              arrival: float) -> tuple[float, int, float]:
        """(deadline, priority, predicted seconds to the answer) of ``n`` frames that may be
        queued now; raises a VisionServeError for a request that may not."""
        b = served.config.batching
        if self.gate.draining:
            raise Unavailable.shutting_down()
        if not self.gate.started or not served.ready:
            raise Unavailable(f"model {served.name} is not ready")
        if not n:
            raise InvalidInput("the request holds no frame")
        if n > b.max_queue_size:
            raise InvalidInput(f"{n} frames in one request; at most {b.max_queue_size}")
        if deadline_ms is None:
            deadline_ms = b.takt_ms
        if not (0 < deadline_ms <= MAX_DEADLINE_MS):
            raise InvalidInput(f"deadline {deadline_ms!r} ms is out of range (0, "
                               f"{MAX_DEADLINE_MS:.0f}]")
        if priority is None:
            priority = b.priority_levels // 2
        if not (0 <= priority < b.priority_levels):
            raise InvalidInput(f"priority {priority!r} is out of range 0..{b.priority_levels - 1}")
        deadline = arrival + deadline_ms / 1000.0
        # 503 at once for a full queue, or for frames the load ahead would answer too late
        predicted = served.batcher.check_capacity(n, deadline=deadline, priority=priority)
        return deadline, priority, predicted

    def _admit(self, served: Served, frames: list[Frame], deadline_ms: float | None,
               priority: int | None, arrival: float) -> list:
        """Check the request and queue its frames; the answers come on the returned items'
        futures (``submit`` records them). Raises a VisionServeError for the whole request."""
        deadline, priority, predicted = self.check(served, len(frames), deadline_ms, priority,
                                                   arrival)
        batcher = served.batcher
        pending = []
        try:
            for f in frames:
                pending.append(batcher.submit(f, deadline=deadline, priority=priority,
                                              arrival=arrival, predicted=predicted))
        except BaseException:
            for p in pending:
                p.future.cancel()
            raise
        if self.latency is not None:
            self.latency.track(pending)  # answered and LATE frames alike, whichever front end waits
        return pending

    # --- who hears the answers ---------------------------------------------------------------

    def tap(self, listener: ResultTap) -> None:
        """Hand every frame's final answer to ``listener`` from now on (its ``watch`` for admitted
        frames, ``refused`` for frames refused at admission), on the event loop: it must never
        wait. With none, an answer costs nothing more; with one, one call."""
        self._taps.append(listener)
        self._set_results()

    def untap(self, listener: ResultTap) -> None:
        if listener in self._taps:
            self._taps.remove(listener)
        self._set_results()

    def _set_results(self) -> None:
        taps = tuple(self._taps)
        self.results = None if not taps else taps[0] if len(taps) == 1 else _Tee(taps)

    def latency_p99(self) -> Callable[[], float | None]:
        """Start keeping the last second's latencies; returns the function that reads their p99."""
        if self.latency is None:
            self.latency = LatencyWindow()
        return self.latency.p99

