"""The records over HTTP: ``GET /v1/parts/{part_id}``, the part's history, newest first, and
``GET /v1/records``, the records a filter names, newest first, a page at a time.

  GET /v1/parts/{part_id}?limit=100
  GET /v1/records?verdict=NG&model=&label=&part_id=&since=&until=&limit=100&before=&captured=

The part's history answers ``{"part_id": ..., "count": n, "records": [...]}`` (each record as in
docs/records.md); 404 with a message for a part with no record. The listing answers ``{"count":
n, "records": [...], "next": cursor or null}``, each record with its ``id`` (what the image
routes take); ``next`` goes into ``before`` for the next page (keyset pagination: a page is as
fast deep in the store as at its start, and records written meanwhile never shift it). A
filter that is not understood is a 400 naming it; both answer 503 with Retry-After while the
store cannot be read.

A captured image, by its record's id (a listing's ``id``):

  GET /v1/records/{id}/image?size=      the image as stored (a raw frame as PNG)
  GET /v1/records/{id}/overlay?size=    the same with the model's answer drawn on it (JPEG)

``size`` (32 to 1024) makes a thumbnail of that longer side (JPEG). 404 with the reason for an
unknown record, a record without an image, or an image no longer kept (:mod:`.images`).

Labels (docs/closed-loop.md), for a captured frame, by a user of role quality or admin:

  POST /v1/records/{id}/flag        {"verdict_was_wrong": true, "label": "scratch"}: a flag
  PUT  /v1/records/{id}/label       the same body: the review queue's label
  GET  /v1/review?model=&state=unlabelled|labelled&limit=50&before=

A label is checked against the model's labels (:mod:`.labels`: 400 with what is wrong), kept in
the store's ``labels`` table (the latest in force, every one kept) and is an audit entry. A
record without a captured image gets it from the recent frames the server keeps in memory
(``--capture-recent``: an escape flagged a while after it passed), else it is a 409: there is
nothing to learn from.

The store is read in a worker thread with its own connection: the event loop never waits
for it, and the writer is never held up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from ..audit import Entry
from ..errors import Conflict, InvalidInput, NotFound, VisionServeError
from ..http.common import audit_of, caller_of, engine_of, error_response, read_json_object
from . import labels as labelling
from .images import ImageSource
from .overlay import THUMB_MAX, THUMB_MIN, frame_size, render
from .record import VERDICTS, Record, parse_time
from .store import MAX_HISTORY, MAX_PAGE, Label, RecordQuery, RecordStore, ReviewQuery

#: a label's body: a few boxes at most
MAX_LABEL_BODY = 256 * 1024
#: the review queue's states: frames still to label, frames labelled
REVIEW_STATES = ("unlabelled", "labelled")


def cursor(row_id: int, time: float) -> str:
    """The ``before`` of the page after a row: its time (seconds, exact) and id."""
    return f"{time!r}_{row_id}"


def parse_query(verdict: str | None, model: str | None, label: str | None,
                part_id: str | None, since: str | None, until: str | None, limit: str | None,
                before: str | None, captured: str | None = None) -> RecordQuery:
    """The listing's query parameters (empty: not set) -> a RecordQuery; InvalidInput names a bad
    one."""
    if captured not in (None, "", "true", "false"):
        raise InvalidInput(f"captured {captured!r}: true (only records with a stored image) or "
                           "false")
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
    mark = parse_before(before)
    return RecordQuery(verdict.upper() if verdict else None, model, label, part_id, t0, t1,
                       mark, n, captured=captured == "true")


def parse_id(text: str) -> int:
    """A record's id in a path; NotFound for text that is none (no record has it)."""
    if not text.isdigit() or len(text) > 18:
        raise NotFound(f"no record {text!r}: a record's id is a whole number (a listing's "
                       "\"id\")")
    return int(text)


def parse_size(text: str | None) -> int | None:
    if not text:
        return None
    if not text.isdigit() or not THUMB_MIN <= int(text) <= THUMB_MAX:
        raise InvalidInput(f"size {text!r}: a thumbnail's longer side, a whole number from "
                           f"{THUMB_MIN} to {THUMB_MAX}")
    return int(text)


