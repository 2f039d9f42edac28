"""GPU memory planning, the staging pool, telemetry and the torch preprocessing (on the CPU)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import weakref

import numpy as np
import pytest

from visionserve.config import ModelConfig
from visionserve.errors import ConfigError, InvalidInput
from visionserve.execution.reservation import GpuReservation
from visionserve.gpu import memory, telemetry
from visionserve.gpu.memory import (
    PinnedPool,
    check_free,
    pinned_gpu,
    plan_budget,
    prep_allowance,
    shared_pool,
)
from visionserve.gpu.nvml import SimulatedNvml, simulated_gpu

GIB = 1024**3

pytestmark = pytest.mark.gpu_path  # takes CUDA branches where CUDA is: run with the GPU tests


def cfg(backend: str = "onnxruntime", budget: str | None = None, instances: int = 1,
        mbs: int = 8) -> ModelConfig:
    return ModelConfig.model_validate({
        "input": {"width": 64, "height": 64},
        "output": {"labels": ["ok", "ng"]},
        "batching": {"max_batch_size": mbs, "preferred_batch_sizes": [1, mbs]},
        "runtime": {"backend": backend, "gpu_memory_budget": budget, "instances": instances},
    })


# --- plan_budget -----------------------------------------------------------------------------

def test_no_budget_caps_nothing():
    assert plan_budget(None, [("a", cfg())]).total is None


def test_model_budgets_sum_when_server_has_none():
    plan = plan_budget(None, [("a", cfg(budget="2GiB")), ("b", cfg("torch", budget="1GiB"))])
    assert plan.total == 3 * GIB
    a = plan.share_of("a")
    assert a.ort_limit_per_instance == 2 * GIB - prep_allowance(cfg())
    # torch allocator: everything onnxruntime does not hold (torch model + all preprocessing)
    assert plan.torch_cap == 3 * GIB - a.ort_limit_per_instance


def test_server_budget_shared_by_models_without_their_own():
    plan = plan_budget("8GiB", [("a", cfg(budget="2GiB")), ("b", cfg()), ("c", cfg(instances=2))])
    assert plan.share_of("b").share == 3 * GIB
    c = plan.share_of("c")
    assert c.share == 3 * GIB and c.instances == 2
    assert c.ort_limit_per_instance == (3 * GIB - 2 * prep_allowance(cfg())) // 2
    ort_total = sum(s.ort_limit_per_instance * s.instances for s in plan.sessions)
    assert plan.torch_cap + ort_total == 8 * GIB


def test_model_budgets_over_the_server_budget_are_refused():
    with pytest.raises(ConfigError, match="smaller than the models' own"):
        plan_budget("1GiB", [("a", cfg(budget="2GiB"))])


def test_budget_too_small_for_preprocessing_names_the_model():
    with pytest.raises(ConfigError, match="model a .*preprocessing"):
        plan_budget("64MiB", [("a", cfg(mbs=32))])
    with pytest.raises(ConfigError, match="model t"):
        plan_budget("64MiB", [("t", cfg("torch", mbs=32))])


# --- NVML: free memory and who holds it ------------------------------------------------------

def test_check_free_reports_free_memory_and_holders():
    nv = SimulatedNvml([simulated_gpu(0, memory_total=80 * GIB, memory_used=0)])
    nv.add_process(0, 4242, 70 * GIB)
    gpu = pinned_gpu(nv, {})
    check = check_free(nv, gpu, 16 * GIB)
    assert not check.ok and check.free == 10 * GIB
    msg = check.message("GPU x")
    assert "16.00 GiB is not available" in msg and "10.00 GiB" in msg
    assert "pid 4242 uses 70.00 GiB" in msg
    nv.remove_process(0, 4242)
    assert check_free(nv, gpu, 16 * GIB).ok


def test_pinned_gpu_follows_cuda_visible_devices():
    nv = SimulatedNvml([simulated_gpu(0), simulated_gpu(1)])
    g1 = nv.devices()[1]
    assert pinned_gpu(nv, {"CUDA_VISIBLE_DEVICES": g1.uuid}).index == 1
    assert pinned_gpu(nv, {}).index == 0
    assert pinned_gpu(SimulatedNvml([]), {}) is None


def test_reservation_waits_not_ready_until_the_budget_is_free(caplog):
    nv = SimulatedNvml([simulated_gpu(0, memory_total=80 * GIB, memory_used=0)])
    other = os.getpid() + 1  # another process: never this one (check_free leaves this one out)
    nv.add_process(0, other, 75 * GIB)
    res = GpuReservation("8GiB", "cuda:0", nvml=nv)
    res.RETRY_S = 0.02

    async def scenario():
        task = asyncio.create_task(res.reserve([("a", cfg())]))
        await asyncio.sleep(0.2)
        assert not task.done()  # still waiting: the engine stays not ready
        nv.remove_process(0, other)
        await asyncio.wait_for(task, 5)

    with caplog.at_level(logging.INFO, logger="visionserve.execution.reservation"):
        asyncio.run(scenario())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # logged once, not every retry
    assert "5.00 GiB of 80.00 GiB is free" in errors[0] and f"pid {other}" in errors[0]
    assert res.plan.total == 8 * GIB
    # an onnxruntime instance loads with its share as gpu_mem_limit
    loaded = res.instance_config("a", cfg())
    assert memory.parse_bytes(loaded.runtime.gpu_memory_budget) == res.plan.share_of("a").ort_limit_per_instance


# --- pinned staging pool ---------------------------------------------------------------------

def test_pool_upload_round_trips_and_streams_large_arrays():
    pool = PinnedPool(2, 1000)  # no CUDA here: ordinary memory, same code path
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 255, s, dtype=np.uint8) for s in [(10, 10, 3), (50, 40, 3), (7,), (1, 1, 1)]]
    out = pool.upload(arrays, "cpu")
    assert [tuple(t.shape) for t in out] == [a.shape for a in arrays]
    for a, t in zip(arrays, out):
        np.testing.assert_array_equal(t.numpy(), a)
    assert pool.nbytes == 2000


def test_pool_never_hands_a_slot_to_two_fillers():
    """Two versions' prep threads share a pool during a swap: a slot being filled is skipped,
    and with every slot taken the next user waits for a release."""
    pool = PinnedPool(3, 100)
    assert [pool.acquire()[0] for _ in range(2)] == [0, 1]
    pool.release(0)
    assert pool.acquire()[0] == 2 and pool.acquire()[0] == 0
    pool.release(2)
    assert pool.acquire()[0] == 2  # slot 1 is next in turn, but still being filled
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()[0]))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # every slot is being filled
    pool.release(1)
    waiter.join(5)
    assert got == [1]


def test_pool_uploads_from_many_threads_keep_their_bytes():
    pool = PinnedPool(2, 64)  # small slots: every upload goes through several
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(50):
            arrays = [rng.integers(0, 255, int(n), dtype=np.uint8) for n in rng.integers(1, 300, 3)]
            for a, t in zip(arrays, pool.upload(arrays, "cpu")):
                if not np.array_equal(t.numpy(), a):
                    errors.append(f"thread {seed}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


def test_shared_pool_is_one_while_a_version_holds_it():
    first = shared_pool(("cuda:0", "m", 0), 2, 100)
    assert shared_pool(("cuda:0", "m", 0), 2, 100) is first
    assert shared_pool(("cuda:0", "m", 1), 2, 100) is not first  # another instance
    assert shared_pool(("cuda:0", "m", 0), 2, 200) is not first  # another input size
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # nobody held it: released, not kept for ever


def test_pool_refuses_empty_sizes():
    with pytest.raises(ValueError):
        PinnedPool(0, 10)


# --- telemetry -------------------------------------------------------------------------------

def test_telemetry_publishes_budget_memory_and_nvml_readings():
    from prometheus_client import REGISTRY, generate_latest

    nv = SimulatedNvml([simulated_gpu(0, memory_total=80 * GIB, memory_used=GIB, temperature_c=77,
                                      power_w=321.5, throttle_reasons=("sw_thermal_slowdown",))])
    nv.add_process(0, 99, 3 * GIB)
    base = memory.AllocatorStats(10, 10, 2 * GIB, GIB, 0, 0)
    now = memory.AllocatorStats(12, 12, 2 * GIB, GIB, 0, 0)
    t = telemetry.GpuTelemetry(nv, 0, 6 * GIB, allocator=lambda: now, baseline=lambda: base, pid=99)
    s = t.update()
    assert s.process_used == 3 * GIB and s.new_segments == 2
    text = generate_latest().decode()  # what /metrics serves
    assert "visionserve_gpu_memory_budget_bytes" in text

    def val(name, **labels):
        return REGISTRY.get_sample_value(name, labels)

    assert val("visionserve_gpu_memory_budget_bytes") == 6 * GIB
    assert val("visionserve_gpu_memory_reserved_bytes") == 2 * GIB
    assert val("visionserve_gpu_memory_used_bytes") == 3 * GIB
    assert val("visionserve_gpu_temperature_celsius") == 77
    assert val("visionserve_gpu_power_watts") == 321.5
    assert val("visionserve_gpu_throttle_active", reason="sw_thermal_slowdown") == 1
    assert val("visionserve_gpu_throttle_active", reason="hw_slowdown") == 0
    assert val("visionserve_gpu_allocator_new_segments") == 2


# --- the torch preprocessing, run on the CPU -------------------------------------------------

def _scene(h: int, w: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.dstack([x * 255 // (w - 1), y * 255 // (h - 1), (x + y) % 256]).astype(np.float32)
    return np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def _frames():
    import cv2

    from visionserve import imaging

    frames = []
    for i, (h, w) in enumerate([(480, 640), (300, 500), (100, 150), (64, 64), (57, 301)]):
        bgr = _scene(h, w, i)
        _, png = cv2.imencode(".png", bgr)
        frames.append(imaging.encoded_frame(png.tobytes()))
        frames.append(imaging.raw_frame(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), (h, w, 3)))
    _, bmp = cv2.imencode(".bmp", _scene(90, 120, 9))
    frames.append(imaging.encoded_frame(bmp.tobytes()))
    grey = _scene(60, 80, 7)[:, :, 0]
    frames.append(imaging.raw_frame(grey[:, :, None], (60, 80, 1)))
    rgba = np.dstack([_scene(60, 80, 8), np.full((60, 80), 200, np.uint8)])
    frames.append(imaging.raw_frame(rgba, (60, 80, 4)))
    return frames


@pytest.mark.parametrize("resize", ["stretch", "letterbox", "center_crop"])
@pytest.mark.parametrize("interp", ["area", "linear", "nearest", "cubic"])
@pytest.mark.parametrize("colour", ["RGB", "BGR", "GRAY"])
def test_torch_preprocessing_matches_opencv(resize, interp, colour):
    """Same pixels as the OpenCV path within 1 level (2 for grey: OpenCV converts before it
    resizes, rounding twice): the resize weights are OpenCV's, only its fixed-point rounding
    differs. JPEG-free, so no decoder difference enters."""
    import torch

    from visionserve import imaging
    from visionserve.config import InputSpec
    from visionserve.gpu.preprocess import TorchPreprocessor

    extra = {"channels": 1, "mean": (0.5,), "std": (0.25,)} if colour == "GRAY" else \
        {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    spec = InputSpec(width=96, height=80, resize=resize, interpolation=interp, color_order=colour, **extra)
    frames = _frames()
    ref, good, bad = imaging.prepare_batch(frames, spec, 16)
    t, good2, bad2 = TorchPreprocessor(spec, device="cpu", dtype=torch.float32, max_batch=16).prepare(frames, 16)
    assert good2 == good and bad2 == bad == []
    assert t.shape == ref.shape and t.dtype == torch.float32
    levels = np.abs(t.numpy() - ref) * np.asarray(spec.std).reshape(1, -1, 1, 1) / spec.scale
    assert levels.max() <= (2.01 if colour == "GRAY" else 1.01)
    assert (levels > 0.5).mean() < 0.12  # most pixels identical
    np.testing.assert_allclose(t.numpy()[len(good):], ref[len(good):])  # padding rows equal too


@pytest.mark.parametrize("resize", ["stretch", "letterbox", "center_crop"])
@pytest.mark.parametrize("colour", ["RGB", "BGR"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_batch_of_one_frame_size_matches_opencv_and_the_padded_batch(resize, colour,
                                                                        channels_last):
    """Frames of one size filling the batch go from the resize product straight to the model's
    tensor (no staging buffer): the same pixels as OpenCV, and as the same frames in a batch
    with padding rows (which takes the staging buffer)."""
    import cv2
    import torch

    from visionserve import imaging
    from visionserve.config import InputSpec
    from visionserve.gpu.preprocess import TorchPreprocessor

    spec = InputSpec(width=96, height=80, resize=resize, color_order=colour,
                     mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    frames = []
    for i in range(4):
        _, png = cv2.imencode(".png", _scene(120, 160, i))
        frames.append(imaging.encoded_frame(png.tobytes()))
    prep = TorchPreprocessor(spec, device="cpu", dtype=torch.float32, max_batch=8,
                             channels_last=channels_last)
    whole, good, bad = prep.prepare(frames, 4)
    padded, _, _ = prep.prepare(frames, 8)
    ref, _, _ = imaging.prepare_batch(frames, spec, 4)
    assert good == [0, 1, 2, 3] and bad == [] and tuple(whole.shape) == ref.shape
    assert whole.is_contiguous(memory_format=torch.channels_last if channels_last
                               else torch.contiguous_format)
    levels = np.abs(whole.numpy() - ref) * np.asarray(spec.std).reshape(1, -1, 1, 1) / spec.scale
    assert levels.max() <= 1.01
    np.testing.assert_allclose(whole.numpy(), padded.numpy()[:4], atol=1e-5)


def _jpegs(n: int, h: int, w: int) -> list:
    import cv2

    from visionserve import imaging

    out = []
    for i in range(n):
        _, jpg = cv2.imencode(".jpg", _scene(h, w, i), [cv2.IMWRITE_JPEG_QUALITY, 90])
        out.append(imaging.encoded_frame(jpg.tobytes()))
    return out


@pytest.mark.parametrize("spec_kw", [
    {},
    {"resize": "center_crop", "color_order": "BGR"},
    {"resize": "letterbox", "width": 96, "height": 72},  # fits exactly: no bars, no offset
    {"channels": 1, "color_order": "GRAY", "mean": (0.5,), "std": (0.25,),
     "interpolation": "linear"},
    {"layout": "NHWC", "dtype": "uint8"},
    {"width": 160, "height": 120},  # the frame's own size: no resize product
])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("n, padded", [(4, 4), (3, 8)])
def test_one_call_preparation_gives_the_eager_tensor(spec_kw, channels_last, n, padded,
                                                      monkeypatch):
    """A batch of JPEGs of one size is prepared by one TorchScript call (onecall.py) that holds
    the interpreter once; its tensor is the eager path's, to the bit: padding rows, colour
    order, grey, dtype and layout, centre crop, and a batch resized in several products."""
    import torch

    from visionserve.config import InputSpec
    from visionserve.gpu import preprocess

    monkeypatch.setattr(preprocess, "CHUNK_BYTES", 3 * 120 * 160 * 2 * 2)  # 2 frames a product
    kw = {"width": 64, "height": 48, "mean": (0.485, 0.456, 0.406),
          "std": (0.229, 0.224, 0.225), **spec_kw}
    spec = InputSpec(**kw)
    dtype = torch.uint8 if kw.get("dtype") == "uint8" else torch.float16
    frames = _jpegs(n, 120, 160)
    preps = [preprocess.TorchPreprocessor(spec, device="cpu", dtype=dtype, max_batch=8,
                                          channels_last=channels_last, one_call=one)
             for one in (True, False)]
    (fast, good, bad), (eager, egood, ebad) = (p.prepare(frames, padded) for p in preps)
    assert preps[0].counts["one_call"] == 1 and preps[1].counts["one_call"] == 0
    assert good == egood == list(range(n)) and bad == ebad == []
    assert fast.dtype == eager.dtype and fast.shape == eager.shape
    assert fast.stride() == eager.stride()
    assert torch.equal(fast, eager)


def test_batches_not_for_the_one_call_take_the_eager_path():
    """Two frame sizes, a PNG, letterbox bars or a JPEG the decoder refuses: the eager path
    (and its per-frame fallback) prepares the batch."""
    import cv2
    import torch

    from tests.tools import jpegs
    from visionserve import imaging
    from visionserve.config import InputSpec
    from visionserve.gpu.preprocess import TorchPreprocessor

    spec = InputSpec(width=64, height=48)
    _, png = cv2.imencode(".png", _scene(120, 160, 5))
    corrupt = imaging.encoded_frame(jpegs.corrupt(_scene(120, 160, 3)))
    batches = {
        "two sizes": _jpegs(2, 120, 160) + _jpegs(1, 60, 80),
        "a png": _jpegs(2, 120, 160) + [imaging.encoded_frame(png.tobytes())],
        "corrupt": _jpegs(2, 120, 160) + [corrupt],
    }
    for what, frames in batches.items():
        prep = TorchPreprocessor(spec, device="cpu", dtype=torch.float32, max_batch=4)
        t, good, bad = prep.prepare(frames, 4)
        assert prep.counts["one_call"] == 0, what
        assert good == ([0, 1] if what == "corrupt" else [0, 1, 2]), what
    boxed = TorchPreprocessor(InputSpec(width=64, height=64, resize="letterbox"), device="cpu",
                              dtype=torch.float32, max_batch=2)
    boxed.prepare(_jpegs(2, 120, 160), 2)
    assert boxed.counts["one_call"] == 0


def test_nhwc_uint8_layout():
    import torch

    from visionserve import imaging
    from visionserve.config import InputSpec
    from visionserve.gpu.preprocess import TorchPreprocessor

    spec = InputSpec(width=32, height=24, layout="NHWC", dtype="uint8")
    frames = _frames()[:4]
    ref, _, _ = imaging.prepare_batch(frames, spec, 4)
    t, _, _ = TorchPreprocessor(spec, device="cpu", dtype=torch.uint8, max_batch=4).prepare(frames, 4)
    assert t.dtype == torch.uint8 and tuple(t.shape) == ref.shape
    assert np.abs(t.numpy().astype(int) - ref.astype(int)).max() <= 1


def test_corrupt_jpeg_fails_only_its_frame(jpeg_bytes):
    import torch

    from tests.tools import jpegs
    from visionserve import imaging
    from visionserve.config import InputSpec
    from visionserve.gpu.preprocess import TorchPreprocessor

    spec = InputSpec(width=64, height=64)
    good_f = imaging.encoded_frame(jpeg_bytes)
    bad_f = imaging.encoded_frame(jpegs.corrupt(_scene(64, 64, 3)))
    prep = TorchPreprocessor(spec, device="cpu", dtype=torch.float32, max_batch=4)
    t, good, bad = prep.prepare([good_f, bad_f, good_f], 4)
    assert good == [0, 2] and [i for i, _ in bad] == [1]
    assert isinstance(bad[0][1], InvalidInput) and "cannot decode JPEG" in bad[0][1].message
    ref, rgood, rbad = imaging.prepare_batch([good_f, bad_f, good_f], spec, 4)
    assert rgood == good and [i for i, _ in rbad] == [1]  # the CPU path gives the same verdicts
    assert prep.counts["fallback"] == 1
    levels = np.abs(t.numpy()[:2] - ref[:2]) / spec.scale
    assert levels.mean() < 1.0  # two JPEG decoders (libjpeg builds), area resize: near-identical


@pytest.mark.parametrize("kind", ["progressive", "cmyk", "12-bit", "corrupt"])
def test_a_jpeg_a_decoder_rejects_goes_to_the_next_or_fails_alone(kind):
    """torchvision's decoder (here on the CPU; nvJPEG in tests/gpu) against the CPU path:
    progressive and CMYK JPEGs are decoded with the CPU path's pixels, 12-bit and corrupt ones
    fail alone with 400, and the batch's other frames are served."""
    import torch

    from tests.tools import jpegs
    from visionserve.config import InputSpec
    from visionserve.gpu.preprocess import TorchPreprocessor

    prep = TorchPreprocessor(InputSpec(width=64, height=64), device="cpu", dtype=torch.float32,
                             max_batch=4)
    counts = jpegs.check_odd_jpeg_in_a_batch(prep, kind)
    assert counts["cpu_decoded"] == (1 if kind == "cmyk" else 0)  # CMYK: the host decodes it


