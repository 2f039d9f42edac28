"""The PLC result bus: every frame's final answer once, fail-safe codes, bounded, never blocking;
and the watchdog's judgement of engine progress."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest

from visionserve.config import ModelConfig
from visionserve.errors import (
    ConfigError,
    DeadlineExceeded,
    InternalError,
    InvalidInput,
    Unavailable,
)
from visionserve.execution.results import FrameResult
from visionserve.plc import metrics
from visionserve.plc.bus import Reason, ResultBus, ResultCode, Stations, part_number
from visionserve.plc.watchdog import SystemState, Watchdog
from visionserve.tasks.classification import Classification, Classified

LABELS = ("ok", "dent", "scratch")
TASK = Classification(ModelConfig.model_validate({"input": {"width": 8, "height": 8},
                                                  "output": {"labels": LABELS}}))
SERVED = SimpleNamespace(name="tiny", version=3, task=TASK)


def _result(verdict="NG", label="dent", score=0.91, deadline_met=True) -> FrameResult:
    return FrameResult(verdict, Classified(label, LABELS.index(label), score, np.zeros(3)), 1, 0.5,
                       2.0, 2.6, deadline_met)


def _pending(n: int, arrival: float = 0.0):
    loop = asyncio.get_running_loop()
    return [SimpleNamespace(future=loop.create_future(), arrival=arrival) for _ in range(n)]


class Woken:
    """Stands in for the PLC thread's loop: counts the wake-ups the bus asks for."""

    def __init__(self, bus: ResultBus) -> None:
        self.count = 0
        bus._wake = self.wake

    def wake(self) -> None:
        self.count += 1


async def test_verdicts_and_every_kind_of_failure_are_published_with_their_codes():
    bus = ResultBus(Stations("*"))
    items = _pending(6)
    bus.watch(SERVED, items, ("A-1", "cam1"))
    assert bus.outstanding == 6 and bus.inflight == [6]
    items[0].future.set_result(_result("OK", "ok", 0.97))
    items[1].future.set_result(_result("NG", "scratch", 0.8))
    items[2].future.set_result(_result("NG", "dent", 0.7, deadline_met=False))  # computed, too late
    items[3].future.set_exception(DeadlineExceeded("late in the queue"))
    items[4].future.set_exception(InternalError("backend failed"))
    items[5].future.cancel()  # the client hung up
    await asyncio.sleep(0)  # done callbacks run on the loop
    events = bus.drain()
    assert [e.code for e in events] == [ResultCode.OK, ResultCode.NG] + [ResultCode.NO_DECISION] * 4
    assert [e.reason for e in events] == [Reason.NONE, Reason.NONE, Reason.LATE, Reason.LATE,
                                          Reason.INTERNAL, Reason.CANCELLED]
    assert [e.verdict for e in events] == ["OK", "NG", "LATE", "LATE", "ERROR", "ERROR"]
    ok, ng = events[0], events[1]
    assert (ok.part_id, ok.camera_id, ok.model, ok.version, ok.index) == ("A-1", "cam1", "tiny", "3", 0)
    assert (ng.label, ng.label_index, ng.score, ng.index) == ("scratch", 2, 0.8, 1)
    assert all(e.label_index == -1 and math.isnan(e.score) for e in events[3:])
    assert len({e.result_id for e in events}) == 6
    assert bus.outstanding == 0 and bus.inflight == [0]


async def test_frames_refused_at_admission_are_no_decision_for_the_plc():
    bus = ResultBus(Stations("*"))
    bus.refused(SERVED, 2, ("P-9", None), Unavailable("queue full", retry_after_s=1.0))
    bus.refused(SERVED, 1, None, InvalidInput("bad image"))
    events = bus.drain()
    assert [(e.part_id, e.code, e.reason, e.index) for e in events] == [
        ("P-9", ResultCode.NO_DECISION, Reason.UNAVAILABLE, 0),
        ("P-9", ResultCode.NO_DECISION, Reason.UNAVAILABLE, 1),
        (None, ResultCode.NO_DECISION, Reason.INVALID_INPUT, 0)]
    assert events[0].message == "queue full"
    assert bus.outstanding == 0  # never admitted


