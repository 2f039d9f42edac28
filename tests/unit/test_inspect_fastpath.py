"""The inspect API's fast path: ``POST .../inspect`` is answered by the route function without
FastAPI's stack; the answers are the route's, every other path still goes to FastAPI."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from visionserve.config import ServerSettings
from visionserve.engine import Engine
from visionserve.http.app import create_app
from visionserve.http.inspect import InspectFastPath


class Spy:
    """The FastAPI app, recording which requests reached it."""

    def __init__(self, app) -> None:
        self.app, self.state, self.paths = app, app.state, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


@pytest.fixture
async def client(tiny_repo):
    settings = ServerSettings(models=tiny_repo, max_queue_delay_ms=1)
    eng = Engine(settings, device="cpu")
    await eng.start()
    spy = Spy(create_app(eng, settings))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=InspectFastPath(spy)),
                                 base_url="http://test") as c:
        yield c, spy
    await eng.close()


RAW = {"Content-Type": "application/octet-stream", "X-Image-Shape": "32x32x3", "X-Part-Id": "p1"}


async def test_inspect_skips_fastapi_and_answers_like_the_route(client):
    c, spy = client
    body = np.full((32, 32, 3), 77, np.uint8).tobytes()
    fast = await c.post("/v1/models/tiny/inspect", content=body, headers=RAW)
    assert fast.status_code == 200 and fast.json()["part_id"] == "p1" and fast.json()["verdict"] in ("OK", "NG")
    versioned = await c.post("/v1/models/tiny/versions/1/inspect", content=body, headers=RAW)
    assert versioned.json()["scores"] == pytest.approx(fast.json()["scores"])
    assert spy.paths == []  # FastAPI never saw them
    assert (await c.get("/v2/health/ready")).status_code == 200
    assert spy.paths == [("GET", "/v2/health/ready")]


@pytest.mark.parametrize("path, headers, body, status, words", [
    ("/v1/models/nope/inspect", RAW, b"x" * 3072, 404, "unknown model"),
    ("/v1/models/tiny/versions/7/inspect", RAW, b"x" * 3072, 404, "no version 7"),
    ("/v1/models/tiny/inspect", {"Content-Type": "image/jpeg"}, b"not a jpeg", 400, "not an image"),
    ("/v1/models/tiny/inspect", {"Content-Type": "text/plain"}, b"x", 415, "unsupported content type"),
    ("/v1/models/tiny/inspect", {**RAW, "X-Priority": "high"}, b"x" * 3072, 400, "X-Priority"),
])
async def test_inspect_errors_through_the_fast_path(client, path, headers, body, status, words):
    c, spy = client
    r = await c.post(path, content=body, headers=headers)
    assert r.status_code == status and words in r.json()["error"], r.text
    assert spy.paths == []


async def test_other_methods_and_paths_still_reach_fastapi(client):
    c, spy = client
    assert (await c.get("/v1/models/tiny/inspect")).status_code == 405  # FastAPI's answer
    assert (await c.post("/v1/models/tiny/inspect/extra", content=b"")).status_code == 404
    assert ("GET", "/v1/models/tiny/inspect") in spy.paths
