"""Capture for learning and the labels of captured frames, below the HTTP routes: the ``learn``
capture policy and its reasons, labels checked against a model's labels (:mod:`.labels`), the
``labels`` table in a real SQLite file (every label kept, the latest in force, the review queue
a page at a time, retention keeps labelled records), and a capture folder whose quota never
deletes a labelled frame, nor a bucket's spool. PostgreSQL runs :func:`label_round_trip` in
tests/integration/test_records_serving.py."""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.unit.test_records import TASK, _record, _result
from visionserve.config import ModelConfig, ServerSettings
from visionserve.errors import InvalidInput
from visionserve.records import labels
from visionserve.records.capture import FolderTarget, Policy, S3Target, open_target
from visionserve.records.store import RecordStore, ReviewQuery, SqliteStore

# --- the learn policy ----------------------------------------------------------------------------


def test_learn_keeps_ng_uncertain_and_a_sample_of_ok_and_says_which():
    ng, ok = _result("NG"), _result("OK", (0.95, 0.03, 0.02))
    near_ng = _result("NG", (0.55, 0.45, 0.0))  # best OK score 0.55, threshold 0.6
    near_ok = _result("OK", (0.65, 0.35, 0.0))
    learn = Policy("learn", band=0.1, percent=10, rng=random.Random(3))
    assert learn.wants("NG", TASK, ng.result) == "ng"
    assert learn.wants("NG", TASK, near_ng.result) == "uncertain"
    assert learn.wants("OK", TASK, near_ok.result) == "uncertain"
    kept = [learn.wants("OK", TASK, ok.result) for _ in range(10_000)]
    assert set(kept) == {"sample", None} and 0.08 < kept.count("sample") / 10_000 < 0.12
    # the other policies name themselves
    assert Policy("all").wants("OK", TASK, ok.result) == "all"
    assert Policy("ng").wants("NG", TASK, ng.result) == "ng"
    assert Policy("uncertain").wants("OK", TASK, near_ok.result) == "uncertain"
    assert Policy("none").wants("NG", TASK, ng.result) is None


# --- checking a label ----------------------------------------------------------------------------

def _config(task: str, **sections) -> ModelConfig:
    return ModelConfig.model_validate({"task": task, "input": {"width": 64, "height": 64},
                                       **sections})


CLASSIFIER = labels.scheme_of("c", _config(
    "classification", output={"labels": ["ok", "scratch"]}, verdict={"ok_labels": ["ok"]}))
DETECTOR = labels.Scheme("detection", ("scratch", "spot"))
ANOMALY = labels.Scheme("anomaly", labels.ANOMALY_LABELS)


def _size() -> tuple[int, int]:
    return 640, 480


def test_a_label_is_checked_against_the_models_labels():
    assert CLASSIFIER == labels.Scheme("classification", ("ok", "scratch"))
    assert labels.validate(CLASSIFIER, {"verdict_was_wrong": True, "label": "scratch"},
                           _size) == {"label": "scratch", "verdict_was_wrong": True}
    assert labels.validate(ANOMALY, {"label": "good"}, _size) == {"label": "good"}
    box = {"label": "spot", "box": [1, 2.5, 640, 480]}
    assert labels.validate(DETECTOR, {"boxes": [box]}, _size) == {
        "boxes": [{"label": "spot", "box": [1.0, 2.5, 640.0, 480.0]}]}
    assert labels.validate(DETECTOR, {"boxes": []}, _size) == {"boxes": []}