async def test_camera_ids_route_to_stations_and_unlisted_ones_are_counted():
    bus = ResultBus(Stations("cam1,cam2"))
    unrouted = metrics.UNROUTED._value.get()
    a, b, c = _pending(1), _pending(1), _pending(1)
    bus.watch(SERVED, a, ("1", "cam2"))
    bus.watch(SERVED, b, ("2", "cam1"))
    bus.watch(SERVED, c, ("3", "cam9"))  # no station takes it
    assert bus.inflight == [1, 1] and bus.outstanding == 3
    for p in a + b + c:
        p.future.set_result(_result())
    await asyncio.sleep(0)
    assert [(e.part_id, e.station) for e in bus.drain()] == [("1", 1), ("2", 0)]
    assert metrics.UNROUTED._value.get() == unrouted + 1
    assert bus.outstanding == 0


def test_station_specs():
    s = Stations("cam1, cam2 ,*")
    assert s.names == ("cam1", "cam2", "*")
    assert (s.route("cam2"), s.route("other"), s.route(None)) == (1, 2, 2)
    assert Stations("cam1").route(None) is None
    for bad in ("", "a,,b", "a,a", ",".join(str(i) for i in range(248))):
        with pytest.raises(ConfigError):
            Stations(bad)


async def test_a_full_bus_drops_and_counts_and_wakes_once_per_drain():
    bus = ResultBus(Stations("*"), capacity=3)
    woken = Woken(bus)
    dropped = metrics.BUS_DROPPED._value.get()
    items = _pending(5)
    bus.watch(SERVED, items, ("x", None))
    for p in items:
        p.future.set_result(_result())
    await asyncio.sleep(0)
    assert woken.count == 1  # the PLC thread is woken once, not once per result
    assert len(bus.drain()) == 3
    assert metrics.BUS_DROPPED._value.get() == dropped + 2
    more = _pending(1)
    bus.watch(SERVED, more, ("y", None))
    more[0].future.set_result(_result())
    await asyncio.sleep(0)
    assert woken.count == 2 and [e.part_id for e in bus.drain()] == ["y"]


def test_a_closed_plc_loop_does_not_break_publishing():
    bus = ResultBus(Stations("*"))

    def closed():
        raise RuntimeError("Event loop is closed")

    bus._wake = closed
    bus.refused(SERVED, 2, None, Unavailable("draining"))
    assert len(bus.drain()) == 2 and bus._wake is None


def test_part_ids_as_modbus_numbers():
    assert part_number(None) == (0, 0)
    assert part_number("4242") == (4242, 1)
    assert part_number("4294967295") == (2**32 - 1, 1)
    big, kind = part_number("4294967296")  # past 32 bits: hashed
    assert kind == 2 and big < 2**32
    assert part_number("A-0042")[1] == 2
    assert part_number("A-0042") == part_number("A-0042")
    assert part_number("٣")[1] == 2  # a digit, but not an ASCII one


# --- watchdog --------------------------------------------------------------------------------


def _engine(ready=False, draining=False, startup_error=None):
    served = {("tiny", 1): SimpleNamespace(stats=SimpleNamespace(execution_count=0))}
    return SimpleNamespace(ready=ready, draining=draining, startup_error=startup_error, served=served)


async def _watched(engine, stall_s=2.0):
    bus = ResultBus(Stations("*"))
    dog = Watchdog(engine, bus, stall_s=stall_s, period_s=60)
    dog.start()  # one probe now; the next would be a minute away
    dog.stop()
    return bus, dog


async def test_health_follows_readiness_and_draining():
    engine = _engine()
    _, dog = await _watched(engine)
    now = dog._probe.at
    assert dog.health(now).state is SystemState.PREOPERATIONAL
    engine.ready = True
    dog._tick(), dog.stop()
    assert dog.health(now).state is SystemState.OPERATIONAL and dog.health(now).ready
    engine.draining, engine.ready = True, False
    dog._tick(), dog.stop()
    assert dog.health(now).state is SystemState.HALTED and not dog.health(now).ready
    engine.draining = False
    dog._tick(), dog.stop()
    h = dog.health(now)  # was ready, is not, not draining: a device or model fault
    assert h.state is SystemState.ERROR and not h.stalled
    engine.startup_error = "model failed to load"
    dog._tick(), dog.stop()
    assert "model failed to load" in dog.health(now).reason


