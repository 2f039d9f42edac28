"""The GPU data path on a real CUDA device: CUDA graphs, nvJPEG + device preprocessing against the
CPU path, the memory budget (no new allocations after warm-up; not ready when it is not free),
onnxruntime IOBinding, and a real device fault. Skipped where CUDA is absent."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
LABELS = ["ok", "scratch", "spot", "crack", "contamination"]

TOML = """\
[input]
width = 96
height = 96
tensor_name = "input"
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]
[output]
labels = ["ok", "scratch", "spot", "crack", "contamination"]
tensor_name = "logits"
[batching]
max_batch_size = 16
preferred_batch_sizes = [1, 2, 4, 8, 16]
max_queue_delay_ms = 1
takt_ms = 10000
[runtime]
backend = "{backend}"
precision = "{precision}"
"""


def _net():
    import torch

    class Net(torch.nn.Module):
        """Small, but with what matters: convs, batch norm, pooling, a linear head."""

        def __init__(self) -> None:
            super().__init__()
            c = [3, 16, 32, 64]
            layers = []
            for a, b in zip(c, c[1:]):
                layers += [torch.nn.Conv2d(a, b, 3, stride=2, padding=1), torch.nn.BatchNorm2d(b),
                           torch.nn.ReLU()]
            self.body = torch.nn.Sequential(*layers)
            self.fc = torch.nn.Linear(64, len(LABELS))

        def forward(self, x):
            return self.fc(self.body(x).mean(dim=(2, 3)))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():  # colour- and texture-sensitive, so preprocessing errors would show
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    return net


def _export(folder: Path, backend: str = "torch", precision: str = "fp16") -> Path:
    import torch

    net = _net()
    v = folder / "1"
    v.mkdir(parents=True, exist_ok=True)
    x = torch.randn(2, 3, 96, 96)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=256)},))
        torch.export.save(ep, str(v / "model.pt2"))
        torch.onnx.export(net, (x,), str(v / "model.onnx"), input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17,
                          dynamo=False)
    (folder / "model.toml").write_text(TOML.format(backend=backend, precision=precision))
    return folder


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpurepo")
    _export(root / "net")
    return root


@pytest.fixture(scope="module")
def config(repo):
    from visionserve.config import load_model_config

    return load_model_config(repo / "net" / "model.toml")


def _scenes(n: int, h: int = 480, w: int = 640) -> list[np.ndarray]:
    """Smooth industrial-looking surfaces with a defect-like blob and mild sensor noise (BGR)."""
    rng = np.random.default_rng(42)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = []
    for i in range(n):
        base = 90 + 60 * np.sin(x / (20 + 7 * i)) * np.cos(y / (31 + 3 * i))
        img = np.dstack([base + 20 * i % 60, base * 0.8 + 30, 255 - base])
        cy, cx = rng.integers(h // 8, h - h // 8), rng.integers(w // 8, w - w // 8)
        img[(y - cy) ** 2 + (x - cx) ** 2 < (10 + 4 * i) ** 2] = (20 + 10 * i, 200, 40)
        img += rng.normal(0, 4, img.shape)
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


def _frames(kinds=("jpeg",), n: int = 8):
    import cv2

    from visionserve import imaging

    frames = []
    for i, bgr in enumerate(_scenes(n)):
        kind = kinds[i % len(kinds)]
        if kind == "raw":
            rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            frames.append(imaging.raw_frame(rgb, rgb.shape))
        else:
            ok, buf = cv2.imencode("." + {"jpeg": "jpg"}.get(kind, kind), bgr,
                                   [cv2.IMWRITE_JPEG_QUALITY, 92] if kind == "jpeg" else [])
            frames.append(imaging.encoded_frame(buf.tobytes()))
    return frames


def _backends(repo, config):
    from visionserve.backends.torch import TorchBackend

    gpu, cpu = TorchBackend(), TorchBackend()
    gpu.load(repo / "net" / "1" / "model.pt2", config, "cuda:0")
    gpu.warmup(config.batching.preferred_batch_sizes)
    cpu.load(repo / "net" / "1" / "model.pt2", config, "cpu")
    return gpu, cpu


def test_cuda_graphs_on_a_high_priority_stream(repo, config):
    import torch

    gpu, cpu = _backends(repo, config)
    assert sorted(gpu._graphs) == [1, 2, 4, 8, 16]
    assert gpu.stream.priority == min(torch.cuda.Stream.priority_range())
    assert gpu.describe()["precision"] == "fp16" and gpu.describe()["memory_format"] == "channels_last"
    x = np.random.default_rng(0).normal(size=(16, 3, 96, 96)).astype(np.float32)
    for n in (1, 4, 16):
        np.testing.assert_allclose(gpu.run(x[:n])["output0"], cpu.run(x[:n])["output0"], atol=0.05,
                                   rtol=0.02)  # fp16
    runs = gpu.graph_runs
    gpu.run(x[:16])
    assert gpu.graph_runs == runs + 1
    eager = gpu.eager_runs
    big = np.concatenate([x, x[:4]])  # 20 rows: no graph for that size -> eager fallback
    np.testing.assert_allclose(gpu.run(big)["output0"][16:], cpu.run(x[:4])["output0"], atol=0.05,
                               rtol=0.02)
    assert gpu.eager_runs == eager + 1


TUNED_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, torch
    from visionserve.backends.torch import TorchBackend
    from visionserve.config import load_model_config
    repo, out = sys.argv[1], sys.argv[2]
    cfg = load_model_config(f"{repo}/net/model.toml")
    b = TorchBackend(); b.cudnn_autotune = True
    b.load(f"{repo}/net/1/model.pt2", cfg, "cuda:0")
    b.warmup(cfg.batching.preferred_batch_sizes)
    rng = np.random.default_rng(2)
    outs = {}
    for n in (1, 2, 4, 8, 16, 3):
        outs[f"x{n}"] = x = rng.normal(size=(n, 3, 96, 96)).astype(np.float32)
        outs[f"y{n}"] = b.run(x)["output0"]
    np.savez(out, **outs)
    print("BENCHMARK_MODE_AFTER", torch.backends.cudnn.benchmark, b.describe().get("cudnn_autotune"))
""")


