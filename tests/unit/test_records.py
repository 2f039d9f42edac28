"""Traceability records: what a record holds, the SQLite store (history, export range,
retention by age and size, a full or deleted file), the writer (off the loop, bounded, faults
counted and survived), the capture policy and the capture folder's quota, and the export."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import json
import os
import random
import re
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import wait_for
from prometheus_client import REGISTRY

from visionserve.config import ModelConfig
from visionserve.dataplane import Origin
from visionserve.errors import DeadlineExceeded, Unavailable
from visionserve.execution.results import FrameResult
from visionserve.imaging import Frame
from visionserve.logs import request_id
from visionserve.records import cli
from visionserve.records.capture import FolderTarget, Policy, image_bytes, image_key
from visionserve.records.record import COLUMNS, Record, parse_time
from visionserve.records.store import SqliteStore, StoreFault
from visionserve.records.writer import Recorder
from visionserve.tasks.classification import Classification, Classified

LABELS = ("ok", "dent", "scratch")
TASK = Classification(ModelConfig.model_validate({
    "input": {"width": 8, "height": 8}, "output": {"labels": LABELS},
    "verdict": {"ok_labels": ["ok"], "ok_threshold": 0.6}}))
SERVED = SimpleNamespace(name="tiny", version=3, task=TASK)
JPEG = b"\xff\xd8\xff\xe0" + b"x" * 1000


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _result(verdict="NG", scores=(0.05, 0.9, 0.05)) -> FrameResult:
    s = np.array(scores, dtype=np.float32)
    top = int(s.argmax())
    return FrameResult(verdict, Classified(LABELS[top], top, float(s[top]), s), 2, 0.5, 2.0, 2.6,
                       True)


def _pending(n: int, data: bytes = JPEG):
    loop = asyncio.get_running_loop()
    return [SimpleNamespace(future=loop.create_future(), arrival=time.monotonic(),
                            payload=Frame("jpeg", data, 64, 48)) for _ in range(n)]


def _record(t: float, part: str = "P-1", verdict: str = "OK", **kw) -> Record:
    return Record(t, part, "st-1", "cam-1", "tiny", "3", None, verdict, "ok", 0.9,
                  {"label": "ok", "score": 0.9}, {"total_ms": 3.0}, "rid", **kw)


# --- the store -----------------------------------------------------------------------------------

def test_history_is_the_parts_records_newest_first_and_select_takes_a_time_range(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    store.write([_record(100.0 + i, part="A" if i % 2 else "B") for i in range(10)])
    hist = store.history("A")
    assert [r.time for r in hist] == [109.0, 107.0, 105.0, 103.0, 101.0]
    assert hist[0] == _record(109.0, part="A")  # every field back as written (JSON decoded)
    assert [r.time for r in store.history("A", limit=2)] == [109.0, 107.0]
    assert store.history("nobody") == []
    assert [r.time for r in store.select(102.0, 105.0)] == [102.0, 103.0, 104.0]
    assert len(list(store.select())) == 10
    mode = store._writer().execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    store.close()


def test_retention_deletes_by_age_and_shrinks_the_file_by_size(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    now = time.time()
    old = [_record(now - 10 * 86400 + i, part=f"old{i}") for i in range(50)]
    store.write(old)
    big = {"label": "ok", "blob": "x" * 2000}
    for k in range(10):
        store.write([Record(now + k * 100 + i, f"new{k}-{i}", None, None, "tiny", "3", None, "OK",
                            None, None, big, {}, None) for i in range(100)])
    assert store.retain(max_age_s=5 * 86400, max_bytes=1 << 40) == 50
    assert store.history("old0") == []
    before = store.size()
    assert before > 2_000_000
    deleted = store.retain(max_age_s=5 * 86400, max_bytes=1_000_000)
    assert deleted > 500
    assert store.size() < 1_000_000  # incremental vacuum and the WAL truncated: on disk too
    kept = list(store.select())
    assert kept and kept[0].part_id.startswith("new") and kept[-1].part_id == "new9-99"
    assert int(kept[0].part_id[3]) >= 4  # the oldest went first
    store.close()


def test_a_full_database_is_a_store_fault_that_says_so(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    store.write([_record(1.0)])
    store._writer().execute("PRAGMA max_page_count=8")  # a disk with no more room for the file
    with pytest.raises(StoreFault) as err:
        store.write([_record(2.0 + i, part="x" * 3000) for i in range(50)])
    assert err.value.full and "full" in err.value.message
    assert isinstance(err.value, Unavailable)
    store.write([_record(3.0)])  # a new connection: the limit was that connection's
    assert [r.time for r in store.history("P-1")] == [3.0, 1.0]


def _old_file(path: Path) -> None:
    """A records file as a version before ``camera_time``, ``camera_frame`` and ``kept_for``
    made it, with one record."""
    import sqlite3

    old = [c for c in COLUMNS if c not in ("camera_time", "camera_frame", "kept_for")]
    c = sqlite3.connect(path)
    c.execute(f"CREATE TABLE records (id INTEGER PRIMARY KEY, {', '.join(old)})")
    c.execute(f"INSERT INTO records ({', '.join(old)}) VALUES ({', '.join('?' * len(old))})",
              _record(1.0, part="OLD").row()[:len(old)])
    c.commit()
    c.close()


@pytest.mark.parametrize("first", ["read", "write"])
def test_the_camera_fields_round_trip_and_an_old_file_gains_their_columns(tmp_path, first):
    path = tmp_path / "r.sqlite"
    _old_file(path)
    store = SqliteStore(path)
    if first == "read":  # an export of an old file before any server opened it
        assert store.history("OLD")[0].camera_time is None
    store.write([_record(2.0, part="NEW", camera_time=1796375551.125, camera_frame=2**40 + 7)])
    (old,) = store.history("OLD")
    assert old == _record(1.0, part="OLD") and old.camera_time is old.camera_frame is None
    (new,) = store.history("NEW")
    assert (new.camera_time, new.camera_frame) == (1796375551.125, 2**40 + 7)
    assert new.to_dict()["camera_time"] == 1796375551.125  # the API's JSON
    assert new.to_dict()["camera_frame"] == 2**40 + 7
    assert SqliteStore(path).history("NEW") == [new]  # a file that has it is left as it is
    store.close()


def test_a_database_deleted_under_the_writer_is_made_anew_not_written_into_the_void(tmp_path):
    path = tmp_path / "r.sqlite"
    store = SqliteStore(path)
    store.write([_record(1.0)])
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    store.write([_record(2.0)])
    assert path.exists()
    assert [r.time for r in SqliteStore(path).history("P-1")] == [2.0]


# --- the writer ----------------------------------------------------------------------------------

async def test_every_answer_becomes_a_record_with_its_origin_result_and_request_id(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    rec = Recorder(store, max_age_s=1e9, max_bytes=1 << 30)
    rec.start()
    try:
        token = request_id.set("req-7")
        items = _pending(4)
        rec.watch(SERVED, items, ("P-42", "cam-2", "station-3"))
        request_id.reset(token)
        items[0].future.set_result(_result("NG"))
        items[1].future.set_result(_result("OK", (0.95, 0.03, 0.02)))
        items[2].future.set_exception(DeadlineExceeded("too late", late_ms=3.0))
        items[3].future.cancel()
        rec.refused(SERVED, 1, ("P-43", None, None), Unavailable("queue full", retry_after_s=1))
        await asyncio.sleep(0)  # the callbacks run
        wait_for(lambda: len(list(store.select())) == 5, what="five records")
    finally:
        await asyncio.to_thread(rec.close)
    by_index = {r.frame_index: r for r in store.history("P-42")}
    ng = by_index[0]
    assert (ng.part_id, ng.camera, ng.station, ng.model, ng.version, ng.verdict, ng.label) == \
        ("P-42", "cam-2", "station-3", "tiny", "3", "NG", "dent")
    assert ng.request_id == "req-7" and abs(ng.score - 0.9) < 1e-6
    assert ng.result == TASK.inspect_fields(_result().result)  # the task's own fields
    assert ng.timings["queue_ms"] == 0.5 and ng.timings["batch_size"] == 2
    assert abs(ng.time - time.time()) < 5
    assert by_index[1].verdict == "OK"
    assert by_index[2].verdict == "LATE" and by_index[2].error.startswith("deadline: too late")
    assert by_index[3].verdict == "ERROR" and by_index[3].error.startswith("cancelled")
    refused = store.history("P-43")[0]
    assert refused.verdict == "ERROR" and refused.error == "unavailable: queue full"


async def test_the_camera_time_of_the_origin_goes_into_the_record(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    rec = Recorder(store, max_age_s=1e9, max_bytes=1 << 30)
    rec.start()
    try:
        triggered, pushed = _pending(1), _pending(1)
        rec.watch(SERVED, triggered, Origin("P-1", "cam1", "st-1", "rec-a", 1796375551.5))
        rec.watch(SERVED, pushed, ("P-2", "cam2"))  # a plain, shorter tuple: no camera time
        rec.refused(SERVED, 1, Origin("P-3", "cam1", camera_time=12.25), Unavailable("full"))
        for item in triggered + pushed:
            item.future.set_result(_result("OK", (0.95, 0.03, 0.02)))
        await asyncio.sleep(0)
        wait_for(lambda: len(list(store.select())) == 3, what="three records")
    finally:
        await asyncio.to_thread(rec.close)
    (r1,), (r2,), (r3,) = (store.history(p) for p in ("P-1", "P-2", "P-3"))
    assert (r1.camera, r1.station, r1.recipe, r1.camera_time) == \
        ("cam1", "st-1", "rec-a", 1796375551.5)
    assert (r2.camera, r2.station, r2.camera_time) == ("cam2", None, None)
    assert r3.verdict == "ERROR" and r3.camera_time == 12.25


async def test_a_full_queue_drops_and_counts_and_the_loop_never_waits(tmp_path):
    rec = Recorder(SqliteStore(tmp_path / "r.sqlite"), max_age_s=1e9, max_bytes=1 << 30,
                   queue_size=100)  # not started: nothing takes from the queue
    before = metric("visionserve_records_dropped_total", reason="queue_full")
    items = _pending(150)
    rec.watch(SERVED, items, None)
    t0 = time.perf_counter()
    for it in items:
        it.future.set_result(_result())
    await asyncio.sleep(0)
    assert time.perf_counter() - t0 < 1.0
    assert metric("visionserve_records_dropped_total", reason="queue_full") - before == 50


async def test_a_store_that_refuses_is_counted_and_its_records_written_once_it_works(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    broken = {"on": True}
    real_write = store.write

    def write(records):
        if broken["on"]:
            raise StoreFault(store.where, "attempt to write a readonly database")
        real_write(records)

    store.write = write  # type: ignore[method-assign]
    errors = metric("visionserve_records_store_errors_total")
    rec = Recorder(store, max_age_s=1e9, max_bytes=1 << 30)
    rec.start()
    try:
        items = _pending(3)
        rec.watch(SERVED, items, ("P-1", None, None))
        for it in items:
            it.future.set_result(_result())
        await asyncio.sleep(0)
        wait_for(lambda: metric("visionserve_records_store_fault") == 1, what="the fault gauge")
        assert metric("visionserve_records_store_errors_total") > errors
        assert rec.fault is not None
        broken["on"] = False
        wait_for(lambda: len(store.history("P-1")) == 3, 10, "the held batch written")
        wait_for(lambda: metric("visionserve_records_store_fault") == 0 and rec.fault is None,
                 what="the fault cleared")
    finally:
        await asyncio.to_thread(rec.close)


def _refusing(store: SqliteStore, refuse, cause: str = "attempt to write a readonly database"):
    """``store`` whose writes raise StoreFault(``cause``) while ``refuse(records)`` is true."""
    real_write = store.write

    def write(records):
        if refuse(records):
            raise StoreFault(store.where, cause)
        real_write(records)

    store.write = write  # type: ignore[method-assign]
    return store


async def _answer(rec: Recorder, part: str, n: int = 1, verdict: str = "NG") -> None:
    items = _pending(n)
    rec.watch(SERVED, items, (part, None, None))
    for it in items:
        it.future.set_result(_result() if verdict == "NG" else _result("OK", (0.95, 0.03, 0.02)))
    await asyncio.sleep(0)


async def test_a_batch_the_store_keeps_refusing_is_dropped_counted_and_logged(tmp_path,
                                                                             monkeypatch, caplog):
    """Bounded retry: a batch refused for GIVE_UP_S is counted lost and logged, and the records
    after it are written (they do not starve behind it)."""
    from visionserve.records import writer

    monkeypatch.setattr(writer, "GIVE_UP_S", 0.5)
    monkeypatch.setattr(writer, "RETRY_MIN_S", 0.05)
    store = _refusing(SqliteStore(tmp_path / "r.sqlite"),
                      lambda records: any(r.part_id == "bad" for r in records))
    before = metric("visionserve_records_dropped_total", reason="store_fault")
    rec = Recorder(store, max_age_s=1e9, max_bytes=1 << 30)
    rec.start()
    try:
        await _answer(rec, "bad", 3)
        wait_for(lambda: metric("visionserve_records_dropped_total", reason="store_fault")
                 - before == 3, 10, "the refused batch counted")
        await _answer(rec, "good", 2)
        wait_for(lambda: len(store.history("good")) == 2, 10, "the next records written")
    finally:
        await asyncio.to_thread(rec.close)
    assert "records: 3 records are lost" in caplog.text and rec.lost == 3


async def test_a_full_disk_deletes_captured_images_before_any_record(tmp_path, monkeypatch):
    """Records come before images: the store finds its disk full, the writer deletes the
    server's oldest captures on that disk (not records) and the batch is written at once."""
    target = FolderTarget(tmp_path / "cap", 1 << 30)
    old = _record(time.time() - 60, part="old")
    for _ in range(4):
        target.put(image_key(old, "jpeg"), b"x" * 1000, b"{}")
    # the disk as the records see it: full, and the records' share not free
    monkeypatch.setattr(FolderTarget, "_room", lambda self: (0, 1500))
    store = _refusing(SqliteStore(tmp_path / "r.sqlite"),
                      lambda records: len(target.images()) == 4, "database or disk is full")
    rec = Recorder(store, max_age_s=1e9, max_bytes=1 << 30, policy=Policy("ng"), target=target)
    rec.start()
    try:
        await _answer(rec, "P-1", 2, "OK")  # answered OK: not captured
        wait_for(lambda: len(store.history("P-1")) == 2, 10, "the records written")
    finally:
        await asyncio.to_thread(rec.close)
    assert len(target.images()) < 4 and rec.deleted == 0 and rec.lost == 0


