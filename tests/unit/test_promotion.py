"""The promotion of a candidate (docs/closed-loop.md), its file work: the next version number
(retired ones count), the staging of a version folder in one rename, a model.toml's default
version rewritten in place, and a candidate's state from the model's promotions."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tomllib

from visionserve.errors import Conflict
from visionserve.loop import candidates as cands
from visionserve.loop import promote
from visionserve.records.record import iso
from visionserve.repository import ModelEntry, load_entry, with_default_version

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "defect-classifier"
TOML = """# a model
name = "m"
task = "classification"
default_version = 1   # the shipped one

[input]
width = 8
height = 8
default_version = 9

[output]
labels = ["ok", "ng"]
"""


def test_the_default_version_is_rewritten_in_place_and_only_at_the_top():
    new = with_default_version(TOML, 3)
    assert new is not None and tomllib.loads(new)["default_version"] == 3
    assert new == TOML.replace("default_version = 1   #", "default_version = 3   #")
    assert "default_version = 9" in new  # another table's key is not the model's
    assert with_default_version('task = "classification"\n[input]\ndefault_version = 2\n',
                                5) is None


def test_the_next_version_counts_the_retired_ones(tmp_path):
    assert promote.next_version(tmp_path) == 1
    for v in ("1", "3", "candidates", "notes"):
        (tmp_path / v).mkdir()
    assert promote.next_version(tmp_path) == 4
    (tmp_path / "retired" / "7").mkdir(parents=True)
    assert promote.next_version(tmp_path) == 8


def model(tmp_path) -> ModelEntry:
    """The shipped classifier's model.toml, with a stand-in for its model file."""
    folder = tmp_path / "defect-classifier"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"v1")
    shutil.copy(SHIPPED / "model.toml", folder / "model.toml")
    folder.chmod(0o755)
    return load_entry(folder)


def test_a_version_is_staged_whole_and_never_over_another(tmp_path):
    entry = model(tmp_path)
    source = tmp_path / "c-1"
    source.mkdir()
    for name in ("model.onnx", "weights.pt", "candidate.json", "job.json"):
        (source / name).write_text(name)
    (source / "heldout").mkdir()
    target = promote.stage(entry, source, 2, {"candidate": "c-1"})
    assert target == entry.path / "2"
    assert sorted(p.name for p in target.iterdir()) == [
        "candidate.json", "model.onnx", "promotion.json", "weights.pt"]
    assert cands.read_json(target / "promotion.json") == {"candidate": "c-1"}
    assert sorted(load_entry(entry.path).versions) == [1, 2]  # the server may serve it
    with pytest.raises(OSError):
        promote.stage(entry, source, 1, {})
    assert not list(entry.path.glob(".promote-*"))  # nothing left half-way


def test_a_candidates_state_follows_the_promotions(tmp_path):
    area = cands.Area(tmp_path)
    area.root.mkdir()
    shown = {"id": "c-1", "state": "done"}
    assert promote.annotate(area, shown) == shown
    history = [{"candidate": "c-1", "version": 2, "from_version": 1}]
    cands.write_json(area.root / promote.HISTORY, history)
    assert promote.annotate(area, shown)["state"] == "promoted"
    assert promote.in_force(area) == history[0]
    history[0]["rolled_back"] = {"by": "qe"}
    cands.write_json(area.root / promote.HISTORY, history)
    assert promote.annotate(area, shown)["state"] == "rolled-back"
    assert promote.in_force(area) is None
    assert promote.annotate(area, {"id": "c-2", "state": "done"})["state"] == "done"


def test_an_approval_counts_for_the_comparison_it_was_given_on(tmp_path):
    """Two approvers: the first approval waits, the same user's second is refused, another
    user's completes them; a comparison made again voids the approvals given before it."""
    entry = model(tmp_path)
    entry = ModelEntry(entry.name, entry.path, entry.config.model_copy(update={
        "training": entry.config.training.model_copy(update={"approvers": 2})}),
        entry.versions)
    folder = tmp_path / "c-1"
    folder.mkdir()
    cands.write_json(folder / "evaluation.json", {"job": {"id": 4}})
    assert promote.approve(entry, folder, "c-1", "anna", 1.0) == [
        {"by": "anna", "approved": iso(1.0), "approved_at": 1.0, "evaluation_job": 4}]
    with pytest.raises(Conflict, match="approved by anna already"):
        promote.approve(entry, folder, "c-1", "anna", 2.0)
    assert [a["by"] for a in promote.waiting(folder)] == ["anna"]
    assert promote.approve(entry, folder, "c-1", "max", 3.0) is None   # the second: promote
    cands.write_json(folder / "evaluation.json", {"job": {"id": 5}})  # compared again
    assert promote.waiting(folder) == []
    assert len(promote.approve(entry, folder, "c-1", "anna", 4.0)) == 1