@pytest.mark.slow
def test_graphs_captured_after_cudnn_autotuning_answer_as_the_heuristic_ones(repo, config,
                                                                              tmp_path):
    """``TorchBackend.cudnn_autotune`` (off in the server; the GPU benchmark compares the
    kernels): a warm-up that times cuDNN's kernels (in a process of its own:
    torch's plan cache is the process's, and this one has the model's shapes cached from the
    tests before) gives graphs that answer as the heuristic ones here within fp16 rounding, at
    every batch size, and leaves the process's benchmark mode as it was."""
    import os

    from visionserve.backends.torch import TorchBackend

    out = tmp_path / "tuned.npz"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", TUNED_SCRIPT, str(repo), str(out)],
                       capture_output=True, text=True, timeout=240, env=env)
    assert "BENCHMARK_MODE_AFTER False on" in p.stdout, (p.stdout + p.stderr)[-3000:]
    tuned = np.load(out)
    heuristic = TorchBackend()
    heuristic.load(repo / "net" / "1" / "model.pt2", config, "cuda:0")
    heuristic.warmup(config.batching.preferred_batch_sizes)
    assert "cudnn_autotune" not in heuristic.describe()
    for n in (1, 2, 4, 8, 16, 3):
        np.testing.assert_allclose(tuned[f"y{n}"], heuristic.run(tuned[f"x{n}"])["output0"],
                                   atol=0.05, rtol=0.02)  # fp16, as against the CPU above


@pytest.mark.parametrize("kinds, scaled", [(("jpeg",), False), (("png", "raw", "jpeg", "bmp"), False),
                                           (("jpeg",), True)])
