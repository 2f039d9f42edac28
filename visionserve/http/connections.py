"""HTTP connections that a slow or idle client cannot hold: a deadline for the request head, and
a connection limit that makes room instead of locking everyone out.

uvicorn has no header-read timeout: a client that sends its request head a byte at a time
(slowloris), or nothing at all, holds its connection for ever, and 1,000 of them (the default
``max_connections``) made every other request fail with a plain-text 503, health checks included.
Here, as in nginx:

- the request head (request line and headers) must be complete within ``header_timeout_s`` of the
  connection opening, or of the first byte of a later request on a kept-alive one; else the
  connection is closed (with a 408 if part of a head had come);
- past ``max_connections``, the connection that has waited longest for its request head, else the
  one idle longest between requests, is closed to make room: slow clients cannot lock real ones
  out, and the open sockets stay bounded. A connection with a request in progress is never closed;
- only when every connection has a request in progress does a new request get 503 with
  Retry-After (JSON, like every other error); health checks are answered even then;
- a connection whose answer is a stream that stays open (``STREAM_PATHS``: the live results) is
  not counted once its request head has come: those streams have their own limit
  (``max_live_streams``, kept by the live feed), and the connections of requests stay bounded
  by ``max_connections`` as before.

A request cannot hold its connection by sending its body slowly either:

- a request head larger than ``MAX_HEAD_BYTES`` is answered 431 and its connection closed;
- a request body must keep arriving at ``min_body_rate_bytes_s`` on average (after a
  ``BODY_GRACE_S`` start): a slower one is answered 408 and its connection closed; when the limit
  is full, a connection whose body has been arriving slower than that for ``BODY_EVICT_AFTER_S``
  is closed at once to make room;
- a request answered before its body has all arrived (401, 408, 413, 503 ...) is not kept alive:
  the server stops reading it as a request, sends its end of the connection, and closes it when
  the client does, or after ``LINGER_S`` (a lingering close, as nginx does, so that the client can
  read its answer instead of a reset); such a connection is the first to go to make room.
"""

from __future__ import annotations

import asyncio
import ctypes
import http
import json
import logging
import socket
import ssl
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from ..errors import Unavailable
from ..security import HEALTH_PATHS, STREAM_PATHS

log = logging.getLogger(__name__)

REPORT_EVERY_S = 10.0
#: the largest request head (request line and headers); nginx allows 32 KiB, Apache about 8 KiB a
#: line: no client of this server sends more than a few hundred bytes
MAX_HEAD_BYTES = 64 * 1024
#: a request body's first seconds do not count against its minimum rate (a TCP retransmit, a
#: client's pause before its upload)
BODY_GRACE_S = 2.0
#: how long a body must have arrived slower than the minimum rate before it can be closed to make
#: room for a new connection
BODY_EVICT_AFTER_S = 0.5
#: how often the bodies in flight are checked against the minimum rate
BODY_CHECK_S = 0.25
#: the longest a connection answered before its body arrived is kept to read (and drop) the rest
LINGER_S = 2.0
#: at shutdown, after the drain: the listener stays open while connections keep coming (each
#: answered, 503 while shutting down), until none came for CLOSE_QUIET_S or CLOSE_GRACE_S passed.
#: Closing it at once resets the connections the kernel has accepted but the server has not yet
#: taken from its backlog: their clients see a disconnect without an answer (the last close is
#: :func:`refuse_until_quiet`'s)
CLOSE_GRACE_S = 1.0
CLOSE_QUIET_S = 0.25
#: at shutdown, how long a connection that opened but has not sent its whole request head may
#: still send it (and get its answer) before it is closed
SHUTDOWN_HEAD_WAIT_S = 1.0
#: Linux's SO_ATTACH_FILTER (the socket module does not name it)
SO_ATTACH_FILTER = 26
#: a classic BPF program for a listening TCP socket (code, jt, jf, k): drop a segment with SYN set
#: and ACK not (a new connection's first), keep every other one; a TCP socket's filter sees the
#: segment from its TCP header on, whose byte 13 holds the flags
_NO_NEW_CONNECTIONS = ((0x30, 0, 0, 13),          # ldb [13]
                       (0x54, 0, 0, 0x12),        # and #(SYN|ACK)
                       (0x15, 0, 1, 0x02),        # jeq #SYN, drop, keep
                       (0x06, 0, 0, 0),           # drop: ret #0
                       (0x06, 0, 0, 0xFFFFFFFF))  # keep: ret #all


