"""One answered frame, as the record store keeps it and as the API, the export and a captured
image's sidecar show it."""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

#: what a record's ``verdict`` may be: the model's verdict, or no decision (LATE: the deadline
#: passed; ERROR: refused or failed, ``error`` says why)
VERDICTS = ("OK", "NG", "LATE", "ERROR")
#: why a frame's image was kept (``kept_for``): its verdict was NG, its score lay within the
#: capture band of the threshold, it fell in the OK sample, every frame is kept, or an operator
#: flagged it while it was among the recent frames in memory (``--capture-recent``)
KEPT_FOR = ("ng", "uncertain", "sample", "all", "flagged")


@dataclass(frozen=True, slots=True)
class Record:
    time: float  #: wall clock (seconds since the epoch) when the frame arrived
    part_id: str | None
    station: str | None
    camera: str | None
    model: str
    version: str
    recipe: str | None  #: the recipe its station ran (recipes.toml), None for no station's
    verdict: str  #: one of VERDICTS
    label: str | None  #: the task's summary: the deciding label and its score
    score: float | None
    result: dict[str, Any] | None  #: the task's part of the inspect answer (scores, detections)
    timings: dict[str, Any]  #: queue_ms, compute_ms, total_ms, batch_size
    request_id: str | None
    frame_index: int = 0  #: the frame's place in its request
    error: str | None = None  #: why there is no decision: "<kind>: <message>"
    image: str | None = None  #: where the frame was captured (folder-relative path or s3:// URL)
    #: the camera's timestamp of the frame (seconds, the camera's clock as its source reports it:
    #: a GigE Vision camera's own, a folder file's modification time); None for pushed frames
    camera_time: float | None = None
    #: the camera's own id of the frame (a GigE Vision camera's block id; counts up per frame it
    #: sends, so a gap is a frame lost on the way); None for pushed frames and where it gives none
    camera_frame: int | None = None
    #: why the frame's image was captured (one of KEPT_FOR: the capture policy's reason); None
    #: for a frame not captured, and for images captured before records said why
    kept_for: str | None = None

    def row(self) -> tuple:
        """The values in COLUMNS order, JSON columns as text."""
        return (self.time, self.part_id, self.station, self.camera, self.model, self.version,
                self.recipe, self.verdict, self.label, self.score, _dumps(self.result),
                _dumps(self.timings), self.request_id, self.frame_index, self.error, self.image,
                self.camera_time, self.camera_frame, self.kept_for)

    @classmethod
    def from_row(cls, row: Any) -> Record:
        """From a row of COLUMNS (a sequence, or a mapping with those keys); JSON columns may be
        text (SQLite) or already decoded (PostgreSQL's jsonb)."""
        values = [row[c] for c in COLUMNS] if hasattr(row, "keys") else list(row)
        data = dict(zip(COLUMNS, values))
        for key in JSON_COLUMNS:
            if isinstance(data[key], str):
                data[key] = json.loads(data[key])
        data["timings"] = data["timings"] or {}
        return cls(**data)

    def reasons(self) -> list[str]:
        """Why the frame got its verdict, in a few words each: the task's reasons (a
        detector's rule messages, an anomaly model's), else its error; [] when the label says
        all."""
        kept = (self.result or {}).get("reasons") or []
        out = [r.get("message", "") if isinstance(r, dict) else str(r) for r in kept]
        return [r for r in out if r] or ([self.error] if self.error else [])

    def to_dict(self) -> dict[str, Any]:
        """For JSON: ``time`` as ISO 8601 UTC, ``timestamp`` the same in seconds."""
        out = asdict(self)
        out["timestamp"] = out.pop("time")
        return {"time": iso(self.time), **out}


COLUMNS = tuple(f.name for f in fields(Record))
JSON_COLUMNS = ("result", "timings")


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def parse_time(text: str) -> float:
    """ISO 8601 (``2026-12-01``, ``2026-12-01T06:00``, with an offset or ``Z``) -> seconds since
    the epoch; without an offset it is local time, as a quality engineer types it. ValueError
    names the text."""
    try:
        t = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a time: {text!r} (use ISO 8601, e.g. 2026-12-01T06:00 or "
                         "2026-12-01T06:00:00Z)") from None
    return t.timestamp()  # naive: local time


def _dumps(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return json.dumps(value, separators=(",", ":"), default=_plain, allow_nan=False)
    except ValueError:  # NaN or infinity somewhere: JSON (and PostgreSQL's jsonb) has none
        return json.dumps(_finite(value), separators=(",", ":"), default=_plain)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    """numpy scalars and arrays a task may leave in its fields."""
    if hasattr(value, "tolist"):
        return _finite(value.tolist())
    raise TypeError(f"not JSON: {type(value).__name__}")