@pytest.mark.parametrize("scheme, body, says", [
    (CLASSIFIER, {"label": "dent"}, "'dent' is not a label of this model: one of ok, scratch"),
    (CLASSIFIER, {"boxes": []}, 'model\'s label is {"label": "ok"}'),
    (CLASSIFIER, {"label": "ok", "color": 1}, "not understood: color"),
    (CLASSIFIER, {"label": "ok", "verdict_was_wrong": "yes"}, "true or false"),
    (ANOMALY, {"label": "scratch"}, "one of good, defective"),
    (DETECTOR, {"label": "spot"}, '{"boxes": [{"label": "scratch", "box": [x1, y1, x2, y2]}]}'),
    (DETECTOR, {"boxes": [{"label": "spot", "box": [700, 0, 710, 10]}]},
     "lies outside the frame (0, 0, 640, 480)"),
    (DETECTOR, {"boxes": [{"label": "spot", "box": [-1, 0, 10, 10]}]}, "outside the frame"),
    (DETECTOR, {"boxes": [{"label": "spot", "box": [10, 0, 10, 10]}]},
     "x2 must be greater than x1"),
    (DETECTOR, {"boxes": [{"label": "spot", "box": [0, 0, 10]}]}, "four numbers"),
    (DETECTOR, {"boxes": [{"label": "spot", "box": [0, 0, True, 10]}]}, "four numbers"),
    (DETECTOR, {"boxes": [{"label": "dent", "box": [0, 0, 1, 1]}]}, "boxes[0].label 'dent'"),
    (DETECTOR, {"boxes": "all"}, "a list of"),
])
def test_a_wrong_label_is_refused_with_what_is_wrong(scheme, body, says):
    with pytest.raises(InvalidInput) as err:
        labels.validate(scheme, body, _size)
    assert says in err.value.message


def test_a_segmenter_has_no_labels_yet():
    config = _config("segmentation", output={"labels": ["scratch"], "format": "semantic"})
    with pytest.raises(InvalidInput, match="classification, anomaly, detection"):
        labels.scheme_of("seg", config)


# --- the labels table ----------------------------------------------------------------------------

def label_round_trip(store: RecordStore, model: str = "tiny") -> None:
    """Labels kept beside the records of ``store`` (either dialect): the latest in force, every
    one kept; the review queue of captured records with or without one, a page at a time;
    retention keeps the labelled records; the images of labelled records for the quota."""
    t0 = 1_800_000_000.0
    store.write([dataclasses.replace(r, model=model) for r in [
        *(_record(t0 + i, part=f"L-{i}", image=f"2027-01-15/L-{i}.jpg", kept_for="sample")
          for i in range(5)),
        _record(t0 + 9, part="L-none")]])  # not captured
    page = store.review(ReviewQuery(model, labelled=False, limit=3))
    assert [r.part_id for _, r, lab in page] == ["L-4", "L-3", "L-2"]
    assert all(lab is None for *_, lab in page) and page[0][1].kept_for == "sample"
    rest = store.review(ReviewQuery(model, before=(page[-1][1].time, page[-1][0]), limit=3))
    assert [r.part_id for _, r, _ in rest] == ["L-1", "L-0"]
    ids = {r.part_id: i for i, r, _ in page + rest}
    first = store.add_label(ids["L-1"], {"label": "ok"}, "qe-anna", "flag", now=t0 + 20)
    store.add_label(ids["L-1"], {"label": "scratch"}, "max", "review", now=t0 + 21)
    store.add_label(ids["L-3"], {"boxes": [{"label": "spot", "box": [1.0, 2.0, 3.0, 4.0]}]},
                    "admin-token", "review", now=t0 + 22)
    assert first.to_dict()["time"] == "2027-01-15T08:00:20.000Z"
    history = store.labels(ids["L-1"])
    assert [(lab.label, lab.by, lab.source) for lab in history] == [
        ({"label": "scratch"}, "max", "review"), ({"label": "ok"}, "qe-anna", "flag")]
    assert history[1].time == t0 + 20
    done = store.review(ReviewQuery(model, labelled=True))
    assert [(r.part_id, lab.label if lab else None) for _, r, lab in done] == [
        ("L-3", {"boxes": [{"label": "spot", "box": [1.0, 2.0, 3.0, 4.0]}]}),
        ("L-1", {"label": "scratch"})]
    assert [r.part_id for _, r, _ in store.review(ReviewQuery(model))] == ["L-4", "L-2", "L-0"]
    assert store.review(ReviewQuery("other")) == []
    assert {"2027-01-15/L-1.jpg", "2027-01-15/L-3.jpg"} <= store.labelled_images()
    # the export: each record with its id and its label in force
    exported = {r.part_id: (row_id, lab) for row_id, r, lab in store.exported(t0, t0 + 10)}
    assert exported["L-1"][0] == ids["L-1"] and exported["L-1"][1] == history[0]
    assert exported["L-0"][1] is None and exported["L-none"][1] is None
    assert exported["L-3"][1].by == "admin-token"
    # retention by age: every record is old, the labelled ones stay
    store.retain(max_age_s=1.0, max_bytes=10**12, now=t0 + 10**6)
    assert store.record(ids["L-1"]) is not None and store.record(ids["L-3"]) is not None
    assert store.record(ids["L-0"]) is None and store.history("L-none") == []
    store.close()


