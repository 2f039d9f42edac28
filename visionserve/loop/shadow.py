"""Shadow evaluation: a trained candidate judges the live frames beside the live version, at the
lowest priority, its verdicts recorded and never sent anywhere (docs/closed-loop.md, "Shadow").

In the serving process, while a shadow runs and only then, :class:`ShadowTap` is a tap of the
engine (``Engine.tap``, as the records and the PLC result bus are): for each answered frame of
its model it makes one O(1) hand-off, (the live answer, the frame) into a small bounded queue,
or counts the frame as dropped when the queue is full. A sender thread writes the queue, one
message at a time, into the pipe of a child process (``python -m visionserve.loop.shadow``) that
runs at nice 19 with one inference thread: it prepares each frame with the server's own
preprocessing, judges it with the candidate and the model's verdict rule (:class:`.evaluate.Judge`)
and stores both verdicts in ``<candidate>/shadow.sqlite``. The child is slow whenever the server
is busy (it gets the CPU last), the pipe then fills, the queue fills and frames are dropped: the
shadow gives way under load, and a live answer never waits for it. Nothing is sent to the PLC or
the live feed: the child's only output is its SQLite file.

The file lies beside the candidate (not in the record store): it is the candidate's evidence, as
``comparison.json`` is; it exists with or without ``--records`` or a PostgreSQL store, and only
the child writes frames into it, so the serving process never writes per frame.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import queue
import select
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from .. import imaging
from ..admission import ResultTap
from ..config import ModelConfig, load_model_config
from ..errors import Conflict, InvalidInput, NotFound, VisionServeError
from ..logs import current_request_id
from ..records.record import iso
from ..records.store import RecordQuery, RecordStore
from .evaluate import JUDGED, Judge, label_score, ok_labels, tensor

#: answered frames waiting for the child, at most: beyond them a frame is dropped
QUEUE_FRAMES = 8
#: a shadow's limits when the request names none, and the most it may name
DEFAULT_MINUTES, MAX_MINUTES = 60.0, 7 * 24 * 60.0
MAX_FRAMES = 10_000_000
#: how long the child may take to load the candidate, and to finish its queue when stopped
READY_S, STOP_S = 120.0, 30.0
#: the disagreements a report lists (newest first)
MAX_LISTED = 100
_HEADER = struct.Struct("<I")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, started_at REAL NOT NULL, started_by TEXT, live_version TEXT,
    frames_limit INTEGER, until REAL, stopped_at REAL, stop_reason TEXT,
    handed INTEGER NOT NULL DEFAULT 0, dropped INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS frames (
    run INTEGER NOT NULL, time REAL NOT NULL, request_id TEXT, part_id TEXT,
    frame_index INTEGER NOT NULL, live_version TEXT, live_verdict TEXT, live_label TEXT,
    live_score REAL, verdict TEXT, label TEXT, score REAL, shadow_ms REAL);
CREATE INDEX IF NOT EXISTS frames_run ON frames (run, time);
"""


def connect(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db, timeout=10)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.executescript(SCHEMA)
    return conn


@runtime_checkable
class Tappable(Protocol):
    """An engine in this process (``Engine``): what a shadow listens to. A front-end process's
    remote engine is none."""

    def tap(self, listener: ResultTap) -> None: ...

    def untap(self, listener: ResultTap) -> None: ...


# --- the serving process's side: the tap and the sender -------------------------------------

class ShadowTap:
    """A ResultTap handing model ``model``'s answered frames to ``send`` (a bounded queue)."""

    def __init__(self, model: str, limit: int | None, on_limit: Callable[[], None]) -> None:
        self.model, self.limit, self.on_limit = model, limit, on_limit
        self.queue: queue.Queue[tuple | None] = queue.Queue(QUEUE_FRAMES)
        self.handed = self.dropped = 0
        self.closed = False

    def watch(self, served, pending: Sequence, origin: tuple | None) -> None:
        if served.name != self.model:
            return
        rid = current_request_id()
        part = origin[0] if origin else None
        for i, item in enumerate(pending):
            item.future.add_done_callback(partial(self._answered, served, part, rid, i, item))

    def refused(self, served, count: int, origin: tuple | None, exc) -> None:
        """A refused frame has no live verdict to compare with."""

    def _answered(self, served, part: str | None, rid: str | None, index: int, item,
                  future) -> None:
        if self.closed or future.cancelled() or future.exception() is not None:
            return
        r = future.result()
        judged = label_score(r.verdict, r.result)
        if judged is None:
            return  # the model was reloaded as another task: nothing to compare
        label, score = judged
        if self.queue.full():  # the child is behind: give way
            self.dropped += 1
            return
        wall = time.time() - (time.monotonic() - item.arrival)
        # bytes of its own: a frame read in place from a front end's arena must not wait here
        self.queue.put_nowait(((wall, rid, part, index, str(served.version), r.verdict,
                                label, float(score)),
                               imaging.owned(item.payload)))
        self.handed += 1
        if self.limit is not None and self.handed >= self.limit:
            self.closed = True
            self.on_limit()