async def test_close_counts_and_logs_every_record_it_could_not_store(tmp_path, caplog):
    store = _refusing(SqliteStore(tmp_path / "r.sqlite"), lambda records: True)
    before = metric("visionserve_records_dropped_total", reason="shutdown")
    rec = Recorder(store, max_age_s=1e9, max_bytes=1 << 30)
    rec.start()
    await _answer(rec, "P-1", 5)
    wait_for(lambda: rec.fault is not None, 10, "the fault")
    await asyncio.to_thread(rec.close, 0.5)
    assert metric("visionserve_records_dropped_total", reason="shutdown") - before == 5
    assert "records: 5 records lost at shutdown" in caplog.text


# --- capture -------------------------------------------------------------------------------------

def test_the_capture_policies_pick_what_they_say():
    ng, ok = _result("NG"), _result("OK", (0.95, 0.03, 0.02))
    near = _result("NG", (0.55, 0.45, 0.0))  # best OK score 0.55, threshold 0.6
    assert not Policy("none").wants("NG", TASK, ng.result)
    assert Policy("all").wants("OK", TASK, ok.result)
    assert Policy("ng").wants("NG", TASK, ng.result)
    assert not Policy("ng").wants("OK", TASK, ok.result)
    unsure = Policy("uncertain", band=0.1)
    assert unsure.wants("NG", TASK, near.result)
    assert not unsure.wants("NG", TASK, ng.result) and not unsure.wants("OK", TASK, ok.result)
    sample = Policy("sample", percent=10, rng=random.Random(1))
    share = sum(sample.wants("OK", TASK, ok.result) == "sample" for _ in range(10_000)) / 10_000
    assert 0.08 < share < 0.12


