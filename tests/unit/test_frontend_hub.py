"""The front-end / engine split (``--frontends N``) without subprocesses: a real Engine on the tiny
model, the Hub, and a RemoteEngine joined by a real Unix socket pair and a real memfd arena, all
in one event loop. The multi-process server itself is in tests/integration/test_frontends.py."""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket

import numpy as np
import pytest

from visionserve import imaging
from visionserve.config import ServerSettings
from visionserve.engine import Engine
from visionserve.errors import DeadlineExceeded, InvalidInput, NotFound, Unavailable
from visionserve.execution.results import FrameResult
from visionserve.framing import Channel, connect, encode
from visionserve.frontends.arena import ALIGN, Arena, create_memfd
from visionserve.frontends.hub import Hub
from visionserve.frontends.remote import RemoteEngine
from visionserve.tasks.classification import Classified

pytestmark = pytest.mark.gpu_path  # takes CUDA branches where CUDA is: run with the GPU tests

# --- the arena ---------------------------------------------------------------------------------


def arena(size: int = 4096) -> Arena:
    fd = create_memfd(size)
    try:
        return Arena(fd, size)
    finally:
        import os

        os.close(fd)


def test_arena_allocates_aligned_and_refuses_when_full():
    a = arena(1024)
    offs = [a.alloc(100) for _ in range(8)]  # 100 -> 128 bytes each
    assert offs == [i * 128 for i in range(8)]
    assert all(o % ALIGN == 0 for o in offs)
    assert a.alloc(1) is None and a.used == 1024


def test_arena_free_coalesces_neighbours():
    a = arena(1024)
    offs = [a.alloc(256) for _ in range(4)]
    a.free(offs[1], 256)
    a.free(offs[3], 256)
    assert a.alloc(512) is None  # two holes of 256, not one of 512
    a.free(offs[2], 256)  # joins both neighbours
    assert a.free_extents == 1
    assert a.alloc(768) == 256
    a.free(256, 768)
    a.free(offs[0], 256)
    assert a.free_extents == 1 and a.used == 0 and a.alloc(1024) == 0


def test_arena_write_is_seen_through_another_mapping():
    import mmap
    import os

    fd = create_memfd(4096)
    try:
        a = Arena(fd, 4096)
        other = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    off = a.alloc(5)
    a.write(off, b"hello")
    pixels = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)[:, ::-1]  # not contiguous
    off2 = a.alloc(pixels.nbytes)
    a.write(off2, np.ascontiguousarray(pixels))
    assert other[off:off + 5] == b"hello"
    assert other[off2:off2 + 12] == np.ascontiguousarray(pixels).tobytes()


# --- the channel -------------------------------------------------------------------------------


def test_channel_reassembles_messages_split_anywhere():
    got = []
    ch = Channel(got.append, lambda: None)
    msgs = [("infer", 1, "m", None, [b"x" * 1000]), ("cancel", 1), ("metrics", 2)]
    # one loop turn's messages, then a turn of one message
    stream = encode(msgs) + encode([("beat",)])
    for i in range(0, len(stream), 7):  # 7-byte pieces: lengths and bodies cut in the middle
        ch.data_received(stream[i:i + 7])
    assert got == [*msgs, ("beat",)]


async def test_channel_sends_a_loop_turns_messages_together_and_in_order():
    """Messages sent in one loop turn arrive in one piece, in order, as sent; a message that
    cannot be pickled is dropped alone; the next turn's messages come in a piece of their own."""
    a, b = socket.socketpair()
    got: list = []
    pieces: list[int] = []
    receiver = await connect(b, got.append, lambda: None)
    counted = receiver.data_received

    def counting(data: bytes) -> None:
        pieces.append(len(data))
        counted(data)

    receiver.data_received = counting  # type: ignore[method-assign]
    sender = await connect(a, lambda m: None, lambda: None)
    first = [("result", i, [FrameResult("OK", None, 4, 1.0, 2.0, 3.0, True)], 1) for i in range(5)]
    for m in first[:2]:
        sender.send(m)
    sender.send(("reply", 9, lambda: None))  # cannot be pickled
    for m in first[2:]:
        sender.send(m)
    await asyncio.sleep(0.05)
    assert got == first and len(pieces) == 1
    sender.send(("beat",))
    await asyncio.sleep(0.05)
    assert got == [*first, ("beat",)] and len(pieces) == 2
    sender.close()
    receiver.close()