def protocol_class(header_timeout_s: float, max_connections: int | None,
                   answer_from_head: AnswerFromHead | None = None,
                   min_body_rate: float = 0.0) -> type:
    """The uvicorn HTTP protocol class for one server: its connections share one table.
    ``answer_from_head(scope)``: the answer to a request that its head decides, or None (see
    :meth:`GuardedHTTPProtocol._start_asgi_task`); ``min_body_rate``: bytes/s, 0 for none."""
    return type("HTTPConnection", (GuardedHTTPProtocol,),
                {"table": ConnectionTable(header_timeout_s, max_connections, answer_from_head,
                                          min_body_rate)})


# scope -> (status, headers, body) | None
AnswerFromHead = Callable[[dict], "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]


class ConnectionTable:
    """One server's connections with no request in progress, oldest first, and what was cut."""

    def __init__(self, header_timeout_s: float, limit: int | None,
                 answer_from_head: AnswerFromHead | None = None,
                 min_body_rate: float = 0.0) -> None:
        self.header_timeout_s = header_timeout_s
        self.limit = limit
        self.answer_from_head = answer_from_head
        self.min_body_rate = min_body_rate
        self.heads: dict[GuardedHTTPProtocol, None] = {}  # waiting for a request head
        self.idle: dict[GuardedHTTPProtocol, None] = {}   # kept alive between requests
        self.bodies: dict[GuardedHTTPProtocol, None] = {}  # a request body still arriving
        self.lingering: dict[GuardedHTTPProtocol, None] = {}  # answered, the body still coming
        self.streams: dict[GuardedHTTPProtocol, None] = {}  # answering a stream (not counted)
        self.last_connection = 0.0  # loop time of the latest connection
        self.shutting_down = False
        self._body_check: asyncio.TimerHandle | None = None
        self.closing = 0  # closed here, still counted by uvicorn until their connection_lost
        self._over_limit: OverLimit | None = None
        self._counts: Counter[str] = Counter()
        self._report: asyncio.TimerHandle | None = None

    def full(self, connections: int) -> bool:
        return self.limit is not None and \
            connections - self.closing - len(self.streams) > self.limit

    def make_room(self, newcomer: GuardedHTTPProtocol) -> None:
        victim = next(iter(self.lingering), None)
        if victim is not None:  # answered already: only the rest of its body is read
            victim.drop()
            return
        for waiting in (self.heads, self.idle):
            victim = next((c for c in waiting if c is not newcomer), None)
            if victim is not None:
                self.note(f"closed to make room (max_connections {self.limit})")
                victim.give_up(503, "closed to make room for other clients (max_connections); "
                               "retry", retry_after_s=1)
                return
        slow = self.slow_bodies(BODY_EVICT_AFTER_S)
        if slow:
            self.note(f"closed to make room (max_connections {self.limit}): body slower than "
                      "min_body_rate_bytes_s")
            min(slow, key=lambda c: c.body_rate()).cut_body(
                f"closed to make room for other clients: the request body arrived slower than "
                f"{self.min_body_rate:g} bytes/s (setting min_body_rate_bytes_s)")

    async def quiet(self) -> None:
        """Return once no connection came for CLOSE_QUIET_S, or after CLOSE_GRACE_S."""
        loop = asyncio.get_running_loop()
        end = loop.time() + CLOSE_GRACE_S
        while loop.time() < end and loop.time() - self.last_connection < CLOSE_QUIET_S:
            await asyncio.sleep(0.05)

    def slow_bodies(self, after_s: float) -> list[GuardedHTTPProtocol]:
        """The connections whose body has been arriving for ``after_s`` at least, and on average
        slower than the minimum rate since then."""
        if not self.min_body_rate:
            return []
        now = asyncio.get_running_loop().time()
        return [c for c in self.bodies if c.body_behind(now, after_s, self.min_body_rate)]

    def body_started(self, connection: GuardedHTTPProtocol) -> None:
        self.bodies[connection] = None
        if self.min_body_rate and self._body_check is None:
            self._body_check = asyncio.get_running_loop().call_later(BODY_CHECK_S,
                                                                     self._check_bodies)

    def _check_bodies(self) -> None:
        self._body_check = None
        for c in self.slow_bodies(BODY_GRACE_S):
            self.note(f"answered 408: request body slower than {self.min_body_rate:g} bytes/s")
            c.cut_body(f"the request body arrived slower than {self.min_body_rate:g} bytes/s "
                       "(setting min_body_rate_bytes_s)")
        if self.bodies:
            self._body_check = asyncio.get_running_loop().call_later(BODY_CHECK_S,
                                                                     self._check_bodies)

    def over_limit(self, app):
        if self._over_limit is None:
            self._over_limit = OverLimit(app, self)
        return self._over_limit

    def note(self, what: str) -> None:
        """Count what was cut; one log line per REPORT_EVERY_S, not one per connection."""
        self._counts[what] += 1
        if self._report is None:
            self._report = asyncio.get_running_loop().call_later(REPORT_EVERY_S, self._log)

    def _log(self) -> None:
        self._report = None
        counts, self._counts = self._counts, Counter()
        log.warning("slow or surplus HTTP clients in the last %g s: %s", REPORT_EVERY_S,
                    "; ".join(f"{n} {what}" for what, n in counts.items()))


class OverLimit:
    """The app for a request that comes when every connection has a request in progress."""

    def __init__(self, app, table: ConnectionTable) -> None:
        self.app = app
        self.table = table

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in HEALTH_PATHS:
            await self.app(scope, receive, send)  # probes keep telling the truth
            return
        from .common import error_response

        self.table.note("answered 503: every connection had a request in progress")
        response = error_response(Unavailable(
            f"every one of the {self.table.limit} connections has a request in progress "
            "(max_connections); retry", retry_after_s=1))
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools, else h11) with the head deadline and the room-making
    limit above. Both parsers share what this uses: ``cycle`` (the request in progress), ``app``
    (read when a head completes), ``connections`` and the connection callbacks."""

    table: ConnectionTable
    app: Any  # the ASGI app; uvicorn's protocol sets it
    _in_message = False  # httptools: between a request's first byte and its body's last
    _head_size = 0  # httptools: the request line and headers parsed so far
    _too_large = False  # the request head is over MAX_HEAD_BYTES: it is answered 431
    _keep_alive = True  # what the request in progress asked for, while its body arrives
    _answer: tuple | None = None  # (cycle, status, headers, body) of an answer from the head

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._app = self.app
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False
        self._head_bytes = 0  # bytes received while the request head was incomplete
        self._closing = False
        self._linger: asyncio.TimerHandle | None = None
        self._body_at = 0.0  # when the request body started to count against the minimum rate
        self._body_bytes = 0
        self._opened = self.table.last_connection = self.loop.time()
        self._await_head()
        if self.table.full(len(self.connections)):
            self.table.make_room(self)

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # the rest of a request that was answered already: dropped
        if self._head_timer is None and self._between_requests():
            self._await_head()  # the first bytes of the next request on a kept-alive connection
        waiting = self._head_timer is not None
        if waiting:
            self._head_started = True
            self._head_bytes += len(data)
            full = self.table.full(len(self.connections))
            self.app = self.table.over_limit(self._app) if full else self._app
        cycle = self.cycle
        super().data_received(data)
        if self._answer is not None:  # decided from a head in this data: see _start_asgi_task
            answer, self._answer = self._answer, None
            self._answer_now(*answer)
        if self._too_large or (waiting and self.cycle is cycle
                               and self._head_bytes > MAX_HEAD_BYTES):
            if not self.transport.is_closing():
                self.table.note("answered 431: request head too large")
                self.give_up(431, f"the request head is over {MAX_HEAD_BYTES} bytes",
                             linger=True)
            return
        if waiting and self.cycle is not cycle:  # the head is complete: a request is in progress
            self._forget()
            if self.transport.is_closing() or self._linger is not None:
                return
            if self.cycle.scope["path"] in STREAM_PATHS and not self.cycle.response_complete:
                self.table.streams[self] = None
            if self._between_requests():
                self.table.idle[self] = None  # ... and was answered already, from its head
            elif self._in_message and not self.cycle.response_complete:
                self.table.body_started(self)  # ... and its body is still arriving

    def on_response_complete(self) -> None:
        self.table.streams.pop(self, None)
        super().on_response_complete()
        if not self.transport.is_closing() and self._head_timer is None \
                and self._between_requests():
            self.table.idle[self] = None

    # httptools parser callbacks (h11 has none of these): a request's body may still be arriving
    # after its answer (refused from its head); those bytes are no new request head
    def on_message_begin(self) -> None:
        self._in_message = True
        self._head_size = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._too_large or self._head_size > MAX_HEAD_BYTES:
            self._too_large = True  # answered 431 (data_received): no request starts
            return
        self._body_at, self._body_bytes = self.loop.time(), 0
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:
            # until its body has arrived, an answer to this request ends the connection (with
            # "connection: close"), in a lingering close; on_message_complete undoes this
            self._keep_alive = self.cycle.keep_alive and not self.table.shutting_down
            self.cycle.keep_alive = False
            self.cycle.transport = _LingeringClose(self)

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        self.table.bodies.pop(self, None)
        if self._too_large:
            return
        cycle = self.cycle
        if cycle is not None and isinstance(cycle.transport, _LingeringClose):
            cycle.transport = self.transport
            if not cycle.response_started:
                cycle.keep_alive = self._keep_alive
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete \
                and self._head_timer is None and not self.transport.is_closing() \
                and self._linger is None:
            self.table.idle[self] = None

    def _start_asgi_task(self, cycle, app) -> None:
        """httptools' protocol starts every request's task here (h11's has no such method, and
        goes on as before). A request that the app answers from its head alone (an overloaded
        model's 503) is answered without a task, as soon as the parser is through the data that
        held the head: under overload most requests end here, and that costs the event loop a
        fraction of a task through the app stack, and the answer leaves without waiting for the
        loop's next turn."""
        answer = None
        if self.table.answer_from_head is not None and app is self._app:
            try:
                answer = self.table.answer_from_head(cycle.scope)
            except Exception:  # a bug there: the app serves the request as usual
                log.exception("answering a request from its head failed; the app serves it")
        if answer is None:
            super()._start_asgi_task(cycle, app)
        else:  # once the parser is through this data: whether the body came with it decides
            self._answer = (cycle, *answer)  # if the connection stays open (see linger())

    def _answer_now(self, cycle, status: int, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> None:
        """Write a whole response for ``cycle`` and end it as uvicorn's ``send`` would."""
        lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode("latin-1")]
        for name, value in [*cycle.default_headers, *headers]:
            if name.lower() != b"content-length":
                lines.append(b"%s: %s\r\n" % (name, value))
        lines.append(b"content-length: %d\r\n" % len(body))
        if not cycle.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        self.transport.write(b"".join(lines) + body)
        cycle.response_started = cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown (the listener is closed by now). A connection that has
        begun its request head, or opened a moment ago (its request may be on the way), is not
        closed unanswered: its request gets its answer (503 while shutting down) and the
        connection closes after it; one that sends nothing more is closed after
        SHUTDOWN_HEAD_WAIT_S. The rest close as uvicorn closes them."""
        self.table.shutting_down = True
        if self._linger is not None:
            return  # it closes by itself
        timer = self._head_timer
        if timer is not None and (self._head_started
                                  or self.loop.time() - self._opened < SHUTDOWN_HEAD_WAIT_S):
            timer.cancel()
            wait = min(SHUTDOWN_HEAD_WAIT_S, max(0.0, timer.when() - self.loop.time()))
            self._head_timer = self.loop.call_later(wait, self._head_timed_out)
            return
        super().shutdown()

    def connection_lost(self, exc) -> None:
        self._forget()
        self.table.bodies.pop(self, None)
        self.table.lingering.pop(self, None)
        self.table.streams.pop(self, None)
        if self._linger is not None:
            self._linger.cancel()
        if self._closing:
            self.table.closing -= 1
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        if self._linger is not None:  # the client has sent all it will: the lingering close ends
            self.drop()
        return super().eof_received()

    def give_up(self, status: int, message: str, retry_after_s: int | None = None,
                linger: bool = False) -> None:
        """Close this connection (it has no request in progress); if part of a request head had
        come, answer it first. ``linger``: the client may still be sending (see :meth:`linger`)."""
        started = self._head_started
        self._forget()
        if started and not self.transport.is_closing():
            self._write_error(status, message, retry_after_s)
        if linger:
            self.linger()
        else:
            self.drop()

    def cut_body(self, message: str) -> None:
        """End the request whose body arrives too slowly: 408 unless it was answered already; the
        app reading it sees the client gone."""
        self.table.bodies.pop(self, None)
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        if not cycle.response_started:
            self._write_error(408, message, None)
            cycle.response_started = cycle.response_complete = True
        cycle.disconnected = True  # what the app sends from now on is dropped
        cycle.message_event.set()
        self.linger()

    def linger(self) -> None:
        """Close a connection whose client may still be sending a body that nobody reads, without
        a reset that could destroy the answer before the client reads it: send our end now, drop
        what comes, and close when the client does or after LINGER_S."""
        if self._linger is not None or self.transport.is_closing():
            return
        self._forget()
        self.table.bodies.pop(self, None)
        self.table.lingering[self] = None
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.drop)

    def drop(self) -> None:
        """Close the connection now."""
        self.table.lingering.pop(self, None)
        self.transport.close()
        if not self._closing:
            self._closing = True
            self.table.closing += 1

    def body_behind(self, now: float, after_s: float, rate: float) -> bool:
        """Whether the request body has arrived slower than ``rate`` bytes/s, counting from
        ``after_s`` after it started. Time in which the server itself was not reading (its
        buffer full, or a ``100 Continue`` not yet sent) is the server's, not the client's."""
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            self._body_at, self._body_bytes = now, 0
            return False
        elapsed = now - self._body_at
        return elapsed >= after_s and self._body_bytes < rate * (elapsed - after_s)

    def body_rate(self) -> float:
        return self._body_bytes / max(1e-3, self.loop.time() - self._body_at)

    def _write_error(self, status: int, message: str, retry_after_s: int | None) -> None:
        self.transport.write(error_response_bytes(status, message, retry_after_s))

    def _between_requests(self) -> bool:
        return not self._in_message and (self.cycle is None or self.cycle.response_complete)

    def _await_head(self) -> None:
        self._head_bytes = 0
        self.table.idle.pop(self, None)
        self.table.heads[self] = None
        self._head_timer = self.loop.call_later(self.table.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        seconds = f"{self.table.header_timeout_s:g} s"
        self.table.note(f"closed: no request head within {seconds}")
        self.give_up(408, f"the request head did not arrive within {seconds} (setting "
                          "header_timeout_s)")

    def _forget(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_started = False
        self.table.heads.pop(self, None)
        self.table.idle.pop(self, None)


def error_response_bytes(status: int, message: str, retry_after_s: int | None) -> bytes:
    """A whole JSON error response that closes its connection."""
    body = json.dumps({"error": message}).encode()
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _RefusedAtShutdown(asyncio.Protocol):
    """A connection taken from the listener once no front end serves it: its request gets 503
    with Retry-After as soon as its head has come (or it is closed after SHUTDOWN_HEAD_WAIT_S
    without one); the connection closes when the client's end does, or after LINGER_S."""

    def __init__(self, seen: _Refusals) -> None:
        self.seen = seen
        self.head = b""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.seen.open.add(self)
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(SHUTDOWN_HEAD_WAIT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.head is None or self.transport is None:
            return  # answered: the rest is dropped
        self.head += data
        if b"\r\n\r\n" not in self.head and len(self.head) <= MAX_HEAD_BYTES:
            return
        self.head = None  # type: ignore[assignment]
        self.transport.write(error_response_bytes(
            503, "the server is shutting down; retry", retry_after_s=1))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # a lingering close: no reset before the client reads
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc) -> None:
        self.seen.open.discard(self)
        if self.timer is not None:
            self.timer.cancel()


class _Refusals:
    """The connections :func:`refuse_until_quiet` took from its listener."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tls: ssl.SSLContext | None) -> None:
        self.loop = loop
        self.tls = tls
        self.last = loop.time()  # loop time of the latest connection
        self.starting: set[asyncio.Task] = set()  # TLS handshakes under way
        self.open: set[_RefusedAtShutdown] = set()

    def take_all(self, sock: socket.socket) -> None:
        """Take every connection queued on the (non-blocking) listener ``sock``."""
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # its client gave up while it was queued
                continue
            except OSError as exc:  # out of file descriptors: the rest stay queued a moment
                log.warning("shutdown: cannot take a queued connection: %s", exc)
                return
            self.last = self.loop.time()
            task = self.loop.create_task(self.loop.connect_accepted_socket(
                lambda: _RefusedAtShutdown(self), conn, ssl=self.tls,
                ssl_handshake_timeout=SHUTDOWN_HEAD_WAIT_S if self.tls else None))
            self.starting.add(task)
            task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task) -> None:
        self.starting.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a failed TLS handshake
            log.debug("shutdown: a connection ended before its answer: %s", task.exception())


def shut_the_door(sock: socket.socket) -> bool:
    """From now on the kernel drops the first packet (SYN) of every new connection to the
    listening ``sock``: its client sends it again a second later and finds the port closed (its
    connect is refused: nothing was accepted). Connections the kernel accepted already, or whose
    handshake is under way, still join the backlog. Closing a listener resets the connections in
    its backlog, and connections keep coming; with the door shut first, the backlog can be
    emptied for good before the close. False where the system cannot do it (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    prog = (_BpfInsn * len(_NO_NEW_CONNECTIONS))(*(_BpfInsn(*i) for i in _NO_NEW_CONNECTIONS))
    try:  # the kernel copies the program: it need not outlive the call
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(_BpfProg(len(prog), prog)))
    except OSError as exc:
        log.warning("shutdown: cannot stop new connections before the listener closes: %s", exc)
        return False
    return True


class _BpfInsn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _BpfProg(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_BpfInsn))]


