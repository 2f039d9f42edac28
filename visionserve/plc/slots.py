"""The connection slots of a PLC server (Modbus TCP, OPC UA): which connection gives its slot to a
new one when all ``--plc-max-clients`` are taken, and which has been idle too long.

Neither protocol stops a peer from opening connections and sending nothing; without this a few
idle sockets would hold every slot and lock the real PLC out. The rule, the same for both: a
connection that never sent a byte goes first (the oldest of them), then the one idle longest, but
only if it has been idle at least :data:`EVICT_IDLE_S` (a PLC that polls keeps its slot; a new
client that would take it is refused instead).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol, TypeVar

#: a connection that sent something less than this long ago keeps its slot for a newcomer
EVICT_IDLE_S = 5.0


class Slot(Protocol):
    connected_at: float  # time.monotonic() of the connection
    heard_at: float | None  # of its last bytes; None: it never sent any


S = TypeVar("S", bound=Slot)


def idle_s(slot: Slot, now: float) -> float:
    """How long ``slot`` has sent nothing (since it connected, if it never did)."""
    return now - (slot.connected_at if slot.heard_at is None else slot.heard_at)


def evictee(slots: Iterable[S], now: float | None = None,
            min_idle_s: float = EVICT_IDLE_S) -> S | None:
    """The connection to close for a new one, or None (the newcomer is refused)."""
    now = time.monotonic() if now is None else now
    silent = [s for s in slots if s.heard_at is None]
    if silent:
        return min(silent, key=lambda s: s.connected_at)
    idle = [s for s in slots if idle_s(s, now) >= min_idle_s]
    return max(idle, key=lambda s: idle_s(s, now)) if idle else None