def test_a_turn_over_the_message_limit_goes_as_one_list_per_message(monkeypatch):
    """A loop turn whose list would pass the receiver's limit goes out message by message, each
    under the limit, and arrives whole and in order."""
    from visionserve import framing

    msgs = [("result", i, [bytes([i]) * 400]) for i in range(5)]
    monkeypatch.setattr(framing, "MAX_MESSAGE", 1000)  # one message fits, two do not
    stream = encode(msgs)
    got: list = []
    receiver = Channel(got.append, lambda: None)
    receiver.data_received(stream)
    assert got == msgs
    assert len(stream) > 5 * 400 and len(encode(msgs[:1])) < 1000


def test_answers_pickle_to_what_was_sent():
    """A frame's answer crosses to the front end equal: the envelope and a classification's
    label, index, score and scores (float32)."""
    scores = np.array([0.1, 0.7, 0.2], dtype=np.float32)
    answer = FrameResult("NG", Classified("scratch", 1, 0.7, scores), 8, 1.5, 2.5, 4.0, True)
    back = pickle.loads(encode([answer])[4:])[0]
    assert (back.verdict, back.batch_size, back.queue_ms, back.compute_ms, back.total_ms,
            back.deadline_met) == ("NG", 8, 1.5, 2.5, 4.0, True)
    r = back.result
    assert (r.label, r.index, r.score) == ("scratch", 1, pytest.approx(0.7))
    assert r.scores.dtype == np.float32 and r.scores.tolist() == scores.tolist()


def test_detection_and_anomaly_answers_pickle_as_their_fields():
    """Detection and anomaly answers cross to the front end equal, each object rebuilt from its
    fields in one call (no BUILD step: a frozen dataclass's own ``__setstate__`` sets each field
    in Python, in the engine's loop)."""
    import pickletools
    from dataclasses import dataclass, field

    from visionserve.tasks.anomaly import Anomaly, FrameRegion
    from visionserve.tasks.base import pickled_as_fields
    from visionserve.tasks.detection import Detected, Detection
    from visionserve.tasks.rules import Reason

    mask = np.eye(4, dtype=bool)
    detected = Detected((Detection("scratch", 1, 0.9, (1.0, 2.0, 30.0, 40.0), 1064.0),
                         Detection("dent", 2, 0.6, (5.0, 6.0, 7.0, 8.0), 4.0, mask)),
                        (Reason("defect:scratch", "a scratch", (0,)),))
    anomaly = Anomaly(0.8, 12.5, (FrameRegion((1.0, 2.0, 3.0, 4.0), 5.0, 0.9),), 1, ("area",),
                      np.linspace(0, 1, 16, dtype=np.float32).reshape(4, 4))
    plain = Detected(detected.detections[:1], detected.reasons)  # no arrays (theirs BUILD)
    wire = encode([FrameResult("NG", plain, 4, 1.0, 2.0, 3.0, True)])[4:]
    assert "BUILD" not in {op.name for op, _, _ in pickletools.genops(wire)}
    assert pickle.loads(wire)[0].result == plain
    for result in (detected, anomaly):
        wire = encode([FrameResult("NG", result, 4, 1.0, 2.0, 3.0, True)])[4:]
        back = pickle.loads(wire)[0].result
        assert type(back) is type(result)
    assert back.map.tolist() == anomaly.map.tolist() and back.regions == anomaly.regions
    assert (back.score, back.raw_score, back.region_count, back.reasons) == (0.8, 12.5, 1, ("area",))
    got = pickle.loads(pickle.dumps(detected))
    assert got.reasons == detected.reasons and got.detections[0] == detected.detections[0]
    assert got.detections[1].mask.tolist() == mask.tolist()

    @dataclass
    class Derived:  # a field set at construction: calling the class with it would not rebuild it
        a: int
        b: int = field(init=False, default=0)

    with pytest.raises(TypeError, match="plain __init__ fields"):
        pickled_as_fields(Derived)


def test_channel_survives_a_handler_error():
    got = []

    def handler(msg):
        if msg == "bad":
            raise ValueError("boom")
        got.append(msg)

    ch = Channel(handler, lambda: None)
    ch.data_received(encode(["bad", "good"]))  # the good one of the same turn still arrives
    ch.data_received(encode(["bad"]) + encode(["good"]))
    assert got == ["good", "good"]


