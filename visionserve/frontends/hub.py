"""The engine side: requests from every front-end process go into the one engine (one batch queue
per model); answers go back on the link they came from.

Messages (tuples) a front end sends:
  ``("infer", rid, model, version, frames, deadline_ms, priority, arrival, request_id, origin)``:
  ``frames`` are ``(kind, width, height, channels, shape, offset, length, inline)`` with the
  bytes in the arena at ``offset`` (or, when the arena was full, ``inline``); ``arrival`` is
  ``time.monotonic()``, which is one clock for all processes of a machine; ``request_id`` is the
  client's (for log lines); ``origin`` (a :class:`~visionserve.dataplane.Origin`) is where the
  frames come from, for the PLC result bus and the records, or None.
  ``("cancel", rid)``: the client went away; ``("cancel", rid, kind)``: the front end answered the
  request itself (``kind`` "deadline": its own deadline timer, "unavailable": this process was
  silent), and the engine counts that answer unless it had answered first.
  ``("count", model, kind)``: the front end answered a request with an error before sending it
  here (bad body, unknown model, ...); counted in this process's metrics, as all answers are.
  ``("stats", rid, model, version)`` and ``("metrics", rid)``.
  ``("verdict", rid, model, changes, caller)``: the model's ``[verdict]`` (``changes`` None), or
  set (``Engine.verdict``); every front end is then sent the models again.
  ``("recipe", rid, station, recipe, caller)``: switch a station's recipe
  (``Engine.switch_recipe``); every front end is then sent the stations' recipes, and the reply
  waits until every front end has said it applies them, so a frame the caller sends next, through
  any front end, is decided under the new recipe (the same for verdict changes).
  ``("applied", generation)``: the front end applies the settings of that generation.
  ``("live_open", rid, model, station, last_id)``: a live results stream opens there (counted
  against ``--max-live-streams``); the reply is the kept events it starts with, and from then on
  the front end is sent ``("live", [LiveEvent])`` until its last stream closes:
  ``("live_close",)`` each. ``("live_summary", rid, model, minutes)``: the per-minute summary.
  ``("live_dropped", n)``: its streams lost ``n`` events (a slow browser), for the metrics.
  ``("repository", rid, call, args)``: ``call`` one of ``repository_index``, ``load_model``,
  ``unload_model``, ``reload_model``, ``trigger`` (a camera's or station's, with (target, part
  id, station)), ``camera_states`` and ``capture_recent`` (a flagged record's frame, with
  (record id,)) of the engine, with ``args``; a swap sends every front end the models before
  any frame reaches the new versions (``Engine.on_change``).
  ``("preview", rid, model, changes)``: what a ``[verdict]`` change would make of the model's
  last answered frames (``Engine.preview_verdict``); nothing changes.
and what the hub sends back:
  ``("state", ready, draining, {(model, version): ready}, models, generation)``: on connect and
  on every change; ``models`` (the repository entries, the served versions' configs and the
  stations' recipes) only when they change, and then the front end answers ``("applied",
  generation)``.
  ``("result", rid, [FrameResult], version)`` (the version that answered: the one current when
  the engine admitted the frames), ``("error", rid, error class name, message, retry_after_s,
  late_ms)`` exactly once per ``infer``, counted in the metrics here before it is sent;
  ``("reply", rid, value)`` or an error for the others.
  ``("live", [LiveEvent])``: the answers of a loop turn, while a live stream is open there
  (:class:`~visionserve.livefeed.Outbox`: held while its channel is backed up, oldest dropped).
  ``("beat",)`` every ``HEARTBEAT_S``: a front end that hears nothing for a while stops taking work.
  ``("free", [rid, ...])`` in zero-copy mode: the engine holds none of these requests'
  frames any more, their extents may be reused (before or after their answers; see arena.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
import traceback

import numpy as np

from ..dataplane import ModelView
from ..errors import INTERNAL_MESSAGE, InternalError, VisionServeError
from ..framing import Channel, connect
from ..imaging import Frame
from ..livefeed import Outbox
from ..logs import request_id
from .arena import ArenaReader

log = logging.getLogger(__name__)

#: how often readiness is compared with what the front ends were told (told at once on drain)
STATE_POLL_S = 0.05
#: how often every front end is told that this process is alive (see remote.HEARTBEAT_TIMEOUT_S)
HEARTBEAT_S = 0.2
#: the engine's calls a front end may make with a "repository" message (and the preview's, and
#: the cameras', which live in this process)
REPOSITORY_CALLS = ("repository_index", "load_model", "unload_model", "reload_model",
                    "preview_verdict", "trigger", "camera_states", "capture_recent")


class Link:
    """One front-end process: its channel, its arena, its requests in progress."""

    def __init__(self, hub: Hub, index: int, arena: ArenaReader, zero_copy: bool = False) -> None:
        self.hub = hub
        self.index = index
        self.arena = arena
        # frames are views of the arena, released with "free" messages (arena.py): off in the
        # server, where reading frames in place measured no faster than copying them out
        self.zero_copy = zero_copy
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._released: list[int] = []  # request ids to tell the front end of, this loop turn
        self.channel: Channel | None = None
        # (served versions, settings generation) this front end has been told of, and the
        # settings generation it has said it applies
        self.models_sent: tuple[int, int] = (-1, -1)
        self.applied = -1
        # request id -> its frame's future (or their gather), its model, its number of frames
        self.tasks: dict[int, tuple[asyncio.Future, str, int]] = {}
        self.lost = asyncio.Event()
        # live results streams open in this front end, and its outbox while there are some
        self.live_streams = 0
        self.outbox: Outbox | None = None

    @property
    def ch(self) -> Channel:
        """The channel: connected before the front end's first message, and before the hub keeps
        the link."""
        assert self.channel is not None
        return self.channel

    def on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "infer":
            _, rid, name, version, descs, deadline_ms, priority, arrival, client_id, origin = msg
            # zero-copy: the frames in the arena hold this lease; the front end frees their
            # extents once it is gone. Else they are copied out now: the extents may be reused
            # after the answer.
            lease = _Lease(self, rid) if self.zero_copy and any(d[7] is None for d in descs) \
                else None
            frames: list[Frame] = []
            try:
                for d in descs:  # not a comprehension: that would keep the lease in a cell here
                    frames.append(self._frame(d, lease))
            # answered all the same: the front end frees the extents on the answer (or once the
            # lease, which no frame holds, is gone)
            except Exception:
                # the traceback (a log handler may keep it) must not hold the lease
                frames.clear()
                lease = None
                log.exception("front end %d sent frames that cannot be read", self.index)
                traceback.clear_frames(sys.exc_info()[2])
                self.hub.engine.count_error(name, "internal", len(descs))
                self._error(rid, InternalError(INTERNAL_MESSAGE))
                return
            lease = None  # the frames hold it now: this frame must not (a traceback may keep it)
            # the frames' and the answer callback's log lines name it
            token = request_id.set(client_id)
            try:
                self._infer(rid, name, version, frames, deadline_ms, priority, arrival, origin)
            finally:
                request_id.reset(token)
        elif kind == "cancel":
            entry = self.tasks.get(msg[1])
            if entry is not None and not entry[0].done():
                # the front end answered it (LATE, 503): not answered here, count that
                if len(msg) > 2:
                    self.hub.engine.count_error(entry[1], msg[2], entry[2])
                entry[0].cancel()
        elif kind == "count":
            self.hub.engine.count_error(msg[1], msg[2])
        elif kind == "applied":  # the front end applies the settings of this generation
            self.applied = max(self.applied, msg[1])
            self.hub.settled.set()
        elif kind == "stats":
            _, rid, name, version = msg
            try:
                stats = [(s.name, s.version, s.stats)
                         for s in self.hub.engine.select(name, version)]
                self.ch.send(("reply", rid, stats))
            except VisionServeError as exc:
                self._error(rid, exc)
        elif kind in ("verdict", "recipe"):
            _, rid, *args = msg
            engine = self.hub.engine
            call = engine.verdict if kind == "verdict" else engine.switch_recipe
            self._background(self._change(rid, kind, call, args))
        elif kind == "repository":
            _, rid, call, args = msg
            self._background(self._repository(rid, call, args))
        elif kind in ("live_open", "live_close", "live_summary", "live_dropped"):
            self._live(kind, msg)
        elif kind == "preview":
            _, rid, *args = msg
            self._background(self._repository(rid, "preview_verdict", tuple(args)))
        elif kind == "metrics":
            from prometheus_client import generate_latest

            self.ch.send(("reply", msg[1], generate_latest()))
        else:
            log.error("front end %d sent an unknown message %r", self.index, kind)

    def _live(self, kind: str, msg: tuple) -> None:
        source = self.hub.engine.live_source
        if kind == "live_open":
            _, rid, model, station, last_id = msg
            try:
                source.reserve()
            except VisionServeError as exc:
                self._error(rid, exc)
                return
            if self.outbox is None:
                transport = self.ch.transport
                assert transport is not None  # connected before its first message
                self.outbox = Outbox(lambda events: self.ch.send(("live", events)),
                                     transport.get_write_buffer_size,
                                     lambda n: source.count_dropped("frontend", n))
                source.attach(self.outbox)
            self.live_streams += 1
            self.ch.send(("reply", rid, source.recent(model, station, last_id)))
        elif kind == "live_close":
            if self.live_streams:
                self.live_streams -= 1
                source.release()
            if not self.live_streams:
                self._close_outbox()
        elif kind == "live_summary":
            _, rid, model, minutes = msg
            self.ch.send(("reply", rid, source.summary(model, minutes)))
        else:
            source.count_dropped("stream", msg[1])

    def _close_outbox(self) -> None:
        if self.outbox is not None:
            self.hub.engine.live_source.detach(self.outbox)
            self.outbox.close()
            self.outbox = None

    def _background(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.hub.background.add(task)
        task.add_done_callback(self.hub.background.discard)

    async def _repository(self, rid: int, call: str, args: tuple) -> None:
        try:
            if call not in REPOSITORY_CALLS:
                raise InternalError(f"unknown repository call {call!r}")
            self.ch.send(("reply", rid, await getattr(self.hub.engine, call)(*args)))
        except VisionServeError as exc:
            self._error(rid, exc)
        except Exception:
            log.exception("repository call %s for front end %d failed", call, self.index)
            self._error(rid, InternalError(INTERNAL_MESSAGE))

    async def _change(self, rid: int, kind: str, call, args: list) -> None:
        """A verdict or recipe call of the engine, for a front end; the new settings (models,
        stations' recipes) then go to every front end."""
        try:
            reply = await call(*args)
        except VisionServeError as exc:
            self._error(rid, exc)
        except Exception:
            log.exception("%s call %r for front end %d failed", kind, args[:2], self.index)
            self._error(rid, InternalError(INTERNAL_MESSAGE))
        else:
            # every front end applies the change before the caller hears it is done: a frame
            # the caller sends next, through whichever front end, is decided under it
            self.hub.publish()
            await self.hub.applied_everywhere(getattr(self.hub.engine, "generation", 0))
            self.ch.send(("reply", rid, reply))

    def _frame(self, desc: tuple, lease: _Lease | None = None) -> Frame:
        kind, width, height, channels, shape, off, n, inline = desc
        if lease is not None and inline is None:
            view = self.arena.view(off, n, lease)
            # a view of the view (reshape), which keeps it and so the lease: np.frombuffer of it
            # would refer to the whole arena instead, and the lease would go with this function
            return Frame(kind, view.reshape(shape) if kind == "raw" else view, width, height,
                         channels)
        data: bytes | np.ndarray = inline if inline is not None else self.arena.read(off, n)
        if kind == "raw":
            data = np.frombuffer(data, dtype=np.uint8).reshape(shape)
        return Frame(kind, data, width, height, channels)

    def release(self, rid: int) -> None:
        """Request ``rid``'s frames are no longer held here (its lease is gone): the front end is
        told at the end of this loop turn, with the others released in it. From any thread."""
        if threading.get_ident() != self._loop_thread:
            with contextlib.suppress(RuntimeError):  # the loop closed: the front end is gone too
                self._loop.call_soon_threadsafe(self.release, rid)
            return
        if not self._released:
            self._loop.call_soon(self._send_released)
        self._released.append(rid)

    def _send_released(self) -> None:
        rids, self._released = self._released, []
        if self.channel is not None and not self.channel.closed:
            self.channel.send(("free", rids))

    def _infer(self, rid, name, version, frames, deadline_ms, priority, arrival,
               origin=None) -> None:
        """Into the engine's one submit path, answered from its future's callback: no task per
        request (the engine process is the one all front ends share, so its cost per request
        sets the ceiling); the engine counts and records the answer."""
        engine = self.hub.engine
        try:
            answer = engine.submit(name, version, frames, deadline_ms=deadline_ms,
                                   priority=priority, arrival=arrival, origin=origin)
        except VisionServeError as exc:  # unknown model or version: refused, and counted here
            engine.count_error(name, exc, len(frames))
            self._error(rid, exc)
            # its traceback holds the frames in the engine's frames below (with zero-copy: their
            # lease), for as long as anything keeps the exception
            exc.__traceback__ = None
            return
        self.tasks[rid] = (answer, name, len(frames))  # "cancel" cancels it: its frames are dropped

        def answered(f: asyncio.Future) -> None:
            self.tasks.pop(rid, None)
            if f.cancelled():
                log.debug("request cancelled (front end %d): its frames are dropped", self.index)
                self.ch.send(("error", rid, "Cancelled", "cancelled", None))
            elif isinstance(exc := f.exception(), VisionServeError):
                self._error(rid, exc)
            elif exc is not None:
                log.error("inference for front end %d failed", self.index, exc_info=exc)
                self._error(rid, InternalError(INTERNAL_MESSAGE))
            else:
                served, results = f.result()
                self.ch.send(("result", rid, results, served.version))

        answer.add_done_callback(answered)

    def _error(self, rid: int, exc: VisionServeError) -> None:
        self.ch.send(("error", rid, type(exc).__name__, exc.message, exc.retry_after_s,
                           getattr(exc, "late_ms", None)))

    def on_lost(self) -> None:
        # the front end died or stopped: its clients are gone, so are their frames and streams
        for task, _, _ in list(self.tasks.values()):
            task.cancel()
        if self.live_streams:
            self.hub.engine.live_source.release(self.live_streams)
            self.live_streams = 0
        self._close_outbox()
        self.lost.set()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


class _Lease:
    """One request's frames in the arena (zero-copy mode): each frame's bytes hold it
    (:class:`~visionserve.frontends.arena.ArenaBytes`), and when the last is gone - decoded and
    dropped, or let go by whatever kept it - its link tells the front end to free the extents."""

    __slots__ = ("link", "rid")

    def __init__(self, link: Link, rid: int) -> None:
        self.link = link
        self.rid = rid

    def __del__(self) -> None:
        # never raise from a finaliser (at interpreter shutdown the loop may be gone)
        with contextlib.suppress(Exception):
            self.link.release(self.rid)


class Hub:
    """Every front end's way into ``engine``; keeps them told of readiness."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.links: dict[int, Link] = {}
        self.settled = asyncio.Event()  # a front end confirmed a settings generation
        self.background: set[asyncio.Task] = set()  # running verdict changes, kept from the GC
        self._last: tuple | None = None
        self._watcher: asyncio.Task | None = None

    async def attach(self, index: int, sock: socket.socket, arena_fd: int, arena_size: int) -> Link:
        """Serve front end ``index`` on ``sock`` (our end of its socket pair)."""
        link = Link(self, index, ArenaReader(arena_fd, arena_size))
        link.channel = await connect(sock, link.on_message, link.on_lost)
        self.links[index] = link
        if self.publish not in self.engine.on_change:
            self.engine.on_change.append(self.publish)
        self._send_state(link)
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return link

    def detach(self, index: int) -> None:
        link = self.links.pop(index, None)
        if link is not None:
            link.close()
            link.arena.close()

    def _state(self) -> tuple:
        e = self.engine
        return (e.ready, e.draining, {k: s.ready for k, s in e.served.items()},
                getattr(e, "generation", 0))

    def _send_state(self, link: Link) -> None:
        ready, draining, per_model, generation = self._state()
        models = None
        served = self.engine.served
        if link.models_sent != (len(served), generation):
            models = (self.engine.entries, {
                k: ModelView.of(s)
                for k, s in served.items()}, self.engine.recipes)
            link.models_sent = (len(served), generation)
        link.ch.send(("state", ready, draining, per_model, models, generation))

    async def applied_everywhere(self, generation: int, timeout_s: float = 2.0) -> bool:
        """Wait until every connected front end says it applies the settings of
        ``generation`` (or later); False (logged) if one did not within ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            behind = [i for i, link in self.links.items()
                      if link.channel is not None and not link.ch.closed
                      and link.applied < generation]
            if not behind:
                return True
            left = end - time.monotonic()
            if left <= 0:
                log.warning("front end(s) %s did not confirm the settings of generation %d "
                            "within %.1f s", behind, generation, timeout_s)
                return False
            self.settled.clear()
            try:
                await asyncio.wait_for(self.settled.wait(), left)
            except TimeoutError:
                pass

    def publish(self) -> None:
        """Tell every front end the current state if it changed (also called at once on drain)."""
        state = self._state()
        if state == self._last:
            return
        self._last = state
        for link in list(self.links.values()):
            if not link.ch.closed:
                self._send_state(link)

    async def _watch(self) -> None:
        beat = 0.0
        while True:
            await asyncio.sleep(STATE_POLL_S)
            self.publish()
            if time.monotonic() - beat >= HEARTBEAT_S:
                beat = time.monotonic()
                for link in list(self.links.values()):
                    link.ch.send(("beat",))

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for index in list(self.links):
            self.detach(index)