def test_gpu_and_cpu_paths_give_the_same_verdicts(repo, config, kinds, scaled):
    """Same frames through nvJPEG + device preprocessing + fp16 CUDA graph, and through OpenCV +
    fp32 on the CPU. Pixels: decoders differ by a level or two (IDCT, chroma upsampling), area
    resizing 640x480 -> 96x96 averages that down, so the mean difference stays under a level.
    Scores: fp16 compute (~1e-3 relative) plus those pixel differences -> within 0.03; labels
    equal wherever the CPU's top two scores are not a near tie (margin > 0.06). ``scaled``: the
    CPU path decodes the JPEGs at 1/4 size (``input.scaled_decode``, as the shipped model does)
    while the GPU decodes in full; on the CPU alone that moves pixels by 0.4 levels on average
    and 6 at p99.9, so the pixel bounds grow by that much, and the score and label bounds stay."""
    import torch

    from visionserve import imaging
    from visionserve.gpu.preprocess import TorchPreprocessor
    from visionserve import tasks

    gpu, cpu = _backends(repo, config)
    prep = TorchPreprocessor.for_config(config, device="cuda:0", dtype=gpu.input_dtype, stream=gpu.stream,
                                        channels_last=True)
    frames = _frames(kinds, 16)
    t_gpu, good, bad = prep.prepare(frames, 16)
    assert t_gpu.is_cuda and t_gpu.dtype == torch.float16 and good == list(range(16)) and not bad
    assert t_gpu.is_contiguous(memory_format=torch.channels_last)
    cpu_input = config.input.model_copy(update={"scaled_decode": scaled})
    assert {imaging.jpeg_scale(f, cpu_input) for f in frames} == ({4} if scaled else {1})
    t_cpu, good_c, _ = imaging.prepare_batch(frames, cpu_input, 16)
    assert good_c == good
    levels = np.abs(t_gpu.float().cpu().numpy() - t_cpu) * np.asarray(config.input.std).reshape(1, 3, 1, 1) * 255
    assert levels.mean() < (1.5 if scaled else 1.0) and np.percentile(levels, 99.9) < (14 if scaled else 8)
    if "jpeg" in kinds:
        assert prep.counts["nvjpeg"] >= 1
    task = tasks.create(config)
    s_gpu = task.postprocess(gpu.run(t_gpu), slice(0, 16))
    s_cpu = task.postprocess(cpu.run(t_cpu), slice(0, 16))
    for (va, a), (vb, b) in zip(s_gpu, s_cpu):
        assert np.abs(a.scores - b.scores).max() < 0.03
        top2 = np.sort(b.scores)[-2:]
        if top2[1] - top2[0] > 0.06:
            assert (a.label, va) == (b.label, vb)


def test_corrupt_jpeg_fails_alone_on_the_gpu(repo, config):
    """nvJPEG rejects the batch; per-image decoding finds the bad frame, OpenCV confirms it is
    bad, and only that frame gets InvalidInput (400), like on the CPU path."""
    from visionserve import imaging
    from visionserve.errors import InvalidInput
    from visionserve.gpu.preprocess import TorchPreprocessor

    from tests.tools import jpegs

    gpu, _ = _backends(repo, config)
    prep = TorchPreprocessor.for_config(config, device="cuda:0", dtype=gpu.input_dtype, stream=gpu.stream)
    frames = _frames(("jpeg",), 4)
    frames.insert(2, imaging.encoded_frame(jpegs.corrupt(_scenes(1, 64, 64)[0])))
    t, good, bad = prep.prepare(frames, 8)
    assert good == [0, 1, 3, 4] and [i for i, _ in bad] == [2]
    assert isinstance(bad[0][1], InvalidInput)
    _, good_c, bad_c = imaging.prepare_batch(frames, config.input, 8)
    assert good_c == good and [i for i, _ in bad_c] == [2]
    assert np.isfinite(gpu.run(t)["output0"]).all()


