"""One station's result handshake (Enable, ResultValid, ResultAck, overflow/Fault) and the Modbus
register map over it, without a network."""

from __future__ import annotations

import math

import pytest

from visionserve.plc.bus import Reason, ResultCode, ResultEvent, Stations
from visionserve.plc.handshake import Control, Fault, Handshake, LineStatus, Status

E, ACK, RESET = int(Control.ENABLE), int(Control.RESULT_ACK), int(Control.FAULT_RESET)


def _event(part: str, code: ResultCode = ResultCode.OK, station: int = 0) -> ResultEvent:
    verdict = code is not ResultCode.NO_DECISION
    return ResultEvent(f"r-{part}", station, part, None, "tiny", "2", 0, code,
                       Reason.NONE if verdict else Reason.LATE,
                       {ResultCode.OK: "OK", ResultCode.NG: "NG"}.get(code, "LATE"),
                       "ok" if verdict else "", 0 if verdict else -1, 0.9876 if verdict else math.nan,
                       0.3, 1.2, 12.34, 0.0, 0.0, 0.0)


def _presented(hs: Handshake) -> str | None:
    return hs.current[1].part_id if hs.valid and hs.current else None


def test_nothing_is_buffered_until_the_plc_enables_the_station():
    hs = Handshake(depth=4)
    assert not hs.offer(_event("1"))
    assert not hs.valid and hs.seq == 0
    hs.write_control(E)
    assert hs.offer(_event("2"))
    assert _presented(hs) == "2" and hs.seq == 1


def test_four_edge_handshake_presents_one_result_per_acknowledge():
    hs = Handshake(depth=8)
    hs.write_control(E)
    for p in "123":
        hs.offer(_event(p))
    assert _presented(hs) == "1" and hs.waiting == 2
    assert hs.write_control(E | ACK)  # the PLC acknowledges result 1
    assert not hs.valid  # ResultValid drops...
    assert not hs.write_control(E | ACK)  # (a level held high acknowledges nothing more)
    assert not hs.valid and hs.waiting == 2
    hs.write_control(E)  # ...and only when ResultAck drops is the next one presented
    assert _presented(hs) == "2" and hs.current[0] == 2
    hs.write_control(E | ACK)
    hs.write_control(E)
    assert _presented(hs) == "3"
    hs.write_control(E | ACK)
    hs.write_control(E)
    assert not hs.valid and hs.current[1].part_id == "3"  # the words stay, ResultValid is off


def test_an_ack_without_a_valid_result_does_nothing():
    hs = Handshake(depth=2)
    hs.write_control(E | ACK)
    hs.offer(_event("1"))
    assert not hs.valid  # presented only once ResultAck is low
    hs.write_control(E)
    assert _presented(hs) == "1"


def test_a_plc_that_never_acknowledges_overflows_latches_fault_and_sees_the_gap():
    hs = Handshake(depth=3)
    hs.write_control(E)
    kept = [hs.offer(_event(str(i))) for i in range(1, 6)]
    assert kept == [True, True, True, False, False]  # the presented one counts toward depth
    assert hs.overflow and hs.dropped == 2 and hs.seq == 5
    line = LineStatus(ready=True)
    assert Status.FAULT in hs.status(line, busy=False) and Status.OVERFLOW in hs.status(line, False)
    assert hs.faults(line) == Fault.OVERFLOW
    # catching up does not clear the latch: results were lost
    for _ in range(3):
        hs.write_control(E | ACK)
        hs.write_control(E)
    assert hs.overflow
    assert hs.offer(_event("6")) and hs.current[0] == 6  # ids 4 and 5 were dropped: a gap
    hs.write_control(E | RESET)
    assert not hs.overflow and Status.FAULT not in hs.status(line, False)


def test_dropping_enable_resets_the_station():
    hs = Handshake(depth=1)
    hs.write_control(E)
    hs.offer(_event("1"))
    hs.offer(_event("2"))
    assert hs.overflow
    hs.write_control(0)
    assert not hs.valid and hs.waiting == 0 and not hs.overflow
    hs.write_control(E)
    assert hs.offer(_event("3")) and _presented(hs) == "3"


def test_inspection_ids_wrap_past_65535_to_1_never_0():
    hs = Handshake(depth=1)
    hs.write_control(E)
    hs.seq = 0xFFFE
    ids = []
    for p in "abc":
        hs.offer(_event(p))
        ids.append(hs.current[0])
        hs.write_control(E | ACK)
        hs.write_control(E)
    assert ids == [0xFFFF, 1, 2]


