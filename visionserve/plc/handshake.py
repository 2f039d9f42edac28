"""One station's result handshake with a PLC, as camera vendors' Modbus interfaces do it.

The pattern (Cognex In-Sight/DataMan "Results Ack" handshake; Keyence and SICK use the same
four edges): the PLC sets **Enable** to receive results. A result waits in a buffer until it is
presented: its words are written, then **ResultValid** rises (with **Pass** or **Fail**). The PLC
reads the words and raises **ResultAck**; the server drops ResultValid; the PLC drops ResultAck;
only then is the next buffered result presented. A stuck ResultAck therefore acknowledges one
result, never a stream of them.

Up to ``depth`` results wait unacknowledged (the presented one included). One more is dropped,
counted, and latches **Overflow** (so **Fault**) until the PLC raises **FaultReset** or drops
Enable (which also clears the buffer: those parts are gone). Each result takes the next
inspection id (1..65535, then 1 again), dropped ones too, so the PLC can see a gap.

Pure logic, no I/O and no clock: the Modbus server calls :meth:`Handshake.write_control` when the
PLC writes the control bits and :meth:`Handshake.offer` for each result of the station.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntFlag

from .bus import ResultCode, ResultEvent


class Control(IntFlag):
    """Control bits from the PLC (coils 0-2, holding register 0)."""

    ENABLE = 1 << 0
    RESULT_ACK = 1 << 1
    FAULT_RESET = 1 << 2


class Status(IntFlag):
    """Status bits to the PLC (discrete inputs 0-8, input register 0)."""

    READY = 1 << 0
    BUSY = 1 << 1
    RESULT_VALID = 1 << 2
    PASS = 1 << 3
    FAIL = 1 << 4
    FAULT = 1 << 5
    HEARTBEAT = 1 << 6
    ENABLED = 1 << 7
    OVERFLOW = 1 << 8


class Fault(IntFlag):
    """Why Fault is set (input register 1)."""

    OVERFLOW = 1 << 0  #: results dropped: the PLC did not acknowledge in time
    STALLED = 1 << 1  #: the engine makes no progress (the heartbeat stopped too)
    ENGINE = 1 << 2  #: a model is not ready after start (device or model fault), start-up failed


NO_FAULT = Fault(0)
CONTROL_BITS = len(Control)
STATUS_BITS = len(Status)


@dataclass(frozen=True, slots=True)
class LineStatus:
    """What every station shows of the server as a whole."""

    ready: bool = False
    heartbeat: bool = False
    heartbeat_count: int = 0
    fault: Fault = NO_FAULT
    state: int = 0  #: watchdog.SystemState
    reason: str = ""  #: why not Operational


class Handshake:
    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"buffer depth must be at least 1, got {depth}")
        self.depth = depth
        self.control = Control(0)
        self.buffer: deque[tuple[int, ResultEvent]] = deque()
        #: the result presented last: (inspection id, event); kept after its ack (words stay)
        self.current: tuple[int, ResultEvent] | None = None
        self.valid = False
        self.overflow = False
        self.seq = 0  #: the last inspection id given
        self.dropped = 0  #: results dropped on overflow, in all

    @property
    def enabled(self) -> bool:
        return Control.ENABLE in self.control

    @property
    def waiting(self) -> int:
        """Results buffered behind the presented one."""
        return len(self.buffer)

    def write_control(self, value: int) -> bool:
        """The PLC wrote the control bits (edges act; levels are kept); True when this
        acknowledged the result presented (a Result Ack handshake)."""
        new, old = Control(value & 0b111), self.control
        self.control = new
        rose = new & ~old
        if Control.ENABLE in old and Control.ENABLE not in new:
            # the PLC resets the station: what waits is for parts already gone
            self.buffer.clear()
            self.valid = False
            self.overflow = False
        if Control.FAULT_RESET in rose:
            self.overflow = False
        acked = Control.RESULT_ACK in rose and self.valid
        if acked:
            self.valid = False  # acknowledged; the next one waits for ResultAck to drop
        self._present()
        return acked

    def offer(self, event: ResultEvent) -> bool:
        """A new result of this station; False when it was not kept (disabled, or overflow)."""
        if not self.enabled:
            return False  # no PLC listens: nothing to buffer
        self.seq = self.seq % 0xFFFF + 1
        if len(self.buffer) + self.valid >= self.depth:
            self.overflow = True
            self.dropped += 1
            return False
        self.buffer.append((self.seq, event))
        self._present()
        return True

    def _present(self) -> None:
        if not self.valid and Control.RESULT_ACK not in self.control and self.buffer:
            self.current = self.buffer.popleft()
            self.valid = True

    def status(self, line: LineStatus, busy: bool) -> Status:
        s = Status(0)
        if line.ready:
            s |= Status.READY
        if busy:
            s |= Status.BUSY
        if self.valid and self.current is not None:
            s |= Status.RESULT_VALID
            s |= Status.PASS if self.current[1].code is ResultCode.OK else Status.FAIL
        if self.overflow or line.fault:
            s |= Status.FAULT
        if line.heartbeat:
            s |= Status.HEARTBEAT
        if self.enabled:
            s |= Status.ENABLED
        if self.overflow:
            s |= Status.OVERFLOW
        return s

    def faults(self, line: LineStatus) -> Fault:
        return line.fault | (Fault.OVERFLOW if self.overflow else Fault(0))
