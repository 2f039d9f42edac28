"""An instance's executor in the serving process: two threads, so batch k+1 is decoded while
batch k computes.

prep thread:    decode + resize + normalise (OpenCV releases the GIL) -> bounded hand-off queue
compute thread: drop what expired meanwhile -> backend.run -> the model's task (results and
                verdicts, :mod:`visionserve.tasks`) -> futures resolved; a
                frame whose verdict is ready after its deadline gets DeadlineExceeded instead (a
                late verdict is no decision for a PLC: it gets LATE, as a frame dropped unrun)

Answers go back to the event loop with one ``call_soon_threadsafe`` per batch; every future is
answered exactly once and only if nobody cancelled it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import imaging, tasks
from ..backends.base import Backend
from ..batching import CostModel, Pending, resolve
from ..config import ModelConfig
from ..errors import DeadlineExceeded, InternalError, Unavailable, VisionServeError
from ..logs import batch_ids
from ..threads import lower_this_thread
from .results import BatchRecord, FrameResult, Prepare, device_fault, padded_size

log = logging.getLogger(__name__)


def split(live: list[Pending], good: list[int], bad: list[tuple[int, Exception]]
           ) -> tuple[list[Pending], list[tuple[Pending, Exception]]]:
    """A prepared batch's frames: (those to run, (frame, error) of those that failed)."""
    # a frame's error needs no traceback, and its traceback and the preparation's list of errors
    # hold each other, and the batch's frames, until the collector runs (with
    # zero-copy mode: arena space the front end cannot reuse)
    return [live[i] for i in good], [(live[i], exc.with_traceback(None)) for i, exc in bad]


_STOP = object()


