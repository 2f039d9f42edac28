"""The live results feed's parts (visionserve/livefeed.py, http/live.py's stream): events from a
tap's answers, the per-model ring and Last-Event-ID, the per-minute summary, the arming while a
console listens, a slow browser's bounded queue, a backed-up front end's outbox, the SSE bytes.
The whole feed on real servers is tests/integration/test_live.py."""

from __future__ import annotations

import asyncio
import types

import pytest

from visionserve import livefeed
from visionserve.errors import DeadlineExceeded, Unavailable
from visionserve.http import live
from visionserve.http.live import sse
from visionserve.livefeed import LiveEvent, LiveSource, LocalFeed, Minutes, Outbox


class Engine:
    """What the source taps itself into."""

    def __init__(self) -> None:
        self.taps: list = []

    def tap(self, listener) -> None:
        self.taps.append(listener)

    def untap(self, listener) -> None:
        self.taps.remove(listener)


class Task:
    def summary(self, result):
        return result, 1, 0.9

    def reasons(self, result):
        return ("scratch 3 mm",)


SERVED = types.SimpleNamespace(name="m", version=1, task=Task())


def _event(seq: int, model: str = "m", station: str | None = None) -> LiveEvent:
    return LiveEvent(seq, "boot", model, "1", station, None, f"P-{seq}", "OK", "ok", (), 1.0,
                     0.0, None, False)


def _pending(loop: asyncio.AbstractEventLoop, arrival: float) -> types.SimpleNamespace:
    return types.SimpleNamespace(future=loop.create_future(), arrival=arrival, captured=False)


async def test_answers_become_events_for_the_streams_and_the_ring():
    loop = asyncio.get_running_loop()
    engine = Engine()
    source = LiveSource(engine, limit=2)
    feed = LocalFeed(source)
    assert engine.taps == []  # nobody listens: not tapped
    replay, stream = await feed.open(None, None, None)
    assert replay == [] and engine.taps == [source]
    items = [_pending(loop, loop.time()) for _ in range(4)]
    source.watch(SERVED, items, ("A-1", "cam", "st-1", "rec"))
    items[1].captured = True
    items[0].future.set_result(types.SimpleNamespace(verdict="OK", result="ok"))
    items[1].future.set_result(types.SimpleNamespace(verdict="NG", result="dent"))
    items[2].future.set_exception(DeadlineExceeded("deadline of 5 ms passed"))
    items[3].future.cancel()
    source.refused(SERVED, 1, None, Unavailable("queue full", retry_after_s=1.0))
    events, missed = await stream.next(1.0)
    assert missed == 0
    assert [e.verdict for e in events] == ["REFUSED", "OK", "NG", "LATE", "ERROR"]
    by = {e.verdict: e for e in events}
    assert (by["OK"].part_id, by["OK"].camera, by["OK"].station, by["OK"].label) == \
        ("A-1", "cam", "st-1", "ok")
    assert by["NG"].reasons == ("scratch 3 mm",) and by["NG"].captured
    assert by["OK"].reasons == () and not by["OK"].captured
    assert by["LATE"].reasons == ("deadline of 5 ms passed",)
    assert by["REFUSED"].reasons == ("unavailable: queue full",) and by["REFUSED"].part_id is None
    assert by["ERROR"].reasons[0].startswith("cancelled")
    assert [e.seq for e in source.recent(None, None)] == sorted(e.seq for e in events)
    # the stream limit: one more fits, then 503
    _, second = await feed.open("m", "st-1", None)
    with pytest.raises(Unavailable, match="max_live_streams"):
        await feed.open(None, None, None)
    second.close()
    second.close()  # twice: counted once
    assert source.streams == 1
    _, third = await feed.open(None, None, None)
    third.close()
    stream.close()
    assert source.streams == 0 and engine.taps == [source]  # kept tapped while it lingers


async def test_recent_follows_filters_and_last_event_id():
    source = LiveSource(Engine(), limit=4)
    source.boot = "boot"
    for seq in range(1, 11):
        e = _event(seq, "a" if seq % 2 else "b", "S1" if seq <= 5 else "S2")
        source.rings.setdefault(e.model, livefeed.deque(maxlen=livefeed.RING)).append(e)
    assert [e.seq for e in source.recent(None, None)] == list(range(1, 11))
    assert [e.seq for e in source.recent("a", None)] == [1, 3, 5, 7, 9]
    assert [e.seq for e in source.recent("a", "S2")] == [7, 9]
    assert [e.seq for e in source.recent(None, None, "boot-7")] == [8, 9, 10]
    # an id of another run (a restart), or none of ours: everything kept
    assert len(source.recent(None, None, "other-7")) == 10
    assert len(source.recent(None, None, "garbage")) == 10


async def test_the_tap_goes_when_no_console_listened_for_the_linger(monkeypatch):
    monkeypatch.setattr(livefeed, "LINGER_S", 0.05)
    engine = Engine()
    source = LiveSource(engine, limit=1)
    feed = LocalFeed(source)
    _, stream = await feed.open(None, None, None)
    await asyncio.sleep(0.1)
    assert engine.taps == [source]  # a stream is open
    stream.close()
    await asyncio.sleep(1.2)
    assert engine.taps == [] and not source.tapped
    await feed.summary("m", 5)  # a summary read taps it again
    assert engine.taps == [source]
    source.close()
    assert engine.taps == []
    with pytest.raises(Unavailable, match="shutting down"):
        source.reserve()


