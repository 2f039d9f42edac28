"""A candidate trained by the model's own command: ``[training] command`` in its model.toml.

For a model the project cannot train itself (a user's classifier or detector export) the user
registers the command that trains it; the loop runs it as the guard job, in the model's folder,
handed the labelled set:

- ``{data}``: the training part of the labelled set, in the loop's export layout: a sub-folder
  per label with each frame as an image file (``<label>/<record>.<ext>``; an anomaly model's
  labels are ``good`` and ``defective``); for a detector ``images/<record>.<ext>`` and
  ``boxes.json``, each image's boxes by its path from there (``{"images/<record>.<ext>":
  [{"label": "scratch", "box": [x1, y1, x2, y2]}, ...]}``, frame pixels; ``[]``: nothing to
  find). The held-out part lies beside
  it (``{out}/heldout``) for the comparison, and is not the command's;
- ``{out}``: the candidate's folder, where the command must leave the version's model file
  (``model.onnx``, or the file of the model's backend) and, if it likes, ``metrics.json``;
- ``{from}``: the folder of the version trained from; ``{model}``: the model's folder;
  ``{device}``: ``cuda`` where the guard has a GPU, else ``cpu``; ``{steps}``: the request's
  steps; ``{python}``: the server's Python interpreter.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..backends.base import model_file
from ..config import parse_bytes
from ..records.images import ImageSource
from ..records.labels import scheme_of
from ..records.store import RecordStore
from ..repository import ModelEntry
from . import candidates as cands
from .plan import TRAIN_GPU_MEM, Plan


def arguments(template: tuple[str, ...], values: dict[str, str]) -> list[str]:
    """The command with its placeholders filled (model.toml's validation named every one)."""
    return [arg.format(**values) for arg in template]


def plan(store: RecordStore, images: ImageSource, entry: ModelEntry, source: Path,
         folder: Path, device: str, steps: int) -> Plan | None:
    """Export the labelled set into ``folder``; the command's plan, or None where there is
    nothing labelled to train on."""
    spec = entry.config.training
    assert spec.command is not None
    scheme = scheme_of(entry.name, entry.config)
    if scheme.boxes:
        training, held = cands.export_boxes(store, images, entry.name, folder)
    else:
        exported = cands.export(store, images, entry.name, scheme.labels, folder)
        training, held = (cands.labelled_dicts(exported.training),
                          cands.labelled_dicts(exported.held_out))
    if not training:
        return None
    values = {"data": str(folder / "train"), "out": str(folder), "from": str(source),
              "model": str(entry.path), "device": device, "steps": str(steps),
              "python": sys.executable}
    recipe = {"labelled_frames": len(training), "command": list(spec.command),
              "layout": "boxes.json and images/" if scheme.boxes else "a folder per label",
              "held_out": f"every {cands.HOLDOUT_EVERY}th labelled record by a stable hash of "
                          "its id"}
    gpu_mem = parse_bytes(spec.gpu_memory) if spec.gpu_memory else TRAIN_GPU_MEM
    return Plan("command", arguments(spec.command, values),
                [model_file(entry.config.runtime.backend)], "metrics.json", training, held,
                recipe, str(entry.path), gpu_mem)
