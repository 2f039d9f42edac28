"""The recent frames in memory (visionserve.records.recent): the newest up to a size, found again
by their record's model, request id, frame index, part id and arrival time, each taken once, and
never where two kept frames fit one record."""

from __future__ import annotations

from visionserve.imaging import Frame
from visionserve.records.recent import Recent, RecentFrames


def recent(t: float, n: int = 100, fill: bytes = b"x", part: str | None = "P") -> Recent:
    return Recent(t, part, Frame("jpeg", fill * n, 8, 8), None, None)


def test_the_oldest_go_past_the_size():
    ring = RecentFrames(350)
    for i in range(5):
        ring.add("m", f"r{i}", 0, recent(1000.0 + i))
    assert len(ring) == 3 and ring.size == 300
    assert ring.take("m", "r1", 0, "P", 1001.0) is None  # pushed out
    assert ring.take("m", "r4", 0, "P", 1004.0).time == 1004.0
    assert ring.take("m", "r4", 0, "P", 1004.0) is None  # taken once
    assert len(ring) == 2 and ring.size == 200


def test_a_repeated_request_id_is_told_apart_by_time_index_part_and_model():
    ring = RecentFrames(10_000)
    ring.add("m", "same", 0, recent(10.0, fill=b"a"))
    ring.add("m", "same", 0, recent(20.0, fill=b"b"))
    ring.add("m", "same", 1, recent(20.0, fill=b"c"))
    ring.add("m", "same", 0, recent(30.0, fill=b"e", part="Q"))
    ring.add("other", "same", 0, recent(20.0, fill=b"d"))
    assert ring.take("m", "same", 0, "P", 20.000001).frame.data[:1] == b"b"  # microseconds
    assert ring.take("m", "same", 0, "P", 15.0) is None
    assert ring.take("m", "same", 0, "P", 30.0) is None  # another part's
    assert ring.take("m", "same", 0, "Q", 30.0).frame.data[:1] == b"e"
    assert ring.take("m", "same", 1, "P", 20.0).frame.data[:1] == b"c"
    assert ring.take("m", "same", 0, "P", 10.0).frame.data[:1] == b"a"
    assert ring.take("other", "same", 0, "P", 20.0).frame.data[:1] == b"d"
    assert len(ring) == 0 and ring.size == 0


def test_two_frames_that_fit_one_record_are_neither_taken():
    ring = RecentFrames(10_000)
    ring.add("m", "triton", 0, recent(5.0, fill=b"a"))
    ring.add("m", "triton", 0, recent(5.000001, fill=b"b"))
    assert ring.take("m", "triton", 0, "P", 5.0000005) is None
    assert len(ring) == 2


def test_after_a_take_the_oldest_still_go_first():
    ring = RecentFrames(300)
    for i, rid in enumerate(["a", "b", "a", "c"]):
        ring.add("m", rid, 0, recent(float(i)))  # the 4th pushes out the 1st
    assert ring.take("m", "a", 0, "P", 0.0) is None
    assert ring.take("m", "a", 0, "P", 2.0) is not None
    ring.add("m", "d", 0, recent(4.0))
    ring.add("m", "e", 0, recent(5.0))  # pushes out "b"
    assert ring.take("m", "b", 0, "P", 1.0) is None
    assert [ring.take("m", r, 0, "P", t) is not None
            for r, t in (("c", 3.0), ("d", 4.0), ("e", 5.0))] == [True] * 3


def test_a_frame_larger_than_the_whole_size_is_not_kept():
    ring = RecentFrames(50)
    ring.add("m", "big", 0, recent(1.0, n=51))
    assert len(ring) == 0 and ring.take("m", "big", 0, "P", 1.0) is None
