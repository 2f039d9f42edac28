"""The dynamic batcher: one per served model version, and nothing else.

Requests wait in a bounded priority queue; a batch is formed when

* it is full (``max_batch_size``), or
* the first queued request has waited ``max_queue_delay`` (the clock starts at the first request
  of the batch, on ``time.monotonic()``), or
* waiting any longer would make the earliest deadline in the queue miss, estimated from measured
  batch times (:class:`CostModel`),
* or, with ``dispatch_when_idle``, nothing is running: then waiting only adds latency,

and only when an executor slot is free: while the runner is busy, requests keep joining the next
batch instead of forming small ones that would just wait. ``full_extra`` slots beyond
``max_inflight`` take full batches only: an executor whose next batch must travel (a worker
process) gets it before it is idle, and under a closed loop of clients batches do not shrink to
fill the extra slots. Higher priorities go first, then
earlier deadlines, then arrival order. Requests whose deadline has passed are answered at once
with :class:`~visionserve.errors.DeadlineExceeded` and never cost compute; cancelled ones (the
client went away) are dropped.

Admission (:meth:`Batcher.check_capacity`) refuses at once (503 + Retry-After) a request that
the load ahead of it would make miss its deadline: the frames queued ahead of it and the batches
running, costed with the measured time each batch size takes of the server. Under overload the
queue stays as long as the deadline allows and no longer, so what is admitted is answered in time
instead of every frame finishing just late.

If the batching loop itself ever dies (a bug), :attr:`Batcher.alive` turns false, the model is
reported not ready, the failure is logged and every queued request is answered 503 at once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import DeadlineExceeded, InternalError, Unavailable, VisionServeError
from .logs import batch_ids, request_id

log = logging.getLogger(__name__)

#: A batcher's state, as its loop reports it: no frames, frames waiting, a batch running.
IDLE, QUEUED, RUNNING = 0, 1, 2
#: ``observer(batcher, state)``: called by each batcher's loop on the event loop thread whenever it
#: looks for its next batch, with the state above; it keeps only what changed. The server
#: installs the guard's busy word here (:func:`visionserve.guard.share.note`), so that guard jobs
#: yield the GPU while a batch runs.
StateObserver = Callable[["Batcher", int], None]
_observer: StateObserver | None = None


def observe_states(observer: StateObserver | None) -> None:
    """Install the batchers' state observer (None: none; the loop then only reads the name)."""
    global _observer
    _observer = observer


#: the quantile of (answer time / admission's prediction) that admission scales predictions by.
#: Under sustained overload every admitted frame is admitted at the edge, so about 1 - q of them
#: end late, each after costing the server its compute. At 3x capacity on the CPU machine (three
#: 6 s rounds, docs/benchmarks.md): 622 admitted frames ended late at 0.9, 120-178 at 0.98, 0-6 at
#: 0.995. The queue is a little shorter for it, which costs nothing while it never runs dry; the
#: margin comes down more slowly after a slow spell (about 5,500 answers from 4x to 1x).
MARGIN_QUANTILE = 0.995


@dataclass(eq=False, slots=True)
class Pending:
    """One queued item (a frame) and the future its caller awaits."""

    payload: Any
    future: asyncio.Future
    arrival: float
    deadline: float
    priority: int = 0
    seq: int = 0
    admitted: float = 0.0
    # seconds from ``admitted`` to the answer, as admission predicted (0: none)
    predicted: float = 0.0
    dispatched: float = 0.0
    #: the id of the request it belongs to, for log lines about its batch (runner threads)
    request_id: str = field(default_factory=request_id.get)
    #: the record writer picked the frame's image for capture (the live feed says so)
    captured: bool = False

    def sort_key(self) -> tuple[int, float, int]:
        return (-self.priority, self.deadline, self.seq)

    def __lt__(self, other: Pending) -> bool:
        # sort_key's order without its two tuples: the event loop compares some 14 times per
        # frame it queues and takes out (about 110 ns here against 230)
        if self.priority != other.priority:
            return self.priority > other.priority
        if self.deadline != other.deadline:
            return self.deadline < other.deadline
        return self.seq < other.seq


def resolve(future: asyncio.Future, value: Any = None, exc: BaseException | None = None) -> None:
    """Set a result only if nobody cancelled or answered the future already."""
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


