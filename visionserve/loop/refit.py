"""An anomaly model's candidate: a refit with the new good parts, no labels needed.

The good parts among the model's captures are the frames labelled ``good`` and the OK frames
``--capture learn`` sampled (``kept_for = "sample"``) and nobody labelled otherwise. They are
exported into the candidate's folder (``train/good/``, ``heldout/good/``: the same stable split
by record id as a classifier's labels), the frames labelled ``defective`` all into
``heldout/defective/`` (a refit never learns from a defect; they measure its recall). The guard
job (``python -m visionserve_tools.training.refit``) refits the source version with the
training frames and, where the model folder says where they are, the good images it was fitted
on: ``[training] good`` in model.toml, else the ``--good`` folder the version's ``fit.json``
names. Without them it keeps the version's memory bank (its ``model.pt2``) and adds the new
patches to it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import Conflict
from ..records.images import ImageSource
from ..records.record import iso
from ..records.store import RecordStore
from ..repository import ModelEntry
from . import candidates as cands
from .plan import Plan

GOOD, DEFECTIVE = "good", "defective"
#: GPU memory the refit declares to the guard (features, coreset and bank on the GPU)
REFIT_GPU_MEM = 1 << 30


def original_data(entry: ModelEntry, source: Path) -> Path | None:
    """The good images the model was fitted on, where its folder says and they still are."""
    named = entry.config.training.good
    if named is not None:
        path = Path(named) if Path(named).is_absolute() else entry.path / named
        if not path.is_dir():
            raise Conflict(f"model {entry.name!r}: its model.toml's [training] good = "
                           f"{named!r} is not a folder ({path})")
        return path.absolute()
    try:
        fitted = json.loads((source / "fit.json").read_text())
    except (OSError, ValueError):
        return None
    good = fitted.get("good") if isinstance(fitted, dict) else None
    return Path(good) if isinstance(good, str) and Path(good).is_dir() else None


def check(entry: ModelEntry, source: Path) -> Path | None:
    """The original data (or None); Conflict where there is nothing to keep the model's good
    parts by: neither the original images nor the version's memory bank."""
    original = original_data(entry, source)
    if original is None and not (source / "model.pt2").is_file():
        raise Conflict(f"model {entry.name!r} version {source.name} cannot be refitted: the "
                       "refit needs the good images it was fitted on ([training] good in its "
                       "model.toml) or its model.pt2 (the memory bank visionserve anomaly fit "
                       "writes), and it has neither")
    return original


def export_good(store: RecordStore, images: ImageSource, model: str,
                dest: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, held out): the good parts (labelled good, or sampled OK and unlabelled) split
    by record id, and every frame labelled defective held out; each as candidate.json lists
    it (a sampled frame has no ``labelled_by``)."""
    training: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []

    def keep(row_id: int, record, label: str, by: str | None, at: str | None) -> None:
        part = "heldout" if label == DEFECTIVE or cands.held_out(row_id) else "train"
        rel = cands.save_frame(images, row_id, record, dest, f"{part}/{label}")
        if rel is not None:
            (held if part == "heldout" else training).append(
                {"record_id": row_id, "label": label, "labelled_by": by, "labelled_at": at,
                 "kept_for": record.kept_for, "file": rel})

    for row_id, record, label in cands.labelled_rows(store, model):
        name = label.label.get("label")
        if name in (GOOD, DEFECTIVE):
            keep(row_id, record, name, label.by, iso(label.time))
    for row_id, record, _ in cands.labelled_rows(store, model, labelled=False):
        if record.kept_for == "sample" and record.verdict == "OK":
            keep(row_id, record, GOOD, None, None)
    return training, held


def plan(store: RecordStore, images: ImageSource, entry: ModelEntry, source: Path,
         folder: Path, device: str) -> Plan:
    """Export the good parts into ``folder``; the refit's plan. Conflict without good parts."""
    original = check(entry, source)
    training, held = export_good(store, images, entry.name, folder)
    if not training:
        raise Conflict(f"model {entry.name!r} has no good parts to refit with ({len(held)} "
                       "frames held out for the comparison): label captured frames \"good\" "
                       "(GET /v1/review, PUT /v1/records/{id}/label) or sample OK frames with "
                       "--capture learn")
    command = [sys.executable, "-m", "visionserve_tools.training.refit",
               "--model-toml", str(entry.path / "model.toml"), "--source", str(source),
               "--good", str(folder / "train"), "--out", str(folder), "--device", device,
               "--threads", "1"]
    if original is not None:
        command += ["--original", str(original)]
    labelled = sum(1 for x in training if x["labelled_by"] is not None)
    recipe = {"good_parts": len(training), "labelled_good": labelled,
              "sampled_ok": len(training) - labelled,
              "original_data": str(original) if original is not None else None,
              "method": ("a new memory bank from the original good images and the good parts, "
                         "calibrated on original images held out" if original is not None else
                         f"version {source.name}'s memory bank with the good parts' patches "
                         "added, its normalisation kept"),
              "held_out": f"every {cands.HOLDOUT_EVERY}th good part by a stable hash of its "
                          "record id, and every frame labelled defective"}
    return Plan("refit", command, ["model.onnx", "metadata.json"], "fit.json", training, held,
                recipe, os.getcwd(), REFIT_GPU_MEM)
