"""The records listing (``GET /v1/records``) on a real server with capture on: each filter, keyset
pagination, the captured images' names, 400 for a bad filter, and who may read it; the SQLite
indexes the filters use (checked in the query plan), added to a store file made without them."""

from __future__ import annotations

import sqlite3

import httpx
import pytest
from conftest import TINY_TOML, make_tiny_model, start_server, wait_for

from tests.integration.test_console_users import add_users, session_client
from visionserve.records.record import Record
from visionserve.records.store import RecordQuery, SqliteStore

#: every frame OK
OK_TOML = TINY_TOML + '[verdict]\nok_labels = ["ok", "dent", "scratch"]\nok_threshold = 0.0\n'
#: every frame NG
NG_TOML = TINY_TOML + '[verdict]\nok_labels = ["ok"]\nok_threshold = 1.0\n'


def _images() -> list[bytes]:
    import cv2
    import numpy as np

    return [cv2.imencode(".png", np.full((32, 32, 3), (i * 40, 255 - i * 30, i * 17), np.uint8))[1]
            .tobytes() for i in range(6)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("listing")
    make_tiny_model(tmp / "repo" / "good", OK_TOML)
    make_tiny_model(tmp / "repo" / "bad", NG_TOML, seed=1)
    s = start_server(tmp / "repo", tmp, "--records", "--records-dir", str(tmp / "data"),
                     "--capture", "ng", grpc=False)
    s.data = tmp / "data"
    # 12 frames: 6 to each model, parts P-0..P-5 each once per model
    for model in ("good", "bad"):
        for i, png in enumerate(_images()):
            r = httpx.post(f"{s.url}/v1/models/{model}/inspect", content=png, timeout=30,
                           headers={"Content-Type": "image/png", "X-Part-Id": f"P-{i}",
                                    "X-Camera-Id": "cam-1"})
            assert r.status_code == 200, r.text
    wait_for(lambda: _list(s).json()["count"] == 12, 20, "12 records")
    yield s
    s.stop()


def _list(server, **params) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/records", params=params, timeout=10)


def test_each_filter_narrows_the_listing_newest_first(server):
    every = _list(server).json()["records"]
    times = [r["timestamp"] for r in every]
    assert times == sorted(times, reverse=True)
    ng = _list(server, verdict="NG").json()["records"]
    assert len(ng) == 6 and {r["model"] for r in ng} == {"bad"}
    for r in ng:  # what a gallery row needs, and the captured image, stored
        assert r["verdict"] == "NG" and r["version"] and r["camera"] == "cam-1"
        assert r["label"] and r["time"].endswith("Z") and r["part_id"].startswith("P-")
        assert (server.data / "captures" / r["image"]).is_file()
    assert all(r["image"] is None for r in _list(server, verdict="ok").json()["records"])
    assert [r["model"] for r in _list(server, model="good").json()["records"]] == ["good"] * 6
    label = ng[0]["label"]
    by_label = _list(server, label=label, verdict="NG").json()["records"]
    assert by_label and all(r["label"] == label for r in by_label)
    assert len(by_label) == sum(r["label"] == label for r in ng)
    part = _list(server, part_id="P-3").json()["records"]
    assert sorted(r["model"] for r in part) == ["bad", "good"]
    middle = times[5]
    newer = _list(server, since=_iso(middle)).json()["records"]
    older = _list(server, until=_iso(middle)).json()["records"]
    assert len(newer) + len(older) == 12 and all(r["timestamp"] >= middle - 1e-3 for r in newer)
    assert _list(server, model="nobody").json() == {"count": 0, "records": [], "next": None}
    captured = _list(server, captured="true").json()["records"]  # --capture ng: the NG ones
    assert [r["request_id"] for r in captured] == [r["request_id"] for r in ng]
    assert _list(server, captured="false").json()["count"] == 12


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


def test_pages_follow_one_another_without_gaps_or_repeats(server):
    every = [r["request_id"] for r in _list(server).json()["records"]]
    got, before = [], None
    while True:
        page = _list(server, limit=5, **({"before": before} if before else {})).json()
        got += [r["request_id"] for r in page["records"]]
        before = page["next"]
        if before is None:
            break
    assert got == every and len(got) == 12
    ng_pages = _list(server, verdict="NG", limit=4).json()
    rest = _list(server, verdict="NG", limit=4, before=ng_pages["next"]).json()
    assert ng_pages["count"] == 4 and rest["count"] == 2 and rest["next"] is None
    assert all(r["verdict"] == "NG" for r in rest["records"])


@pytest.mark.parametrize("params, says", [
    ({"verdict": "maybe"}, "verdict"), ({"since": "yesterday"}, "not a time"),
    ({"limit": "0"}, "limit"), ({"limit": "abc"}, "limit"), ({"limit": "501"}, "limit"),
    ({"before": "x"}, "before"), ({"since": "2026-12-02", "until": "2026-12-01"}, "after"),
    ({"captured": "yes"}, "captured"),
])
def test_a_bad_filter_is_a_400_naming_it(server, params, says):
    r = _list(server, **params)
    assert r.status_code == 400 and says in r.json()["error"], r.text


def test_the_listing_is_a_viewer_s_read(tmp_path):
    make_tiny_model(tmp_path / "repo" / "tiny", OK_TOML)
    add_users(tmp_path / "data")
    s = start_server(tmp_path / "repo", tmp_path, "--host", "0.0.0.0", "--records",
                     "--trusted-proxies", "127.0.0.1", grpc=False,
                     env={"XDG_DATA_HOME": str(tmp_path / "data")})
    try:
        assert httpx.get(f"{s.url}/v1/records", timeout=10).status_code == 401
        viewer, _ = session_client(s, "otto", "198.51.100.31")
        with viewer:
            assert viewer.get("/v1/records").status_code == 200
            assert viewer.get("/v1/records", headers={"Host": "evil.example"}).status_code == 403
    finally:
        s.stop()


# --- the SQLite store's indexes ------------------------------------------------------------------

def _record(i: int) -> Record:
    return Record(1.0e9 + i, f"P-{i}", None, None, f"m{i % 2}", "1", None, "NG" if i % 3 else "OK",
                  "dent", 0.5, None, {}, f"r{i}", image=f"2001-09-09/P-{i}.0123456789ab.jpg")


@pytest.mark.parametrize("query", [RecordQuery(verdict="NG"), RecordQuery(model="m1"),
                                   RecordQuery(label="dent"), RecordQuery(part_id="P-3"),
                                   RecordQuery(verdict="NG", before=(1.0e9 + 5, 5)),
                                   RecordQuery(model="m0", since=1.0e9, until=2.0e9),
                                   RecordQuery(verdict="NG", captured=True),
                                   RecordQuery(verdict="NG", model="m1", captured=True),
                                   RecordQuery(verdict="NG", label="dent", captured=True)])
def test_filtered_listings_use_an_index_also_in_a_file_made_without_them(tmp_path, query):
    path = tmp_path / "records.sqlite"
    old = sqlite3.connect(path)  # the table as an older server made it: part and time only
    old.executescript("CREATE TABLE records (id INTEGER PRIMARY KEY, time REAL NOT NULL, "
                      "part_id TEXT, station TEXT, camera TEXT, model TEXT NOT NULL, version TEXT "
                      "NOT NULL, recipe TEXT, verdict TEXT NOT NULL, label TEXT, score REAL, "
                      "result TEXT, timings TEXT, request_id TEXT, frame_index INTEGER NOT NULL "
                      "DEFAULT 0, error TEXT, image TEXT);"
                      "CREATE INDEX records_part ON records (part_id, time);"
                      "CREATE INDEX records_time ON records (time);")
    old.close()
    store = SqliteStore(path)
    store.write([_record(i) for i in range(10)])  # the writer's open adds the indexes
    store.close()
    c = sqlite3.connect(path)
    sql, args = SqliteStore.listing_sql(query)
    plan = " / ".join(row[3] for row in c.execute(f"EXPLAIN QUERY PLAN {sql}", args))
    c.close()
    assert "SEARCH records USING INDEX" in plan and "TEMP B-TREE" not in plan, plan
    got = [r.request_id for _, r in store.listing(query)]
    assert got == sorted(got, key=lambda x: -int(x[1:])) and got
