"""The PLC servers' thread: OPC UA and Modbus TCP beside the engine, fed by the result bus.

They run on their own event loop in their own thread, so a PLC's traffic, OPC UA's encryption
and a slow or hostile client cost the engine's event loop nothing but the bus's few
microseconds per frame, and so the watchdog can still speak (heartbeat stopped, Fault raised)
when the engine's loop is stuck.

:func:`plc_running` is what ``serve`` wraps itself in: it does nothing unless ``--opcua`` or
``--modbus`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from pathlib import Path

from ..errors import ConfigError, VisionServeError
from . import require
from .bus import ResultBus, Stations
from .handshake import Fault, LineStatus
from .watchdog import SystemState, Watchdog

log = logging.getLogger(__name__)

#: how often Ready, Busy, Fault and the heartbeat are brought up to date
TICK_S = 0.02


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/visionserve/plc (~/.local/share/visionserve/plc)."""
    data = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(data):  # the XDG spec: unset or relative means the default
        data = os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "visionserve" / "plc"


def parse_address(spec: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:5020`` for IPv6) for ``--modbus``."""
    host, sep, port = spec.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--modbus {spec!r}: use host:port, e.g. 0.0.0.0:5020")
    return host, int(port)


def parse_endpoint(url: str) -> str:
    if not url.startswith("opc.tcp://") or url.count(":") < 2:
        raise ConfigError(f"--opcua {url!r}: use opc.tcp://host:port, e.g. opc.tcp://0.0.0.0:4840")
    return url


def build_publishers(settings, stations: Stations, bus: ResultBus, recipes: list[str]) -> list:
    """The configured servers, their settings checked (ConfigError names the bad one)."""
    publishers = []
    if settings.modbus:
        address = parse_address(settings.modbus)
        require("pymodbus")
        from .modbus import ModbusPublisher

        publishers.append(ModbusPublisher(address, stations, bus, settings.plc_buffer,
                                          settings.plc_max_clients))
    if settings.opcua:
        endpoint = parse_endpoint(settings.opcua)
        require("asyncua")
        from .opcua import OpcUaPublisher

        publishers.append(OpcUaPublisher(
            endpoint, stations, bus, policies=settings.opcua_security,
            anonymous=settings.opcua_anonymous, user=settings.opcua_user,
            password_file=settings.opcua_password_file, max_clients=settings.plc_max_clients,
            data_dir=Path(settings.plc_data_dir or default_data_dir()), recipes=recipes))
    return publishers


class PlcService:
    """Runs ``publishers`` in a thread; feeds them the bus's results and the line status."""

    def __init__(self, publishers: list, bus: ResultBus, watchdog: Watchdog,
                 heartbeat_s: float) -> None:
        self.publishers = publishers
        self.bus = bus
        self.watchdog = watchdog
        self.heartbeat_s = heartbeat_s
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 120.0) -> None:
        """Start the thread and wait until every server listens; raises what stopped one."""
        self._thread = threading.Thread(target=self._run, name="plc", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise OSError(f"the PLC servers did not start within {timeout:.0f} s")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            if not self._started.is_set():
                self._error = exc
            else:
                log.exception("the PLC servers stopped")
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        results = asyncio.Event()
        started = []
        try:
            for p in self.publishers:
                await p.start()
                started.append(p)
            await self._update(time.monotonic(), False, 0)
            self.bus.bind(self._loop, results)
            self._started.set()
            tasks = [asyncio.create_task(self._forward(results)), asyncio.create_task(self._tick())]
            await self._stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.bus.unbind()
            for p in reversed(started):
                try:
                    await p.stop()
                except Exception:
                    log.exception("stopping the %s server failed", p.protocol)

    async def _forward(self, ready: asyncio.Event) -> None:
        """Results to every server as soon as the bus has them."""
        while True:
            await ready.wait()
            ready.clear()
            events = self.bus.drain()
            for p in self.publishers:
                try:
                    await p.publish(events)
                except Exception:
                    log.exception("the %s server could not publish %d results", p.protocol,
                                  len(events))

    async def _tick(self) -> None:
        """Ready, Fault and Busy follow the engine; the heartbeat toggles while it makes progress."""
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
        for p in self.publishers:
            try:
                await p.update(line)
            except Exception:
                log.exception("the %s server could not update its status", p.protocol)


@contextlib.asynccontextmanager
async def plc_running(engine, settings):
    """The PLC servers for ``engine`` while the body runs (nothing unless one is configured).
    Yields 0, or 2 when they could not start (the reason logged): then the server must stop."""
    if not (getattr(settings, "opcua", None) or getattr(settings, "modbus", None)):
        yield 0
        return
    service = watchdog = None
    try:
        stations = Stations(settings.plc_stations)
        bus = ResultBus(stations)
        recipes = [f"{e.name}:{v}" for e in engine.entries.values() for v in sorted(e.versions)]
        publishers = build_publishers(settings, stations, bus, recipes)
        watchdog = Watchdog(engine, bus, settings.plc_watchdog_ms / 1000,
                            min(0.1, settings.plc_watchdog_ms / 4000))
        watchdog.start()
        service = PlcService(publishers, bus, watchdog, settings.plc_heartbeat_ms / 1000)
        await asyncio.to_thread(service.start)
    except (VisionServeError, OSError) as exc:
        log.error("PLC servers: %s", exc.message if isinstance(exc, VisionServeError) else exc)
        if watchdog is not None:
            watchdog.stop()
        service = None
    if service is None:
        yield 2
        return
    engine.results = bus  # from here every answered frame is published
    try:
        yield 0
    finally:
        engine.results = None
        watchdog.stop()
        await asyncio.to_thread(service.stop)