def test_the_capture_folder_stays_under_its_quota_oldest_first(tmp_path):
    target = FolderTarget(tmp_path / "cap", quota=10_000)
    for i in range(12):
        key = f"2026-12-0{1 + i // 6}/p{i}.{i:012x}.jpg"
        target.put(key, b"x" * 1000, b"{}")
        os.utime(tmp_path / "cap" / key, (1000 + i, 1000 + i))
    kept = sorted(p.name.split(".")[0] for p in (tmp_path / "cap").rglob("*.jpg"))
    total = sum(p.stat().st_size for p in (tmp_path / "cap").rglob("*") if p.is_file())
    assert total <= 10_000 and target.used == total
    assert "p11" in kept and "p0" not in kept
    assert metric("visionserve_captures_deleted_total") >= 3


def test_the_quota_deletes_only_the_servers_own_captures(tmp_path):
    """A capture folder that also holds an engineer's notes and golden images: the quota deletes
    the server's oldest images, never those (nor their folder), and does not count them."""
    cap = tmp_path / "cap"
    (cap / "golden").mkdir(parents=True)
    (cap / "notes.txt").write_text("line 3 camera notes")
    (cap / "golden" / "reference.png").write_bytes(b"\x89PNG" + b"g" * 5000)
    (cap / "2026-12-01").mkdir()
    (cap / "2026-12-01" / "by-hand.jpg").write_bytes(b"h" * 3000)  # not a name the server writes
    target = FolderTarget(cap, quota=5_000)
    assert target.used == 0
    rec = _record(time.time(), part="Q-1")
    for _ in range(12):
        target.put(image_key(rec, "jpeg"), b"x" * 1000, b"{}")
    assert (cap / "notes.txt").read_text() == "line 3 camera notes"
    assert (cap / "golden" / "reference.png").stat().st_size == 5004
    assert (cap / "2026-12-01" / "by-hand.jpg").exists()
    ours = list(cap.glob("*/Q-1*.jpg"))
    assert 0 < len(ours) < 12 and target.used <= 5_000


