"""The Review page's reading of the record store: a page of a model's review queue (its captured
frames without a label, or with one), each made into a gallery card (:func:`.parts.card`) with
its label in force and what the label form needs (the model's labels, a detector's boxes).

The page's forms send ``PUT /v1/records/{id}/label`` from the browser (``static/review.js``),
under the access rules every client meets; the labels are checked there (:mod:`..records.labels`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from ..records.http import REVIEW_STATES, cursor, parse_review
from ..records.labels import Scheme
from ..records.store import RecordStore
from .parts import card

PATH = "/ui/review"
#: cards per page
ROWS = 24


@dataclass(frozen=True)
class Queue:
    model: str
    state: str
    scheme: Scheme | None  #: None: no model to review
    cards: list[dict[str, Any]]
    older: str | None  #: the next page's URL


def read_queue(store: RecordStore, model: str, state: str, before: str,
               scheme: Scheme) -> Queue:
    """(a worker thread) a page of ``model``'s queue; InvalidInput names a bad parameter."""
    query = parse_review(model, state, str(ROWS), before)
    rows = store.review(query)
    older = None
    if len(rows) == query.limit:
        row_id, last, _ = rows[-1]
        older = f"{PATH}?" + urlencode({"model": model, "state": state,
                                        "before": cursor(row_id, last.time)})
    cards = [{**card(i, r), "labelled": label, "kept_for": r.kept_for,
              "boxes": (label.label.get("boxes", []) if label else [])}
             for i, r, label in rows]
    return Queue(model, state or REVIEW_STATES[0], scheme, cards, older)


def empty(model: str, state: str) -> Queue:
    return Queue(model, state or REVIEW_STATES[0], None, [], None)
