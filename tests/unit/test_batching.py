"""The dynamic batcher (with a recording executor) and the runner (with a fake backend).

No assertion here depends on the box being fast: waits have generous timeouts, and time is only
checked as a lower bound (a batch is never dispatched *before* its rule allows it) or with
margins of a second or more.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from visionserve import imaging
from visionserve.backends.base import Backend
from visionserve.batching import Batcher, CostModel, Pending, resolve
from visionserve.config import ModelConfig
from visionserve.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidInput,
    Unavailable,
    http_status,
)
from visionserve.execution.results import BatchRecord, FrameResult, padded_size
from visionserve.execution.threads import ThreadExecutor

WAIT = 10.0  # generous upper bound for anything that should happen "soon"
FAR = 3600.0  # a deadline that never matters


class Recorder:
    """A fake executor: records each batch's payloads, optionally blocks, then answers."""

    def __init__(self, block_first: bool = False, block_all: bool = False) -> None:
        self.batches: list[list] = []
        self.gate = asyncio.Event()
        self.block_first = block_first
        self.block_all = block_all
        self.started = asyncio.Event()

    async def __call__(self, batch: list[Pending]) -> None:
        self.batches.append([p.payload for p in batch])
        self.started.set()
        if self.block_all or (self.block_first and len(self.batches) == 1):
            await self.gate.wait()
        for p in batch:
            resolve(p.future, ("done", p.payload))

    @property
    def seen(self) -> list:
        return [x for b in self.batches for x in b]


def make_batcher(execute, *, max_batch_size=4, delay=0.0, queue=64, inflight=1,
                 cost: CostModel | None = None) -> Batcher:
    b = Batcher(name="test", execute=execute, max_batch_size=max_batch_size, max_queue_delay_s=delay,
                max_queue_size=queue, cost=cost or CostModel(lambda n: n), max_inflight=inflight)
    b.start()
    return b


def far() -> float:
    return time.monotonic() + FAR


async def until(cond, timeout: float = WAIT) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


# --- batch formation ---------------------------------------------------------------------------


async def test_full_batch_dispatches_without_waiting_for_the_delay():
    rec = Recorder()
    b = make_batcher(rec, max_batch_size=4, delay=FAR)  # the delay alone would never fire
    items = [b.submit(i, deadline=far()) for i in range(4)]
    results = await asyncio.wait_for(asyncio.gather(*(p.future for p in items)), WAIT)
    assert results == [("done", i) for i in range(4)]
    assert rec.batches == [[0, 1, 2, 3]]
    await b.close()


async def test_more_than_max_batch_size_splits_into_full_batches():
    rec = Recorder(block_first=True)
    b = make_batcher(rec, max_batch_size=3, delay=FAR)
    items = [b.submit(i, deadline=far()) for i in range(7)]
    await asyncio.wait_for(rec.started.wait(), WAIT)
    rec.gate.set()
    await asyncio.wait_for(asyncio.gather(*(p.future for p in items[:6])), WAIT)
    assert rec.batches == [[0, 1, 2], [3, 4, 5]]
    # 6 is alone: below max_batch_size and the delay is an hour, so it keeps waiting
    await asyncio.sleep(0.2)
    assert not items[6].future.done()
    await b.close()
    assert isinstance(items[6].future.exception(), Unavailable)


async def test_a_slot_beyond_max_inflight_takes_only_a_full_batch():
    """``full_extra``: while max_inflight batches run, a partial batch waits (its delay long
    past) and a full one goes at once; a late frame is still answered in time; once a running
    batch ends the partial one goes."""
    rec = Recorder(block_all=True)
    b = Batcher(name="test", execute=rec, max_batch_size=3, max_queue_delay_s=0.0,
                max_queue_size=64, cost=CostModel(lambda n: 0.0), max_inflight=1, full_extra=1)
    b.start()
    try:
        first = b.submit("a", deadline=far())
        await until(lambda: rec.batches == [["a"]])
        partial = [b.submit("b", deadline=far())]
        soon = b.submit("late", deadline=time.monotonic() + 0.3)
        await asyncio.sleep(0.1)
        assert rec.batches == [["a"]]  # two queued, not a full batch
        # "late" expires in the queue: answered 504 while the extra slot waits, not held back
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(soon.future, WAIT)
        partial.append(b.submit("c", deadline=far()))
        await asyncio.sleep(0.1)
        assert rec.batches == [["a"]]  # b and c: still not full
        d = b.submit("d", deadline=far())  # b, c, d: full, takes the extra slot
        await until(lambda: len(rec.batches) == 2)
        assert rec.batches[1] == ["b", "c", "d"]
        e = b.submit("e", deadline=far())
        await asyncio.sleep(0.1)
        assert len(rec.batches) == 2  # two running, and max_inflight + full_extra is 2
        rec.gate.set()
        results = await asyncio.wait_for(
            asyncio.gather(*(p.future for p in (first, *partial, d, e))), WAIT)
        assert [r[1] for r in results] == ["a", "b", "c", "d", "e"]
        assert rec.batches[2] == ["e"]
    finally:
        await b.close()


