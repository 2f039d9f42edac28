"""The verdict preview: each model's last answered frames, kept with their outputs, and what a
change of the model's ``[verdict]`` would make of them (``POST /v1/models/{m}/verdict/preview``).

:class:`Ring` is a tap of the engine (``Engine.tap``, as the records and the PLC result bus are):
for each admitted frame it adds one callback to the frame's future, which appends the answer
(ids, time, verdict, the task's result: never the image) to the model's bounded deque
(``--preview-frames``; the oldest falls out). Only answered frames are kept: a refused, failed
or cancelled frame has no outputs to judge again. Everything runs on the engine's loop; the
preview takes a copy of the deque there and judges it in a worker thread
(:func:`judge_again`, each task's ``Task.rejudge``). Nothing is written: the answer says which
frames would flip, and how many could not be judged again and why.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from .config import ModelConfig
from .logs import request_id
from .tasks.base import Task, Unjudgeable


@dataclass(frozen=True, slots=True)
class Kept:
    """One answered frame, as the preview keeps it."""

    time: float  #: wall clock (seconds since the epoch) when the frame arrived
    request_id: str | None
    part_id: str | None
    frame_index: int  #: the frame's place in its request
    version: str
    verdict: str
    result: Any  #: the task's result (scores, detections, anomaly score and regions)
    task: Task  #: the task that judged it
    judged: ModelConfig  #: the settings it was judged under


class Ring:
    """The last ``frames`` answered frames of each model (a ResultTap)."""

    def __init__(self, frames: int) -> None:
        self.frames = frames
        self._rings: dict[str, deque[Kept]] = {}

    def watch(self, served, pending: Sequence, origin: tuple | None) -> None:
        ring = self._rings.get(served.name)
        if ring is None:
            ring = self._rings[served.name] = deque(maxlen=self.frames)
        rid = request_id.get()
        part = origin[0] if origin else None
        for i, item in enumerate(pending):
            item.future.add_done_callback(partial(self._answered, ring, served, part,
                                                  None if rid == "-" else rid, i, item.arrival))

    def refused(self, served, count: int, origin: tuple | None, exc) -> None:
        """A refused frame has no outputs to judge again."""

    @staticmethod
    def _answered(ring: deque, served, part: str | None, rid: str | None, index: int,
                  arrival: float, future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        r = future.result()
        task = served.task
        ring.append(Kept(time.time() - (time.monotonic() - arrival), rid, part, index,
                         str(served.version), r.verdict, r.result, task, task.config))

    def kept(self, name: str) -> list[Kept]:
        """Model ``name``'s kept frames, oldest first (a copy: call it on the engine's loop)."""
        return list(self._rings.get(name, ()))


def judge_again(frames: Sequence[Kept], config: ModelConfig) -> dict[str, Any]:
    """What ``config`` (validated, the model's new settings) makes of ``frames``: how many there
    are, which would change verdict (newest first), and how many could not be judged again and
    why."""
    changed = []
    unavailable = 0
    why: dict[str, None] = {}
    for k in reversed(frames):
        try:
            new = k.task.rejudge(k.result, k.judged, config)
        except Unjudgeable as exc:
            unavailable += 1
            why[str(exc)] = None
            continue
        if new != k.verdict:
            changed.append({"request_id": k.request_id, "part_id": k.part_id,
                            "frame_index": k.frame_index, "version": k.version,
                            "old": k.verdict, "new": new, "timestamp": k.time,
                            "time": dt.datetime.fromtimestamp(k.time, dt.timezone.utc)
                            .isoformat(timespec="milliseconds").replace("+00:00", "Z")})
    return {"frames": len(frames), "changed": len(changed), "frames_changed": changed,
            "unavailable": unavailable, "why": "; ".join(why) or None}
