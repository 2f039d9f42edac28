"""A front-end process (started by :mod:`.procs`, not by hand): the same HTTP app and gRPC
servicer as the in-process front end, over a :class:`~.remote.RemoteEngine`. It never imports a
model runtime or touches the GPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys

from ..config import ServerSettings
from ..errors import VisionServeError
from .arena import Arena
from .channel import connect
from .procs import SETTINGS_ENV, SPEC_ENV
from .remote import RemoteEngine

log = logging.getLogger("visionserve.frontend")


async def run(spec: dict, settings: ServerSettings) -> int:
    from ..server import http_app, http_server, open_guard_store

    index = spec["index"]
    arena = Arena(spec["arena_fd"], spec["arena_bytes"])
    os.close(spec["arena_fd"])
    remote = RemoteEngine(arena)
    remote.channel = await connect(socket.socket(fileno=spec["channel_fd"]), remote.on_message, remote.on_lost)
    routers = ()
    if settings.guard:
        from ..guard.http import make_router

        routers = (make_router(open_guard_store(settings)),)
    server = http_server(http_app(remote, settings, routers), remote, settings)
    # Ctrl-C in a terminal reaches the whole process group: the serving process drains and then
    # sends SIGTERM here; taking SIGINT too would make that SIGTERM a second signal (leave now)
    server.ignored_signals = (signal.SIGINT,)
    grpc_server = None
    if spec["grpc_port"] >= 0:
        from ..grpc.server import create_server

        grpc_settings = settings.model_copy(update={"grpc_port": spec["grpc_port"]})
        try:
            grpc_server = create_server(remote, grpc_settings, shared_port=True)
            await grpc_server.start()
        except VisionServeError as exc:
            log.error("front end %d: %s", index, exc.message)
            return 2
    server.grpc_server = grpc_server

    async def engine_gone() -> None:
        await remote.lost.wait()
        server.should_exit = True

    watcher = asyncio.ensure_future(engine_gone())
    http_sock = socket.socket(fileno=spec["http_fd"])
    try:
        await server.serve(sockets=[http_sock])
    finally:
        watcher.cancel()
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)
        await remote.close()
        with contextlib.suppress(OSError):
            http_sock.close()
    return 0


def main() -> int:
    spec = json.loads(os.environ.pop(SPEC_ENV))
    settings = ServerSettings.model_validate_json(os.environ.pop(SETTINGS_ENV))
    from ..server import configure_logging, run_loop

    configure_logging(settings.log_level, settings.log_json)
    return run_loop(run(spec, settings))


if __name__ == "__main__":
    sys.exit(main())
