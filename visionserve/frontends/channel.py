"""Messages between a front end and the engine process: pickled tuples, length-prefixed, on a
Unix socket pair. Messages sent in one event-loop turn go out in one write (one system call for
a burst of answers instead of one each)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_MESSAGE = 1 << 30


class Channel(asyncio.Protocol):
    """``on_message(msg)`` is called for each message received; ``on_lost()`` once at the end."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.closed = False

    # --- receiving ---------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if n > MAX_MESSAGE:
                log.error("front-end channel: message of %d bytes; closing the channel", n)
                assert self.transport is not None  # data comes after connection_made
                self.transport.close()
                return
            if end - pos - 4 < n:
                break
            msg = pickle.loads(memoryview(buf)[pos + 4:pos + 4 + n])
            pos += 4 + n
            try:
                self.on_message(msg)
            except Exception:  # one bad message must not take the channel down
                log.exception("front-end channel: handling %r failed",
                              msg[:1] if isinstance(msg, tuple) else msg)
        if pos:
            del buf[:pos]

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.on_lost()

    # --- sending -----------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        if self.closed or self.transport is None:
            return
        blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._out.append(_LEN.pack(len(blob)))
        self._out.append(blob)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and not self.closed:
            out, self._out = self._out, []
            assert self.transport is not None  # send() queues nothing before connection_made
            self.transport.write(b"".join(out))

    def close(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.close()


async def connect(sock, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> Channel:
    """Wrap an already connected socket (one end of a socket pair) in a :class:`Channel`."""
    loop = asyncio.get_running_loop()
    _, channel = await loop.create_unix_connection(lambda: Channel(on_message, on_lost), sock=sock)
    return channel
