"""The PLC servers beside the engine: each protocol's server (OPC UA, Modbus TCP) in its own
process, fed from the result bus over a Unix socket pair.

Why processes: asyncua encodes, signs and encrypts every event in Python (2-3 ms each), and
pymodbus parses every PLC request in Python (a PLC polling every few milliseconds sends hundreds
a second). In the serving process that work competes with the engine's event loop and the
decode/compute threads for the one interpreter lock, so it lengthens the inspect answer, and a
result waits for the lock before a PLC can see it. In a process of its own, the engine's loop
only puts a compact tuple per result on a socket (:class:`PlcLink`, a few microseconds), and each
server's process has its own interpreter: a PLC's traffic, OPC UA's encryption or a hostile client
cost the serving process nothing more. One process per protocol, so OPC UA's encoding does not
hold up a Modbus PLC's reads either.

The watchdog's probe runs on the engine's loop and goes to the processes with the bus's
counters every period; each process judges the engine's health on its own (the heartbeat stops
when the probes stop coming: a stuck engine loop, not only a dead process). When the serving
process dies, the processes see the end of the socket pair (or SIGHUP) and exit, closing their
ports: the PLC sees the connection drop. When a PLC server process dies on its own, it is reaped
and started again (with the front-end processes' backoff,
:class:`~visionserve.process.RestartBackoff`); the server reports not ready until it listens
again (the results in its buffers are lost).

:func:`plc_running` is what ``serve`` wraps itself in: it does nothing unless ``--opcua`` or
``--modbus`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from ..config import data_home
from ..errors import ConfigError, Conflict, InternalError, NotFound, VisionServeError
from ..framing import Channel, connect
from ..process import RestartBackoff
from . import metrics
from .bus import ResultBus, Stations
from .watchdog import Watchdog

log = logging.getLogger(__name__)

SPEC_ENV = "VSPLC_SPEC"
SETTINGS_ENV = "VSPLC_SETTINGS"
#: a PLC server process that has this much unsent on its socket has fallen behind: results for
#: it are dropped (and counted) rather than held
MAX_BACKLOG_BYTES = 4 << 20
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/visionserve/plc (~/.local/share/visionserve/plc)."""
    return data_home() / "plc"


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


def protocols(settings) -> list[str]:
    """The configured servers, their addresses checked (ConfigError names the bad one)."""
    out = []
    if settings.modbus:
        parse_address(settings.modbus)
        out.append("modbus")
    if settings.opcua:
        parse_endpoint(settings.opcua)
        out.append("opcua")
    return out


def recipe_spec(engine) -> dict:
    """What a PLC server shows of the recipes: the recipes file's recipes and what each station
    runs; without a recipes file, the served model:version pairs (no stations)."""
    book = engine.recipes
    if book.recipes or book.stations:
        return {"recipes": sorted(book.recipes), "stations": dict(book.stations)}
    return {"recipes": [f"{e.name}:{v}" for e in engine.entries.values()
                        for v in sorted(e.versions)], "stations": {}}