async def test_a_slow_stream_loses_its_oldest_events_and_is_told(monkeypatch):
    monkeypatch.setattr(livefeed, "STREAM_QUEUE", 5)
    dropped: list[int] = []
    streams = livefeed.LiveStreams(dropped.append)
    stream = streams.add(None, None, [_event(1)], lambda s: None)
    stream.queue = livefeed.deque(maxlen=5)
    streams([_event(i) for i in range(1, 10)])  # 1 was replayed already
    events, missed = await stream.next(1.0)
    assert [e.seq for e in events] == [5, 6, 7, 8, 9] and missed == 3 and dropped == [3]
    assert await stream.next(0.01) == ([], 0)  # nothing came: the heartbeat's turn
    streams.shut()
    assert await stream.next(1.0) is None


async def test_a_backed_up_front_end_gets_its_events_later_oldest_dropped(monkeypatch):
    monkeypatch.setattr(livefeed, "OUTBOX", 4)
    sent: list[list[int]] = []
    dropped: list[int] = []
    backlog = [0]
    box = Outbox(lambda events: sent.append([e.seq for e in events]), lambda: backlog[0],
                 dropped.append)
    box([_event(1)])
    assert sent == [[1]]
    # the channel is backed up: the engine never waits
    backlog[0] = livefeed.OUTBOX_BACKLOG_BYTES + 1
    box([_event(2), _event(3)])
    box([_event(4), _event(5), _event(6)])
    assert sent == [[1]] and dropped == [1]
    await asyncio.sleep(livefeed.OUTBOX_RETRY_S * 2)
    assert sent == [[1]]
    backlog[0] = 0
    await asyncio.sleep(livefeed.OUTBOX_RETRY_S * 2)
    assert sent == [[1], [3, 4, 5, 6]]
    box.close()


def test_the_summary_counts_per_minute_with_latency_quantiles():
    m = Minutes()
    base = 1_000_000 * 60.0
    for i in range(100):
        m.add("OK" if i % 4 else "NG", float(i + 1), base + 1)
    m.add("LATE", 500.0, base + 2)
    m.add("REFUSED", 0.0, base + 61)
    m.add("ERROR", 3.0, base + 62)
    rows = m.summary(3, base + 70)
    assert [r["minute"] for r in rows] == [base - 60, base, base + 60]
    first, this, last = rows
    assert first == {"minute": base - 60, "ok": 0, "ng": 0, "late": 0, "refused": 0,
                     "error": 0, "p50_ms": None, "p99_ms": None}
    assert (this["ok"], this["ng"], this["late"]) == (75, 25, 1)
    assert this["p50_ms"] == pytest.approx(51, rel=0.06)
    assert this["p99_ms"] == pytest.approx(100, rel=0.06)
    assert (last["refused"], last["error"], last["p50_ms"]) == (1, 1, None)
    # older than the window: gone
    m.add("OK", 1.0, base + livefeed.WINDOW_MIN * 60 + 5)
    assert m.summary(livefeed.WINDOW_MIN, base + livefeed.WINDOW_MIN * 60 + 5)[0]["ok"] == 0


async def test_a_stream_gives_at_most_once_a_batch_time_what_came_meanwhile_along(monkeypatch):
    monkeypatch.setattr(livefeed, "STREAM_BATCH_S", 0.3)
    loop = asyncio.get_running_loop()
    streams = livefeed.LiveStreams(lambda n: None)
    stream = streams.add(None, None, [], lambda s: None)
    streams([_event(1)])
    assert [e.seq for e in (await stream.next(1.0))[0]] == [1]  # after a quiet spell: at once
    streams([_event(2)])
    loop.call_later(0.05, streams, [_event(3)])  # inside the batch time: goes along
    assert [e.seq for e in (await stream.next(1.0))[0]] == [2, 3]
    streams.shut()
    assert await stream.next(1.0) is None


def test_an_event_is_encoded_once_for_every_stream_that_sends_it():
    event = _event(7)
    assert live._encoded(event) is live._encoded(event)
    assert live._events([event, _event(8)]) == live._encoded(event) + live._encoded(_event(8))
    assert live._encoded(event).startswith(b"id: boot-7\ndata: {")


async def test_the_sse_bytes_replay_events_drops_heartbeat_and_end():
    streams = livefeed.LiveStreams(lambda n: None)
    closed: list = []
    stream = streams.add(None, None, [_event(1)], closed.append)
    out = sse([_event(1)], stream, heartbeat_s=0.01)
    first = await out.__anext__()
    assert first.startswith(b"retry: ") and b"id: boot-1\ndata: {" in first
    assert await out.__anext__() == b": heartbeat\n\n"
    stream.missed, stream.dropped = 2, 2
    streams([_event(2)])
    chunk = await out.__anext__()
    assert chunk.startswith(b"event: dropped\ndata: {\"dropped\": 2") and b"id: boot-2\n" in chunk
    streams.shut()
    assert (await out.__anext__()).startswith(b"event: shutdown\n")
    with pytest.raises(StopAsyncIteration):
        await out.__anext__()
    assert closed == [stream]