async def test_captured_frames_are_the_bytes_received_with_their_record_beside(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    rec = Recorder(store, max_age_s=1e9, max_bytes=1 << 30, policy=Policy("ng"),
                   target=FolderTarget(tmp_path / "cap", 1 << 30))
    rec.start()
    try:
        items = _pending(2)
        rec.watch(SERVED, items, ("P/7 x", "cam", None))
        items[0].future.set_result(_result("NG"))
        items[1].future.set_result(_result("OK", (0.95, 0.03, 0.02)))
        await asyncio.sleep(0)
        wait_for(lambda: list((tmp_path / "cap").rglob("*.json")), what="the capture")
    finally:
        await asyncio.to_thread(rec.close)
    (image,) = (tmp_path / "cap").rglob("*.jpg")
    assert image.read_bytes() == JPEG
    assert image.name.startswith("P_7_x.") and image.parent.name == time.strftime(
        "%Y-%m-%d", time.gmtime())
    side = json.loads(image.with_name(image.name + ".json").read_text())
    assert side["part_id"] == "P/7 x" and side["verdict"] == "NG" and side["image"] == \
        f"{image.parent.name}/{image.name}"
    records = {r.verdict: r for r in store.history("P/7 x")}
    assert records["NG"].image == side["image"] and records["OK"].image is None


def _pixels(h: int, w: int, c: int) -> np.ndarray:
    px = np.random.default_rng(c).integers(0, 256, (h, w, c), dtype=np.uint8)
    px[0, 0] = (255, 0, 0, 255)[:c]  # red in RGB(A): the channel order shows
    return px


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_a_raw_frame_is_captured_as_a_png_of_exactly_its_pixels(channels):
    cv2 = pytest.importorskip("cv2")
    image = pytest.importorskip("PIL.Image")
    px = _pixels(37, 53, channels)  # odd sizes: no row padding hides
    data = image_bytes(Frame("raw", px, 53, 37, channels))
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    # another decoder (Pillow gives RGB(A) as stored): the very pixels, the channels in order
    with image.open(io.BytesIO(data)) as im:
        assert im.mode == {1: "L", 3: "RGB", 4: "RGBA"}[channels]
        assert np.array_equal(np.asarray(im).reshape(px.shape), px)
    # OpenCV reads it as BGR(A): red is red
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if channels > 1:
        assert tuple(bgr[0, 0, :3]) == (0, 0, 255)
        assert np.array_equal(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB if channels == 3
                                           else cv2.COLOR_BGRA2RGBA), px)
    else:
        assert np.array_equal(bgr, px[:, :, 0])


