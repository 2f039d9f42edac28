"""Captured images by their record (``GET /v1/records/{id}/image`` and ``/overlay``) and the
console's NG parts pages (``/ui/parts``, ``/ui/parts/{part}``), on a real server with the shipped
detector and anomaly model, ``--records --capture ng``, and a real SQLite store: the stored bytes,
the answer drawn (boxes where the detector found them, the anomaly model's heat map from the
sidecar), thumbnails, 404s with their reason, no path from a request's text, who may read them;
the gallery's filters and the part's page; the gallery's pages with 100,000 records and 10,000
images (the partial indexes of captured records, in the query plan and in time)."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import sqlite3
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit
from zoneinfo import ZoneInfo

import httpx
import numpy as np
import pytest
from conftest import REPO, start_server, wait_for

from tests.integration.test_console_users import add_users, session_client
from visionserve.console import parts
from visionserve.records.record import Record
from visionserve.records.store import RecordQuery, SqliteStore
from visionserve_tools import synthetic

DETECTOR, ANOMALY = "defect-detector", "surface-anomaly"
ZONE = "Europe/Berlin"
#: part id -> what its frame shows
FRAMES = {"D-1": "scratch", "D-2": "crack", "D-3": "ok", "D-4": "spot"}


def shipped_repo(root: Path, models: tuple[str, ...]) -> Path:
    for name in models:
        shutil.copytree(REPO / "models" / name, root / name)
    for path in [root, *root.rglob("*")]:  # the server refuses a repository others can write
        path.chmod(path.stat().st_mode & 0o755)
    return root


def inspect(server, model: str, part: str, label: str, seed: int = 0) -> dict:
    r = httpx.post(f"{server.url}/v1/models/{model}/inspect", timeout=60,
                   content=synthetic.encode(synthetic.generate(label, seed=seed)),
                   # the shipped models' takt is for a free machine; a loaded test machine may
                   # take longer, which is not what these tests are about
                   headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                            "X-Deadline-Ms": "10000"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ngparts")
    s = start_server(shipped_repo(tmp / "repo", (DETECTOR, ANOMALY)), tmp, "--records",
                     "--records-dir", str(tmp / "data"), "--capture", "ng", "--time-zone", ZONE,
                     grpc=False)
    s.data = tmp / "data"
    s.verdicts = {}
    for i, (part, label) in enumerate(FRAMES.items()):
        s.verdicts[part] = inspect(s, DETECTOR, part, label, seed=i)["verdict"]
    s.verdicts["A-1"] = inspect(s, ANOMALY, "A-1", "scratch")["verdict"]
    wait_for(lambda: listing(s)["count"] == len(s.verdicts), 20, "every record")
    yield s
    s.stop()


def listing(server, **params) -> dict:
    return httpx.get(f"{server.url}/v1/records", params=params, timeout=10).json()


def row_id(server, part: str) -> int:
    """The record id of the part's answer, as the gallery links it."""
    page = httpx.get(f"{server.url}/ui/parts/{part}", timeout=10).text
    return int(re.findall(r'data-record="(\d+)"', page)[0])


def decode(body: bytes) -> np.ndarray:
    import cv2

    img = cv2.imdecode(np.frombuffer(body, np.uint8), cv2.IMREAD_COLOR)
    assert img is not None
    return img.astype(np.int16)


def get(server, path: str, **params) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", params=params, timeout=30)


def test_the_image_is_the_stored_file_and_the_overlay_draws_the_boxes(server):
    assert server.verdicts["D-2"] == "NG"
    rid = row_id(server, "D-2")
    record = listing(server, part_id="D-2")["records"][0]
    assert record["id"] == rid  # the listing names the id the image routes take
    raw = get(server, f"/v1/records/{rid}/image")
    assert raw.status_code == 200 and raw.headers["content-type"] == "image/jpeg"
    assert raw.content == (server.data / "captures" / record["image"]).read_bytes()
    assert raw.headers["cache-control"].startswith("private")
    over = get(server, f"/v1/records/{rid}/overlay")
    assert over.status_code == 200 and over.headers["content-type"] == "image/jpeg"
    a, b = decode(raw.content), decode(over.content)
    assert a.shape == b.shape
    diff = np.abs(a - b).sum(axis=2)
    x1, y1, x2, y2 = (round(v) for v in record["result"]["detections"][0]["box"])
    edge = np.concatenate([diff[y1:y2, max(0, x1 - 1):x1 + 2].ravel(),
                           diff[max(0, y2 - 1):y2 + 2, x1:x2].ravel()])
    assert edge.mean() > 100, edge.mean()  # the box's lines, in colour
    far = np.ones(diff.shape, bool)  # away from the box, its label and the banner
    far[max(0, y1 - 40):y2 + 40, max(0, x1 - 40):x2 + 40] = False
    far[:100, :] = False
    assert far.sum() > 10_000 and diff[far].mean() < 12, diff[far].mean()  # the JPEG's noise