class CostModel:
    """Measured batch times, as moving averages:

    * latency per (padded) batch size (:meth:`observe`, :meth:`estimate`): from dispatch to
      answers, what one batch takes;
    * the server's time per frame (:meth:`observe_interval`, :meth:`per_frame`): how long the
      server was busy with each batch, over its frames. Less than the latency when batches overlap
      (decode of one while another computes, several instances); queued work is costed with it.
      One figure over the recent batches whatever their sizes, rather than one per size: sizes
      seen rarely would be costed from a stale sample. :meth:`typical_batch` goes with it.

    The runner threads write, the event loop reads. A write replaces the table by an updated copy
    (under a lock, so concurrent writers lose nothing) and a reader takes the table once: nobody
    iterates a dict that another thread is changing. (Iterating the live dict while a compute
    thread inserted a new batch size raised "dictionary changed size during iteration" in the
    batcher loop.)
    """

    def __init__(self, padded_size: Callable[[int], int], alpha: float = 0.2) -> None:
        self._padded = padded_size
        self._alpha = alpha
        self._lock = threading.Lock()
        self._seconds: dict[int, float] = {}
        # moving averages: (busy seconds, frames) per batch
        self._busy: tuple[float, float] | None = None

    def observe(self, batch_size: int, seconds: float) -> None:
        with self._lock:
            self._seconds = self._averaged(self._seconds, batch_size, seconds)

    def observe_interval(self, batch_size: int, seconds: float) -> None:
        with self._lock:
            old, a = self._busy, self._alpha
            self._busy = (seconds, float(batch_size)) if old is None else (
                old[0] + a * (seconds - old[0]), old[1] + a * (batch_size - old[1]))

    def estimate(self, batch_size: int) -> float:
        """Seconds from dispatch to answers for a batch of ``batch_size`` (0.0: nothing
        measured)."""
        return self._lookup(self._seconds, batch_size)

    def per_frame(self) -> float | None:
        """Seconds of the server's time one frame costs in the recent batches (None: none yet)."""
        busy = self._busy
        return busy[0] / busy[1] if busy else None

    def typical_batch(self) -> float | None:
        """Frames in the recent batches, on average (None: none yet)."""
        busy = self._busy
        return busy[1] if busy else None

    def _averaged(self, table: dict[int, float], batch_size: int,
                  seconds: float) -> dict[int, float]:
        p = self._padded(batch_size)
        old = table.get(p)
        return {**table, p: seconds if old is None else old + self._alpha * (seconds - old)}

    def _lookup(self, table: dict[int, float], batch_size: int) -> float:
        if not table:
            return 0.0
        p = self._padded(max(1, batch_size))
        if p in table:
            return table[p]
        # nearest measured size, scaled linearly: pessimistic for larger batches, which is safe
        q = min(table, key=lambda s: abs(s - p))
        return table[q] * max(1.0, p / q)

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
        full_extra: int = 0,
        dispatch_when_idle: bool = False,
        safety_s: float = 0.005,
    ) -> None:
        if max_batch_size < 1 or max_queue_size < 1 or max_inflight < 1 or max_queue_delay_s < 0 \
                or full_extra < 0:
            raise ValueError("batcher sizes must be >= 1 and the delay and full_extra >= 0")
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self.max_inflight = max_inflight
        self.full_extra = full_extra
        self.cost = cost
        self._execute = execute
        self.dispatch_when_idle = dispatch_when_idle
        self._safety = safety_s
        self._heap: list[Pending] = []
        self._seq = itertools.count()
        self._slots = asyncio.Semaphore(max_inflight + full_extra)
        self._wakeup = asyncio.Event()
        self._tasks: dict[asyncio.Task, list[Pending]] = {}  # running batches
        self._loop_task: asyncio.Task | None = None
        self._accepting = True
        self._last_done = 0.0  # when the last batch was answered (monotonic)
        #: answer time over admission's prediction, its recent MARGIN_QUANTILE (see _check_deadline)
        self.margin = 1.0
        #: why the batching loop stopped, when it died (then the model is not ready)
        self.failure: BaseException | None = None
        self.on_drop: Callable[[Pending, str], None] = lambda item, reason: None
        self.on_failure: Callable[[BaseException], None] = lambda exc: None

    # --- caller side -------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name=f"batcher:{self.name}")
            self._loop_task.add_done_callback(self._loop_ended)

    def wake(self) -> None:
        """Frames were cancelled: the loop drops them from the queue now, not when it next forms
        a batch."""
        self._wakeup.set()

    @property
    def alive(self) -> bool:
        """False once the batching loop died: nothing would be dispatched any more."""
        return self.failure is None

    @property
    def queue_depth(self) -> int:
        return sum(1 for p in self._heap if not p.future.done())

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    def submit(self, payload: Any, *, deadline: float, priority: int = 0,
               arrival: float | None = None, predicted: float = 0.0) -> Pending:
        """Queue one item; await ``pending.future`` for its answer. ``predicted``: what
        :meth:`check_capacity` returned for its request (how late answers come is learnt from
        it)."""
        self.check_capacity(1)
        now = time.monotonic()
        item = Pending(payload, asyncio.get_running_loop().create_future(),
                       now if arrival is None else arrival, deadline, priority, next(self._seq),
                       now, predicted)
        heapq.heappush(self._heap, item)
        self._wakeup.set()
        return item

    def check_capacity(self, n: int, *, deadline: float | None = None, priority: int = 0) -> float:
        """Raise 503 (with a Retry-After estimate) unless ``n`` more items fit in the queue and,
        given a ``deadline``, the load ahead of them leaves time to answer them before it.
        Returns the predicted seconds to their answer (0.0 when there was no need to predict)."""
        if not self._accepting:
            if self.failure is not None:
                raise self._stopped()
            raise Unavailable.shutting_down()
        predicted = 0.0 if deadline is None else self._check_deadline(n, deadline, priority)
        if len(self._heap) + n > self.max_queue_size:
            self._purge()
            if len(self._heap) + n > self.max_queue_size:
                wait = max(0.05, self.cost.estimate(self.max_batch_size)) * (
                    1 + len(self._heap) / self.max_batch_size)
                raise Unavailable(
                    f"model {self.name} is overloaded: {len(self._heap)} frames queued "
                    f"(max_queue_size {self.max_queue_size})", retry_after_s=round(wait, 3))
        return predicted

    def predict(self, n: int, *, deadline: float, priority: int = 0) -> tuple[float, int]:
        """Seconds from now until the last of ``n`` new frames would be answered, and how many
        queued frames go before them.

        The server's time per frame (measured) times the frames it works through first: those of
        the running batches (less what it already spent on the oldest), the queued frames that go
        first (higher priority, or the same and a deadline no later), the ``n`` frames, and the
        frames that will join their batch (the ``n`` frames' batch is answered as a whole; batches
        are as large as the recent ones). Never sooner than one batch's latency.
        """
        now = time.monotonic()
        # the queued frames that go first: live, not expired, and a higher priority, or the
        # same and a deadline no later. One pass per admitted request over the queue, on the
        # event loop, so written out (8 us for 96 queued frames against 13 as a generator of
        # sort keys)
        ahead = 0
        for p in self._heap:
            due, rank = p.deadline, p.priority
            if due > now and (rank > priority or (rank == priority and due <= deadline)) \
                    and not p.future.done():
                ahead += 1
        cost = self.cost
        per_frame = cost.per_frame() or cost.estimate(self.max_batch_size) / self.max_batch_size
        batch = min(max(1.0, cost.typical_batch() or 1.0), self.max_batch_size)
        frames = math.ceil((ahead + n) / batch - 1e-9) * batch
        spent = 0.0
        if self._tasks:
            running = list(self._tasks.values())  # in dispatch order
            frames += sum(len(b) for b in running)
            spent = min(now - max(self._last_done, running[0][0].dispatched),
                        len(running[0]) * per_frame)
        work = frames * per_frame - spent
        return max(work, cost.estimate(min(ahead + n, self.max_batch_size))), ahead

    def _check_deadline(self, n: int, deadline: float, priority: int) -> float:
        """503 at once for frames the load would make late: finishing them just after their
        deadline would cost the server the time that frames behind them need to be in time.

        The prediction is scaled by :attr:`margin`, the measured :data:`MARGIN_QUANTILE` of
        answer time over prediction: when every admitted frame is admitted at the edge (sustained
        overload), a prediction right on average would still leave half of them late."""
        budget = deadline - time.monotonic() - self._safety
        if not self._heap and not self._tasks:
            # idle: nothing ahead (a deadline even an idle server misses is answered 504)
            return 0.0
        if self.cost.estimate(n) > budget:
            return 0.0  # alone it would miss as well: not the load's doing, no 503 (it ends as 504)
        predicted, ahead = self.predict(n, deadline=deadline, priority=priority)
        if predicted * self.margin <= budget:
            return predicted
        raise Unavailable(
            f"model {self.name} is overloaded: the frame would be answered in about "
            f"{predicted * self.margin * 1000:.0f} ms ({ahead} frames queued before it, "
            f"{len(self._tasks)} batches running), after its deadline in "
            f"{max(0.0, budget + self._safety) * 1000:.0f} ms",
            retry_after_s=round(predicted * self.margin, 3))

    def _learn(self, item: Pending, now: float, missed: bool = False) -> None:
        """Move :attr:`margin` toward the :data:`MARGIN_QUANTILE` of answer time over prediction
        (a stochastic quantile estimate: up by q steps when slower, down by 1 - q when not).

        Only frames whose prediction took a quarter of their time left or more: those near the
        edge, where the margin decides. A few milliseconds of scheduling noise on a short
        prediction would make a large ratio, and a margin that refuses a queue of any length."""
        if item.predicted > 0 and item.predicted >= 0.25 * (item.deadline - item.admitted):
            slower = missed or now - item.admitted > item.predicted * self.margin
            step = math.exp(0.05 * (MARGIN_QUANTILE if slower else MARGIN_QUANTILE - 1))
            self.margin = min(4.0, max(0.5, self.margin * step))

    def _stopped(self) -> Unavailable:
        return Unavailable(f"model {self.name} is not ready: its batcher stopped after an internal "
                           "error; see the server log", retry_after_s=1.0)

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
            task, self._loop_task = self._loop_task, None
            task.cancel()
            await asyncio.wait([task])  # never raises: a loop that died was logged when it did
        while self._heap:
            item = heapq.heappop(self._heap)
            resolve(item.future, exc=Unavailable("the server shut down before this frame ran"))
        for batch in list(self._tasks.values()):
            for item in batch:
                resolve(item.future,
                        exc=Unavailable("the server shut down before this frame finished"))

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
            # not held here while the next batch is awaited: its frames go when it is answered
            # (in zero-copy mode, their arena space too)
            del batch, task

    async def _acquire_slot(self) -> None:
        """Wait for a free executor slot. Meanwhile keep answering requests whose deadline passes:
        a busy runner must not hold a late answer back until it is done."""
        while self._slots.locked():
            self._purge()
            await self._until_woken()
        await self._slots.acquire()  # free: returns at once

    async def _until_woken(self) -> None:
        """Wait for a wake-up (a frame queued or cancelled, a batch answered) or until the
        earliest queued deadline passes (the caller's ``_purge`` then answers that frame)."""
        expiry = min((p.deadline for p in self._heap), default=None)
        timeout = None if expiry is None else max(0.0, expiry - time.monotonic())
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout=timeout)
        except (asyncio.TimeoutError, TimeoutError):
            pass

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The batching loop only ends when cancelled (close): anything else is a bug that would
        leave every request waiting for ever. Say it, turn not ready, answer the queue 503."""
        if task.cancelled():
            return
        exc = task.exception() or RuntimeError("the batching loop returned")
        self.failure = exc
        self._accepting = False
        log.error("the batcher of model %s stopped: %s: %s; the model is not ready, queued frames "
                  "are answered 503", self.name, type(exc).__name__, exc, exc_info=exc)
        while self._heap:
            resolve(heapq.heappop(self._heap).future, exc=self._stopped())
        try:
            self.on_failure(exc)
        except Exception:
            log.exception("on_failure of the batcher of %s failed", self.name)

    def _task_done(self, task: asyncio.Task) -> None:
        batch = self._tasks.pop(task, None)
        now = time.monotonic()
        if batch and not task.cancelled() and task.exception() is None:
            # the server's time this batch took: since it was dispatched, or since the batch before
            # it was answered when it was already running then (batches overlap)
            self.cost.observe_interval(len(batch), now - max(self._last_done, batch[0].dispatched))
            for item in batch:
                self._learn(item, now)
        self._last_done = now
        self._slots.release()
        self._wakeup.set()  # a slot is free: wake the loop if it waits in _acquire_slot
        if not task.cancelled() and task.exception() is not None:
            log.error("batch execution failed in %s", self.name, exc_info=task.exception(),
                      extra=batch_ids(batch or ()))

    async def _dispatch(self, batch: list[Pending]) -> None:
        try:
            await self._execute(batch)
        except VisionServeError as exc:
            for item in batch:
                resolve(item.future, exc=exc)
        except Exception:
            log.exception("model %s failed on a batch of %d", self.name, len(batch),
                          extra=batch_ids(batch))
            for item in batch:
                resolve(item.future,
                        exc=InternalError("the model failed on this batch; see the server log"))

    async def _next_batch(self) -> list[Pending]:
        while True:
            self._purge()
            observer = _observer
            if observer is not None:
                observer(self, RUNNING if self._tasks else QUEUED if self._heap else IDLE)
            if not self._heap:
                if not self._accepting:
                    await asyncio.sleep(3600)  # drained: idle until closed
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            n = len(self._heap)
            if n >= self.max_batch_size or not self._accepting:
                break
            if len(self._tasks) >= self.max_inflight:
                # a slot of full_extra: only a full batch takes it; meanwhile a running batch
                # ends (a slot of max_inflight), the queue fills, or a frame expires
                await self._until_woken()
                continue
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
            latest = (earliest_deadline - self.cost.estimate(min(n + 1, self.max_batch_size))
                      - self._safety)
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
        self._learn(item, now, missed=True)
        self.on_drop(item, "late")
        waited, late_ms = (now - item.arrival) * 1000, (now - item.deadline) * 1000
        resolve(item.future, exc=DeadlineExceeded(
            f"deadline passed after {waited:.1f} ms in the queue ({late_ms:.1f} ms ago); the frame "
            "was not run", late_ms=late_ms))
