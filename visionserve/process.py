"""What every process of the server does for itself: run its event loop, and (a child process:
a front end, a PLC server) die with the serving process that started it (:func:`child_main`);
and, for the serving process, when to start such a child again after it died
(:class:`RestartBackoff`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable

from .config import ServerSettings
from .logs import configure_logging

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


class RestartBackoff:
    """How long to wait before starting a child process again after it died: at once when it had
    run ``stable_s`` or more, else ``first_s``, doubling while it keeps dying early, up to
    ``max_s`` (a bad setting or a crash at start would otherwise spin)."""

    def __init__(self, first_s: float = 1.0, max_s: float = 30.0, stable_s: float = 10.0) -> None:
        self.first_s, self.max_s, self.stable_s = first_s, max_s, stable_s
        self._delay = 0.0
        self._started = time.monotonic()

    def started(self) -> None:
        """The child was (re)started now."""
        self._started = time.monotonic()

    def delay(self) -> float:
        """Seconds to wait before the next start, the child having died just now."""
        if time.monotonic() - self._started >= self.stable_s:
            self._delay = 0.0
        else:
            self._delay = min(self.max_s, self._delay * 2 or self.first_s)
        return self._delay


def run_loop(main):
    """Run ``main`` on uvloop where it is installed (uvicorn[standard] brings it): the event loop
    is on every request's path, and uvloop's costs a fraction of asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if sys.version_info < (3, 11):  # no asyncio.Runner: the policy is how 3.10 picks a loop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def die_with(parent: int) -> None:
    """SIGHUP when the serving process dies, even where the end of file on the socket pair would
    not come (its end inherited by some other process)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGHUP), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); relying on the socket pair",
                    ctypes.get_errno())
    if os.getppid() != parent:  # it died before the request above took effect
        os._exit(1)


def child_main(run: Callable[[dict, ServerSettings], Awaitable[int]], spec_env: str,
               settings_env: str) -> int:
    """The whole life of a child process of the serving process: its spec (JSON) and the
    server's settings from the environment variables the parent set, logging as the server
    logs, death with the parent, then ``run(spec, settings)`` on the event loop."""
    spec = json.loads(os.environ.pop(spec_env))
    settings = ServerSettings.model_validate_json(os.environ.pop(settings_env))
    configure_logging(settings.log_level, settings.log_json)
    die_with(spec["parent"])
    return run_loop(run(spec, settings))
