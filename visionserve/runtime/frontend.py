"""A front-end process (started by :mod:`.procs`, not by hand): the same HTTP app and gRPC
servicer as the in-process front end, over a :class:`~visionserve.frontends.remote.RemoteEngine`.
It never imports a model runtime or touches the GPU.

It lives no longer than the serving process: when that one dies (end of file on the socket pair,
or SIGHUP through ``PR_SET_PDEATHSIG``) the requests waiting for it are answered 503 at once, the
listening sockets close (so that a restart can bind the ports) and the process exits, with no
graceful-shutdown wait."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from .. import imaging
from ..config import ServerSettings
from ..errors import VisionServeError
from ..framing import connect
from ..frontends.arena import Arena
from ..frontends.remote import RemoteEngine
from ..http.server import http_app, http_server
from ..process import child_main
from .assembly import service_routers
from .hosted import open_guard_store
from .procs import SETTINGS_ENV, SPEC_ENV

if TYPE_CHECKING:
    from fastapi import APIRouter

log = logging.getLogger("visionserve.frontend")

#: after the serving process died: the answers in flight (all 503 by then) may take this long
#: to go out, then the process leaves
EXIT_GRACE_S = 0.3


async def run(spec: dict, settings: ServerSettings) -> int:
    index = spec["index"]
    # this process decodes too (an annotated answer's image): OpenCV's limit is the server's
    # here as well, not what the environment it was started from says (it is spawned before the
    # engine sets its own)
    imaging.configure_opencv(settings.max_image_pixels)
    arena = Arena(spec["arena_fd"], spec["arena_bytes"])
    os.close(spec["arena_fd"])
    remote = RemoteEngine(arena)
    remote.channel = await connect(socket.socket(fileno=spec["channel_fd"]), remote.on_message,
                                   remote.on_lost)
    transport = remote.channel.transport
    assert transport is not None  # connect() returns a connected channel
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, transport.abort)
    heartbeat = asyncio.ensure_future(remote.watch())
    routers: tuple[APIRouter, ...] = service_routers(
        settings, open_guard_store(settings) if settings.guard else None)
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

    async def engine_gone() -> None:
        await remote.lost.wait()
        # every request that waited for the engine has had its 503 now: stop listening at once
        # (no graceful-shutdown wait), let those answers go out, and leave without the usual
        # teardown (requests still reading a body would only be cancelled by it)
        server.should_exit = server.force_exit = True
        with contextlib.suppress(Exception):
            if grpc_server is not None:
                await asyncio.wait_for(grpc_server.stop(grace=EXIT_GRACE_S), EXIT_GRACE_S + 0.5)
            else:
                await asyncio.sleep(EXIT_GRACE_S)
        log.info("front end %d (pid %d) exits: the engine process is gone", index, os.getpid())
        logging.shutdown()
        os._exit(1)

    watcher = asyncio.ensure_future(engine_gone())
    http_sock = socket.socket(fileno=spec["http_fd"])
    try:
        await server.serve(sockets=[http_sock])
        if remote.lost.is_set():
            await watcher  # it ends the process
    finally:
        watcher.cancel()
        heartbeat.cancel()
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)
        await remote.close()
        with contextlib.suppress(OSError):
            http_sock.close()
    return 0


def main() -> int:
    return child_main(run, SPEC_ENV, SETTINGS_ENV)


if __name__ == "__main__":
    sys.exit(main())
