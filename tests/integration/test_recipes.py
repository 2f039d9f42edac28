"""Recipes on a real server: which model version and verdict settings a station's frames are
decided under, switched while frames flow (issue 21)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import start_server

from tests.tools.recipe_repo import RECIPES, versioned_tiny

@pytest.fixture(scope="module")
def recipe_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reciperepo")
    versioned_tiny(root / "tiny")
    (root / "recipes.toml").write_text(RECIPES)
    return root


@pytest.fixture
def repo(recipe_repo, tmp_path) -> Path:
    """A fresh copy per test: switches write the state file and model.toml."""
    copy = tmp_path / "repo"
    shutil.copytree(recipe_repo, copy)
    return copy


def _inspect(url: str, jpeg: bytes, path: str = "/v1/stations/st1/inspect", **headers) -> httpx.Response:
    return httpx.post(url + path, content=jpeg, timeout=30,
                      headers={"Content-Type": "image/jpeg", **headers})


def _version_of(answer: dict) -> int:
    """The version that computed an answer, from its scores (see recipe_repo.LOGITS)."""
    return 1 if answer["scores"]["ok"] > answer["scores"]["dent"] else 2


def test_a_station_runs_its_recipe_and_switches(repo, server_factory, jpeg_bytes):
    s = server_factory(repo, grpc=False)
    book = httpx.get(s.url + "/v1/recipes").json()
    assert book["stations"]["st1"] == {"recipe": "housing-black", "cameras": ["cam-1"]}
    assert book["recipes"]["housing-white"]["version"] == 2
    a = _inspect(s.url, jpeg_bytes, **{"X-Part-Id": "P1"}).json()
    assert (a["station"], a["recipe"], a["version"], _version_of(a)) == ("st1", "housing-black", "1", 1)
    assert a["verdict"] == "OK" and a["part_id"] == "P1"
    # the camera makes it the station's frame on the model's own URL too
    b = _inspect(s.url, jpeg_bytes, "/v1/models/tiny/inspect", **{"X-Camera-Id": "cam-1"}).json()
    assert (b["station"], b["recipe"]) == ("st1", "housing-black")
    # a frame of no station: the URL's model, no recipe
    c = _inspect(s.url, jpeg_bytes, "/v1/models/tiny/versions/2/inspect").json()
    assert "recipe" not in c and _version_of(c) == 2

    r = httpx.post(s.url + "/v1/stations/st1/recipe", json={"recipe": "housing-white"},
                   headers={"X-Operator": "shift lead"})
    assert r.status_code == 200, r.text
    switched = r.json()
    assert (switched["recipe"], switched["version"], switched["previous"]) == \
        ("housing-white", 2, "housing-black")
    assert switched["persisted"] and switched["changeover_ms"] >= 0
    d = _inspect(s.url, jpeg_bytes).json()
    assert (d["recipe"], d["version"], _version_of(d), d["verdict"]) == ("housing-white", "2", 2, "NG")
    assert httpx.get(s.url + "/v1/models/tiny/verdict").json()["verdict"]["ok_threshold"] == 0.6
    assert httpx.get(s.url + "/v1/stations/st1").json()["recipe"] == "housing-white"
    assert any("switched from recipe housing-black to housing-white" in ln
               for ln in s.log().splitlines())  # the audit line


def test_conflicts_and_bad_requests_change_nothing(repo, server_factory, jpeg_bytes):
    s = server_factory(repo, grpc=False)
    # st2 runs no recipe: its URL cannot say which model to use
    r = _inspect(s.url, jpeg_bytes, "/v1/stations/st2/inspect")
    assert r.status_code == 409 and "runs no recipe" in r.json()["error"]
    # st1 runs version 1: another version on its frames is a contradiction
    r = _inspect(s.url, jpeg_bytes, "/v1/models/tiny/versions/2/inspect", **{"X-Station-Id": "st1"})
    assert r.status_code == 409 and "housing-black" in r.json()["error"]
    # st2 may not set other verdict settings on the model st1 runs
    r = httpx.post(s.url + "/v1/stations/st2/recipe", json={"recipe": "housing-grey"})
    assert r.status_code == 409 and "ok_threshold" in r.json()["error"], r.text
    assert httpx.get(s.url + "/v1/stations/st2").json()["recipe"] is None
    # the same settings are fine
    assert httpx.post(s.url + "/v1/stations/st2/recipe",
                      json={"recipe": "housing-black"}).status_code == 200
    for path, body, status in [("/v1/stations/nope/recipe", {"recipe": "housing-black"}, 404),
                               ("/v1/stations/st1/recipe", {"recipe": "nope"}, 404),
                               ("/v1/stations/st1/recipe", {"recipe": 7}, 400),
                               ("/v1/stations/st1/recipe", [1], 400)]:
        r = httpx.post(s.url + path, json=body)
        assert r.status_code == status, (path, body, r.text)
        assert "error" in r.json()
    assert _inspect(s.url, jpeg_bytes, "/v1/stations/nope/inspect").status_code == 404
    assert httpx.get(s.url + "/v1/stations/st1").json()["recipe"] == "housing-black"


def test_a_restart_resumes_the_stations_recipes(repo, tmp_path, jpeg_bytes):
    s = start_server(repo, tmp_path, grpc=False)
    try:
        assert httpx.post(s.url + "/v1/stations/st1/recipe",
                          json={"recipe": "housing-white"}).status_code == 200
    finally:
        s.stop()
    state = json.loads((repo / "recipes.toml.active.json").read_text())
    assert state == {"stations": {"st1": "housing-white"}}
    s = start_server(repo, tmp_path, grpc=False)
    try:
        a = _inspect(s.url, jpeg_bytes).json()
        assert (a["recipe"], _version_of(a)) == ("housing-white", 2)
    finally:
        s.stop()


def test_oip_requests_of_a_station_over_http_and_grpc(repo, server_factory, jpeg_bytes):
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    s = server_factory(repo)
    assert httpx.post(s.url + "/v1/stations/st1/recipe",
                      json={"recipe": "housing-white"}).status_code == 200
    for module, url in ((httpclient, f"127.0.0.1:{s.http_port}"),
                        (grpcclient, f"127.0.0.1:{s.grpc_port}")):
        client = module.InferenceServerClient(url)
        inp = module.InferInput("image", [1], "BYTES")
        inp.set_data_from_numpy(np.array([jpeg_bytes], dtype=object))
        result = client.infer("tiny", [inp], parameters={"station_id": "st1"})
        response = result.get_response()
        if module is grpcclient:
            params = {k: v.string_param for k, v in response.parameters.items()}
            version = response.model_version
        else:
            params, version = response.get("parameters", {}), response["model_version"]
        assert params == {"station_id": "st1", "recipe": "housing-white"}, params
        assert version == "2"
        with pytest.raises(Exception, match="housing-white"):
            client.infer("tiny", [inp], model_version="1", parameters={"station_id": "st1"})


def test_switches_under_load_answer_every_frame_under_the_recipe_of_its_time(repo, server_factory,
                                                                              jpeg_bytes):
    """Ten switches while two clients send frames: every frame answered, each by the version of
    the recipe it names, and frames sent after a switch returned are decided under the new one."""
    s = server_factory(repo, "--frontends", "2", grpc=False)
    answers: list[tuple[float, float, dict]] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                r = http.post(s.url + "/v1/stations/st1/inspect", content=jpeg_bytes,
                              headers={"Content-Type": "image/jpeg"})
                answers.append((t0, time.monotonic(), r.status_code == 200 and r.json()))

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    switches = []  # (sent, returned, recipe now in force)
    try:
        time.sleep(0.5)
        for i in range(10):
            recipe = ("housing-white", "housing-black")[i % 2]
            t0 = time.monotonic()
            r = httpx.post(s.url + "/v1/stations/st1/recipe", json={"recipe": recipe}, timeout=30)
            assert r.status_code == 200, r.text
            switches.append((t0, time.monotonic(), recipe))
            time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert answers and all(a for _, _, a in answers), "every frame answered 200"
    version = {"housing-black": 1, "housing-white": 2}
    for sent, done, a in answers:
        assert isinstance(a, dict)
        assert version[a["recipe"]] == int(a["version"]) == _version_of(a), a
        # the recipe in force when the request was sent, or one switched in while it was out
        before = [rc for t0, t1, rc in switches if t1 <= sent]
        during = {rc for t0, t1, rc in switches if t0 < done and t1 > sent}
        allowed = {before[-1] if before else "housing-black"} | during
        assert a["recipe"] in allowed, (a["recipe"], allowed, sent)
    print(f"\n{len(answers)} frames over 10 switches; changeover "
          f"{max(t1 - t0 for t0, t1, _ in switches) * 1000:.0f} ms at most")
