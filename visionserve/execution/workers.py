"""An instance's executor in worker processes: batch preparation, and with
``--gpu-batch-processes`` the model too, in processes of their own.

The serving process has one interpreter. Its event loop takes every frame message from the front
ends, and the executor's prep thread must take the interpreter back after each torch call and
inside the decoder, and one process has one nvJPEG decoder, behind a mutex (docs/gpu.md). Here
each model instance's batches are prepared (decode, resize, normalise:
:class:`~visionserve.gpu.preprocess.TorchPreprocessor`, unchanged) by N worker processes whose
interpreters do nothing else, each with a decoder of its own, N batches at once:

* **Slots.** At load the serving process allocates ``SLOTS`` tensors per worker of the model's
  input (its largest batch, dtype and memory layout) in its own allocator, inside its budget and
  before it reports ready, and hands them to the worker: CUDA IPC handles on a GPU, a shared
  memory file on the CPU. The slots stay the serving process's memory, whatever happens to the
  worker.
* **A batch.** The event loop, which dispatches the batch, takes a free slot, stages the frames
  (below) and sends the worker a request on a non-blocking socket, and reads the answer when
  it comes: no thread of the serving process takes the interpreter back for it (a thread that
  sent and waited took it back twice a batch, each a wait behind the busy loop: slower than
  preparing in-process). The worker prepares the batch, copies the tensor into the slot, waits
  for its stream, and answers with the rows it wrote and the frames that failed (each alone,
  with its 400, as in-process). The loop hands the slot's first rows to the compute thread as
  the batch's input.
* **Giving a slot back.** The compute thread gives the slot back when it has finished the batch:
  by then the batch's outputs have been read on the host, so the device is past the copy out of
  the slot. A slot is never written while a batch may still read it.
* **Failures.** A worker that dies, does not answer within :data:`REPLY_TIMEOUT_S`, or answers
  another job than the one asked is killed and logged as an error; the batches it had are
  prepared in the serving process (the executor's prep thread, as without workers), later ones
  by the other workers, and when none is left by the serving process: no frame fails for it. A
  worker that cannot start (no CUDA in it, an import failing) is left out, with a warning. A
  batch a worker says it could not prepare (an unexpected error) is prepared in-process, and
  the worker stays.
* **Frames.** The loop copies a batch's frames into the slot's part of a shared memory file
  (``STAGE_BYTES`` a slot; one memcpy each, no system call), and the request says where; a
  batch larger than that sends its bytes on the socket after the request (non-blocking, the
  loop writing what the socket takes as it drains).

* **Memory.** A worker's torch allocator (a model's copy, its CUDA graphs, the working copies of
  a batch) comes out of the server's budget: after its warm-up the worker caps its allocator at
  what it holds then plus one batch's preparation allowance (what the budget plan gives an
  instance for it), and says how much that is; the serving process lowers its own cap by as
  much (:class:`~.reservation.GpuReservation`), or serves without the workers where that would
  leave it less than it holds. A worker's CUDA context and nvJPEG's own buffers are outside the
  allocators, as the serving process's are; NVML counts them, and the server's
  ``visionserve_gpu_memory_used_bytes`` includes its workers.

The parts: :class:`WorkerExecutor` (the instance's executor: the serving process's two threads,
which take what no worker can, and the workers), :class:`WorkerPool` (an instance's workers),
:mod:`.link` (one worker, serving side), :mod:`.protocol` (what they say), :mod:`.worker` (the
worker process, ``python -m visionserve.execution.worker``, started by :mod:`.link` only).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from .. import framing
from ..batching import Pending, resolve
from ..config import ModelConfig
from ..errors import InternalError
from ..gpu.memory import prep_allowance, stage_slot_bytes
from ..imaging import Frame
from ..logs import batch_ids
from ..metrics import BATCH_WORKERS_ALIVE
from .link import Ready, WorkerFailed, WorkerLink
from .protocol import REPLY_TIMEOUT_S, START_TIMEOUT_S
from .results import Prepared, RanBatch, padded_size
from .threads import Posted, ThreadExecutor, fail_all, split

if TYPE_CHECKING:
    from ..gpu.preprocess import TorchPreprocessor

log = logging.getLogger(__name__)


class WorkerPool:
    """An instance's batches prepared by ``workers`` worker processes. The executor
    :meth:`attach`-es it to the event loop and :meth:`submit`-s each batch from there;
    :meth:`prepare` does the same from a thread that waits (the contract of
    :meth:`TorchPreprocessor.prepare`; tests, and a caller without a loop). ``fallback`` (the
    in-process preprocessor, warmed up) prepares what no worker can (:meth:`prepare_here`, the
    executor's prep thread). :meth:`release` from the compute thread gives a slot back."""

    def __init__(self, config: ModelConfig, fallback: TorchPreprocessor, *, device: str,
                 dtype: Any, channels_last: bool, one_call: bool, preferred: tuple[int, ...],
                 name: str = "", workers: int = 1,
                 reply_timeout_s: float = REPLY_TIMEOUT_S, model: dict | None = None) -> None:
        self.config = config
        # {"path", "config" (its JSON dump)}: the workers also run the model and
        # answer with its outputs (--gpu-batch-processes; :class:`~.results.RanBatch`)
        self.runs_model = model is not None
        self.fallback = fallback
        self.device = device
        self.name = name or "model"
        self.reply_timeout_s = reply_timeout_s
        self.largest = max(config.batching.max_batch_size, *preferred)  # rows of a slot
        self._spec: dict[str, Any] = {
            "input": config.input.model_dump_json(), "max_batch": config.batching.max_batch_size,
            "stage_bytes": stage_slot_bytes(config), "device": device,
            "dtype": str(dtype).removeprefix("torch."), "channels_last": channels_last,
            "one_call": one_call, "preferred": list(preferred), "parent": os.getpid(),
            "model": model, "growth": prep_allowance(config)}
        self.workers = [WorkerLink(i) for i in range(workers)]
        self._idle: queue.Queue[WorkerLink] = queue.Queue()
        self._ptrs: dict[int, tuple[WorkerLink, int]] = {}  # a slot's data pointer -> its owner
        self._local = threading.Lock()  # the fallback is one thread's at a time
        self._counts_lock = threading.Lock()
        self._alive_lock = threading.Lock()
        self._counted = 0  # workers this pool has counted in BATCH_WORKERS_ALIVE
        self.failure: str | None = None  # why a worker is gone (the first reason)
        self.counts = {"remote_batches": 0, "local_batches": 0}
        self._loop: asyncio.AbstractEventLoop | None = None  # attached to (see attach)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.alive and w.proc is not None]

    @property
    def device_bytes(self) -> int:
        """Device bytes the live workers' allocators may hold together (each its cap)."""
        return sum(w.capped for w in self.workers if w.alive)

    @property
    def pid(self) -> int | None:
        pids = self.pids
        return pids[0] if pids else None

    # -- start / stop ---------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        """Start the workers and wait until they are warm; False (the reason in
        :attr:`failure`, logged) when none could start: then everything is prepared here."""
        try:
            template, _, _ = self.fallback.prepare([], self.largest)
        except Exception as exc:  # noqa: BLE001 - leaves the in-process path
            self._lost(None, f"the preparation process did not start: {exc}", logging.WARNING)
            return False
        launched = []
        for w in self.workers:
            try:
                w.launch(template, self.fallback.stream, self._spec)
                launched.append(w)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the in-process path
                self._lost(w, f"the preparation process did not start: {exc}", logging.WARNING)
        for w in launched:
            try:
                w.wait_ready(timeout_s, self.reply_timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the in-process path
                self._lost(w, f"the preparation process did not start: {exc}", logging.WARNING)
                continue
            self._ptrs.update({s.data_ptr(): (w, k) for k, s in enumerate(w.slots)
                               if s is not None})
            self._idle.put(w)
        self._count_alive()
        if self.pids:
            log.info("%s: batches prepared%s by process(es) %s", self.name,
                     " and run" if self.runs_model else "", ", ".join(map(str, self.pids)))
        return bool(self.pids)

    def close(self) -> None:
        """Stop the workers; from any thread (the loop stops watching their sockets first)."""
        loop, self._loop = self._loop, None
        if loop is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._detach_all()
            elif not loop.is_closed():
                done = threading.Event()
                try:
                    loop.call_soon_threadsafe(self._detach_all, done)
                    done.wait(5.0)
                except RuntimeError:  # the loop closed meanwhile
                    pass
        for w in self.workers:
            w.stop()
        self._count_alive()

    def _count_alive(self) -> None:
        """Bring this pool's share of ``visionserve_batch_workers_alive`` (a sum over every
        pool of the process) to the workers alive now."""
        with self._alive_lock:
            alive = len(self.pids)
            BATCH_WORKERS_ALIVE.inc(alive - self._counted)
            self._counted = alive

    def _lost(self, w: WorkerLink | None, why: str, level: int = logging.ERROR) -> None:
        if self.failure is None:
            self.failure = why
        if w is not None:
            w.stop(kill=True)
        left = sum(x.alive for x in self.workers)
        self._count_alive()
        log.log(level, "%s: %s; %s", self.name, why,
                f"{left} preparation process(es) left" if left else
                "its batches are prepared in the serving process from now on")

    # -- per batch ------------------------------------------------------------------------------

    def prepare(self, frames: list[Frame], padded: int) -> Prepared:
        if self.runs_model:  # its workers answer with outputs, through the loop (submit)
            return self.prepare_here(frames, padded)
        while (w := self._idle_worker()) is not None:
            try:
                out = w.prepare(frames, padded)
            except (OSError, EOFError, WorkerFailed, framing.FramingError,
                    pickle.UnpicklingError) as exc:
                # the next live worker takes the batch (none left: this process does)
                self._lost(w, f"a preparation process failed ({type(exc).__name__}: {exc})")
                continue
            self._idle.put(w)
            if not isinstance(out, str):
                self._count("remote_batches")
                return out
            log.warning("%s: a preparation process could not prepare a batch (%s); "
                        "preparing it here", self.name, out)
            break
        return self.prepare_here(frames, padded)

    def prepare_here(self, frames: list[Frame], padded: int) -> Prepared:
        """The batch prepared in this process (the fallback), by one thread at a time."""
        self._count("local_batches")
        with self._local:
            return self.fallback.prepare(frames, padded)

    # -- driven by the event loop ---------------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: batches are sent with :meth:`submit` from now on (see
        :meth:`WorkerLink.attach`); the executor's thread prepares only what no worker can
        (:meth:`prepare_here`)."""
        self._loop = loop
        for w in self.workers:
            if w.alive:
                w.reply_timeout_s = self.reply_timeout_s
                w.attach(loop, lambda w, why: self._lost(w, f"a preparation process failed: "
                                                             f"{why}"),
                         lambda: self._count("remote_batches"))

    def submit(self, frames: list[Frame], padded: int, ready: Ready) -> bool:
        """On the loop: the batch to the live worker with the fewest batches on their way;
        False when there is none (or no free slot): then the caller prepares it."""
        for w in sorted((w for w in self.workers if w.alive and w.loop is not None),
                        key=lambda w: len(w.outstanding)):
            if w.submit(frames, padded, ready):
                return True
        return False

    def _detach_all(self, done: threading.Event | None = None) -> None:
        for w in self.workers:
            w.detach()
        if done is not None:
            done.set()

    def _idle_worker(self) -> WorkerLink | None:
        """An idle live worker (waiting while all live ones are busy), or None if none lives."""
        while any(w.alive for w in self.workers):
            try:
                w = self._idle.get(timeout=0.5)
            except queue.Empty:
                continue
            if w.alive:
                return w
        return None

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self.counts[key] += 1

    def release(self, tensor: Any) -> None:
        """The compute thread is done with ``tensor`` (the executor's input): its slot, if it is
        one, may be written again."""
        if tensor is None:
            return
        owner = self._ptrs.get(tensor.data_ptr())
        if owner is not None:
            w, k = owner
            w.free.put(k)