# --- hub and remote engine, in one loop ---------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["copy", "zero-copy"])
async def pair(tiny_repo, request):
    """(engine, hub, remote): the remote engine is what a front-end process would hold; the
    engine copies the frames out of the arena (the server's way), or reads them in place (the
    zero-copy mode, off in the server: it measured no faster)."""
    import os

    eng = Engine(ServerSettings(models=tiny_repo, max_queue_delay_ms=1), device="cpu")
    eng.scan()
    hub = Hub(eng)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    size = 1024**2
    fd = create_memfd(size)
    remote = RemoteEngine(Arena(fd, size), zero_copy=request.param)
    remote.channel = await connect(theirs, remote.on_message, remote.on_lost)
    await hub.attach(0, ours, fd, size)
    hub.links[0].zero_copy = request.param
    os.close(fd)
    await asyncio.wait_for(remote.connected.wait(), 5)
    assert not remote.ready and "tiny" in remote.entries  # the repository is known before warm-up ends
    await eng.start()
    hub.publish()
    await _until(lambda: remote.ready)
    yield eng, hub, remote
    await remote.close()
    await hub.close()
    await eng.close()


async def _until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


def raw(value: int = 128) -> imaging.Frame:
    return imaging.raw_frame(np.full((32, 32, 3), value, np.uint8), (32, 32, 3))


def jpeg(value: int = 128) -> imaging.Frame:
    import cv2

    _ok, buf = cv2.imencode(".jpg", np.full((48, 64, 3), value, np.uint8))
    return imaging.encoded_frame(buf.tobytes())


async def test_remote_answers_equal_the_engines(pair):
    eng, _, remote = pair
    frames = [raw(0), jpeg(200), raw(255)]
    served, results = await remote.infer("tiny", None, frames)
    assert served.name == "tiny" and served.version == 1 and served.ready
    _, direct = await eng.infer("tiny", None, frames)
    assert [r.result.label for r in results] == [r.result.label for r in direct]
    for a, b in zip(results, direct):
        assert np.allclose(a.result.scores, b.result.scores, atol=1e-6)
    assert remote.arena.used == 0  # every extent back once answered


async def test_zero_copy_frames_are_read_in_place_and_their_extents_wait_for_the_engine(pair):
    """Zero-copy mode: the engine's frames are views of the front end's arena, not copies;
    an extent is reused only once the engine holds none of its request's frames, even after
    the answer (here a stand-in for a record that captures the frame's image)."""
    from visionserve.frontends.arena import ArenaBytes

    eng, hub, remote = pair
    if not hub.links[0].zero_copy:
        pytest.skip("the copying hub: covered by the other tests")
    held: list = []
    submit = eng.submit

    def keep(name, version, frames, **kw):
        held.extend(frames)
        return submit(name, version, frames, **kw)

    eng.submit = keep
    frames = [jpeg(200), raw(7)]
    _, results = await remote.infer("tiny", None, frames)
    assert len(results) == 2 and remote.arena.used > 0
    j, r = held
    assert isinstance(j.data, ArenaBytes) and bytes(j.data) == frames[0].data
    assert isinstance(r.data.base, ArenaBytes) and (r.data == frames[1].data).all()
    await asyncio.sleep(0.05)
    assert remote.arena.used > 0  # answered, but the engine still holds the frames
    del j, r
    held.clear()
    await _until(lambda: remote.arena.used == 0 and not remote._leased)
    eng.submit = submit
    _, (again,) = await remote.infer("tiny", None, [raw(7)])  # the space is used again
    assert again.result.label == results[1].result.label
    await _until(lambda: remote.arena.used == 0)


def test_a_frame_kept_long_gets_bytes_of_its_own_and_lets_the_arena_go():
    """``imaging.owned``: what keeps a frame long (a record's capture queue) copies a frame read
    in place (an arena view, its lease released at once), and keeps any other frame as it is."""
    import gc
    import os

    from visionserve.frontends.arena import ArenaReader

    fd = create_memfd(1 << 16)
    writer, reader = Arena(fd, 1 << 16), ArenaReader(fd, 1 << 16)
    os.close(fd)
    released = []

    class Lease:
        def __del__(self) -> None:
            released.append(True)

    data = jpeg(90).data
    off = writer.alloc(len(data))
    writer.write(off, data)
    in_place = imaging.Frame("jpeg", reader.view(off, len(data), Lease()), 64, 48)
    kept = imaging.owned(in_place)
    assert isinstance(kept.data, bytes) and kept.data == data
    del in_place
    gc.collect()
    assert released == [True]  # the copy does not hold the arena's space
    raw_frame = raw(3)
    for frame in (kept, raw_frame, imaging.Frame("raw", np.frombuffer(bytes(12), np.uint8)
                                                  .reshape(2, 2, 3), 2, 2)):
        assert imaging.owned(frame) is frame  # bytes, or an array of its own or over bytes
    raw_in_place = imaging.Frame("raw", reader.view(0, 12, Lease()).reshape(2, 2, 3), 2, 2)
    copy = imaging.owned(raw_in_place)
    assert copy.data.flags.owndata and copy.data.shape == (2, 2, 3)
    del raw_in_place, copy
    reader.close()
    writer.close()