@pytest.mark.parametrize("code,bit", [(ResultCode.OK, Status.PASS), (ResultCode.NG, Status.FAIL),
                                      (ResultCode.NO_DECISION, Status.FAIL)])
def test_pass_only_for_ok_fail_for_ng_and_no_decision(code, bit):
    hs = Handshake(depth=2)
    hs.write_control(E)
    hs.offer(_event("1", code))
    s = hs.status(LineStatus(ready=True, heartbeat=True), busy=True)
    assert bit in s and (Status.PASS | Status.FAIL) & ~bit not in s
    assert Status.READY | Status.BUSY | Status.RESULT_VALID | Status.HEARTBEAT | Status.ENABLED in s


def test_a_stalled_engine_is_fault_on_every_station():
    hs = Handshake(depth=2)
    line = LineStatus(ready=False, fault=Fault.STALLED)
    assert Status.FAULT in hs.status(line, False) and Status.READY not in hs.status(line, False)
    assert hs.faults(line) == Fault.STALLED


# --- the Modbus register map (no server) ------------------------------------------------------

modbus = pytest.importorskip("visionserve.plc.modbus")
ExcCodes = pytest.importorskip("pymodbus.constants").ExcCodes


def _map(stations="cam1,cam2", depth=4):
    from visionserve.plc.bus import ResultBus

    bus = ResultBus(Stations(stations))
    return modbus.ModbusStations(bus.stations, bus, depth), bus


def test_registers_show_the_presented_result():
    m, bus = _map()
    m.line = LineStatus(ready=True, heartbeat=True, heartbeat_count=7)
    assert m.write(2, 6, 0, [E]) is None  # unit 2 = station 2, holding register 0
    m.publish([_event("123456", ResultCode.NG, station=1)])
    bus.inflight[1] = 1
    regs = m.read(2, 4, 0, 16)
    status = Status(regs[0])
    assert Status.READY | Status.BUSY | Status.RESULT_VALID | Status.FAIL | Status.ENABLED | \
        Status.HEARTBEAT == status
    # fault, inspection id, code, reason, label index, score x 1000, latency in 0.1 ms
    assert regs[1:8] == [0, 1, int(ResultCode.NG), 0, 0, 988, 123]
    assert (regs[8] << 16 | regs[9], regs[10]) == (123456, 1)
    assert (regs[13], regs[14], regs[15]) == (7, 0, 2)
    assert m.read(2, 2, 0, 9) == [bool(int(status) >> i & 1) for i in range(9)]  # discrete inputs
    assert m.read(1, 4, 0, 3) == [int(Status.READY | Status.HEARTBEAT), 0, 0]  # station 1: no result


def test_control_bits_by_coil_and_by_register_are_the_same():
    m, _ = _map("*")
    assert m.write(1, 5, 0, [True]) is None  # coil Enable
    assert m.read(1, 3, 0, 1) == [E]
    assert m.write(1, 15, 1, [True, False]) is None  # coils ResultAck, FaultReset
    assert m.read(1, 1, 0, 3) == [True, True, False]
    assert m.read(0, 1, 0, 3) == m.read(255, 1, 0, 3)  # 0 and 255 address station 1 too


def test_the_protocol_refuses_what_is_outside_the_map():
    m, _ = _map("*")
    assert m.write(1, 6, 21, [1]) == ExcCodes.ILLEGAL_ADDRESS  # HR 0-20 are writable
    assert m.write(1, 16, 19, [0, 0, 0]) == ExcCodes.ILLEGAL_ADDRESS
    assert m.write(1, 6, 0, [0x8001]) == ExcCodes.ILLEGAL_VALUE  # no such control bit
    assert m.write(1, 5, 3, [True]) == ExcCodes.ILLEGAL_ADDRESS
    assert m.read(1, 4, 10, 9) == ExcCodes.ILLEGAL_ADDRESS  # input registers 0-17
    assert m.read(1, 3, 0, 22) == ExcCodes.ILLEGAL_ADDRESS  # holding registers 0-20
    assert m.read(1, 2, 0, 10) == ExcCodes.ILLEGAL_ADDRESS
    assert m.read(7, 4, 0, 1) == ExcCodes.GATEWAY_PATH_UNAVIABLE
    assert m.handshakes[0].control == 0  # nothing refused changed anything


