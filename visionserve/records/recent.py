"""The recent frames that the capture policy did not keep, in memory, newest up to a size
(``--capture-recent``), so that an operator who flags a part seconds or minutes later (an OK that
was wrong: an escape, which a sample of 1 % would almost never have kept) still captures its
frame (``POST /v1/records/{id}/flag``; the record's ``kept_for`` is then ``flagged``).

A frame is found again by what its record keeps: the model, the request id, the frame's index in
its request, the part id and its arrival time (PostgreSQL keeps microseconds: within
:data:`SAME_TIME_S`). Request ids repeat (tritonclient sends the same one every time): where two
kept frames fit one record, neither is taken. A record never gets another frame's image.
:meth:`RecentFrames.add` runs on the engine's loop for each answered frame not captured (a lock,
an append, and evictions past the size); :meth:`RecentFrames.take` in the thread that captures
it. A frame is taken once: its image is then the record's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from .. import imaging

#: two arrival times of the same frame as two stores keep them (seconds: a PostgreSQL
#: timestamp's microsecond)
SAME_TIME_S = 2e-6


@dataclass(frozen=True, slots=True)
class Recent:
    """One answered frame kept in memory: its arrival (wall clock), its part id, the frame, the
    task of the model version that answered it and its result (what the image's sidecar draws;
    the task, not the version: a version unloaded meanwhile is not kept alive)."""

    time: float
    part_id: str | None
    frame: imaging.Frame
    task: Any
    result: Any


def frame_bytes(frame: imaging.Frame) -> int:
    data = frame.data
    return int(data.nbytes) if hasattr(data, "nbytes") else len(data)


class RecentFrames:
    """The newest frames up to ``max_bytes`` (their encoded or raw bytes), by their record's
    (model, request id, frame index, time)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._lock = threading.Lock()
        self._serial = 0
        #: serial -> (key, Recent), oldest first
        self._order: OrderedDict[int, tuple[tuple, Recent]] = OrderedDict()
        #: key -> serials of its frames, oldest first (ids repeat: a client's fixed request id)
        self._by_key: dict[tuple, deque[int]] = {}

    def __len__(self) -> int:
        return len(self._order)

    def add(self, model: str, request_id: str | None, index: int, recent: Recent) -> None:
        """Keep ``recent`` (its frame's bytes must be its own, :func:`imaging.owned`); the oldest
        go past ``max_bytes``. A frame larger than all of it is not kept."""
        n = frame_bytes(recent.frame)
        if n > self.max_bytes:
            return
        key = (model, request_id, index)
        with self._lock:
            self._serial += 1
            self._order[self._serial] = (key, recent)
            self._by_key.setdefault(key, deque()).append(self._serial)
            self.size += n
            while self.size > self.max_bytes:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (key, old) = self._order.popitem(last=False)
        self.size -= frame_bytes(old.frame)
        serials = self._by_key[key]
        serials.popleft()  # the oldest of its key: at the front (take() removes others)
        if not serials:
            del self._by_key[key]

    def take(self, model: str, request_id: str | None, index: int, part_id: str | None,
             time: float) -> Recent | None:
        """The frame of that record, now no longer kept here; None where it is gone (or was
        never kept), or where two kept frames fit it."""
        key = (model, request_id, index)
        with self._lock:
            fits = [serial for serial in self._by_key.get(key, ())
                    if self._order[serial][1].part_id == part_id
                    and abs(self._order[serial][1].time - time) <= SAME_TIME_S]
            if len(fits) != 1:
                return None
            recent = self._order.pop(fits[0])[1]
            self._by_key[key].remove(fits[0])
            if not self._by_key[key]:
                del self._by_key[key]
            self.size -= frame_bytes(recent.frame)
            return recent