def test_one_call_preparation_on_the_gpu_gives_the_eager_tensor(repo, config):
    """A batch of JPEGs of one size goes through the one TorchScript call (onecall.py): the same
    tensor, to the bit, as the eager path on the same stream, padding rows included. With a
    corrupt JPEG of the same size in it, the call fails and the eager path serves the batch:
    only that frame fails, and the caller's current stream is what it was."""
    import torch

    from tests.tools import jpegs
    from visionserve import imaging
    from visionserve.gpu.preprocess import TorchPreprocessor

    gpu, _ = _backends(repo, config)
    one, eager = (TorchPreprocessor.for_config(config, device="cuda:0", dtype=gpu.input_dtype,
                                               stream=gpu.stream,
                                               channels_last=gpu.channels_last, one_call=flag)
                  for flag in (True, False))
    frames = _frames(("jpeg",), 6)
    for padded in (6, 8):
        a, good, bad = one.prepare(frames, padded)
        b, good_e, bad_e = eager.prepare(frames, padded)
        gpu.stream.synchronize()
        assert good == good_e == list(range(6)) and bad == bad_e == []
        assert a.stride() == b.stride() and torch.equal(a, b)
    assert one.counts["one_call"] == 2 and eager.counts["one_call"] == 0
    before = torch.cuda.current_stream()
    frames.insert(2, imaging.encoded_frame(jpegs.corrupt(_scenes(1)[0])))  # 640x480 too
    t, good, bad = one.prepare(frames, 8)
    assert torch.cuda.current_stream() == before
    assert good == [0, 1, 3, 4, 5, 6] and [i for i, _ in bad] == [2]
    assert one.counts["one_call"] == 2  # the eager path served it
    ref, _, _ = eager.prepare([f for i, f in enumerate(frames) if i != 2], 8)
    gpu.stream.synchronize()
    assert torch.equal(t[:6], ref[:6])


@pytest.mark.slow
def test_a_preparation_process_gives_the_model_what_this_process_would(repo, config):
    """Preparation-only worker processes (off in the server; they share their code with the
    batch workers): a worker process prepares the batch (nvJPEG of its own, CUDA IPC
    slots the serving process allocated) to the bit as the serving process's own preprocessor
    does, for JPEGs of one size (the one call), mixed kinds, and a corrupt JPEG that fails
    alone; the model's outputs from the slot are the outputs from the in-process tensor; a
    slot comes back when released; a worker killed mid-run leaves the batches to this process."""
    import os
    import signal

    import torch

    from tests.tools import jpegs
    from visionserve import imaging
    from visionserve.execution.protocol import SLOTS
    from visionserve.execution.workers import WorkerPool
    from visionserve.gpu.preprocess import TorchPreprocessor

    gpu, _ = _backends(repo, config)
    local = TorchPreprocessor.for_config(config, device="cuda:0", dtype=gpu.input_dtype,
                                         stream=gpu.stream, channels_last=gpu.channels_last)
    local.warmup(config.batching.preferred_batch_sizes)
    pp = WorkerPool(config, local, device="cuda:0", dtype=gpu.input_dtype,
                    channels_last=gpu.channels_last, one_call=True,
                    preferred=config.batching.preferred_batch_sizes, name="net#0")
    assert pp.start(), pp.failure
    try:
        corrupt = imaging.encoded_frame(jpegs.corrupt(_scenes(1)[0]))
        cases = [_frames(("jpeg",), 16), _frames(("jpeg", "raw", "png"), 7),
                 _frames(("jpeg",), 5)[:2] + [corrupt] + _frames(("jpeg",), 3)]
        for frames in cases * 3:
            padded = 16 if len(frames) > 8 else 8
            t, good, bad = pp.prepare(frames, padded)
            ref, good_r, bad_r = local.prepare(frames, padded)
            gpu.stream.synchronize()
            assert good == good_r and [i for i, _ in bad] == [i for i, _ in bad_r]
            assert t.is_cuda and t.stride() == ref.stride() and t.dtype == ref.dtype
            assert torch.equal(t, ref)
            out, out_r = gpu.run(t), gpu.run(ref)
            assert out.keys() == out_r.keys()
            for name in out:
                np.testing.assert_array_equal(out[name], out_r[name])
            pp.release(t)
        assert pp.counts == {"remote_batches": 9, "local_batches": 0}
        assert pp.workers[0].free.qsize() == SLOTS
        os.kill(pp.pid, signal.SIGKILL)
        frames = cases[0]
        t, good, _ = pp.prepare(frames, 16)
        ref, _, _ = local.prepare(frames, 16)
        gpu.stream.synchronize()
        assert pp.failure and good == list(range(16)) and torch.equal(t, ref)
    finally:
        pp.close()