def parse_before(before: str | None) -> tuple[float, int] | None:
    """A page's ``before`` (the previous page's ``next``); InvalidInput for text that is none."""
    if not before:
        return None
    t, _, rid = before.rpartition("_")
    try:
        return float(t), int(rid)
    except ValueError:
        raise InvalidInput(f"before {before!r}: pass the previous page's \"next\" as it "
                           "came") from None


def parse_review(model: str | None, state: str | None, limit: str | None,
                 before: str | None) -> ReviewQuery:
    """The review queue's query parameters -> a ReviewQuery; InvalidInput names a bad one."""
    if not model:
        raise InvalidInput("model: whose frames to review (a model's name)")
    state = state or REVIEW_STATES[0]
    if state not in REVIEW_STATES:
        raise InvalidInput(f"state {state!r}: {' or '.join(REVIEW_STATES)}")
    n = 50
    if limit:
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidInput(f"limit {limit!r}: a whole number from 1 to {MAX_PAGE}")
        n = int(limit)
    return ReviewQuery(model, state == "labelled", parse_before(before), n)


class Labeller:
    """Labels of captured frames: checked against the model's labels, kept in the store, each
    an audit entry. The store and the image reads run in a worker thread."""

    def __init__(self, store: RecordStore, images: ImageSource) -> None:
        self.store, self.images = store, images

    def scheme(self, request: Request, model: str) -> labelling.Scheme:
        entry = engine_of(request).entries.get(model)
        if entry is None:
            raise Conflict(f"model {model!r} is not in the repository now: a label is checked "
                           "against its model.toml")
        return labelling.scheme_of(model, entry.config)

    def read(self, record_id: str) -> tuple[int, Record]:
        """(a worker thread) the record; NotFound."""
        row_id = parse_id(record_id)
        record = self.store.record(row_id)
        if record is None:
            raise NotFound(f"no record {row_id} (records are kept for records_max_age_days)")
        return row_id, record

    async def captured(self, request: Request, record_id: str) -> tuple[int, Record]:
        """The record of a captured frame, captured now where its frame is among the recent
        frames in memory; NotFound, or Conflict where there is no frame to label."""
        row_id, record = await run_in_threadpool(self.read, record_id)
        if record.image is None and record.verdict in ("OK", "NG"):
            image = await engine_of(request).capture_recent(row_id)
            if image is not None:
                record = dataclasses.replace(record, image=image, kept_for="flagged")
        if record.image is None:
            raise Conflict(f"record {row_id}: its frame was not captured and is no longer among "
                           "the recent frames in memory, so there is nothing to label; capture "
                           "the frames to learn from with --capture learn (--capture-recent "
                           "keeps the newest others a while)")
        return row_id, record

    async def label(self, request: Request, record_id: str, source: str) -> JSONResponse:
        row_id, record = await self.captured(request, record_id)
        scheme = self.scheme(request, record.model)
        body = await read_json_object(request, MAX_LABEL_BODY,
                                      f" such as {labelling.example(scheme)}")
        caller = caller_of(request)
        by = str(caller.get("operator") or "?")

        def keep() -> tuple[Label, Label | None]:
            value = labelling.validate(scheme, body, lambda: frame_size(
                self.images.read(row_id, record)))
            before = self.store.labels(row_id)
            return self.store.add_label(row_id, value, by, source), \
                before[0] if before else None

        kept, old = await run_in_threadpool(keep)
        await audit_of(request).arecord(
            Entry("flag" if source == "flag" else "label", "record", str(row_id),
                  old.label if old else None, kept.label, caller),
            "records: record %d (model %s, part %s) %s %s by %s", row_id, record.model,
            record.part_id or "-", "flagged" if source == "flag" else "labelled",
            _shown(kept.label), by)
        return JSONResponse({"id": row_id, "model": record.model, "labelled": kept.to_dict()})

    def review(self, query: ReviewQuery) -> list[dict[str, Any]]:
        return [{"id": i, **r.to_dict(), "labelled": lab.to_dict() if lab else None}
                for i, r, lab in self.store.review(query)]


def _shown(label: dict[str, Any]) -> str:
    if "boxes" in label:
        return f"{len(label['boxes'])} boxes"
    return repr(label["label"])


