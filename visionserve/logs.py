"""Log lines that name their request: the request id in a context variable, set by the HTTP and
gRPC front ends, added to every record by :class:`RequestIdFilter`; and structured JSON log lines
(``--log-json``), one object per line, for log shippers. :func:`configure_logging` sets up a
serving process (and each front-end process) that way."""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Iterable

#: the id of the request the running code serves (``-`` outside a request)
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

# new request ids: a random prefix per process and a counter, 16 hex digits (uuid4 read the
# kernel's random source for every request)
_id_prefix = os.urandom(5).hex()
_id_counter = itertools.count(1)


def _new_id_prefix() -> None:
    global _id_prefix
    _id_prefix = os.urandom(5).hex()


os.register_at_fork(after_in_child=_new_id_prefix)  # a forked process makes its own ids


def current_request_id() -> str | None:
    """The id of the request the running code serves, None outside a request."""
    rid = request_id.get()
    return None if rid == "-" else rid


def new_request_id() -> str:
    """An id for a request that came without one, unique across the server's processes."""
    return f"{_id_prefix}{next(_id_counter):06x}"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to every log record: the current request's, unless the call named its
    own (``extra=batch_ids(...)`` where one line is about several requests, in the runner
    threads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id.get()
        return True


def batch_ids(items: Iterable) -> dict[str, str]:
    """``extra=`` for a log line about a batch: the request ids of its items (``.request_id``)."""
    ids = dict.fromkeys(getattr(p, "request_id", "-") for p in items)
    return {"request_id": ",".join(ids) or "-"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("request_id", "model", "part_id", "audit"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, as_json: bool) -> None:
    """Every log line of the process to stderr, with its request id; one JSON object per line
    with ``as_json``."""
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
