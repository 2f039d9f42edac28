"""A model's candidates area: ``<repository>/<model>/candidates/<cid>/`` (``c-1``, ``c-2``, ...).

The repository reads numeric version folders only (:mod:`visionserve.repository`), so neither the
scan, ``poll`` mode nor the version policy ever serves a candidate. A candidate's folder holds,
while it trains, ``job.json`` (what it is trained on and the guard job that trains it) and the
exported frames (``train/<label>/<record>.<ext>``, ``heldout/<label>/<record>.<ext>``); once its
job succeeded, what a version folder holds (``weights.pt``, ``model.onnx``, ``model.pt2``,
``metrics.json``, ``export.json``) and ``candidate.json``, the traceability record (job.json and
the training's metrics, with the digests of its files and of the version it was trained from).
The training frames are removed then; the held-out ones stay for the comparison
(``evaluation.json``: its guard job; ``comparison.json``: its result, :mod:`.evaluate`).
:func:`trace` puts the whole trail of a candidate together for an audit.

The export: every labelled capture of the model (the label in force), split by a stable hash of
its record id (:func:`held_out`: every 5th out of training), each image as it was stored (a raw
frame, kept as ``.npy``, is written as PNG: the training script reads image files).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import NotFound
from ..guard.store import TERMINAL, Job, JobStore
from ..records.images import ImageSource
from ..records.record import iso
from ..records.store import MAX_PAGE, Label, RecordStore, ReviewQuery

#: one labelled record in this many is held out of training (the comparison's set)
HOLDOUT_EVERY = 5
#: the most labelled captures one candidate is trained on (the newest)
MAX_FRAMES = 20000
_CID = re.compile(r"^c-([1-9][0-9]{0,8})$")
#: what a trained candidate (and a version it is trained from) is, by file: their SHA-256 in
#: candidate.json say which bytes were trained, compared and, later, served
ARTEFACTS = ("weights.pt", "model.onnx", "model.pt2", "metrics.json", "export.json",
             "metadata.json", "fit.json")
#: a candidate's states: its training job's (paused counts as running), or done
STATES = ("queued", "running", "done", "failed")


def held_out(record_id: int) -> bool:
    """Whether a labelled record is held out of training: fixed by its id (a stable hash), so a
    frame never moves between the two sets from one candidate to the next."""
    digest = hashlib.sha256(f"record:{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HOLDOUT_EVERY == 0


@dataclass(frozen=True)
class Labelled:
    """A labelled capture as exported: its record (its part and the line's verdict), its label,
    who labelled it, when and where (``flag`` or ``review``), whether they said the line's
    verdict was wrong, and its file in the candidate's folder."""

    record_id: int
    label: str
    labelled_by: str
    labelled_at: str
    file: str
    source: str
    verdict_was_wrong: bool
    part_id: str | None
    verdict: str


@dataclass(frozen=True)
class Export:
    training: list[Labelled]
    held_out: list[Labelled]


def labelled_rows(store: RecordStore, model: str, limit: int = MAX_FRAMES,
                  labelled: bool = True) -> Iterator[tuple]:
    """(record id, Record, Label) of the model's labelled captures (``labelled`` False: its
    captures without a label, Label None), newest first, a page at a time (the review queue's
    query)."""
    before, n = None, 0
    while n < limit:
        page = min(MAX_PAGE, limit - n)
        rows = store.review(ReviewQuery(model, labelled, before, page))
        yield from rows
        n += len(rows)
        if len(rows) < page:
            return
        row_id, record, _ = rows[-1]
        before = (record.time, row_id)


def image_file(data: bytes, ext: str) -> tuple[bytes, str]:
    """A stored image as an image file: as stored, a raw frame (``npy``, RGB or grey) as PNG."""
    if ext != "npy":
        return data, ext
    import cv2

    pixels = np.load(io.BytesIO(data), allow_pickle=False)
    if pixels.ndim == 3 and pixels.shape[2] == 3:
        pixels = pixels[:, :, ::-1]  # RGB -> the BGR OpenCV writes
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(pixels))
    if not ok:
        raise ValueError(f"a raw frame of shape {pixels.shape} cannot be written as PNG")
    return buf.tobytes(), "png"