def test_a_thumbnail_keeps_the_aspect_and_is_never_enlarged(server):
    rid = row_id(server, "D-1")
    full = decode(get(server, f"/v1/records/{rid}/image").content)
    for path in ("image", "overlay"):
        thumb = decode(get(server, f"/v1/records/{rid}/{path}", size=160).content)
        assert max(thumb.shape[:2]) == 160
        assert abs(thumb.shape[1] / thumb.shape[0] - full.shape[1] / full.shape[0]) < 0.02
    same = decode(get(server, f"/v1/records/{rid}/overlay", size=1024).content)
    assert same.shape == full.shape
    for bad in ("31", "1025", "x", "-5"):
        r = get(server, f"/v1/records/{rid}/overlay", size=bad)
        assert r.status_code == 400 and "size" in r.json()["error"], r.text


def test_the_anomaly_models_heat_map_is_kept_in_the_sidecar_and_drawn(server):
    assert server.verdicts["A-1"] == "NG"
    rid = row_id(server, "A-1")
    record = listing(server, part_id="A-1")["records"][0]
    assert "anomaly_map" not in record["result"]  # the record keeps only the regions
    side = json.loads((server.data / "captures" / f"{record['image']}.json").read_text())
    assert side["drawing"]["heat_map"]["png"] and len(json.dumps(side["drawing"])) < 40_000
    a = decode(get(server, f"/v1/records/{rid}/image").content)
    b = decode(get(server, f"/v1/records/{rid}/overlay").content)
    changed = (np.abs(a - b).sum(axis=2) > 30).mean()
    assert changed > 0.5, changed  # a heat map tints the whole frame, not only a box


def test_unknown_records_and_images_are_404s_with_the_reason(server):
    cases = {"/v1/records/999999/overlay": "no record 999999",
             "/v1/records/abc/image": "whole number",
             "/v1/records/99999999999999999999999/image": "whole number",
             f"/v1/records/{row_id(server, 'D-3')}/image": "no captured image"}
    assert server.verdicts["D-3"] == "OK"  # --capture ng kept no image of it
    for path, says in cases.items():
        r = get(server, path)
        assert r.status_code == 404 and says in r.json()["error"], (path, r.text)


def _tamper(server, part: str, image: str) -> int:
    """Point the part's record at ``image`` in the store (as a damaged or hostile file would)."""
    rid = row_id(server, part)
    c = sqlite3.connect(server.data / "records.sqlite", timeout=10)
    with c:
        c.execute("UPDATE records SET image = ? WHERE id = ?", (image, rid))
    c.close()
    return rid


def test_no_request_or_record_text_becomes_a_path(server, tmp_path):
    for path in ("/v1/records/..%2F..%2F..%2Fetc%2Fpasswd/image",
                 "/v1/records/1%2F..%2F..%2Fetc%2Fpasswd/image", "/v1/records/%2e%2e/image",
                 "/v1/records/1/image/../../../../etc/passwd"):
        r = get(server, path)
        assert r.status_code == 404 and "root:" not in r.text, (path, r.text)
    rid = _tamper(server, "D-4", "../../../../etc/passwd")
    r = get(server, f"/v1/records/{rid}/image")
    assert r.status_code == 404 and "did not write" in r.json()["error"], r.text
    # a key of the server's form, in a date folder that leads out of the capture folder
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.0123456789ab.jpg").write_bytes(b"\xff\xd8\xff secret")
    (server.data / "captures" / "2001-01-01").symlink_to(outside)
    rid = _tamper(server, "D-4", "2001-01-01/x.0123456789ab.jpg")
    r = get(server, f"/v1/records/{rid}/image")
    assert r.status_code == 404 and "outside" in r.json()["error"], r.text
    # an image the quota deleted
    rid = _tamper(server, "D-4", "2001-01-02/gone.0123456789ab.jpg")
    r = get(server, f"/v1/records/{rid}/overlay")
    assert r.status_code == 404 and "no longer" in r.json()["error"], r.text


