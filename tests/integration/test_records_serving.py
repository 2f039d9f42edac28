"""Traceability records in a real server: what the inspect API and gRPC answered is in the part's
record (also through front-end processes), GET /v1/parts/{part_id} behind the token, captured
images with their sidecars, a record store on a full disk (serving goes on, the fault is counted
and shown, records resume once there is room); the PostgreSQL store against a real PostgreSQL
(pgserver); capture to an S3-compatible server (moto's server mode, tests/tools/setup_moto.sh)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import REPO, free_port, wait_for

from tests.tools.disks import mount_disk
from visionserve.records.recent import SAME_TIME_S
from visionserve.records.record import Record
from visionserve.records.store import PostgresStore, RecordQuery, StoreFault

TOKEN = "s3cret"


def _inspect(server, jpeg: bytes, part: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/models/tiny/inspect", content=jpeg, timeout=30,
                      headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                               "Authorization": f"Bearer {TOKEN}", **headers})


def _history(server, part: str, **kw) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/parts/{part}", timeout=10, params=kw,
                     headers={"Authorization": f"Bearer {TOKEN}"})


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


@pytest.mark.parametrize("frontends", [0, 2])
def test_answers_are_recorded_and_read_back_by_part(server_factory, tiny_repo, tmp_path,
                                                    jpeg_bytes, frontends):
    import tritonclient.grpc as grpcclient

    server = server_factory(tiny_repo, "--records", "--records-dir", str(tmp_path / "data"),
                            "--capture", "all", "--auth-token", TOKEN,
                            "--frontends", str(frontends))
    r = _inspect(server, jpeg_bytes, "A-0042", **{"X-Camera-Id": "cam-1",
                                                  "X-Request-Id": "req-xyz"})
    assert r.status_code == 200, r.text
    answer = r.json()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("image", [1], "BYTES")
    inp.set_data_from_numpy(np.array([jpeg_bytes], dtype=object))
    client.infer("tiny", [inp], parameters={"part_id": "A-0042", "camera_id": "cam-2"},
                 headers={"authorization": f"Bearer {TOKEN}"})
    got = wait_for(lambda: (h := _history(server, "A-0042")).status_code == 200
                   and h.json()["count"] == 2 and h.json(), 20, "both records")
    grpc_rec, http_rec = got["records"]  # newest first
    assert http_rec["verdict"] == answer["verdict"] and http_rec["label"] == answer["label"]
    assert http_rec["result"]["scores"] == answer["scores"]
    # no recipes.toml here: no station (tests/integration/test_recipes.py has stations)
    assert (http_rec["camera"], http_rec["station"], http_rec["recipe"], http_rec["request_id"]) \
        == ("cam-1", None, None, "req-xyz")
    assert (http_rec["model"], http_rec["version"]) == ("tiny", answer["version"])
    assert http_rec["timings"]["compute_ms"] == answer["timing"]["compute_ms"]
    assert grpc_rec["camera"] == "cam-2" and grpc_rec["verdict"] == answer["verdict"]
    image = tmp_path / "data" / "captures" / http_rec["image"]
    assert image.read_bytes() == jpeg_bytes  # as received, no re-encode
    assert json.loads(Path(f"{image}.json").read_text())["request_id"] == "req-xyz"
    missing = _history(server, "nobody")
    assert missing.status_code == 404 and "nobody" in missing.json()["error"]
    assert httpx.get(f"{server.url}/v1/parts/A-0042", timeout=10).status_code == 401
    assert _metric(server, "visionserve_records_written_total") >= 2


def test_each_part_s_captured_image_is_its_own_through_the_front_ends(server_factory,
                                                                      tiny_repo, tmp_path):
    """Front ends with every image captured: 48 different frames sent at once, and each part's
    record holds the very bytes sent for it (a capture copies its frame before the front end
    may reuse the arena space under it)."""
    import asyncio

    import cv2

    server = server_factory(tiny_repo, "--records", "--records-dir", str(tmp_path / "data"),
                            "--capture", "all", "--auth-token", TOKEN, "--frontends", "2",
                            grpc=False)
    sent = {}
    for i in range(48):
        img = np.full((120, 160, 3), (i * 5 % 256, 255 - i * 5 % 256, i * 37 % 256), np.uint8)
        cv2.putText(img, str(i), (10, 80), cv2.FONT_HERSHEY_SIMPLEX, 2, (255, 255, 255), 3)
        sent[f"P-{i}"] = cv2.imencode(".jpg", img)[1].tobytes()

    async def send_all() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            rs = await asyncio.gather(*(client.post(
                f"{server.url}/v1/models/tiny/inspect", content=jpeg,
                headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                         "Authorization": f"Bearer {TOKEN}"}) for part, jpeg in sent.items()))
            return [r.status_code for r in rs]

    assert set(asyncio.run(send_all())) == {200}
    for part, jpeg in sent.items():
        rec = wait_for(lambda part=part: (h := _history(server, part)).status_code == 200
                       and h.json()["count"] == 1 and h.json()["records"][0], 20, part)
        assert (tmp_path / "data" / "captures" / rec["image"]).read_bytes() == jpeg, part


def test_a_full_disk_does_not_stop_serving_and_records_resume(request, server_factory, tiny_repo,
                                                              tmp_path, jpeg_bytes):
    disk = mount_disk(request, tmp_path, "full")
    server = server_factory(tiny_repo, "--records", "--records-dir", str(disk.dir),
                            "--auth-token", TOKEN, "--frontends", "0")
    assert _inspect(server, jpeg_bytes, "before").status_code == 200
    wait_for(lambda: _history(server, "before").status_code == 200, 20, "the first record")
    disk.fail()
    for i in range(30):  # more than a page of records: the full disk must refuse them
        r = _inspect(server, jpeg_bytes, f"during-{i}", **{"X-Camera-Id": "x" * 3000})
        assert r.status_code == 200, r.text
    wait_for(lambda: _metric(server, "visionserve_records_store_fault") == 1, 20,
             "the fault in /metrics")
    assert "records: the record store cannot be used now" in server.log()
    env = {**os.environ, "VISIONSERVE_RECORDS": "true", "VISIONSERVE_RECORDS_DIR": str(disk.dir)}
    doctor = subprocess.run([sys.executable, "-m", "visionserve", "doctor", "--json"], env=env,
                            capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["records"]["status"] == "fail" and "free" in checks["records"]["detail"]
    disk.mend()
    wait_for(lambda: _metric(server, "visionserve_records_store_fault") == 0, 60, "the recovery")
    assert _inspect(server, jpeg_bytes, "after").status_code == 200
    wait_for(lambda: _history(server, "after").status_code == 200, 20, "a record after")
    assert _history(server, "during-0").status_code == 200  # held in the queue, not lost


# --- PostgreSQL ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def postgres_url(tmp_path_factory):
    """A real PostgreSQL (pgserver's bundled binaries), or a skip saying why there is none."""
    try:
        import pgserver
    except ImportError:
        pytest.skip("pgserver is not installed (pip install pgserver): no PostgreSQL to test "
                    "against")
    folder = tmp_path_factory.mktemp("pg")
    if os.geteuid() == 0:  # postgres refuses to run as root: a folder an unprivileged user owns
        shutil.chown(folder, "nobody")
    try:
        server = pgserver.get_server(str(folder), cleanup_mode="stop")
    except Exception as exc:  # noqa: BLE001 - whatever keeps it from starting: say it, skip
        pytest.skip(f"PostgreSQL could not be started here: {exc}")
    yield server.get_uri()
    server.cleanup()


def test_postgres_store_writes_reads_exports_and_retains(postgres_url):
    store = PostgresStore(postgres_url)
    now = time.time()
    rows = [Record(now - 86400 * (10 - i), f"P-{i % 3}", "st", "cam", "tiny", "1", None,
                   "NG" if i % 2 else "OK", "dent", 0.5 + i / 100,
                   {"score": i, "nan": float("nan")}, {"total_ms": 1.5}, f"r{i}", 0)
            for i in range(10)]
    store.write(rows)
    hist = store.history("P-1")
    assert [r.request_id for r in hist] == ["r7", "r4", "r1"]
    assert hist[0].result == {"score": 7, "nan": None} and hist[0].timings == {"total_ms": 1.5}
    assert abs(hist[0].time - rows[7].time) < 1e-3
    assert [r.request_id for r in store.select(now - 86400 * 5.5, now - 86400 * 2.5)] == \
        ["r5", "r6", "r7"]
    assert store.retain(max_age_s=86400 * 4.5, max_bytes=1 << 40) == 6
    assert store.size() > 0
    store.close()
    with pytest.raises(StoreFault):
        PostgresStore(postgres_url.rsplit("/", 1)[0] + "/no_such_db").write(rows[:1])


def test_postgres_store_lists_by_filter_a_page_at_a_time(postgres_url):
    store = PostgresStore(postgres_url)
    base = time.time() - 100
    rows = [Record(base + i / 7, f"L-{i % 4}", "st", "cam", f"m{i % 2}", "1", None,
                   "NG" if i % 3 else "OK", "dent" if i % 2 else "scratch", 0.5, None, {},
                   f"list-{i}", 0, None, f"2026/L-{i}.jpg" if i % 3 else None)
            for i in range(20)]
    store.write(rows)
    want = [r.request_id for r in reversed(rows) if r.verdict == "NG" and r.model == "m1"]
    got, before = [], None
    while True:
        page = store.listing(RecordQuery(verdict="NG", model="m1", since=base - 1, limit=3,
                                         before=before))
        got += [r.request_id for _, r in page]
        if len(page) < 3:
            break
        before = (page[-1][1].time, page[-1][0])
    assert got == want and len(got) > 3
    dents = store.listing(RecordQuery(label="dent", since=base - 1))
    assert {r.label for _, r in dents} == {"dent"} and len(dents) == 10
    part = store.listing(RecordQuery(part_id="L-1", since=base - 1))
    assert [r.request_id for _, r in part] == [f"list-{i}" for i in (17, 13, 9, 5, 1)]
    assert all(r.image for _, r in store.listing(RecordQuery(verdict="NG", since=base - 1)))
    captured = store.listing(RecordQuery(model="m0", since=base - 1, captured=True))
    assert captured and all(r.image and r.model == "m0" for _, r in captured)
    row_id, record = captured[0]
    assert store.record(row_id) == record and store.record(10**12) is None
    # a frame captured later (a flag's, from the recent frames): found again by its time
    not_kept = [(i, r) for i, r in store.listing(RecordQuery(model="m0", since=base - 1))
                if r.image is None]
    assert not_kept
    later_id, later = not_kept[0]
    sent = rows[int(later.request_id.split("-")[1])]
    assert abs(later.time - sent.time) <= SAME_TIME_S
    store.set_image(later_id, "2026/flagged.jpg", "flagged")
    store.set_image(row_id, "2026/other.jpg", "flagged")  # has one: keeps it
    assert (store.record(later_id).image, store.record(later_id).kept_for) == \
        ("2026/flagged.jpg", "flagged")
    assert store.record(row_id).image == record.image
    store.close()


def test_a_postgres_table_of_an_earlier_version_gains_the_camera_time(postgres_url):
    import psycopg

    def record(part: str, camera_time: float | None = None) -> Record:
        return Record(time.time(), part, "st", "cam", "tiny", "1", None, "OK", "ok", 0.9, None,
                      {}, part, camera_time=camera_time)

    store = PostgresStore(postgres_url)
    store.write([record("CT-0")])
    store.close()
    with psycopg.connect(postgres_url, autocommit=True) as c:  # the table as it was before
        c.execute("ALTER TABLE visionserve_records DROP COLUMN camera_time")
    store = PostgresStore(postgres_url)
    assert store.history("CT-0")[0].camera_time is None  # read first: the table gains it
    store.write([record("CT-1", 1796375551.125)])
    assert store.history("CT-1")[0].camera_time == 1796375551.125
    store.close()


def test_postgres_keeps_labels_beside_the_records(postgres_url):
    from tests.unit.test_labels import label_round_trip

    label_round_trip(PostgresStore(postgres_url), model="labels-pg")


# --- S3 ------------------------------------------------------------------------------------------

def _moto_exe() -> Path:
    """moto_server (its own venv: tests/tools/setup_moto.sh), or a skip saying why none."""
    exe = Path(os.environ.get("VISIONSERVE_MOTO_SERVER", REPO / ".work/moto-venv/bin/moto_server"))
    if not exe.exists():
        pytest.skip(f"no moto_server at {exe}: run tests/tools/setup_moto.sh")
    return exe


@contextlib.contextmanager
def _moto(exe: Path, port: int, folder: Path):
    """moto's S3-compatible server on 127.0.0.1:``port`` while the block runs."""
    log = open(folder / f"moto-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _listening(port), 30, "moto_server")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3-compatible server on loopback, or a skip saying why there is none."""
    with _moto(_moto_exe(), free_port(), tmp_path_factory.mktemp("moto")) as endpoint:
        yield endpoint


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_captured_images_go_to_an_s3_bucket_with_their_record(server_factory, tiny_repo,
                                                             tmp_path, jpeg_bytes, s3_endpoint):
    import minio

    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_REGION": "us-east-1"}
    client = minio.Minio(s3_endpoint.split("//")[1], access_key="testing", secret_key="testing",
                         secure=False, region="us-east-1")
    client.make_bucket("line3")
    server = server_factory(tiny_repo, "--records", "--records-dir", str(tmp_path / "data"),
                            "--capture", "all", "--capture-target", "s3://line3/captures",
                            "--capture-s3-endpoint", s3_endpoint, "--auth-token", TOKEN,
                            env=creds)
    assert _inspect(server, jpeg_bytes, "S-1").status_code == 200
    rec = wait_for(lambda: (h := _history(server, "S-1")).status_code == 200
                   and h.json()["records"][0], 20, "the record")
    assert rec["image"].startswith("s3://line3/captures/")
    name = rec["image"].removeprefix("s3://line3/")
    wait_for(lambda: any(o.object_name == name + ".json" for o in
                         client.list_objects("line3", prefix="captures/", recursive=True)),
             20, "the sidecar in the bucket")
    assert client.get_object("line3", name).read() == jpeg_bytes
    side = json.loads(client.get_object("line3", name + ".json").read())
    assert side["part_id"] == "S-1" and side["image"] == rec["image"]
    # read back through the server's own S3 client, by the record's id
    auth = {"Authorization": f"Bearer {TOKEN}"}
    rid = httpx.get(f"{server.url}/v1/records", params={"part_id": "S-1"}, headers=auth,
                    timeout=10).json()["records"][0]["id"]
    image = httpx.get(f"{server.url}/v1/records/{rid}/image", headers=auth, timeout=30)
    assert image.status_code == 200 and image.content == jpeg_bytes
    drawn = httpx.get(f"{server.url}/v1/records/{rid}/overlay", params={"size": 64},
                      headers=auth, timeout=30)
    assert drawn.status_code == 200 and drawn.headers["content-type"] == "image/jpeg"
    client.remove_object("line3", name)  # the bucket's lifecycle rule
    gone = httpx.get(f"{server.url}/v1/records/{rid}/image", headers=auth, timeout=30)
    assert gone.status_code == 404 and "no longer" in gone.json()["error"], gone.text


# --- data safety: a full disk, repeated ids, an unreachable bucket, a shared capture folder ----

S3_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1"}


def _rows(db: Path, where: str = "1", args: tuple = ()) -> list[sqlite3.Row]:
    c = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
    try:
        c.row_factory = sqlite3.Row
        return c.execute(f"SELECT * FROM records WHERE {where} ORDER BY id", args).fetchall()
    finally:
        c.close()


def _noise_jpeg(seed: int, size: int = 96) -> bytes:
    import cv2

    img = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()


def _send_all(server, frames: list[tuple[str, bytes]], parallel: int = 8) -> list[int]:
    async def run() -> list[int]:
        gate = asyncio.Semaphore(parallel)
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(part: str, body: bytes) -> int:
                async with gate:
                    r = await client.post(f"{server.url}/v1/models/tiny/inspect", content=body,
                                          headers={"Content-Type": "image/jpeg",
                                                   "X-Part-Id": part})
                    return r.status_code
            return list(await asyncio.gather(*(one(p, b) for p, b in frames)))

    return asyncio.run(run())


def test_a_full_disk_keeps_the_records_before_the_images_and_no_loss_is_silent(
        request, server_factory, tiny_repo, tmp_path):
    """--records --capture all on a 6 MiB file system, 700 frames of ~20 KB: the images fill it,
    the server deletes its own oldest images and every record is written; then a burst and
    SIGTERM at once: the records in SQLite plus the losses the server counted and logged are
    every answered frame."""
    disk = mount_disk(request, tmp_path, "full", "6m")
    server = server_factory(tiny_repo, "--records", "--records-dir", str(disk.dir),
                            "--capture", "all", "--frontends", "0", grpc=False)
    frame = _noise_jpeg(0, 128)
    assert len(frame) > 15_000
    codes = _send_all(server, [(f"F-{i}", frame) for i in range(700)])
    assert codes == [200] * 700
    wait_for(lambda: _metric(server, "visionserve_records_written_total")
             + _metric(server, "visionserve_records_dropped_total") >= 700, 60,
             "every record written or counted")
    assert _metric(server, "visionserve_captures_deleted_total") > 0  # the disk did fill
    assert _metric(server, "visionserve_records_dropped_total") == 0
    assert _metric(server, "visionserve_records_deleted_total") == 0
    db = disk.dir / "records.sqlite"
    assert len(_rows(db)) == 700
    # written after the disk filled (older images make way for newer ones)
    assert len(_rows(db, "part_id = ?", ("F-699",))) == 1
    # (a frame whose image found no room has none: its record is kept all the same)
    assert any(row["image"] and (disk.dir / "captures" / row["image"]).exists()
               for row in _rows(db)[-20:])
    # a burst, and SIGTERM as soon as it is answered: queued records are stored or counted
    assert _send_all(server, [(f"B-{i}", frame) for i in range(100)], 16) == [200] * 100
    assert server.stop(signal.SIGTERM) == 0
    log = server.log()
    m = re.search(r"records: .*since start (\d+) written, (\d+) lost, (\d+) deleted", log)
    assert m, log[-3000:]
    written, lost, deleted = map(int, m.groups())
    assert len(_rows(db)) == written - deleted
    assert len(_rows(db)) + lost + deleted == 800


def test_repeated_ids_keep_each_answers_own_image_over_http_and_grpc(server_factory, tiny_repo,
                                                                     tmp_path):
    """Two different frames with the same part id and request id (a retry), and two gRPC calls
    with the same request id (tritonclient's default is fixed): two images, and each record
    points at its own frame's."""
    import tritonclient.grpc as grpcclient

    data = tmp_path / "data"
    server = server_factory(tiny_repo, "--records", "--records-dir", str(data), "--capture", "all",
                            "--frontends", "0")
    frames = [_noise_jpeg(1, 64), _noise_jpeg(2, 64)]
    answers = []
    for body in frames:
        r = httpx.post(f"{server.url}/v1/models/tiny/inspect", content=body, timeout=30,
                       headers={"Content-Type": "image/jpeg", "X-Part-Id": "R-1",
                                "X-Request-Id": "retry-1"})
        assert r.status_code == 200, r.text
        answers.append(r.json())
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for body in frames:
        inp = grpcclient.InferInput("image", [1], "BYTES")
        inp.set_data_from_numpy(np.array([body], dtype=object))
        client.infer("tiny", [inp], request_id="same", parameters={"part_id": "G-1"})
    db = data / "records.sqlite"
    for part, rid in (("R-1", "retry-1"), ("G-1", "same")):
        rows = wait_for(lambda part=part: len(r := _rows(db, "part_id = ?", (part,))) == 2 and r,
                        20, f"both records of {part}")
        assert [row["request_id"] for row in rows] == [rid, rid]
        images = [row["image"] for row in rows]
        assert None not in images and images[0] != images[1]
        assert {(data / "captures" / img).read_bytes() for img in images} == set(frames)
        # each record's image is the frame its result came from
        for row in rows:
            body = (data / "captures" / row["image"]).read_bytes()
            i = frames.index(body)
            assert json.loads(row["result"])["scores"] == pytest.approx(answers[i]["scores"],
                                                                       abs=1e-4)


def test_the_capture_quota_deletes_only_the_servers_own_images(server_factory, tiny_repo,
                                                               tmp_path):
    folder = tmp_path / "captures"
    (folder / "golden").mkdir(parents=True)
    (folder / "notes.txt").write_text("camera 3: lens cleaned 2026-11-30")
    (folder / "golden" / "reference.png").write_bytes(b"\x89PNG" + b"g" * 40_000)
    server = server_factory(tiny_repo, "--records", "--records-dir", str(tmp_path / "data"),
                            "--capture", "all", "--capture-target", str(folder),
                            "--capture-quota", "60000", "--frontends", "0", grpc=False)
    frame = _noise_jpeg(3, 64)
    assert _send_all(server, [(f"Q-{i}", frame) for i in range(12)], 1) == [200] * 12
    wait_for(lambda: len(_rows(tmp_path / "data" / "records.sqlite")) == 12, 20, "the records")
    assert _metric(server, "visionserve_captures_deleted_total") > 0
    assert (folder / "notes.txt").read_text() == "camera 3: lens cleaned 2026-11-30"
    assert (folder / "golden" / "reference.png").stat().st_size == 40_004
    kept = [p for p in folder.glob("*/*.jpg")]
    assert 0 < len(kept) < 12


def test_an_unreachable_bucket_never_leaves_a_record_pointing_at_nothing(
        server_factory, tiny_repo, tmp_path):
    """The S3 endpoint is a closed loopback port: each image waits in the local spool, and the
    record names where it will be uploaded; with moto_server, once it answers, the spooled
    images are uploaded and the spool empties."""
    port = free_port()  # nothing listens there
    data = tmp_path / "data"
    server = server_factory(tiny_repo, "--records", "--records-dir", str(data), "--capture", "all",
                            "--capture-target", "s3://line3/captures", "--capture-s3-endpoint",
                            f"http://127.0.0.1:{port}", "--frontends", "0", grpc=False,
                            env=S3_CREDS)
    frames = {f"U-{i}": _noise_jpeg(10 + i, 64) for i in range(3)}
    assert _send_all(server, list(frames.items()), 1) == [200] * 3
    db = data / "records.sqlite"
    rows = wait_for(lambda: len(r := _rows(db)) == 3 and r, 20, "the records")
    spool = data / "capture-spool"
    for row in rows:
        assert row["image"].startswith("s3://line3/captures/")
        key = row["image"].removeprefix("s3://line3/captures/")
        assert (spool / key).read_bytes() == frames[row["part_id"]]  # stored, to be uploaded
        # the image route reads it from the spool meanwhile
        image = httpx.get(f"{server.url}/v1/records/{row['id']}/image", timeout=30)
        assert image.status_code == 200 and image.content == frames[row["part_id"]]
    assert _metric(server, "visionserve_capture_spooled") == 3
    assert "cannot be reached" in server.log()
    exe = _moto_exe()  # the rest needs a server that comes back
    import minio

    with _moto(exe, port, tmp_path) as endpoint:
        client = minio.Minio(endpoint.split("//")[1], access_key="testing", secret_key="testing",
                             secure=False, region="us-east-1")
        client.make_bucket("line3")
        wait_for(lambda: _metric(server, "visionserve_capture_spooled") == 0, 120,
                 "the spool uploaded")
        for row in rows:
            name = row["image"].removeprefix("s3://line3/")
            assert client.get_object("line3", name).read() == frames[row["part_id"]]
            assert json.loads(client.get_object("line3", name + ".json").read())["image"] == \
                row["image"]
        assert not list(spool.rglob("*.jpg"))
        assert "answers again" in server.log()