async def test_waiting_frames_with_none_computed_is_a_stall_late_answers_are_not_progress():
    engine = _engine(ready=True)
    bus, dog = await _watched(engine, stall_s=2.0)
    t0 = dog._probe.at
    items = _pending(2)
    bus.watch(SERVED, items, None)
    bus.busy_since = bus.last_progress = t0
    assert not dog.health(t0 + 1.0).stalled
    items[0].future.set_exception(DeadlineExceeded("late"))  # the batcher answers late...
    await asyncio.sleep(0)
    bus.busy_since = bus.last_progress = t0  # (the clock of this test, not the loop's)
    dog._probe = dog._probe.__class__(t0 + 2.5, True, False, True, None, t0)  # the loop runs fine
    h = dog.health(t0 + 2.5)  # ...but nothing was computed for 2.5 s
    assert h.stalled and h.state is SystemState.ERROR and "none computed" in h.reason
    assert metrics.STALLED._value.get() == 1
    # a batch executed (its frames answered LATE, computed after their deadline) is progress
    engine.served["tiny", 1].stats.execution_count += 1
    dog._tick(), dog.stop()
    assert not dog.health(dog._probe.at + 1.0).stalled
    assert dog.health(dog._probe.at + 2.5).stalled  # (the probe saw it at its own time)
    items[1].future.set_result(_result())
    await asyncio.sleep(0)
    assert bus.outstanding == 0
    assert not dog.health(dog._probe.at + 0.5).stalled
    assert metrics.STALLED._value.get() == 0


async def test_an_idle_engine_is_not_stalled_but_a_silent_event_loop_is():
    engine = _engine(ready=False)
    bus, dog = await _watched(engine, stall_s=2.0)
    t0 = dog._probe.at
    assert not dog.health(t0 + 5).stalled  # starting: imports and warm-up may hold the loop
    engine.ready = True
    dog._tick(), dog.stop()
    t0 = dog._probe.at
    bus.last_progress = t0 - 3600  # nothing to do for an hour
    assert not dog.health(t0 + 1.9).stalled
    h = dog.health(t0 + 2.1)  # the probe on the engine's loop has not run since t0
    assert h.stalled and "event loop" in h.reason


async def test_a_station_part_is_one_result_on_the_station_of_its_name():
    """A camera's frame of a station's part is only counted (Busy on the part's station); the
    part's combined answer is the one result, on the PLC station named like the station."""
    from visionserve.dataplane import Origin, PartResult

    bus = ResultBus(Stations("cam-a,st1,*"))
    items = _pending(2)
    for item, camera in zip(items, ("cam-a", "cam-b")):
        bus.watch(SERVED, [item], Origin("P-1", camera, "st1", "parts", part_frame=True))
    assert bus.inflight == [0, 2, 0] and bus.outstanding == 2
    bus.refused(SERVED, 1, Origin("P-1", "cam-c", "st1", "parts", part_frame=True),
                Unavailable("camera cam-c is down"))
    items[0].future.set_result(_result("OK", "ok", 0.97))
    items[1].future.set_result(_result("NG", "dent", 0.8))
    await asyncio.sleep(0)
    assert bus.drain() == [] and bus.outstanding == 0 and bus.inflight == [0, 0, 0]
    part = PartResult("st1", "P-1", ("cam-a", "cam-b"), "tiny", "3", "NG", 200, "dent", 1, 0.8,
                      0.5, 2.0, asked=0.0)
    bus.publish_part(part)
    fault = PartResult("st1", "P-2", ("cam-a", "cam-b"), "tiny", "3", "ERROR", 503, "", -1,
                       math.nan, 0.0, 0.0, asked=0.0, message="camera cam-b: timeout")
    bus.publish_part(fault)
    ng, none = bus.drain()
    assert (ng.station, ng.part_id, ng.camera_id, ng.code, ng.label_index) == \
        (1, "P-1", "cam-a,cam-b", ResultCode.NG, 1)
    assert (none.part_id, none.code, none.reason, none.message) == \
        ("P-2", ResultCode.NO_DECISION, Reason.UNAVAILABLE, "camera cam-b: timeout")
    # a camera's own trigger: its frame is its result, on its own station, as before
    item = _pending(1)
    bus.watch(SERVED, item, Origin("P-3", "cam-a"))
    item[0].future.set_result(_result("OK", "ok", 0.97))
    await asyncio.sleep(0)
    (own,) = bus.drain()
    assert (own.station, own.part_id) == (0, "P-3")