def test_cmyk_jpegs_are_decoded_on_the_host_and_rotated_ones_by_nvjpeg():
    """EXIF orientation is ignored on both paths, so it sends no JPEG to the CPU decoder."""
    from tests.tools import jpegs
    from visionserve.gpu.preprocess import host_decoded

    picture = np.full((24, 40, 3), (30, 140, 220), np.uint8)
    plain = jpegs.baseline(picture)
    assert not host_decoded(plain)
    assert not host_decoded(jpegs.with_orientation(plain, 6))
    assert not host_decoded(jpegs.with_orientation(plain, 3, ">"))
    assert not host_decoded(b"\xff\xd8\xff\xe0\x00\x04ab\xff\xda\x00\x02")
    assert host_decoded(jpegs.cmyk(picture))  # 4 components
    assert not host_decoded(jpegs.progressive(picture))  # nvJPEG's, falling back per frame
    import cv2

    ok, grey = cv2.imencode(".jpg", picture[:, :, 0])
    assert not host_decoded(grey.tobytes())


def test_axis_weights_are_normalised_and_exact_for_integer_area():
    from visionserve.gpu.preprocess import axis_weights

    w = axis_weights(640, 160, "area")
    assert np.allclose(w.sum(axis=1), 1)
    assert np.allclose(w[0, :4], 0.25) and w[0, 4:].sum() == 0
    for mode in ("area", "linear", "nearest", "cubic"):
        assert np.allclose(axis_weights(50, 50, mode), np.eye(50))


