"""The front-end side: an engine look-alike that the HTTP app and the gRPC servicer call unchanged.

Lookups (``get``, ``entry``, readiness) answer from what the engine process last said; ``infer``
writes the frames into this process's arena and waits for the answer; ``statistics`` and
``metrics_text`` ask the engine process. See :mod:`visionserve.frontends.hub` for the messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .. import errors
from ..engine import ModelLookup, ModelStats
from ..errors import Unavailable, VisionServeError
from ..imaging import Frame
from ..logs import request_id
from .arena import Arena
from .channel import Channel

log = logging.getLogger(__name__)


@dataclass
class ServedView:
    """A served version as a front end sees it: what the OIP/inspect answers need."""

    entry: object
    version: int
    config: object
    backend_info: dict
    ready: bool = False
    stats: ModelStats = field(default_factory=ModelStats)

    @property
    def name(self) -> str:
        return self.entry.name


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class RemoteEngine(ModelLookup):
    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.channel: Channel | None = None
        self.entries: dict = {}
        self.served: dict[tuple[str, int], ServedView] = {}
        self._ready = False
        self._engine_draining = False
        self._draining = False
        self._pending: dict[int, tuple[asyncio.Future, list[tuple[int, int]]]] = {}
        self._ids = itertools.count(1)
        self.connected = asyncio.Event()
        self.lost = asyncio.Event()

    # --- the channel -------------------------------------------------------------------------

    def on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "state":
            _, ready, draining, per_model, models = msg
            if models is not None:
                entries, infos = models
                self.entries = entries
                self.served = {k: self.served.get(k) or ServedView(i.entry, i.version, i.config, i.backend_info)
                               for k, i in infos.items()}
            for k, r in per_model.items():
                if k in self.served:
                    self.served[k].ready = r
            self._ready, self._engine_draining = ready, draining
            self.connected.set()
            return
        rid = msg[1]
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        fut, extents = pending
        for off, n in extents:
            self.arena.free(off, n)
        if fut.done():
            return
        if kind in ("result", "reply"):
            fut.set_result(msg[2])
        elif kind == "error":
            _, _, name, message, retry_after = msg
            if name == "Cancelled":
                fut.cancel()
            else:
                cls = getattr(errors, name, None)
                if not (isinstance(cls, type) and issubclass(cls, VisionServeError)):
                    cls = errors.InternalError
                fut.set_exception(cls(message, retry_after_s=retry_after))

    def on_lost(self) -> None:
        if not self._draining:
            log.error("the engine process closed the channel; this front end stops")
        self._ready = False
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(Unavailable("the server's engine process is gone", retry_after_s=1.0))
        self._pending.clear()
        self.lost.set()

    def _check_reachable(self) -> None:
        if self.channel is None or self.channel.closed:
            raise Unavailable("the server's engine process is not reachable", retry_after_s=1.0)

    def _call(self, msg_head: str, *rest, extents: list[tuple[int, int]] | None = None
              ) -> tuple[asyncio.Future, int]:
        """Send ``(msg_head, id, *rest)``; the future gets the engine's answer to that id."""
        self._check_reachable()
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, extents or [])
        self.channel.send((msg_head, rid, *rest))
        return fut, rid

    # --- what the front ends call ------------------------------------------------------------

    @property
    def live(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return self._ready and not self._draining and not self._engine_draining

    @property
    def draining(self) -> bool:
        return self._draining or self._engine_draining

    async def infer(self, name: str, version, frames: list[Frame], *, deadline_ms: float | None = None,
                    priority: int | None = None, arrival: float | None = None):
        arrival = time.monotonic() if arrival is None else arrival
        served = self.get(name, version)
        if self._draining:
            raise Unavailable.shutting_down()
        self._check_reachable()  # before the frames take arena space that only an answer frees
        descs, extents = [], []
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
        fut, rid = self._call("infer", name, version, descs, deadline_ms, priority, arrival, request_id.get(),
                              extents=extents)
        try:
            results = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the client went away: the engine drops its frames; the extents are freed on its answer
            if not fut.done():
                self.channel.send(("cancel", rid))
                fut.add_done_callback(_retrieve)  # nobody awaits it any more
            raise
        return served, results

    async def statistics(self, name: str = "", version=None) -> list[ServedView]:
        self.select(name, version)  # unknown names fail here, as in the engine
        fut, _ = self._call("stats", name, version)
        out = []
        for model, v, stats in await fut:
            view = self.served.get((model, v))
            if view is not None:
                view.stats = stats
                out.append(view)
        return out

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
