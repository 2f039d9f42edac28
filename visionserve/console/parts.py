"""The NG parts pages' reading of the record store: the gallery's query from its form (times in
the console's zone), a page of captured NG frames, and a part's every answer, each made into
what the templates show.

The gallery reads the records of captured NG frames newest first, a page at a time by keyset
(``before``: the last card's time and id), through the store's partial indexes of captured
records: a page costs the same with 100,000 records as with 100, and the capture folder is never
listed."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlencode
from zoneinfo import ZoneInfo

from ..errors import InvalidInput
from ..records.http import cursor, parse_query
from ..records.record import Record
from ..records.store import MAX_PAGE, RecordQuery, RecordStore

#: cards per gallery page
GALLERY_PAGE = 24
#: a gallery card's thumbnail: its longer side (pixels); a part page's picture
THUMB_SIDE, PICTURE_SIDE = 320, 800
#: the gallery form's fields, in the order of its query string
FILTERS = ("since", "until", "model", "label", "part_id")


@dataclass(frozen=True)
class Gallery:
    filters: dict[str, str]  #: as typed (the form shows them again)
    cards: list[dict[str, Any]]
    older: str | None  #: the next page's URL


def gallery_query(filters: dict[str, str], before: str, zone: ZoneInfo) -> RecordQuery:
    """The form's values -> the store's query (NG, captured); a time without an offset is in
    the console's zone (``datetime-local`` inputs send none). InvalidInput names a bad value."""
    since, until = (_zoned(filters[k], k, zone) for k in ("since", "until"))
    query = parse_query("NG", filters["model"], filters["label"], filters["part_id"], since,
                        until, str(GALLERY_PAGE), before)
    return replace(query, captured=True)


def _zoned(text: str, name: str, zone: ZoneInfo) -> str:
    if not text.strip():
        return ""
    try:
        t = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInput(f"{name} {text!r}: not a time (the form's date and time, or ISO "
                           "8601 such as 2026-12-01T06:00)") from None
    return (t if t.tzinfo is not None else t.replace(tzinfo=zone)).isoformat()


def read_gallery(store: RecordStore, filters: dict[str, str], before: str,
                 zone: ZoneInfo) -> Gallery:
    """(a worker thread) a page of the gallery."""
    query = gallery_query(filters, before, zone)
    rows = store.listing(query)
    older = None
    if len(rows) == query.limit:
        row_id, last = rows[-1]
        kept = {k: v for k, v in filters.items() if v}
        older = "/ui/parts?" + urlencode({**kept, "before": cursor(row_id, last.time)})
    return Gallery(filters, [card(i, r) for i, r in rows], older)


def read_part(store: RecordStore, part_id: str) -> list[dict[str, Any]]:
    """(a worker thread) the part's answers, newest first (at most MAX_PAGE)."""
    return [card(i, r) for i, r in store.listing(RecordQuery(part_id=part_id, limit=MAX_PAGE))]


def card(row_id: int, r: Record) -> dict[str, Any]:
    """What a template shows of one record."""
    image = f"/v1/records/{row_id}/image" if r.image else None
    return {"id": row_id, "r": r, "reasons": r.reasons(), "image": image,
            "overlay": f"/v1/records/{row_id}/overlay" if r.image else None,
            "timings": {k: _figure(r.timings[k]) for k in ("queue_ms", "compute_ms", "total_ms",
                                                           "batch_size") if k in r.timings}}


def _figure(value: Any) -> str:
    """A timing as the page shows it: milliseconds to a tenth, a batch size whole."""
    return f"{value:.1f}" if isinstance(value, float) else str(value)