# --- resize costs a client cannot blow up -----------------------------------------------------

def test_axis_weights_build_only_the_rows_asked_for():
    from visionserve.gpu.preprocess import axis_weights

    for mode in ("area", "area_up", "linear", "nearest", "cubic"):
        full = axis_weights(300, 700, mode)
        part = axis_weights(300, 700, mode, 200, 96)
        assert part.shape == (96, 300)
        np.testing.assert_array_equal(part, full[200:296])


def test_centre_crop_intermediate_over_the_limit_fails_alone_on_both_paths():
    """A 64:1 frame (the largest aspect allowed) into a wide, flat model input would need a
    512x32768 intermediate: refused (413) for that frame only, the others answered."""
    import torch

    from visionserve import imaging
    from visionserve.config import InputSpec
    from visionserve.errors import PayloadTooLarge
    from visionserve.gpu.preprocess import TorchPreprocessor

    spec = InputSpec(width=512, height=8, resize="center_crop")
    tall = imaging.raw_frame(np.zeros((512, 8, 3), np.uint8), (512, 8, 3))
    ok = imaging.raw_frame(np.full((16, 1024, 3), 9, np.uint8), (16, 1024, 3))
    _, good, bad = TorchPreprocessor(spec, device="cpu", dtype=torch.float32,
                                     max_batch=2).prepare([tall, ok], 2)
    assert good == [1] and [i for i, _ in bad] == [0]
    assert isinstance(bad[0][1], PayloadTooLarge) and "512x32768 intermediate" in bad[0][1].message
    _, rgood, rbad = imaging.prepare_batch([tall, ok], spec, 2)
    assert rgood == good and isinstance(rbad[0][1], PayloadTooLarge)