def test_full_extra_cannot_be_negative():
    with pytest.raises(ValueError):
        Batcher(name="test", execute=Recorder(), max_batch_size=3, max_queue_delay_s=0.0,
                max_queue_size=64, cost=CostModel(lambda n: 0.0), full_extra=-1)


async def test_lone_request_dispatched_after_the_delay():
    rec = Recorder()
    delay = 0.3
    b = make_batcher(rec, max_batch_size=8, delay=delay)
    p = b.submit("alone", deadline=far())
    assert await asyncio.wait_for(p.future, WAIT) == ("done", "alone")
    assert rec.batches == [["alone"]]
    assert p.dispatched - p.arrival >= delay  # never earlier than the delay
    await b.close()


async def test_delay_clock_starts_at_the_first_request():
    rec = Recorder()
    delay = 3.0
    b = make_batcher(rec, max_batch_size=8, delay=delay)
    now = time.monotonic()
    # the first request has been waiting 2.5 s already; the second arrives now
    a = b.submit("a", deadline=far(), arrival=now - 2.5)
    c = b.submit("c", deadline=far())
    await asyncio.wait_for(asyncio.gather(a.future, c.future), WAIT)
    assert rec.batches == [["a", "c"]]
    assert a.dispatched >= a.arrival + delay
    # clock from the last request would dispatch at now + 3 s; from the first, at now + 0.5 s
    assert a.dispatched < c.arrival + delay - 1.0
    await b.close()


async def test_early_dispatch_when_waiting_would_miss_the_deadline():
    cost = CostModel(lambda n: n)
    for n in (1, 2):
        cost.observe(n, 0.5)  # a batch takes half a second
    rec = Recorder()
    b = make_batcher(rec, max_batch_size=8, delay=FAR, cost=cost)
    deadline = time.monotonic() + 2.0
    p = b.submit("urgent", deadline=deadline)
    # without the cost model this would wait an hour and then be dropped as late
    assert await asyncio.wait_for(p.future, WAIT) == ("done", "urgent")
    assert rec.batches == [["urgent"]]
    # it waited for company as long as it safely could: until deadline - batch time
    assert p.dispatched >= deadline - 0.5 - b._safety - 1e-6
    assert p.dispatched < deadline
    await b.close()


# --- deadlines, priorities, capacity, cancellation ---------------------------------------------


async def test_expired_request_is_answered_late_and_never_executed():
    rec = Recorder(block_first=True)
    b = make_batcher(rec, max_batch_size=1, inflight=1)
    busy = b.submit("busy", deadline=far())
    await asyncio.wait_for(rec.started.wait(), WAIT)
    drops = []
    b.on_drop = lambda item, reason: drops.append((item.payload, reason))
    late = b.submit("late", deadline=time.monotonic() + 0.2)
    # answered as late at once, while the executor is still busy (not when a slot frees up)
    with pytest.raises(DeadlineExceeded, match="not run"):
        await asyncio.wait_for(late.future, WAIT)
    assert not busy.future.done()
    rec.gate.set()
    await asyncio.wait_for(busy.future, WAIT)
    assert rec.seen == ["busy"]
    assert drops == [("late", "late")]
    assert http_status(DeadlineExceeded("x")) == 504
    await b.close()


async def test_request_submitted_already_expired_is_never_executed():
    rec = Recorder()
    b = make_batcher(rec, max_batch_size=4, delay=0.05)
    p = b.submit("expired", deadline=time.monotonic() - 0.001)
    ok = b.submit("ok", deadline=far())
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(p.future, WAIT)
    assert await asyncio.wait_for(ok.future, WAIT) == ("done", "ok")
    assert rec.seen == ["ok"]
    await b.close()


async def test_higher_priority_runs_first_when_several_wait():
    rec = Recorder(block_first=True)
    b = make_batcher(rec, max_batch_size=1, inflight=1)
    first = b.submit("first", deadline=far(), priority=0)
    await asyncio.wait_for(rec.started.wait(), WAIT)
    d = far()
    waiting = [b.submit("low", deadline=d, priority=0), b.submit("high", deadline=d, priority=2),
               b.submit("mid", deadline=d, priority=1), b.submit("high2", deadline=d, priority=2)]
    rec.gate.set()
    await asyncio.wait_for(asyncio.gather(first.future, *(p.future for p in waiting)), WAIT)
    # priority, then arrival order within a priority
    assert rec.batches == [["first"], ["high"], ["high2"], ["mid"], ["low"]]
    await b.close()


