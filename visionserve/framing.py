"""One message framing for every process boundary of the server: a message is its pickle behind
its length, on a Unix stream socket.

Two ways to drive it:

* **Blocking**, between the serving process and its batch worker processes
  (:mod:`visionserve.execution`): a message (:func:`pack`) is one pickled head behind an 8-byte
  length, then the raw buffers the head describes (a batch's frames), all sent in one
  ``sendmsg``; :class:`Reader` takes a message in usually one ``recv_into``. The event loop drives
  the same format on a non-blocking socket (:func:`trim` what a send took, :func:`messages` out of
  what came in).
* **asyncio**, between a front-end process and the engine's hub, and between the PLC child and
  its service: :class:`Channel`. The messages sent in one event-loop turn go out together, as
  one pickled list behind a 4-byte length (:func:`encode`): one system call and one pickling
  for a burst of answers instead of one each. (The engine process is the one every front end
  shares; pickling each answer alone cost it about 10 us a frame, a quarter of that in one list,
  where the classes and functions a message names are written once.)
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

#: the length before a blocking message's pickled head
HEAD = struct.Struct("<Q")
#: the length before a channel's pickled list of messages
_LIST_LEN = struct.Struct("<I")
#: the largest list a channel accepts (a larger one closes the channel)
MAX_MESSAGE = 1 << 30


class FramingError(Exception):
    """The other side sent what the framing does not allow."""


# --- blocking ------------------------------------------------------------------------------------
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


def pack(head: Any, buffers: Sequence[Any] = ()) -> list[memoryview]:
    """A message: ``head`` pickled behind its length, then ``buffers`` as they are."""
    blob = pickle.dumps(head, protocol=pickle.HIGHEST_PROTOCOL)
    parts = [memoryview(HEAD.pack(len(blob))), memoryview(blob)]
    parts += [memoryview(b).cast("B") for b in buffers]
    return parts


def trim(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``parts`` after ``sent`` bytes went out."""
    k = 0
    while k < len(parts) and sent >= len(parts[k]):
        sent -= len(parts[k])
        k += 1
    rest = parts[k:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest


def send(sock: socket.socket, head: Any, buffers: Sequence[Any] = ()) -> None:
    """A message in one ``sendmsg``."""
    send_parts(sock, pack(head, buffers))


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """``parts`` in one ``sendmsg`` (more only if a signal or the time limit cut it short)."""
    while parts:
        parts = trim(parts, sock.sendmsg(parts))


def recv_exact(sock: socket.socket, into: memoryview) -> None:
    pos, n = 0, len(into)
    while pos < n:
        got = sock.recv_into(into[pos:], n - pos)
        if not got:
            raise EOFError("the other side closed the channel")
        pos += got


def read_head(sock: socket.socket) -> Any:
    """A message's head, read exactly: the buffers that follow it stay on the socket."""
    size = bytearray(HEAD.size)
    recv_exact(sock, memoryview(size))
    blob = bytearray(HEAD.unpack(size)[0])
    recv_exact(sock, memoryview(blob))
    return pickle.loads(blob)


class Reader:
    """Messages from a socket on which at most one is on its way at a time (an answer to a
    request, a request to the worker): usually one ``recv_into`` each."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(1 << 16)

    def message(self) -> Any:
        view = memoryview(self.buf)
        got = 0
        while got < HEAD.size:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise EOFError("the other side closed the channel")
            got += n
        (size,) = HEAD.unpack_from(self.buf)
        end = HEAD.size + size
        if end > len(self.buf):  # a larger message: the buffer grows (let go of its view first)
            view.release()
            self.buf.extend(bytes(end - len(self.buf)))
            view = memoryview(self.buf)
        if got < end:
            recv_exact(self.sock, view[got:end])
        elif got > end:
            raise FramingError(f"{got - end} bytes beyond the message")
        return pickle.loads(view[HEAD.size:end])


def messages(buf: bytearray) -> Iterator[Any]:
    """The whole messages (heads without buffers) at the start of ``buf``, what a non-blocking
    socket brought in; each is taken off ``buf`` before it is yielded, and what is left of a
    message still on its way stays there."""
    while len(buf) >= HEAD.size:
        (n,) = HEAD.unpack_from(buf)
        if len(buf) < HEAD.size + n:
            return
        msg = pickle.loads(memoryview(buf)[HEAD.size:HEAD.size + n])
        del buf[:HEAD.size + n]
        yield msg


# --- asyncio -------------------------------------------------------------------------------------

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
            (n,) = _LIST_LEN.unpack_from(buf, pos)
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
    return _LIST_LEN.pack(len(blob)) + blob


def _head(msg: Any) -> Any:
    """What a log line names of a message: its kind."""
    return msg[:1] if isinstance(msg, tuple) else msg


async def connect(sock, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> Channel:
    """Wrap an already connected socket (one end of a socket pair) in a :class:`Channel`."""
    loop = asyncio.get_running_loop()
    _, channel = await loop.create_unix_connection(lambda: Channel(on_message, on_lost), sock=sock)
    return channel
