"""The live results, for the console: ``GET /v1/live`` (Server-Sent Events) and
``GET /v1/live/summary``.

``GET /v1/live?model=&station=`` answers ``text/event-stream``: first the kept events of that
filter (the last ones of each model; after ``Last-Event-ID`` when the browser reconnects), then
every answer as it happens, each as one ``data:`` line of JSON with its ``id:``. A comment line
every ``HEARTBEAT_S`` keeps proxies from closing a quiet stream. A browser that reads slower
than the line answers loses its oldest events and is told with an ``event: dropped``; at
shutdown the stream gets an ``event: shutdown`` and ends. The streams of the whole server are
limited (``--max-live-streams``; past it 503 with Retry-After); they do not count against
``--max-connections`` (:mod:`.connections`). The data plane's feed does the rest
(:mod:`visionserve.livefeed`); this only translates.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from functools import lru_cache

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from ..errors import Unavailable
from ..livefeed import WINDOW_MIN, LiveEvent, LiveStream
from .common import engine_of
from .schemas import ERRORS

router = APIRouter(tags=["Live results"])

#: a comment line after this long without an event
HEARTBEAT_S = 15.0
#: how long a browser waits before it reconnects a stream that ended (the SSE ``retry:``)
RECONNECT_MS = 2000
#: events whose encoding is kept for the other streams of this process that send them too
ENCODED = 4096


class SummaryMinute(BaseModel):
    minute: int = Field(..., description="The minute's start, epoch seconds.")
    ok: int
    ng: int
    late: int
    refused: int
    error: int
    p50_ms: float | None = Field(..., description="Arrival to answer of OK, NG and LATE frames "
                                                  "(5 % bins); null without any.")
    p99_ms: float | None


class Summary(BaseModel):
    model: str
    takt_ms: float = Field(..., description="The model's takt: the default deadline.")
    minutes: list[SummaryMinute] = Field(..., description="Oldest first, the current minute "
                                                          "last.")
    since: float | None = Field(..., description="Since when the server keeps the answers "
                                                 "(epoch seconds): from the first console that "
                                                 "listened; null before.")


_STREAM = {200: {"description": "Server-Sent Events: one `data:` JSON line per answer, with "
                                "its `id:`", "content": {"text/event-stream": {}}},
           **ERRORS}


@router.get("/v1/live", summary="Every answer as it happens (Server-Sent Events)",
            response_class=StreamingResponse, responses=_STREAM)
async def live(request: Request,
               model: str | None = Query(None, description="Only this model's answers."),
               station: str | None = Query(None, description="Only this station's answers.")
               ) -> StreamingResponse:
    engine = engine_of(request)
    if model:
        engine.entry(model)  # 404 for a model the repository does not hold
    replay, stream = await engine.feed.open(model or None, station or None,
                                            request.headers.get("last-event-id"))
    try:
        return StreamingResponse(sse(replay, stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})
    except BaseException:
        stream.close()
        raise


async def sse(replay: Sequence[LiveEvent], stream: LiveStream,
              heartbeat_s: float = HEARTBEAT_S) -> AsyncIterator[bytes]:
    """The stream's bytes: the replay, then what comes; the stream is closed when it ends
    (the browser left, or the server shuts down)."""
    try:
        yield f"retry: {RECONNECT_MS}\n\n".encode() + _events(replay)
        while True:
            got = await stream.next(heartbeat_s)
            if got is None:
                yield _event("shutdown", {"message": "the server is shutting down"})
                return
            events, missed = got
            head = _event("dropped", {"dropped": missed, "total": stream.dropped,
                                      "message": f"{missed} events were dropped: this stream "
                                                 "was read slower than the answers came"}) \
                if missed else b""
            yield head + _events(events) if events or missed else b": heartbeat\n\n"
    finally:
        stream.close()


def _events(events: Sequence[LiveEvent]) -> bytes:
    return b"".join(map(_encoded, events))


@lru_cache(maxsize=ENCODED)
def _encoded(e: LiveEvent) -> bytes:
    """One event as the stream sends it, encoded once for every page that shows it (each open
    stream gets the same event object)."""
    return f"id: {e.id}\ndata: {json.dumps(e.to_json())}\n\n".encode()


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


@router.get("/v1/live/summary", summary="Answers per minute of one model, and its latency",
            response_model=Summary, responses=ERRORS)
async def summary(request: Request,
                  model: str = Query(..., description="The model."),
                  minutes: int = Query(10, ge=1, le=WINDOW_MIN,
                                       description="How many minutes back.")) -> JSONResponse:
    engine = engine_of(request)
    entry = engine.entry(model)
    try:  # the served version's takt (with --takt-ms applied), else the repository's
        takt_ms = engine.get(model).config.batching.takt_ms
    except Unavailable:
        takt_ms = entry.config.batching.takt_ms
    return JSONResponse({**await engine.feed.summary(model, minutes), "takt_ms": takt_ms})
