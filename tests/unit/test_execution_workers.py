"""Batches prepared by worker processes (execution/workers.py; the batch workers of
``--gpu-batch-processes``, and the preparation-only ones, off in the server), on the CPU:
a real worker process (``python -m visionserve.execution.worker``), slots in a real shared memory
file, the real TorchPreprocessor on both sides. The GPU test (tests/gpu/test_gpu_path.py) does
the same with CUDA IPC slots."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from visionserve import imaging
from visionserve.batching import CostModel, Pending
from visionserve.config import ModelConfig
from visionserve.execution.results import FrameResult, padded_size
from visionserve.tasks.classification import Classified

torch = pytest.importorskip("torch")
cv2 = pytest.importorskip("cv2")

from visionserve import framing
from visionserve.execution import protocol, workers
from visionserve.execution import worker as child
from visionserve.execution.workers import WorkerExecutor
from visionserve.gpu.preprocess import TorchPreprocessor

pytestmark = pytest.mark.gpu_path  # takes CUDA branches where CUDA is: run with the GPU tests

PREFERRED = (1, 2, 4, 8)
CONFIG = ModelConfig.model_validate({
    "name": "means",
    "input": {"width": 16, "height": 16, "scale": 1.0, "mean": [0, 0, 0], "std": [1, 1, 1]},
    "output": {"labels": ["r", "g", "b"], "activation": "none"},
    "verdict": {"ok_labels": ["r"]},
    "batching": {"max_batch_size": 8, "preferred_batch_sizes": list(PREFERRED)},
})


def worker(one_call: bool = False, **kw) -> workers.WorkerPool:
    """Workers without the one call start in under 2 s here, with it in 3-5 (TorchScript
    compiles it); the module's shared worker has it."""
    local = TorchPreprocessor.for_config(CONFIG, device="cpu", dtype=torch.float32,
                                         one_call=one_call)
    args = {"device": "cpu", "dtype": torch.float32, "channels_last": False,
            "one_call": one_call, "preferred": PREFERRED, "name": "means#0", **kw}
    return workers.WorkerPool(CONFIG, local, **args)


@pytest.fixture(scope="module")
def pp():
    p = worker(one_call=True)
    assert p.start(), p.failure
    yield p
    p.close()


def jpeg(seed: int, h: int = 48, w: int = 64) -> imaging.Frame:
    img = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".jpg", img)
    assert ok
    return imaging.encoded_frame(buf.tobytes())


def mixed_frames() -> list[imaging.Frame]:
    png = cv2.imencode(".png", np.full((20, 30, 3), (10, 200, 90), np.uint8))[1].tobytes()
    good = jpeg(1).data
    corrupt = good[:200] + b"\xff\xd9"  # a header and the end marker, no scan to decode
    raw = np.arange(24 * 32 * 3, dtype=np.uint8).reshape(24, 32, 3)
    # a frame read in place (zero-copy mode): a uint8 view of memory something else owns
    arena = np.frombuffer(bytearray(b"\0" * 7 + jpeg(3).data + b"\0" * 9), np.uint8)
    in_place = imaging.Frame("jpeg", arena[7:-9], 64, 48)
    return [jpeg(0), imaging.encoded_frame(png), imaging.encoded_frame(corrupt),
            imaging.raw_frame(raw, raw.shape), jpeg(2, 120, 90), in_place]


def test_the_worker_prepares_what_the_serving_process_would(pp):
    frames = mixed_frames()
    ref, ref_good, ref_bad = pp.fallback.prepare(frames, 8)
    t, good, bad = pp.prepare(frames, 8)
    try:
        assert good == ref_good == [0, 1, 3, 4, 5]
        assert [(i, type(e), str(e)) for i, e in bad] == [(i, type(e), str(e)) for i, e in ref_bad]
        assert [i for i, _ in bad] == [2] and "corrupt" in str(bad[0][1])
        assert torch.equal(t, ref)
        assert t.data_ptr() in {s.data_ptr() for s in pp.workers[0].slots}  # a slot, not a copy
    finally:
        pp.release(t)
    assert pp.counts["remote_batches"] >= 1 and pp.failure is None


