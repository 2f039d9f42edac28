"""The closed loop's candidates (docs/closed-loop.md): the fixed held-out split, the export of the
labelled captures into a candidate's folder (a real SQLite store and capture folder), the
candidates area's ids, the POST body's checks and the comparison's summary."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from visionserve.errors import InvalidInput, NotFound
from visionserve.guard.store import JobSpec, JobStore
from visionserve.loop import candidates as cands
from visionserve.loop.evaluate import found, held_label, iou, summarize
from visionserve.loop.http import DEFAULT_SHARE, DEFAULT_STEPS, parse_request
from visionserve.records.images import ImageSource
from visionserve.records.record import Record
from visionserve.records.store import ReviewQuery, SqliteStore

LABELS = ("ok", "scratch", "spot")


def test_the_split_holds_out_every_fifth_record_fixed_by_its_id():
    ids = range(1, 5001)
    held = [i for i in ids if cands.held_out(i)]
    assert 0.17 < len(held) / len(ids) < 0.23  # one in five, by a hash: not every 5th id
    assert held != list(range(5, 5001, 5))
    assert [i for i in ids if cands.held_out(i)] == held  # the same every time


def _captured(store: SqliteStore, folder, n: int) -> list[int]:
    """n captured records of model m, alternately JPEG and raw (npy) frames; their row ids."""
    day = folder / "2026-12-06"
    day.mkdir(parents=True)
    for i in range(n):
        pixels = np.full((24, 32, 3), (i * 7) % 255, np.uint8)
        pixels[:, :, 0] = 200  # red in RGB
        if i % 2:
            buf = io.BytesIO()
            np.save(buf, pixels)
            key, data = f"2026-12-06/f{i}.{i:012x}.npy", buf.getvalue()
        else:
            key = f"2026-12-06/f{i}.{i:012x}.jpg"
            data = cv2.imencode(".jpg", pixels[:, :, ::-1])[1].tobytes()
        (folder / key).write_bytes(data)
        store.write([Record(1.8e9 + i, f"P-{i}", None, None, "m", "1", None, "OK", "ok", 0.9,
                            {"label": "ok"}, {"total_ms": 1.0}, "rid", image=key)])
    return sorted(row_id for row_id, _, _ in store.review(ReviewQuery("m", False, None, 1000)))


def test_the_export_writes_each_labelled_capture_into_train_or_heldout(tmp_path):
    store = SqliteStore(tmp_path / "records.sqlite")
    images = ImageSource(tmp_path / "captures")
    ids = _captured(store, tmp_path / "captures", 30)
    for k, row_id in enumerate(ids[:25]):  # five stay unlabelled
        store.add_label(row_id, {"label": LABELS[k % 3]}, f"user-{k % 2}", "review")
    store.add_label(ids[0], {"label": "spot"}, "qe-anna", "flag")  # the latest label counts
    out = cands.export(store, images, "m", LABELS, tmp_path / "c-1")
    got = {x.record_id: x for x in out.training + out.held_out}
    assert sorted(got) == sorted(ids[:25])
    assert {x.record_id for x in out.held_out} == {i for i in ids[:25] if cands.held_out(i)}
    assert not {x.record_id for x in out.held_out} & {x.record_id for x in out.training}
    first = got[ids[0]]
    assert (first.label, first.labelled_by) == ("spot", "qe-anna")
    for x in got.values():
        path = tmp_path / "c-1" / x.file
        part = "heldout" if cands.held_out(x.record_id) else "train"
        assert x.file.startswith(f"{part}/{x.label}/{x.record_id}.")
        img = cv2.imread(str(path))
        assert img is not None and img.shape == (24, 32, 3)
        assert img[0, 0, 2] > 150  # red stays red: a raw RGB frame is written as BGR PNG
    assert {x.file.rsplit(".", 1)[1] for x in got.values()} == {"jpg", "png"}
    # a label of another shape (the model's labels changed since) is left out
    store.add_label(ids[1], {"label": "crack"}, "qe-anna", "review")
    again = cands.export(store, images, "m", LABELS, tmp_path / "c-2")
    assert ids[1] not in {x.record_id for x in again.training + again.held_out}
    store.close()


def test_the_candidates_area_numbers_its_folders_and_finds_only_its_own(tmp_path):
    (tmp_path / "m").mkdir()
    area = cands.Area(tmp_path / "m")
    assert area.ids() == []
    assert area.create()[0] == "c-1"
    (tmp_path / "m" / "candidates" / "c-9").mkdir()
    (tmp_path / "m" / "candidates" / "notes").mkdir()
    assert area.ids() == ["c-1", "c-9"] and area.create()[0] == "c-10"
    (tmp_path / "m" / "candidates" / "c-1" / "job.json").write_text("{}")
    assert area.folder("c-1").name == "c-1"
    assert [p.name for p in area.started()] == ["c-1"]  # c-9: nothing submitted yet
    for bad in ("c-9", "../c-1", "c-0", "x"):  # c-9 holds no job.json
        with pytest.raises(NotFound):
            area.folder(bad)


def test_the_request_body_is_checked():
    assert parse_request({}) == parse_request({"steps": DEFAULT_STEPS,
                                               "original_share": DEFAULT_SHARE})
    assert parse_request({"from_version": 1, "steps": 5, "original_share": 0}).steps == 5
    for body, word in (({"steps": 0}, "steps"), ({"steps": True}, "steps"),
                       ({"original_share": 1}, "original_share"),
                       ({"from_version": "1"}, "from_version"), ({"epochs": 3}, "epochs")):
        with pytest.raises(InvalidInput, match=word):
            parse_request(body)


def test_the_summary_gives_each_models_rates_and_where_they_disagree():
    def row(rid, label, live, cand):
        return {"record_id": rid, "label": label,
                "live": {"verdict": "OK" if live == "ok" else "NG", "label": live, "score": 0.9},
                "candidate": {"verdict": "OK" if cand == "ok" else "NG", "label": cand,
                              "score": 0.9}}
    rows = [row(1, "scratch", "ok", "scratch"), row(2, "scratch", "scratch", "scratch"),
            row(3, "ok", "ok", "ok"), row(4, "ok", "ok", "spot")]
    s = summarize(rows, frozenset({"ok"}))
    assert s["live"] == {"accuracy": 0.75, "ng_recall": 0.5, "false_reject_rate": 0.0,
                         "frames": 4, "ng_frames": 2, "ok_frames": 2}
    assert s["candidate"]["ng_recall"] == 1.0 and s["candidate"]["false_reject_rate"] == 0.5
    assert s["disagree"] == [1, 4]
    json.dumps(s)


def test_a_detectors_summary_counts_the_labelled_boxes_each_model_found():
    scratch = {"label": "scratch", "box": [100, 100, 200, 140]}
    spot = {"label": "spot", "box": [300, 300, 340, 340]}

    def answer(*boxes):
        return {"verdict": "NG" if boxes else "OK", "label": "defective" if boxes else "good",
                "score": 0.8 if boxes else 0.0,
                "boxes": [{"label": b["label"], "box": b["box"], "score": 0.8} for b in boxes]}
    shifted = {"label": "scratch", "box": [110, 102, 210, 142]}  # IoU 0.75: found
    far = {"label": "scratch", "box": [150, 100, 250, 140]}      # IoU 0.33: not found
    wrong = {"label": "crack", "box": [100, 100, 200, 140]}      # another label: not found
    items = [{"record_id": 1, "boxes": [scratch, spot]}, {"record_id": 2, "boxes": [scratch]},
             {"record_id": 3, "boxes": []}, {"record_id": 4, "boxes": [scratch]}]
    answers = [(answer(shifted), answer(shifted, spot)), (answer(far), answer(scratch)),
               (answer(), answer()), (answer(wrong), answer(wrong))]
    rows = [{"record_id": it["record_id"], "label": held_label(it), "boxes": it["boxes"],
             "live": a, "candidate": b} for it, (a, b) in zip(items, answers, strict=True)]
    assert [r["label"] for r in rows] == ["defective", "defective", "good", "defective"]
    s = summarize(rows, frozenset({"good"}))
    assert s["live"]["boxes"] == 4 and s["live"]["box_recall"] == 0.25
    assert s["candidate"]["box_recall"] == 0.75
    assert s["live"]["ng_recall"] == 1.0 and s["live"]["false_reject_rate"] == 0.0
    # the same verdicts, other boxes found: they disagree there
    assert s["disagree"] == [1, 2]
    # a box is matched once: two labelled boxes on one detection find one
    assert found([scratch, scratch], answer(scratch)) == 1
    assert iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(1 / 3)
    assert "box_recall" not in summarize(rows[2:3], frozenset({"good"}))["live"]


def test_a_candidates_state_follows_its_guard_job_and_done_makes_candidate_json(tmp_path):
    jobs = JobStore(tmp_path / "guard.sqlite")
    area = cands.Area(tmp_path)

    def candidate() -> tuple[int, object]:
        job = jobs.submit(JobSpec(command=[sys.executable, "-c", "pass"]))
        cid, folder = area.create()
        (folder / "train" / "ok").mkdir(parents=True)
        cands.write_json(folder / "job.json", {
            "id": cid, "model": "m", "from_version": 1, "job": {"id": job.id, "command": []},
            "trained_on": [], "held_out": [], "created": "t"})
        return job.id, folder

    job_id, folder = candidate()
    assert cands.describe(folder, jobs)["state"] == "queued"
    shown = cands.describe(folder, None)  # a server without --guard
    assert shown["state"] == "queued" and "--guard" in shown["reason"]
    job = jobs.claim(job_id)
    assert job is not None and job.log_path
    log = Path(job.log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text('data ready\n{"step": 2, "steps": 5, "loss": 0.5}\nexporting\n')
    shown = cands.describe(folder, jobs)
    assert shown["state"] == "running" and shown["progress"] == {"step": 2, "steps": 5,
                                                                 "loss": 0.5}
    jobs.finish(job_id, "failed", exit_code=1, reason="exit code 1")
    shown = cands.describe(folder, jobs)
    assert shown["state"] == "failed" and "exit code 1" in shown["reason"]

    job_id, folder = candidate()  # succeeded, but wrote nothing
    jobs.claim(job_id)
    jobs.finish(job_id, "succeeded", exit_code=0, reason=None)
    shown = cands.describe(folder, jobs)
    assert shown["state"] == "failed" and "weights.pt" in shown["reason"]
    (folder / "weights.pt").write_bytes(b"w")  # and now as a training run leaves it
    (folder / "metrics.json").write_text(json.dumps({"final_val_acc": 0.9, "steps": 5}))
    shown = cands.describe(folder, jobs)
    assert shown["state"] == "done" and shown["candidate"]["metrics"]["final_val_acc"] == 0.9
    assert shown["candidate"]["finished"] and not (folder / "train").exists()
    assert json.loads((folder / "candidate.json").read_text()) == shown["candidate"]
