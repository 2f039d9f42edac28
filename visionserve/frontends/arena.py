"""A shared-memory arena: a front end writes frame bytes in, the engine process reads them out.

The engine process creates one anonymous memory file (``memfd``) per front end and hands it over
at spawn time, so nothing is named in ``/dev/shm`` (Docker's default 64 MiB limit there does not
apply, and nothing is left behind after a crash). The front end is the only writer and the only
allocator; the engine copies a frame out as soon as it reads the request message, and the front
end frees the extent when the answer to that request arrives (never earlier: a cancelled request's
extent could otherwise be rewritten before the engine has read the message).

In zero-copy mode (``Link.zero_copy``; off in the server, where it measured no faster) the engine
copies nothing: a frame is an :class:`ArenaBytes`, a read-only view of its extent that holds its
request's lease, and the decoder reads the bytes where the front end wrote them. The front end
then frees a request's extents when the engine says it released them (``("free", [rid, ...])``),
which is when the last view of them is gone (the frames decoded and dropped; a record that
captures an image copies it, ``imaging.owned``), whenever that is against the answer.
"""

from __future__ import annotations

import bisect
import mmap
import os
from typing import Any

import numpy as np

ALIGN = 64


def create_memfd(size: int, name: str = "visionserve-arena") -> int:
    """An anonymous shared memory file of ``size`` bytes; returns its descriptor (inheritable)."""
    fd = os.memfd_create(name, 0)  # no MFD_CLOEXEC: the front-end process inherits it
    os.ftruncate(fd, size)
    return fd


class Arena:
    """First-fit allocator over one mapped memory file. Single-threaded (a front end's loop)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = np.frombuffer(self._map, dtype=np.uint8)
        # free extents as two parallel sorted lists (offset, length), coalesced on free
        self._offs: list[int] = [0]
        self._lens: list[int] = [size]
        self.used = 0

    def alloc(self, n: int) -> int | None:
        """Offset of ``n`` free bytes, or None when no extent is large enough."""
        need = max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)
        for i, length in enumerate(self._lens):
            if length >= need:
                off = self._offs[i]
                if length == need:
                    del self._offs[i], self._lens[i]
                else:
                    self._offs[i] += need
                    self._lens[i] -= need
                self.used += need
                return off
        return None

    def free(self, off: int, n: int) -> None:
        need = max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)
        self.used -= need
        i = bisect.bisect_left(self._offs, off)
        # merge with the next extent, then with the previous one
        if i < len(self._offs) and off + need == self._offs[i]:
            self._offs[i] = off
            self._lens[i] += need
        else:
            self._offs.insert(i, off)
            self._lens.insert(i, need)
        if i > 0 and self._offs[i - 1] + self._lens[i - 1] == self._offs[i]:
            self._lens[i - 1] += self._lens[i]
            del self._offs[i], self._lens[i]

    def write(self, off: int, data: bytes | np.ndarray) -> None:
        src = data.reshape(-1) if isinstance(data, np.ndarray) \
            else np.frombuffer(data, dtype=np.uint8)
        self._view[off:off + src.size] = src

    @property
    def free_extents(self) -> int:
        return len(self._offs)

    def close(self) -> None:
        del self._view
        self._map.close()


class ArenaBytes(np.ndarray):
    """A frame's bytes in the arena (zero-copy mode): a read-only uint8 view of its
    extent that holds ``lease``, its request's. A view taken with its own methods (a slice,
    ``reshape``) refers to it (numpy ends a view's chain of bases at the first array of another
    type), so it keeps the lease. ``np.frombuffer`` and ``torch.frombuffer`` of it do NOT: they
    refer to the whole arena. So the frame must hold this array (or such a view of it) for as
    long as its bytes are read, and a buffer taken from it another way may only live within a
    call made while the frame is held (a decode); copies (``bytes()``) need nothing."""

    lease: Any


class ArenaReader:
    """The engine's read-only side of one front end's arena."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self._bytes: np.ndarray | None = None  # the whole arena, for views (made on first use)

    def read(self, off: int, n: int) -> bytes:
        return self._map[off:off + n]

    def view(self, off: int, n: int, lease: Any) -> ArenaBytes:
        """The ``n`` bytes at ``off`` in place, holding ``lease`` (see :class:`ArenaBytes`)."""
        if self._bytes is None:
            self._bytes = np.frombuffer(self._map, np.uint8)
        v = self._bytes[off:off + n].view(ArenaBytes)
        v.lease = lease
        return v

    def close(self) -> None:
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # frames still in the engine view it: unmapped when the last goes
            pass
