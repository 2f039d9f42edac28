"""One PLC server (Modbus TCP or OPC UA) in its own process: started by :mod:`.service`, not by
hand.

Messages from the serving process (pickled tuples on a Unix socket pair, the framing of
:mod:`visionserve.framing`):

- ``("r", [ResultEvent.wire(), ...])``: results, in the order they became final;
- ``("b", station, busy)``: a station's frames in flight went from none to some, or back to none;
- ``("p", probe, outstanding, last_progress, busy_since, busy)``: the watchdog's probe of the
  engine's loop, every period, with the bus's counters;
- ``("a", {station: recipe})``: the stations' recipes, when one was switched;
- ``("reply", rid, answer, error)``: the answer to a ``recipe`` or ``trigger`` call
  (``error``: (the error class's name, message));
- ``("stop",)``.

To it: ``("listening", None)`` or ``("failed", why)`` once at start, then ``("m", updates)``:
the process's metric updates (:func:`.metrics.apply` repeats them where ``/metrics`` is served),
``("recipe", rid, station, recipe, caller)``: a PLC switches a station's recipe (OPC UA's
``ActivateRecipe``), and ``("trigger", rid, plc_station, part_id or None, caller)``: a PLC
triggers its station's cameras (Modbus's trigger register, OPC UA's ``Trigger``), each answered by
``reply`` (a trigger: as soon as it is taken; its verdict comes as a result, ``r``).

The process lives no longer than the serving process: at the end of the socket pair (or SIGHUP
through ``PR_SET_PDEATHSIG``, :func:`visionserve.process.child_main`) it closes its server and
exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import errors
from ..errors import Unavailable, VisionServeError
from . import metrics, require
from .bus import BusMirror, ResultEvent, Stations
from .handshake import Fault, LineStatus
from .watchdog import SystemState, Watchdog, _Probe

if TYPE_CHECKING:
    from ..framing import Channel

log = logging.getLogger(__name__)

#: how often Ready, Busy, Fault and the heartbeat are brought up to date
TICK_S = 0.02
#: histogram observations (one per result) go to the serving process this often, not one by one
METRICS_FLUSH_S = 0.05
#: a trigger not taken by the serving process in this long is refused (unavailable)
TRIGGER_TIMEOUT_S = 5.0


def build_publisher(protocol: str, settings, stations: Stations, mirror: BusMirror,
                    recipes: dict, ask=None, trigger=None):
    """The server for ``protocol``, its settings checked (ConfigError names the bad one)."""
    from .service import default_data_dir, parse_address, parse_endpoint

    if protocol == "modbus":
        address = parse_address(settings.modbus)
        require("pymodbus")
        from .modbus import ModbusPublisher

        return ModbusPublisher(address, stations, mirror, settings.plc_buffer,
                               settings.plc_max_clients, settings.plc_idle_timeout_s, trigger)
    endpoint = parse_endpoint(settings.opcua)
    require("asyncua")
    from .opcua import OpcUaPublisher

    return OpcUaPublisher(
        endpoint, stations, mirror, policies=settings.opcua_security,
        anonymous=settings.opcua_anonymous, user=settings.opcua_user,
        password_file=settings.opcua_password_file, max_clients=settings.plc_max_clients,
        idle_timeout_s=settings.plc_idle_timeout_s,
        data_dir=Path(settings.plc_data_dir or default_data_dir()), recipes=recipes, ask=ask,
        trigger=trigger)


class PlcService:
    """Runs one server: results in as they come, and Ready, Fault, Busy and the heartbeat
    following the engine as the watchdog judges it."""

    def __init__(self, publisher, mirror: BusMirror, watchdog: Watchdog,
                 heartbeat_s: float, asker: Asker | None = None) -> None:
        self.publisher = publisher
        self.asker = asker or Asker()
        self.mirror = mirror
        self.watchdog = watchdog
        self.heartbeat_s = heartbeat_s
        self.stop = asyncio.Event()

    def on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "r":
            self.publisher.accept([ResultEvent.from_wire(t) for t in msg[1]])
        elif kind == "b":
            self.mirror.inflight[msg[1]] = 1 if msg[2] else 0
        elif kind == "p":
            m = self.mirror
            _, probe, m.outstanding, m.last_progress, m.busy_since, busy = msg
            m.inflight[:] = [1 if b else 0 for b in busy]
            self.watchdog.observe(_Probe(*probe))
        elif kind == "a":
            changed = getattr(self.publisher, "recipes_changed", None)  # OPC UA shows them
            if changed is not None:
                changed(msg[1])
        elif kind == "reply":
            self.asker.answer(*msg[1:])
        elif kind == "stop":
            self.stop.set()

    async def start(self) -> None:
        await self.publisher.start()
        await self._update(time.monotonic(), False, 0)

    async def run(self) -> None:
        """Until :attr:`stop` is set; then the server stops."""
        tick = asyncio.create_task(self._tick())
        try:
            await self.stop.wait()
        finally:
            tick.cancel()
            await asyncio.gather(tick, return_exceptions=True)
            try:
                await self.publisher.stop()
            except Exception:
                log.exception("stopping the %s server failed", self.publisher.protocol)

    async def _tick(self) -> None:
        """Ready, Fault and Busy follow the engine; the heartbeat toggles while it makes
        progress."""
        beat, count = False, 0
        next_beat = time.monotonic() + self.heartbeat_s
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            health = self.watchdog.health(now)
            if health.stalled:
                next_beat = now + self.heartbeat_s  # stopped; resumes a full period after
            elif now >= next_beat:
                beat, count = not beat, count + 1
                next_beat = max(next_beat + self.heartbeat_s, now)
            await self._update(now, beat, count, health)

    async def _update(self, now: float, beat: bool, count: int, health=None) -> None:
        health = health or self.watchdog.health(now)
        fault = Fault(0)
        if health.stalled:
            fault |= Fault.STALLED
        elif health.state is SystemState.ERROR:
            fault |= Fault.ENGINE
        line = LineStatus(health.ready, beat, count, fault, int(health.state), health.reason)
        try:
            await self.publisher.update(line)
        except Exception:
            log.exception("the %s server could not update its status", self.publisher.protocol)


class Asker:
    """Calls the serving process makes for a PLC (a recipe switch, a trigger), and their
    replies."""

    def __init__(self) -> None:
        self.channel: Channel | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}

    async def switch_recipe(self, station: str, recipe: str, caller: dict,
                            timeout_s: float = 30.0) -> dict:
        """The serving process's answer (as ``POST /v1/stations/{s}/recipe``'s), or its error
        as a VisionServeError of the same kind."""
        return await self._call(("recipe", station, recipe, caller), timeout_s)

    async def trigger(self, station: str, part_id: str | None, caller: dict,
                      timeout_s: float = TRIGGER_TIMEOUT_S) -> dict:
        """PLC station ``station`` triggered: ``{"station", "part_id", "cameras"}`` once the
        serving process has taken it (the grabs started), or its error (NotFound: no camera,
        Conflict: not triggerable, Unavailable: no serving process) as a VisionServeError."""
        return await self._call(("trigger", station, part_id, caller), timeout_s)

    async def _call(self, call: tuple, timeout_s: float) -> dict:
        if self.channel is None or self.channel.closed:
            raise Unavailable("the serving process is gone")
        rid = next(self._ids)
        fut = self._waiting[rid] = asyncio.get_running_loop().create_future()
        self.channel.send((call[0], rid, *call[1:]))
        try:
            answer, error = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"no answer from the serving process in {timeout_s:g} s") from None
        finally:
            self._waiting.pop(rid, None)
        if error is not None:
            name, message = error
            cls = getattr(errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, VisionServeError)):
                cls = VisionServeError
            raise cls(message)
        return answer

    def answer(self, rid: int, answer, error) -> None:
        fut = self._waiting.get(rid)
        if fut is not None and not fut.done():
            fut.set_result((answer, error))


class _MetricsOut:
    """Collects the process's metric updates; histogram observations go every
    :data:`METRICS_FLUSH_S`, anything else (rare: overflows, clients, stalls) at once."""

    def __init__(self) -> None:
        self.channel: Channel | None = None
        self._ops: list[tuple] = []
        self._scheduled = False

    def __call__(self, name: str, labels: tuple, method: str, value: float) -> None:
        self._ops.append((name, labels, method, value))
        if self._scheduled or self.channel is None:
            return
        self._scheduled = True
        loop = asyncio.get_running_loop()
        if method == "observe":
            loop.call_later(METRICS_FLUSH_S, self.flush)
        else:
            loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._ops and self.channel is not None and not self.channel.closed:
            ops, self._ops = self._ops, []
            self.channel.send(("m", ops))


async def run(spec: dict, settings) -> int:
    from ..framing import connect

    out = _MetricsOut()
    metrics.record_into(out)
    stations = Stations(settings.plc_stations)
    mirror = BusMirror(len(stations))
    watchdog = Watchdog(None, mirror, settings.plc_watchdog_ms / 1000)
    service: PlcService | None = None
    pending: list[tuple] = []  # messages that came before the server was built

    def on_message(msg: tuple) -> None:
        if service is None:
            pending.append(msg)
        else:
            service.on_message(msg)

    lost = asyncio.Event()
    channel = await connect(socket.socket(fileno=spec["channel_fd"]), on_message, lost.set)
    out.channel = channel
    asker = Asker()
    asker.channel = channel
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, lost.set)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the serving process says when to stop
        loop.add_signal_handler(sig, lambda: None)
    try:
        publisher = build_publisher(spec["protocol"], settings, stations, mirror, spec["recipes"],
                                    asker.switch_recipe, asker.trigger)
        service = PlcService(publisher, mirror, watchdog, settings.plc_heartbeat_ms / 1000, asker)
        await service.start()
    except (VisionServeError, OSError) as exc:
        channel.send(("failed", exc.message if isinstance(exc, VisionServeError) else str(exc)))
        channel.close()
        return 2
    for msg in pending:
        service.on_message(msg)
    channel.send(("listening", None))
    stop_waiter = asyncio.ensure_future(lost.wait())
    stop_waiter.add_done_callback(lambda _: service.stop.set())
    await service.run()
    stop_waiter.cancel()
    out.flush()
    with contextlib.suppress(Exception):
        channel.close()
    return 0


if __name__ == "__main__":
    from ..process import child_main
    from .service import SETTINGS_ENV, SPEC_ENV

    sys.exit(child_main(run, SPEC_ENV, SETTINGS_ENV))
