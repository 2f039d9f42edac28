"""The shadow's pieces in the serving process (visionserve/loop/shadow.py): the tap's hand-off
(its model only, answered frames only, dropped and counted when its queue is full, a frame
limit), the request body, the report of a run read back from its SQLite file; and the judging
it shares with the held-out comparison, on the shipped classifier."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from visionserve import imaging
from visionserve.config import load_model_config
from visionserve.errors import InvalidInput, NotFound
from visionserve.loop import shadow
from visionserve.loop.evaluate import Judge, tensor
from visionserve.tasks.classification import Classified
from visionserve_tools import synthetic

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "defect-classifier"


@dataclass
class Served:
    name: str
    version: int = 1


@dataclass
class Answer:
    verdict: str
    result: object


@dataclass
class Item:
    future: asyncio.Future
    payload: imaging.Frame
    arrival: float = field(default_factory=time.monotonic)


def frame(i: int) -> imaging.Frame:
    return imaging.Frame("raw", np.full((4, 4, 3), i, np.uint8), 4, 4)


def result(label: str) -> Classified:
    return Classified(label, 0, 0.9, np.zeros(5, np.float32))


def test_the_tap_hands_off_its_models_answered_frames_and_drops_when_full():
    async def run():
        limits: list[str] = []
        tap = shadow.ShadowTap("m", 12, lambda: limits.append("limit"))
        loop = asyncio.get_running_loop()
        other = [Item(loop.create_future(), frame(0))]
        tap.watch(Served("other"), other, ("P-0",))
        items = [Item(loop.create_future(), frame(i)) for i in range(shadow.QUEUE_FRAMES + 3)]
        tap.watch(Served("m"), items, ("P-1",))
        other[0].future.set_result(Answer("OK", result("ok")))
        items[0].future.set_exception(RuntimeError("failed"))  # no live verdict: not handed
        items[1].future.cancel()
        for it in items[2:]:
            it.future.set_result(Answer("NG", result("scratch")))
        await asyncio.sleep(0)
        assert tap.handed == shadow.QUEUE_FRAMES and tap.dropped == 1
        meta, got = tap.queue.get_nowait()
        assert meta[1:] == (None, "P-1", 2, "1", "NG", "scratch", 0.9)
        assert abs(meta[0] - time.time()) < 5 and got == items[2].payload
        while not tap.queue.empty():  # the sender's part
            tap.queue.get_nowait()
        # room again: handed off up to the limit, which then closes the tap
        more = [Item(loop.create_future(), frame(i)) for i in range(6)]
        tap.watch(Served("m"), more, None)
        for it in more:
            it.future.set_result(Answer("OK", result("ok")))
        await asyncio.sleep(0)
        assert tap.handed == 12 and limits == ["limit"] and tap.closed
    asyncio.run(run())


def test_the_request_body_is_checked():
    assert shadow.parse_request({}) == shadow.ShadowRequest(None, shadow.DEFAULT_MINUTES)
    assert shadow.parse_request({"frames": 5, "minutes": 0.5}) == shadow.ShadowRequest(5, 0.5)
    for body in ({"frames": 0}, {"frames": 1.5}, {"frames": True}, {"minutes": 0},
                 {"minutes": shadow.MAX_MINUTES + 1}, {"minutes": "1"}, {"speed": 1}):
        with pytest.raises(InvalidInput):
            shadow.parse_request(body)


def test_the_report_reads_a_run_back(tmp_path):
    with pytest.raises(NotFound):
        shadow.report(tmp_path, "c-1", "m", None, None)
    req = shadow.ShadowRequest(None, 1.0)
    run = shadow._open_run(tmp_path, 100.0, "qe-anna", 1, req, 160.0)
    with shadow.connect(tmp_path / "shadow.sqlite") as conn:
        shadow._store(conn, [
            (run, 101.0, "r1", "A-1", 0, "1", "OK", "ok", 0.9, "OK", "ok", 0.8, 3.0),
            (run, 102.0, "r2", "A-2", 0, "1", "OK", "ok", 0.9, "NG", "scratch", 0.7, 5.0),
            (run, 103.0, "r3", None, 1, "1", "NG", "spot", 0.6, "NG", "crack", 0.5, 4.0)])
    got = shadow.report(tmp_path, "c-1", "m", None, None)  # no process runs it (a restart)
    assert got["state"] == "stopped" and got["stop_reason"] == "the server stopped while it ran"
    shadow._close_run(tmp_path, run, "stopped by qe-anna", 5, 2)
    got = shadow.report(tmp_path, "c-1", "m", None, None)
    assert got["state"] == "stopped" and got["stop_reason"] == "stopped by qe-anna"
    assert (got["judged"], got["agree"], got["disagree"]) == (3, 1, 2)
    assert (got["handed"], got["dropped"], got["live_ng"], got["candidate_ng"]) == (5, 2, 1, 2)
    assert got["agreement"] == 0.3333 and got["shadow_ms_mean"] == 4.0
    assert [d["request_id"] for d in got["disagreements"]] == ["r3", "r2"]  # newest first
    assert got["disagreements"][1]["candidate"] == {"verdict": "NG", "label": "scratch",
                                                    "score": 0.7}


def test_the_candidate_judges_as_the_comparison_does():
    config = load_model_config(MODEL / "model.toml")
    frames = [imaging.encoded_frame(synthetic.encode(synthetic.generate(look, seed=1)))
              for look in ("ok", "scratch")]
    judging = Judge(config, MODEL / "1")
    try:
        one = [judging(tensor([f], config.input))[0] for f in frames]
        both = judging(tensor(frames, config.input))
    finally:
        judging.close()
    assert one == both
    assert [x["label"] for x in both] == ["ok", "scratch"]
    assert [x["verdict"] for x in both] == ["OK", "NG"]