def test_a_bayer_frame_is_captured_as_the_rgb_png_the_model_saw():
    """A camera's Bayer frame travels as its mosaic; its capture is the demosaiced RGB, never
    the mosaic: OpenCV's demosaic of it, as the CPU path prepares it for the model."""
    cv2 = pytest.importorskip("cv2")
    from visionserve.cameras.pixels import mosaic, to_frame, to_rgb8

    rgb = _pixels(37, 53, 3)
    samples = mosaic(rgb, "GR")
    frame = to_frame(samples, "BayerGR8")
    assert frame.bayer == "GR" and frame.channels == 1
    data = image_bytes(frame)
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    assert bgr.shape == (37, 53, 3)
    assert np.array_equal(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), to_rgb8(samples, "BayerGR8"))


def test_image_keys_are_unique_per_answer_even_when_ids_repeat():
    r = _record(0.0, part="A-1")
    keys = {image_key(r, "jpeg") for _ in range(1000)}  # a retry: same part, same request id
    assert len(keys) == 1000
    assert all(re.fullmatch(r"1970-01-01/A-1_rid\.[0-9a-f]{12}\.jpg", k) for k in keys)
    assert re.fullmatch(r"1970-01-01/rid-2\.[0-9a-f]{12}\.png",
                        image_key(dataclasses.replace(r, part_id=None, frame_index=2), "raw"))