@pytest.mark.parametrize("kind", ["progressive", "cmyk", "12-bit", "corrupt"])
def test_a_jpeg_nvjpeg_rejects_goes_to_the_next_decoder_or_fails_alone(kind, record_property):
    """In a batch of good JPEGs: a progressive JPEG is decoded (by nvJPEG, or by the CPU after
    nvJPEG refused it) with the CPU path's pixels; a CMYK one goes to the CPU decoder; 12-bit and
    corrupt ones fail alone with 400 after both decoders refused them. Which decoder took what
    is in junit.xml (property ``decoders``)."""
    import torch

    from tests.tools import jpegs
    from visionserve.config import InputSpec
    from visionserve.gpu.preprocess import TorchPreprocessor

    prep = TorchPreprocessor(InputSpec(width=64, height=64), device="cuda:0", dtype=torch.float32,
                             max_batch=4)
    counts = jpegs.check_odd_jpeg_in_a_batch(prep, kind)
    record_property("decoders", counts)
    assert counts["nvjpeg"] >= 3  # the good frames
    assert counts["cpu_decoded"] == (1 if kind == "cmyk" else 0) or \
        (kind == "progressive" and counts["fallback"] == counts["cpu_decoded"] == 1)


def _engine(repo: Path, budget: str | None, **extra):
    from visionserve.config import ServerSettings
    from visionserve.engine import Engine

    settings = ServerSettings(models=repo, device="cuda", gpu_memory_budget=budget, **extra)
    return Engine(settings, device="cuda:0")


def _pool(executor):
    """The worker processes of an instance's executor; None where it runs in the serving
    process."""
    from visionserve.execution.workers import WorkerExecutor

    return executor.pool if isinstance(executor, WorkerExecutor) else None


# beside other tests: it counts the segments of its own process's allocator
@pytest.mark.slow
@pytest.mark.parametrize("batch_processes", [0, 1], ids=["in-process", "batch-processes"])
def test_serving_adds_no_device_memory_after_warm_up(repo, batch_processes):
    """Budget reserved, every preferred size warmed (model + preprocessing): then a load of
    mixed sizes and kinds (1080p and VGA JPEG, raw, PNG, 1..16 frames) makes no cudaMalloc.
    The workers' allocators come out of the budget too (about 0.7 GiB each), hence 6 GiB. With
    --gpu-batch-processes the lone batches (one at a time, the instance idle) run in the
    serving process and the concurrent ones in the worker: neither adds memory."""
    import cv2

    from visionserve import imaging

    big = cv2.resize(_scenes(1)[0], (1920, 1080))
    ok, big_jpeg = cv2.imencode(".jpg", big)
    mixed = _frames(("jpeg", "raw", "png"), 16) + [imaging.encoded_frame(big_jpeg.tobytes())] * 4

    async def scenario():
        engine = _engine(repo, "6GiB", gpu_batch_processes=batch_processes)
        await engine.start()
        try:
            assert engine.ready and engine.gpu is not None
            if batch_processes:
                runner = engine.served[("net", 1)].runners[0]
                workers = _pool(runner)
                assert workers is not None and workers.runs_model, engine.gpu.worker_bytes
            before = engine.gpu.watch.new_since_mark()
            for n in (1, 3, 16, 7, 2, 16, 5):
                for k in range(0, len(mixed), n):
                    _, results = await engine.infer("net", None, mixed[k:k + n])
                    assert len(results) == len(mixed[k:k + n])
            await asyncio.gather(*(engine.infer("net", None, mixed[i:i + 2]) for i in range(0, 18, 2)))
            after = engine.gpu.watch.new_since_mark()
            if batch_processes:  # the lone ones here, at least one of the concurrent ones there
                assert workers.counts["local_batches"] > 20 and workers.failure is None
                assert workers.counts["remote_batches"] >= 1
            return before, after
        finally:
            await engine.close()

    before, after = asyncio.run(scenario())
    assert before["new_segments"] == 0
    assert after == {"new_segments": 0, "reserved_growth_bytes": 0, "alloc_retries": 0, "ooms": 0}, after