def test_results_offered_while_the_plc_side_holds_the_lock_wait_in_order():
    """The engine's loop never waits for the PLC servers' thread: a result that finds the lock
    taken is queued, and taken in, in order, before the next read."""
    m, _ = _map("*", depth=8)
    m.write(1, 6, 0, [E])
    m.offer(_event("1"))  # lock free: straight into the station
    assert m.handshakes[0].current[1].part_id == "1"
    with m._lock:  # the PLC side is busy
        m.offer(_event("2"))
        m.offer(_event("3"))
        assert [e.part_id for e in m._pending] == ["2", "3"]
    m.offer(_event("4"))  # the lock is free, but "2" and "3" wait: "4" goes behind them
    assert [e.part_id for e in m._pending] == []  # taken in, in order, by the offer itself
    assert [p for _, p in ((s, e.part_id) for s, e in m.handshakes[0].buffer)] == ["2", "3", "4"]
    with m._lock:
        m.offer(_event("5"))
    regs = m.read(1, 4, 0, 16)  # the read takes "5" in first
    assert regs[11] == 4  # waiting behind the presented one: 2, 3, 4, 5


# --- triggers: holding registers 1-20, input registers 16-17 -----------------------------------

@pytest.mark.parametrize("part_id", [None, 0, 1234, 2**32 - 1, "A", "LOT-7/a b", "x" * 32])
def test_part_id_registers_round_trip(part_id):
    words = modbus.part_id_words(part_id)
    assert len(words) == 19 and all(0 <= w <= 0xFFFF for w in words)
    assert modbus.part_id_of(words) == (None if part_id is None else str(part_id))


def test_part_id_text_is_high_byte_first_and_ends_at_the_first_nul():
    words = modbus.part_id_words("AB-C")
    assert words[:6] == [2, 0, 0, 0x4142, 0x2D43, 0]
    words[4] = 0x2D00  # "-" then NUL: the rest is ignored
    words[5] = 0x5858
    assert modbus.part_id_of(words) == "AB-"
    assert modbus.part_id_words(70000)[:3] == [1, 1, 70000 - 65536]


@pytest.mark.parametrize("part_id", [-1, 2**32, "", "x" * 33, "é", "tab\there"])
def test_a_part_id_the_registers_cannot_carry_is_refused(part_id):
    with pytest.raises(ValueError):
        modbus.part_id_words(part_id)


@pytest.mark.parametrize("words", [[3] + [0] * 18, [2] + [0] * 18, [2, 0, 0, 0xC3A9] + [0] * 15,
                                   [2, 0, 0, 0x4101] + [0] * 15])
def test_bad_part_id_registers(words):
    with pytest.raises(ValueError):
        modbus.part_id_of(words)


def test_a_trigger_is_a_new_value_of_holding_register_1_taken_after_the_whole_write():
    m, _ = _map("cam1,st1")
    calls = []
    m.on_trigger = lambda *call: calls.append(call)
    assert m.write(2, 16, 1, [7, *modbus.part_id_words("P-1")]) is None  # FC16, HR 1-20
    assert calls == [(1, 1, 7, "P-1")]
    assert m.write(2, 16, 1, [7, *modbus.part_id_words("P-2")]) is None  # a retry: no trigger
    assert m.write(2, 6, 1, [0]) is None  # 0 never triggers
    assert len(calls) == 1
    assert m.write(2, 16, 2, modbus.part_id_words(42)) is None  # HR 2-20, then HR 1
    assert m.write(2, 6, 1, [8]) is None
    assert calls[-1] == (1, 2, 8, "42")
    assert m.read(2, 3, 0, 21) == [0, 8, *modbus.part_id_words(42)]  # as written
    assert m.write(2, 16, 0, [E, 9, 0]) is None  # with the control word: both
    assert calls[-1] == (1, 3, 9, None) and m.handshakes[1].control == E
    assert m.read(2, 4, 16, 2) == [0, 0]  # not answered yet: the previous value
    m.answered(1, 3, 9, modbus.Refusal.TAKEN)
    m.answered(1, 2, 8, modbus.Refusal.NO_CAMERA)  # an older answer, late: ignored
    assert m.read(2, 4, 16, 2) == [9, 0]
    # a bad part id is refused at once, as is any trigger when nobody takes them
    assert m.write(2, 16, 1, [10, 3]) is None
    assert m.read(2, 4, 16, 2) == [10, int(modbus.Refusal.BAD_PART_ID)]
    m.on_trigger = None
    assert m.write(2, 16, 1, [11, 0]) is None
    assert m.read(2, 4, 16, 2) == [11, int(modbus.Refusal.UNAVAILABLE)]
    assert m.write(2, 16, 0, [0x8000, 12]) == ExcCodes.ILLEGAL_VALUE  # nothing of it applied
    assert m.read(2, 3, 1, 1) == [11]