def test_resize_weight_cache_is_bounded_by_bytes(monkeypatch):
    import torch

    from visionserve import imaging
    from visionserve.config import InputSpec
    from visionserve.gpu import preprocess

    monkeypatch.setattr(preprocess, "WEIGHT_CACHE_BYTES", 400_000)
    prep = preprocess.TorchPreprocessor(InputSpec(width=64, height=64), device="cpu",
                                        dtype=torch.float32, max_batch=1)
    for k in range(40):  # a client sending ever new frame sizes
        h, w = 100 + 9 * k, 120 + 11 * k
        prep.prepare([imaging.raw_frame(np.zeros((h, w, 3), np.uint8), (h, w, 3))], 1)
        assert prep._weight_bytes <= 400_000
    assert prep._weight_bytes == sum(t.numel() * t.element_size() for t in prep._weights.values())
    assert 0 < len(prep._weights) < 40


def test_a_swap_must_fit_beside_the_serving_versions():
    from visionserve.errors import Conflict

    res = GpuReservation("8GiB", "cuda:0", nvml=SimulatedNvml([simulated_gpu(0)]))
    res.plan = plan_budget("8GiB", [("a", cfg(budget="3GiB")), ("b", cfg())])  # b's share: 5 GiB
    res.check_beside("a", [("a", cfg(budget="3GiB"), 1)], [cfg(budget="3GiB")])  # 6 of 8 GiB
    with pytest.raises(Conflict, match=r"need 5120 MiB .* beside the 8192 MiB .* over the budget "
                                       r"of 8192 MiB .* the serving versions keep serving"):
        res.check_beside("b", [("a", cfg(budget="3GiB"), 1), ("b", cfg(), 2)], [cfg()])
    # measured: b's version took 1.5 GiB, so its next one is reckoned at that, and fits
    res.footprints[2] = 1536 * 1024**2
    res.check_beside("b", [("a", cfg(budget="3GiB"), 1), ("b", cfg(), 2)], [cfg()])  # 6 of 8
    res.footprints[2] = 3 * 1024**3
    with pytest.raises(Conflict, match=r"need 3072 MiB .* beside the 6144 MiB"):
        res.check_beside("b", [("a", cfg(budget="3GiB"), 1), ("b", cfg(), 2)], [cfg()])
    with pytest.raises(Conflict, match="give it runtime.gpu_memory_budget"):
        res.check_beside("new", [], [cfg()])
    GpuReservation(None, "cuda:0").check_beside("x", [], [cfg()])  # no budget: nothing to check