class PlcProcess:
    """One protocol's server in a child process (:mod:`.child`), and the socket pair to it."""

    def __init__(self, protocol: str, settings, recipes: dict, engine=None) -> None:
        self.protocol = protocol
        self.settings = settings
        self.recipes = recipes  # {"recipes": [...], "stations": {station: recipe or None}}
        self.engine = engine  # switches recipes (OPC UA's ActivateRecipe), triggers cameras
        self._calls: set[asyncio.Task] = set()
        self.proc: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.stopping = False
        self._started: asyncio.Future | None = None
        self._lost = asyncio.Event()
        self.listening = False  # its server listens (the process said so) and it is not lost
        self._backoff = RestartBackoff()
        self._supervisor: asyncio.Task | None = None

    async def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the process and wait until its server listens; raises ConfigError saying why
        it could not (bad settings, port in use, the process died). From then on it is started
        again whenever it dies."""
        try:
            await self._spawn(timeout)
        except ConfigError:
            await self.stop()
            raise
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def _spawn(self, timeout: float) -> None:
        """One process, up to its server listening; ConfigError (the process reaped) if not."""
        loop = asyncio.get_running_loop()
        self._started = loop.create_future()
        self._lost.clear()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spec = {"protocol": self.protocol, "channel_fd": theirs.fileno(), "parent": os.getpid(),
                "recipes": self.recipes}
        env = {**os.environ, SPEC_ENV: json.dumps(spec),
               SETTINGS_ENV: self.settings.model_dump_json()}
        try:
            self.proc = subprocess.Popen(  # noqa: ASYNC220 - a fork/exec, milliseconds
                [sys.executable, "-m", "visionserve.plc.child"], env=env,
                pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.channel = await connect(ours, self._on_message, self._on_lost)
        try:
            failure = await asyncio.wait_for(asyncio.shield(self._started), timeout)
        except asyncio.TimeoutError:
            failure = f"the {self.protocol} server did not start within {timeout:.0f} s"
        if failure:
            await self._reap()
            raise ConfigError(failure)
        self._backoff.started()

    async def _supervise(self) -> None:
        """Start the process again each time it dies, reaped first; readiness is held false
        (``engine.unready``) until its server listens again."""
        name = f"plc:{self.protocol}"
        unready = getattr(self.engine, "unready", {})
        while True:
            await self._lost.wait()
            if self.stopping:
                return
            unready[name] = f"the {self.protocol} PLC server process exited; restarting it"
            await self._reap()
            while not self.stopping:
                delay = self._backoff.delay()
                log.warning("starting the %s PLC server process again%s; not ready until it "
                            "listens", self.protocol, f" in {delay:g} s" if delay else "")
                await asyncio.sleep(delay)
                if self.engine is not None:  # what the stations run now
                    self.recipes = recipe_spec(self.engine)
                try:
                    await self._spawn(START_TIMEOUT_S)
                except ConfigError as exc:
                    log.error("the %s PLC server did not start again: %s", self.protocol,
                              exc.message)
                    continue
                break
            unready.pop(name, None)
            if not self.stopping:
                assert self.proc is not None
                log.info("the %s PLC server is back (pid %d)", self.protocol, self.proc.pid)

    async def _reap(self) -> None:
        """The process gone and waited for (no zombie): it is given a moment to exit on its
        own, then killed."""
        if self.channel is not None and not self.channel.closed:
            self.channel.close()
        proc = self.proc
        if proc is None:
            return
        try:
            await asyncio.to_thread(proc.wait, 2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    def send(self, msg: tuple) -> bool:
        """Queue ``msg`` for the process; False (nothing sent) when it is gone or behind."""
        channel = self.channel
        if channel is None or channel.closed or channel.transport is None \
                or channel.transport.get_write_buffer_size() > MAX_BACKLOG_BYTES:
            return False
        channel.send(msg)
        return True

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "m":
            metrics.apply(msg[1])
        elif kind == "recipe":
            task = asyncio.get_running_loop().create_task(self._switch(*msg[1:]))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        elif kind == "trigger":  # answered at once, in the order the PLCs' triggers came
            self._take(*msg[1:])
        elif kind in ("listening", "failed") and self._started is not None \
                and not self._started.done():
            self.listening = kind == "listening"
            self._started.set_result(msg[1] if kind == "failed" else None)

    async def _switch(self, rid: int, station: str, recipe: str, caller: dict) -> None:
        """A station's recipe switched for the PLC: ``("reply", rid, answer, None)``, or
        ``("reply", rid, None, (error class name, message))``."""
        try:
            if self.engine is None:
                raise Conflict("this server switches no recipes")
            answer = await self.engine.switch_recipe(station, recipe, caller)
        except VisionServeError as exc:
            self._refuse(rid, exc)
        except Exception:
            log.exception("recipe switch for the %s PLC failed", self.protocol)
            self._refuse(rid, InternalError("the switch failed; see the server log"))
        else:
            self.send(("reply", rid, answer, None))

    def _take(self, rid: int, station: str, part_id: str | None, caller: dict) -> None:
        """A PLC triggers its station ``station`` (a camera, or a station's cameras:
        ``CameraService.take``): ``("reply", rid, {"station", "part_id", "cameras"}, None)`` as
        soon as the grabs started, or the error; the verdict follows by the result bus."""
        try:
            cameras = None if self.engine is None else self.engine.camera_service
            if cameras is None:
                raise NotFound(f"no camera for PLC station {station!r}: the server acquires "
                               "from no camera ([camera.NAME] in the recipes file, --camera)")
            answer = cameras.take(station, part_id)
        except VisionServeError as exc:
            self._refuse(rid, exc)
        except Exception:
            log.exception("trigger for the %s PLC failed", self.protocol)
            self._refuse(rid, InternalError("the trigger failed; see the server log"))
        else:
            log.debug("%s trigger of PLC station %s taken: part %s (%s)", self.protocol, station,
                      answer["part_id"], caller.get("client", "?"))
            self.send(("reply", rid, answer, None))

    def _refuse(self, rid: int, exc: VisionServeError) -> None:
        """A PLC's call answered with ``exc`` (its class's name and message)."""
        self.send(("reply", rid, None, (type(exc).__name__, exc.message)))

    def _on_lost(self) -> None:
        code = self.proc.poll() if self.proc is not None else None
        if self._started is not None and not self._started.done():
            self._started.set_result(f"the {self.protocol} server process exited "
                                     f"{'' if code is None else f'(code {code}) '}before it "
                                     "listened; see the lines above")
        elif self.listening and not self.stopping:  # (one that failed to start said why)
            log.error("the %s PLC server process (pid %s) exited%s: the PLC sees its "
                      "connection closed and no heartbeat", self.protocol,
                      self.proc.pid if self.proc else "?",
                      "" if code is None else f" (code {code})")
        self.listening = False
        self._lost.set()

    async def stop(self) -> None:
        self.stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self.channel is not None and not self.channel.closed:
            self.channel.send(("stop",))
            self.channel.close()
        proc = self.proc
        if proc is None:
            return
        for _ in range(int(STOP_TIMEOUT_S / 0.05)):
            if proc.poll() is not None:
                return
            await asyncio.sleep(0.05)
        log.warning("the %s PLC server process (pid %d) did not stop; killing it", self.protocol,
                    proc.pid)
        proc.kill()
        await asyncio.to_thread(proc.wait)


class PlcLink:
    """The engine's side of the PLC processes: results from the bus, busy edges and the
    watchdog's probes, each sent to every process; all on the engine's event loop, none waits."""

    def __init__(self, bus: ResultBus, procs: list[PlcProcess], engine=None) -> None:
        self.bus = bus
        self.procs = procs
        self.engine = engine
        self._recipes = None if engine is None else engine.recipes
        bus.bind(self._flush)
        bus.on_busy = self._busy

    def _flush(self) -> None:
        """Called by the bus for each result: it goes out at the end of this loop turn, with the
        others of the turn, in one write per process (framing.Channel)."""
        events = self.bus.drain()
        if not events:
            return
        msg = ("r", [e.wire() for e in events])
        for p in self.procs:
            if not p.send(msg):
                metrics.BUS_DROPPED.inc(len(events))

    def _busy(self, station: int, busy: bool) -> None:
        msg = ("b", station, busy)
        for p in self.procs:
            p.send(msg)

    def probe(self, probe) -> None:
        bus = self.bus
        msg = ("p", dataclasses.astuple(probe), bus.outstanding, bus.last_progress,
               bus.busy_since, tuple(n > 0 for n in bus.inflight))
        for p in self.procs:
            p.send(msg)
        if self.engine is not None and self.engine.recipes is not self._recipes:
            # a station switched (from any front end, or a PLC): the PLCs see what runs now
            self._recipes = self.engine.recipes
            stations = ("a", dict(self._recipes.stations))
            for p in self.procs:
                p.send(stations)

    def close(self) -> None:
        self.bus.unbind()
        self.bus.on_busy = None


@contextlib.asynccontextmanager
async def plc_running(engine, settings):
    """The PLC servers for ``engine`` while the body runs (nothing unless one is configured).
    Yields 0, or 2 when they could not start (the reason logged): then the server must stop."""
    if not (getattr(settings, "opcua", None) or getattr(settings, "modbus", None)):
        yield 0
        return
    procs: list[PlcProcess] = []
    try:
        bus = ResultBus(Stations(settings.plc_stations))
        for protocol in protocols(settings):
            p = PlcProcess(protocol, settings, recipe_spec(engine), engine)
            procs.append(p)
            await p.start()
    except (VisionServeError, OSError) as exc:
        log.error("PLC servers: %s", exc.message if isinstance(exc, VisionServeError) else exc)
        for p in procs:
            await p.stop()
        yield 2
        return
    link = PlcLink(bus, procs, engine)
    watchdog = Watchdog(engine, bus, settings.plc_watchdog_ms / 1000,
                        min(0.1, settings.plc_watchdog_ms / 4000), on_probe=link.probe)
    watchdog.start()
    engine.tap(bus)  # from here every answered frame is published
    engine.part_results = bus  # and each station trigger's part, once
    try:
        yield 0
    finally:
        engine.part_results = None
        engine.untap(bus)
        watchdog.stop()
        link.close()
        for p in procs:
            await p.stop()