async def test_a_cancelled_frames_arena_space_is_free_before_the_queue_forms_a_batch(tiny_repo):
    """Zero-copy mode: a frame cancelled while it waits in the queue (the client went
    away) is let go at once, not when the queue next forms a batch (here 5 s later): its arena
    space is the front end's again."""
    import os

    eng = Engine(ServerSettings(models=tiny_repo, max_queue_delay_ms=5000), device="cpu")
    await eng.start()
    hub = Hub(eng)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = create_memfd(1 << 20)
    remote = RemoteEngine(Arena(fd, 1 << 20), zero_copy=True)
    remote.channel = await connect(theirs, remote.on_message, remote.on_lost)
    await hub.attach(0, ours, fd, 1 << 20)
    hub.links[0].zero_copy = True
    os.close(fd)
    try:
        await _until(lambda: remote.ready)
        (served,) = eng.select("tiny", None)
        task = asyncio.ensure_future(remote.infer("tiny", None, [raw()], deadline_ms=60_000))
        await _until(lambda: served.batcher.queue_depth == 1)  # waiting for company
        assert remote.arena.used > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: remote.arena.used == 0, timeout=2.0)
        assert served.batcher.queue_depth == 0
    finally:
        await remote.close()
        await hub.close()
        await eng.close()


async def test_remote_errors_keep_their_class_and_message(pair):
    _, _, remote = pair
    with pytest.raises(NotFound, match="unknown model 'nope'"):
        await remote.infer("nope", None, [raw()])
    with pytest.raises(InvalidInput, match="priority"):
        await remote.infer("tiny", None, [raw()], priority=99)  # checked by the engine, sent back
    with pytest.raises(DeadlineExceeded):
        await remote.infer("tiny", None, [raw()], deadline_ms=0.001)
    assert remote.arena.used == 0


async def test_queue_full_comes_back_with_retry_after(tiny_repo):
    eng = Engine(ServerSettings(models=tiny_repo, max_queue_size=2, max_queue_delay_ms=1), device="cpu")
    await eng.start()
    hub = Hub(eng)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = create_memfd(1024**2)
    remote = RemoteEngine(Arena(fd, 1024**2))
    remote.channel = await connect(theirs, remote.on_message, remote.on_lost)
    await hub.attach(0, ours, fd, 1024**2)
    try:
        await _until(lambda: remote.ready)
        with pytest.raises(InvalidInput, match="at most 2"):
            await remote.infer("tiny", None, [raw()] * 3)
        # fill the queue from many requests at once: some are refused with a retry hint, none lost
        outcomes = await asyncio.gather(*(remote.infer("tiny", None, [raw()]) for _ in range(40)),
                                        return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, Unavailable)]
        answered = [o for o in outcomes if isinstance(o, tuple)]
        assert len(refused) + len(answered) == 40 and answered
        assert all(o.retry_after_s for o in refused)
    finally:
        await remote.close()
        await hub.close()
        await eng.close()


async def test_cancelled_request_frees_its_extent_after_the_engine_answers(pair):
    _eng, _, remote = pair
    big = imaging.raw_frame(np.zeros((480, 640, 3), np.uint8), (480, 640, 3))
    task = asyncio.ensure_future(remote.infer("tiny", None, [big] * 8))
    await asyncio.sleep(0)  # the request is sent
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: remote.arena.used == 0 and not remote._pending)
    _, (r,) = await remote.infer("tiny", None, [raw()])  # and it goes on serving
    assert r.result.label