def _send(tap: ShadowTap, pipe: IO[bytes], gone: Callable[[str], None]) -> None:
    """The sender thread: the queue into the child's pipe until None (or the child is gone)."""
    try:
        while (item := tap.queue.get()) is not None:
            data = pickle.dumps(item, protocol=5)
            pipe.write(_HEADER.pack(len(data)))
            pipe.write(data)
    except (OSError, ValueError):
        gone("the shadow's process ended")
    finally:
        try:
            pipe.close()
        except OSError:
            pass


@dataclass
class Shadow:
    """One running shadow: a candidate of a model, its run in the candidate's file."""

    cid: str
    folder: Path
    run: int
    engine: Tappable
    tap: ShadowTap
    proc: subprocess.Popen
    sender: threading.Thread
    timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True)
class ShadowRequest:
    frames: int | None
    minutes: float


def parse_request(body: dict[str, Any]) -> ShadowRequest:
    unknown = sorted(set(body) - {"frames", "minutes"})
    if unknown:
        raise InvalidInput(f"not understood: {', '.join(unknown)} (a shadow's body is "
                           '{"frames": 1000, "minutes": 60}, each optional)')
    frames, minutes = body.get("frames"), body.get("minutes", DEFAULT_MINUTES)
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int)
                               or not 1 <= frames <= MAX_FRAMES):
        raise InvalidInput(f"frames {frames!r}: how many live frames to judge, a whole number "
                           f"from 1 to {MAX_FRAMES}")
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) \
            or not 0 < minutes <= MAX_MINUTES:
        raise InvalidInput(f"minutes {minutes!r}: how long the shadow runs, above 0 and at "
                           f"most {MAX_MINUTES:.0f}")
    return ShadowRequest(frames, float(minutes))


class Shadows:
    """The shadows of this process, one per model at most. Their methods run on the engine's
    event loop (the taps are added and removed there)."""

    def __init__(self) -> None:
        self.running: dict[str, Shadow] = {}
        self._starting: set[str] = set()
        self._stopping: set[asyncio.Task] = set()

    async def start(self, engine: object, model: str, config: ModelConfig, live_version: int,
                    cid: str, folder: Path, model_toml: Path, req: ShadowRequest,
                    by: str) -> dict[str, Any]:
        if not isinstance(engine, Tappable):
            raise Conflict("a shadow runs beside the engine: this server's front ends run in "
                           "processes of their own (--frontends); start it without them")
        if ok_labels(config) is None:
            raise Conflict(f"model {model!r} is a {getattr(config, 'task', '?')} model: shadows "
                           f"are run for the candidates of {', '.join(JUDGED)} models")
        busy = self.running.get(model)
        if busy is not None:
            raise Conflict(f"candidate {busy.cid} of model {model!r} runs in shadow already: "
                           f"stop it first (DELETE .../candidates/{busy.cid}/shadow)")
        if model in self._starting:
            raise Conflict(f"a shadow of model {model!r} is being started")
        self._starting.add(model)
        try:
            return await self._start(engine, model, live_version, cid, folder, model_toml,
                                     req, by)
        finally:
            self._starting.discard(model)

    async def _start(self, engine: Tappable, model: str, live_version: int, cid: str,
                     folder: Path, model_toml: Path, req: ShadowRequest,
                     by: str) -> dict[str, Any]:
        started = time.time()
        until = started + req.minutes * 60
        run = await asyncio.to_thread(_open_run, folder, started, by, live_version, req, until)
        proc, why = await asyncio.to_thread(_launch, folder, model_toml, run)
        if why is not None:
            await asyncio.to_thread(_close_run, folder, run, "failed to start", 0, 0)
            raise Conflict(f"candidate {cid} could not be loaded for the shadow: {why} "
                           f"(see {folder / 'shadow.log'})")
        loop = asyncio.get_running_loop()

        def end(reason: str) -> None:  # from the loop or the sender thread
            loop.call_soon_threadsafe(self._stop_later, model, reason)

        tap = ShadowTap(model, req.frames, partial(end, "frame limit reached"))
        assert proc.stdin is not None
        sender = threading.Thread(target=_send, args=(tap, proc.stdin, end),
                                  name=f"shadow-{model}", daemon=True)
        shadow = Shadow(cid, folder, run, engine, tap, proc, sender)
        sender.start()
        shadow.timer = loop.call_later(req.minutes * 60, self._stop_later, model,
                                       "time limit reached")
        self.running[model] = shadow
        engine.tap(tap)
        return {"id": cid, "state": "running", "run": run, "started": iso(started),
                "until": iso(until), "frames_limit": req.frames}

    def _stop_later(self, model: str, reason: str) -> None:
        if model in self.running:
            task = asyncio.ensure_future(self.stop(model, None, reason))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def stop(self, model: str, cid: str | None, reason: str) -> dict[str, Any]:
        """Stop model ``model``'s shadow (``cid``: only if it is that candidate's): the tap goes
        first, then the child judges what is queued and leaves."""
        shadow = self.running.get(model)
        if shadow is None or (cid is not None and shadow.cid != cid):
            raise Conflict(f"candidate {cid} of model {model!r} is not running in shadow")
        del self.running[model]
        tap = shadow.tap
        tap.closed = True
        shadow.engine.untap(tap)
        if shadow.timer is not None:
            shadow.timer.cancel()
        await asyncio.to_thread(_finish, shadow)
        await asyncio.to_thread(_close_run, shadow.folder, shadow.run, reason, tap.handed,
                                tap.dropped)
        return {"id": shadow.cid, "state": "stopped", "run": shadow.run, "reason": reason,
                "handed": tap.handed, "dropped": tap.dropped}

    def live(self, model: str, cid: str) -> Shadow | None:
        shadow = self.running.get(model)
        return shadow if shadow is not None and shadow.cid == cid else None


