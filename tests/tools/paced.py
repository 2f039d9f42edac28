"""Load at half the saturation rate for the changeover tests (model swaps, recipe switches).

The frames go through the load generator's raw keep-alive HTTP client
(``visionserve_tools/benchclient/wire.py``, tens of microseconds a request): httpx costs about a
millisecond a request, so on the 2-core machine the client took half the cores itself and its own
backlogs showed as the server's latency. Saturation is measured closed loop (8 senders, 2 s); the
open loop then paces half of it from 32 senders, as the bench's generator does (no task or
connection per frame). Latency runs from a request's write to its answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from visionserve_tools.benchclient import wire


@dataclass
class Answer:
    sent: float  # time.monotonic()
    answered: float
    status: int
    body: dict

    @property
    def latency_ms(self) -> float:
        return (self.answered - self.sent) * 1000


@dataclass
class PacedLoad:
    """``POST path`` with ``frame`` (``content_type``) to the server at ``url``."""

    url: str
    path: str
    frame: bytes
    content_type: str
    answers: list[Answer] = field(default_factory=list)
    rate: float = 0.0
    _idle: list[wire.HttpConnection] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.host, port = self.url.rsplit("//", 1)[1].rsplit(":", 1)
        self.port = int(port)
        self.head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\n"
                     f"Content-Type: {self.content_type}\r\nContent-Length: {len(self.frame)}\r\n"
                     "\r\n").encode()

    async def one(self) -> None:
        conn = self._idle.pop() if self._idle else \
            await wire.HttpConnection(self.host, self.port).open()
        sent = time.monotonic()
        status, _, data = await conn.request(self.head, self.frame)
        self.answers.append(Answer(sent, time.monotonic(), status, json.loads(data)))
        self._idle.append(conn)

    async def measure_half_saturation(self, seconds: float = 2.0, senders: int = 8) -> float:
        """Closed loop for ``seconds``; sets (and returns) ``rate`` to half the throughput."""
        async def closed() -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await self.one()

        await asyncio.gather(*(closed() for _ in range(senders)))
        self.rate = len(self.answers) / seconds / 2
        self.answers.clear()
        return self.rate

    async def open_loop(self, seconds: float, senders: int = 32) -> None:
        """Paced sends at ``rate`` for ``seconds``."""
        start, n = time.monotonic(), int(seconds * self.rate)
        due = iter(start + i / self.rate for i in range(n))

        async def sender() -> None:
            for t in due:
                await asyncio.sleep(max(0.0, t - time.monotonic()))
                await self.one()

        await asyncio.gather(*(sender() for _ in range(senders)))

    async def around(self, change: Callable[[int], Awaitable[None]], count: int = 10,
                     steady_s: float = 4.0, gap_s: float = 0.4, tail_s: float = 1.0) -> float:
        """Half the saturation rate: ``steady_s`` steady, then ``change(k)`` for k in
        range(``count``), ``gap_s`` apart, then ``tail_s`` more. Returns when the steady window
        ended (time.monotonic()); the connections are closed afterwards."""
        await self.measure_half_saturation()
        steady_end = time.monotonic() + steady_s

        async def changes() -> None:
            await asyncio.sleep(steady_s + 0.5)
            for k in range(count):
                await change(k)
                await asyncio.sleep(gap_s)

        changing = asyncio.create_task(changes())
        try:
            await self.open_loop(steady_s + 0.5 + count * (gap_s + 0.1) + tail_s)
            await changing
        finally:
            self.close()
        return steady_end

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    def p99_ms(self, start: float = float("-inf"), end: float = float("inf")) -> float:
        """p99 latency of the frames sent in [start, end]."""
        lat = [a.latency_ms for a in self.answers if start <= a.sent <= end]
        return float(np.percentile(lat, 99))

    def record(self, record_property, steady_end: float, start: float, end: float,
               during: str) -> tuple[float, float]:
        """p99 of the steady window (up to ``steady_end``) and of [``start``, ``end``], written as
        junit properties ``p99_steady_ms`` and ``p99_<during>_ms`` with the slowest answers: a
        benchmark figure the changeover tests record and do not assert (docs/benchmarks.md)."""
        steady, changing = self.p99_ms(end=steady_end), self.p99_ms(start, end)
        record_property("p99_steady_ms", round(steady, 1))
        record_property(f"p99_{during}_ms", round(changing, 1))
        record_property("slowest", repr(self.slowest()))
        return steady, changing

    def slowest(self, n: int = 5) -> list[tuple[str, float, dict]]:
        """For a failure message: the slowest answers, when they were sent, and the server's
        own timing of them (a client-side stall shows as a long latency with a short
        ``total_ms``)."""
        worst = sorted(self.answers, key=lambda a: a.latency_ms)[-n:]
        return [(f"{a.latency_ms:.0f} ms", a.sent, a.body.get("timing", {})) for a in worst]