async def test_same_priority_earlier_deadline_first():
    rec = Recorder(block_first=True)
    b = make_batcher(rec, max_batch_size=1, inflight=1)
    b.submit("first", deadline=far())
    await asyncio.wait_for(rec.started.wait(), WAIT)
    now = time.monotonic()
    later = b.submit("later", deadline=now + 500)
    sooner = b.submit("sooner", deadline=now + 400)
    rec.gate.set()
    await asyncio.wait_for(asyncio.gather(later.future, sooner.future), WAIT)
    assert rec.seen == ["first", "sooner", "later"]
    await b.close()


async def test_full_queue_refuses_with_503_and_retry_after():
    rec = Recorder(block_first=True)
    b = make_batcher(rec, max_batch_size=1, inflight=1, queue=2)
    first = b.submit("running", deadline=far())
    await asyncio.wait_for(rec.started.wait(), WAIT)
    queued = [b.submit(i, deadline=far()) for i in range(2)]
    with pytest.raises(Unavailable) as info:
        b.submit("one too many", deadline=far())
    exc = info.value
    assert http_status(exc) == 503
    assert exc.retry_after_s is not None and exc.retry_after_s > 0
    assert "max_queue_size 2" in exc.message
    with pytest.raises(Unavailable):
        b.check_capacity(1)
    # the refused item never entered the queue; the others all finish
    rec.gate.set()
    await asyncio.wait_for(asyncio.gather(first.future, *(p.future for p in queued)), WAIT)
    assert rec.seen == ["running", 0, 1]
    b.check_capacity(2)  # room again
    await b.close()


async def test_cancelled_request_is_dropped_before_compute():
    rec = Recorder(block_first=True)
    b = make_batcher(rec, max_batch_size=4, inflight=1)
    drops = []
    b.on_drop = lambda item, reason: drops.append((item.payload, reason))
    first = b.submit("first", deadline=far())
    await asyncio.wait_for(rec.started.wait(), WAIT)
    gone = b.submit("gone", deadline=far())
    stays = b.submit("stays", deadline=far())
    gone.future.cancel()  # the client went away
    assert b.queue_depth == 1
    rec.gate.set()
    await asyncio.wait_for(asyncio.gather(first.future, stays.future), WAIT)
    assert rec.seen == ["first", "stays"]
    assert ("gone", "cancelled") in drops
    await b.close()


async def test_cancelled_while_waiting_for_the_delay_is_never_executed():
    rec = Recorder()
    b = make_batcher(rec, max_batch_size=8, delay=0.3)
    gone = b.submit("gone", deadline=far())
    await asyncio.sleep(0.05)
    gone.future.cancel()
    await asyncio.sleep(0.6)  # well past the delay
    assert rec.batches == []
    ok = b.submit("ok", deadline=far())
    assert await asyncio.wait_for(ok.future, WAIT) == ("done", "ok")
    assert rec.seen == ["ok"]
    await b.close()


# --- drain and close ---------------------------------------------------------------------------


async def test_drain_refuses_new_items_and_finishes_queued_ones():
    rec = Recorder(block_first=True)
    b = make_batcher(rec, max_batch_size=2, delay=FAR, inflight=1)
    running = b.submit("running", deadline=far())
    b.submit("running2", deadline=far())
    await asyncio.wait_for(rec.started.wait(), WAIT)
    queued = [b.submit(i, deadline=far()) for i in range(3)]
    drain = asyncio.ensure_future(b.drain(timeout_s=WAIT))
    await asyncio.sleep(0.05)
    with pytest.raises(Unavailable, match="shutting down"):
        b.submit("new", deadline=far())
    assert not drain.done()
    rec.gate.set()
    assert await asyncio.wait_for(drain, WAIT + 5) is True
    # queued work finished even though the batch was not full and the delay is an hour
    assert [p.future.result() for p in queued] == [("done", i) for i in range(3)]
    assert running.future.result() == ("done", "running")
    assert "new" not in rec.seen


async def test_drain_timeout_answers_leftovers_503():
    rec = Recorder(block_all=True)
    b = make_batcher(rec, max_batch_size=1, inflight=1)
    stuck = b.submit("stuck", deadline=far())
    await asyncio.wait_for(rec.started.wait(), WAIT)
    left = b.submit("left", deadline=far())
    assert await asyncio.wait_for(b.drain(timeout_s=0.2), WAIT) is False
    with pytest.raises(Unavailable, match="shut down before this frame ran"):
        left.future.result()
    # the running one too: a clean 503 rather than a connection cut when the process exits
    with pytest.raises(Unavailable, match="shut down before this frame finished"):
        stuck.future.result()
    assert rec.seen == ["stuck"]
    rec.gate.set()