def _open_run(folder: Path, started: float, by: str, live_version: int, req: ShadowRequest,
              until: float) -> int:
    with connect(folder / "shadow.sqlite") as conn:
        cur = conn.execute("INSERT INTO runs (started_at, started_by, live_version, "
                           "frames_limit, until) VALUES (?, ?, ?, ?, ?)",
                           (started, by, str(live_version), req.frames, until))
        assert cur.lastrowid is not None
        return cur.lastrowid


def _close_run(folder: Path, run: int, reason: str, handed: int, dropped: int) -> None:
    with connect(folder / "shadow.sqlite") as conn:
        conn.execute("UPDATE runs SET stopped_at = ?, stop_reason = ?, handed = ?, dropped = ? "
                     "WHERE id = ?", (time.time(), reason, handed, dropped, run))


def _launch(folder: Path, model_toml: Path, run: int) -> tuple[subprocess.Popen, str | None]:
    """The child, and None once it has loaded the candidate; else why it has not (it is ended
    then)."""
    with open(folder / "shadow.log", "ab") as log:  # the child's stderr
        proc = subprocess.Popen(
            [sys.executable, "-m", "visionserve.loop.shadow", "--model-toml", str(model_toml),
             "--candidate", str(folder), "--run", str(run)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    timer = threading.Timer(READY_S, proc.kill)
    timer.start()
    try:
        line = proc.stdout.readline()
    finally:
        timer.cancel()
    if line.strip() == b'{"ready": true}':
        return proc, None
    proc.kill()
    proc.wait()
    return proc, f"its process ended with status {proc.returncode}"


def _finish(shadow: Shadow) -> None:
    """Let the child judge what is queued and leave; end it when it takes longer than STOP_S."""
    try:
        shadow.tap.queue.put(None, timeout=STOP_S)
    except queue.Full:
        shadow.proc.kill()
    shadow.sender.join(STOP_S)
    try:
        shadow.proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        shadow.proc.kill()
        shadow.proc.wait()


# --- the report ---------------------------------------------------------------------------------

def _verdicts(verdict: str, label: str, score: float | None) -> dict[str, Any]:
    return {"verdict": verdict, "label": label, "score": score}


def report(folder: Path, cid: str, model: str, shadow: Shadow | None,
           store: RecordStore | None) -> dict[str, Any]:
    """The candidate's latest shadow run: its state and limits, frames judged and handed off,
    frames dropped for load, agreement with the live version and each model's NG count, and the
    frames where the two disagree (newest first, with their record ids where the records keep
    them)."""
    db = folder / "shadow.sqlite"
    if not db.is_file():
        raise NotFound(f"candidate {cid} has not run in shadow yet: POST "
                       f"/v1/models/{model}/candidates/{cid}/shadow")
    with connect(db) as conn:
        row = conn.execute("SELECT id, started_at, started_by, live_version, frames_limit, "
                           "until, stopped_at, stop_reason, handed, dropped FROM runs "
                           "ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            raise NotFound(f"candidate {cid} has not run in shadow yet")
        run, started, by, live_version, limit, until, stopped, reason, handed, dropped = row
        judged, agree, live_ng, cand_ng, ms = conn.execute(
            "SELECT COUNT(*), SUM(live_verdict = verdict AND live_label = label), "
            "SUM(live_verdict = 'NG'), SUM(verdict = 'NG'), AVG(shadow_ms) FROM frames "
            "WHERE run = ?", (run,)).fetchone()
        rows = conn.execute(
            "SELECT time, request_id, part_id, frame_index, live_version, live_verdict, "
            "live_label, live_score, verdict, label, score FROM frames WHERE run = ? AND "
            "(live_verdict != verdict OR live_label != label) ORDER BY time DESC LIMIT ?",
            (run, MAX_LISTED)).fetchall()
        runs = conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    running = shadow is not None and shadow.run == run
    if shadow is not None and running:
        handed, dropped = shadow.tap.handed, shadow.tap.dropped
    elif stopped is None:  # the server stopped while it ran: its verdicts so far are kept
        reason = "the server stopped while it ran"
    agree = agree or 0
    found = record_ids(store, model, rows)
    out = {"id": cid, "model": model, "state": "running" if running else "stopped",
           "run": run, "runs": runs, "started": iso(started), "started_by": by,
           "live_version": live_version, "frames_limit": limit, "until": iso(until),
           "stopped": iso(stopped) if stopped is not None else None, "stop_reason": reason,
           "handed": handed, "dropped": dropped, "judged": judged, "agree": agree,
           "disagree": judged - agree,
           "agreement": round(agree / judged, 4) if judged else None,
           "live_ng": live_ng or 0, "candidate_ng": cand_ng or 0,
           "shadow_ms_mean": round(ms, 2) if ms is not None else None,
           "disagreements": [{
               "time": iso(t), "timestamp": t, "request_id": rid, "part_id": part,
               "frame_index": index, "record_id": found.get((rid, part, index)),
               "live_version": version, "live": _verdicts(lv, ll, ls),
               "candidate": _verdicts(cv, cl, cs)}
               for t, rid, part, index, version, lv, ll, ls, cv, cl, cs in rows]}
    return out


def record_ids(store: RecordStore | None, model: str, rows: list[tuple]
               ) -> dict[tuple, int]:
    """(request id, part id, frame index) -> record id of the listed frames that have a part id
    and a record (the console shows a record's frame)."""
    found: dict[tuple, int] = {}
    if store is None:
        return found
    for part in {r[2] for r in rows if r[2]}:
        for row_id, rec in store.listing(RecordQuery(model=model, part_id=part, limit=100)):
            found.setdefault((rec.request_id, rec.part_id, rec.frame_index), row_id)
    return found


# --- the child --------------------------------------------------------------------------------

def _read(stream: IO[bytes], n: int) -> bytes | None:
    data = stream.read(n)
    return data if data and len(data) == n else None


def child(model_toml: Path, folder: Path, run: int, stream: IO[bytes], out: IO[str]) -> int:
    """Judge each frame read from ``stream`` with the candidate in ``folder``; store both
    verdicts in its shadow.sqlite; end at the end of the stream."""
    os.nice(19)
    config = load_model_config(model_toml)
    if ok_labels(config) is None:
        print(f"error: {model_toml}: shadows are run for {', '.join(JUDGED)} models",
              file=sys.stderr)
        return 2
    config = config.model_copy(update={"runtime": config.runtime.model_copy(
        update={"intra_op_threads": 1})})
    judging = Judge(config, folder)
    conn = connect(folder / "shadow.sqlite")
    print(json.dumps({"ready": True}), file=out, flush=True)
    rows: list[tuple] = []
    flushed = time.monotonic()
    try:
        while (head := _read(stream, _HEADER.size)) is not None:
            data = _read(stream, _HEADER.unpack(head)[0])
            if data is None:
                break
            meta, frame = pickle.loads(data)
            t0 = time.perf_counter()
            try:
                got = judging(tensor([frame], config.input), [(frame.width, frame.height)])[0]
            except VisionServeError as exc:  # a frame the server answered but cannot be redone
                print(f"frame {meta[1]}/{meta[3]}: {exc.message}", file=sys.stderr)
                continue
            rows.append((run, *meta, got["verdict"], got["label"], got["score"],
                         round((time.perf_counter() - t0) * 1000, 3)))
            # stored in small transactions; at once when no frame waits
            if len(rows) >= 32 or time.monotonic() - flushed > 0.5 \
                    or not select.select([stream], [], [], 0)[0]:
                _store(conn, rows)
                flushed = time.monotonic()
    finally:
        _store(conn, rows)
        conn.close()
        judging.close()
    return 0


def _store(conn: sqlite3.Connection, rows: list[tuple]) -> None:
    if rows:
        with conn:
            conn.executemany("INSERT INTO frames VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             rows)
        rows.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A candidate's shadow (started by the server).")
    ap.add_argument("--model-toml", type=Path, required=True)
    ap.add_argument("--candidate", type=Path, required=True)
    ap.add_argument("--run", type=int, required=True)
    args = ap.parse_args(argv)
    return child(args.model_toml, args.candidate, args.run, sys.stdin.buffer, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
