"""The audit trail over HTTP: ``GET /v1/audit`` (docs/security.md, "The audit trail").

Entries newest first, filtered by time, user and action, in pages: ``before`` (an entry id) gives
the next older page, ``after`` the next newer one; each answer names the ids to ask with
(``older``, ``newer``), so a page never shifts under entries written meanwhile. Times are read and
written in the server's time zone (setting ``time_zone``), which the answer names. The console's
Audit page renders the same answer (:func:`audit_page`).
"""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..audit import ACTIONS, MAX_LIMIT, AuditTrail, Filters, Row
from ..config import time_zone
from ..errors import InvalidInput, Unavailable
from ..storage import sqlite_fault
from .common import audit_of, settings_of
from .schemas import ERRORS

router = APIRouter(tags=["Audit"])

DEFAULT_LIMIT = 50


@dataclass(frozen=True)
class AuditQuery:
    """What a reader asks of the trail (every field optional)."""

    since: str = ""
    until: str = ""
    user: str = ""
    action: str = ""
    limit: int = DEFAULT_LIMIT
    before: int | None = None
    after: int | None = None


def parse_time(text: str, zone: tzinfo, name: str) -> float | None:
    """Seconds since the epoch of ``text``: ISO 8601 (``2026-12-06T14:30``; without an offset,
    in ``zone``) or a number of seconds since the epoch; None for ""; InvalidInput otherwise."""
    text = text.strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"{name}={text!r} is not a time: give ISO 8601 (2026-12-06T14:30, in "
                           "the server's time zone unless it names an offset) or seconds since "
                           "the epoch") from None
    return (when if when.tzinfo else when.replace(tzinfo=zone)).timestamp()


async def audit_page(trail: AuditTrail, query: AuditQuery, zone_setting: str) -> dict[str, Any]:
    """The answer of ``GET /v1/audit`` for ``query``: ``entries`` newest first, ``older`` and
    ``newer`` (the ids to page with, None where there is nothing more) and ``time_zone``.
    InvalidInput for a bad filter, Unavailable (503) where the file cannot be read."""
    zone_name, zone = time_zone(zone_setting)
    if query.action and query.action not in ACTIONS:
        raise InvalidInput(f"unknown action {query.action!r}: one of {', '.join(ACTIONS)}")
    if not 1 <= query.limit <= MAX_LIMIT:
        raise InvalidInput(f"limit={query.limit}: from 1 to {MAX_LIMIT}")
    if query.before is not None and query.after is not None:
        raise InvalidInput("give before (older entries) or after (newer entries), not both")
    filters = Filters(parse_time(query.since, zone, "since"),
                      parse_time(query.until, zone, "until"), query.user.strip(), query.action)

    def read() -> tuple[list[Row], bool, bool]:
        rows = trail.read(filters, before=query.before, after=query.after, limit=query.limit)
        if not rows:
            return rows, False, False
        return (rows, trail.has(filters, before=rows[-1].id),
                trail.has(filters, after=rows[0].id))

    try:
        rows, older, newer = await asyncio.to_thread(read)
    except sqlite3.Error as exc:
        if not sqlite_fault(exc):
            raise
        raise Unavailable(f"the audit file {trail.path} cannot be read ({exc})",
                          retry_after_s=5.0) from None
    return {"time_zone": zone_name,
            "entries": [_entry(r, zone) for r in rows],
            "older": rows[-1].id if older else None,
            "newer": rows[0].id if newer else None}


def _entry(row: Row, zone: tzinfo) -> dict[str, Any]:
    return {"id": row.id, "time": datetime.fromtimestamp(row.time, zone).isoformat(
                timespec="seconds"),
            "user": row.user, "operator_declared": row.declared, "client": row.client,
            "request_id": row.request_id, "action": row.action, "target": row.target,
            "old": row.old, "new": row.new}


@router.get("/v1/audit", responses=ERRORS, summary="The audit trail: who changed what, when",
            description="Entries newest first. since, until: ISO 8601 (without an offset, in the "
                        "server's time zone) or seconds since the epoch; user: a user name, "
                        "admin-token or loopback; action: one of " + ", ".join(ACTIONS) + "; "
                        f"limit: 1 to {MAX_LIMIT}; before / after: an entry id (the answer's "
                        "older / newer) for the next older / newer page.")
async def get_audit(request: Request, since: str = "", until: str = "", user: str = "",
                    action: str = "", limit: int = DEFAULT_LIMIT, before: int | None = None,
                    after: int | None = None) -> JSONResponse:
    query = AuditQuery(since, until, user, action, limit, before, after)
    page = await audit_page(audit_of(request), query, settings_of(request).time_zone)
    return JSONResponse(page, headers={"Cache-Control": "no-store"})