# beside other tests: NVML's memory of its own processes, its own allocators' caps
@pytest.mark.slow
def test_batch_workers_hold_their_memory_inside_the_budget(repo, config, caplog):
    """--gpu-batch-processes 1 with a budget: what the worker's allocator may hold (what it
    holds after warm-up and one batch's preparation, its cap) comes off the serving process's
    cap and into the load's footprint, and its NVML memory into the memory used; with a budget
    that holds the serving process and not the worker beside it, the instance serves in-process
    (a warning says why) and answers alike."""
    import torch

    from visionserve.gpu import telemetry
    from visionserve.gpu.memory import prep_allowance

    frames = _frames(("jpeg",), 4)

    async def scenario(budget: str):
        engine = _engine(repo, budget, gpu_batch_processes=1)
        await engine.start()
        try:
            assert engine.ready and engine.gpu is not None
            res, served = engine.gpu, engine.served[("net", 1)]
            workers = _pool(served.runners[0])
            _, results = await engine.infer("net", None, frames)
            out = {"results": [r.result for r in results], "workers": workers,
                   "reserved": torch.cuda.memory_reserved(), "cap": res._serving_cap(),
                   "torch_cap": res.plan.torch_cap, "footprint": res.footprints[served.load_id],
                   "worker_bytes": dict(res.worker_bytes), "load_id": served.load_id}
            if workers is not None:
                out["device_bytes"] = workers.device_bytes
                out["used"] = res.telemetry.sample().process_used
                out["used_alone"] = telemetry.GpuTelemetry(
                    res.nvml, res.gpu.index, res.plan.total).sample().process_used
            return out
        finally:
            await engine.close()

    roomy = asyncio.run(scenario("4GiB"))
    assert roomy["workers"] is not None and roomy["workers"].runs_model
    w = roomy["device_bytes"]
    assert w > prep_allowance(config)  # a model, its graphs, and room to grow
    assert roomy["worker_bytes"] == {roomy["load_id"]: w}
    assert roomy["cap"] == roomy["torch_cap"] - w and roomy["footprint"] > w
    if roomy["used"] is not None:  # NVML sees per-process memory here
        assert roomy["used"] > roomy["used_alone"] > 0
    budget = roomy["reserved"] + prep_allowance(config) + w // 2
    with caplog.at_level(logging.WARNING):
        tight = asyncio.run(scenario(str(budget)))
    assert tight["workers"] is None and tight["worker_bytes"] == {}
    assert "are prepared and run in the serving process" in caplog.text
    for a, b in zip(tight["results"], roomy["results"], strict=True):
        assert a.label == b.label
        np.testing.assert_allclose(a.scores, b.scores, atol=2e-3)


# beside other tests: its own allocator's reserve and segments (a budget that other tests'
# memory left unfree would only delay its start)
@pytest.mark.slow
@pytest.mark.parametrize(("batch_processes", "budget_gib"), [(0, 4), (2, 8)],
                         ids=["in-process", "batch-processes"])
