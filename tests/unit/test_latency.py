"""The last second's served latency (what the guard's latency budget reads)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from visionserve.errors import DeadlineExceeded
from visionserve.guard import watchdog
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
    for i in range(2000):  # each add waits for a p99 under the lock: 2,000 interleavings
        w.add(float(i % 10))
    stop.set()
    t.join()
    assert w.p99() == 9.0


def _frames(n: int, deadline_ms: float, arrival: float):
    loop = asyncio.get_running_loop()
    return [SimpleNamespace(future=loop.create_future(), arrival=arrival,
                            deadline=arrival + deadline_ms / 1000) for _ in range(n)]


def test_late_frames_count_at_least_at_their_deadline_and_keep_the_job_paused():
    """Frames answered LATE (expired in the queue or during decode) are in the window at no less
    than their deadline budget: a line that only misses deadlines reads a p99 over a budget under
    the deadline, and a job paused for latency is not resumed."""
    w = LatencyWindow()

    async def main():
        now = time.monotonic()
        late = _frames(MIN_FRAMES, deadline_ms=40.0, arrival=now)  # deadline still ahead: a floor
        gone = _frames(5, deadline_ms=40.0, arrival=now)
        w.track(late + gone)
        for f in late:
            f.future.set_exception(DeadlineExceeded("deadline passed; the frame was not run"))
        for f in gone:
            f.future.cancel()  # the client left: not an answer
        await asyncio.sleep(0)

    asyncio.run(main())
    p99 = w.p99()
    assert p99 is not None and p99 >= 40.0 - 1e-6  # (float rounding of arrival + 40 ms)
    paused = watchdog.JobView(1, "pause", "paused", need=0, used=0)
    assert watchdog.decide([paused], free=None, floor=0, hysteresis=0,
                           latency=watchdog.Latency(p99, budget_ms=20.0)) == []


def test_answered_frames_count_at_their_answer_time():
    w = LatencyWindow()

    async def main():
        frames = _frames(MIN_FRAMES, deadline_ms=100.0, arrival=time.monotonic())
        w.track(frames)
        for i, f in enumerate(frames):
            f.future.set_result(SimpleNamespace(total_ms=float(i + 1)))
        await asyncio.sleep(0)

    asyncio.run(main())
    assert w.p99() == float(MIN_FRAMES)
