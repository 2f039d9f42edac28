"""The front-end side: an engine look-alike that the HTTP app and the gRPC servicer call unchanged.

Lookups (``get``, ``entry``, readiness) answer from what the engine process last said; ``infer``
writes the frames into this process's arena and waits for the answer; ``statistics`` and
``metrics_text`` ask the engine process. See :mod:`visionserve.frontends.hub` for the messages.

A front end does not trust the engine process to answer: each request's deadline is kept here
too (504 at the deadline, whatever the engine does), and an engine process that sends nothing for
``HEARTBEAT_TIMEOUT_S`` (it sends a beat every ``hub.HEARTBEAT_S``) makes this front end not
ready, answers its requests in progress 503 and refuses new ones, until it is heard again.
A request answered here keeps its arena extents until the engine's own answer to it comes: the
engine reads a frame's bytes when it reads the request, which may be later than this answer.

Every answer is counted in the engine process's metrics, once: the engine counts what it answers;
a request answered here (LATE at the deadline, 503 for a silent engine) is counted there with the
cancel that drops its frames, unless the engine had answered it first; a request this process
refuses before sending it (bad body, unknown model, ...) is counted with a ``count`` message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time

import numpy as np

from .. import errors, recipes
from ..dataplane import ModelLookup, ModelView
from ..errors import DeadlineExceeded, Unavailable, VisionServeError
from ..framing import Channel
from ..imaging import Frame
from ..livefeed import LiveEvent, LiveStream, LiveStreams
from ..logs import request_id
from .arena import Arena

log = logging.getLogger(__name__)

#: an engine process silent for this long is taken for hung (it beats every hub.HEARTBEAT_S)
HEARTBEAT_TIMEOUT_S = 1.0
#: a request's deadline is answered here this long after it passes: an engine that is alive
#: answers first (LATE from its queue, or a frame it was computing when the deadline came)
DEADLINE_GRACE_S = 0.02


class RemoteEngine(ModelLookup):
    """The data plane (:class:`visionserve.dataplane.DataPlane`) in a front-end process."""

    def __init__(self, arena: Arena, zero_copy: bool = False) -> None:
        self.arena = arena
        # zero-copy mode (off in the server: no faster): the engine reads the frames in place and
        # says when it let them go ("free"); a request's extents wait for that here (arena.py)
        self.zero_copy = zero_copy
        self._leased: dict[int, list[tuple[int, int]]] = {}
        self.channel: Channel | None = None
        self.entries: dict = {}
        self.served: dict[tuple[str, int], ModelView] = {}
        self.recipes = recipes.NO_RECIPES  # the stations' recipes, as the engine last sent them
        self._ready = False
        self._engine_draining = False
        self._draining = False
        # request id -> its future, its arena extents, its deadline timer (None for non-frames)
        self._pending: dict[int, tuple[asyncio.Future, list[tuple[int, int]],
                                       asyncio.TimerHandle | None]] = {}
        self._heard = time.monotonic()
        self._silent = False  # the engine process stopped beating
        self._ids = itertools.count(1)
        self.connected = asyncio.Event()
        self.lost = asyncio.Event()
        self.feed = RemoteFeed(self)

    # --- the channel -------------------------------------------------------------------------

    def on_message(self, msg: tuple) -> None:
        self._heard = time.monotonic()
        kind = msg[0]
        if kind == "beat":
            return
        if kind == "state":
            _, ready, draining, per_model, models, generation = msg
            if models is not None:
                entries, infos, self.recipes = models
                self.entries = entries
                served = {}
                for k, view in infos.items():
                    mine = self.served.get(k)
                    if mine is not None:  # kept (its stats), with what is in force now
                        mine.entry, mine.config, mine.task = view.entry, view.config, view.task
                        mine.backend_info = view.backend_info
                    served[k] = mine or view
                self.served = served
            for k, r in per_model.items():
                if k in self.served:
                    self.served[k].ready = r
            self._ready, self._engine_draining = ready, draining
            self.connected.set()
            if models is not None and self.channel is not None:  # in force here from now on
                self.channel.send(("applied", generation))
            return
        if kind == "live":  # the engine's answers of a loop turn, for the streams open here
            self.feed.streams(msg[1])
            return
        if kind == "free":  # zero-copy: the engine holds none of these requests' frames any more
            for rid in msg[1]:
                for off, n in self._leased.pop(rid, ()):
                    self.arena.free(off, n)
            return
        rid = msg[1]
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        fut, extents, timer = pending
        if timer is not None:
            timer.cancel()
        for off, n in extents:  # the engine has read them (it answers after reading the request)
            self.arena.free(off, n)
        if fut.done():
            return
        if kind == "result":
            fut.set_result((msg[3], msg[2]))  # (the version that answered, the results)
        elif kind == "reply":
            fut.set_result(msg[2])
        elif kind == "error":
            _, _, name, message, retry_after, *rest = msg
            if name == "Cancelled":
                fut.cancel()
            else:
                cls = getattr(errors, name, None)
                if not (isinstance(cls, type) and issubclass(cls, VisionServeError)):
                    cls = errors.InternalError
                exc = cls(message, retry_after_s=retry_after)
                if rest and rest[0] is not None and isinstance(exc, DeadlineExceeded):
                    exc.late_ms = rest[0]  # only a DeadlineExceeded carries one
                exc.counted = True  # the engine counted it when it answered
                fut.set_exception(exc)

    def on_lost(self) -> None:
        if self.lost.is_set():
            return
        if not self._draining:
            log.error("the engine process closed the channel; this front end stops")
        self._ready = False
        for fut, _, timer in self._pending.values():
            if timer is not None:
                timer.cancel()
            if not fut.done():
                fut.set_exception(Unavailable("the server's engine process is gone",
                                              retry_after_s=1.0))
        self._pending.clear()
        self.feed.shut()  # no more results: the streams end
        self.lost.set()

    async def watch(self) -> None:
        """Follow the engine process's heartbeat (runs for the front end's lifetime)."""
        while not self.lost.is_set():
            await asyncio.sleep(HEARTBEAT_TIMEOUT_S / 10)
            silent_s = time.monotonic() - self._heard
            if silent_s > HEARTBEAT_TIMEOUT_S and not self._silent:
                self._silent = True
                waiting = [rid for rid, (fut, _, _) in self._pending.items() if not fut.done()]
                log.error("the engine process has not answered for %.1f s: not ready; %d requests "
                          "in progress answered 503", silent_s, len(waiting))
                for rid in waiting:
                    self._abandon(rid, Unavailable("the server's engine process is not answering",
                                                   retry_after_s=1.0))
            elif silent_s <= HEARTBEAT_TIMEOUT_S and self._silent:
                self._silent = False
                log.warning("the engine process answers again")

    def _check_reachable(self) -> None:
        if self.channel is None or self.channel.closed:
            raise Unavailable("the server's engine process is not reachable", retry_after_s=1.0)
        if self._silent:
            raise Unavailable("the server's engine process is not answering", retry_after_s=1.0)

    def _call(self, msg_head: str, *rest, extents: list[tuple[int, int]] | None = None,
              expires: tuple[float, float] | None = None) -> tuple[asyncio.Future, int]:
        """Send ``(msg_head, id, *rest)``; the future gets the engine's answer to that id, or
        DeadlineExceeded at ``expires`` = (monotonic time, the deadline in ms, for the message)."""
        self._check_reachable()
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        timer = None
        if expires is not None:
            timer = loop.call_at(expires[0], self._expire, rid, *expires)
        if self.zero_copy and extents:  # freed on the engine's "free", whenever that comes
            self._leased[rid] = extents
            extents = None
        self._pending[rid] = (fut, extents or [], timer)
        assert self.channel is not None  # _check_reachable
        self.channel.send((msg_head, rid, *rest))
        return fut, rid

    def _expire(self, rid: int, at: float, ms: float) -> None:
        """Request ``rid``'s deadline timer (``at``: its deadline plus the grace): answer it
        LATE."""
        late_ms = (time.monotonic() - at + DEADLINE_GRACE_S) * 1000
        self._abandon(rid, DeadlineExceeded(
            f"deadline of {ms:g} ms passed without an answer from the engine process "
            f"({late_ms:.1f} ms ago)", late_ms=late_ms))

    def _abandon(self, rid: int, exc: VisionServeError | None = None) -> None:
        """Answer request ``rid`` now (``exc``, or cancelled) and tell the engine to drop its frames
        (and to count ``exc`` as the answer, unless it had answered first).
        Its entry and arena extents stay until the engine answers: the engine may not have read
        the frames yet, and bytes of another frame there would get that frame's verdict."""
        pending = self._pending.get(rid)
        if pending is None or pending[0].done():
            return
        fut, _, timer = pending
        if timer is not None:
            timer.cancel()
        assert self.channel is not None  # a request in progress went out on it
        if exc is None:
            fut.cancel()
            self.channel.send(("cancel", rid))
        else:
            exc.counted = True
            fut.set_exception(exc)
            self.channel.send(("cancel", rid, exc.kind))

    # --- what the front ends call ------------------------------------------------------------

    @property
    def live(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return self._ready and not self._silent and not self._draining and not self._engine_draining

    @property
    def draining(self) -> bool:
        return self._draining or self._engine_draining

    def precheck(self, name: str, version, n: int, *, deadline_ms: float | None,
                 priority: int | None, arrival: float, origin: tuple | None = None) -> None:
        """What this process can refuse from a request's head: an unknown model, draining, a
        silent engine. The engine process admits the frames themselves (its queue is there)."""
        self.get(name, version)
        if self._draining:
            raise Unavailable.shutting_down()
        self._check_reachable()

    async def infer(self, name: str, version, frames: list[Frame], *,
                    deadline_ms: float | None = None, priority: int | None = None,
                    arrival: float | None = None, origin: tuple | None = None):
        arrival = time.monotonic() if arrival is None else arrival
        served = self.get(name, version)
        if self._draining:
            raise Unavailable.shutting_down()
        self._check_reachable()  # before the frames take arena space that only an answer frees
        descs: list[tuple] = []
        extents: list[tuple[int, int]] = []
        for f in frames:
            data = f.data
            n = data.nbytes if isinstance(data, np.ndarray) else len(data)
            shape = data.shape if isinstance(data, np.ndarray) else None
            off = self.arena.alloc(n)
            if off is None:  # arena full (huge frames or a burst): the bytes travel in the message
                descs.append((f.kind, f.width, f.height, f.channels, shape, 0, n,
                              data.tobytes() if isinstance(data, np.ndarray) else bytes(data)))
                continue
            self.arena.write(off, data)
            extents.append((off, n))
            descs.append((f.kind, f.width, f.height, f.channels, shape, off, n, None))
        # the engine's own deadline (it checks the value: no timer for one it refuses)
        ms = served.config.batching.takt_ms if deadline_ms is None else deadline_ms
        expires = (arrival + ms / 1000.0 + DEADLINE_GRACE_S, ms) if 0 < ms < math.inf else None
        fut, rid = self._call("infer", name, version, descs, deadline_ms, priority, arrival,
                              request_id.get(), origin, extents=extents, expires=expires)
        try:
            version, results = await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._abandon(rid)  # the client went away: the engine drops its frames
            raise
        # the version the engine admitted the frames to (the models of a swap come before)
        return self.served.get((served.name, version), served), results

    def count_error(self, model: str, exc: VisionServeError, frames: int = 0) -> None:
        """A request this front end answered with ``exc`` before sending it to the engine: counted
        in the engine process, where /metrics is read (``frames``: none reached the engine)."""
        exc.counted = True
        if self.channel is not None:
            self.channel.send(("count", model, exc.kind))

    async def statistics(self, name: str = "", version=None) -> list[ModelView]:
        self.select(name, version)  # unknown names fail here, as in the engine
        fut, _ = self._call("stats", name, version)
        out = []
        for model, v, stats in await fut:
            view = self.served.get((model, v))
            if view is not None:
                view.stats = stats
                out.append(view)
        return out

    async def verdict(self, name: str, changes=None, caller=None) -> dict:
        """Asked of the engine process, which changes the file and every process's settings."""
        self.entry(name)
        fut, _ = self._call("verdict", name, None if changes is None else dict(changes),
                            None if caller is None else dict(caller))
        return await fut

    async def preview_verdict(self, name: str, changes) -> dict:
        """Asked of the engine process, which keeps the answered frames."""
        self.entry(name)
        fut, _ = self._call("preview", name, dict(changes))
        return await fut

    async def switch_recipe(self, station: str, recipe_id: str, caller=None) -> dict:
        """Asked of the engine process, which tells every front end the new recipe."""
        fut, _ = self._call("recipe", station, recipe_id, None if caller is None else dict(caller))
        return await fut

    async def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        fut, _ = self._call("repository", "repository_index", (ready,))
        return await fut

    async def load_model(self, name: str, parameters=None, caller=None) -> dict:
        fut, _ = self._call("repository", "load_model", (name, dict(parameters or {}),
                                                         dict(caller or {})))
        return await fut

    async def unload_model(self, name: str, parameters=None, caller=None) -> dict:
        fut, _ = self._call("repository", "unload_model", (name, dict(parameters or {}),
                                                           dict(caller or {})))
        return await fut

    async def reload_model(self, name: str, action: str,
                           default_version: int | None = None) -> dict:
        fut, _ = self._call("repository", "reload_model", (name, action, default_version))
        return await fut

    async def trigger(self, target: str, part_id: str | None, station: bool = False
                      ) -> tuple[int, dict]:
        """Asked of the engine process, where the cameras are."""
        fut, _ = self._call("repository", "trigger", (target, part_id, station))
        return await fut

    async def capture_recent(self, record_id: int) -> str | None:
        """Asked of the engine process, which keeps the recent frames."""
        fut, _ = self._call("repository", "capture_recent", (record_id,))
        return await fut

    async def camera_states(self) -> list[dict]:
        fut, _ = self._call("repository", "camera_states", ())
        return await fut

    async def metrics_text(self) -> bytes:
        fut, _ = self._call("metrics")
        return await fut

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work; wait (up to ``timeout_s``) for the answers of accepted requests."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline and not self.lost.is_set():
            await asyncio.sleep(0.02)
        return not self._pending

    async def close(self) -> None:
        self._draining = True
        if self.channel is not None:
            self.channel.close()


class RemoteFeed:
    """The live results feed (:class:`~visionserve.livefeed.LiveFeed`) of a front-end process:
    its streams here, fed by the engine process's ``live`` messages while one is open; the
    stream limit, the kept events and the summary are the engine's (hub.py says the messages)."""

    def __init__(self, remote: RemoteEngine) -> None:
        self.remote = remote
        self.streams = LiveStreams(self._dropped)

    async def open(self, model: str | None, station: str | None, last_id: str | None
                   ) -> tuple[list[LiveEvent], LiveStream]:
        if self.streams.closing:
            raise Unavailable.shutting_down()
        fut, _ = self.remote._call("live_open", model, station, last_id)
        try:
            replay = await asyncio.shield(fut)
        except asyncio.CancelledError:  # the browser left first: the engine counted its stream
            fut.add_done_callback(self._opened_late)
            raise
        return replay, self.streams.add(model, station, replay, self._closed)

    def _closed(self, stream: LiveStream) -> None:
        self.streams.remove(stream)
        self._send(("live_close",))

    def _opened_late(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._send(("live_close",))

    def _dropped(self, n: int) -> None:
        self._send(("live_dropped", n))

    def _send(self, msg: tuple) -> None:
        channel = self.remote.channel
        if channel is not None:
            channel.send(msg)

    async def summary(self, model: str, minutes: int) -> dict:
        fut, _ = self.remote._call("live_summary", model, minutes)
        return await fut

    def shut(self) -> None:
        self.streams.shut()
