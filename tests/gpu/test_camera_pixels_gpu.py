"""Camera pixel formats converted on a CUDA device (cameras/pixels.py ``to_rgb8_device``)
against the CPU path, whose conversion is OpenCV's (tests/unit/test_camera_pixels.py checks
that one against OpenCV and GenICam's Bayer phases): equal bit for bit, on the device.
Skipped where CUDA is absent."""

from __future__ import annotations

import numpy as np
import pytest

from visionserve.cameras.pixels import PIXEL_FORMATS, from_buffer, mosaic, pack12, to_rgb8

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def _on_cuda(samples: np.ndarray, name: str, **kw) -> np.ndarray:
    from visionserve.cameras.pixels import to_rgb8_device

    tensor = torch.from_numpy(samples.copy()).to("cuda:0")
    out = to_rgb8_device(tensor, name, **kw)
    assert out.device == tensor.device and out.dtype == torch.uint8
    return out.cpu().numpy()


@pytest.mark.parametrize("h,w", [(5, 7), (480, 640), (1024, 1280), (2048, 2048)])
@pytest.mark.parametrize("name", sorted(PIXEL_FORMATS))
def test_every_format_on_the_device_equals_opencvs_conversion(name, h, w):
    fmt = PIXEL_FORMATS[name]
    rng = np.random.default_rng(h + w)
    shape = (h, w, 3) if fmt.channels == 3 else (h, w)
    samples = rng.integers(0, fmt.max_value + 1, shape).astype(fmt.dtype)
    if fmt.packing != "none":  # through the packed buffer a camera sends
        samples = from_buffer(pack12(samples, fmt.packing), name, w, h)
    np.testing.assert_array_equal(_on_cuda(samples, name), to_rgb8(samples, name))


@pytest.mark.parametrize("pattern", ["RG", "GB", "GR", "BG"])
def test_genicam_bayer_phases_on_the_device(pattern):
    rgb = np.zeros((64, 64, 3), dtype=np.uint8)
    rgb[:, :32], rgb[:, 32:] = (200, 40, 10), (30, 70, 220)
    out = _on_cuda(mosaic(rgb, pattern), f"Bayer{pattern}8")
    assert (out[2:62, 2:30] == (200, 40, 10)).all() and (out[2:62, 34:62] == (30, 70, 220)).all()


@pytest.mark.parametrize("top", [1023, 4095, 65535, 4096, 60007])
def test_every_16_bit_value_scales_on_the_device_as_opencv_scales_it(top):
    samples = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    np.testing.assert_array_equal(_on_cuda(samples, "Mono16", max_value=top),
                                  to_rgb8(samples, "Mono16", max_value=top))


def test_16_bit_samples_scaled_on_the_device_as_uint16_or_a_signed_view():
    samples = np.array([[0, 2048, 4095, 5000, 65535]], dtype=np.uint16)
    want = to_rgb8(samples, "Mono16", max_value=4095)
    np.testing.assert_array_equal(_on_cuda(samples, "Mono16", max_value=4095), want)
    np.testing.assert_array_equal(_on_cuda(samples.view(np.int16), "Mono16", max_value=4095),
                                  want)


@pytest.mark.parametrize("channels", [3, 1])
def test_a_bayer_mosaic_is_demosaiced_by_the_cuda_preprocessor_as_by_the_cpu_path(channels):
    """A camera's Bayer frame reaches the GPU as its 8-bit mosaic (through the pinned staging
    pool) and is demosaiced there: the model's input is the tensor the GPU path makes of the
    RGB frame OpenCV demosaics, exactly, and the CPU path's within the raw frames' bounds of
    tests/gpu/test_gpu_path.py."""
    from visionserve import imaging
    from visionserve.cameras.pixels import to_frame
    from visionserve.config import InputSpec
    from visionserve.gpu.memory import PinnedPool
    from visionserve.gpu.preprocess import TorchPreprocessor

    grey = {"channels": 1, "color_order": "GRAY", "mean": [0.5], "std": [0.25]}
    spec = InputSpec(width=224, height=224, **(grey if channels == 1 else {}))
    prep = TorchPreprocessor(spec, device="cuda:0", dtype=torch.float32, max_batch=8,
                             stream=torch.cuda.Stream(), pool=PinnedPool(2, 4 << 20),
                             one_call=False)
    rng = np.random.default_rng(channels)
    frames, refs = [], []
    for k, (name, (h, w)) in enumerate(zip(["BayerRG8", "BayerGB12", "BayerGR16", "BayerBG8"] * 2,
                                           [(480, 640), (1200, 1920), (5, 7), (1080, 1920)] * 2)):
        fmt = PIXEL_FORMATS[name]
        samples = rng.integers(0, fmt.max_value + 1, (h, w)).astype(fmt.dtype)
        frames.append(to_frame(samples, name))
        rgb = to_rgb8(samples, name)
        refs.append(imaging.raw_frame(rgb, rgb.shape))
    got, good, bad = prep.prepare(frames, 8)
    want, want_good, _ = prep.prepare(refs, 8)
    torch.cuda.synchronize()
    assert got.is_cuda and good == want_good == list(range(8)) and not bad
    assert torch.equal(got, want)
    cpu, _, _ = imaging.prepare_batch(frames, spec, 8)
    levels = np.abs(got.cpu().numpy() - cpu) * np.asarray(spec.std).reshape(1, -1, 1, 1) * 255
    assert levels.mean() < 1.0 and np.percentile(levels, 99.9) < 8