def export(store: RecordStore, images: ImageSource, model: str, labels: tuple[str, ...],
           dest: Path) -> Export:
    """Write the model's labelled captures (classifier labels among ``labels``) into
    ``dest/train`` and ``dest/heldout``, a sub-folder per label; an image no longer kept is left
    out."""
    training: list[Labelled] = []
    held: list[Labelled] = []
    for row_id, record, label in labelled_rows(store, model):
        name = label.label.get("label")
        if name not in labels:
            continue  # a label of another task's shape (the model changed since)
        part = "heldout" if held_out(row_id) else "train"
        rel = save_frame(images, row_id, record, dest, f"{part}/{name}")
        if rel is not None:
            (held if part == "heldout" else training).append(Labelled(
                row_id, name, label.by, iso(label.time), rel, label.source,
                bool(label.label.get("verdict_was_wrong")), record.part_id, record.verdict))
    return Export(training, held)


def export_boxes(store: RecordStore, images: ImageSource, model: str,
                 dest: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A detector's labelled set: ``{train,heldout}/images/<record>.<ext>`` and each part's
    ``boxes.json``; (training, held out) as candidate.json lists them."""
    parts: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
        "train": ([], {}), "heldout": ([], {})}
    for row_id, record, label in labelled_rows(store, model):
        boxes = label.label.get("boxes")
        if not isinstance(boxes, list):
            continue  # a label of another task's shape (the model changed since)
        part = "heldout" if held_out(row_id) else "train"
        rel = save_frame(images, row_id, record, dest, f"{part}/images")
        if rel is None:
            continue
        listed, by_file = parts[part]
        by_file[rel.split("/", 1)[1]] = boxes
        listed.append({"record_id": row_id, "boxes": boxes, "labelled_by": label.by,
                       "labelled_at": iso(label.time), "file": rel})
    for part, (listed, by_file) in parts.items():
        if listed:
            write_json(dest / part / "boxes.json", by_file)
    return parts["train"][0], parts["heldout"][0]


def save_frame(images: ImageSource, row_id: int, record, dest: Path, sub: str) -> str | None:
    """Write a record's stored frame as ``dest/sub/<record id>.<ext>`` (:func:`image_file`);
    its path relative to ``dest``, or None where the image is no longer kept."""
    try:
        stored = images.read(row_id, record)
        data, ext = image_file(stored.data, stored.ext)
    except (NotFound, ValueError):
        return None
    rel = f"{sub}/{row_id}.{ext}"
    (dest / sub).mkdir(parents=True, exist_ok=True)
    (dest / rel).write_bytes(data)
    return rel


def write_json(path: Path, value: Any) -> None:
    """Write atomically: a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class Area:
    """The candidates of one model: ``<model folder>/candidates``."""

    def __init__(self, model_folder: Path) -> None:
        self.root = Path(model_folder).absolute() / "candidates"

    def ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p.name) for p in self.root.iterdir()
                 if p.is_dir() and (m := _CID.match(p.name))]
        return [cid for _, cid in sorted(found)]

    def started(self) -> list[Path]:
        """The candidates' folders whose job was submitted (a folder still being exported into,
        or left by a request that failed half-way, holds no job.json yet)."""
        return [self.root / cid for cid in self.ids() if (self.root / cid / "job.json").is_file()]

    def create(self) -> tuple[str, Path]:
        """A new candidate's folder, numbered after the highest."""
        self.root.mkdir(exist_ok=True)
        ids = self.ids()
        n = int(ids[-1][2:]) + 1 if ids else 1
        while True:
            folder = self.root / f"c-{n}"
            try:
                folder.mkdir()
                return folder.name, folder
            except FileExistsError:  # another request took it
                n += 1

    def folder(self, cid: str) -> Path:
        folder = self.root / cid
        if not _CID.match(cid) or not (folder / "job.json").is_file():
            raise NotFound(f"no candidate {cid!r} of this model (have "
                           f"{', '.join(self.ids()) or 'none'})")
        return folder