async def test_close_answers_queued_items_unavailable():
    rec = Recorder()
    b = make_batcher(rec, max_batch_size=8, delay=FAR)
    items = [b.submit(i, deadline=far()) for i in range(3)]
    await b.close()
    for p in items:
        exc = p.future.exception()
        assert isinstance(exc, Unavailable) and http_status(exc) == 503
    assert rec.batches == []
    with pytest.raises(Unavailable):
        b.submit("after close", deadline=far())


# --- executor failures -------------------------------------------------------------------------


async def test_executor_raising_fails_its_batch_and_the_batcher_keeps_serving():
    batches = []

    async def flaky(batch):
        batches.append([p.payload for p in batch])
        if any(p.payload == "boom" for p in batch):
            raise RuntimeError("backend exploded")
        for p in batch:
            resolve(p.future, p.payload)

    b = make_batcher(flaky, max_batch_size=2, delay=FAR)
    bad = [b.submit("boom", deadline=far()), b.submit("victim", deadline=far())]
    for p in bad:
        with pytest.raises(InternalError, match="see the server log"):
            await asyncio.wait_for(p.future, WAIT)
    good = [b.submit("a", deadline=far()), b.submit("b", deadline=far())]
    assert await asyncio.wait_for(asyncio.gather(*(p.future for p in good)), WAIT) == ["a", "b"]
    assert batches == [["boom", "victim"], ["a", "b"]]
    await b.close()


async def test_executor_raising_a_visionserve_error_passes_it_on():
    async def refuse(batch):
        raise InvalidInput("the model refuses this batch")

    b = make_batcher(refuse, max_batch_size=1)
    p = b.submit("x", deadline=far())
    with pytest.raises(InvalidInput, match="refuses"):
        await asyncio.wait_for(p.future, WAIT)
    await b.close()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        Batcher(name="x", execute=None, max_batch_size=0, max_queue_delay_s=0, max_queue_size=1,
                cost=CostModel(lambda n: n))


def test_cost_model_estimates():
    cost = CostModel(lambda n: padded_size(n, (1, 2, 4, 8)))
    assert cost.estimate(3) == 0.0  # nothing measured: no early dispatch
    cost.observe(4, 0.010)
    assert cost.estimate(3) == pytest.approx(0.010)  # 3 pads to 4
    assert cost.estimate(8) == pytest.approx(0.020)  # scaled up from the nearest measured size
    assert cost.estimate(1) == pytest.approx(0.010)  # never scaled down
    cost.observe(4, 0.020)
    assert 0.010 < cost.estimate(4) < 0.020  # moving average
    assert list(cost.snapshot()) == [4]


def test_cost_model_estimate_survives_a_new_batch_size_inserted_while_it_reads():
    """A compute thread observing a new batch size while the loop estimates (issue 14, defect 5):
    the insert is made from inside estimate's own iteration, so the race is hit every time."""
    cost: CostModel

    class Size(int):  # the padded size estimate looks up; comparing with it inserts a new size
        inserted = False

        def __rsub__(self, other):
            if not Size.inserted:
                Size.inserted = True
                cost.observe(7, 0.5)  # what CostModel.observe does from a runner thread
            return int(other) - int(self)

    cost = CostModel(lambda n: Size(n) if n == 3 else n)
    cost.observe(2, 0.010)
    cost.observe(4, 0.020)
    assert cost.estimate(3) == pytest.approx(0.015)  # nearest measured size (2), scaled
    assert Size.inserted
    assert cost.snapshot() == {2: pytest.approx(0.010), 4: pytest.approx(0.020), 7: pytest.approx(0.5)}


def test_cost_model_per_frame_server_time_over_recent_batches():
    cost = CostModel(lambda n: padded_size(n, (1, 2, 4, 8)))
    assert cost.per_frame() is None and cost.typical_batch() is None
    cost.observe_interval(4, 0.040)
    assert cost.per_frame() == pytest.approx(0.010) and cost.typical_batch() == pytest.approx(4)
    cost.observe_interval(8, 0.040)  # bigger batches cost less per frame: the average moves
    assert 0.005 < cost.per_frame() < 0.010 and 4 < cost.typical_batch() < 8
    assert cost.estimate(4) == 0.0  # the latency table is apart


# --- a batching loop that dies -------------------------------------------------------------------