class WorkerExecutor(ThreadExecutor):
    """An instance whose batches go to worker processes (:class:`WorkerPool`) from the event loop;
    the serving process's two threads (:class:`~.threads.ThreadExecutor`) take what no worker
    can, and with workers that prepare and run them, a batch that finds the instance idle. The
    compute thread gives each batch's input back (:meth:`WorkerPool.release`: a slot may then be
    written again), and :meth:`stop` closes the workers after the threads."""

    def __init__(self, *, pool: WorkerPool, why: str, **kw: Any) -> None:
        super().__init__(prepare=pool.prepare_here, why=why, **kw)
        self.pool = pool

    def describe(self) -> str:
        n = len(self.pool.pids)
        if self.pool.runs_model:
            return f"in {n} worker process(es) ({self.why})"
        return f"in the serving process (2 threads), prepared in {n} worker process(es) " \
               f"({self.why})"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        # the workers' sockets are watched from the loop: attach there
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            self.pool.attach(loop)
        else:  # until then, batches go to the prep thread
            loop.call_soon_threadsafe(self.pool.attach, loop)
        super().start(loop)

    def stop(self) -> None:
        super().stop()
        self.pool.close()

    @property
    def batches_in_flight(self) -> int:
        """Batches the batcher may give this instance at once: one computing, and one being
        prepared by each preparation process; or two for each process that prepares and runs
        them (one prepared there while one runs)."""
        if self.pool.runs_model:
            return 2 * len(self.pool.workers)
        return 1 + len(self.pool.workers)

    @property
    def full_batches_extra(self) -> int:
        """Full batches the batcher may give this instance beyond :attr:`batches_in_flight`: one
        for each process that prepares and runs them, waiting on its socket, so that a worker
        done with a batch starts the next without waiting for the loop to read its answer and
        send one. Only full ones: a closed loop of clients would otherwise spread its frames
        over more, smaller batches."""
        if self.pool.runs_model:
            return len(self.pool.workers)
        return 0

    def _sent_elsewhere(self, batch: list[Pending], done: asyncio.Future) -> bool:
        return self.healthy and not self._here_when_idle() and self._submit(batch, done)

    def _here_when_idle(self) -> bool:
        """Whether a batch of an instance whose workers prepare and run its batches
        (``--gpu-batch-processes``) runs in this process instead: when it is the only one in
        flight. The instance is idle then, so this process's two threads take it without
        waiting behind other work, and it saves a worker's two socket hops, a lone client's
        latency. Under load some batch is always in flight, and the workers take them all."""
        return self.pool.runs_model and self.inflight == 1

    def _submit(self, batch: list[Pending], done: asyncio.Future) -> bool:
        """On the loop: the batch to a worker process; when it is in a slot, straight to the
        compute thread (what the prep thread does with a batch it prepared). False when no
        process can take it; a batch one took and then could not prepare goes to the prep
        thread."""
        t0 = time.monotonic()
        live = [p for p in batch if not p.future.done()]
        padded = padded_size(len(live), self.preferred)

        def ready(prepared: Prepared | RanBatch | None) -> None:
            if prepared is None:
                self._inbox.put((batch, done))
                return
            if isinstance(prepared, RanBatch):
                self._conclude_ran(done, live, prepared, t0)
                return
            tensor, items, errors = self._sorted(live, *prepared)
            if errors:
                fail_all(errors)
            self._handoff.put((batch, done, items, tensor, t0, time.monotonic() - t0,
                               len(errors)))

        return bool(self.pool.submit([p.payload for p in live], padded, ready))

    def _conclude_ran(self, done: asyncio.Future, live: list[Pending], ran: RanBatch,
                      t0: float) -> None:
        """On the loop: a batch a worker process prepared and ran is answered here, without a
        thread of this process (what the compute thread does after ``backend.run``)."""
        post = Posted()
        _, errors = split(live, [], ran.bad)
        if errors:
            post(fail_all, errors)
        # the rows of frames still waiting (a frame cancelled meanwhile is not answered)
        rows = [j for j, i in enumerate(ran.good) if not live[i].future.done()]
        items = [live[ran.good[j]] for j in rows]
        try:
            if items:  # the preparation as the loop saw it: the round trip but the model
                self._conclude(items, ran.outputs, rows, ran.padded, 0,
                               time.monotonic() - t0 - ran.infer_s, ran.infer_s, len(errors),
                               post)
        except Exception:
            log.exception("answering a batch run by a worker process failed in %s", self.name,
                          extra=batch_ids(items))
            post(fail_all, [(p, InternalError("the model's results could not be read; see the "
                                              "server log")) for p in items])
        post(resolve, done, None)
        post.run()

    def _given_back(self, tensor: Any, settled: bool) -> None:
        if tensor is not None:
            # a batch that ran has had its outputs read on the host, so the device has read its
            # input; one that failed midway may still have a copy of it queued
            if not settled:
                self._settle()
            self.pool.release(tensor)

    def _run_failed(self) -> None:
        self._settle()  # it may have queued a read of the input: see _given_back

    def _settle(self) -> None:
        stream = self.backend.stream
        if stream is not None:
            try:
                stream.synchronize()
            except Exception:  # a device fault: the instance is out of service anyway
                log.debug("waiting for %s's stream failed", self.name, exc_info=True)