def test_the_gallery_shows_captured_ng_frames_with_their_overlay_and_filters(server):
    page = get(server, "/ui/parts")
    assert page.status_code == 200 and page.headers["content-security-policy"]
    ng = [p for p, v in server.verdicts.items() if v == "NG"]
    shown = re.findall(r'<a href="/ui/parts/([^"]+)">', page.text)
    assert sorted(shown) == sorted(ng)
    assert "/overlay?size=320" in page.text and "/ui/static/parts.js" in page.text
    assert f"From ({ZONE})" in page.text and "NG parts" in page.text
    only = get(server, "/ui/parts", part_id="D-2").text
    assert re.findall(r'<a href="/ui/parts/([^"]+)">', only) == ["D-2"]
    assert re.findall(r'<a href="/ui/parts/([^"]+)">',
                      get(server, "/ui/parts", model=ANOMALY).text) == ["A-1"]
    assert re.findall(r'<a href="/ui/parts/([^"]+)">',
                      get(server, "/ui/parts", label="crack").text) == ["D-2"]
    future = get(server, "/ui/parts", since="2100-01-01T00:00").text
    assert "No captured NG frame matches" in future
    past = get(server, "/ui/parts", until="2000-01-01T00:00:00").text
    assert "No captured NG frame matches" in past
    bad = get(server, "/ui/parts", since="yesterday")
    assert bad.status_code == 400 and "not a time" in bad.text


def test_a_parts_page_shows_its_every_answer(server):
    inspect(server, ANOMALY, "D-1", "scratch", seed=5)  # the same part at a second model
    wait_for(lambda: listing(server, part_id="D-1")["count"] == 2, 20, "the second answer")
    page = get(server, "/ui/parts/D-1")
    assert page.status_code == 200
    for words in ("Part D-1", DETECTOR, ANOMALY, "queue ", "compute ", "batch of 1",
                  "Request id", "/overlay?size=800"):
        assert words in page.text, words
    for r in listing(server, part_id="D-1")["records"]:
        assert r["request_id"] in page.text
    missing = get(server, "/ui/parts/NOPE-9")
    assert missing.status_code == 404 and "No record of part NOPE-9" in missing.text


def test_a_part_id_with_slashes_has_its_page_and_its_history(server):
    """Part ids such as ``2026/12/D-7`` (a date path) link from the gallery to their page, and
    the API's history answers them too."""
    part = "2026/12/D-7"
    inspect(server, DETECTOR, part, "scratch", seed=7)
    wait_for(lambda: listing(server, part_id=part)["count"] == 1, 20, "the record")
    gallery = get(server, "/ui/parts", part_id=part).text
    (href,) = re.findall(r'<a href="(/ui/parts/[^"]+)">', gallery)
    page = httpx.get(f"{server.url}{href}", timeout=30)  # the link as the browser follows it
    assert page.status_code == 200 and f"Part {part}" in page.text
    history = get(server, f"/v1/parts/{part}")
    assert history.status_code == 200 and history.json()["records"][0]["part_id"] == part


def test_without_records_the_pages_say_so(tmp_path):
    s = start_server(shipped_repo(tmp_path / "repo", (DETECTOR,)), tmp_path, grpc=False)
    try:
        page = get(s, "/ui/parts")
        assert page.status_code == 200 and "keeps no records (--records)" in page.text
        assert get(s, "/v1/records/1/image").status_code == 404
    finally:
        s.stop()


