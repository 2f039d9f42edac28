"""Is the engine making progress? The PLC's heartbeat says so, and stops when it is not.

A process that is alive is not enough: a hung model call or a blocked event loop leaves the
process running while no part gets a verdict. So a probe on the engine's event loop records,
every ``period``, that the loop runs, what readiness says and whether a batch was executed since
(the models' ``execution_count``); the result bus records when a frame was last answered with a
verdict. The probe and those counters go to the PLC server processes (``on_probe``), whose own
:class:`Watchdog` (without an engine: :meth:`Watchdog.observe`) then judges, on their own clock
(the monotonic clock is the machine's, the same in every process):

- the engine loop has not run the probe for ``stall_s`` (once it has been ready), or frames
  have waited ``stall_s`` with none computed: **stalled** (state Error, Fault, heartbeat stops);
- draining: Halted (Ready drops, results still flow);
- ready: Operational;
- not ready after having been ready, or start-up failed: Error (a device or model fault);
- otherwise: Preoperational (models still loading).

LATE answers are not progress (a hung runner leaves the batcher answering LATE for ever); a batch
computed, even too late for its deadlines, is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from . import metrics
from .bus import BusMirror, ResultBus

log = logging.getLogger(__name__)


class SystemState(IntEnum):
    """OPC 40100's VisionStateMachine top-level states (the numbers are ours)."""

    PREOPERATIONAL = 0
    OPERATIONAL = 1
    HALTED = 2
    ERROR = 3


@dataclass(frozen=True, slots=True)
class Health:
    state: SystemState
    stalled: bool = False
    reason: str = ""

    @property
    def ready(self) -> bool:
        return self.state is SystemState.OPERATIONAL


@dataclass(frozen=True, slots=True)
class _Probe:
    at: float  # monotonic time the engine loop last ran the probe
    ready: bool
    draining: bool
    was_ready: bool
    startup_error: str | None
    executed_at: float  # monotonic time a batch count change was last seen


class Watchdog:
    """Engine side: :meth:`start` probes the engine's loop, and hands each probe to ``on_probe``.
    Judging side: :meth:`health` (after :meth:`observe` where the probes come from elsewhere)."""

    def __init__(self, engine, bus: ResultBus | BusMirror, stall_s: float, period_s: float = 0.1,
                 on_probe: Callable[[_Probe], None] | None = None) -> None:
        self.engine = engine
        self.bus = bus
        self.stall_s = stall_s
        self.period_s = period_s
        self.on_probe = on_probe
        self._probe = _Probe(time.monotonic(), False, False, False, None, 0.0)
        self._executed = -1
        self._handle: asyncio.TimerHandle | None = None
        self._stalled = False

    # --- the engine's event loop -------------------------------------------------------------

    def start(self) -> None:
        """Start probing; call on the engine's event loop."""
        self._tick()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        e, now, executed_at = self.engine, time.monotonic(), self._probe.executed_at
        ready = bool(e.ready)
        executed = sum(s.stats.execution_count for s in getattr(e, "served", {}).values())
        if executed != self._executed:
            self._executed, executed_at = executed, now
        # one assignment: the PLC thread reads a consistent snapshot
        self._probe = _Probe(now, ready, bool(e.draining), self._probe.was_ready or ready,
                             getattr(e, "startup_error", None), executed_at)
        self._handle = asyncio.get_running_loop().call_later(self.period_s, self._tick)
        if self.on_probe is not None:
            self.on_probe(self._probe)

    # --- the judging side (a PLC server process) ---------------------------------------------

    def observe(self, probe: _Probe) -> None:
        """A probe made on the engine's loop (in another process)."""
        self._probe = probe

    def health(self, now: float | None = None) -> Health:
        now = time.monotonic() if now is None else now
        p, bus = self._probe, self.bus
        stall = ""
        # before the first ready a busy loop is start-up (imports, warm-up), not a stall
        if now - p.at > self.stall_s and p.was_ready:
            stall = f"the engine's event loop has not run for {now - p.at:.1f} s"
        elif bus.outstanding > 0:
            idle = now - max(bus.last_progress, bus.busy_since, p.executed_at)
            if idle > self.stall_s:
                stall = f"{bus.outstanding} frames waiting and none computed for {idle:.1f} s"
        self._note_stall(stall)
        if stall:
            return Health(SystemState.ERROR, True, f"engine stalled: {stall}")
        if p.draining:
            return Health(SystemState.HALTED, reason="draining: the server is shutting down")
        if p.ready:
            return Health(SystemState.OPERATIONAL)
        if p.startup_error:
            return Health(SystemState.ERROR, reason=f"start-up failed: {p.startup_error}")
        if p.was_ready:
            return Health(SystemState.ERROR, reason="a model is not ready (device or model fault; "
                                                    "see the server log)")
        return Health(SystemState.PREOPERATIONAL, reason="starting: models loading")

    def _note_stall(self, stall: str) -> None:
        if bool(stall) == self._stalled:
            return
        self._stalled = bool(stall)
        metrics.STALLED.set(1 if stall else 0)
        if stall:
            log.error("PLC watchdog: %s; the heartbeat stops and Fault is raised", stall)
        else:
            log.warning("PLC watchdog: the engine makes progress again; the heartbeat resumes")
