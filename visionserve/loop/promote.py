"""Promotion of a model's candidate to a served version, and its rollback (docs/closed-loop.md).

A promotion, approved by a user with the right role (``POST
/v1/models/{m}/candidates/{cid}/promote``), copies the trained and compared candidate into the
model's folder as its next version: into a hidden staging folder first, then renamed to its
number in one step, so that ``--model-control-mode poll`` sees the whole version or none of it.
Then the engine serves the folder again with the swap of a model load (the new version loads and
warms up beside the live one, one assignment switches traffic, the old one drains): no frame
fails. Where model.toml names a ``default_version`` (the shipped models do), it is set to the new
version in the same step; otherwise the newest version is the default anyway. A rollback
(``POST /v1/models/{m}/rollback``) moves the version of the last promotion to
``<model>/retired/<version>/`` (kept, never served: the repository reads numeric folders only)
and swaps back to the version served before it, which stayed on disk (``default_version`` set
back where the file names one).

Where the model's ``[training] approvers`` is 2, a promotion takes two users: the first
approval is kept in the candidate's ``approvals.json`` and waits (:func:`promote` answers it
with state ``awaiting-approval``); another user's approval promotes. An approval counts for the
comparison it was given on: a candidate compared again needs its approvals again.

The model's promotions are kept in its candidates area, ``promotions.json`` (oldest first: the
candidate, the versions from and to, who approved and when, and who rolled it back and when);
the promoted version's folder holds ``promotion.json``, the same for it, beside the candidate's
``candidate.json`` and comparison. Version numbers are never used twice: a retired version's
number counts. Promotions and rollbacks of one model run one at a time, across the front-end
processes too (a lock file in the candidates area).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends.base import model_file
from ..errors import Conflict, NotFound
from ..guard.store import JobStore
from ..records.record import iso
from ..repository import ModelEntry
from . import candidates as cands
from .shadow import Shadows, report

if TYPE_CHECKING:
    from ..dataplane import DataPlane

#: the model's promotions, oldest first, in its candidates area
HISTORY = "promotions.json"
#: where a rolled-back version goes, in the model's folder
RETIRED = "retired"
#: a candidate's approvals waiting for the next one, in its folder
APPROVALS = "approvals.json"
#: a candidate's files that are not part of the version made of it
NOT_COPIED = ("job.json", APPROVALS)


def history(area: cands.Area) -> list[dict[str, Any]]:
    return cands.read_json(area.root / HISTORY) or []


def in_force(area: cands.Area) -> dict[str, Any] | None:
    """The last promotion not rolled back, or None."""
    return next((p for p in reversed(history(area)) if "rolled_back" not in p), None)


def annotate(area: cands.Area, shown: dict[str, Any]) -> dict[str, Any]:
    """A candidate as the API shows it (:func:`.candidates.describe`), with its last promotion:
    state ``promoted`` while that version is in force, ``rolled-back`` after its rollback."""
    mine = [p for p in history(area) if p["candidate"] == shown["id"]]
    if not mine:
        return shown
    last = mine[-1]
    return {**shown, "state": "rolled-back" if "rolled_back" in last else "promoted",
            "promotion": last}


def _numbers(folder: Path) -> set[int]:
    if not folder.is_dir():
        return set()
    return {int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()}


def next_version(model_folder: Path) -> int:
    """One above every version the model has had: its folders and the retired ones."""
    return max(_numbers(model_folder) | _numbers(model_folder / RETIRED) | {0}) + 1


def check_promotable(entry: ModelEntry, area: cands.Area, cid: str,
                     jobs: JobStore | None) -> tuple[Path, dict[str, Any]]:
    """(the candidate's folder, its comparison) where candidate ``cid`` may be promoted now;
    Conflict saying why not: not trained, not compared (or compared with another version than
    the live one), promoted already, or a model.toml that would not serve a new version."""
    folder = area.folder(cid)
    shown = cands.describe(folder, jobs)
    if shown["state"] != "done":
        raise Conflict(f"candidate {cid} is {shown['state']}: only a trained and compared "
                       "candidate is promoted")
    comparison = cands.read_json(folder / "comparison.json")
    evaluation = cands.read_json(folder / "evaluation.json")
    if comparison is None or evaluation is None:
        raise Conflict(f"candidate {cid} has no comparison with the live version: POST "
                       f"/v1/models/{entry.name}/candidates/{cid}/evaluate and wait for its "
                       "result before promoting it")
    current = in_force(area)
    if current is not None and current["candidate"] == cid:
        raise Conflict(f"candidate {cid} is promoted already: it serves as version "
                       f"{current['version']}")
    live = entry.default_version
    if evaluation["live_version"] != live:
        raise Conflict(f"candidate {cid} was compared with version {evaluation['live_version']}, "
                       f"but the model serves version {live} now: compare it again first")
    name = model_file(entry.config.runtime.backend)
    if not (folder / name).is_file():
        raise Conflict(f"candidate {cid} has no {name}, the file model {entry.name}'s backend "
                       f"({entry.config.runtime.backend}) serves")
    config = entry.config
    if config.version_policy.specific is not None:
        raise Conflict(f"model {entry.name}'s model.toml serves specific versions "
                       f"{list(config.version_policy.specific)} only, so a promoted version "
                       "would not be served: use latest or all in [version_policy]")
    return folder, comparison


def stage(entry: ModelEntry, source: Path, version: int, record: dict[str, Any]) -> Path:
    """Copy candidate ``source`` into the model's folder as ``version`` (with ``record`` as its
    promotion.json): written into a hidden folder, then renamed in one step."""
    tmp = entry.path / f".promote-{version}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name not in NOT_COPIED:
                shutil.copy2(f, tmp / f.name)
        cands.write_json(tmp / "promotion.json", record)
        for f in [*tmp.iterdir(), tmp]:
            os.chmod(f, 0o644 if f.is_file() else 0o755)  # only the server's user writes it
        target = entry.path / str(version)
        os.rename(tmp, target)  # fails where the folder exists: never over a version
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


@asynccontextmanager
async def exclusive(area: cands.Area) -> AsyncIterator[None]:
    """One promotion or rollback of a model at a time, across processes (an flock)."""
    area.root.mkdir(exist_ok=True)
    fd = os.open(area.root / ".promote.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _entry(engine: DataPlane, model: str) -> ModelEntry:
    entry = engine.entries.get(model)
    if entry is None:
        raise NotFound(f"no model {model!r} in the repository")
    return entry


def waiting(folder: Path) -> list[dict[str, Any]]:
    """The approvals of the candidate in ``folder`` that wait for the next one: those given on
    its comparison as it is now."""
    evaluation = cands.read_json(folder / "evaluation.json")
    if evaluation is None:
        return []
    return [a for a in cands.read_json(folder / APPROVALS) or []
            if a.get("evaluation_job") == evaluation["job"]["id"]]


def approve(entry: ModelEntry, folder: Path, cid: str, by: str,
            now: float) -> list[dict[str, Any]] | None:
    """``by``'s approval of the promotion of the candidate in ``folder``: the approvals so far
    where the model needs more than there are now (kept in ``approvals.json``), or None where
    this one completes them. Conflict where ``by`` approved it already."""
    given = waiting(folder)
    if any(a["by"] == by for a in given):
        raise Conflict(f"candidate {cid} is approved by {by} already: model {entry.name} needs "
                       f"{entry.config.training.approvers} approvers, another user approves "
                       "its promotion")
    if len(given) + 1 >= entry.config.training.approvers:
        return None
    evaluation = cands.read_json(folder / "evaluation.json") or {"job": {"id": None}}
    given.append({"by": by, "approved": iso(now), "approved_at": now,
                  "evaluation_job": evaluation["job"]["id"]})
    cands.write_json(folder / APPROVALS, given)
    return given


async def promote(engine: DataPlane, jobs: JobStore | None, model: str, cid: str,
                  by: str) -> dict[str, Any]:
    """Promote candidate ``cid`` of ``model``, approved by ``by``: the promotion as kept; or,
    where the model needs another approver, the approval kept (state ``awaiting-approval``)."""
    entry = _entry(engine, model)
    area = cands.Area(entry.path)
    async with exclusive(area):
        entry = _entry(engine, model)
        source, comparison = await asyncio.to_thread(check_promotable, entry, area, cid, jobs)
        now = time.time()
        first = await asyncio.to_thread(waiting, source)
        pending = await asyncio.to_thread(approve, entry, source, cid, by, now)
        if pending is not None:
            return {"candidate": cid, "model": model, "state": "awaiting-approval",
                    "approvals": pending, "approvers": entry.config.training.approvers}
        version = await asyncio.to_thread(next_version, entry.path)
        record = {"candidate": cid, "model": model, "version": version,
                  "from_version": entry.default_version, "approved_by": by,
                  "approved": iso(now), "approved_at": now,
                  **({"approvals": [*first, {"by": by, "approved": iso(now),
                                             "approved_at": now}]} if first else {}),
                  "comparison": comparison.get("summary")}
        target = await asyncio.to_thread(stage, entry, source, version, record)
        try:
            done = await engine.reload_model(model, "promote", version)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, target, True)
            raise
        record.pop("comparison")
        await asyncio.to_thread(cands.write_json, area.root / HISTORY,
                                [*history(area), record])
        # spent: promoting it again (after a rollback) takes its approvals again
        await asyncio.to_thread((source / APPROVALS).unlink, True)
    return {**record, "versions": done["versions"]}


async def rollback(engine: DataPlane, model: str, by: str) -> dict[str, Any]:
    """Serve again the version served before the last promotion in force of ``model``; its
    version is retired. The promotion as kept, with ``rolled_back``."""
    entry = _entry(engine, model)
    area = cands.Area(entry.path)
    async with exclusive(area):
        entry = _entry(engine, model)
        kept = await asyncio.to_thread(history, area)
        last = next((p for p in reversed(kept) if "rolled_back" not in p), None)
        if last is None:
            raise Conflict(f"model {model} has no promotion to roll back"
                           + (" (each one is rolled back already)" if kept else ""))
        to, back = last["version"], last["from_version"]
        on_disk = await asyncio.to_thread(_numbers, entry.path)
        if entry.default_version != to:
            raise Conflict(f"model {model} serves version {entry.default_version}, not version "
                           f"{to} of the last promotion (candidate {last['candidate']}): "
                           "nothing to roll back")
        if back not in on_disk or (entry.config.default_version is None
                                   and max(on_disk - {to}) != back):
            raise Conflict(f"version {back}, served before the promotion of version {to}, is "
                           "no longer the newest other version on disk: load the version wanted "
                           "by hand")
        retired = entry.path / RETIRED
        await asyncio.to_thread(retired.mkdir, 0o755, False, True)
        await asyncio.to_thread(os.rename, entry.path / str(to), retired / str(to))
        try:
            done = await engine.reload_model(model, "rollback", back)
        except BaseException:
            await asyncio.to_thread(os.rename, retired / str(to), entry.path / str(to))
            raise
        now = time.time()
        last["rolled_back"] = {"by": by, "time": iso(now), "at": now}
        await asyncio.to_thread(cands.write_json, area.root / HISTORY, kept)
    return {**last, "versions": done["versions"]}


#: what the console's Candidates page shows of a candidate's latest shadow run
SHADOW_FIELDS = ("state", "judged", "agreement", "disagree", "live_ng", "candidate_ng", "dropped",
                 "live_version")


def shadow_summary(folder: Path, entry: ModelEntry, shadows: Shadows | None
                   ) -> dict[str, Any] | None:
    """The candidate's latest shadow run as :func:`.shadow.report` gives it (its
    :data:`SHADOW_FIELDS`), or None where it never ran in shadow."""
    if not (folder / "shadow.sqlite").is_file():
        return None
    live = shadows.live(entry.name, folder.name) if shadows is not None else None
    try:
        shown = report(folder, folder.name, entry.name, live, None)
    except NotFound:
        return None
    return {k: shown[k] for k in SHADOW_FIELDS}


def overview(entry: ModelEntry, jobs: JobStore | None,
             shadows: Shadows | None = None) -> dict[str, Any]:
    """(a worker thread) The console's view of a model's candidates: each as the API shows it,
    with its comparison's ``summary`` (None before one is done), the version it was compared
    with, its latest shadow run (:func:`shadow_summary`) and whether it may be promoted now; the
    promotion in force and the version served."""
    area = cands.Area(entry.path)
    rows = []
    for folder in area.started():
        shown = annotate(area, cands.describe(folder, jobs))
        comparison = cands.read_json(folder / "comparison.json")
        evaluation = cands.read_json(folder / "evaluation.json")
        rows.append({**shown, "promotion": shown.get("promotion"),
                     "from_version": (shown.get("candidate") or shown).get("from_version"),
                     "summary": comparison["summary"] if comparison else None,
                     "compared_with": evaluation["live_version"] if evaluation else None,
                     "promotable": shown["state"] in ("done", "rolled-back")
                     and comparison is not None,
                     "approvals": waiting(folder),
                     "shadow": shadow_summary(folder, entry, shadows)})
    return {"model": entry.name, "candidates": rows[::-1], "in_force": in_force(area),
            "serving": entry.default_version, "approvers": entry.config.training.approvers}
