"""The served latency of the last second, for the training-queue guard's latency budget.

The engine adds every answered frame's arrival-to-answer time (event loop thread); the guard's
watchdog thread asks for the p99. A lock keeps the two apart: an append costs well under a
microsecond, a p99 of a second's frames a fraction of a millisecond at 10 Hz.
"""

from __future__ import annotations

import threading
import time
from collections import deque

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
