"""The last second's served latency (what the guard's latency budget reads)."""

from __future__ import annotations

import threading

from visionserve.latency import MIN_FRAMES, LatencyWindow


def test_p99_of_the_last_second_only():
    w = LatencyWindow(seconds=1.0)
    for i in range(100):
        w.add(1000.0, now=10.0)  # a slow burst, then it ages out
    for i in range(100):
        w.add(float(i + 1), now=11.5)
    assert w.p99(now=11.6) == 100.0  # the 99th of 1..100 ms, the burst at t=10 is gone
    assert w.p99(now=13.0) is None  # all aged out


def test_too_few_frames_give_no_p99():
    w = LatencyWindow()
    for _ in range(MIN_FRAMES - 1):
        w.add(50.0, now=1.0)
    assert w.p99(now=1.1) is None
    w.add(50.0, now=1.0)
    assert w.p99(now=1.1) == 50.0


def test_adding_from_one_thread_while_another_reads():
    w = LatencyWindow(seconds=60)
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            w.p99()

    t = threading.Thread(target=reader)
    t.start()
    for i in range(20000):
        w.add(float(i % 10))
    stop.set()
    t.join()
    assert w.p99() == 9.0