def test_a_swap_on_the_gpu_returns_the_old_memory_and_serving_adds_none_after_it(
        tmp_path, batch_processes, budget_gib):
    """Model control on the GPU: versions 2 and 3 each load beside the serving one within the
    budget (reckoned at what the first load took) and shares the serving one's pinned pool,
    traffic switches, the old one is released, and from then on serving mixed loads makes no cudaMalloc (the new version's streams got
    their small-block pools as the first ones did, and no swap emptied a serving cache). With
    batch workers (whose allocators count in the load's footprint: hence 8 GiB) each version
    has workers of its own, and the old one's stop with it."""
    import shutil

    from visionserve.config import ServerSettings
    from visionserve.engine import Engine

    folder = _export(tmp_path / "net")
    toml = folder / "model.toml"
    toml.write_text(toml.read_text() + "\n[version_policy]\nlatest = 1\n")
    mixed = _frames(("jpeg", "raw", "png"), 16)

    async def scenario():
        engine = Engine(ServerSettings(models=tmp_path, device="cuda",
                                       gpu_memory_budget=f"{budget_gib}GiB",
                                       gpu_batch_processes=batch_processes,
                                       model_control_mode="explicit"), device="cuda:0")
        await engine.start()
        try:
            import torch

            for k in range(0, 16, 4):
                await engine.infer("net", None, mixed[k:k + 4])
            held = []

            def prep(v):  # version v's preprocessor in this process (the workers' fallback)
                p = engine.served[("net", v)].runners[0].prepare.__self__
                return getattr(p, "fallback", p)

            def pool(v):  # its pinned staging pool
                return prep(v).pool

            def workers(v):
                return _pool(engine.served[("net", v)].runners[0])

            first, old = pool(1), workers(1)
            assert (old is not None) == bool(batch_processes)
            for v in (2, 3):
                shutil.copytree(folder / str(v - 1), folder / str(v))
                swap = await engine.load_model("net")
                assert swap["versions"] == [str(v)] and swap["unloaded"] == [str(v - 1)], swap
                held.append(torch.cuda.memory_reserved())
                # pinning holds a driver lock that stalls serving: a swap pins nothing new
                assert pool(v) is first
                if old is not None:  # the old version's workers went with it
                    assert workers(v) is not None and workers(v).pids
                    assert not old.pids and set(engine.gpu.worker_pids()) == set(workers(v).pids)
                    old = workers(v)
            for n in (1, 3, 16, 7, 2, 16, 5):
                for k in range(0, len(mixed), n):
                    served, results = await engine.infer("net", None, mixed[k:k + n])
                    assert served.version == 3 and len(results) == len(mixed[k:k + n])
            await asyncio.gather(*(engine.infer("net", None, mixed[i:i + 2]) for i in range(0, 16, 2)))
            return held, engine.gpu.watch.new_since_mark()
        finally:
            await engine.close()

    held, after = asyncio.run(scenario())
    assert max(held) <= budget_gib * 1024**3, held  # within the budget's torch cap
    assert after == {"new_segments": 0, "reserved_growth_bytes": 0, "alloc_retries": 0, "ooms": 0}, after


def test_budget_not_free_keeps_the_server_not_ready(repo, caplog):
    from visionserve.execution.reservation import GpuReservation

    async def scenario():
        engine = _engine(repo, "100TiB")
        task = asyncio.create_task(engine.start())
        await asyncio.sleep(3)
        ready = engine.ready
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return ready, task

    with caplog.at_level(logging.ERROR):
        ready, _ = asyncio.run(scenario())
    assert not ready
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "is not available" in text and "GiB is free" in text
    assert GpuReservation.RETRY_S > 0


def test_onnxruntime_iobinding_on_device_tensors(repo, config):
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime without CUDA: {ort.get_available_providers()}")
    import torch

    from visionserve.backends.onnx import OnnxBackend

    cfg = config.model_copy(update={"runtime": config.runtime.model_copy(
        update={"backend": "onnxruntime", "precision": "fp32", "gpu_memory_budget": "1GiB"})})
    b = OnnxBackend()
    b.load(repo / "net" / "1" / "model.onnx", cfg, "cuda:0")
    assert b.providers[0] == "CUDAExecutionProvider" and b.stream is not None
    x = np.random.default_rng(0).normal(size=(8, 3, 96, 96)).astype(np.float32)
    host = b.run(x)["logits"]
    with torch.cuda.stream(b.stream):
        dev = torch.from_numpy(x).to("cuda:0")
    np.testing.assert_allclose(b.run(dev)["logits"], host, rtol=1e-4, atol=1e-4)


FAULT_SCRIPT = textwrap.dedent("""
    import asyncio, logging, sys, time
    import numpy as np, torch
    from visionserve.backends.torch import TorchBackend
    from visionserve.batching import CostModel, Pending
    from visionserve.config import load_model_config
    from visionserve.execution.results import padded_size
    from visionserve.execution.threads import ThreadExecutor
    from visionserve import imaging
    logging.basicConfig(level=logging.ERROR, stream=sys.stdout)
    repo = sys.argv[1]
    cfg = load_model_config(f"{repo}/net/model.toml")

    class Broken(TorchBackend):
        fail = False
        def run(self, batch):
            if self.fail:  # out-of-bounds gather: a device-side assert, a sticky CUDA error
                idx = torch.tensor([10**6], device="cuda")
                torch.zeros(4, device="cuda")[idx].sum().item()
            return super().run(batch)

    b = Broken(); b.load(f"{repo}/net/1/model.pt2", cfg, "cuda:0"); b.warmup((1, 2))
    async def main():
        loop = asyncio.get_running_loop()
        r = ThreadExecutor(name="net:1#0", backend=b, config=cfg, preferred=(1, 2),
                           cost=CostModel(lambda n: padded_size(n, (1, 2))),
                           on_batch=lambda x: None)
        r.start(loop)
        frame = imaging.raw_frame(np.zeros((96, 96, 3), np.uint8), (96, 96, 3))
        async def one():
            now = time.monotonic()
            p = Pending(payload=frame, future=loop.create_future(), arrival=now, deadline=now + 30, dispatched=now)
            await r.execute([p])
            return p.future.exception() or p.future.result()
        ok = await one()
        b.fail = True
        bad = await one()
        print("RESULT", type(ok).__name__, type(bad).__name__, r.healthy)
    asyncio.run(main())
""")