# --- export --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_writes_the_records_of_the_range(tmp_path, fmt):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    store = SqliteStore(tmp_path / "records.sqlite")
    t0 = parse_time("2026-12-01T06:00:00Z")
    store.write([_record(t0 + 3600 * i, part=f"P-{i}", verdict="NG" if i % 3 else "OK",
                         camera_time=t0 + i + 0.5 if i % 2 else None) for i in range(10)])
    # P-3 was labelled twice (the later in force), P-9 (out of the range) once
    store.add_label(4, {"label": "dent"}, "max", "review", now=t0 + 86400)
    store.add_label(4, {"label": "scratch", "verdict_was_wrong": True}, "qe-anna", "flag",
                    now=t0 + 86400 + 60)
    store.add_label(10, {"label": "dent"}, "max", "review", now=t0 + 86400)
    out = tmp_path / f"out.{fmt}"
    args = Namespace(records_url=None, records_dir=str(tmp_path), action="export",
                     since="2026-12-01T08:00Z", until="2026-12-01T12:00Z", format=fmt,
                     out=str(out))
    assert cli.run(args) == 0
    if fmt == "csv":
        with open(out, newline="") as f:
            rows = list(csv.DictReader(f))
        times = [r["time"] for r in rows]
        labelled_at = [r["labelled_at"] for r in rows]
        assert json.loads(rows[0]["result"]) == {"label": "ok", "score": 0.9}
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(out).to_pylist()
        times = [r["time"].strftime("%Y-%m-%dT%H:%M:%S.000Z") for r in rows]
        labelled_at = [r["labelled_at"] and r["labelled_at"].strftime("%Y-%m-%dT%H:%M:%S.000Z")
                       for r in rows]
    assert [r["part_id"] for r in rows] == ["P-2", "P-3", "P-4", "P-5"]
    assert [int(r["id"]) for r in rows] == [3, 4, 5, 6]  # the API's ids
    # the label in force of each record, who set it, when and where (empty for none)
    assert json.loads(rows[1]["labelled"]) == {"label": "scratch", "verdict_was_wrong": True}
    assert (rows[1]["labelled_by"], rows[1]["labelled_source"]) == ("qe-anna", "flag")
    assert labelled_at[1] == "2026-12-02T06:01:00.000Z"
    assert [r["labelled_by"] or None for r in rows] == [None, "qe-anna", None, None]
    assert times[0] == "2026-12-01T08:00:00.000Z"
    # the camera's time, where the frame had one (CSV: text, empty for none)
    assert [r["camera_time"] for r in rows] == \
        ([None, t0 + 3.5, None, t0 + 5.5] if fmt == "parquet" else ["", str(t0 + 3.5), "",
                                                                    str(t0 + 5.5)])
    bad = Namespace(**{**vars(args), "since": "yesterday"})
    assert cli.run(bad) == 2