async def refuse_until_quiet(sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
    """At shutdown, in the last process that holds the listening socket ``sock`` (its HTTP
    server has stopped taking connections): answer what is left in its backlog and what still
    comes 503 (see :class:`_RefusedAtShutdown`; over TLS when ``tls``), until no connection came
    for CLOSE_QUIET_S or CLOSE_GRACE_S passed; then shut the door (:func:`shut_the_door`), take
    what the kernel queued until then, close the listener and let the last answers go out."""
    loop = asyncio.get_running_loop()
    seen = _Refusals(loop, tls)
    sock.setblocking(False)
    loop.add_reader(sock.fileno(), seen.take_all, sock)
    try:
        end = loop.time() + CLOSE_GRACE_S
        while loop.time() < end and loop.time() - seen.last < CLOSE_QUIET_S:
            await asyncio.sleep(0.05)
        if shut_the_door(sock):  # the handshakes under way join the backlog and are taken
            await asyncio.sleep(CLOSE_QUIET_S)
    finally:
        loop.remove_reader(sock.fileno())
    seen.take_all(sock)  # the backlog is empty now, and nothing new can join it
    sock.close()
    end = loop.time() + SHUTDOWN_HEAD_WAIT_S + LINGER_S  # the heads on their way, the answers
    while (seen.open or seen.starting) and loop.time() < end:
        await asyncio.sleep(0.05)
    for task in list(seen.starting):
        task.cancel()
    for c in list(seen.open):
        if c.transport is not None:
            c.transport.close()


class _LingeringClose:
    """The transport as a request's cycle sees it while the request's body is still arriving:
    uvicorn closes it after an answer that was not to be kept alive, and here that close is the
    protocol's lingering close (:meth:`GuardedHTTPProtocol.linger`)."""

    def __init__(self, protocol: GuardedHTTPProtocol) -> None:
        self._protocol = protocol
        self._transport = protocol.transport

    def write(self, data: bytes) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._protocol.linger()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