class ThreadExecutor:
    """An instance's batches prepared and run in the serving process, by a prep thread and a
    compute thread (:class:`~visionserve.execution.Executor`)."""

    def __init__(self, *, name: str, backend: Backend, config: ModelConfig,
                 preferred: tuple[int, ...], cost: CostModel,
                 on_batch: Callable[[BatchRecord], None],
                 prepare: Prepare | None = None, task: tasks.Task | None = None,
                 nice: int = 0, why: str = "CPU") -> None:
        self.name = name
        # the prep and compute threads (and the decode pool they start) this many nice levels
        # below the event loop (visionserve/threads.py)
        self.nice = nice
        # the model's outputs -> (verdict, result) per frame; the engine's is bound to the model
        self.task = task if task is not None else tasks.create(config)
        # a task that reads device outputs does so on the stream the backend wrote them on
        self._task_stream = backend.stream if self.task.on_device and backend.device_outputs \
            else None
        # prepare(frames, padded) -> (tensor, good, bad): None = imaging.prepare_batch (CPU); the
        # GPU preprocessor (gpu/preprocess.py) when the instance's device is a GPU
        self.prepare = prepare
        # what the start-up log says of how this instance's batches are prepared and run
        self.why = why
        self.backend = backend
        self.config = config
        self.preferred = preferred
        self.cost = cost
        self.on_batch = on_batch
        self.healthy = True
        # batches accepted and not answered yet, and accepted in all (loop thread only): the
        # engine sends a batch to the instance with the fewest in flight
        self.inflight = 0
        self.accepted = 0
        self._inbox: queue.Queue = queue.Queue()
        # batches ready for the compute thread; the batcher's limit on batches in flight bounds
        # it (the event loop puts into it too, and must never wait)
        self._handoff: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def describe(self) -> str:
        return f"in the serving process (2 threads; {self.why})"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for target, role in ((self._prep_loop, "prep"), (self._compute_loop, "compute")):
            t = threading.Thread(target=target, name=f"{self.name}:{role}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._inbox.put(_STOP)
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()

    @property
    def batches_in_flight(self) -> int:
        """Batches the batcher may give this instance at once: one computing, and one being
        prepared by the prep thread."""
        return 2

    @property
    def full_batches_extra(self) -> int:
        """Full batches the batcher may give this instance beyond :attr:`batches_in_flight`."""
        return 0

    async def execute(self, batch: list[Pending]) -> None:
        """Batcher entry point: returns when every item of ``batch`` has its answer."""
        done = asyncio.get_running_loop().create_future()
        self.inflight += 1
        self.accepted += 1
        done.add_done_callback(self._answered)
        if not self._sent_elsewhere(batch, done):
            self._inbox.put((batch, done))
        await done

    def _sent_elsewhere(self, batch: list[Pending], done: asyncio.Future) -> bool:
        """On the loop: whether the batch went to something other than this executor's prep
        thread (worker processes, :class:`~.workers.WorkerExecutor`)."""
        return False

    def _given_back(self, tensor: Any, settled: bool) -> None:
        """The compute thread is done with a batch's input ``tensor`` (None when it failed in
        preparation); ``settled``: the device is past every read of it."""

    def _run_failed(self) -> None:
        """``backend.run`` raised a VisionServeError: it may have queued a read of the input."""

    def _answered(self, done: asyncio.Future) -> None:
        self.inflight -= 1

    # --- threads -----------------------------------------------------------------------------

    def _post(self, fn, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _sorted(self, live: list[Pending], tensor: Any, good: list[int],
                bad: list[tuple[int, Exception]]) -> tuple[Any, list[Pending], list]:
        """A prepared batch as the compute thread takes it: (tensor, frames to run, (frame,
        error) of those that failed)."""
        items, errors = split(live, good, bad)
        if bad and good:  # rows of bad frames need not run: keep the good ones (+ padding)
            tensor = tensor[:padded_size(len(good), self.preferred)]
        return tensor, items, errors

    def _prep_loop(self) -> None:
        lower_this_thread(self.nice)
        spec = self.config.input
        while True:
            job = self._inbox.get()
            if job is _STOP:
                self._handoff.put(_STOP)
                return
            batch, done = job
            t0 = time.monotonic()
            live = [p for p in batch if not p.future.done()]
            try:
                if not self.healthy:
                    raise _Unhealthy
                padded = padded_size(len(live), self.preferred)
                if self.prepare is None:
                    tensor, good, bad = imaging.prepare_batch([p.payload for p in live], spec,
                                                              padded)
                else:
                    tensor, good, bad = self.prepare([p.payload for p in live], padded)
                tensor, items, errors = self._sorted(live, tensor, good, bad)
            except _Unhealthy:
                tensor, items = None, []
                errors = [(p, Unavailable(f"model instance {self.name} is unhealthy after a device "
                                          "fault; see the server log")) for p in live]
            except Exception as exc:
                if device_fault(exc):
                    self._mark_unhealthy(exc)
                log.exception("preprocessing failed in %s", self.name, extra=batch_ids(live))
                tensor, items = None, []
                errors = [(p, InternalError("preprocessing failed; see the server log"))
                          for p in live]
            if errors:
                self._post(fail_all, errors)
            self._handoff.put((batch, done, items, tensor, t0, time.monotonic() - t0, len(errors)))
            # this thread holds no frame while it waits for the next batch (with
            # zero-copy mode a frame held is arena space the front end cannot reuse)
            del job, batch, done, live, items, tensor, errors

    def _compute_loop(self) -> None:
        lower_this_thread(self.nice)
        while True:
            job = self._handoff.get()
            if job is _STOP:
                return
            _batch, done, items, tensor, t0, prep_s, failed = job
            # what the batch sends the loop goes in one call_soon_threadsafe: each one writes to
            # the loop's wake-up socket, and each write gives up the interpreter and waits for it
            post = Posted()
            settled = True  # the device is past every read of ``tensor``
            try:
                self._compute(items, tensor, t0, prep_s, failed, post)
            except Exception as exc:  # never let the thread die: the batch fails, runner goes on
                settled = False
                if device_fault(exc):
                    self._mark_unhealthy(exc)
                log.exception("compute failed in %s", self.name, extra=batch_ids(items))
                failure = "the model failed on this batch; see the server log"
                post(fail_all, [(p, InternalError(failure)) for p in items])
            finally:
                self._given_back(tensor, settled)
                post(resolve, done, None)
                self._post(post.run)
                # nor this one (see the prep thread)
                del job, _batch, done, items, tensor, post

    def _mark_unhealthy(self, exc: BaseException) -> None:
        if self.healthy:
            self.healthy = False
            log.error("device fault in %s: %s; this model instance is out of service (not ready) "
                      "until the server restarts", self.name,
                      str(exc).strip().splitlines()[0][:300])

    def _compute(self, items: list[Pending], tensor, t0: float, prep_s: float, failed: int,
                 post: Callable) -> None:
        """Runs ``items``; what the loop must do with the outcome goes to ``post`` (in order)."""
        now = time.monotonic()
        keep = [i for i, p in enumerate(items) if not p.future.done() and p.deadline > now]
        late = [p for p in items if not p.future.done() and p.deadline <= now]
        if late:
            self._post(fail_all, [(p, DeadlineExceeded(
                "deadline passed while the frame was being decoded "
                f"({(now - p.deadline) * 1000:.1f} ms ago); it was not run",
                late_ms=(now - p.deadline) * 1000)) for p in late])
        if not keep:
            return
        out_rows: list[int] | None = None  # rows of the model's output that answer ``items``
        if len(keep) != len(items):
            if isinstance(tensor, np.ndarray):
                # CPU: drop rows of frames that expired or were cancelled during decode, re-pad;
                # fewer rows is less compute
                padded = padded_size(len(keep), self.preferred)
                tensor = np.ascontiguousarray(tensor[keep + [keep[0]] * (padded - len(keep))])
            else:
                # device tensor: its rows may still be being written on the preprocessing stream,
                # and this thread's stream is another one; a re-index here could read them before
                # they are written. Run the batch as prepared (same padded shape, same CUDA graph)
                # and answer from the kept rows of the output.
                out_rows = keep
            items = [items[i] for i in keep]
        t1 = time.monotonic()
        try:
            outputs = self.backend.run(tensor)
        except VisionServeError as exc:
            self._run_failed()
            post(fail_all, [(p, exc) for p in items])
            return
        except Exception as exc:
            if not device_fault(exc):
                raise
            self._mark_unhealthy(exc)
            post(fail_all, [(p, Unavailable(
                f"the GPU failed while running model instance {self.name}; it is out of service"))
                for p in items])
            return
        t2 = time.monotonic()
        rows = out_rows if out_rows is not None else slice(0, len(items))
        self._conclude(items, outputs, rows, tensor.shape[0], len(late), prep_s, t2 - t1, failed,
                       post)

    def _conclude(self, items: list[Pending], outputs: Any, rows: Any, padded: int, late: int,
                  prep_s: float, infer_s: float, failed: int, post: Callable) -> None:
        """The model's ``outputs`` for ``items`` (their ``rows``) -> each frame's answer, and the
        batch's record, to ``post`` (in order)."""
        t2 = time.monotonic()
        sizes = [(p.payload.width, p.payload.height) for p in items]
        if self._task_stream is None:
            results = self.task.postprocess(outputs, rows, sizes)
        else:
            import torch

            with torch.cuda.stream(self._task_stream):
                results = self.task.postprocess(outputs, rows, sizes)
        t3 = time.monotonic()
        n = len(items)
        if len(results) != n:
            raise InternalError(f"task {self.task.name} answered {len(results)} frames of {n}")
        answers, too_late = [], []
        for p, (verdict, result) in zip(items, results):  # each frame with its own row's, in order
            if t3 > p.deadline:  # its verdict came after the deadline: LATE, no verdict
                late_ms = (t3 - p.deadline) * 1000
                too_late.append((p, DeadlineExceeded(
                    "deadline passed while the frame was computed: its answer was ready "
                    f"{late_ms:.1f} ms after the deadline ({(t3 - p.arrival) * 1000:.1f} ms after "
                    "arrival)", late_ms=late_ms)))
                continue
            answers.append((p, FrameResult(
                verdict=verdict, result=result, batch_size=n,
                queue_ms=(p.dispatched - p.arrival) * 1000, compute_ms=(t3 - p.dispatched) * 1000,
                total_ms=(t3 - p.arrival) * 1000, deadline_met=True)))
        self.cost.observe(n, t3 - min(p.dispatched for p in items))
        # the batch is recorded before its answers are released (the loop runs posts in order): a
        # client holding its answer must find it counted in /stats, even if this thread is slow
        # to get the GIL back after posting
        post(self.on_batch, BatchRecord(
            size=n, padded=padded, ok=len(answers), failed=failed,
            late=late + len(too_late),
            queue_s=tuple(p.dispatched - p.arrival for p in items),
            prep_s=prep_s, infer_s=infer_s, post_s=t3 - t2))
        if too_late:
            post(fail_all, too_late)
        post(_answer_all, answers)


class _Unhealthy(Exception):
    pass


class Posted(list):
    """What one batch sends the event loop: ``post(fn, *args)`` adds a call, :meth:`run` (on
    the loop, once) makes them in order, one failing call not stopping the rest."""

    def __call__(self, fn: Callable, *args: Any) -> None:
        self.append((fn, args))

    def run(self) -> None:
        for fn, args in self:
            try:
                fn(*args)
            except Exception:
                log.exception("answering a batch: %s failed", getattr(fn, "__name__", fn))


def _answer_all(answers) -> None:
    for p, value in answers:
        resolve(p.future, value)


def fail_all(errors) -> None:
    for p, exc in errors:
        resolve(p.future, exc=exc)