async def test_cancelled_request_of_many_frames_is_no_internal_error(pair, caplog):
    _, hub, remote = pair
    caplog.set_level(logging.DEBUG, logger="visionserve")
    task = asyncio.ensure_future(remote.infer("tiny", None, [raw()] * 4, deadline_ms=60_000))
    await asyncio.sleep(0)  # the request is sent
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: not remote._pending and not hub.links[0].tasks)
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]  # a client that went away is no fault
    assert any("cancelled" in r.getMessage() for r in caplog.records)


async def test_the_request_id_crosses_to_the_engine_process(pair):
    from visionserve.logs import request_id

    eng, _, remote = pair
    seen = []
    submit = eng.get("tiny").batcher.submit

    def spy(*args, **kw):
        item = submit(*args, **kw)
        seen.append(item.request_id)
        return item

    eng.get("tiny").batcher.submit = spy
    token = request_id.set("cam3-0815")
    try:
        await remote.infer("tiny", None, [raw(), raw()])
    finally:
        request_id.reset(token)
    assert seen == ["cam3-0815", "cam3-0815"]  # what the runner threads' log lines name


async def test_cancelled_single_frame_is_answered_and_freed(pair):
    _, hub, remote = pair
    task = asyncio.ensure_future(remote.infer("tiny", None, [raw()], deadline_ms=60_000))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: remote.arena.used == 0 and not remote._pending and not hub.links[0].tasks)


async def test_frames_that_do_not_fit_the_arena_travel_inline(pair):
    _, _, remote = pair
    big = imaging.raw_frame(np.full((600, 800, 3), 7, np.uint8), (600, 800, 3))  # 1.44 MB > 1 MiB arena
    _, results = await remote.infer("tiny", None, [big, raw()])
    _, (alone,) = await remote.infer("tiny", None, [imaging.raw_frame(
        np.full((600, 800, 3), 7, np.uint8), (600, 800, 3))])
    assert results[0].result.label == alone.result.label and len(results) == 2
    assert remote.arena.used == 0


async def test_statistics_and_metrics_come_from_the_engine(pair):
    _, _, remote = pair
    await remote.infer("tiny", None, [raw(), raw()])
    (st,) = await remote.statistics("tiny")
    assert st.name == "tiny" and st.stats.inference_count == 2
    assert len(await remote.statistics()) == 1
    with pytest.raises(NotFound):
        await remote.statistics("nope")
    text = (await remote.metrics_text()).decode()
    assert 'visionserve_model_ready{model="tiny",version="1"} 1.0' in text


async def test_drain_reaches_the_front_end_and_waits_for_accepted_work(pair):
    eng, hub, remote = pair
    link, received = hub.links[0], asyncio.Event()

    def on_message(msg, handle=link.on_message):
        handle(msg)  # the frames are admitted here, before the drain below starts
        received.set()

    link.channel.on_message = on_message
    inflight = asyncio.ensure_future(remote.infer("tiny", None, [raw()] * 4))
    await asyncio.wait_for(received.wait(), 5)
    drained = asyncio.ensure_future(eng.drain(5))
    hub.publish()
    await _until(lambda: not remote.ready)
    assert remote.draining
    _, results = await inflight  # accepted before the drain: answered
    assert len(results) == 4 and await drained
    with pytest.raises(Unavailable, match="shutting down"):
        await remote.infer("tiny", None, [raw()])


async def test_engine_gone_fails_waiting_requests_with_503(pair):
    _, hub, remote = pair
    hub.detach(0)  # the engine side closes the channel
    await asyncio.wait_for(remote.lost.wait(), 5)
    assert not remote.ready
    with pytest.raises(Unavailable, match="not reachable"):
        await remote.infer("tiny", None, [raw()])
    assert remote.arena.used == 0  # refused before its frames took arena space


def _freeze(link) -> list:
    """Hold what reaches the engine side (an engine process that stopped reading); returns the
    held messages, to be handed on later with ``link.on_message``."""
    held: list = []
    link.channel.on_message = held.append
    return held