def test_worker_processes_are_in_the_budget_and_in_the_memory_used(monkeypatch, caplog):
    """--gpu-batch-processes: what a load's workers may hold comes off the serving process's
    allocator cap (and into the load's footprint, for swaps); workers that would leave the
    serving process less than it holds and one batch's preparation are not used; a swap that
    unloads them gives their bytes back; the memory-used metric adds the workers' NVML figures."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from visionserve.execution import reservation

    caps: list[int] = []
    monkeypatch.setattr(reservation, "cap_torch_allocator", lambda cap, device: caps.append(cap))
    monkeypatch.setattr(reservation, "allocator_stats",
                        lambda device: memory.AllocatorStats(1, 1, GIB, GIB, 0, 0))
    monkeypatch.setattr(reservation, "reserve_small_pool", lambda device, streams: None)
    monkeypatch.setattr(GpuReservation, "device_bytes", lambda self: GIB)
    res = GpuReservation("8GiB", "cuda:0", nvml=SimulatedNvml([simulated_gpu(0)]))
    res.plan = plan_budget("8GiB", [("a", cfg("torch"))])
    assert res.plan.torch_cap == 8 * GIB
    allowance = memory.prep_allowance(cfg("torch"))
    workers = SimpleNamespace(device_bytes=2 * GIB, pids=[501, 502])
    assert res._take_for_workers(7, workers, cfg("torch"), "a#0")
    assert caps == [6 * GIB] and res.worker_pids() == [501, 502]
    res.measure(7, 0)
    assert res.footprints[7] == GIB + 2 * GIB  # the serving process's part and the workers'
    # too many: 6 GiB - 5 GiB leaves less than the 1 GiB held and a batch's preparation
    greedy = SimpleNamespace(device_bytes=5 * GIB, pids=[503])
    with caplog.at_level(logging.WARNING):
        assert not res._take_for_workers(8, greedy, cfg("torch"), "a#1")
    assert caps == [6 * GIB] and 503 not in res.worker_pids()
    assert "run in the serving process" in caplog.text
    just = SimpleNamespace(device_bytes=5 * GIB - allowance, pids=[504])
    assert res._take_for_workers(8, just, cfg("torch"), "a#1")
    assert caps[-1] == GIB + allowance
    asyncio.run(res.settled([7, 8]))  # both unloaded: the serving process's cap is whole again
    assert caps[-1] == 8 * GIB and res.worker_pids() == [] and not res.worker_bytes
    # on the CPU a worker holds no device bytes, and nothing is capped
    cpu = GpuReservation("8GiB", "cpu")
    cpu.plan = res.plan
    assert cpu._take_for_workers(1, SimpleNamespace(device_bytes=0, pids=[9]), cfg("torch"), "a#0")
    assert caps[-1] == 8 * GIB


def test_the_memory_used_metric_counts_the_worker_processes():
    nv = SimulatedNvml([simulated_gpu(0, memory_total=80 * GIB)])
    nv.add_process(0, 99, 3 * GIB)
    nv.add_process(0, 501, GIB)
    nv.add_process(0, 777, 5 * GIB)  # someone else's
    t = telemetry.GpuTelemetry(nv, 0, 6 * GIB, pid=99, workers=lambda: [501, 502])
    assert t.sample().process_used == 4 * GIB
    assert telemetry.GpuTelemetry(nv, 0, 6 * GIB, pid=98, workers=lambda: [501]
                                  ).sample().process_used is None  # the server's own is unknown
