"""One error hierarchy for the whole server, and the one table that maps it to the wire.

Front ends catch :class:`VisionServeError` and translate it with :func:`http_status` /
:func:`grpc_code`; anything else that escapes is a bug and is answered as a generic 500 without
a traceback (the traceback goes to the log).
"""

from __future__ import annotations

import math
from typing import Any


class VisionServeError(Exception):
    """Base class. ``message`` is safe to show to a client."""

    #: key into :data:`STATUS_TABLE`
    kind = "internal"

    #: True once the request this error answers is in the metrics (``Engine.count_error``): the
    #: engine counts what it answers; a front end counts the rest (its own parsing errors), once
    counted = False

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidInput(VisionServeError):
    """The request is malformed: bad image, wrong tensor name/shape/datatype, bad header."""

    kind = "invalid_input"


class PayloadTooLarge(VisionServeError):
    """Body or declared image size over the configured limit."""

    kind = "too_large"


class UnsupportedMediaType(VisionServeError):
    kind = "unsupported_media_type"


class NotFound(VisionServeError):
    """Unknown model or version."""

    kind = "not_found"


class Unavailable(VisionServeError):
    """Not ready, shutting down, or the queue is full (then ``retry_after_s`` is set)."""

    kind = "unavailable"

    @classmethod
    def shutting_down(cls) -> Unavailable:
        return cls("the server is shutting down; send to another instance", retry_after_s=1.0)


class DeadlineExceeded(VisionServeError):
    """The request's deadline passed before its answer was ready (verdict ``LATE``): in the
    queue, during decode, or during compute (a verdict after the deadline is no decision for a
    PLC, so it is not given). ``late_ms``: how long after the deadline that was found."""

    kind = "deadline"

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 late_ms: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.late_ms = late_ms


class RequestTimeout(VisionServeError):
    """The client did not send its request in time (slow body)."""

    kind = "request_timeout"


class Conflict(VisionServeError):
    """The request cannot be done in the server's present state: a model load or unload that the
    model control mode does not allow, the unload of a model in use, a swap that does not fit
    the GPU memory budget, a frame for another model than its station's recipe, a recipe switch
    that would change the verdict settings under another station. Nothing was changed."""

    kind = "conflict"


class Unauthenticated(VisionServeError):
    kind = "unauthenticated"


class ConfigError(VisionServeError):
    """A settings value or a ``model.toml`` field is wrong; the message names file and field."""

    kind = "config"


#: what a client is told of a fault inside the server (the details go to the log)
INTERNAL_MESSAGE = "internal server error; see the server log"


class InternalError(VisionServeError):
    """A fault inside the server (backend failure, device fault). Never carries a traceback."""

    kind = "internal"


# kind -> (HTTP status, gRPC status code name). gRPC names are grpc.StatusCode member names, kept
# as strings so this module imports nothing heavy.
STATUS_TABLE: dict[str, tuple[int, str]] = {
    "invalid_input": (400, "INVALID_ARGUMENT"),
    "too_large": (413, "RESOURCE_EXHAUSTED"),
    "unsupported_media_type": (415, "INVALID_ARGUMENT"),
    "not_found": (404, "NOT_FOUND"),
    "unavailable": (503, "UNAVAILABLE"),
    "deadline": (504, "DEADLINE_EXCEEDED"),
    "request_timeout": (408, "DEADLINE_EXCEEDED"),
    "unauthenticated": (401, "UNAUTHENTICATED"),
    "conflict": (409, "FAILED_PRECONDITION"),
    "config": (500, "FAILED_PRECONDITION"),
    "internal": (500, "INTERNAL"),
}


def http_status(exc: VisionServeError) -> int:
    return STATUS_TABLE[exc.kind][0]


def grpc_code(exc: VisionServeError) -> str:
    """The ``grpc.StatusCode`` member name for ``exc`` (e.g. ``"INVALID_ARGUMENT"``)."""
    return STATUS_TABLE[exc.kind][1]


def retry_after(exc: VisionServeError) -> str | None:
    """When to try again, for the HTTP ``Retry-After`` header and gRPC's ``retry-after`` trailing
    metadata: whole seconds, at least 1; None when the error names no time."""
    if exc.retry_after_s is None:
        return None
    return str(max(1, math.ceil(exc.retry_after_s)))


def describe_validation(exc: Any, *, empty: str = "", flag: bool = False, field: bool = False,
                        got: bool = False) -> list[str]:
    """One line per error of a pydantic ``ValidationError`` (or FastAPI's
    ``RequestValidationError``): where, then what.

    Where: the error's location, dotted (``input.width``), or ``empty`` when it has none; with
    ``flag``, as the command-line option (``--max-batch-size``); with ``field``, quoted as a
    model.toml field (``field 'input.width'``), and "unknown field" / "required" in place of
    pydantic's words for those two. ``got`` adds the value given (not to a missing field).
    """
    lines = []
    for err in exc.errors():
        parts = [str(p) for p in err["loc"]]
        where = "--" + "-".join(parts).replace("_", "-") if flag else ".".join(parts) or empty
        msg = err["msg"]
        if field:
            where = f"field '{where}'"
            if err["type"] == "missing":
                lines.append(f"{where}: required")
                continue
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
        lines.append(f"{where}: {msg} (got {err.get('input')!r})" if got else f"{where}: {msg}")
    return lines
