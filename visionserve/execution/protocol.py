"""What the serving process and a batch worker process say to each other (:mod:`.workers` is
the serving side, :mod:`.worker` the worker's), over :mod:`visionserve.framing`'s blocking
format: a request names a batch's slot and its frames, which sit in the slot's part of the
shared staging memory or follow the request on the socket; an answer names the rows written,
or carries the model's outputs, and the frames that failed, each by its error's name.

Requests: ``("prepare", job, slot, padded, frame descriptions, staged)``. Answers: ``("ready",
capped bytes)`` once after the warm-up, then for each request in order ``("done", job, rows,
good, bad)`` (prepared into the slot), ``("ran", job, outputs, good, bad, padded, infer_s)``
(prepared and run) or ``("failed", job, why)``.
"""

from __future__ import annotations

import mmap
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import errors, framing
from ..errors import VisionServeError
from ..imaging import Frame

#: the environment variable that carries the worker's spec (JSON)
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

#: (job, slot, padded, frames) of one request, as the worker reads it
Request = tuple[int, int, int, list[Frame]]


# --- requests ------------------------------------------------------------------------------------

def _frame_buffer(frame: Frame) -> tuple[tuple, Any]:
    """(description, buffer) of a frame for the wire: its bytes where they are. A description
    is (kind, width, height, channels, Bayer pattern or None, bytes, raw shape or None)."""
    data = frame.data
    head = (frame.kind, frame.width, frame.height, frame.channels, frame.bayer)
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
        shape = tuple(data.shape) if frame.kind == "raw" else None
        return (*head, data.nbytes, shape), data
    return (*head, len(data), None), data


def request(job: int, k: int, padded: int, frames: list[Frame], stage: np.ndarray | None
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
        off += d[5]
    if stage is not None and off <= stage.size:
        for (*_, n, _shape, at), b in zip(descs, buffers):
            stage[at:at + n] = np.frombuffer(b, np.uint8) if not isinstance(b, np.ndarray) \
                else b.reshape(-1).view(np.uint8)
        return framing.pack(("prepare", job, k, padded, descs, True))
    return framing.pack(("prepare", job, k, padded, descs, False), buffers)


def requests(sock: socket.socket, stage: np.ndarray) -> Iterator[Request]:
    """The requests, as (job, slot, padded, frames), until the serving process closes the
    channel. A batch's frames are views of slot ``k``'s staging memory (or of a buffer reused
    for the next request): valid until the batch is prepared."""
    buf = bytearray(1 << 20)
    while True:
        try:
            head = framing.read_head(sock)
        except (EOFError, OSError):
            return
        _, job, k, padded, descs, staged = head
        if staged:  # in slot k's staging memory
            data = stage[k * STAGE_BYTES:(k + 1) * STAGE_BYTES]
        else:  # on the socket, after the message
            total = sum(d[5] for d in descs)
            if len(buf) < total:
                buf = bytearray(max(total, 2 * len(buf)))
            framing.recv_exact(sock, memoryview(buf)[:total])
            data = np.frombuffer(buf, dtype=np.uint8)
        frames = []
        for kind, width, height, channels, bayer, n, shape, off in descs:
            b = data[off:off + n]
            frames.append(Frame(kind, b.reshape(shape) if shape else b, width, height, channels,
                                bayer))
        del data
        yield job, k, padded, frames


# --- the frames that failed ----------------------------------------------------------------------

def encode_errors(bad: list[tuple[int, Exception]]) -> list[tuple[int, str, str]]:
    """The frames that failed in the worker, for its answer: (index, error's name, message)."""
    return [(i, type(e).__name__, str(getattr(e, "message", e))) for i, e in bad]


def decode_errors(bad: list[tuple[int, str, str]]) -> list[tuple[int, Exception]]:
    """The frames that failed in the worker, as its answer names them (:func:`encode_errors`)."""
    return [(i, _error(name, message)) for i, name, message in bad]


def _error(name: str, message: str) -> VisionServeError:
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, VisionServeError)):
        cls = errors.InvalidInput
    return cls(message)


# --- slots ---------------------------------------------------------------------------------------

def slot_bytes(template: Any) -> int:
    return int(template.numel() * template.element_size())


def cpu_slots(template: Any, fd: int) -> list[Any]:
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