def test_a_bayer_mosaic_crosses_to_the_worker_with_its_pattern(pp):
    """A camera's Bayer frame goes to the worker as its mosaic (a third of the RGB bytes) and
    its pattern, demosaiced there: the tensor of the RGB frame the serving process would make."""
    from visionserve.cameras.pixels import mosaic, to_frame, to_rgb8

    frames, rgbs = [], []
    for k, pattern in enumerate(("RG", "GB", "GR", "BG")):
        samples = mosaic(np.random.default_rng(k).integers(0, 255, (24 + k, 33, 3), np.uint8),
                         pattern)
        frames.append(to_frame(samples, f"Bayer{pattern}8"))
        rgb = to_rgb8(samples, f"Bayer{pattern}8")
        rgbs.append(imaging.raw_frame(rgb, rgb.shape))
    ref, ref_good, _ = pp.fallback.prepare(rgbs, 4)
    t, good, bad = pp.prepare(frames, 4)
    try:
        assert good == ref_good == [0, 1, 2, 3] and not bad
        assert torch.equal(t, ref)
        assert t.data_ptr() in {s.data_ptr() for s in pp.workers[0].slots}  # the worker's
    finally:
        pp.release(t)
    desc, data = protocol._frame_buffer(frames[1])
    assert desc[4] == "GB" and data.nbytes == 25 * 33


def test_a_slot_is_not_written_again_until_the_compute_thread_gives_it_back(pp):
    frames = [jpeg(i) for i in range(4)]
    held = [pp.prepare(frames, 4)[0] for _ in range(protocol.SLOTS)]
    assert len({t.data_ptr() for t in held}) == protocol.SLOTS
    before = [t.clone() for t in held]
    done: list = []
    other = [jpeg(10 + i) for i in range(4)]
    thread = threading.Thread(target=lambda: done.append(pp.prepare(other, 4)[0]), daemon=True)
    thread.start()
    thread.join(1.0)
    assert not done  # every slot is held: the next batch waits
    assert all(torch.equal(a, b) for a, b in zip(held, before))  # and nothing was overwritten
    pp.release(held[1])
    thread.join(30)
    assert done and done[0].data_ptr() == held[1].data_ptr()
    assert torch.equal(done[0], pp.fallback.prepare(other, 4)[0])
    for t in held[:1] + held[2:] + done:
        pp.release(t)


def _alive() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("visionserve_batch_workers_alive") or 0.0


def test_when_one_of_two_workers_dies_the_other_prepares_every_batch(caplog):
    before = _alive()  # the module's shared worker counts too
    p = worker(workers=2)
    assert p.start(), p.failure
    assert _alive() == before + 2  # the console's System page shows it
    try:
        frames = [jpeg(i) for i in range(3)]
        victim = p.pids[0]
        os.kill(victim, signal.SIGKILL)
        with caplog.at_level(logging.ERROR, logger="visionserve.execution"):
            for _ in range(6):  # whichever worker a batch finds first: none is lost
                t, good, _ = p.prepare(frames, 4)
                assert good == [0, 1, 2] and torch.equal(t, p.fallback.prepare(frames, 4)[0])
                p.release(t)
        assert len(p.pids) == 1 and victim not in p.pids
        assert p.counts == {"remote_batches": 6, "local_batches": 0}
        assert any("1 preparation process(es) left" in r.message for r in caplog.records)
        assert _alive() == before + 1
    finally:
        p.close()
    assert _alive() == before


