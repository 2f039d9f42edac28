"""The records over HTTP: ``GET /v1/parts/{part_id}``, the part's history, newest first.

  GET /v1/parts/{part_id}?limit=100

Answers ``{"part_id": ..., "count": n, "records": [...]}`` (each record as in docs/records.md);
404 with a message for a part with no record, 503 with Retry-After while the store cannot be
read. The store is read in a worker thread with its own connection: the event loop never waits
for it, and the writer is never held up.
"""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from ..errors import NotFound, VisionServeError
from ..http.common import error_response
from .store import MAX_HISTORY, RecordStore


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

    return router