class BrokenCost(CostModel):
    """A cost model whose estimate fails the way the racing dict did."""

    def __init__(self) -> None:
        super().__init__(lambda n: n)

    def estimate(self, batch_size: int) -> float:
        raise RuntimeError("dictionary changed size during iteration")


async def test_dead_batching_loop_turns_not_alive_logs_and_answers_503(caplog):
    rec = Recorder()
    b = make_batcher(rec, max_batch_size=4, delay=1.0, cost=BrokenCost())
    failures = []
    b.on_failure = failures.append
    assert b.alive
    with caplog.at_level("ERROR", logger="visionserve.batching"):
        queued = b.submit("queued", deadline=far())  # the loop estimates its wait, and dies
        with pytest.raises(Unavailable, match="batcher stopped") as info:
            await asyncio.wait_for(queued.future, WAIT)  # answered, not left hanging
    assert http_status(info.value) == 503 and info.value.retry_after_s
    assert not b.alive and isinstance(b.failure, RuntimeError)
    assert [type(e) for e in failures] == [RuntimeError]
    assert any("batcher of model test stopped" in r.getMessage() and "not ready" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(Unavailable, match="batcher stopped"):
        b.submit("after", deadline=far())
    await b.close()  # does not re-raise the loop's error
    assert rec.batches == []


# --- admission: refuse at once what the load would make late ------------------------------------


def slow_cost(latency: float = 10.0, per_frame: float = 2.5, batch: int = 4) -> CostModel:
    """Every batch takes ``latency``; the server spends ``per_frame`` on each frame of batches of
    ``batch`` frames (the batches overlap: less than the latency)."""
    cost = CostModel(lambda n: n)
    for n in range(1, 9):
        cost.observe(n, latency)
    cost.observe_interval(batch, batch * per_frame)
    return cost


async def running_and_queued(b: Batcher, rec: Recorder, queued: int = 8) -> tuple[float, list]:
    """One frame running (its batch blocked), ``queued`` more waiting at priority 1."""
    b.submit("running", deadline=far())
    await asyncio.wait_for(rec.started.wait(), WAIT)
    now = time.monotonic()
    return now, [b.submit(i, deadline=now + 100, priority=1) for i in range(queued)]


async def test_admission_predicts_from_the_running_batch_and_the_frames_ahead():
    rec = Recorder(block_all=True)
    b = make_batcher(rec, max_batch_size=4, cost=slow_cost())
    now, _ = await running_and_queued(b, rec)
    # 2.5 s a frame: the running one, 8 ahead, itself, and 3 that join its batch of 4 (13 frames)
    predicted, ahead = b.predict(1, deadline=now + 200, priority=1)
    assert ahead == 8 and 32.0 < predicted <= 32.5
    # a higher priority only waits for the running frame, in a batch of 4 (5 frames)
    predicted, ahead = b.predict(1, deadline=now + 200, priority=2)
    assert ahead == 0 and 12.0 < predicted <= 12.5
    # same priority, earlier deadline: ahead of them too
    assert b.predict(1, deadline=now + 50, priority=1)[1] == 0
    # 5 frames of one request: 13 with those ahead, in batches of 4: 16, and the running one
    assert 42.0 < b.predict(5, deadline=now + 200, priority=1)[0] <= 42.5
    rec.gate.set()
    await b.close()


async def test_admission_refuses_what_cannot_make_its_deadline_with_503_and_retry_after():
    rec = Recorder(block_all=True)
    b = make_batcher(rec, max_batch_size=4, cost=slow_cost())
    now, queued = await running_and_queued(b, rec)
    with pytest.raises(Unavailable, match="overloaded") as info:
        b.check_capacity(1, deadline=now + 30, priority=0)  # behind all 8: answered in ~32.5 s
    assert http_status(info.value) == 503
    assert info.value.retry_after_s == pytest.approx(32.5, abs=1.0)
    assert "8 frames queued before it" in info.value.message
    assert 32.0 < b.check_capacity(1, deadline=now + 45, priority=0) <= 32.5  # in time: admitted
    b.check_capacity(1, deadline=now + 30, priority=2)  # overtakes the queue: ~12.5 s, admitted
    b.check_capacity(1, deadline=now + 30, priority=1)  # the same priority, due sooner: ahead of them
    assert b.check_capacity(1) == 0.0  # no deadline given: only the queue's size counts
    assert not any(p.future.done() for p in queued)
    rec.gate.set()
    await b.close()


async def test_admission_costs_queued_work_with_the_server_time_not_the_latency():
    """Overlapping batches (decode of one while another computes) take less of the server's time
    than their latency: a pessimistic estimate would refuse frames that would be in time."""
    rec = Recorder(block_all=True)
    b = make_batcher(rec, max_batch_size=4, cost=slow_cost(latency=10.0, per_frame=1.0))
    now, _ = await running_and_queued(b, rec)
    predicted, _ = b.predict(1, deadline=now + 200, priority=0)
    assert 12.5 < predicted <= 13.0  # 13 frames x 1 s, not 3 batches x 10 s
    b.check_capacity(1, deadline=now + 20)
    rec.gate.set()
    await b.close()


async def test_admission_never_refuses_an_idle_or_lightly_loaded_batcher():
    rec = Recorder(block_all=True)
    b = make_batcher(rec, max_batch_size=4, cost=slow_cost())
    now = time.monotonic()
    b.check_capacity(1, deadline=now + 11)  # idle: one batch, in time
    b.check_capacity(1, deadline=now + 1)  # idle, a deadline even an idle server misses: no 503
    b.submit("running", deadline=far())
    await asyncio.wait_for(rec.started.wait(), WAIT)
    b.check_capacity(1, deadline=time.monotonic() + 21)  # the running frame, then its own batch
    b.check_capacity(1, deadline=time.monotonic() + 5)  # hopeless alone too: left to the 504 path
    rec.gate.set()
    await b.close()


async def test_admission_margin_learns_how_late_answers_come_against_the_prediction():
    rec = Recorder(block_all=True)
    b = make_batcher(rec, max_batch_size=4, cost=slow_cost())
    now, _ = await running_and_queued(b, rec, queued=0)
    assert b.margin == 1.0
    assert b.check_capacity(1, deadline=now + 20) > 0  # ~12.5 s predicted: admitted
    loop = asyncio.get_running_loop()
    for _ in range(100):  # answers come at twice the predicted time
        b._learn(Pending(None, loop.create_future(), now, now + 2, admitted=now, predicted=1.0), now + 2.0)
    assert 1.9 < b.margin <= 4.0
    with pytest.raises(Unavailable, match="overloaded"):  # 12.5 s x 2 > 20 s
        b.check_capacity(1, deadline=now + 20)
    for _ in range(12000):  # and then in half of it (down by (1 - MARGIN_QUANTILE) steps)
        b._learn(Pending(None, loop.create_future(), now, now + 2, admitted=now, predicted=1.0), now + 0.5)
    assert 0.5 <= b.margin < 0.6
    assert b.check_capacity(1, deadline=now + 20) > 0
    # a short prediction far from the deadline teaches nothing: scheduling noise, not the edge
    margin = b.margin
    b._learn(Pending(None, loop.create_future(), now, now + 2, admitted=now, predicted=0.1), now + 2.0)
    assert b.margin == margin
    rec.gate.set()
    await b.close()


async def test_admitted_frames_teach_the_margin_from_their_answers():
    rec = Recorder()
    b = make_batcher(rec, max_batch_size=4)
    now = time.monotonic()
    # predicted 30 s of their 60: answered far sooner, the margin goes down
    items = [b.submit(i, deadline=now + 60, predicted=30.0) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(p.future for p in items)), WAIT)
    await until(lambda: b.margin < 1.0)
    margin = b.margin
    # dropped as late in the queue: slower than predicted, the margin goes up
    late = b.submit("late", deadline=time.monotonic() - 1, predicted=0.5)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(late.future, WAIT)
    assert b.margin > margin
    await b.close()


