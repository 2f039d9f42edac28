"""The thread executor's handling of device tensors (the GPU path's batches), with torch on the CPU.

A GPU batch's rows are written by kernels queued on the preprocessing stream; the compute thread
runs on another stream. So when frames drop out of a batch after preprocessing (cancelled, or
expired while it was decoded), the runner must not re-index the tensor on the compute thread: it
runs the batch as prepared and answers each frame from its own row of the output.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from visionserve import imaging
from visionserve.backends.base import Backend
from visionserve.batching import CostModel, Pending
from visionserve.config import ModelConfig
from visionserve.errors import DeadlineExceeded
from visionserve.execution.results import FrameResult, padded_size
from visionserve.execution.threads import ThreadExecutor

pytestmark = pytest.mark.gpu_path  # takes CUDA branches where CUDA is: run with the GPU tests

torch = pytest.importorskip("torch")

CONFIG = ModelConfig.model_validate({
    "name": "means",
    "input": {"width": 8, "height": 8},
    "output": {"labels": ["r", "g", "b"], "activation": "none"},
    "verdict": {"ok_labels": ["r"]},
    "batching": {"max_batch_size": 8, "preferred_batch_sizes": [1, 2, 4, 8]},
})
PREFERRED = (1, 2, 4, 8)


class MeansBackend(Backend):
    """Scores = the mean of each input channel; keeps every tensor it was given."""

    def __init__(self) -> None:
        self.inputs: list = []

    def load(self, path, config, device):  # pragma: no cover - not used
        pass

    def warmup(self, batch_sizes):  # pragma: no cover - not used
        pass

    def run(self, batch):
        self.inputs.append(batch)
        return {"scores": batch.float().mean(dim=(2, 3)).numpy()}


def make_prepare(slow_s: float):
    """A device-style preprocessor: a torch tensor, one row per frame (the frame's colour)."""
    prepared: list = []

    def prepare(frames, padded):
        t = torch.zeros((padded, 3, 8, 8))
        for i, f in enumerate(frames):
            t[i] = torch.tensor(f.data[0, 0], dtype=torch.float32).view(3, 1, 1)
        time.sleep(slow_s)  # decoding takes a while: short deadlines pass meanwhile
        prepared.append(t)
        return t, list(range(len(frames))), []

    return prepare, prepared


COLOURS = [(10, 20, 30), (40, 50, 60), (70, 80, 90), (100, 110, 120), (130, 140, 150)]


def start_runner(backend: Backend, prepare, loop) -> ThreadExecutor:
    runner = ThreadExecutor(name="means:1#0", backend=backend, config=CONFIG,
                            preferred=PREFERRED, on_batch=lambda r: None, prepare=prepare,
                            cost=CostModel(lambda n: padded_size(n, PREFERRED)))
    runner.start(loop)
    return runner


def frame(rgb) -> imaging.Frame:
    return imaging.raw_frame(np.full((8, 8, 3), rgb, np.uint8), (8, 8, 3))


async def test_frames_dropped_after_preprocessing_leave_the_device_batch_as_prepared():
    loop = asyncio.get_running_loop()
    backend = MeansBackend()
    prepare, prepared = make_prepare(slow_s=0.2)
    runner = start_runner(backend, prepare, loop)
    try:
        now = time.monotonic()
        colours = COLOURS
        # frames 1 and 3 expire while the batch is prepared; frame 4 is cancelled meanwhile
        deadlines = [now + 60, now + 0.05, now + 60, now + 0.05, now + 60]
        batch = [Pending(frame(c), loop.create_future(), now, d, dispatched=now)
                 for c, d in zip(colours, deadlines)]
        loop.call_later(0.1, batch[4].future.cancel)
        await asyncio.wait_for(runner.execute(batch), 10)
    finally:
        await asyncio.to_thread(runner.stop)
    assert len(backend.inputs) == 1 and backend.inputs[0] is prepared[0]  # no re-index, no copy
    for i in (0, 2):
        r = batch[i].future.result()
        assert isinstance(r, FrameResult) and r.batch_size == 2
        np.testing.assert_allclose(r.result.scores, colours[i])  # its own row, not another frame's
    for i in (1, 3):
        assert isinstance(batch[i].future.exception(), DeadlineExceeded)
    assert batch[4].future.cancelled()


async def test_cpu_batches_are_still_trimmed_to_the_frames_that_remain():
    """numpy batches (the CPU path) are re-indexed: fewer rows is less compute there."""
    loop = asyncio.get_running_loop()
    seen: list = []

    class Numpy(MeansBackend):
        def run(self, batch):
            seen.append(batch.shape[0])
            return {"scores": batch.reshape(batch.shape[0], 3, -1).mean(axis=2)}

    def prepare(frames, padded):
        x = np.zeros((padded, 3, 8, 8), np.float32)
        for i, f in enumerate(frames):
            x[i] = np.asarray(f.data[0, 0], np.float32).reshape(3, 1, 1)
        time.sleep(0.2)
        return x, list(range(len(frames))), []

    runner = start_runner(Numpy(), prepare, loop)
    try:
        now = time.monotonic()
        colours = COLOURS
        batch = [Pending(frame(c), loop.create_future(), now, now + (60 if i % 2 == 0 else 0.05),
                         dispatched=now) for i, c in enumerate(colours)]
        await asyncio.wait_for(runner.execute(batch), 10)
    finally:
        await asyncio.to_thread(runner.stop)
    assert seen == [4]  # 3 frames left of 5: padded to 4, not 8
    for i in (0, 2, 4):
        np.testing.assert_allclose(batch[i].future.result().result.scores, colours[i])


async def test_a_verdict_ready_after_the_deadline_is_answered_late_not_given():
    """A frame whose answer is ready after its deadline gets DeadlineExceeded (504 LATE: no
    decision for a PLC), not its verdict with deadline_met false; the other frames of the batch get
    their own answers, and the batch's record counts it late."""
    loop = asyncio.get_running_loop()
    records: list = []

    class Slow(MeansBackend):
        def run(self, batch):
            time.sleep(0.6)  # the deadline passes while the model runs
            return super().run(batch)

    prepare, _ = make_prepare(slow_s=0.0)
    runner = ThreadExecutor(name="means:1#0", backend=Slow(), config=CONFIG,
                            preferred=PREFERRED, on_batch=records.append, prepare=prepare,
                            cost=CostModel(lambda n: padded_size(n, PREFERRED)))
    runner.start(loop)
    try:
        now = time.monotonic()
        colours = COLOURS[:3]
        deadlines = [now + 60, now + 0.3, now + 60]
        batch = [Pending(frame(c), loop.create_future(), now, d, dispatched=now)
                 for c, d in zip(colours, deadlines)]
        await asyncio.wait_for(runner.execute(batch), 10)
    finally:
        await asyncio.to_thread(runner.stop)
    exc = batch[1].future.exception()
    assert isinstance(exc, DeadlineExceeded), batch[1].future.result()
    assert "while the frame was computed" in exc.message and "ms after the deadline" in exc.message
    assert exc.late_ms >= 200
    for i in (0, 2):
        r = batch[i].future.result()
        assert r.deadline_met and r.batch_size == 3
        np.testing.assert_allclose(r.result.scores, colours[i])  # its own row, not another frame's
    (rec,) = records
    assert (rec.size, rec.ok, rec.late, rec.failed) == (3, 2, 1, 0)