def test_a_worker_that_dies_leaves_its_batches_to_the_serving_process(caplog):
    p = worker()
    assert p.start(), p.failure
    try:
        frames = [jpeg(i) for i in range(3)]
        t, _, _ = p.prepare(frames, 4)
        p.release(t)
        os.kill(p.pid, signal.SIGKILL)
        with caplog.at_level(logging.ERROR, logger="visionserve.execution"):
            for _ in range(2):
                t, good, bad = p.prepare(frames, 4)
                assert good == [0, 1, 2] and bad == []
                assert torch.equal(t, p.fallback.prepare(frames, 4)[0])
                p.release(t)
        assert p.failure and "failed" in p.failure and p.pid is None and p.pids == []
        assert p.counts["local_batches"] == 2
        assert sum("prepared in the serving process" in r.message for r in caplog.records) == 1
    finally:
        p.close()


def big_frames(seed: int = 5) -> list[imaging.Frame]:
    """Eight raw frames of 4.3 MB: more than a slot's staging memory (32 MB), so their bytes go
    on the socket, whose buffer holds about 200 kB."""
    rng = np.random.default_rng(seed)
    return [imaging.raw_frame(rng.integers(0, 255, (1200, 1200, 3), dtype=np.uint8),
                              (1200, 1200, 3)) for _ in range(8)]


def test_a_batch_larger_than_its_staging_memory_goes_on_the_socket(pp):
    frames = big_frames()
    assert sum(f.data.nbytes for f in frames) > protocol.STAGE_BYTES
    t, good, bad = pp.prepare(frames, 8)
    try:
        assert good == list(range(8)) and bad == []
        assert torch.equal(t, pp.fallback.prepare(frames, 8)[0])
    finally:
        pp.release(t)


async def test_the_loop_sends_a_large_batch_as_the_socket_drains(pp):
    """From the event loop the socket is non-blocking: the loop writes what it takes and the
    rest when it drains, and frames staged for the next batch do not wait for it."""
    loop = asyncio.get_running_loop()
    pp.attach(loop)
    try:
        got: list = []
        small = [jpeg(i) for i in range(3)]
        for frames in (big_frames(), small):
            assert pp.submit(frames, 8 if len(frames) > 4 else 4, got.append)
        await asyncio.wait_for(_until(lambda: len(got) == 2), 60)
        for (t, good, bad), frames in zip(got, (big_frames(), small)):
            assert good == list(range(len(frames))) and bad == []
            assert torch.equal(t, pp.fallback.prepare(frames, t.shape[0])[0])
            pp.release(t)
    finally:
        pp._detach_all()
        for w in pp.workers:
            w.sock.setblocking(True)
            framing.set_time_limit(w.sock, pp.reply_timeout_s)


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_a_worker_that_stops_answering_is_given_up_after_the_time_limit(caplog):
    p = worker(reply_timeout_s=2.0)
    assert p.start(), p.failure
    pid = p.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        frames = [jpeg(i) for i in range(2)]
        with caplog.at_level(logging.ERROR, logger="visionserve.execution"):
            t0 = time.monotonic()
            t, good, _ = p.prepare(frames, 2)
            waited = time.monotonic() - t0
        assert good == [0, 1] and torch.equal(t, p.fallback.prepare(frames, 2)[0])
        assert 1.5 < waited < 20 and p.failure and p.pid is None
        assert any("prepared in the serving process" in r.message for r in caplog.records)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        p.close()


def test_a_worker_that_cannot_start_leaves_the_instance_preparing_in_process(caplog):
    p = worker(device="cuda:0") if not torch.cuda.is_available() else worker(device="cuda:99")
    with caplog.at_level(logging.WARNING, logger="visionserve.execution"):
        assert not p.start(timeout_s=120)
    assert "did not start" in (p.failure or "")
    assert any("did not start" in r.message for r in caplog.records)
    frames = [jpeg(0)]
    t, good, _ = p.prepare(frames, 1)
    assert good == [0] and torch.equal(t, p.fallback.prepare(frames, 1)[0])
    p.close()


