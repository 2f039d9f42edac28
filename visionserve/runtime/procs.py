"""The serving process with ``--frontends N``: it holds the engine and the listening sockets, and
starts, watches and stops N front-end processes.

Each front end gets, at spawn (``pass_fds``): the HTTP listening socket (all front ends accept
from the one socket), one end of a Unix socket pair to the hub, and its own shared-memory arena.
gRPC: the serving process binds the port first with SO_REUSEPORT and holds it (so no other
program can take it, and port 0 picks one port for all), then every front end listens on it too.

Shutdown (SIGTERM/SIGINT): the engine drains (readiness false at once in every front end, queued
frames finish), each front end is told to stop (it answers what it accepted, refuses new work
with 503) and the serving process waits for them, up to the drain timeout. A second signal ends
everything at once. A front end that dies is logged and started again; its clients' requests
in flight are cancelled in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time

from ..config import ServerSettings
from ..errors import VisionServeError
from ..frontends.arena import create_memfd
from ..frontends.hub import Hub
from ..http.connections import refuse_until_quiet
from ..metrics import FRONTENDS_ALIVE
from ..process import RestartBackoff
from .ports import listen_socket
from .startup import start_engine

log = logging.getLogger(__name__)

SPEC_ENV = "VSFRONTEND_SPEC"
SETTINGS_ENV = "VSFRONTEND_SETTINGS"


class FrontEnds:
    def __init__(self, settings: ServerSettings, hub: Hub, http_sock: socket.socket,
                 grpc_port: int) -> None:
        self.settings = settings
        self.hub = hub
        self.http_sock = http_sock
        self.grpc_port = grpc_port
        self.procs: dict[int, subprocess.Popen] = {}
        self.backoff = {i: RestartBackoff() for i in range(settings.frontends or 0)}
        self.stopping = False
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        for i in range(self.settings.frontends or 0):
            await self._spawn(i)
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _spawn(self, index: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        size = self.settings.frontend_arena_bytes
        arena_fd = create_memfd(size, f"visionserve-frontend-{index}")
        spec = {"index": index, "http_fd": self.http_sock.fileno(), "channel_fd": theirs.fileno(),
                "arena_fd": arena_fd, "arena_bytes": size, "grpc_port": self.grpc_port,
                "parent": os.getpid()}
        env = {**os.environ, SPEC_ENV: json.dumps(spec),
               SETTINGS_ENV: self.settings.model_dump_json()}
        try:
            proc = subprocess.Popen([sys.executable, "-m", "visionserve.runtime.frontend"], env=env,  # noqa: ASYNC220 - milliseconds
                                    pass_fds=(self.http_sock.fileno(), theirs.fileno(), arena_fd))
            theirs.close()
            await self.hub.attach(index, ours, arena_fd, size)
        finally:
            os.close(arena_fd)  # mapped by the hub, inherited by the front end
        self.procs[index] = proc
        self._count_alive()
        self.backoff[index].started()
        log.info("front end %d started (pid %d)", index, proc.pid)

    async def _watch(self) -> None:
        while not self.stopping:
            await asyncio.sleep(0.2)
            for index, proc in list(self.procs.items()):
                if proc.poll() is None or self.stopping:
                    continue
                log.error("front end %d (pid %d) exited with %s; starting it again", index,
                          proc.pid, proc.returncode)
                self._count_alive()
                self.hub.detach(index)
                await asyncio.sleep(self.backoff[index].delay())
                if not self.stopping:
                    await self._spawn(index)

    def _count_alive(self) -> None:
        FRONTENDS_ALIVE.set(sum(p.poll() is None for p in self.procs.values()))

    def signal_all(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM every front end (each drains), wait up to ``timeout_s``, then SIGKILL the
        rest."""
        self.stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for index, proc in self.procs.items():
            if proc.poll() is None:
                log.warning("front end %d did not stop in time; killed", index)
                proc.kill()
                proc.wait()
        # each front end stops accepting when it sees no new connection, but the connections
        # may have gone to another: this process holds the listener until the last front end
        # is gone (the kernel queues what comes), then answers what is left 503 before it
        # closes it (closing a listener resets the connections in its backlog)
        if self.http_sock.fileno() != -1:
            await refuse_until_quiet(self.http_sock, self._tls())

    def _tls(self) -> ssl.SSLContext | None:
        """The front ends' TLS, for the answers this process gives on their listener."""
        if self.settings.tls_cert is None or self.settings.tls_key is None:
            return None
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            tls.load_cert_chain(self.settings.tls_cert, self.settings.tls_key)
        except (OSError, ssl.SSLError) as exc:  # the files changed since the front ends read them
            log.warning("shutdown: cannot read --tls-cert/--tls-key again (%s): the last "
                        "connections are refused without TLS", exc)
            return None
        return tls


async def serve_with_frontends(engine, settings: ServerSettings, guard=None) -> int:
    """Run the engine here and ``settings.frontends`` front-end processes until a signal."""
    try:
        http_sock = listen_socket(settings.host, settings.http_port, "--http-port")
        grpc_hold = None
        grpc_port = -1
        if settings.grpc_port >= 0:
            grpc_hold = listen_socket(settings.host, settings.grpc_port, "--grpc-port",
                                      reuse_port=True, listen=False)
            grpc_port = grpc_hold.getsockname()[1]
    except VisionServeError as exc:
        log.error("%s", exc.message)
        return 2
    log.info("HTTP on %s:%d%s, %d front-end processes", settings.host, http_sock.getsockname()[1],
             f", gRPC on port {grpc_port}" if grpc_port >= 0 else "", settings.frontends)
    hub = Hub(engine)
    fronts = FrontEnds(settings, hub, http_sock, grpc_port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = []

    def on_signal(sig: int) -> None:
        signals.append(sig)
        if len(signals) > 1:  # second signal: leave now
            fronts.signal_all(signal.SIGKILL)
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    exit_code = 0
    start = None
    try:
        try:
            await fronts.start()
        except OSError as exc:  # out of processes, memory or file descriptors
            log.error("cannot start the front-end processes: %s", exc)
            return 2
        start = asyncio.ensure_future(start_engine(engine))
        if guard is not None:
            guard.start()
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiter, start}, return_when=asyncio.FIRST_COMPLETED)
        if start.done() and start.result():
            exit_code = start.result()
            log.error("start-up failed; stopping the front ends")
        else:
            await waiter
        if exit_code == 0:
            log.info("shutdown requested: draining for up to %.1f s", settings.drain_timeout_s)
            drained = asyncio.ensure_future(engine.drain(settings.drain_timeout_s))
            hub.publish()  # readiness false in every front end now, not at the next poll
            await fronts.stop(settings.drain_timeout_s + 5.0)
            if not await drained:
                log.warning("drain timeout: unfinished frames were answered 503")
        else:
            await fronts.stop(5.0)
    finally:
        await fronts.stop(1.0)
        if guard is not None:
            await asyncio.to_thread(guard.stop)
        if start is not None and not start.done():
            start.cancel()
        await hub.close()
        await engine.close()
        http_sock.close()
        if grpc_hold is not None:
            grpc_hold.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return exit_code