def test_images_and_ng_pages_are_a_viewers_read(tmp_path):
    add_users(tmp_path / "users")
    s = start_server(shipped_repo(tmp_path / "repo", (DETECTOR,)), tmp_path, "--host", "0.0.0.0",
                     "--records", "--records-dir", str(tmp_path / "data"), "--capture", "ng",
                     "--trusted-proxies", "127.0.0.1", grpc=False,
                     env={"XDG_DATA_HOME": str(tmp_path / "users")})
    try:
        inspect(s, DETECTOR, "V-1", "scratch")
        wait_for(lambda: list((tmp_path / "data" / "captures").rglob("*.jpg")), 20, "the image")
        paths = ("/v1/records/1/image", "/v1/records/1/overlay?size=64", "/ui/parts",
                 "/ui/parts/V-1")
        for path in paths:
            assert httpx.get(s.url + path, timeout=10).status_code == 401, path
        viewer, _ = session_client(s, "otto", "198.51.100.41")
        with viewer:
            wait_for(lambda: viewer.get("/v1/records/1/image").status_code == 200, 20, "record")
            for path in paths:
                assert viewer.get(path).status_code == 200, path
                r = viewer.get(path, headers={"Host": "evil.example"})
                assert r.status_code == 403, path
                r = viewer.get(path, headers={"Origin": "http://evil.example"})
                assert r.status_code == 403, path
    finally:
        s.stop()


# --- the gallery's reads with many records (real SQLite, no server) ------------------------------

def _many(path: Path, n: int, every: int) -> None:
    """``n`` records over a day, two models; every ``every``-th is NG with a captured image."""
    store = SqliteStore(path)
    base = 1.8e9
    labels = ("scratch", "spot", "crack", "contamination")
    batch = []
    for i in range(n):
        captured = i % every == 0
        batch.append(Record(base + i * 0.8, f"P-{i}", "st-1", "cam-1", ("det", "cls")[i % 2], "1",
                            None, "NG" if captured or i % 7 == 0 else "OK",
                            labels[i % 4] if captured or i % 7 == 0 else "ok", 0.9,
                            {"detections": []}, {"total_ms": 3.0}, f"r{i}", 0, None,
                            f"2027-01-15/P-{i}_r{i}.0123456789ab.jpg" if captured else None))
        if len(batch) == 5000:
            store.write(batch)
            batch = []
    store.write(batch)
    store.close()


@pytest.fixture(scope="module")
def big_store(tmp_path_factory) -> SqliteStore:
    path = tmp_path_factory.mktemp("big") / "records.sqlite"
    _many(path, 100_000, 10)
    return SqliteStore(path)


FILTERS = {"since": "", "until": "", "model": "", "label": "", "part_id": ""}


@pytest.mark.parametrize("filters", [
    {}, {"model": "det"}, {"label": "crack"}, {"model": "cls", "label": "spot"},
    {"part_id": "P-99990"}, {"since": "2027-01-15T09:00", "until": "2027-01-15T12:00"},
    {"label": "no-such-label"}, {"model": "no-such-model"},
])
def test_the_gallery_reads_a_page_fast_among_100000_records(big_store, filters):
    zone = ZoneInfo("UTC")
    query = parts.gallery_query({**FILTERS, **filters}, "", zone)
    sql, args = SqliteStore.listing_sql(query)
    c = sqlite3.connect(big_store.path)
    plan = " / ".join(row[3] for row in c.execute(f"EXPLAIN QUERY PLAN {sql}", args))
    c.close()
    assert "USING INDEX" in plan and "TEMP B-TREE" not in plan, plan
    t0 = time.perf_counter()
    gallery = parts.read_gallery(big_store, {**FILTERS, **filters}, "", zone)
    took = time.perf_counter() - t0
    assert took < 0.3, (took, plan)
    for c in gallery.cards:
        r = c["r"]
        assert r.verdict == "NG" and r.image and c["overlay"] == f"/v1/records/{c['id']}/overlay"
    if not filters:
        assert len(gallery.cards) == parts.GALLERY_PAGE and gallery.older


def test_the_gallerys_pages_follow_one_another(big_store):
    zone = ZoneInfo("UTC")
    filters = {**FILTERS, "model": "det", "since": "2027-01-16T05:30"}
    seen: list[int] = []
    before = ""
    while True:
        g = parts.read_gallery(big_store, filters, before, zone)
        seen += [c["id"] for c in g.cards]
        if g.older is None:
            break
        assert "model=det" in g.older and "since=2027-01-16T05%3A30" in g.older
        before = parse_qs(urlsplit(g.older).query)["before"][0]
    since = dt.datetime(2027, 1, 16, 5, 30, tzinfo=dt.timezone.utc).timestamp()
    every = [i for i, _ in big_store.listing(RecordQuery(verdict="NG", model="det", since=since,
                                                         captured=True, limit=500))]
    assert seen == every and len(every) > 10 * parts.GALLERY_PAGE
