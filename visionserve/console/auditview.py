"""What the Audit log page shows of an entry (``/ui/audit``): its change as ``old → new`` lines,
and the links to the next older and newer pages with the filters kept."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from ..http.audit import AuditQuery
from .strings import STRINGS

PATH = "/ui/audit"
#: the entries one page shows
ROWS = 50


def action_name(action: str) -> str:
    """What the page calls an action (an action it has no name for: as the server names it)."""
    return STRINGS.get(f"audit_action_{action}", action)


def changes(old: Any, new: Any) -> list[str]:
    """``old → new`` lines: one per field that differs where both are objects (a verdict rule
    change shows the rules it changed, not every rule), else one line."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        return [f"{k}: {_shown(old.get(k))} → {_shown(new.get(k))}" for k in keys]
    if old is None and new is None:
        return []
    return [f"{_shown(old)} → {_shown(new)}"]


def _shown(value: Any) -> str:
    if value is None:
        return STRINGS["audit_nothing"]
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_shown(v)}" for k, v in sorted(value.items()))
    return json.dumps(value)


def page_link(query: AuditQuery, before: int | None = None, after: int | None = None) -> str:
    """This page with ``query``'s filters, ``before`` or ``after`` an entry id."""
    params = {"user": query.user, "action": query.action, "since": query.since,
              "until": query.until, "before": before, "after": after}
    kept = {k: v for k, v in params.items() if v not in ("", None)}
    return PATH + ("?" + urlencode(kept) if kept else "")


def local_input(text: str) -> str:
    """A filter's time as a ``datetime-local`` field takes it (``YYYY-MM-DDTHH:MM``), or ""
    where it is another form (the field then starts empty; the filter still applies)."""
    text = text.strip()
    return text if len(text) in (16, 19) and text[10:11] == "T" else ""