async def test_batch_intervals_are_measured_from_overlapping_batches():
    gates = [asyncio.Event(), asyncio.Event()]
    intervals = []

    class Recording(CostModel):
        def observe_interval(self, batch_size, seconds):
            intervals.append((batch_size, seconds))
            super().observe_interval(batch_size, seconds)

    async def execute(batch):
        await gates[len(batch) - 1].wait()
        for p in batch:
            resolve(p.future, p.payload)

    b = make_batcher(execute, max_batch_size=2, inflight=2, cost=Recording(lambda n: n))
    one = b.submit("a", deadline=far())
    await asyncio.sleep(0.05)  # dispatched alone (size 1)
    two = [b.submit("b", deadline=far()), b.submit("c", deadline=far())]  # dispatched while it runs
    await asyncio.sleep(0.3)
    gates[0].set()
    await asyncio.wait_for(one.future, WAIT)
    await asyncio.sleep(0.3)
    gates[1].set()
    await asyncio.wait_for(asyncio.gather(*(p.future for p in two)), WAIT)
    await until(lambda: len(intervals) == 2)
    (n1, s1), (n2, s2) = intervals
    assert n1 == 1 and s1 >= 0.35 - 0.01
    # the second batch ran ~0.6 s, but the server was busy with it alone only after the first ended
    assert n2 == 2 and 0.3 - 0.01 <= s2 < 0.5
    await b.close()