class Means:
    """A backend: the mean of each channel of each row, computed when the batch runs."""

    stream = None

    def run(self, batch):
        return {"scores": batch.float().mean(dim=(2, 3)).numpy().copy()}


def coloured_batches(loop, count: int, seed: int = 7) -> list[tuple[list, list[Pending]]]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        n = int(rng.integers(1, 9))
        colours = [tuple(int(c) for c in rng.integers(0, 256, 3)) for _ in range(n)]
        now = time.monotonic()
        batch = [Pending(imaging.raw_frame(np.full((12, 20, 3), c, np.uint8), (12, 20, 3)),
                         loop.create_future(), now, now + 60, dispatched=now)
                 for c in colours]
        batches.append((colours, batch))
    return batches


def runner_for(p: workers.WorkerPool) -> WorkerExecutor:
    """An executor with preparation-only workers (the batches from the loop
    to the workers; the prep thread prepares only what they cannot)."""
    return WorkerExecutor(name="means:1#0", backend=Means(), config=CONFIG,  # type: ignore[arg-type]
                          preferred=PREFERRED, cost=CostModel(lambda n: padded_size(n, PREFERRED)),
                          on_batch=lambda r: None, pool=p, why="test")


def assert_own_colours(batches) -> None:
    for colours, batch in batches:
        for c, p in zip(colours, batch):
            r = p.future.result()
            assert isinstance(r, FrameResult) and isinstance(r.result, Classified)
            np.testing.assert_allclose(r.result.scores, c, atol=1e-4)


async def test_every_answer_is_its_own_frames_through_two_workers():
    """The event loop sends an instance's batches to two workers (at most three in flight, as
    the batcher allows): many batches, slots reused, frames of distinct colours; each answer
    holds its own frame's colour, and every slot comes back."""
    p = worker(workers=2)
    assert p.start(), p.failure
    runner = runner_for(p)
    assert (runner.batches_in_flight, runner.full_batches_extra) == (3, 0)
    loop = asyncio.get_running_loop()
    await asyncio.to_thread(runner.start, loop)  # as the engine starts it: off the loop
    await asyncio.sleep(0)  # the workers are attached on the loop
    batches = coloured_batches(loop, 30)
    try:
        limit = asyncio.Semaphore(runner.batches_in_flight)

        async def one(batch):
            async with limit:
                await runner.execute(batch)

        await asyncio.wait_for(asyncio.gather(*(one(b) for _, b in batches)), 60)
        assert [w.free.qsize() for w in p.workers] == [protocol.SLOTS] * 2  # all given back
    finally:
        await asyncio.to_thread(runner.stop)
    assert_own_colours(batches)
    assert p.counts == {"remote_batches": 30, "local_batches": 0}
    assert all(len(w.outstanding) == 0 for w in p.workers) and p.pids == []


