"""Modbus TCP server (pymodbus, pinned): one station per unit id, the register map of docs/plc.md.

Unit id N (1..stations) is station N; 0 and 255, what many clients send to a TCP device, are
station 1. Addresses are protocol addresses (0-based; a PLC manual's 40001 is holding register 0).

==================  =====  ==========================================================
table               addr   meaning
==================  =====  ==========================================================
coils (rw)          0-2    Enable, ResultAck, FaultReset (= holding register 0, bits 0-2)
holding reg. (rw)   0      control word: the same three bits
holding reg. (rw)   1      trigger: each change to a new value other than 0 triggers
holding reg. (rw)   2      part id kind: 0 none (the server names the part), 1 number,
                           2 text
holding reg. (rw)   3-4    part id number, uint32, high word first
holding reg. (rw)   5-20   part id text, up to 32 ASCII bytes, high byte first,
                           NUL-padded
discrete inp. (ro)  0-8    Ready, Busy, ResultValid, Pass, Fail, Fault, Heartbeat,
                           Enabled, Overflow (= input register 0, bits 0-8)
input reg. (ro)     0-17   see :data:`INPUT_REGISTERS`
==================  =====  ==========================================================

A trigger (holding register 1) is taken after the whole write that changed it is applied (one
FC16 write of registers 1-20, or 2-20 and then 1), with the part id of registers 2-20; the
serving process grabs from the station's cameras (a camera named like the station, else each
camera of the recipes file's station of that name) and the verdict comes as the station's next
result, with that part id. Input register 16 shows the trigger value the server answered last,
register 17 whether it took it (0) or why not (:class:`Refusal`). The request that wrote the
trigger is answered at once; the server's answer follows in the registers.

Anything else is answered with the protocol's own exception: ILLEGAL DATA ADDRESS (02) for an
address outside the map (so for a write to a status register), ILLEGAL DATA VALUE (03) for
control bits that do not exist, GATEWAY PATH UNAVAILABLE (0A) for an unknown unit id, and
pymodbus answers ILLEGAL FUNCTION (01) for function codes it does not know.

The datastore is a :class:`pymodbus.datastore.ModbusServerContext` subclass that computes every
read from the stations' handshakes, so a read always shows one consistent result.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from enum import IntEnum
from typing import cast

from pymodbus.constants import ExcCodes
from pymodbus.datastore import ModbusServerContext
from pymodbus.server import ModbusTcpServer
from pymodbus.server.requesthandler import ServerRequestHandler

from ..errors import VisionServeError
from . import metrics, slots
from .bus import BusMirror, ResultBus, ResultCode, ResultEvent, Stations, part_number
from .handshake import CONTROL_BITS, STATUS_BITS, Control, Handshake, LineStatus

log = logging.getLogger(__name__)

#: input registers, in order (one 16-bit word each)
INPUT_REGISTERS = (
    "status",  # 0: the status bits
    "fault",  # 1: why Fault: 1 overflow, 2 engine stalled, 4 engine/model fault
    "inspection_id",  # 2: 1..65535 per result of the station (wraps to 1); 0 before the first
    "result_code",  # 3: 0 none, 1 OK, 2 NG, 3 no decision (reject)
    "reason",  # 4: for no decision: 1 late, 2 unavailable, 3 invalid input, 4 internal, 5 cancelled
    "label_index",  # 5: index into the model's labels; 65535 without a verdict
    "score",  # 6: score x 1000 (0..1000)
    "latency",  # 7: arrival to final answer, in 0.1 ms (65535 = 6.5535 s or more)
    "part_id_high",  # 8: part id as a 32-bit number, high word
    "part_id_low",  # 9: ... low word
    "part_id_kind",  # 10: 0 none, 1 the decimal part id itself, 2 CRC-32 of its UTF-8 text
    "waiting",  # 11: results buffered behind the presented one
    "dropped",  # 12: results dropped on overflow since start (saturates at 65535)
    "heartbeat_count",  # 13: counts heartbeat toggles (wraps); stops with the heartbeat
    "frame_index",  # 14: the frame's place in its request (OIP batches), 0 for inspect
    "model_version",  # 15: the model version that answered (0 without)
    "trigger_ack",  # 16: the trigger value (holding register 1) the server answered last
    "trigger_refusal",  # 17: 0 that trigger was taken, else why not (Refusal)
)
_IR = {name: i for i, name in enumerate(INPUT_REGISTERS)}

#: holding registers: the control word, the trigger, the part id (kind, number, text)
HR_CONTROL, HR_TRIGGER, HR_PART_KIND, HR_PART_NUMBER, HR_PART_TEXT = 0, 1, 2, 3, 5
PART_TEXT_BYTES = 32
HOLDING_REGISTERS = HR_PART_TEXT + PART_TEXT_BYTES // 2
#: holding register 2
PART_NONE, PART_NUMBER, PART_TEXT = 0, 1, 2


class Refusal(IntEnum):
    """Why a trigger was not taken (input register 17)."""

    TAKEN = 0
    NO_CAMERA = 1  #: the station names no camera and no station with cameras
    NOT_TRIGGERABLE = 2  #: a free-running or hardware-triggered camera, a station without recipe
    UNAVAILABLE = 3  #: the serving process did not answer
    BAD_PART_ID = 4  #: part id kind not 0-2, text empty or not printable ASCII


#: the serving process's refusal (its error's kind) as the PLC sees it
_REFUSAL_OF_KIND = {"not_found": Refusal.NO_CAMERA, "conflict": Refusal.NOT_TRIGGERABLE,
                    "invalid_input": Refusal.BAD_PART_ID}


def part_id_of(words: Sequence[int]) -> str | None:
    """The part id in holding registers 2-20 (``words[0]`` is register 2): None for kind 0 (the
    server names the part), the decimal number for kind 1, the text for kind 2. ValueError for
    another kind, or a text that is empty or not printable ASCII."""
    kind = words[0]
    if kind == PART_NONE:
        return None
    if kind == PART_NUMBER:
        return str(words[1] << 16 | words[2])
    if kind != PART_TEXT:
        raise ValueError(f"part id kind {kind}: 0 none, 1 number, 2 text")
    raw = b"".join(w.to_bytes(2, "big") for w in words[HR_PART_TEXT - HR_PART_KIND:])
    text = raw.split(b"\0", 1)[0]
    if not text or any(not 0x20 <= b < 0x7F for b in text):
        raise ValueError("the part id text is empty or not printable ASCII")
    return text.decode("ascii")


def part_id_words(part_id: str | int | None) -> list[int]:
    """Holding registers 2-20 for a part id: None (the server names it), a number (uint32) or a
    text of up to 32 printable ASCII characters (ValueError otherwise)."""
    words = [0] * (HOLDING_REGISTERS - HR_PART_KIND)
    if part_id is None:
        return words
    if isinstance(part_id, int):
        if not 0 <= part_id < 2**32:
            raise ValueError(f"part id {part_id}: a number is 0 to 4294967295")
        words[:3] = [PART_NUMBER, part_id >> 16, part_id & 0xFFFF]
        return words
    raw = part_id.encode("utf-8")
    if not 0 < len(raw) <= PART_TEXT_BYTES or any(not 0x20 <= b < 0x7F for b in raw):
        raise ValueError(f"part id {part_id!r}: 1 to {PART_TEXT_BYTES} printable ASCII "
                         "characters")
    raw = raw.ljust(PART_TEXT_BYTES, b"\0")
    words[0] = PART_TEXT
    words[HR_PART_TEXT - HR_PART_KIND:] = [int.from_bytes(raw[i:i + 2], "big")
                                           for i in range(0, PART_TEXT_BYTES, 2)]
    return words

_TABLE = {1: "coils", 5: "coils", 15: "coils", 2: "inputs", 3: "holding", 6: "holding",
          16: "holding", 22: "holding", 23: "holding", 4: "registers"}
#: function codes pymodbus answers for us; others are counted as malformed (and refused by it)
_KNOWN_FC = frozenset((*_TABLE, 7, 8, 11, 12, 17, 20, 21, 24, 43))


def result_words(seq: int, ev: ResultEvent) -> list[int]:
    """Input registers 2..10 and 14..15 for one result."""
    part, kind = part_number(ev.part_id)
    verdict = ev.code is not ResultCode.NO_DECISION
    return [seq, int(ev.code), int(ev.reason), ev.label_index if ev.label_index >= 0 else 0xFFFF,
            max(0, min(1000, round(ev.score * 1000)))
            if verdict and not math.isnan(ev.score) else 0,
            min(0xFFFF, round(ev.total_ms * 10)), part >> 16, part & 0xFFFF, kind]


#: trigger(PLC station, part id or None, caller): the serving process's answer, or its refusal
Trigger = Callable[[str, str | None, dict], Awaitable[dict]]


class ModbusStations:
    """The stations' handshakes and the register map over them.

    ``bus``: what the server knows of the engine's result bus (its ``inflight`` per station
    makes Busy): in the PLC server process, a :class:`~visionserve.plc.bus.BusMirror`.

    Results come in through :meth:`offer` the moment they arrive from the serving process, and
    reads and writes come from the PLC's requests. The two share a lock that the result side
    only ever *tries*: when another thread holds it, the result waits in a queue taken in, in
    order, before the next read or write. (In the PLC server process both run on its one event
    loop, so the lock is always free; the map stays safe to feed from another thread.)
    """

    def __init__(self, stations: Stations, bus: ResultBus | BusMirror, depth: int,
                 on_trigger: Callable[[int, int, int, str | None], None] | None = None) -> None:
        self.stations = stations
        self.bus = bus
        self.handshakes = [Handshake(depth) for _ in stations.names]
        #: holding registers 1-20 of each station as written (register 0 is the handshake's)
        self.holding = [[0] * HOLDING_REGISTERS for _ in stations.names]
        #: input registers 16 and 17 of each station, and the trigger they answer (its number)
        self.trigger_ack = [0] * len(stations)
        self.trigger_refusal = [Refusal.TAKEN] * len(stations)
        self._triggers = [0] * len(stations)  # triggers taken from the registers
        self._answered = [0] * len(stations)  # the last of them answered in 16, 17
        #: (station index, trigger number, its value, part id) for each trigger: hands it to the
        #: serving process, and says :meth:`answered` when it answers; None: refused
        #: (unavailable)
        self.on_trigger = on_trigger
        self.line = LineStatus()
        self._overflows = [metrics.OVERFLOWS.labels(n) for n in stations.names]
        self._acks = [metrics.LAST_ACK.labels(n) for n in stations.names]
        self._delay = metrics.BUS_DELAY.labels("modbus")
        self._lock = threading.Lock()
        self._pending: deque[ResultEvent] = deque()

    def offer(self, ev: ResultEvent) -> None:
        """A result; never waits."""
        if not self._lock.acquire(blocking=False):
            self._pending.append(ev)  # taken in before the PLC side's next read or write
            return
        try:
            self._catch_up()  # (only this side adds to the queue: the order stays)
            self._take(ev)
        finally:
            self._lock.release()

    def publish(self, events: list[ResultEvent]) -> None:
        for ev in events:
            self.offer(ev)

    def _catch_up(self) -> None:
        """Under the lock: what waited while the other side held it."""
        pending = self._pending
        while pending:
            self._take(pending.popleft())

    def _take(self, ev: ResultEvent) -> None:
        hs = self.handshakes[ev.station]
        before = hs.dropped
        hs.offer(ev)
        self._delay.observe(time.monotonic() - ev.final_mono)
        if hs.dropped != before:
            self._overflows[ev.station].inc()
            if hs.dropped == 1 or hs.dropped % 1000 == 0:
                log.warning("Modbus station %d (%s): the PLC has not acknowledged %d results; "
                            "result %s (part %s) dropped, Fault raised (%d dropped so far)",
                            ev.station + 1, self.stations.names[ev.station], hs.depth,
                            ev.result_id, ev.part_id, hs.dropped)

    def _target(self, unit: int, fc: int) -> tuple[int, Handshake, str | None] | ExcCodes:
        """(station index, its handshake, the table ``fc`` reads or writes), or the exception."""
        if unit in (0, 255):
            unit = 1
        if not 1 <= unit <= len(self.handshakes):
            return ExcCodes.GATEWAY_PATH_UNAVIABLE
        return unit - 1, self.handshakes[unit - 1], _TABLE.get(fc)

    def input_registers(self, station: int, hs: Handshake) -> list[int]:
        line = self.line
        words = [0] * len(INPUT_REGISTERS)
        words[_IR["status"]] = int(hs.status(line, self.bus.inflight[station] > 0))
        words[_IR["fault"]] = int(hs.faults(line))
        if hs.current is not None:
            seq, ev = hs.current
            words[2:11] = result_words(seq, ev)
            words[_IR["frame_index"]] = min(ev.index, 0xFFFF)
            words[_IR["model_version"]] = int(ev.version) if ev.version.isdigit() else 0
        words[_IR["waiting"]] = min(hs.waiting, 0xFFFF)
        words[_IR["dropped"]] = min(hs.dropped, 0xFFFF)
        words[_IR["heartbeat_count"]] = line.heartbeat_count & 0xFFFF
        words[_IR["trigger_ack"]] = self.trigger_ack[station]
        words[_IR["trigger_refusal"]] = int(self.trigger_refusal[station])
        return words

    def answered(self, station: int, number: int, value: int, refusal: Refusal) -> None:
        """The server's answer to trigger ``number`` of ``station`` (its register value
        ``value``): into input registers 16 and 17, unless a later trigger was answered already."""
        with self._lock:
            if number > self._answered[station]:
                self._answered[station] = number
                self.trigger_ack[station], self.trigger_refusal[station] = value, refusal

    def _trigger(self, station: int, value: int) -> None:
        """(under the lock) the PLC wrote a new trigger value: refused here for a bad part id
        or when nobody takes triggers, else handed on."""
        self._triggers[station] += 1
        number = self._triggers[station]
        try:
            part_id = part_id_of(self.holding[station][HR_PART_KIND:])
        except ValueError as exc:
            log.info("Modbus station %d: trigger %d refused: %s", station + 1, value, exc)
            refusal = Refusal.BAD_PART_ID
        else:
            if self.on_trigger is not None:
                self.on_trigger(station, number, value, part_id)
                return
            refusal = Refusal.UNAVAILABLE
        self._answered[station] = number
        self.trigger_ack[station], self.trigger_refusal[station] = value, refusal

    def read(self, unit: int, fc: int, address: int, count: int) -> list | ExcCodes:
        with self._lock:
            self._catch_up()
            return self._read(unit, fc, address, count)

    def write(self, unit: int, fc: int, address: int, values: list) -> ExcCodes | None:
        with self._lock:
            self._catch_up()
            return self._write(unit, fc, address, values)

    def _read(self, unit: int, fc: int, address: int, count: int) -> list | ExcCodes:
        target = self._target(unit, fc)
        if isinstance(target, ExcCodes):
            return target
        station, hs, table = target
        if table == "registers":
            values: list = self.input_registers(station, hs)
        elif table == "inputs":
            word = int(hs.status(self.line, self.bus.inflight[station] > 0))
            values = [bool(word >> i & 1) for i in range(STATUS_BITS)]
        elif table == "coils":
            values = [bool(int(hs.control) >> i & 1) for i in range(CONTROL_BITS)]
        elif table == "holding":
            values = [int(hs.control), *self.holding[station][1:]]
        else:
            return ExcCodes.ILLEGAL_FUNCTION
        if address < 0 or count < 1 or address + count > len(values):
            return ExcCodes.ILLEGAL_ADDRESS
        return values[address:address + count]

    def _write(self, unit: int, fc: int, address: int, values: list) -> ExcCodes | None:
        target = self._target(unit, fc)
        if isinstance(target, ExcCodes):
            return target
        index, hs, table = target
        if table == "coils":
            if address < 0 or address + len(values) > CONTROL_BITS:
                return ExcCodes.ILLEGAL_ADDRESS
            word = int(hs.control)
            for i, v in enumerate(values, start=address):
                word = word | (1 << i) if v else word & ~(1 << i)
        elif table == "holding":
            if address < 0 or not values or address + len(values) > HOLDING_REGISTERS:
                return ExcCodes.ILLEGAL_ADDRESS
            if address > HR_CONTROL:
                self._write_trigger(index, address, values)
                return None
            word = int(values[0])
            if word & ~int(Control.ENABLE | Control.RESULT_ACK | Control.FAULT_RESET):
                return ExcCodes.ILLEGAL_VALUE
            if len(values) > 1:
                self._write_trigger(index, 1, values[1:])
        else:
            return ExcCodes.ILLEGAL_ADDRESS  # input registers and discrete inputs are read-only
        if hs.write_control(word):  # once per part: the serving process hears of it
            self._acks[index].set(time.time())
        return None

    def _write_trigger(self, station: int, address: int, values: list) -> None:
        """Holding registers from ``address`` (1-20) written: all of them kept, then a new
        trigger value taken."""
        regs = self.holding[station]
        before = regs[HR_TRIGGER]
        regs[address:address + len(values)] = [int(v) & 0xFFFF for v in values]
        if regs[HR_TRIGGER] not in (0, before):
            self._trigger(station, regs[HR_TRIGGER])


class _Context(ModbusServerContext):
    """pymodbus's datastore interface over :class:`ModbusStations` (its ``old_simulator`` path:
    the server calls these two coroutines for every request and sends what they return)."""

    def __init__(self, stations: ModbusStations) -> None:  # no super(): it wants register blocks
        self.old_simulator = True
        self.simdevices = []
        self.stations = stations

    def device_ids(self) -> list[int]:
        return list(range(1, len(self.stations.handshakes) + 1))

    async def async_getValues(self, device_id, func_code, address, count=1):
        try:
            return self.stations.read(device_id, func_code, address, count)
        except Exception:
            log.exception("Modbus read failed (unit %d, function %d)", device_id, func_code)
            return ExcCodes.DEVICE_FAILURE

    async def async_setValues(self, device_id, func_code, address, values):
        try:
            return self.stations.write(device_id, func_code, address, list(values))
        except Exception:
            log.exception("Modbus write failed (unit %d, function %d)", device_id, func_code)
            return ExcCodes.DEVICE_FAILURE


class _Handler(ServerRequestHandler):
    """One client connection: enforces the client limit (:mod:`.slots`) and says once per client
    what went wrong (pymodbus itself would log every bad frame)."""

    def __init__(self, owner: _Server) -> None:
        super().__init__(owner, owner.trace_packet, owner.trace_pdu, owner.trace_connect)
        self.owner = owner
        self.peer = "?"
        self.malformed = 0
        self.refused = False
        self.connected_at = time.monotonic()
        self.heard_at: float | None = None

    def callback_connected(self) -> None:
        super().callback_connected()
        peer = self.transport.get_extra_info("peername") if self.transport else None
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        if len(self.owner.active_connections) > self.owner.max_clients:
            others = [h for h in self.owner.active_connections.values()
                      if h is not self and isinstance(h, _Handler) and not h.refused]
            victim = slots.evictee(others)
            if victim is not None:
                victim.drop("closed to make room for a new client (--plc-max-clients)")
        if len(self.owner.active_connections) > self.owner.max_clients:
            self.refused = True
            host = self.peer.rpartition(":")[0]
            if host not in self.owner.refused_hosts:
                self.owner.refused_hosts.add(host)
                log.warning("Modbus: refused a client from %s: %d clients connected already "
                            "(--plc-max-clients)", host, self.owner.max_clients)
            self.close()
            return
        log.info("Modbus client %s connected", self.peer)
        metrics.CLIENTS.labels("modbus").set(len(self.owner.active_connections))

    def callback_disconnected(self, exc: Exception | None) -> None:
        super().callback_disconnected(exc)
        if self.refused:
            return
        self._left(f" ({exc})" if exc else "")

    def _left(self, why: str) -> None:
        self.owner.refused_hosts.clear()  # a slot is free: say again when someone is refused
        metrics.CLIENTS.labels("modbus").set(len(self.owner.active_connections))  # we left it
        log.info("Modbus client %s disconnected%s%s", self.peer, why,
                 f"; {self.malformed} malformed frames" if self.malformed else "")

    def drop(self, why: str) -> None:
        """Close this connection from the server's side (pymodbus then calls no callback)."""
        self.refused = True  # its remaining bytes are ignored
        self.close()
        self._left(f": {why}")

    def callback_data(self, data: bytes, addr: tuple | None = None) -> int:
        if self.refused:
            return len(data)
        self.heard_at = time.monotonic()
        if len(data) >= 8:
            proto, length = int.from_bytes(data[2:4], "big"), int.from_bytes(data[4:6], "big")
            fc = data[7]
            if proto != 0 or not 2 <= length <= 254:
                # not Modbus TCP framing: nothing after it can be trusted to be in step
                self._malformed(f"MBAP header with protocol id {proto} and length {length}; "
                                "connection closed")
                self.close()
                return len(data)
            if fc & 0x7F not in _KNOWN_FC:
                end = 6 + length
                if len(data) < end:
                    return 0  # the rest of the frame is still coming
                self._malformed(f"function code {fc}, answered ILLEGAL FUNCTION")
                # answered here: pymodbus would put function code 0 in the exception response
                cast(asyncio.Transport, self.transport).write(
                    data[:2] + b"\x00\x00\x00\x03" + data[6:7] + bytes((fc | 0x80, 1)))
                return end
        return super().callback_data(data, addr)

    def _malformed(self, what: str) -> None:
        self.malformed += 1
        if self.malformed == 1:
            log.warning("Modbus client %s sent a malformed request (%s); further ones from this "
                        "client are counted, not logged", self.peer, what)