# --- the runner with a fake backend ------------------------------------------------------------

CONFIG = ModelConfig.model_validate({
    "input": {"width": 16, "height": 16},
    "output": {"labels": ["ok", "dent", "scratch"]},
    "batching": {"max_batch_size": 8, "preferred_batch_sizes": [1, 2, 4, 8]},
})


class FakeBackend(Backend):
    """Scores from the mean pixel value of each row, so answers are checkable; records shapes."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.calls = 0
        self.fail_on = fail_on

    def load(self, path, config, device):  # pragma: no cover - not used
        pass

    def warmup(self, batch_sizes):  # pragma: no cover - not used
        pass

    def run(self, batch: np.ndarray) -> np.ndarray:
        self.calls += 1
        self.shapes.append(batch.shape)
        if self.fail_on is not None and self.calls == self.fail_on:
            raise RuntimeError("fake device fault")
        m = batch.reshape(batch.shape[0], -1).mean(axis=1)
        # bright frames -> "ok", dark -> "scratch"
        scores = np.stack([m * 10, np.zeros_like(m), (1 - m) * 10], axis=1).astype(np.float32)
        return {"logits": scores}


def frame(value: int) -> imaging.Frame:
    return imaging.raw_frame(np.full((16, 16, 3), value, np.uint8), (16, 16, 3))


def broken_png() -> imaging.Frame:
    # passes the header check (it's how it reached the runner) but cannot be decoded
    return imaging.Frame("png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, 16, 16)


@pytest.fixture
async def runner_env():
    loop = asyncio.get_running_loop()
    records: list[BatchRecord] = []
    made = []

    def make(backend: Backend) -> ThreadExecutor:
        r = ThreadExecutor(name="fake", backend=backend, config=CONFIG, preferred=(1, 2, 4, 8),
                           cost=CostModel(lambda n: padded_size(n, (1, 2, 4, 8))),
                           on_batch=records.append)
        r.start(loop)
        made.append(r)
        return r

    yield make, records
    for r in made:
        await asyncio.to_thread(r.stop)


def pending(payload, loop, deadline=None) -> Pending:
    now = time.monotonic()
    return Pending(payload, loop.create_future(), now, deadline or now + FAR, dispatched=now)


async def test_runner_pads_three_frames_to_four_rows(runner_env):
    make, records = runner_env
    backend = FakeBackend()
    runner = make(backend)
    loop = asyncio.get_running_loop()
    batch = [pending(frame(v), loop) for v in (250, 5, 240)]
    await asyncio.wait_for(runner.execute(batch), WAIT)
    assert backend.shapes == [(4, 3, 16, 16)]  # NCHW, padded to the preferred size 4
    results = [p.future.result() for p in batch]
    assert all(isinstance(r, FrameResult) for r in results)
    assert [r.result.label for r in results] == ["ok", "scratch", "ok"]
    assert [r.verdict for r in results] == ["OK", "NG", "OK"]
    assert all(r.batch_size == 3 and r.deadline_met for r in results)
    await until(lambda: len(records) == 1)
    assert records[0].size == 3 and records[0].padded == 4 and records[0].failed == 0


async def test_runner_bad_frame_fails_alone(runner_env):
    make, records = runner_env
    backend = FakeBackend()
    runner = make(backend)
    loop = asyncio.get_running_loop()
    batch = [pending(frame(250), loop), pending(broken_png(), loop), pending(frame(5), loop)]
    await asyncio.wait_for(runner.execute(batch), WAIT)
    with pytest.raises(InvalidInput, match="cannot decode PNG"):
        batch[1].future.result()
    assert batch[0].future.result().result.label == "ok"
    assert batch[2].future.result().result.label == "scratch"
    assert len(backend.shapes) == 1  # the good frames still ran, together
    await until(lambda: len(records) == 1)
    assert records[0].size == 2 and records[0].failed == 1


async def test_runner_skips_cancelled_and_expired_frames(runner_env):
    make, _ = runner_env
    backend = FakeBackend()
    runner = make(backend)
    loop = asyncio.get_running_loop()
    gone = pending(frame(250), loop)
    gone.future.cancel()
    late = pending(frame(250), loop, deadline=time.monotonic() - 1)
    ok = pending(frame(5), loop)
    await asyncio.wait_for(runner.execute([gone, late, ok]), WAIT)
    assert isinstance(late.future.exception(), DeadlineExceeded)
    assert ok.future.result().result.label == "scratch"
    # only the one live frame reached the backend, padded to 1 row
    assert backend.shapes == [(1, 3, 16, 16)]


async def test_runner_backend_fault_fails_the_batch_and_the_runner_goes_on(runner_env):
    make, _ = runner_env
    backend = FakeBackend(fail_on=1)
    runner = make(backend)
    loop = asyncio.get_running_loop()
    first = [pending(frame(250), loop), pending(frame(5), loop)]
    await asyncio.wait_for(runner.execute(first), WAIT)
    for p in first:
        with pytest.raises(InternalError):
            p.future.result()
    second = [pending(frame(250), loop)]
    await asyncio.wait_for(runner.execute(second), WAIT)
    assert second[0].future.result().result.label == "ok"


async def test_batcher_and_runner_together(runner_env):
    make, _ = runner_env
    backend = FakeBackend()
    runner = make(backend)
    b = make_batcher(runner.execute, max_batch_size=8, delay=0.05, inflight=2)
    values = [250, 5, 240, 10, 200]
    items = [b.submit(frame(v), deadline=far()) for v in values]
    items.append(b.submit(broken_png(), deadline=far()))
    results = await asyncio.wait_for(asyncio.gather(*(p.future for p in items[:-1])), WAIT)
    assert [r.result.label for r in results] == ["ok", "scratch", "ok", "scratch", "ok"]
    with pytest.raises(InvalidInput):
        await asyncio.wait_for(items[-1].future, WAIT)
    assert sum(s[0] for s in backend.shapes) >= 5
    await b.close()


async def test_runner_batch_of_only_bad_frames(runner_env):
    make, _ = runner_env
    backend = FakeBackend()
    runner = make(backend)
    loop = asyncio.get_running_loop()
    batch = [pending(broken_png(), loop), pending(broken_png(), loop)]
    await asyncio.wait_for(runner.execute(batch), WAIT)
    assert all(isinstance(p.future.exception(), InvalidInput) for p in batch)
    assert backend.shapes == []  # nothing left to run: the model is not called
    good = [pending(frame(250), loop)]
    await asyncio.wait_for(runner.execute(good), WAIT)
    assert good[0].future.result().result.label == "ok"


async def test_dispatch_when_idle_sends_a_lone_request_at_once_and_batches_under_load():
    """Idle: no waiting for company. Busy: requests queue and leave together."""
    import time as _time

    from visionserve.batching import Batcher, CostModel

    gate = asyncio.Event()
    batches: list[int] = []

    async def execute(batch):
        batches.append(len(batch))
        if len(batches) == 1:
            await gate.wait()  # the first batch keeps the model busy
        for p in batch:
            p.future.set_result(len(batch))

    b = Batcher(name="m", execute=execute, max_batch_size=8, max_queue_delay_s=5.0, max_queue_size=64,
                cost=CostModel(lambda n: n), max_inflight=1, dispatch_when_idle=True)
    b.start()
    try:
        t0 = _time.monotonic()
        first = b.submit("a", deadline=_time.monotonic() + 60)
        while not batches:
            await asyncio.sleep(0.001)
        assert _time.monotonic() - t0 < 2.0, "a lone request must not wait the 5 s delay"
        rest = [b.submit(i, deadline=_time.monotonic() + 60) for i in range(5)]
        await asyncio.sleep(0.05)
        assert batches == [1]  # busy: the five wait together
        gate.set()
        assert await first.future == 1
        assert [await p.future for p in rest] == [5] * 5
        assert batches == [1, 5]
    finally:
        await b.close()


async def test_runner_counts_batches_in_flight_until_answered(runner_env):
    import threading

    make, _ = runner_env
    release = threading.Event()

    class Blocking(FakeBackend):
        def run(self, batch):
            release.wait(WAIT)
            return super().run(batch)

    runner = make(Blocking())
    loop = asyncio.get_running_loop()
    assert (runner.inflight, runner.accepted) == (0, 0)
    tasks = [asyncio.ensure_future(runner.execute([pending(frame(v), loop)])) for v in (5, 250)]
    await asyncio.sleep(0.1)
    # the prep thread took the first batch out of the inbox: it is in flight all the same
    assert (runner.inflight, runner.accepted) == (2, 2)
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    assert (runner.inflight, runner.accepted) == (0, 2)


def test_queued_frames_order_by_priority_then_deadline_then_arrival():
    """The queue's comparison (written out for the event loop's sake) is ``sort_key``'s order."""
    import random

    rng = random.Random(3)
    loop = asyncio.new_event_loop()
    try:
        items = [Pending(None, loop.create_future(), 0.0, float(rng.choice([1, 2, 3])),
                         rng.choice([0, 1, 2]), seq) for seq in range(200)]
        rng.shuffle(items)
        assert sorted(items) == sorted(items, key=Pending.sort_key)
    finally:
        loop.close()
