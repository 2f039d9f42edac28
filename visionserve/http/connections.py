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
  Retry-After (JSON, like every other error); health checks are answered even then.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from ..errors import Unavailable
from ..security import HEALTH_PATHS

log = logging.getLogger(__name__)

REPORT_EVERY_S = 10.0


def protocol_class(header_timeout_s: float, max_connections: int | None,
                   answer_from_head: AnswerFromHead | None = None) -> type:
    """The uvicorn HTTP protocol class for one server: its connections share one table.
    ``answer_from_head(scope)``: the answer to a request that its head decides, or None (see
    :meth:`GuardedHTTPProtocol._start_asgi_task`)."""
    return type("HTTPConnection", (GuardedHTTPProtocol,),
                {"table": ConnectionTable(header_timeout_s, max_connections, answer_from_head)})


# scope -> (status, headers, body) | None
AnswerFromHead = Callable[[dict], "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]


class ConnectionTable:
    """One server's connections with no request in progress, oldest first, and what was cut."""

    def __init__(self, header_timeout_s: float, limit: int | None,
                 answer_from_head: AnswerFromHead | None = None) -> None:
        self.header_timeout_s = header_timeout_s
        self.limit = limit
        self.answer_from_head = answer_from_head
        self.heads: dict[GuardedHTTPProtocol, None] = {}  # waiting for a request head
        self.idle: dict[GuardedHTTPProtocol, None] = {}   # kept alive between requests
        self.closing = 0  # closed here, still counted by uvicorn until their connection_lost
        self._over_limit: OverLimit | None = None
        self._counts: Counter[str] = Counter()
        self._report: asyncio.TimerHandle | None = None

    def full(self, connections: int) -> bool:
        return self.limit is not None and connections - self.closing > self.limit

    def make_room(self, newcomer: GuardedHTTPProtocol) -> None:
        for waiting in (self.heads, self.idle):
            victim = next((c for c in waiting if c is not newcomer), None)
            if victim is not None:
                self.note(f"closed to make room (max_connections {self.limit})")
                victim.give_up(503, "closed to make room for other clients (max_connections); "
                               "retry", retry_after_s=1)
                return

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

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._app = self.app
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False
        self._closing = False
        self._await_head()
        if self.table.full(len(self.connections)):
            self.table.make_room(self)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._between_requests():
            self._await_head()  # the first bytes of the next request on a kept-alive connection
        waiting = self._head_timer is not None
        if waiting:
            self._head_started = True
            full = self.table.full(len(self.connections))
            self.app = self.table.over_limit(self._app) if full else self._app
        cycle = self.cycle
        super().data_received(data)
        if waiting and self.cycle is not cycle:  # the head is complete: a request is in progress
            self._forget()
            if self._between_requests() and not self.transport.is_closing():
                self.table.idle[self] = None  # ... and was answered already, from its head

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._head_timer is None \
                and self._between_requests():
            self.table.idle[self] = None

    # httptools parser callbacks (h11 has none of these): a request's body may still be arriving
    # after its answer (refused from its head); those bytes are no new request head
    def on_message_begin(self) -> None:
        self._in_message = True
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._in_message = False
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete \
                and self._head_timer is None and not self.transport.is_closing():
            self.table.idle[self] = None

    def _start_asgi_task(self, cycle, app) -> None:
        """httptools' protocol starts every request's task here (h11's has no such method, and
        goes on as before). A request that the app answers from its head alone (an overloaded
        model's 503) is answered at once, before any task: under overload most requests end
        here, and that costs the event loop a fraction of a task through the app stack, and the
        answer leaves without waiting for the loop's next turn."""
        answer = None
        if self.table.answer_from_head is not None and app is self._app:
            try:
                answer = self.table.answer_from_head(cycle.scope)
            except Exception:  # a bug there: the app serves the request as usual
                log.exception("answering a request from its head failed; the app serves it")
        if answer is None:
            super()._start_asgi_task(cycle, app)
        else:
            self._answer_now(cycle, *answer)

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
            self.transport.close()
        cycle.on_response()

    def connection_lost(self, exc) -> None:
        self._forget()
        if self._closing:
            self.table.closing -= 1
        super().connection_lost(exc)

    def give_up(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        """Close this connection (it has no request in progress); if part of a request head had
        come, answer it first."""
        started = self._head_started
        self._forget()
        if started and not self.transport.is_closing():
            body = json.dumps({"error": message}).encode()
            head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
                    "content-type: application/json", f"content-length: {len(body)}",
                    "connection: close"]
            if retry_after_s is not None:
                head.append(f"retry-after: {retry_after_s}")
            self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        self.transport.close()
        if not self._closing:
            self._closing = True
            self.table.closing += 1

    def _between_requests(self) -> bool:
        return not self._in_message and (self.cycle is None or self.cycle.response_complete)

    def _await_head(self) -> None:
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
