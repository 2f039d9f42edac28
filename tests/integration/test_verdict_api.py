"""Verdict settings changed while serving: ``GET``/``PUT /v1/models/{m}/verdict`` on a real server
(in the engine's process and with a front-end process), written back to model.toml atomically
with its comments, refused whole when invalid, audited, raced, kept across a restart, behind
auth, and in force from the next batch on."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
from conftest import TINY_TOML, make_tiny_model, start_server, wait_for

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LABELS = ["ok", "dent", "scratch"]
TOML = TINY_TOML + """\
[verdict]
# the line's rule: every label passes, so the threshold alone decides
ok_labels = ["ok", "dent", "scratch"]   # all of them
ok_threshold = 0.0  # set by the quality engineer
"""


def frame() -> bytes:
    ok, buf = cv2.imencode(".png", np.full((32, 32, 3), 90, np.uint8))
    assert ok
    return buf.tobytes()


def inspect(server) -> dict:
    r = httpx.post(f"{server.url}/v1/models/tiny/inspect", content=frame(),
                   headers={"Content-Type": "image/png"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def put(server, body, headers=None) -> httpx.Response:
    return httpx.put(f"{server.url}/v1/models/tiny/verdict", content=json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})}, timeout=30)


def on_file(repo: Path) -> dict:
    return tomllib.loads((repo / "tiny" / "model.toml").read_text())["verdict"]


@pytest.fixture(params=[(), ("--frontends", "1")], ids=["engine", "frontends"])
def served(request, tmp_path):
    repo = tmp_path / "repo"
    make_tiny_model(repo / "tiny", TOML)
    s = start_server(repo, tmp_path, "--log-json", *request.param, grpc=False)
    yield s, repo
    s.stop()


def test_get_put_and_answers_change_from_the_next_batch(served):
    server, repo = served
    r = httpx.get(f"{server.url}/v1/models/tiny/verdict")
    assert r.status_code == 200
    assert r.json() == {"model": "tiny", "verdict": {"ok_labels": LABELS, "ok_threshold": 0.0}}
    assert inspect(server)["verdict"] == "OK"
    r = put(server, {"ok_threshold": 1.0}, {"X-Operator": "qe-anna"})
    assert r.status_code == 200, r.text
    assert r.json()["verdict"] == {"ok_labels": LABELS, "ok_threshold": 1.0}
    # the next frame is judged by the new rule (a top score of 3 labels is < 1)
    assert inspect(server)["verdict"] == "NG"
    assert httpx.get(f"{server.url}/v1/models/tiny/verdict").json()["verdict"]["ok_threshold"] \
        == 1.0
    config = httpx.get(f"{server.url}/v2/models/tiny/config").json()
    assert config["parameters"]["ok_threshold"] == {"string_value": "1.0"}
    # written back: the value changed, the comments and the rest of the file as they were
    text = (repo / "tiny" / "model.toml").read_text()
    assert text == TOML.replace("ok_threshold = 0.0  #", "ok_threshold = 1.0  #")
    # audited: old and new values and the caller, one JSON line
    line = wait_for(lambda: next((json.loads(x) for x in server.log().splitlines()
                                  if x.startswith("{") and '"audit"' in x), None),
                    what="the audit line")
    a = line["audit"]
    assert (a["model"], a["old"]["ok_threshold"], a["new"]["ok_threshold"]) == ("tiny", 0.0, 1.0)
    # the operator is who the credential says (here: the loopback bind); X-Operator is what the
    # client says, kept beside it
    assert (a["caller"]["operator"], a["caller"]["operator_declared"]) == ("loopback", "qe-anna")
    assert a["caller"]["client"].startswith("127.0.0.1")


@pytest.mark.parametrize("body, field", [
    ({"ok_threshold": 1.5}, "verdict.ok_threshold"),
    ({"ok_treshold": 0.7}, "verdict.ok_treshold"),
    ({"ok_labels": ["ok", "bent"]}, "ok_labels"),
    ({"ok_threshold": "high"}, "verdict.ok_threshold"),
    ([0.7], "JSON object"),
    ({}, "JSON object"),
])
def test_invalid_changes_are_refused_whole(served, body, field):
    server, repo = served
    before = (repo / "tiny" / "model.toml").read_bytes()
    r = put(server, {**body, "ok_threshold": 1.0} if isinstance(body, dict) and body
            and "ok_threshold" not in body else body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]
    assert (repo / "tiny" / "model.toml").read_bytes() == before
    assert httpx.get(f"{server.url}/v1/models/tiny/verdict").json()["verdict"]["ok_threshold"] \
        == 0.0
    assert inspect(server)["verdict"] == "OK"


def test_not_json_and_unknown_model(served):
    server, _ = served
    r = httpx.put(f"{server.url}/v1/models/tiny/verdict", content=b"{oops")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    assert put(server, {"ok_threshold": 1.0}).status_code == 200
    r = httpx.put(f"{server.url}/v1/models/nope/verdict", content=b"{}")
    assert r.status_code == 404


def test_racing_puts_each_win_whole(served):
    """Each PUT sets two fields that belong together; after a race the file and the served
    settings hold one PUT's pair, and the file always parses."""
    server, repo = served
    pairs = [(["ok"], 0.1 * i) for i in range(1, 5)] + [(LABELS, 0.05 * i) for i in range(1, 5)]
    codes: list[int] = []
    torn: list[str] = []
    stop = threading.Event()

    def writer(labels, threshold):
        codes.append(put(server, {"ok_labels": labels, "ok_threshold": threshold}).status_code)

    def reader():
        while not stop.is_set():
            try:
                v = on_file(repo)
            except Exception as exc:  # noqa: BLE001 - a torn file is what we look for
                torn.append(repr(exc))
                continue
            if (v["ok_labels"], v["ok_threshold"]) not in \
                    [(LABELS, 0.0)] + [(list(lab), t) for lab, t in pairs]:
                torn.append(repr(v))

    watch = threading.Thread(target=reader)
    watch.start()
    threads = [threading.Thread(target=writer, args=p) for p in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watch.join()
    assert codes == [200] * len(pairs) and torn == []
    final = on_file(repo)
    assert (final["ok_labels"], final["ok_threshold"]) in [(list(lab), t) for lab, t in pairs]
    served_now = httpx.get(f"{server.url}/v1/models/tiny/verdict").json()["verdict"]
    assert served_now == {"ok_labels": final["ok_labels"], "ok_threshold": final["ok_threshold"]}
    assert not list((repo / "tiny").glob(".model.toml.*"))  # no temporary file left


def test_kept_across_a_restart(tmp_path):
    repo = tmp_path / "repo"
    make_tiny_model(repo / "tiny", TOML)
    s = start_server(repo, tmp_path, grpc=False)
    try:
        assert put(s, {"ok_threshold": 1.0}).status_code == 200
    finally:
        s.stop()
    s = start_server(repo, tmp_path, grpc=False)
    try:
        assert httpx.get(f"{s.url}/v1/models/tiny/verdict").json()["verdict"]["ok_threshold"] \
            == 1.0
        assert inspect(s)["verdict"] == "NG"
    finally:
        s.stop()


def test_behind_auth(tmp_path):
    repo = tmp_path / "repo"
    make_tiny_model(repo / "tiny", TOML)
    s = start_server(repo, tmp_path, "--auth-token", "s3cret", grpc=False)
    try:
        assert httpx.get(f"{s.url}/v1/models/tiny/verdict").status_code == 401
        assert put(s, {"ok_threshold": 1.0}).status_code == 401
        assert on_file(repo)["ok_threshold"] == 0.0
        r = put(s, {"ok_threshold": 1.0}, {"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and on_file(repo)["ok_threshold"] == 1.0
    finally:
        s.stop()
