"""The verdict preview on a real server: a threshold change's preview names exactly the frames
whose verdict then flips when the change is made and the same frames are sent again (also
through front-end processes); the preview changes nothing; the kept frames are bounded
(``--preview-frames``); validation answers as ``PUT /v1/models/{m}/verdict`` does; and it is a
protected change route (role quality, CSRF, JSON only)."""

from __future__ import annotations

import statistics

import httpx
import pytest
from conftest import TINY_TOML, make_tiny_model, start_server

from tests.integration.test_console_users import add_users, session_client

#: every frame OK to begin with: each label is a good one, any score will do
TOML = TINY_TOML + '[verdict]\nok_labels = ["ok", "dent", "scratch"]\nok_threshold = 0.0\n'


def _images(n: int) -> list[bytes]:
    import cv2
    import numpy as np

    rng = np.random.default_rng(7)
    return [cv2.imencode(".png", rng.integers(0, 256, (32, 32, 3), np.uint8))[1].tobytes()
            for _ in range(n)]


def _inspect(server, png: bytes, part: str, rid: str) -> dict:
    r = httpx.post(f"{server.url}/v1/models/tiny/inspect", content=png, timeout=30,
                   headers={"Content-Type": "image/png", "X-Part-Id": part, "X-Request-Id": rid})
    assert r.status_code == 200, r.text
    return r.json()


def _preview(server, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/models/tiny/verdict/preview", json=body, timeout=30, **kw)


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_the_preview_names_the_frames_the_change_then_flips(tmp_path, frontends):
    make_tiny_model(tmp_path / "repo" / "tiny", TOML)
    server = start_server(tmp_path / "repo", tmp_path, "--frontends", frontends, grpc=False)
    try:
        images = _images(12)
        scores = {}
        for i, png in enumerate(images):
            answer = _inspect(server, png, f"P-{i}", f"first-{i}")
            assert answer["verdict"] == "OK"
            scores[f"P-{i}"] = answer["score"]
        threshold = statistics.median(scores.values())
        expected = {p for p, s in scores.items() if s < threshold}
        assert 0 < len(expected) < 12
        toml = tmp_path / "repo" / "tiny" / "model.toml"
        before = toml.read_bytes()
        r = _preview(server, {"ok_threshold": threshold})
        assert r.status_code == 200, r.text
        preview = r.json()
        assert (preview["model"], preview["frames"], preview["unavailable"]) == ("tiny", 12, 0)
        assert preview["changed"] == len(expected)
        assert {f["part_id"] for f in preview["frames_changed"]} == expected
        for f in preview["frames_changed"]:
            assert (f["old"], f["new"]) == ("OK", "NG")
            assert f["request_id"] == f"first-{f['part_id'][2:]}" and f["time"].endswith("Z")
        stamps = [f["timestamp"] for f in preview["frames_changed"]]
        assert stamps == sorted(stamps, reverse=True)  # newest first
        # nothing changed: the file, the rule in force, the next answers
        assert toml.read_bytes() == before
        rule = httpx.get(f"{server.url}/v1/models/tiny/verdict", timeout=10).json()["verdict"]
        assert rule["ok_threshold"] == 0.0
        assert _inspect(server, images[0], "P-0", "again-0")["verdict"] == "OK"
        # the change itself: exactly the previewed frames flip
        r = httpx.put(f"{server.url}/v1/models/tiny/verdict", json={"ok_threshold": threshold},
                      timeout=30)
        assert r.status_code == 200, r.text
        flipped = {f"P-{i}" for i, png in enumerate(images)
                   if _inspect(server, png, f"P-{i}", f"after-{i}")["verdict"] == "NG"}
        assert flipped == expected
    finally:
        server.stop()


def test_the_kept_frames_are_bounded_and_validation_is_the_put_s(tmp_path):
    make_tiny_model(tmp_path / "repo" / "tiny", TOML)
    server = start_server(tmp_path / "repo", tmp_path, "--preview-frames", "5", grpc=False)
    try:
        for i, png in enumerate(_images(8)):
            _inspect(server, png, f"P-{i}", f"r-{i}")
        r = _preview(server, {"ok_threshold": 1.0})  # every frame would be NG
        assert r.status_code == 200, r.text
        assert (r.json()["frames"], r.json()["changed"]) == (5, 5)
        assert {f["part_id"] for f in r.json()["frames_changed"]} == {f"P-{i}" for i in range(3, 8)}
        url = f"{server.url}/v1/models/tiny/verdict"
        for body in ({"ok_threshold": 2}, {"no_such_field": 1}, {"ok_labels": ["wrong"]}, {}, [1]):
            put = httpx.put(url, json=body, timeout=10)
            post = httpx.post(f"{url}/preview", json=body, timeout=10)
            assert put.status_code == post.status_code == 400, (body, put.text, post.text)
            assert put.json() == post.json(), body
        for call in (httpx.put, httpx.post):
            target = url if call is httpx.put else f"{url}/preview"
            r = call(target, content=b"ok_threshold=1", timeout=10,
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
            assert r.status_code == 415, r.text
        assert _preview(server, {"ok_threshold": 1.0}).json()["frames"] == 5
        missing = httpx.post(f"{server.url}/v1/models/nobody/verdict/preview",
                             json={"ok_threshold": 1.0}, timeout=10)
        assert missing.status_code == 404
    finally:
        server.stop()


def test_no_frames_kept_with_preview_frames_0(tmp_path):
    make_tiny_model(tmp_path / "repo" / "tiny", TOML)
    server = start_server(tmp_path / "repo", tmp_path, "--preview-frames", "0", grpc=False)
    try:
        _inspect(server, _images(1)[0], "P-0", "r-0")
        answer = _preview(server, {"ok_threshold": 1.0}).json()
        assert answer["frames"] == 0 and "--preview-frames" in answer["why"]
    finally:
        server.stop()


def test_the_preview_is_a_quality_change_route(tmp_path):
    make_tiny_model(tmp_path / "repo" / "tiny", TOML)
    add_users(tmp_path / "data")
    server = start_server(tmp_path / "repo", tmp_path, "--host", "0.0.0.0", "--trusted-proxies",
                          "127.0.0.1", grpc=False, env={"XDG_DATA_HOME": str(tmp_path / "data")})
    try:
        r = _preview(server, {"ok_threshold": 0.5})
        assert r.status_code == 401 and "admin token" in r.json()["error"]
        viewer, viewer_csrf = session_client(server, "otto", "198.51.100.60")
        quality, csrf = session_client(server, "qe-anna", "198.51.100.61")
        with viewer, quality:
            path = "/v1/models/tiny/verdict/preview"
            r = viewer.post(path, json={"ok_threshold": 0.5},
                            headers={"X-CSRF-Token": viewer_csrf})
            assert r.status_code == 403 and "needs the role quality" in r.json()["error"]
            r = quality.post(path, json={"ok_threshold": 0.5})
            assert r.status_code == 403 and "CSRF token" in r.json()["error"]
            r = quality.post(path, json={"ok_threshold": 0.5}, headers={"X-CSRF-Token": csrf,
                                                                     "Origin": "http://evil.example"})
            assert r.status_code == 403
            r = quality.post(path, json={"ok_threshold": 0.5}, headers={"X-CSRF-Token": csrf})
            assert r.status_code == 200 and r.json()["frames"] == 0, r.text
    finally:
        server.stop()
