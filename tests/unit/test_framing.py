"""The framing every process boundary uses (visionserve/framing.py), its blocking side: a message
and the buffers behind it in one ``sendmsg``, read whole by a blocking reader or by the event
loop from a non-blocking socket, in both directions. The asyncio Channel's own tests (a loop
turn's messages in one write, a message split anywhere) are in test_frontend_hub.py."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest

from visionserve import framing


def test_a_head_and_its_buffers_cross_in_one_message():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        raw = np.arange(3000, dtype=np.uint16).reshape(50, 60)
        framing.send(ours, ("prepare", 7, [raw.nbytes, 5]), [raw, b"hello"])
        assert framing.read_head(theirs) == ("prepare", 7, [raw.nbytes, 5])
        data = bytearray(raw.nbytes + 5)
        framing.recv_exact(theirs, memoryview(data))
        assert np.array_equal(np.frombuffer(data[:raw.nbytes], np.uint16).reshape(50, 60), raw)
        assert bytes(data[raw.nbytes:]) == b"hello"


def test_a_reader_takes_one_message_at_a_time_and_refuses_a_second_behind_it():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = framing.Reader(theirs)
        big = bytes(range(256)) * 400  # over the reader's first buffer (it grows): 100 kB
        framing.send(ours, ("done", 1, big))
        assert reader.message() == ("done", 1, big)
        framing.send(ours, ("done", 2))
        assert reader.message() == ("done", 2)
        # at most one message is on its way at a time: two at once break the contract
        framing.send_parts(ours, framing.pack(("a",)) + framing.pack(("b",)))
        with pytest.raises(framing.FramingError):
            reader.message()
        ours.close()
        with pytest.raises(EOFError):
            framing.Reader(theirs).message()


def test_what_is_left_after_a_partial_send():
    parts = framing.pack(("x",), [b"abcdef", b"gh"])
    total = sum(len(p) for p in parts)
    rest = framing.trim(parts, total - 5)
    assert b"".join(bytes(p) for p in rest) == b"defgh"
    assert framing.trim(parts, total) == []


async def test_a_blocking_peer_and_the_event_loop_exchange_messages_both_ways():
    """A worker's side (blocking, a thread here) sends messages larger than the socket's buffer;
    the loop reads them from its non-blocking socket as they come, whole and in order, and
    answers each, which the blocking side reads with its Reader."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    framing.set_time_limit(theirs, 10)
    sent = [("ran", i, bytes([i]) * (i * 100_000)) for i in range(1, 6)]
    answers: list = []

    def peer() -> None:
        reader = framing.Reader(theirs)
        for msg in sent:
            framing.send(theirs, msg)
            answers.append(reader.message())

    got: list = []
    buf = bytearray()
    done = loop.create_future()

    def readable() -> None:
        try:
            data = ours.recv(1 << 16)
        except BlockingIOError:
            return
        buf.extend(data)
        for msg in framing.messages(buf):
            got.append(msg)
            ours.sendmsg(framing.pack(("ok", msg[1], len(msg[2]))))
            if len(got) == len(sent):
                done.set_result(None)

    loop.add_reader(ours.fileno(), readable)
    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    try:
        await asyncio.wait_for(done, 30)
    finally:
        loop.remove_reader(ours.fileno())
    await asyncio.to_thread(thread.join, 10)
    assert got == sent and not buf
    assert answers == [("ok", i, i * 100_000) for i in range(1, 6)]
    ours.close()
    theirs.close()
