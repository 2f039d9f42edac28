"""Messages between a front end and the engine process: tuples on a Unix socket pair. The messages
sent in one event-loop turn go out together, as one pickled list behind its length: one system
call and one pickling for a burst of answers instead of one each. (The engine process is the one
every front end shares; pickling each answer alone cost it about 10 us a frame, a quarter of that
in one list, where the classes and functions a message names are written once.)"""

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
            msgs = pickle.loads(memoryview(buf)[pos + 4:pos + 4 + n])
            pos += 4 + n
            for msg in msgs:
                try:
                    self.on_message(msg)
                except Exception:  # one bad message must not take the channel down
                    log.exception("front-end channel: handling %r failed", _head(msg))
        if pos:
            del buf[:pos]

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.on_lost()

    # --- sending -----------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        """Queue ``msg``; it goes out (pickled then) at the end of this loop turn, with the others
        sent in it."""
        if self.closed or self.transport is None:
            return
        self._out.append(msg)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and not self.closed:
            out, self._out = self._out, []
            assert self.transport is not None  # send() queues nothing before connection_made
            self.transport.write(encode(out))

    def close(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.close()


def encode(msgs: list) -> bytes:
    """``msgs`` as one length-prefixed pickled list, or as several where one list cannot be:
    a message that cannot be pickled is logged and dropped alone (its peer's own timer answers
    it), and a list over ``MAX_MESSAGE`` goes as one list per message."""
    try:
        blob = pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        if len(msgs) == 1:
            log.exception("front-end channel: message %r cannot be sent", _head(msgs[0]))
            return b""
        return b"".join(encode([m]) for m in msgs)
    if len(blob) > MAX_MESSAGE and len(msgs) > 1:
        return b"".join(encode([m]) for m in msgs)
    return _LEN.pack(len(blob)) + blob


def _head(msg: Any) -> Any:
    """What a log line names of a message: its kind."""
    return msg[:1] if isinstance(msg, tuple) else msg


async def connect(sock, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> Channel:
    """Wrap an already connected socket (one end of a socket pair) in a :class:`Channel`."""
    loop = asyncio.get_running_loop()
    _, channel = await loop.create_unix_connection(lambda: Channel(on_message, on_lost), sock=sock)
    return channel
