"""Batch preparation, and with ``--gpu-batch-processes`` the model too, in processes of their own.

The serving process has one interpreter. Its event loop takes every frame message from the front
ends, and the runner's prep thread must take the interpreter back after each torch call and
inside the decoder, and one process has one nvJPEG decoder, behind a mutex (docs/gpu.md). Here
each model instance's batches are prepared (decode, resize, normalise:
:class:`~.preprocess.TorchPreprocessor`, unchanged) by N worker processes whose interpreters do
nothing else, each with a decoder of its own, N batches at once:

* **Slots.** At load the serving process allocates ``SLOTS`` tensors per worker of the model's
  input (its largest batch, dtype and memory layout) in its own allocator, inside its budget and
  before it reports ready, and hands them to the worker: CUDA IPC handles on a GPU, a shared
  memory file on the CPU. The slots stay the serving process's memory, whatever happens to the
  worker.
* **A batch.** The event loop, which dispatches the batch, takes a free slot, stages the frames
  (below) and sends the worker a request on a non-blocking socket, and reads the answer when
  it comes: no
  runner thread takes the interpreter back for it (a thread that sent and waited took it back
  twice a batch, each a wait behind the busy loop: slower than preparing in-process). The worker
  prepares the batch, copies the tensor into the slot, waits for its stream, and answers with
  the rows it wrote and the frames that failed (each alone, with its 400, as in-process). The
  loop hands the slot's first rows to the compute thread as the batch's input.
* **Giving a slot back.** The compute thread gives the slot back when it has finished the batch:
  by then the batch's outputs have been read on the host, so the device is past the copy out of
  the slot. A slot is never written while a batch may still read it.
* **Failures.** A worker that dies, does not answer within :data:`REPLY_TIMEOUT_S`, or answers
  another job than the one asked is killed and logged as an error; the batches it had are
  prepared in the serving process (the runner's prep thread, as without workers), later ones
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

Run as ``python -m visionserve.gpu.prepworker`` by :class:`PrepProcess` only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import mmap
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import errors
from ..config import InputSpec, ModelConfig
from ..errors import VisionServeError
from ..imaging import Frame
from ..runner import RanBatch, device_fault
from .memory import prep_allowance, stage_slot_bytes

log = logging.getLogger(__name__)

SPEC_ENV = "VISIONSERVE_PREP_SPEC"
#: slots per instance: one batch prepared, one waiting for the compute thread, one computing,
#: and one spare so the prep thread never waits for the compute thread to give one back
SLOTS = 4
#: seconds the serving process waits for a batch's answer (32 frames of the largest accepted
#: size decoded on the CPU take well under this) and for the worker to start and warm up
REPLY_TIMEOUT_S = 30.0
START_TIMEOUT_S = 180.0
#: bytes of frames a slot's batch may stage in shared memory (the rest goes through the socket):
#: 32 JPEGs of 1080p take about 9 MB. Pages are only used as far as batches fill them.
STAGE_BYTES = 32 << 20
_LEN = struct.Struct("<Q")


class WorkerFailed(Exception):
    """The worker is gone or broken; the instance prepares in-process from now on."""


# --- framing (both sides) -------------------------------------------------------------------------
# The sockets stay in blocking mode, with the kernel's own time limits (SO_SNDTIMEO, SO_RCVTIMEO)
# rather than Python's timeout: a Python timeout makes a socket non-blocking, and a batch's
# frames larger than the socket's buffer would then go out in many calls, each taking the
# serving process's interpreter back behind the busy event loop. Blocking, one ``sendmsg`` sends
# them all while the interpreter is released, and one ``recv_into`` takes an answer.

def set_time_limit(sock: socket.socket, seconds: float) -> None:
    """Sends and receives on ``sock`` fail (OSError) after ``seconds`` without progress."""
    sock.settimeout(None)
    limit = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)


def _parts(head: Any, buffers: Sequence[Any] = ()) -> list[memoryview]:
    """A message: ``head`` pickled behind its length, then ``buffers`` as they are."""
    blob = pickle.dumps(head, protocol=pickle.HIGHEST_PROTOCOL)
    parts = [memoryview(_LEN.pack(len(blob))), memoryview(blob)]
    parts += [memoryview(b).cast("B") for b in buffers]
    return parts


def _trim(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``parts`` after ``sent`` bytes went out."""
    k = 0
    while k < len(parts) and sent >= len(parts[k]):
        sent -= len(parts[k])
        k += 1
    rest = parts[k:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest


def _send(sock: socket.socket, head: Any, buffers: Sequence[Any] = ()) -> None:
    """A message in one ``sendmsg``."""
    _send_parts(sock, _parts(head, buffers))


def _send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """``parts`` in one ``sendmsg`` (more only if a signal or the time limit cut it short)."""
    while parts:
        parts = _trim(parts, sock.sendmsg(parts))


def _recv_exact(sock: socket.socket, into: memoryview) -> None:
    pos, n = 0, len(into)
    while pos < n:
        got = sock.recv_into(into[pos:], n - pos)
        if not got:
            raise EOFError("the other side closed the channel")
        pos += got


class _Reader:
    """Messages from a socket on which at most one is on its way at a time (an answer to a
    request, a request to the worker): usually one ``recv_into`` each."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(1 << 16)

    def message(self) -> Any:
        view = memoryview(self.buf)
        got = 0
        while got < _LEN.size:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise EOFError("the other side closed the channel")
            got += n
        (size,) = _LEN.unpack_from(self.buf)
        end = _LEN.size + size
        if end > len(self.buf):
            self.buf.extend(bytes(end - len(self.buf)))
            view = memoryview(self.buf)
        if got < end:
            _recv_exact(self.sock, view[got:end])
        elif got > end:
            raise WorkerFailed(f"{got - end} bytes beyond the message")
        return pickle.loads(view[_LEN.size:end])


def _frame_buffer(frame: Frame) -> tuple[tuple, Any]:
    """(description, buffer) of a frame for the wire: its bytes where they are."""
    data = frame.data
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
        shape = tuple(data.shape) if frame.kind == "raw" else None
        return (frame.kind, frame.width, frame.height, frame.channels, data.nbytes, shape), data
    return (frame.kind, frame.width, frame.height, frame.channels, len(data), None), data


def _request(job: int, k: int, padded: int, frames: list[Frame], stage: np.ndarray | None
             ) -> list[memoryview]:
    """The message asking for slot ``k``'s batch. Where the frames fit ``stage`` (slot ``k``'s
    part of the shared staging memory) they are copied there - one memcpy each, holding the
    interpreter, no system call - and the message only says where; else their bytes follow
    the message on the socket."""
    descs, buffers, off = [], [], 0
    for f in frames:
        d, b = _frame_buffer(f)
        descs.append((*d, off))
        buffers.append(b)
        off += d[4]
    if stage is not None and off <= stage.size:
        for (*_, n, _shape, at), b in zip(descs, buffers):
            stage[at:at + n] = np.frombuffer(b, np.uint8) if not isinstance(b, np.ndarray) \
                else b.reshape(-1).view(np.uint8)
        return _parts(("prepare", job, k, padded, descs, True))
    return _parts(("prepare", job, k, padded, descs, False), buffers)


def _errors(bad: list[tuple[int, str, str]]) -> list[tuple[int, Exception]]:
    """The frames that failed in the worker, as its answer names them (:func:`_bad`)."""
    return [(i, _error(name, message)) for i, name, message in bad]


def _error(name: str, message: str) -> VisionServeError:
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, VisionServeError)):
        cls = errors.InvalidInput
    return cls(message)


# --- slots -------------------------------------------------------------------------------------

def slot_bytes(template: Any) -> int:
    return int(template.numel() * template.element_size())


def _cpu_slots(template: Any, fd: int) -> list[Any]:
    """SLOTS tensors shaped and strided as ``template`` over the shared memory file ``fd``."""
    import torch

    each = slot_bytes(template)
    mm = mmap.mmap(fd, each * SLOTS, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    out = []
    for k in range(SLOTS):
        t = flat[k * each:(k + 1) * each].view(template.dtype)
        out.append(t.as_strided(template.shape, template.stride()))
    return out


# --- the serving side ----------------------------------------------------------------------------

class _Worker:
    """One worker process, its channel and its slots (serving side)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.reader: _Reader | None = None
        self.slots: list[Any] = []
        self.free: queue.Queue[int] = queue.Queue()  # slots the compute thread gave back
        self.job = 0
        self.stage: np.ndarray | None = None  # SLOTS x STAGE_BYTES shared with the worker
        self._stage_map: mmap.mmap | None = None
        # driven by the event loop (attach): the requests on their way, oldest first, as
        # (job, slot, ready, timer); what the socket did not take yet; what came in
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outstanding: collections.deque[tuple[int, int, Callable, Any]] = collections.deque()
        self._out: list[memoryview] = []
        self._in = bytearray()
        self._on_lost: Callable[[_Worker, str], None] = lambda w, why: None
        self._on_done: Callable[[], None] = lambda: None
        self.reply_timeout_s = REPLY_TIMEOUT_S
        self.capped = 0  # device bytes its allocator may hold (the cap it set after warm-up)

    def launch(self, template: Any, stream: Any, spec: dict) -> None:
        """Start the process and hand it the slots; :meth:`wait_ready` waits for its warm-up
        (the workers of an instance warm up at once)."""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor  # noqa: F401 - registers

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [theirs.fileno()]
        slot_fd = -1
        runs_model = spec.get("model") is not None  # its batches never come back as tensors
        if runs_model:
            self.slots = [None] * SLOTS  # a slot is its staging memory and a batch on its way
        elif template.is_cuda:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.slots = [torch.empty_like(template) for _ in range(SLOTS)]
            (stream or torch.cuda.current_stream(template.device)).synchronize()
        else:
            slot_fd = os.memfd_create("visionserve-prep-slots", 0)
            os.ftruncate(slot_fd, slot_bytes(template) * SLOTS)
            self.slots = _cpu_slots(template, slot_fd)
            fds.append(slot_fd)
        stage_fd = os.memfd_create("visionserve-prep-stage", 0)
        os.ftruncate(stage_fd, STAGE_BYTES * SLOTS)
        self._stage_map = mmap.mmap(stage_fd, STAGE_BYTES * SLOTS)
        self.stage = np.frombuffer(self._stage_map, np.uint8)
        fds.append(stage_fd)
        spec = {**spec, "channel_fd": theirs.fileno(), "slot_fd": slot_fd, "stage_fd": stage_fd,
                "shape": list(template.shape), "stride": list(template.stride())}
        env = {**os.environ, SPEC_ENV: json.dumps(spec)}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "visionserve.gpu.prepworker"],
                                         env=env, pass_fds=tuple(fds))
        finally:
            theirs.close()
            os.close(stage_fd)  # mapped here, inherited by the worker
            if slot_fd >= 0:
                os.close(slot_fd)
        self.sock, self.reader = ours, _Reader(ours)
        if template.is_cuda and not runs_model:
            from multiprocessing.reduction import ForkingPickler

            _send(ours, ("slots", [bytes(ForkingPickler.dumps(s)) for s in self.slots]))
        else:
            _send(ours, ("slots", None))

    def wait_ready(self, timeout_s: float, reply_timeout_s: float) -> None:
        assert self.sock is not None and self.reader is not None
        set_time_limit(self.sock, timeout_s)
        reply = self.reader.message()
        if reply[0] != "ready":
            raise WorkerFailed(reply[1] if len(reply) > 1 else repr(reply))
        self.capped = int(reply[1])
        set_time_limit(self.sock, reply_timeout_s)
        for k in range(SLOTS):
            self.free.put(k)

    @property
    def alive(self) -> bool:
        return self.sock is not None

    def prepare(self, frames: list[Frame], padded: int
                ) -> tuple[Any, list[int], list[tuple[int, Exception]]] | str:
        """The batch prepared by the worker, or why it could not prepare this one (it said so,
        and is fine: the batch is prepared in-process, the next one here again). Raises when
        the worker is broken."""
        assert self.sock is not None and self.reader is not None
        k = self.free.get()  # the compute thread gives each back (release)
        try:
            self.job += 1
            job = self.job
            _send_parts(self.sock, _request(job, k, padded, frames, self._stage_of(k)))
            reply = self.reader.message()
        except BaseException:
            self.free.put(k)
            raise
        if reply[0] != "done" or reply[1] != job:
            self.free.put(k)
            if reply[0] == "failed" and reply[1] == job:
                return str(reply[2])
            raise WorkerFailed(f"asked for batch {job}, it answered {reply[:2]!r}")
        _, _, rows, good, bad = reply
        return self.slots[k][:rows], good, _errors(bad)

    # -- driven by the event loop ---------------------------------------------------------------
    # The loop sends a batch's frames itself (it holds the interpreter anyway, and a non-blocking
    # send returns at once) and reads the answer, so no runner thread of the serving process
    # takes the interpreter back for a batch's preparation: through a thread that sends and
    # waits it took it back twice a batch, each a wait behind the loop (docs/gpu.md).

    def attach(self, loop: asyncio.AbstractEventLoop, on_lost: Callable[[_Worker, str], None],
               on_done: Callable[[], None]) -> None:
        """On the loop: from now on requests go through :meth:`submit`."""
        assert self.sock is not None
        self.loop, self._on_lost, self._on_done = loop, on_lost, on_done
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._readable)

    def detach(self) -> None:
        """On the loop: stop watching the socket (before it is closed)."""
        loop, self.loop = self.loop, None
        if loop is not None and self.sock is not None:
            loop.remove_reader(self.sock.fileno())
            if self._out:
                loop.remove_writer(self.sock.fileno())
        self._out = []

    def submit(self, frames: list[Frame], padded: int, ready: Callable[[Any], None]) -> bool:
        """On the loop: send the batch; ``ready((tensor, good, bad))`` on the loop when it is in
        a slot, ``ready(None)`` when this worker cannot prepare it (the caller prepares it
        another way). False, and nothing sent, when no slot is free."""
        if self.loop is None or self.sock is None:
            return False
        try:
            k = self.free.get_nowait()
        except queue.Empty:
            return False
        self.job += 1
        timer = self.loop.call_later(self.reply_timeout_s, self._timed_out, self.job)
        self.outstanding.append((self.job, k, ready, timer))
        self._write(_request(self.job, k, padded, frames, self._stage_of(k)))
        return True

    def _stage_of(self, k: int) -> np.ndarray | None:
        """Slot ``k``'s staging memory: written for a batch only while ``k`` is taken, and
        the worker is done reading it when it answers."""
        if self.stage is None:
            return None
        return self.stage[k * STAGE_BYTES:(k + 1) * STAGE_BYTES]

    def _write(self, parts: list[memoryview]) -> None:
        if self._out:  # the socket is full: after what waits
            self._out += parts
            return
        self._out = parts
        self._writable()
        if self._out and self.loop is not None and self.sock is not None:
            self.loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        assert self.sock is not None
        try:
            sent = self.sock.sendmsg(self._out[:512])
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(f"sending to it failed ({exc})")
            return
        self._out = _trim(self._out, sent)
        if not self._out and self.loop is not None:
            self.loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(f"reading from it failed ({exc})")
            return
        if not data:
            self._lose("it closed the channel (exited)")
            return
        buf = self._in
        buf += data
        while len(buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(buf)
            if len(buf) < _LEN.size + n:
                break
            msg = pickle.loads(memoryview(buf)[_LEN.size:_LEN.size + n])
            del buf[:_LEN.size + n]
            self._answer(msg)
            if self.sock is None:  # lost while answering
                return

    def _answer(self, msg: Any) -> None:
        if not self.outstanding:
            self._lose(f"it answered {msg[:2]!r} when nothing was asked")
            return
        job, k, ready, timer = self.outstanding.popleft()
        timer.cancel()
        if msg[0] == "ran" and msg[1] == job:  # prepared and run there: the slot is free
            _, _, outputs, good, bad, padded, infer_s = msg
            self.free.put(k)
            self._on_done()
            ready(RanBatch(outputs, good, _errors(bad), padded, infer_s))
            return
        if msg[0] == "done" and msg[1] == job:
            _, _, rows, good, bad = msg
            self._on_done()
            ready((self.slots[k][:rows], good, _errors(bad)))
            return
        self.free.put(k)
        if msg[0] == "failed" and msg[1] == job:
            log.warning("a preparation process could not prepare a batch (%s); preparing it "
                        "in the serving process", msg[2])
            ready(None)
            return
        ready(None)
        self._lose(f"asked for batch {job}, it answered {msg[:2]!r}")

    def _timed_out(self, job: int) -> None:
        if any(j == job for j, *_ in self.outstanding):
            self._lose(f"it did not answer within {self.reply_timeout_s:.0f} s")

    def _lose(self, why: str) -> None:
        """On the loop: the worker is broken; what it was asked goes back to the caller."""
        pending = list(self.outstanding)
        self.outstanding.clear()
        self.detach()
        self._on_lost(self, why)  # stops (kills) the process
        for _job, _k, ready, timer in pending:
            timer.cancel()
            ready(None)

    def stop(self, kill: bool = False) -> None:
        sock, proc, self.sock, self.reader = self.sock, self.proc, None, None
        if kill and proc is not None and proc.poll() is None:
            proc.kill()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()  # the worker sees the channel close and exits
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


class PrepProcess:
    """An instance's batches prepared by ``workers`` worker processes. The runner
    :meth:`attach`-es it to the event loop and :meth:`submit`-s each batch from there;
    :meth:`prepare` does the same from a thread that waits (the contract of
    :meth:`TorchPreprocessor.prepare`; tests, and a caller without a loop). ``fallback`` (the
    in-process preprocessor, warmed up) prepares what no worker can (:meth:`prepare_here`, the
    runner's prep thread). :meth:`release` from the compute thread gives a slot back."""

    def __init__(self, config: ModelConfig, fallback: Any, *, device: str, dtype: Any,
                 channels_last: bool, one_call: bool, preferred: tuple[int, ...],
                 name: str = "", workers: int = 1,
                 reply_timeout_s: float = REPLY_TIMEOUT_S, model: dict | None = None) -> None:
        self.config = config
        # {"path", "config" (its JSON dump)}: the workers also run the model and
        # answer with its outputs (--gpu-batch-processes; :class:`~visionserve.runner.RanBatch`)
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
        self.workers = [_Worker(i) for i in range(workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._ptrs: dict[int, tuple[_Worker, int]] = {}  # a slot's data pointer -> its owner
        self._local = threading.Lock()  # the fallback is one thread's at a time
        self._counts_lock = threading.Lock()
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

    def _lost(self, w: _Worker | None, why: str, level: int = logging.ERROR) -> None:
        if self.failure is None:
            self.failure = why
        if w is not None:
            w.stop(kill=True)
        left = sum(x.alive for x in self.workers)
        log.log(level, "%s: %s; %s", self.name, why,
                f"{left} preparation process(es) left" if left else
                "its batches are prepared in the serving process from now on")

    # -- per batch ------------------------------------------------------------------------------

    def prepare(self, frames: list[Frame], padded: int
                ) -> tuple[Any, list[int], list[tuple[int, Exception]]]:
        if self.runs_model:  # its workers answer with outputs, through the loop (submit)
            return self.prepare_here(frames, padded)
        while (w := self._idle_worker()) is not None:
            try:
                out = w.prepare(frames, padded)
            except (OSError, EOFError, WorkerFailed, pickle.UnpicklingError) as exc:
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

    def prepare_here(self, frames: list[Frame], padded: int
                     ) -> tuple[Any, list[int], list[tuple[int, Exception]]]:
        """The batch prepared in this process (the fallback), by one thread at a time."""
        self._count("local_batches")
        with self._local:
            return self.fallback.prepare(frames, padded)

    # -- driven by the event loop ---------------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: batches are sent with :meth:`submit` from now on (see
        :meth:`_Worker.attach`); the runner's thread prepares only what no worker can
        (:meth:`prepare_here`)."""
        self._loop = loop
        for w in self.workers:
            if w.alive:
                w.reply_timeout_s = self.reply_timeout_s
                w.attach(loop, lambda w, why: self._lost(w, f"a preparation process failed: "
                                                             f"{why}"),
                         lambda: self._count("remote_batches"))

    def submit(self, frames: list[Frame], padded: int, ready: Callable[[Any], None]) -> bool:
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

    def _idle_worker(self) -> _Worker | None:
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
        """The compute thread is done with ``tensor`` (the runner's input): its slot, if it is
        one, may be written again."""
        if tensor is None:
            return
        owner = self._ptrs.get(tensor.data_ptr())
        if owner is not None:
            w, k = owner
            w.free.put(k)


# --- the worker ----------------------------------------------------------------------------------

def _read_head(sock: socket.socket) -> Any:
    """A request's head, read exactly: the frames' bytes follow it on the socket."""
    size = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(size))
    blob = bytearray(_LEN.unpack(size)[0])
    _recv_exact(sock, memoryview(blob))
    return pickle.loads(blob)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _load_model(model: dict, device: str, preferred: tuple[int, ...]) -> Any:
    """The model loaded and warmed up as the serving process loads it (its outputs on the host:
    the task reads them there)."""
    from pathlib import Path

    from .. import tasks
    from ..backends import base as backends
    from ..backends import checks

    config = ModelConfig.model_validate(model["config"])
    path = Path(model["path"])
    backend = backends.create(config.runtime.backend)
    backend.load(path, config, device)
    task = tasks.create(config)
    backend.select_outputs(task.bind(checks.Subject(path), backend.outputs), on_device=False)
    backend.warmup(preferred)
    return backend


def _batches(sock: socket.socket, stage: np.ndarray):
    """The requests, as (job, slot, padded, frames), until the serving process closes the
    channel. A batch's frames are views of slot ``k``'s staging memory (or of a buffer reused
    for the next request): valid until the batch is prepared."""
    buf = bytearray(1 << 20)
    while True:
        try:
            head = _read_head(sock)
        except (EOFError, OSError):
            return
        _, job, k, padded, descs, staged = head
        if staged:  # in slot k's staging memory
            data = stage[k * STAGE_BYTES:(k + 1) * STAGE_BYTES]
        else:  # on the socket, after the message
            total = sum(d[4] for d in descs)
            if len(buf) < total:
                buf = bytearray(max(total, 2 * len(buf)))
            _recv_exact(sock, memoryview(buf)[:total])
            data = np.frombuffer(buf, dtype=np.uint8)
        frames = []
        for kind, width, height, channels, n, shape, off in descs:
            b = data[off:off + n]
            frames.append(Frame(kind, b.reshape(shape) if shape else b, width, height, channels))
        del data
        yield job, k, padded, frames


def _bad(bad: list[tuple[int, Exception]]) -> list[tuple[int, str, str]]:
    return [(i, type(e).__name__, str(getattr(e, "message", e))) for i, e in bad]


def _prepare_into_slots(sock: socket.socket, stage: np.ndarray, prep: Any, slots: list[Any],
                        stream: Any) -> None:
    """Preparation-only workers (off in the server): each batch prepared into its slot; answered
    with its rows."""
    import torch

    for job, k, padded, frames in _batches(sock, stage):
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), \
                    torch.inference_mode():
                tensor, good, bad = prep.prepare(frames, padded)
                slots[k][:tensor.shape[0]].copy_(tensor)
            if stream is not None:
                stream.synchronize()
            reply: tuple = ("done", job, int(tensor.shape[0]), good, _bad(bad))
        except Exception as exc:  # noqa: BLE001 - the serving process prepares it instead
            reply = ("failed", job, f"{type(exc).__name__}: {exc}")
        del frames
        _send(sock, reply)


def _prepare_and_run(sock: socket.socket, stage: np.ndarray, prep: Any, backend: Any) -> None:
    """``--gpu-batch-processes``: this thread prepares batch k+1 while a compute thread runs
    batch k (both on the model's stream, as the serving process's runner threads do) and
    answers with its outputs, in the order asked. A device fault (a sticky CUDA error: this
    process's context is unusable) is answered as the batch's failure, and then the worker stops
    reading: the serving process sees the channel close and runs what it had sent itself."""
    import torch

    handoff: queue.Queue = queue.Queue(maxsize=1)

    def compute() -> None:
        broken = False  # the device failed, or the serving process is gone: answer no more
        while (item := handoff.get()) is not None:
            job, outcome = item
            del item
            if broken:  # drained until the reading side ends
                continue
            failure: BaseException | None = None
            if isinstance(outcome, BaseException):
                failure = outcome
            else:
                tensor, good, bad = outcome
                try:
                    t0 = time.perf_counter()
                    outputs = backend.run(tensor)
                    reply: tuple = ("ran", job, outputs, good, _bad(bad), int(tensor.shape[0]),
                                    time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001 - the serving process runs it instead
                    failure = exc.with_traceback(None)
                del tensor
            del outcome
            if failure is not None:
                reply = ("failed", job, f"{type(failure).__name__}: {failure}")
            try:
                _send(sock, reply)
            except OSError:
                broken = True
            if failure is not None and device_fault(failure):
                log.error("the device failed (%s); this worker stops", str(failure)[:300])
                broken = True
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    thread = threading.Thread(target=compute, name="compute", daemon=True)
    thread.start()
    for job, _k, padded, frames in _batches(sock, stage):
        try:
            with torch.inference_mode():
                outcome: Any = prep.prepare(frames, padded)
        except Exception as exc:  # noqa: BLE001 - the serving process prepares it instead
            outcome = exc.with_traceback(None)
        del frames
        handoff.put((job, outcome))
        del outcome
    handoff.put(None)
    thread.join(timeout=30)


def serve(spec: dict) -> int:
    """The worker's main: prepare (and with a model, run) batches until the channel closes."""
    import torch

    from .memory import PinnedPool, cap_torch_allocator
    from .preprocess import TorchPreprocessor

    sock = socket.socket(fileno=spec["channel_fd"])
    reader = _Reader(sock)
    stage = np.frombuffer(mmap.mmap(spec["stage_fd"], STAGE_BYTES * SLOTS), np.uint8)
    backend = None
    slots: list[Any] = []
    try:
        head = reader.message()
        assert head[0] == "slots", head
        device = spec["device"]
        cuda = device.startswith("cuda")
        dtype = getattr(torch, spec["dtype"])
        stream = None
        if cuda:
            torch.cuda.set_device(torch.device(device))
        if spec.get("model") is not None:
            backend = _load_model(spec["model"], device, tuple(spec["preferred"]))
            stream = backend.stream
        elif cuda:
            from .memory import high_priority_stream

            stream = high_priority_stream(device)
            slots = [pickle.loads(b) for b in head[1]]
        else:
            template = torch.empty_strided(spec["shape"], spec["stride"], dtype=dtype)
            slots = _cpu_slots(template, spec["slot_fd"])
        prep = TorchPreprocessor(
            InputSpec.model_validate_json(spec["input"]), device=device, dtype=dtype,
            max_batch=spec["max_batch"], stream=stream, channels_last=spec["channels_last"],
            pool=PinnedPool(2, spec["stage_bytes"]) if cuda else None, one_call=spec["one_call"])
        capped = 0
        if cuda:  # grows nvJPEG's and the allocator's buffers (nothing to grow on the CPU)
            prep.warmup(tuple(spec["preferred"]))
            # what it holds now, and room for one batch's preparation more: its share of the
            # server's budget, which the serving process takes off its own cap
            torch.cuda.synchronize()
            capped = int(torch.cuda.memory_reserved(device)) + int(spec["growth"])
            cap_torch_allocator(capped, device)
    except Exception as exc:  # noqa: BLE001 - said to the serving process, which goes on
        with contextlib.suppress(OSError):
            _send(sock, ("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    _send(sock, ("ready", capped))
    if backend is not None:
        _prepare_and_run(sock, stage, prep, backend)
    else:
        _prepare_into_slots(sock, stage, prep, slots, stream)
    # the serving process closed the channel: let its slots go before exiting, so that torch
    # does not warn there of CUDA tensors still shared with a process that ended
    slots.clear()
    if cuda:
        torch.cuda.synchronize()
    return 0


def main() -> int:
    spec = json.loads(os.environ.pop(SPEC_ENV))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the serving process stops it (channel closed)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s prepworker: %(message)s")
    threading.Thread(target=_watch_parent, args=(spec["parent"],), daemon=True).start()
    return serve(spec)


if __name__ == "__main__":
    sys.exit(main())