async def test_a_deadline_is_answered_by_the_front_end_when_the_engine_does_not(pair):
    """504 at the deadline, while the engine holds the request; its arena extent is not handed to
    another frame until the engine has answered (it reads the bytes when it reads the request)."""
    _, hub, remote = pair
    link = hub.links[0]
    held = _freeze(link)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(DeadlineExceeded, match="deadline of 50 ms"):
        await asyncio.wait_for(remote.infer("tiny", None, [raw(10)], deadline_ms=50), 5)
    assert 0.05 <= loop.time() - t0 < 0.5
    used = remote.arena.used
    assert used > 0  # kept: the engine has not read the frame yet
    late = asyncio.ensure_future(remote.infer("tiny", None, [raw(250)], deadline_ms=60_000))
    await _until(lambda: len(held) == 3)  # the first request, its cancel, the second request
    (_, _, _, _, (first,), *_), (_, _, _, _, (second,), *_) = (m for m in held if m[0] == "infer")
    assert first[5] + first[6] <= second[5] or second[5] + second[6] <= first[5]  # offsets apart
    link.channel.on_message = link.on_message
    for msg in held:
        link.on_message(msg)
    _, (r,) = await late
    _, (alone,) = await remote.infer("tiny", None, [raw(250)])
    assert np.allclose(r.result.scores, alone.result.scores, atol=1e-6)  # its own frame's answer
    await _until(lambda: remote.arena.used == 0 and not remote._pending)


async def test_default_deadline_is_the_models_takt(pair):
    _, hub, remote = pair
    served = remote.get("tiny")
    served.config = served.config.model_copy(update={"batching": served.config.batching.model_copy(
        update={"takt_ms": 30})})
    _freeze(hub.links[0])
    with pytest.raises(DeadlineExceeded, match="deadline of 30 ms"):
        await asyncio.wait_for(remote.infer("tiny", None, [raw()]), 2)


async def test_a_silent_engine_turns_the_front_end_not_ready(pair, monkeypatch):
    import visionserve.frontends.remote as remote_mod

    _, hub, remote = pair
    monkeypatch.setattr(remote_mod, "HEARTBEAT_TIMEOUT_S", 0.3)
    watch = asyncio.ensure_future(remote.watch())
    try:
        hub._watcher.cancel()  # no more beats
        held = _freeze(hub.links[0])
        waiting = asyncio.ensure_future(remote.infer("tiny", None, [raw()], deadline_ms=60_000))
        await _until(lambda: not remote.ready, timeout=2)
        with pytest.raises(Unavailable, match="not answering"):
            await waiting
        with pytest.raises(Unavailable, match="not answering"):
            await remote.infer("tiny", None, [raw()])
        assert len(held) == 2  # the infer, then its cancel; the refused request sent nothing
        hub.links[0].channel.on_message = hub.links[0].on_message
        for msg in held:
            hub.links[0].on_message(msg)
        hub._watcher = asyncio.ensure_future(hub._watch())
        await _until(lambda: remote.ready, timeout=2)
        await _until(lambda: remote.arena.used == 0 and not remote._pending)
        _, (r,) = await remote.infer("tiny", None, [raw()])
        assert r.result.label
    finally:
        watch.cancel()


async def test_unreadable_frames_are_answered_not_lost(pair):
    _, hub, remote = pair
    link = hub.links[0]

    def corrupt(msg, handle=link.on_message):
        if msg[0] == "infer":
            kind, w, h, c, _shape, off, n, inline = msg[4][0]
            msg = (*msg[:4], [(kind, w, h, c, (7, 7, 7), off, n, inline)], *msg[5:])
        handle(msg)

    link.channel.on_message = corrupt
    with pytest.raises(Exception, match="internal"):
        await asyncio.wait_for(remote.infer("tiny", None, [raw()], deadline_ms=60_000), 5)
    await _until(lambda: remote.arena.used == 0 and not remote._pending)


# --- issue 15: every answer counted once, in the engine process --------------------------------


def _sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


_LATE_SERIES = (("visionserve_requests_total", {"model": "tiny", "outcome": "deadline"}),
                ("visionserve_frames_total", {"model": "tiny", "outcome": "late"}),
                ("visionserve_deadline_misses_total", {"model": "tiny"}))


def _late_counts() -> list[float]:
    return [_sample(n, **labels) for n, labels in _LATE_SERIES]


async def test_a_late_answer_of_the_front_ends_timer_is_counted_in_the_engine(pair):
    _, hub, remote = pair
    link = hub.links[0]
    held = _freeze(link)
    before = _late_counts()
    with pytest.raises(DeadlineExceeded, match=r"deadline of 50 ms .*ms ago") as info:
        await asyncio.wait_for(remote.infer("tiny", None, [raw(), raw(9)], deadline_ms=50), 5)
    assert info.value.late_ms >= 15
    await _until(lambda: len(held) == 2)  # the request, then its cancel (with what was answered)
    assert held[1][0] == "cancel" and held[1][2] == "deadline"
    link.channel.on_message = link.on_message
    for msg in held:
        link.on_message(msg)
    await _until(lambda: remote.arena.used == 0 and not remote._pending and not link.tasks)
    assert [a - b for a, b in zip(_late_counts(), before)] == [1, 2, 2]