@pytest.mark.slow
def test_device_fault_marks_the_model_unhealthy(repo):
    """A real sticky CUDA error (device-side assert) in a separate process: the runner goes
    unhealthy with one log line, the frame gets 503, nothing garbage is answered."""
    env = {"PYTHONPATH": ":".join([str(REPO)] + sys.path), "CUDA_LAUNCH_BLOCKING": "0"}
    import os

    p = subprocess.run([sys.executable, "-c", FAULT_SCRIPT, str(repo)], capture_output=True, text=True,
                       timeout=240, env={**os.environ, **env})
    out = p.stdout + p.stderr
    assert "RESULT FrameResult Unavailable False" in out, out[-3000:]
    assert out.count("device fault in net:1#0") == 1, out[-3000:]


# beside other tests: it looks only for its own server's processes among NVML's holders
@pytest.mark.slow
def test_front_end_processes_hold_no_gpu_context_and_answer_like_the_engine(repo, tmp_path):
    """``--frontends 2`` on the GPU: the serving process holds the device (its only CUDA
    context), the front-end processes none; their answers equal the in-process engine's, and
    the load through them adds no device memory after warm-up."""
    import os
    import signal
    import socket
    import time
    import urllib.request

    import cv2

    from visionserve.gpu.nvml import real_nvml

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "fe-server.log"
    args = [sys.executable, "-m", "visionserve", "serve", "--models", str(repo), "--device", "cuda:0",
            "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "-1", "--frontends", "2",
            "--gpu-batch-processes", "0", "--gpu-memory-budget", "2GiB"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def call(path, body=None, headers=None):
        req = urllib.request.Request(url + path, data=body, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError:
            return 0, b""

    try:
        end = time.time() + 180
        while call("/v2/health/ready")[0] != 200:
            assert proc.poll() is None and time.time() < end, log_path.read_text()
            time.sleep(0.25)
        jpegs = [cv2.imencode(".jpg", img)[1].tobytes() for img in _scenes(6)]
        answers = []
        for _ in range(30):  # several rounds: both front ends take some
            for j in jpegs:
                status, body = call("/v1/models/net/inspect", j, {"Content-Type": "image/jpeg"})
                assert status == 200, body
                answers.append(__import__("json").loads(body))
        by_image = {}
        for i, a in enumerate(answers):
            by_image.setdefault(i % len(jpegs), set()).add(a["label"])
        assert all(len(labels) == 1 for labels in by_image.values())  # same image, same answer
        metrics = call("/metrics")[1].decode()
        segs = [line for line in metrics.splitlines()
                if line.startswith("visionserve_gpu_allocator_new_segments")]
        assert segs and float(segs[0].split()[-1]) == 0, segs

        kids = [int(c) for t in Path(f"/proc/{proc.pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
        fronts = [k for k in kids if b"runtime.frontend" in Path(f"/proc/{k}/cmdline").read_bytes()]
        assert len(fronts) == 2
        nvml = real_nvml()
        holders = {p.pid for g in nvml.devices() for p in nvml.processes(g.index)}
        assert proc.pid in holders, holders
        assert not holders & set(fronts), (holders, fronts)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
    assert code == 0, log_path.read_text()[-3000:]
    assert "Traceback" not in log_path.read_text()