def test_labels_are_kept_beside_the_records_in_sqlite(tmp_path):
    label_round_trip(SqliteStore(tmp_path / "records.sqlite"))


def fill_with_a_labelled_frame(store: SqliteStore, put: Callable[[str, bytes, bytes], str],
                               folder: Path) -> None:
    """Twelve 1 KB frames stored by ``put`` (a capture target's: it answers where the image
    is, as the record names it) into ``folder`` (quota 10 KB), oldest first; the oldest is
    labelled by a flag and the third in the review queue once the first ones are in: both
    stay with their sidecars whatever the quota, the unlabelled ones go, oldest first."""
    keys = [f"2027-01-15/p{i}.{i:012x}.jpg" for i in range(12)]

    def stored(i: int) -> str:
        location = put(keys[i], b"x" * 1000, b"{}")
        os.utime(folder / keys[i], (1000 + i, 1000 + i))
        return location

    store.write([_record(1.0 + i, part=f"p{i}", image=stored(i), kept_for="ng")
                 for i in range(3)])
    store.add_label(1, {"label": "scratch", "verdict_was_wrong": True}, "qe-anna", "flag")
    store.add_label(3, {"label": "ok"}, "max", "review")
    for i in range(3, 12):
        stored(i)
    kept = sorted(p.name.split(".")[0] for p in folder.rglob("*.jpg"))
    assert "p0" in kept and (folder / f"{keys[0]}.json").is_file()
    assert "p2" in kept and (folder / f"{keys[2]}.json").is_file()
    assert "p1" not in kept and "p3" not in kept and "p11" in kept  # oldest first, as before
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert total <= 10_000


def test_the_quota_never_deletes_a_labelled_frame(tmp_path):
    store = SqliteStore(tmp_path / "records.sqlite")
    target = FolderTarget(tmp_path / "cap", quota=10_000, keep=store.labelled_images)
    fill_with_a_labelled_frame(store, target.put, tmp_path / "cap")
    store.close()


def test_the_s3_spools_quota_never_deletes_a_labelled_frame(tmp_path):
    """A bucket that does not answer (a closed port): images wait in the spool, under the
    capture quota; the labelled ones (their records name the bucket's URL) stay there to be
    uploaded."""
    pytest.importorskip("minio")
    store = SqliteStore(tmp_path / "records.sqlite")
    settings = ServerSettings(records=True, capture="learn",
                              capture_target="s3://line-1/captures",
                              capture_s3_endpoint="http://127.0.0.1:9", capture_quota="10000")
    target = open_target(settings, tmp_path, store.labelled_images)
    assert isinstance(target, S3Target) and target.spool is not None
    fill_with_a_labelled_frame(store, target.put, tmp_path / "capture-spool")
    # waiting to be uploaded, oldest first: the labelled ones, then the newest unlabelled
    assert [k.split(".")[0] for k in target.spool.images()[:3]] == [
        "2027-01-15/p0", "2027-01-15/p2", "2027-01-15/p6"]
    assert store.record(1).image == "s3://line-1/captures/2027-01-15/p0.000000000000.jpg"
    store.close()
