"""The records over HTTP: ``GET /v1/parts/{part_id}``, the part's history, newest first, and
``GET /v1/records``, the records a filter names, newest first, a page at a time.

  GET /v1/parts/{part_id}?limit=100
  GET /v1/records?verdict=NG&model=&label=&part_id=&since=&until=&limit=100&before=

The part's history answers ``{"part_id": ..., "count": n, "records": [...]}`` (each record as in
docs/records.md); 404 with a message for a part with no record. The listing answers ``{"count":
n, "records": [...], "next": cursor or null}``: ``next`` goes into ``before`` for the next page
(keyset pagination: a page is as fast deep in the store as at its start, and records written
meanwhile never shift it). A filter that is not understood is a 400 naming it; both answer 503
with Retry-After while the store cannot be read.

The store is read in a worker thread with its own connection: the event loop never waits
for it, and the writer is never held up.
"""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from ..errors import InvalidInput, NotFound, VisionServeError
from ..http.common import error_response
from .record import VERDICTS, parse_time
from .store import MAX_HISTORY, MAX_PAGE, RecordQuery, RecordStore


def cursor(row_id: int, time: float) -> str:
    """The ``before`` of the page after a row: its time (seconds, exact) and id."""
    return f"{time!r}_{row_id}"


def parse_query(verdict: str | None, model: str | None, label: str | None,
                part_id: str | None, since: str | None, until: str | None, limit: str | None,
                before: str | None) -> RecordQuery:
    """The listing's query parameters (empty: not set) -> a RecordQuery; InvalidInput names a bad
    one."""
    verdict, model, label, part_id, since, until, limit, before = (
        v or None for v in (verdict, model, label, part_id, since, until, limit, before))
    if verdict is not None and verdict.upper() not in VERDICTS:
        raise InvalidInput(f"verdict {verdict!r}: use one of {', '.join(VERDICTS)}")
    try:
        t0 = None if since is None else parse_time(since)
        t1 = None if until is None else parse_time(until)
    except ValueError as exc:
        raise InvalidInput(f"since/until: {exc}") from None
    if t0 is not None and t1 is not None and t1 <= t0:
        raise InvalidInput(f"until ({until}) must be after since ({since})")
    n = 100
    if limit is not None:
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidInput(f"limit {limit!r}: a whole number from 1 to {MAX_PAGE}")
        n = int(limit)
    mark = None
    if before is not None:
        t, _, rid = before.rpartition("_")
        try:
            mark = (float(t), int(rid))
        except ValueError:
            raise InvalidInput(f"before {before!r}: pass the previous page's \"next\" as it "
                               "came") from None
    return RecordQuery(verdict.upper() if verdict else None, model, label, part_id, t0, t1,
                       mark, n)


def make_router(store: RecordStore) -> APIRouter:
    router = APIRouter(tags=["Records"])

    @router.get("/v1/parts/{part_id}", summary="A part's traceability records, newest first")
    async def part_history(part_id: str, limit: int = Query(100, ge=1, le=MAX_HISTORY)):
        try:
            records = await run_in_threadpool(store.history, part_id, limit)
            if not records:
                raise NotFound(f"no record of part {part_id!r} (records are kept for "
                               "records_max_age_days; is X-Part-Id sent?)")
        except VisionServeError as exc:
            return error_response(exc, {"part_id": part_id})
        return JSONResponse({"part_id": part_id, "count": len(records),
                             "records": [r.to_dict() for r in records]})

    @router.get("/v1/records", summary="Records by verdict, model, label, part and time, newest "
                "first, a page at a time")
    async def records(verdict: str | None = None, model: str | None = None,
                      label: str | None = None, part_id: str | None = None,
                      since: str | None = Query(None, description="ISO 8601, inclusive"),
                      until: str | None = Query(None, description="ISO 8601, exclusive"),
                      limit: str | None = Query(None, description=f"1..{MAX_PAGE}; 100"),
                      before: str | None = Query(None, description="the previous page's next")):
        try:
            query = parse_query(verdict, model, label, part_id, since, until, limit, before)
            rows = await run_in_threadpool(store.listing, query)
        except VisionServeError as exc:
            return error_response(exc)
        full = len(rows) == query.limit
        return JSONResponse({"count": len(rows), "records": [r.to_dict() for _, r in rows],
                             "next": cursor(*_last(rows)) if full else None})

    return router


def _last(rows: list) -> tuple[int, float]:
    row_id, record = rows[-1]
    return row_id, record.time