def job_state(jobs: JobStore | None, job_id: int) -> tuple[str, Job | None, str | None]:
    """(state, the job, why it failed) of a loop's guard job: queued, running, succeeded as
    "done", or failed (with the guard's reason); ``jobs`` None: the server runs no guard."""
    if jobs is None:
        return "queued", None, (f"guard job {job_id} waits: this server runs without --guard, "
                                "so nothing runs its queue")
    try:
        job = jobs.get(job_id)
    except NotFound:
        return "failed", None, f"guard job {job_id} is no longer in the guard's job database"
    if job.state == "succeeded":
        return "done", job, None
    if job.state in TERMINAL:
        return "failed", job, f"guard job {job_id} {job.state}: {job.reason or 'no reason given'}"
    return ("queued" if job.state == "queued" else "running"), job, None


def progress(job: Job | None) -> dict[str, Any] | None:
    """The job's progress: its last JSON line with a ``step`` (the training script's) or its
    last log line."""
    if job is None or not job.log_path:
        return None
    try:
        with open(job.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(job.log_path) - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                step = json.loads(line)
            except ValueError:
                continue
            if isinstance(step, dict) and "step" in step:
                return step
    return {"line": lines[-1]} if lines else None


def describe(folder: Path, jobs: JobStore | None) -> dict[str, Any]:
    """A candidate as the API shows it: id, state, progress; candidate.json once done. A job
    that succeeded is made into the candidate here (candidate.json written, the training frames
    removed): the first reader after the job's end does it, so a restart loses nothing."""
    done = read_json(folder / "candidate.json")
    if done is not None:
        return {"id": folder.name, "state": "done", "progress": None, "candidate": done}
    job_info = read_json(folder / "job.json")
    state, job, reason = job_state(jobs, job_info["job"]["id"])
    if state == "done":
        # what the job must leave: job.json names it (the fine-tune's weights.pt by default)
        missing = [f for f in job_info.get("expects", ["weights.pt"])
                   if not (folder / f).is_file()]
        if missing:
            state, reason = "failed", f"the training job ended without writing {missing[0]}"
        else:
            return {"id": folder.name, "state": "done", "progress": None,
                    "candidate": finish(folder, job_info, job)}
    out = {"id": folder.name, "state": state, "progress": progress(job),
           "job": job_info["job"], "model": job_info["model"],
           "from_version": job_info["from_version"], "created": job_info["created"]}
    if reason:
        out["reason"] = reason
    return out


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 of each of the ARTEFACTS ``folder`` holds."""
    out = {}
    for name in ARTEFACTS:
        digest = hashlib.sha256()
        try:
            with open(folder / name, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except FileNotFoundError:
            continue
        out[name] = digest.hexdigest()
    return out


#: what a candidate's metrics keep of the project's training script's metrics.json
FINETUNE_METRICS = ("final_val_acc", "history", "train_images", "val_images", "steps",
                    "freeze_backbone", "keep_batch_norm", "mix_synthetic", "synthetic_scenes",
                    "lr", "seconds", "device", "export")


def finish(folder: Path, job_info: dict[str, Any], job: Job | None) -> dict[str, Any]:
    """candidate.json: job.json with the end and the metrics (the file job.json's
    ``metrics_file`` names, metrics.json by default: the fine-tune's keys of it, or all of
    another job's)."""
    metrics = read_json(folder / job_info.get("metrics_file", "metrics.json"))
    metrics = metrics if isinstance(metrics, dict) else {}
    if job_info.get("kind", "finetune") == "finetune":
        metrics = {k: metrics.get(k) for k in FINETUNE_METRICS}
    ended = job.ended_at if job is not None and job.ended_at else time.time()
    candidate = {**job_info, "finished": iso(ended), "metrics": metrics,
                 # which bytes: the candidate's, and the version's it was trained from (a
                 # version folder is never rewritten: a new version is a new folder)
                 "files": digests(folder),
                 "from_files": digests(folder.parent.parent / str(job_info["from_version"]))}
    write_json(folder / "candidate.json", candidate)
    shutil.rmtree(folder / "train", ignore_errors=True)
    return candidate


def labelled_dicts(items: list[Labelled]) -> list[dict[str, Any]]:
    return [asdict(x) for x in items]


def comparison(folder: Path, jobs: JobStore | None) -> dict[str, Any]:
    """A candidate's comparison with the live version: its state and, once done, per record
    and summed up, with the records where the two disagree; NotFound before one was asked for."""
    cid = folder.name
    evaluation = read_json(folder / "evaluation.json")
    if evaluation is None:
        raise NotFound(f"candidate {cid} has not been compared yet: POST "
                       f"/v1/models/{folder.parent.parent.name}/candidates/{cid}/evaluate")
    result = read_json(folder / "comparison.json")
    if result is not None:
        disagree = set(result["summary"]["disagree"])
        return {"id": cid, "state": "done", "evaluation": evaluation, **result,
                "disagreements": [r for r in result["records"] if r["record_id"] in disagree]}
    state, job, reason = job_state(jobs, evaluation["job"]["id"])
    if state == "done":
        state, reason = "failed", "the comparison job ended without writing its result"
    return {"id": cid, "state": state, "evaluation": evaluation,
            "progress": progress(job), **({"reason": reason} if reason else {})}


def used(folder: Path) -> set[int]:
    """The records a candidate was trained or compared on (its job.json's)."""
    info = read_json(folder / "job.json") or {}
    return {x["record_id"] for part in ("trained_on", "held_out") for x in info.get(part, [])}


def trace(folder: Path, jobs: JobStore | None, store: RecordStore) -> dict[str, Any]:
    """A candidate's trail for an audit: the version it was trained from, the training (who
    asked, the guard job, its command and recipe, its metrics, which bytes came out), the
    labelled records it was trained and compared on (each label, who set it, when and where)
    and those whose label in force changed since, and its comparison with the live version (the
    held-out records and the figures)."""
    shown = describe(folder, jobs)
    info = shown.get("candidate") or read_json(folder / "job.json")
    training = {"job": {**info["job"], "state": shown["state"]}, "recipe": info["recipe"],
                "requested_by": info["created_by"], "requested": info["created"],
                **{k: info.get(k) for k in ("finished", "metrics", "files")}}
    try:
        compared = comparison(folder, jobs)
        evaluation: dict[str, Any] | None = {
            "state": compared["state"], **compared["evaluation"],
            "records": [r["record_id"] for r in compared.get("records", [])],
            "summary": compared.get("summary")}
    except NotFound:
        evaluation = None
    return {"id": folder.name, "model": info["model"], "state": shown["state"],
            **({"reason": shown["reason"]} if "reason" in shown else {}),
            "from_version": info["from_version"], "from_files": info.get("from_files"),
            "training": training, "trained_on": info["trained_on"],
            "held_out": info["held_out"],
            "relabelled": relabelled(store, info["model"], info["trained_on"] + info["held_out"]),
            "evaluation": evaluation}


def relabelled(store: RecordStore, model: str, items: list[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """The records among ``items`` (a candidate's ``trained_on`` and ``held_out``) whose label
    in force is no longer the one the candidate used: each with the label used and the one in
    force now."""
    if not items:
        return []
    now: dict[int, Label] = {row_id: label for row_id, _, label in labelled_rows(store, model)
                             if label is not None}
    out = []
    for x in items:
        label = now.get(x["record_id"])
        if label is None:  # beyond the newest labelled captures: asked on its own
            labels = store.labels(x["record_id"])
            label = labels[0] if labels else None
        if label is None or (label.by, iso(label.time)) != (x["labelled_by"], x["labelled_at"]):
            out.append({"record_id": x["record_id"],
                        "used": {k: x[k] for k in ("label", "labelled_by", "labelled_at")},
                        "now": None if label is None else label.to_dict()})
    return out
