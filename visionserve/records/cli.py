"""Read the traceability records.

  visionserve records export --since 2026-12-01T06:00 [--until ...] --format csv|parquet --out FILE
  visionserve records show PART_ID [--limit N]

The store is the server's: ``--records-url`` / ``--records-dir`` (or VISIONSERVE_RECORDS_URL /
VISIONSERVE_RECORDS_DIR, as ``serve`` reads them). Times are ISO 8601; without an offset, local
time. CSV has one row per record (its ``id``, its columns, and the label in force of a captured
frame: what it shows, who labelled it, when and where), the task's result, the timings and the
label as JSON text; Parquet (the ``records-parquet`` extra, pyarrow) the same columns, ``time``
and ``labelled_at`` as UTC timestamps.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from ..errors import VisionServeError
from .record import COLUMNS, Record, iso, parse_time
from .store import Label

#: rows per Parquet row group
PARQUET_ROWS = 10_000
#: what a captured frame was labelled (the label in force, docs/closed-loop.md): the label as
#: kept (JSON), who set it, when and where (``flag`` or ``review``); empty for a record without
LABEL_COLUMNS = ("labelled", "labelled_by", "labelled_at", "labelled_source")
#: an export's columns: the record's id (the API's), its columns, its label
EXPORT_COLUMNS = ("id", *COLUMNS, *LABEL_COLUMNS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records-url", default=None,
                        help="the record store (default: VISIONSERVE_RECORDS_URL, else "
                             "records.sqlite in the records folder)")
    parser.add_argument("--records-dir", default=None,
                        help="the records folder (default: VISIONSERVE_RECORDS_DIR, else "
                             "$XDG_DATA_HOME/visionserve)")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("export", help="records of a time range as CSV or Parquet")
    p.add_argument("--since", required=True, help="first time, ISO 8601 (e.g. 2026-12-01T06:00)")
    p.add_argument("--until", default=None, help="end time (excluded); default: now")
    p.add_argument("--format", choices=("csv", "parquet"), default="csv")
    p.add_argument("--out", required=True, help="the file to write ('-': stdout, CSV only)")
    p = sub.add_parser("show", help="a part's records, newest first, as JSON")
    p.add_argument("part_id")
    p.add_argument("--limit", type=int, default=100)


def run(args: argparse.Namespace) -> int:
    from ..config import ServerSettings
    from .service import store_of

    over = {k: v for k, v in (("records_url", args.records_url),
                              ("records_dir", args.records_dir)) if v is not None}
    try:
        store = store_of(ServerSettings(**over))
        if args.action == "show":
            records = store.history(args.part_id, args.limit)
            if not records:
                print(f"visionserve records: no record of part {args.part_id!r} in "
                      f"{store.where}", file=sys.stderr)
                return 1
            print(json.dumps([r.to_dict() for r in records], indent=1))
            return 0
        since = parse_time(args.since)
        until = parse_time(args.until) if args.until else None
        if args.format == "parquet" and args.out == "-":
            raise ValueError("--format parquet needs a file (--out FILE)")
        rows = store.exported(since, until)
        n = write_parquet(rows, Path(args.out)) if args.format == "parquet" \
            else write_csv(rows, args.out)
    except ValueError as exc:
        print(f"visionserve records: {exc}", file=sys.stderr)
        return 2
    except VisionServeError as exc:
        print(f"visionserve records: {exc.message}", file=sys.stderr)
        return 2
    print(f"{n} records from {store.where} -> {args.out}", file=sys.stderr)
    return 0


Exported = tuple[int, Record, Label | None]


def _row(row_id: int, r: Record, label: Label | None) -> dict:
    """A record as one row: its id, the JSON columns as text, its label in force (or None)."""
    return {"id": row_id, **dict(zip(COLUMNS, r.row())),
            **dict(zip(LABEL_COLUMNS, (None,) * len(LABEL_COLUMNS) if label is None else
                       (json.dumps(label.label), label.by, label.time, label.source)))}


def _flat(exported: Exported) -> dict:
    """A record as one CSV row: the times in ISO 8601 (UTC)."""
    row = _row(*exported)
    row["time"] = iso(exported[1].time)
    if row["labelled_at"] is not None:
        row["labelled_at"] = iso(row["labelled_at"])
    return row


def write_csv(records: Iterable[Exported], out: str) -> int:
    n = 0
    f = sys.stdout if out == "-" else open(out, "w", newline="", encoding="utf-8")  # noqa: SIM115
    try:
        w = csv.DictWriter(f, fieldnames=EXPORT_COLUMNS)
        w.writeheader()
        for r in records:
            w.writerow(_flat(r))
            n += 1
    finally:
        if f is not sys.stdout:
            f.close()
    return n


def write_parquet(records: Iterable[Exported], out: Path) -> int:
    from ..extras import require

    pa = require("pyarrow", "records export to Parquet")
    pq = require("pyarrow.parquet", "records export to Parquet")
    types = {"id": pa.int64(), "time": pa.timestamp("ms", tz="UTC"), "score": pa.float64(),
             "frame_index": pa.int32(), "camera_time": pa.float64(),
             "camera_frame": pa.int64(), "labelled_at": pa.timestamp("ms", tz="UTC")}
    schema = pa.schema([(c, types.get(c, pa.string())) for c in EXPORT_COLUMNS])
    n = 0
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with pq.ParquetWriter(str(tmp), schema) as w:
            chunk: list[dict] = []
            for r in records:
                row = _row(*r)
                row["time"] = int(r[1].time * 1000)
                if row["labelled_at"] is not None:
                    row["labelled_at"] = int(row["labelled_at"] * 1000)
                chunk.append(row)
                if len(chunk) >= PARQUET_ROWS:
                    w.write_table(pa.Table.from_pylist(chunk, schema=schema))
                    n += len(chunk)
                    chunk = []
            if chunk or not n:
                w.write_table(pa.Table.from_pylist(chunk, schema=schema))
                n += len(chunk)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return n

