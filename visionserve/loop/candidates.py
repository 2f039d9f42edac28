"""A model's candidates area: ``<repository>/<model>/candidates/<cid>/`` (``c-1``, ``c-2``, ...).

The repository reads numeric version folders only (:mod:`visionserve.repository`), so neither the
scan, ``poll`` mode nor the version policy ever serves a candidate. A candidate's folder holds,
while it trains, ``job.json`` (what it is trained on and the guard job that trains it) and the
exported frames (``train/<label>/<record>.<ext>``, ``heldout/<label>/<record>.<ext>``); once its
job succeeded, what a version folder holds (``weights.pt``, ``model.onnx``, ``model.pt2``,
``metrics.json``, ``export.json``) and ``candidate.json``, the traceability record (job.json and
the training's metrics). The training frames are removed then; the held-out ones stay for the
comparison (``evaluation.json``: its guard job; ``comparison.json``: its result, :mod:`.evaluate`).

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
from ..records.store import MAX_PAGE, RecordStore, ReviewQuery

#: one labelled record in this many is held out of training (the comparison's set)
HOLDOUT_EVERY = 5
#: the most labelled captures one candidate is trained on (the newest)
MAX_FRAMES = 20000
_CID = re.compile(r"^c-([1-9][0-9]{0,8})$")
#: a candidate's states: its training job's (paused counts as running), or done
STATES = ("queued", "running", "done", "failed")


def held_out(record_id: int) -> bool:
    """Whether a labelled record is held out of training: fixed by its id (a stable hash), so a
    frame never moves between the two sets from one candidate to the next."""
    digest = hashlib.sha256(f"record:{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HOLDOUT_EVERY == 0


@dataclass(frozen=True)
class Labelled:
    """A labelled capture as exported: its record, label, who labelled it and when, and its file
    in the candidate's folder."""

    record_id: int
    label: str
    labelled_by: str
    labelled_at: str
    file: str


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
            (held if part == "heldout" else training).append(
                Labelled(row_id, name, label.by, iso(label.time), rel))
    return Export(training, held)


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


#: what a candidate's metrics keep of the project's training script's metrics.json
FINETUNE_METRICS = ("final_val_acc", "history", "train_images", "val_images", "steps",
                    "freeze_backbone", "mix_synthetic", "seconds", "device", "export")


def finish(folder: Path, job_info: dict[str, Any], job: Job | None) -> dict[str, Any]:
    """candidate.json: job.json with the end and the metrics (the file job.json's
    ``metrics_file`` names, metrics.json by default: the fine-tune's keys of it, or all of
    another job's)."""
    metrics = read_json(folder / job_info.get("metrics_file", "metrics.json"))
    metrics = metrics if isinstance(metrics, dict) else {}
    if job_info.get("kind", "finetune") == "finetune":
        metrics = {k: metrics.get(k) for k in FINETUNE_METRICS}
    ended = job.ended_at if job is not None and job.ended_at else time.time()
    candidate = {**job_info, "finished": iso(ended), "metrics": metrics}
    write_json(folder / "candidate.json", candidate)
    shutil.rmtree(folder / "train", ignore_errors=True)
    return candidate


def labelled_dicts(items: list[Labelled]) -> list[dict[str, Any]]:
    return [asdict(x) for x in items]
