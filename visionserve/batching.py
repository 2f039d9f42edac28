"""The dynamic batcher: one per served model version, and nothing else.

Requests wait in a bounded priority queue; a batch is formed when

* it is full (``max_batch_size``), or
* the first queued request has waited ``max_queue_delay`` (the clock starts at the first request
  of the batch, on ``time.monotonic()``), or
* waiting any longer would make the earliest deadline in the queue miss, estimated from measured
  batch times (:class:`CostModel`),
* or, with ``dispatch_when_idle``, nothing is running: then waiting only adds latency,

and only when an executor slot is free: while the runner is busy, requests keep joining the next
batch instead of forming small ones that would just wait. Higher priorities go first, then
earlier deadlines, then arrival order. Requests whose deadline has passed are answered at once
with :class:`~visionserve.errors.DeadlineExceeded` and never cost compute; cancelled ones (the
client went away) are dropped.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import DeadlineExceeded, InternalError, Unavailable, VisionServeError
from .logs import batch_ids, request_id

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Pending:
    """One queued item (a frame) and the future its caller awaits."""

    payload: Any
    future: asyncio.Future
    arrival: float
    deadline: float
    priority: int = 0
    seq: int = 0
    dispatched: float = 0.0
    extra: dict = field(default_factory=dict)
    #: the id of the request it belongs to, for log lines about its batch (runner threads)
    request_id: str = field(default_factory=request_id.get)

    def sort_key(self) -> tuple[int, float, int]:
        return (-self.priority, self.deadline, self.seq)

    def __lt__(self, other: Pending) -> bool:
        return self.sort_key() < other.sort_key()


def resolve(future: asyncio.Future, value: Any = None, exc: BaseException | None = None) -> None:
    """Set a result only if nobody cancelled or answered the future already."""
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


class CostModel:
    """Measured time from dispatch to answers, per (padded) batch size, as a moving average."""

    def __init__(self, padded_size: Callable[[int], int], alpha: float = 0.2) -> None:
        self._padded = padded_size
        self._alpha = alpha
        self._seconds: dict[int, float] = {}

    def observe(self, batch_size: int, seconds: float) -> None:
        p = self._padded(batch_size)
        old = self._seconds.get(p)
        self._seconds[p] = seconds if old is None else old + self._alpha * (seconds - old)

    def estimate(self, batch_size: int) -> float:
        if not self._seconds:
            return 0.0
        p = self._padded(max(1, batch_size))
        if p in self._seconds:
            return self._seconds[p]
        # nearest measured size, scaled linearly: pessimistic for larger batches, which is safe
        q = min(self._seconds, key=lambda s: abs(s - p))
        return self._seconds[q] * max(1.0, p / q)

    def snapshot(self) -> dict[int, float]:
        return dict(sorted(self._seconds.items()))


class Batcher:
    """Collects :class:`Pending` items into batches and hands each to ``execute``.

    ``execute(batch)`` must answer every item's future (or leave it to be failed here if it
    raises) and return when the batch's slot can be reused.
    """

    def __init__(
        self,
        *,
        name: str,
        execute: Callable[[list[Pending]], Awaitable[None]],
        max_batch_size: int,
        max_queue_delay_s: float,
        max_queue_size: int,
        cost: CostModel,
        max_inflight: int = 2,
        dispatch_when_idle: bool = False,
        safety_s: float = 0.005,
    ) -> None:
        if max_batch_size < 1 or max_queue_size < 1 or max_inflight < 1 or max_queue_delay_s < 0:
            raise ValueError("batcher sizes must be >= 1 and the delay >= 0")
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self.cost = cost
        self._execute = execute
        self.dispatch_when_idle = dispatch_when_idle
        self._safety = safety_s
        self._heap: list[Pending] = []
        self._seq = itertools.count()
        self._slots = asyncio.Semaphore(max_inflight)
        self._wakeup = asyncio.Event()
        self._tasks: dict[asyncio.Task, list[Pending]] = {}  # running batches
        self._loop_task: asyncio.Task | None = None
        self._accepting = True
        self.on_drop: Callable[[Pending, str], None] = lambda item, reason: None

    # --- caller side -------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=f"batcher:{self.name}")

    @property
    def queue_depth(self) -> int:
        return sum(1 for p in self._heap if not p.future.done())

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    def submit(self, payload: Any, *, deadline: float, priority: int = 0,
               arrival: float | None = None) -> Pending:
        """Queue one item; await ``pending.future`` for its answer."""
        self.check_capacity(1)
        now = time.monotonic()
        item = Pending(payload, asyncio.get_running_loop().create_future(),
                       now if arrival is None else arrival, deadline, priority, next(self._seq))
        heapq.heappush(self._heap, item)
        self._wakeup.set()
        return item

    def check_capacity(self, n: int) -> None:
        """Raise 503 (with a Retry-After estimate) unless ``n`` more items fit in the queue."""
        if not self._accepting:
            raise Unavailable.shutting_down()
        if len(self._heap) + n > self.max_queue_size:
            self._purge()
            if len(self._heap) + n > self.max_queue_size:
                wait = max(0.05, self.cost.estimate(self.max_batch_size)) * (
                    1 + len(self._heap) / self.max_batch_size)
                raise Unavailable(
                    f"model {self.name} is overloaded: {len(self._heap)} frames queued "
                    f"(max_queue_size {self.max_queue_size})", retry_after_s=round(wait, 3))

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new items, let queued and running ones finish; True if all did in time."""
        self._accepting = False
        self._wakeup.set()
        end = time.monotonic() + timeout_s
        while (self._heap or self._tasks) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        done = not self._heap and not self._tasks
        await self.close()
        return done

    async def close(self) -> None:
        """Stop the loop; whatever is still queued or running is answered 503.

        Running frames too: after a drain timeout the process is about to exit, and a clean 503
        beats a connection cut when uvicorn gives up on the request. A result the runner still
        produces later is ignored (futures are answered once)."""
        self._accepting = False
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        while self._heap:
            item = heapq.heappop(self._heap)
            resolve(item.future, exc=Unavailable("the server shut down before this frame ran"))
        for batch in list(self._tasks.values()):
            for item in batch:
                resolve(item.future, exc=Unavailable("the server shut down before this frame finished"))

    # --- batching loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._acquire_slot()
            try:
                batch = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._dispatch(batch))
            self._tasks[task] = batch
            task.add_done_callback(self._task_done)

    async def _acquire_slot(self) -> None:
        """Wait for a free executor slot. Meanwhile keep answering requests whose deadline passes:
        a busy runner must not hold a late answer back until it is done."""
        while self._slots.locked():
            self._purge()
            expiry = min((p.deadline for p in self._heap), default=None)
            timeout = None if expiry is None else max(0.0, expiry - time.monotonic())
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=timeout)
            except (asyncio.TimeoutError, TimeoutError):
                pass
        await self._slots.acquire()  # free: returns at once

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)
        self._slots.release()
        self._wakeup.set()  # a slot is free: wake the loop if it waits in _acquire_slot
        if not task.cancelled() and task.exception() is not None:
            log.error("batch execution failed in %s", self.name, exc_info=task.exception())

    async def _dispatch(self, batch: list[Pending]) -> None:
        try:
            await self._execute(batch)
        except VisionServeError as exc:
            for item in batch:
                resolve(item.future, exc=exc)
        except Exception:
            log.exception("model %s failed on a batch of %d", self.name, len(batch), extra=batch_ids(batch))
            for item in batch:
                resolve(item.future, exc=InternalError("the model failed on this batch; see the server log"))

    async def _next_batch(self) -> list[Pending]:
        while True:
            self._purge()
            if not self._heap:
                if not self._accepting:
                    await asyncio.sleep(3600)  # drained: idle until closed
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            n = len(self._heap)
            if n >= self.max_batch_size or not self._accepting:
                break
            if self.dispatch_when_idle and not self._tasks:
                break  # nothing running: waiting for company would only add latency
            now = time.monotonic()
            first_arrival = min(p.arrival for p in self._heap)
            earliest_deadline = min(p.deadline for p in self._heap)
            due = first_arrival + self.max_queue_delay_s
            # latest start that still answers the most urgent request in time. The safety margin
            # covers what the cost model cannot see: the loop waking up late on a busy CPU, and
            # decoding (the model is seeded with backend-only times at warm-up). With 1 ms, a lone
            # request on an idle but loaded box woke up past its deadline and was answered LATE.
            latest = earliest_deadline - self.cost.estimate(min(n + 1, self.max_batch_size)) - self._safety
            wait = min(due, latest) - now
            if wait <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=wait)
            except (asyncio.TimeoutError, TimeoutError):
                pass
        batch: list[Pending] = []
        now = time.monotonic()
        while self._heap and len(batch) < self.max_batch_size:
            item = heapq.heappop(self._heap)
            if item.future.done():
                continue
            if item.deadline <= now:
                self._late(item, now)
                continue
            item.dispatched = now
            batch.append(item)
        return batch

    def _purge(self) -> None:
        """Drop cancelled items; answer expired ones as late right away."""
        if not self._heap:
            return
        now = time.monotonic()
        keep = []
        for item in self._heap:
            if item.future.done():
                self.on_drop(item, "cancelled")
            elif item.deadline <= now:
                self._late(item, now)
            else:
                keep.append(item)
        if len(keep) != len(self._heap):
            heapq.heapify(keep)
            self._heap = keep

    def _late(self, item: Pending, now: float) -> None:
        self.on_drop(item, "late")
        waited = (now - item.arrival) * 1000
        resolve(item.future, exc=DeadlineExceeded(
            f"deadline passed after {waited:.1f} ms in the queue; the frame was not run"))
