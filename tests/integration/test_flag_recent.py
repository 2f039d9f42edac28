"""An escape flagged after it passed (docs/closed-loop.md): a real server with the shipped
classifier, ``--capture learn`` at a sample that keeps almost no OK frame, and a small
``--capture-recent``. A flag of a frame not captured but among the recent ones in memory
captures it then: the record names its image (``kept_for`` ``flagged``), the image is the very
bytes that part's request sent, the label is kept; a frame pushed out of memory by newer ones
is a 409 that says so. In the engine's process and through a front-end process (which asks the
engine's). A part's console page offers the flag to whoever may flag (quality, admin), not to a
viewer."""

from __future__ import annotations

import httpx
import pytest
from conftest import start_server, wait_for

from tests.integration.test_console_users import add_users, session_client
from tests.integration.test_records_images import shipped_repo
from visionserve.records.store import SqliteStore
from visionserve_tools import synthetic

MODEL = "defect-classifier"
TOKEN = "flag-recent-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
#: the recent frames kept: a few dozen of the frames below
RECENT = "1MiB"


def jpeg(seed: int) -> bytes:
    return synthetic.encode(synthetic.generate("ok", seed, (320, 240)))


@pytest.fixture(scope="module", params=[(), ("--frontends", "1")], ids=["engine", "frontends"])
def server(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flag-recent")
    add_users(tmp / "xdg")
    s = start_server(shipped_repo(tmp / "repo", (MODEL,)), tmp, "--host", "0.0.0.0",
                     "--trusted-proxies", "127.0.0.1", "--admin-token", TOKEN,
                     "--records", "--records-dir", str(tmp / "data"), "--capture", "learn",
                     "--capture-sample-percent", "0.001", "--capture-recent", RECENT,
                     *request.param, grpc=False, env={"XDG_DATA_HOME": str(tmp / "xdg")})
    s.store = SqliteStore(tmp / "data" / "records.sqlite")
    s.sent = {}
    yield s
    s.stop()


def send(server, first: int, n: int) -> None:
    for seed in range(first, first + n):
        body = jpeg(seed)
        r = httpx.post(f"{server.url}/v1/models/{MODEL}/inspect", content=body, timeout=30,
                       headers={"Content-Type": "image/jpeg", "X-Part-Id": f"P-{seed}",
                                "X-Request-Id": "line-7",  # a client that repeats its id
                                "X-Deadline-Ms": "10000"})
        assert r.status_code == 200, r.text
        server.sent[f"P-{seed}"] = body
    wait_for(lambda: all(server.store.history(f"P-{s}") for s in range(first, first + n)), 30,
             "every record")


def not_captured(server, first: int, n: int) -> list[tuple[str, int]]:
    """(part id, record id) of the frames sent whose image the policy did not keep."""
    out = []
    for seed in range(first, first + n):
        page = httpx.get(f"{server.url}/v1/records", params={"part_id": f"P-{seed}"},
                         headers=ADMIN, timeout=10).json()["records"]
        if page[0]["image"] is None and page[0]["verdict"] == "OK":
            out.append((f"P-{seed}", page[0]["id"]))
    return out


def flag(server, record_id: int) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/records/{record_id}/flag", headers=ADMIN, timeout=60,
                      json={"verdict_was_wrong": True, "label": "scratch"})


def test_an_escape_flagged_while_its_frame_is_recent_is_captured_then(server):
    send(server, 0, 10)
    escapes = not_captured(server, 0, 10)
    assert len(escapes) >= 5, escapes
    for part, rid in escapes[:3]:
        r = flag(server, rid)
        assert r.status_code == 200, r.text
        assert r.json()["labelled"]["label"] == "scratch"
        (record,) = server.store.history(part)
        assert record.image and record.kept_for == "flagged", record
        # the image is that part's frame, byte for byte
        img = httpx.get(f"{server.url}/v1/records/{rid}/image", headers=ADMIN, timeout=10)
        assert img.status_code == 200 and img.content == server.sent[part]
        # flagged again (another label): the image it has
        again = httpx.put(f"{server.url}/v1/records/{rid}/label", json={"label": "spot"},
                          headers=ADMIN, timeout=10)
        assert again.status_code == 200, again.text
        assert server.store.history(part)[0].image == record.image
    # the review queue shows them with why they were kept
    page = httpx.get(f"{server.url}/v1/review", params={"model": MODEL, "state": "labelled"},
                     headers=ADMIN, timeout=10).json()["records"]
    assert {r["part_id"]: r["kept_for"] for r in page} == {p: "flagged" for p, _ in escapes[:3]}


def test_a_frame_pushed_out_of_memory_by_newer_ones_is_a_409_that_says_so(server):
    send(server, 100, 5)
    old = not_captured(server, 100, 5)
    assert old
    send(server, 200, 120)  # far more than --capture-recent holds
    r = flag(server, old[0][1])
    assert r.status_code == 409, r.text
    assert "no longer among the recent frames" in r.json()["error"]
    assert server.store.history(old[0][0])[0].image is None
    # a newest one still is captured
    newest = not_captured(server, 315, 5)
    assert newest and flag(server, newest[-1][1]).status_code == 200


def test_an_unknown_record_is_a_404(server):
    r = flag(server, 99_999_999)
    assert r.status_code == 404 and "no record 99999999" in r.json()["error"]


def test_a_parts_page_offers_the_flag_to_whoever_may_flag(server):
    send(server, 500, 1)
    (record,) = httpx.get(f"{server.url}/v1/records", params={"part_id": "P-500"},
                          headers=ADMIN, timeout=10).json()["records"]
    rid = record["id"]
    form = f'data-url="/v1/records/{rid}/flag"'
    summary = "This OK was wrong" if record["verdict"] == "OK" else "This NG was wrong"
    page = httpx.get(f"{server.url}/ui/parts/P-500", headers=ADMIN, timeout=10)
    assert page.status_code == 200 and form in page.text and summary in page.text
    for user, offered in (("qe-anna", True), ("otto", False)):
        client, _ = session_client(server, user, "198.51.100.77")
        with client:
            page = client.get("/ui/parts/P-500")
        assert page.status_code == 200 and (form in page.text) is offered, user
        assert "Not captured" in page.text  # the frame itself: not kept by the policy
