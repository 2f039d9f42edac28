"""One batch worker process as the serving process sees it: the process, its socket, its slots
and its staging memory (:class:`WorkerLink`). :class:`~.workers.WorkerPool` holds an instance's
links; the worker's own side is :mod:`.worker`.

A link is driven two ways: by a thread that sends a request and waits for its answer
(:meth:`WorkerLink.prepare`, blocking), or, once :meth:`WorkerLink.attach`-ed, by the event loop
(:meth:`WorkerLink.submit`), which writes on a non-blocking socket what it takes and reads each
answer when it comes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import mmap
import os
import queue
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import framing
from ..imaging import Frame
from .protocol import (
    REPLY_TIMEOUT_S,
    SLOTS,
    SPEC_ENV,
    STAGE_BYTES,
    cpu_slots,
    decode_errors,
    request,
    slot_bytes,
)
from .results import Prepared, RanBatch

log = logging.getLogger(__name__)


#: called on the loop with a batch's outcome: prepared into a slot, prepared and run, or None
#: (the worker could not take it: the caller prepares it another way)
Ready = Callable[[Prepared | RanBatch | None], None]


class WorkerFailed(Exception):
    """The worker is gone or broken; the instance prepares in-process from now on."""


class WorkerLink:
    """One worker process, its channel and its slots (serving side)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.reader: framing.Reader | None = None
        self.slots: list[Any] = []
        self.free: queue.Queue[int] = queue.Queue()  # slots the compute thread gave back
        self.job = 0
        self.stage: np.ndarray | None = None  # SLOTS x STAGE_BYTES shared with the worker
        self._stage_map: mmap.mmap | None = None
        # driven by the event loop (attach): the requests on their way, oldest first, as
        # (job, slot, ready, timer); what the socket did not take yet; what came in
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outstanding: collections.deque[tuple[int, int, Ready, Any]] = collections.deque()
        self._out: list[memoryview] = []
        self._in = bytearray()
        self._on_lost: Callable[[WorkerLink, str], None] = lambda w, why: None
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
            self.slots = cpu_slots(template, slot_fd)
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
            self.proc = subprocess.Popen([sys.executable, "-m", "visionserve.execution.worker"],
                                         env=env, pass_fds=tuple(fds))
        finally:
            theirs.close()
            os.close(stage_fd)  # mapped here, inherited by the worker
            if slot_fd >= 0:
                os.close(slot_fd)
        self.sock, self.reader = ours, framing.Reader(ours)
        if template.is_cuda and not runs_model:
            from multiprocessing.reduction import ForkingPickler

            framing.send(ours, ("slots", [bytes(ForkingPickler.dumps(s)) for s in self.slots]))
        else:
            framing.send(ours, ("slots", None))

    def wait_ready(self, timeout_s: float, reply_timeout_s: float) -> None:
        assert self.sock is not None and self.reader is not None
        framing.set_time_limit(self.sock, timeout_s)
        reply = self.reader.message()
        if reply[0] != "ready":
            raise WorkerFailed(reply[1] if len(reply) > 1 else repr(reply))
        self.capped = int(reply[1])
        framing.set_time_limit(self.sock, reply_timeout_s)
        for k in range(SLOTS):
            self.free.put(k)

    @property
    def alive(self) -> bool:
        return self.sock is not None

    def prepare(self, frames: list[Frame], padded: int) -> Prepared | str:
        """The batch prepared by the worker, or why it could not prepare this one (it said so,
        and is fine: the batch is prepared in-process, the next one here again). Raises when
        the worker is broken."""
        assert self.sock is not None and self.reader is not None
        k = self.free.get()  # the compute thread gives each back (release)
        try:
            self.job += 1
            job = self.job
            framing.send_parts(self.sock, request(job, k, padded, frames, self._stage_of(k)))
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
        return self.slots[k][:rows], good, decode_errors(bad)

    # -- driven by the event loop ---------------------------------------------------------------
    # The loop sends a batch's frames itself (it holds the interpreter anyway, and a non-blocking
    # send returns at once) and reads the answer, so no runner thread of the serving process
    # takes the interpreter back for a batch's preparation: through a thread that sends and
    # waits it took it back twice a batch, each a wait behind the loop (docs/gpu.md).

    def attach(self, loop: asyncio.AbstractEventLoop, on_lost: Callable[[WorkerLink, str], None],
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

    def submit(self, frames: list[Frame], padded: int, ready: Ready) -> bool:
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
        self._write(request(self.job, k, padded, frames, self._stage_of(k)))
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
        self._out = framing.trim(self._out, sent)
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
        self._in += data
        for msg in framing.messages(self._in):
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
            ready(RanBatch(outputs, good, decode_errors(bad), padded, infer_s))
            return
        if msg[0] == "done" and msg[1] == job:
            _, _, rows, good, bad = msg
            self._on_done()
            ready((self.slots[k][:rows], good, decode_errors(bad)))
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
