"""The served latency of the last second, for the training-queue guard's latency budget.

The engine hands every admitted frame to :meth:`LatencyWindow.track`; once the frame is answered
its arrival-to-answer time joins the window (event loop thread), and the guard's watchdog thread
asks for the p99. A frame answered LATE (its deadline passed in the queue, during decode or
while its batch computed) counts too, at its time to that answer and at least its deadline
budget: under contention the late frames are exactly the ones that matter, and leaving them out
would read "no p99" and resume training when the line misses its deadlines. A lock keeps the
two threads apart: an append costs well under a microsecond, a p99 of a second's frames a fraction
of a millisecond at 10 Hz.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from functools import partial

from .errors import DeadlineExceeded

#: fewer frames than this in the window: no p99 (a quiet line must not pause training)
MIN_FRAMES = 20


class LatencyWindow:
    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds
        self._items: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, ms: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._items.append((now, ms))
            self._trim(now)

    def track(self, items) -> None:
        """Count each queued frame (``Pending``: future, arrival, deadline) once it is answered.
        Cancelled frames (the client left) and other errors are not answered frames."""
        for item in items:
            item.future.add_done_callback(partial(self._answered, item.arrival, item.deadline))

    def _answered(self, arrival: float, deadline: float, future) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            self.add(future.result().total_ms)
        elif isinstance(exc, DeadlineExceeded):
            now = time.monotonic()
            self.add((max(now, deadline) - arrival) * 1000, now)

    def p99(self, now: float | None = None) -> float | None:
        """The 99th percentile (ms) of the frames answered in the last ``seconds``, or None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            values = sorted(ms for _, ms in self._items)
        if len(values) < MIN_FRAMES:
            return None
        return values[min(len(values) - 1, int(0.99 * len(values)))]

    def _trim(self, now: float) -> None:
        items, oldest = self._items, now - self.seconds
        while items and items[0][0] < oldest:
            items.popleft()