@pytest.mark.parametrize("how", ["killed", "stopped"])
async def test_batches_a_lost_worker_had_are_prepared_in_the_serving_process(how, caplog):
    """A worker killed, or stopped (SIGSTOP: no answer within the time limit), while the loop
    has sent it batches: those batches are prepared by the runner's prep thread, later ones by
    the other worker; every answer is its own frame's."""
    p = worker(workers=2, reply_timeout_s=2.0)
    assert p.start(), p.failure
    runner = runner_for(p)
    loop = asyncio.get_running_loop()
    runner.start(loop)
    victim = p.pids[0]
    batches = coloured_batches(loop, 20, seed=11)
    try:
        os.kill(victim, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        limit = asyncio.Semaphore(runner.batches_in_flight)

        async def one(batch):
            async with limit:
                await runner.execute(batch)

        with caplog.at_level(logging.ERROR, logger="visionserve.execution"):
            await asyncio.wait_for(asyncio.gather(*(one(b) for _, b in batches)), 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        await asyncio.to_thread(runner.stop)
    assert_own_colours(batches)
    assert p.failure and ("did not answer" in p.failure if how == "stopped" else True)
    assert p.counts["remote_batches"] + p.counts["local_batches"] == 20
    assert p.counts["local_batches"] >= 1  # what the lost worker had
    assert any("1 preparation process(es) left" in r.message for r in caplog.records)


# --- --gpu-batch-processes: the workers prepare and run the batches --------------------------

TORCH_CONFIG = ModelConfig.model_validate({**CONFIG.model_dump(mode="json"),
                                           "runtime": {"backend": "torch"}})


@pytest.fixture(scope="module")
def means_model(tmp_path_factory):
    """CONFIG's model as a torch program on disk (the mean of each channel), and the serving
    process's own instance of it (the fallback), loaded as the engine loads one."""
    from visionserve.backends.torch import TorchBackend

    class MeansModule(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))

    path = tmp_path_factory.mktemp("means") / "means" / "1" / "model.pt2"
    path.parent.mkdir(parents=True)
    ep = torch.export.export(MeansModule().eval(), (torch.zeros(2, 3, 16, 16),),
                             dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    torch.export.save(ep, str(path))
    backend = TorchBackend()
    backend.load(path, TORCH_CONFIG, "cpu")
    backend.warmup(PREFERRED)
    return path, backend


def batch_workers(means_model, **kw) -> workers.WorkerPool:
    path, _ = means_model
    return worker(model={"path": str(path), "config": TORCH_CONFIG.model_dump(mode="json")}, **kw)


def model_runner_for(p: workers.WorkerPool, backend) -> WorkerExecutor:
    """An executor as the engine makes one with --gpu-batch-processes: its own backend runs only
    what the workers cannot."""
    return WorkerExecutor(name="means:1#0", backend=backend, config=CONFIG,
                          preferred=PREFERRED, cost=CostModel(lambda n: padded_size(n, PREFERRED)),
                          on_batch=lambda r: None, pool=p, why="--gpu-batch-processes")


async def run_all(runner: WorkerExecutor, batches) -> None:
    """Every batch through ``runner``, as many at once as the batcher would give it (full ones
    included)."""
    limit = asyncio.Semaphore(runner.batches_in_flight + runner.full_batches_extra)

    async def one(batch):
        async with limit:
            await runner.execute(batch)

    await asyncio.wait_for(asyncio.gather(*(one(b) for _, b in batches)), 60)


async def test_batch_workers_answer_every_frame_with_its_own_outputs(means_model):
    """Two workers prepare and run an instance's batches (two in flight each, and one more
    full batch each): every answer holds its own frame's colour, the serving process's model
    runs only the batches that found the instance idle (the first), and no slot is lost."""
    _, backend = means_model
    p = batch_workers(means_model, workers=2)
    assert p.start(), p.failure
    runner = model_runner_for(p, backend)
    assert (runner.batches_in_flight, runner.full_batches_extra) == (4, 2)
    records: list = []
    runner.on_batch = records.append
    ran_here = backend.eager_runs
    loop = asyncio.get_running_loop()
    await asyncio.to_thread(runner.start, loop)
    await asyncio.sleep(0)
    batches = coloured_batches(loop, 30, seed=3)
    try:
        await run_all(runner, batches)
        assert [w.free.qsize() for w in p.workers] == [protocol.SLOTS] * 2
    finally:
        await asyncio.to_thread(runner.stop)
    assert_own_colours(batches)
    local = p.counts["local_batches"]
    assert p.counts["remote_batches"] + local == 30 and 1 <= local <= 3
    assert backend.eager_runs - ran_here == local  # the rest ran in the workers
    assert len(records) == 30 and sum(r.size for r in records) == sum(len(b) for _, b in batches)
    assert all(r.infer_s > 0 and r.prep_s > 0 for r in records)


async def test_a_batch_that_finds_the_instance_idle_runs_in_the_serving_process(means_model):
    """A lone batch saves the worker's round trip: with nothing else in flight the serving
    process's own threads prepare and run it; a batch sent while that one is in flight goes to a
    worker; and once both are answered the next runs here again. Every answer is its own
    frame's."""
    _, backend = means_model
    p = batch_workers(means_model)
    assert p.start(), p.failure
    runner = model_runner_for(p, backend)
    loop = asyncio.get_running_loop()
    await asyncio.to_thread(runner.start, loop)
    await asyncio.sleep(0)
    first, second, third = batches = coloured_batches(loop, 3, seed=5)
    ran_here = backend.eager_runs
    try:
        # the first is in flight (in this process) when the second is sent
        both = [asyncio.ensure_future(runner.execute(b)) for _, b in (first, second)]
        await asyncio.wait_for(asyncio.gather(*both), 60)
        assert p.counts == {"remote_batches": 1, "local_batches": 1}
        await asyncio.wait_for(runner.execute(third[1]), 60)
    finally:
        await asyncio.to_thread(runner.stop)
    assert p.counts == {"remote_batches": 1, "local_batches": 2}
    assert backend.eager_runs - ran_here == 2
    assert_own_colours(batches)


async def test_a_frame_a_batch_worker_cannot_decode_fails_alone(means_model):
    """A corrupt JPEG among good frames: it alone gets its 400 (InvalidInput), the others their
    own outputs, from the worker's run of the batch without it (sent while another batch is in
    flight, so that the worker takes it)."""
    from visionserve.errors import InvalidInput

    _, backend = means_model
    p = batch_workers(means_model)
    assert p.start(), p.failure
    runner = model_runner_for(p, backend)
    loop = asyncio.get_running_loop()
    runner.start(loop)
    await asyncio.sleep(0)
    now = time.monotonic()
    colours = [(200, 10, 10), (10, 200, 10)]
    frames = [imaging.raw_frame(np.full((12, 20, 3), colours[0], np.uint8), (12, 20, 3)),
              imaging.encoded_frame(jpeg(1).data[:200] + b"\xff\xd9"),
              imaging.raw_frame(np.full((12, 20, 3), colours[1], np.uint8), (12, 20, 3))]
    batch = [Pending(f, loop.create_future(), now, now + 60, dispatched=now) for f in frames]
    lead = coloured_batches(loop, 1, seed=9)
    try:
        both = [asyncio.ensure_future(runner.execute(b)) for b in (lead[0][1], batch)]
        await asyncio.wait_for(asyncio.gather(*both), 60)
    finally:
        await asyncio.to_thread(runner.stop)
    assert isinstance(batch[1].future.exception(), InvalidInput)
    for p_, c in ((batch[0], colours[0]), (batch[2], colours[1])):
        np.testing.assert_allclose(p_.future.result().result.scores, c, atol=1e-4)
    assert p.counts == {"remote_batches": 1, "local_batches": 1}
    assert_own_colours(lead)


@pytest.mark.parametrize("how", ["killed", "stopped"])
async def test_batches_a_lost_batch_worker_had_run_in_the_serving_process(means_model, how,
                                                                          caplog):
    """A batch worker killed, or stopped (no answer within the time limit), with batches on
    their way: the serving process prepares and runs those, the other worker the later ones;
    every answer is its own frame's."""
    _, backend = means_model
    p = batch_workers(means_model, workers=2, reply_timeout_s=2.0)
    assert p.start(), p.failure
    runner = model_runner_for(p, backend)
    loop = asyncio.get_running_loop()
    runner.start(loop)
    victim = p.pids[0]
    ran_here = backend.eager_runs
    batches = coloured_batches(loop, 20, seed=13)
    try:
        os.kill(victim, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        with caplog.at_level(logging.ERROR, logger="visionserve.execution"):
            await run_all(runner, batches)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        await asyncio.to_thread(runner.stop)
    assert_own_colours(batches)
    assert p.counts["remote_batches"] + p.counts["local_batches"] == 20
    assert p.counts["local_batches"] >= 1 and backend.eager_runs > ran_here
    assert any("1 preparation process(es) left" in r.message for r in caplog.records)


def test_a_batch_worker_whose_device_fails_answers_the_batch_and_stops():
    """The worker's loop (in this process, over a socket pair): a sticky CUDA error while a
    batch runs is answered as that batch's failure, then the worker stops reading, so the serving
    process sees the channel close (and runs what it had sent itself); a batch sent after it is
    not answered."""
    import socket

    ours, theirs = socket.socketpair()
    stage = np.zeros(protocol.STAGE_BYTES * protocol.SLOTS, np.uint8)

    class Prep:
        def prepare(self, frames, padded):
            return torch.zeros(padded, 3, 4, 4), list(range(len(frames))), []

    class FailingDevice:
        def run(self, x):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    worker_loop = threading.Thread(target=child._prepare_and_run,
                                   args=(theirs, stage, Prep(), FailingDevice()), daemon=True)
    worker_loop.start()
    frames = [jpeg(0)]
    parts = []  # both requests at once: the worker stops reading after the first
    for job in (1, 2):
        view = stage[job * protocol.STAGE_BYTES:(job + 1) * protocol.STAGE_BYTES]
        parts += protocol.request(job, job, 1, frames, view)
    assert ours.sendmsg(parts) == sum(len(p) for p in parts)
    reader = framing.Reader(ours)
    failed = reader.message()
    assert failed[:2] == ("failed", 1) and "illegal memory access" in failed[2]
    with pytest.raises(EOFError):
        reader.message()
    worker_loop.join(10)
    assert not worker_loop.is_alive()
    ours.close()
    theirs.close()


def test_the_reservation_gives_an_instance_batch_workers_only_where_they_can_serve(means_model,
                                                                                  tmp_path,
                                                                                  caplog):
    """GpuReservation.placement with --gpu-batch-processes (on the CPU here): workers that
    run the model where they start; the instance's own preprocessor where none can start (a
    model file they cannot read) or where the task reads its outputs on the device."""
    from types import SimpleNamespace

    from visionserve.execution import InProcess, InWorkers
    from visionserve.execution.reservation import GpuReservation

    path, _ = means_model
    res = GpuReservation("8GiB", "cpu", batch_processes=1)
    view = SimpleNamespace(takes_device_input=True, input_dtype=torch.float32, stream=None,
                           channels_last=False, config=TORCH_CONFIG)
    host_task = SimpleNamespace(on_device=False)
    placed = res.placement(view, TORCH_CONFIG, PREFERRED, 1, ("means", 0), path, host_task)
    assert isinstance(placed, InWorkers) and placed.why == "--gpu-batch-processes 1"
    pool = placed.pool
    try:
        assert pool.runs_model
        assert len(pool.pids) == 1
        # the workers load the model file with its configuration, as the serving process did
        assert pool._spec["model"] == {"path": str(path),
                                       "config": TORCH_CONFIG.model_dump(mode="json")}
        # on the CPU they hold no device memory; the reservation knows them (telemetry)
        assert pool.device_bytes == 0 and res.worker_pids() == pool.pids
    finally:
        pool.close()
    with caplog.at_level(logging.INFO):
        broken = res.placement(view, TORCH_CONFIG, PREFERRED, 2, ("means", 0),
                               tmp_path / "missing" / "1" / "model.pt2", host_task)
        on_device = res.placement(view, TORCH_CONFIG, PREFERRED, 3, ("means", 0), path,
                                  SimpleNamespace(on_device=True))
    for here in (broken, on_device):  # the instance's own (warmed-up) preprocessor
        assert isinstance(here, InProcess) and isinstance(getattr(here.prepare, "__self__", None),
                                                          TorchPreprocessor)
    assert "did not start" in broken.why and "need a task" in on_device.why
    assert any("did not start" in r.message for r in caplog.records)
    assert any("need a task that reads the model's outputs on the host" in r.message
               for r in caplog.records)