def make_router(store: RecordStore, images: ImageSource | None = None) -> APIRouter:
    router = APIRouter(tags=["Records"])

    def picture(record_id: str, size: str | None, overlay: bool) -> tuple[bytes, str]:
        """(a worker thread) the record, its image, drawn or not."""
        row_id, thumb = parse_id(record_id), parse_size(size)
        record = store.record(row_id)
        if record is None:
            raise NotFound(f"no record {row_id} (records are kept for records_max_age_days)")
        assert images is not None
        stored = images.read(row_id, record, sidecar=overlay)
        return render(stored, record, overlay=overlay, size=thumb)

    async def answer(record_id: str, size: str | None, overlay: bool) -> Response:
        try:
            body, media = await run_in_threadpool(picture, record_id, size, overlay)
        except VisionServeError as exc:
            return error_response(exc, {"record": record_id})
        # a record's image never changes: the browser may keep it (only for this user)
        return Response(body, media_type=media, headers={
            "Cache-Control": "private, max-age=3600", "X-Content-Type-Options": "nosniff"})

    if images is not None:
        @router.get("/v1/records/{record_id}/image", summary="A record's captured image")
        async def record_image(record_id: str, size: str | None = Query(
                None, description=f"a thumbnail's longer side, {THUMB_MIN}..{THUMB_MAX}")):
            return await answer(record_id, size, False)

        @router.get("/v1/records/{record_id}/overlay", summary="A record's captured image with "
                    "the model's answer drawn on it")
        async def record_overlay(record_id: str, size: str | None = Query(
                None, description=f"a thumbnail's longer side, {THUMB_MIN}..{THUMB_MAX}")):
            return await answer(record_id, size, True)

    if images is not None:
        labeller = Labeller(store, images)

        async def labelled(request: Request, record_id: str, source: str) -> JSONResponse:
            """A flag (``source`` "flag") or a review's label, or the refusal as JSON."""
            try:
                return await labeller.label(request, record_id, source)
            except VisionServeError as exc:
                return error_response(exc, {"record": record_id})

        @router.post("/v1/records/{record_id}/flag", summary="Flag a captured frame: what it "
                     "really shows (the line's verdict was wrong)")
        async def flag(request: Request, record_id: str) -> JSONResponse:
            return await labelled(request, record_id, "flag")

        @router.put("/v1/records/{record_id}/label", summary="Label a captured frame (the "
                    "review queue)")
        async def put_label(request: Request, record_id: str) -> JSONResponse:
            return await labelled(request, record_id, "review")

        @router.get("/v1/review", summary="The captured frames of a model to label, or "
                    "labelled, newest first")
        async def review(request: Request, model: str | None = None,
                         state: str | None = Query(None, description="unlabelled (default) or "
                                                                     "labelled"),
                         limit: str | None = Query(None, description=f"1..{MAX_PAGE}; 50"),
                         before: str | None = Query(None, description="the previous page's "
                                                                      "next")):
            try:
                query = parse_review(model, state, limit, before)
                scheme = labeller.scheme(request, query.model)
                rows = await run_in_threadpool(labeller.review, query)
            except VisionServeError as exc:
                return error_response(exc)
            full = len(rows) == query.limit
            return JSONResponse({
                "model": query.model, "task": scheme.task, "labels": list(scheme.labels),
                "state": "labelled" if query.labelled else "unlabelled", "count": len(rows),
                "records": rows,
                "next": cursor(rows[-1]["id"], rows[-1]["timestamp"]) if full else None})

    @router.get("/v1/parts/{part_id:path}", summary="A part's traceability records, newest first")
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
                      before: str | None = Query(None, description="the previous page's next"),
                      captured: str | None = Query(None, description="true: only records with "
                                                                     "a stored image")):
        try:
            query = parse_query(verdict, model, label, part_id, since, until, limit, before,
                                captured)
            rows = await run_in_threadpool(store.listing, query)
        except VisionServeError as exc:
            return error_response(exc)
        full = len(rows) == query.limit
        return JSONResponse({"count": len(rows),
                             "records": [{"id": i, **r.to_dict()} for i, r in rows],
                             "next": cursor(*_last(rows)) if full else None})

    return router


def _last(rows: list) -> tuple[int, float]:
    row_id, record = rows[-1]
    return row_id, record.time