class _Server(ModbusTcpServer):
    def __init__(self, context: _Context, address: tuple[str, int], max_clients: int,
                 idle_timeout_s: float) -> None:
        super().__init__(context, address=address)
        self.max_clients = max_clients
        self.idle_timeout_s = idle_timeout_s
        self.refused_hosts: set[str] = set()

    def callback_new_connection(self) -> _Handler:
        return _Handler(self)

    async def close_idle(self) -> None:
        """Close connections that have sent nothing for ``idle_timeout_s``, for ever."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout_s / 4))
            now = time.monotonic()
            for h in list(self.active_connections.values()):
                if isinstance(h, _Handler) and not h.refused \
                        and slots.idle_s(h, now) >= self.idle_timeout_s:
                    h.drop(f"nothing sent for {self.idle_timeout_s:g} s (--plc-idle-timeout-s)")


class ModbusPublisher:
    protocol = "modbus"

    def __init__(self, address: tuple[str, int], stations: Stations, bus: ResultBus | BusMirror,
                 depth: int, max_clients: int, idle_timeout_s: float = 30.0,
                 trigger: Trigger | None = None) -> None:
        self.address = address
        self.trigger = trigger  # trigger(station, part id, caller): the serving process takes it
        self.map = ModbusStations(stations, bus, depth,
                                  None if trigger is None else self._hand_on)
        self.max_clients = max_clients
        self.idle_timeout_s = idle_timeout_s
        self.server: _Server | None = None
        self._sweeper: asyncio.Task | None = None
        self._triggers: set[asyncio.Task] = set()

    def _hand_on(self, station: int, number: int, value: int, part_id: str | None) -> None:
        """A trigger from the registers, handed to the serving process by a task of its own:
        the request that wrote it is answered at once."""
        task = asyncio.get_running_loop().create_task(
            self._ask(station, number, value, part_id))
        self._triggers.add(task)
        task.add_done_callback(self._triggers.discard)

    async def _ask(self, station: int, number: int, value: int, part_id: str | None) -> None:
        assert self.trigger is not None
        name = self.map.stations.names[station]
        try:
            await self.trigger(name, part_id, {"client": "modbus"})
            refusal = Refusal.TAKEN
        except VisionServeError as exc:
            refusal = _REFUSAL_OF_KIND.get(exc.kind, Refusal.UNAVAILABLE)
            log.info("Modbus station %d (%s): trigger %d refused: %s", station + 1, name, value,
                     exc.message)
        self.map.answered(station, number, value, refusal)

    async def start(self) -> None:
        # pymodbus logs every odd frame and client at ERROR; we say it once per client instead
        logging.getLogger("pymodbus").setLevel(logging.CRITICAL)
        self.server = _Server(_Context(self.map), self.address, self.max_clients,
                              self.idle_timeout_s)
        try:
            await self.server.serve_forever(background=True)
        except RuntimeError as exc:
            raise OSError(f"Modbus TCP: cannot listen on {self.address[0]}:{self.address[1]} "
                          "(in use, or not an address of this machine?)") from exc
        self._sweeper = asyncio.create_task(self.server.close_idle())
        log.info("Modbus TCP listening on %s:%d (%d stations, unit ids 1..%d)", *self.address,
                 len(self.map.handshakes), len(self.map.handshakes))

    def accept(self, events: list[ResultEvent]) -> None:
        """Results, as they arrive: in the registers before the next request is answered."""
        self.map.publish(events)

    async def update(self, line: LineStatus) -> None:
        self.map.line = line

    async def stop(self) -> None:
        pending = [*self._triggers, *([self._sweeper] if self._sweeper is not None else [])]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self.server is not None:
            await self.server.shutdown()
            await asyncio.sleep(0)