async def test_a_request_the_engine_answered_first_is_not_counted_again(pair):
    """The engine's answer and the front end's timer crossed: the engine's answer is the one counted."""
    _, hub, remote = pair
    link = hub.links[0]
    held = _freeze(link)
    before = _late_counts()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(remote.infer("tiny", None, [raw()], deadline_ms=50), 5)
    await _until(lambda: len(held) == 2)
    link.channel.on_message = link.on_message
    link.on_message(held[0])  # the engine answers it (LATE from the queue) before the cancel comes
    await _until(lambda: not link.tasks)
    link.on_message(held[1])
    await _until(lambda: remote.arena.used == 0 and not remote._pending)
    assert [a - b for a, b in zip(_late_counts(), before)] == [1, 1, 1]


async def test_a_front_ends_own_refusal_is_counted_in_the_engine(pair):
    _, _, remote = pair
    before = _sample("visionserve_requests_total", model="_unknown", outcome="not_found")
    with pytest.raises(NotFound) as info:
        await remote.infer("some-client-string", None, [raw()])
    assert not info.value.counted  # refused here: the front end counts it
    remote.count_error("some-client-string", info.value)
    await _until(lambda: _sample("visionserve_requests_total", model="_unknown", outcome="not_found")
                 == before + 1)
    with pytest.raises(InvalidInput) as info:
        await remote.infer("tiny", None, [raw()], priority=99)
    assert info.value.counted  # the engine counted it when it answered


async def test_a_settings_change_returns_once_every_front_end_applies_it(pair, tiny_repo):
    """A verdict change (or a recipe switch) asked through one front end is answered only when
    every front end has applied it: the caller's next frame may reach any of them. Here the
    second front end is slow to read its channel."""
    import os

    eng, hub, remote = pair
    slow_size = 1024**2
    fd = create_memfd(slow_size)
    slow = RemoteEngine(Arena(fd, slow_size))
    loop = asyncio.get_running_loop()

    def late(msg) -> None:  # a busy front end: its messages handled 0.3 s after they arrive
        loop.call_later(0.3, slow.on_message, msg)

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.channel = await connect(theirs, late, slow.on_lost)
    await hub.attach(1, ours, fd, slow_size)
    os.close(fd)
    await _until(lambda: slow.ready)
    toml = tiny_repo / "tiny" / "model.toml"
    saved = toml.read_text()
    try:
        before = slow.served[("tiny", 1)].config.verdict.ok_threshold
        await remote.verdict("tiny", {"ok_threshold": 0.77})
        assert before != 0.77
        assert slow.served[("tiny", 1)].config.verdict.ok_threshold == 0.77
    finally:
        toml.write_text(saved)
        await slow.close()
        hub.detach(1)


async def test_live_results_reach_a_front_ends_streams_and_its_streams_count_in_the_engine(pair):
    eng, hub, remote = pair
    replay, stream = await remote.feed.open("tiny", None, None)
    assert replay == [] and eng.live_source.streams == 1
    await remote.infer("tiny", None, [raw()], origin=("A-1", None, None, None))
    events, missed = await stream.next(5.0)
    assert [(e.part_id, e.model, e.verdict in ("OK", "NG")) for e in events] == \
        [("A-1", "tiny", True)] and missed == 0
    # a second stream starts with what the engine kept; the summary is the engine's
    replay2, stream2 = await remote.feed.open(None, None, None)
    assert [e.part_id for e in replay2] == ["A-1"]
    summary = await remote.feed.summary("tiny", 2)
    assert sum(m["ok"] + m["ng"] for m in summary["minutes"]) == 1
    stream2.close()
    await _until(lambda: eng.live_source.streams == 1)
    # the front end goes: its streams stop counting, and it is sent nothing more
    hub.detach(0)
    await asyncio.wait_for(remote.lost.wait(), 5)
    await _until(lambda: eng.live_source.streams == 0)
    assert eng.live_source.sinks == [eng.feed.streams]
    assert await stream.next(1.0) is None  # the stream ended with the engine
