"""The engine: command-line overrides of model.toml, and its checks on every request.

The in-process tests run a real Engine (onnxruntime on the CPU) on the tiny model repository.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from visionserve import imaging
from visionserve.config import ModelConfig, ServerSettings
from visionserve.engine import Engine
from visionserve.errors import ConfigError, DeadlineExceeded, InvalidInput, NotFound, Unavailable
from visionserve.served import effective_config

BASE = ModelConfig.model_validate({
    "input": {"width": 32, "height": 32},
    "output": {"labels": ["ok", "ng"]},
    "batching": {"max_batch_size": 16, "preferred_batch_sizes": [1, 2, 4, 8, 16],
                 "max_queue_delay_ms": 5, "max_queue_size": 100, "takt_ms": 300},
})


def settings(**kw) -> ServerSettings:
    return ServerSettings(**kw)


def test_no_override_keeps_the_config():
    assert effective_config(BASE, settings()) is BASE


def test_max_batch_size_override_trims_preferred_sizes():
    cfg = effective_config(BASE, settings(max_batch_size=4))
    assert cfg.batching.max_batch_size == 4
    assert cfg.batching.preferred_batch_sizes == (1, 2, 4)
    assert effective_config(BASE, settings(max_batch_size=6)).batching.preferred_batch_sizes == (1, 2, 4)
    # the rest of model.toml is untouched
    assert cfg.batching.max_queue_delay_ms == 5 and cfg.input == BASE.input
    assert BASE.batching.max_batch_size == 16  # the original is not modified


def test_max_batch_size_below_every_preferred_size():
    cfg = ModelConfig.model_validate({**BASE.model_dump(), "batching": {
        "max_batch_size": 32, "preferred_batch_sizes": [8, 16, 32]}})
    assert effective_config(cfg, settings(max_batch_size=4)).batching.preferred_batch_sizes == (4,)


def test_max_batch_size_raised_keeps_preferred_sizes():
    cfg = effective_config(BASE, settings(max_batch_size=64))
    assert cfg.batching.max_batch_size == 64
    assert cfg.batching.preferred_batch_sizes == (1, 2, 4, 8, 16)


def test_queue_and_takt_overrides():
    cfg = effective_config(BASE, settings(max_queue_delay_ms=1500, max_queue_size=7, takt_ms=42.5))
    b = cfg.batching
    assert (b.max_queue_delay_ms, b.max_queue_size, b.takt_ms) == (1500, 7, 42.5)
    assert b.max_batch_size == 16 and b.preferred_batch_sizes == BASE.batching.preferred_batch_sizes
    zero = effective_config(BASE, settings(max_queue_delay_ms=0))
    assert zero.batching.max_queue_delay_ms == 0  # 0 is an override, not "unset"


def test_override_out_of_the_model_range_is_refused():
    # the server setting allows it, model.toml's schema does not: a ConfigError naming the option
    with pytest.raises(ConfigError, match=r"--max-queue-delay-ms: .*10000.* \(got 20000"):
        effective_config(BASE, settings(max_queue_delay_ms=20_000))


def test_engine_scan_checks_the_overrides(tiny_repo):
    eng = Engine(settings(models=tiny_repo, max_batch_size=5000), device="cpu")
    with pytest.raises(ConfigError, match="model tiny: --max-batch-size"):
        eng.scan()


# --- a real engine on the tiny model -----------------------------------------------------------


@pytest.fixture
async def engine(tiny_repo):
    eng = Engine(settings(models=tiny_repo, max_queue_delay_ms=1), device="cpu")
    await eng.start()
    yield eng
    await eng.close()


def raw(value: int = 128) -> imaging.Frame:
    return imaging.raw_frame(np.full((32, 32, 3), value, np.uint8), (32, 32, 3))


def _sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_engine_answers_frames_in_order(engine):
    assert engine.ready and engine.model_ready("tiny")
    frames = [raw(v) for v in (0, 128, 255)]
    served, results = await engine.infer("tiny", None, frames)
    assert served.name == "tiny" and served.version == 1
    assert len(results) == 3
    for f, r in zip(frames, results):
        _, (alone,) = await engine.infer("tiny", "1", [f])
        assert alone.result.label == r.result.label
        assert np.allclose(alone.result.scores, r.result.scores, atol=1e-5)
    assert served.stats.inference_count == 6


@pytest.mark.parametrize("kw, match", [
    ({"deadline_ms": -1.0}, "deadline"), ({"deadline_ms": 0.0}, "deadline"),
    ({"deadline_ms": float("inf")}, "deadline"), ({"deadline_ms": 1e12}, "deadline"),
    ({"priority": -1}, "priority"), ({"priority": 3}, "priority"), ({"priority": 10**9}, "priority"),
])
async def test_engine_refuses_out_of_range_deadline_and_priority(engine, kw, match):
    with pytest.raises(InvalidInput, match=match):
        await engine.infer("tiny", None, [raw()], **kw)


async def test_engine_unknown_model_and_version(engine):
    with pytest.raises(NotFound, match="unknown model 'nope'"):
        await engine.infer("nope", None, [raw()])
    with pytest.raises(NotFound, match="no version 9"):
        await engine.infer("tiny", "9", [raw()])


async def test_engine_no_frames_and_too_many(engine):
    with pytest.raises(InvalidInput, match="no frame"):
        await engine.infer("tiny", None, [])
    with pytest.raises(InvalidInput, match="at most 64"):
        await engine.infer("tiny", None, [raw()] * 65)


async def test_engine_tiny_deadline_is_late(engine):
    with pytest.raises(DeadlineExceeded, match="in the queue"):
        await engine.infer("tiny", None, [raw()], deadline_ms=0.001)
    # the gauge reads the queue when scraped: not left at 1, what admission saw (issue 15)
    assert _sample("visionserve_queue_depth", model="tiny") == 0
    _, (r,) = await engine.infer("tiny", None, [raw()])  # and it keeps serving
    assert r.deadline_met


async def test_engine_drain_refuses_new_work(engine):
    await engine.drain(timeout_s=5)
    assert not engine.ready
    with pytest.raises(Unavailable, match="shutting down"):
        await engine.infer("tiny", None, [raw()])


async def test_engine_bad_repository(tmp_path):
    eng = Engine(settings(models=tmp_path), device="cpu")
    with pytest.raises(ConfigError, match="holds no model"):
        eng.scan()
    assert not eng.ready


async def test_engine_cancelled_request_never_runs(tiny_repo):
    eng = Engine(settings(models=tiny_repo, max_queue_delay_ms=800), device="cpu")
    await eng.start()
    try:
        task = asyncio.ensure_future(eng.infer("tiny", None, [raw()]))
        await asyncio.sleep(0.1)
        assert _sample("visionserve_queue_depth", model="tiny") == 1
        task.cancel()  # what the HTTP front end does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _sample("visionserve_queue_depth", model="tiny") == 0  # read when scraped
        await asyncio.sleep(1.2)  # past the queue delay
        s = eng.get("tiny")
        assert s.stats.execution_count == 0 and s.stats.inference_count == 0
        assert s.batcher.queue_depth == 0
    finally:
        await eng.close()


async def test_engine_keeps_latencies_only_once_asked(engine):
    await engine.infer("tiny", None, [raw()])
    # nothing recorded on the hot path unless the guard reads it
    assert engine.admission.latency is None
    p99 = engine.latency_p99()
    assert p99() is None  # too few frames yet
    await engine.infer("tiny", None, [raw()] * 30)
    assert p99() is not None and p99() > 0


# --- issue 14: a dead batcher loop, admission under load, the runner pick -----------------------


class _BrokenCost:
    """Stands in for the cost model: fails the way the dict race did, inside the batching loop."""

    def estimate(self, batch_size: int) -> float:
        raise RuntimeError("dictionary changed size during iteration")

    interval = estimate


async def test_engine_dead_batcher_loop_turns_not_ready_with_a_log_line(tiny_repo, caplog):
    from visionserve import metrics

    eng = Engine(settings(models=tiny_repo, max_queue_delay_ms=50), device="cpu")
    await eng.start()
    try:
        s = eng.get("tiny")
        s.batcher.cost = _BrokenCost()
        # answered 503 at once, not left waiting for a loop that will never dispatch it
        with caplog.at_level("ERROR", logger="visionserve.batching"), \
                pytest.raises(Unavailable, match="batcher stopped"):
            await asyncio.wait_for(eng.infer("tiny", None, [raw()]), 10)
        assert any("batcher of model tiny:1 stopped" in r.getMessage() for r in caplog.records)
        assert not eng.ready and not eng.model_ready("tiny")
        assert metrics.READY.labels("tiny", "1")._value.get() == 0
        with pytest.raises(Unavailable, match="not ready"):
            await eng.infer("tiny", None, [raw()])
    finally:
        await eng.close()  # does not re-raise the loop's error


async def test_engine_refuses_frames_the_queue_would_make_late(tiny_repo):
    from visionserve import metrics
    from visionserve.batching import CostModel

    eng = Engine(settings(models=tiny_repo, max_queue_delay_ms=1000, takt_ms=2000), device="cpu")
    await eng.start()
    try:
        s = eng.get("tiny")
        # 0.4 s of the server's time per frame, in batches of 2 (the latency is kept short so that
        # the batcher does not dispatch early): 7 frames queued, waiting for company
        # (max_queue_delay 1 s), and one more take 3.2 s, past the 2 s takt. The runner measures
        # into its own cost model, so these figures stay.
        cost = CostModel(lambda n: n)
        for n in range(1, 9):
            cost.observe(n, 0.010)
        cost.observe_interval(2, 0.8)
        queued = [asyncio.ensure_future(eng.infer("tiny", None, [raw()])) for _ in range(7)]
        await asyncio.sleep(0.05)
        s.batcher.cost = cost
        rejected = metrics.FRAMES.labels("tiny", "rejected")._value.get()
        refused = metrics.REQUESTS.labels("tiny", "unavailable")._value.get()
        with pytest.raises(Unavailable, match="overloaded") as info:
            await eng.infer("tiny", None, [raw()])
        assert info.value.retry_after_s and info.value.retry_after_s > 2.0
        assert metrics.FRAMES.labels("tiny", "rejected")._value.get() == rejected + 1
        assert metrics.REQUESTS.labels("tiny", "unavailable")._value.get() == refused + 1
        # a higher priority goes before the seven: its batch (of 2, 0.8 s) ends in time
        _, (r,) = await asyncio.wait_for(eng.infer("tiny", None, [raw()], priority=2), 10)
        assert r.result.label
        results = await asyncio.wait_for(asyncio.gather(*queued), 10)
        assert len(results) == 7  # what was admitted is answered
    finally:
        await eng.close()


@pytest.fixture(scope="module")
def two_instance_repo(tmp_path_factory):
    from conftest import TINY_TOML, make_tiny_model

    root = tmp_path_factory.mktemp("tiny2")
    make_tiny_model(root / "tiny", TINY_TOML + "[runtime]\ninstances = 2\n")
    return root


async def test_engine_two_instances_both_get_batches(two_instance_repo):
    eng = Engine(settings(models=two_instance_repo, max_queue_delay_ms=1), device="cpu")
    await eng.start()
    try:
        s = eng.get("tiny")
        assert len(s.runners) == 2
        counts = [0, 0]
        for i, r in enumerate(s.runners):
            def counting(batch, i=i, execute=r.execute):
                counts[i] += 1
                return execute(batch)
            r.execute = counting
        for _ in range(6):  # one at a time: each finds both instances idle
            await eng.infer("tiny", None, [raw()])
        assert counts[0] > 0 and counts[1] > 0, counts
        counts[:] = [0, 0]
        for _ in range(5):  # concurrent requests: batches overlap
            await asyncio.gather(*(eng.infer("tiny", None, [raw(v)]) for v in range(0, 250, 25)))
        assert counts[0] > 0 and counts[1] > 0, counts
        for _ in range(100):  # the batch is answered frames first, then the runner's own future
            if [r.inflight for r in s.runners] == [0, 0]:
                break
            await asyncio.sleep(0.01)
        assert [r.inflight for r in s.runners] == [0, 0]
    finally:
        await eng.close()


# --- issue 15: LATE verdicts, and metrics that count each answer once -----------------------------


async def test_engine_a_verdict_ready_after_the_deadline_is_late_and_counted_once(engine, monkeypatch):
    import time

    backend = engine.get("tiny").runners[0].backend
    run = backend.run

    def slow(x):
        time.sleep(0.4)  # the deadline passes while the model runs
        return run(x)

    monkeypatch.setattr(backend, "run", slow)
    series = [("visionserve_requests_total", {"model": "tiny", "outcome": "deadline"}),
              ("visionserve_frames_total", {"model": "tiny", "outcome": "late"}),
              ("visionserve_deadline_misses_total", {"model": "tiny"}),
              ("visionserve_requests_total", {"model": "tiny", "outcome": "success"})]
    before = [_sample(n, **labels) for n, labels in series]
    with pytest.raises(DeadlineExceeded, match="while the frame was computed") as info:
        await engine.infer("tiny", None, [raw(), raw(7)], deadline_ms=200)
    assert info.value.late_ms > 100
    assert [_sample(n, **labels) - b for (n, labels), b in zip(series, before)] == [1, 2, 2, 0]
    assert engine.get("tiny").stats.fail.count == 2


async def test_engine_counts_an_unknown_models_request_under_one_placeholder(engine):
    before = _sample("visionserve_requests_total", model="_unknown", outcome="not_found")
    for name in ("nope-1", "nope-2"):
        with pytest.raises(NotFound) as info:
            engine.get(name)
        engine.count_error(name, info.value)  # what a front end does with a refusal of its own
        assert info.value.counted
    assert _sample("visionserve_requests_total", model="_unknown", outcome="not_found") == before + 2
    assert _sample("visionserve_requests_total", model="nope-1", outcome="not_found") == 0
