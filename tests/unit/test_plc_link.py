"""The link from the engine to the PLC server processes: results as compact tuples, busy edges,
the watchdog's probes, drops counted when a process falls behind; what a PLC server process makes
of those messages; and its metric updates repeated in the serving process."""

from __future__ import annotations

import asyncio
import math
import pickle
import time
from types import SimpleNamespace

import pytest

from visionserve.errors import InternalError
from visionserve.plc import metrics
from visionserve.plc.bus import BusMirror, Reason, ResultBus, ResultCode, ResultEvent, Stations
from visionserve.plc.child import PlcService
from visionserve.plc.service import PlcLink
from visionserve.plc.watchdog import SystemState, Watchdog, _Probe

SERVED = SimpleNamespace(name="tiny", version=3)


def _event(part: str = "1", code: ResultCode = ResultCode.NG, score: float = 0.5) -> ResultEvent:
    now = time.monotonic()
    return ResultEvent(f"r-{part}", 0, part, "cam1", "tiny", "3", 0, code, Reason.NONE, "NG",
                       "dent", 1, score, 0.1, 2.0, 2.5, time.time(), time.time(), now)


class Proc:
    """Stands in for a PLC server process: records what it is sent; ``full`` refuses it."""

    def __init__(self, full: bool = False) -> None:
        self.full = full
        self.sent: list[tuple] = []

    def send(self, msg: tuple) -> bool:
        if self.full:
            return False
        self.sent.append(pickle.loads(pickle.dumps(msg)))  # what the socket would carry
        return True


def _pending(n: int):
    loop = asyncio.get_running_loop()
    return [SimpleNamespace(future=loop.create_future(), arrival=time.monotonic())
            for _ in range(n)]


def test_an_event_crosses_to_the_plc_process_unchanged():
    ev = _event()
    back = ResultEvent.from_wire(pickle.loads(pickle.dumps(ev.wire())))
    assert back == ev and type(back.code) is ResultCode and type(back.reason) is Reason
    failed = ResultEvent("r-2", 0, None, None, "tiny", "3", 1, ResultCode.NO_DECISION,
                         Reason.INTERNAL, "ERROR", "", -1, math.nan, 0, 0, 1.0, 0, 0, 0, "boom")
    back = ResultEvent.from_wire(pickle.loads(pickle.dumps(failed.wire())))
    assert math.isnan(back.score) and (back.part_id, back.message) == (None, "boom")


async def test_results_busy_edges_and_probes_go_to_every_process_and_drops_are_counted():
    bus = ResultBus(Stations("cam1,*"))
    ok, full = Proc(), Proc(full=True)
    PlcLink(bus, [ok, full])
    dropped = metrics.BUS_DROPPED._value.get()
    items = _pending(2)
    bus.watch(SERVED, items, ("7", "cam1"))
    assert ok.sent == [("b", 0, True)]  # station 1 busy: the first frame in flight
    items[0].future.set_exception(InternalError("backend failed"))
    await asyncio.sleep(0)
    assert [m[0] for m in ok.sent] == ["b", "r"]  # not idle yet: no busy edge
    items[1].future.set_exception(InternalError("backend failed"))
    await asyncio.sleep(0)
    assert ok.sent[2] == ("b", 0, False)
    results = [ResultEvent.from_wire(t) for m in ok.sent if m[0] == "r" for t in m[1]]
    assert [(e.part_id, e.index, e.code) for e in results] == [("7", 0, ResultCode.NO_DECISION),
                                                                ("7", 1, ResultCode.NO_DECISION)]
    assert metrics.BUS_DROPPED._value.get() == dropped + 2  # the full one lost both
    assert bus.drain() == []  # nothing left behind in the bus
    link = PlcLink(bus, [ok])
    probe = _Probe(123.0, True, False, True, None, 120.0)
    link.probe(probe)
    assert ok.sent[-1] == ("p", (123.0, True, False, True, None, 120.0), 0, bus.last_progress,
                           bus.busy_since, (False, False))


async def test_the_plc_process_takes_results_busy_and_probes():
    accepted: list = []
    publisher = SimpleNamespace(accept=accepted.extend, protocol="fake")
    mirror = BusMirror(2)
    dog = Watchdog(None, mirror, stall_s=1.0)
    service = PlcService(publisher, mirror, dog, heartbeat_s=0.5)
    ev = _event("42")
    service.on_message(("r", [ev.wire()]))
    assert accepted == [ev]
    service.on_message(("b", 1, True))
    assert mirror.inflight == [0, 1]
    now = time.monotonic()
    probe = (now, True, False, True, None, now)
    service.on_message(("p", probe, 3, now - 5, now - 5, (True, False)))
    assert (mirror.outstanding, mirror.inflight) == (3, [1, 0])
    assert dog.health(now).state is SystemState.OPERATIONAL
    h = dog.health(now + 1.5)  # no probe since: the engine's loop (or its process) is stuck
    assert h.stalled and "event loop" in h.reason
    assert not dog.health(now).stalled  # (and the stall gauge back to 0)
    service.on_message(("stop",))
    assert service.stop.is_set()


def test_metric_updates_made_in_a_plc_process_are_repeated_here():
    ops: list = []
    sink = lambda *op: ops.append(op)
    metrics.Recorder("OVERFLOWS", sink).labels("cam-x").inc()
    metrics.Recorder("BUS_DELAY", sink).labels("modbus").observe(0.0004)
    metrics.Recorder("STALLED", sink).set(1)
    assert ops[0] == ("OVERFLOWS", ("cam-x",), "inc", 1)
    before = metrics.OVERFLOWS.labels("cam-x")._value.get()
    count = metrics.BUS_DELAY.labels("modbus")._sum.get()
    refused = [("RESULTS", (), "clear", 0), ("os", (), "inc", 1)]  # not a method, not a series
    metrics.apply(pickle.loads(pickle.dumps(ops)) + refused)
    assert metrics.OVERFLOWS.labels("cam-x")._value.get() == before + 1
    assert metrics.BUS_DELAY.labels("modbus")._sum.get() == pytest.approx(count + 0.0004)
    assert metrics.STALLED._value.get() == 1
    metrics.STALLED.set(0)
