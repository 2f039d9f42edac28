"""The pixel formats industrial cameras send (visionserve/cameras/pixels.py): buffers read and
checked, each format converted to a raw frame's pixels against OpenCV's conversion, GenICam's
Bayer phases, the scaling rule of deeper formats, and the torch path (here on the CPU device,
the same code as on a GPU: tests/gpu/test_camera_pixels_gpu.py) equal to the CPU path."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from visionserve import imaging
from visionserve.cameras import pixels
from visionserve.cameras.pixels import (
    PIXEL_FORMATS,
    from_buffer,
    mosaic,
    pack12,
    to_frame,
    to_rgb8,
    to_rgb8_device,
)
from visionserve.cameras.source import CameraFault
from visionserve.config import InputSpec

torch = pytest.importorskip("torch")

PATTERNS = ("RG", "GB", "GR", "BG")
SIZES = [(3, 3), (4, 6), (5, 7), (31, 47), (48, 64), (101, 80)]  # (height, width), odd ones too
DEEP_MONO = {"Mono10": 1023, "Mono12": 4095, "Mono16": 65535}


def _samples(fmt: pixels.PixelFormat, h: int, w: int, seed: int = 0) -> np.ndarray:
    """Random samples of the format's depth, as :func:`from_buffer` gives them."""
    rng = np.random.default_rng(seed)
    shape = (h, w, 3) if fmt.channels == 3 else (h, w)
    return rng.integers(0, fmt.max_value + 1, shape).astype(fmt.dtype)


def _buffer(fmt: pixels.PixelFormat, samples: np.ndarray) -> bytes:
    """The bytes a camera sends for ``samples``: little-endian 16-bit words, or packed."""
    if fmt.packing != "none":
        return pack12(samples, fmt.packing)
    return samples.astype(fmt.dtype.newbyteorder("<")).tobytes()


def _reference_scale(samples: np.ndarray, top: int) -> np.ndarray:
    """OpenCV's own 16-bit -> 8-bit conversion (rounds to nearest, saturates)."""
    return cv2.convertScaleAbs(samples, alpha=255.0 / top)


def _device(px: np.ndarray, name: str, **kw) -> np.ndarray:
    return to_rgb8_device(torch.from_numpy(px.copy()), name, **kw).numpy()


# --- the table -----------------------------------------------------------------------------------

def test_the_formats_cameras_send_are_supported_with_their_depth_and_layout():
    for name, bits in [("Mono8", 8), ("Mono10", 10), ("Mono12", 12), ("Mono16", 16),
                       ("Mono12Packed", 12), ("Mono12p", 12), ("RGB8", 8), ("BGR8", 8)]:
        assert PIXEL_FORMATS[name].bits == bits
    for pattern in PATTERNS:
        for bits in (8, 10, 12, 16):
            fmt = PIXEL_FORMATS[f"Bayer{pattern}{bits}"]
            assert (fmt.layout, fmt.pattern, fmt.bits) == ("bayer", pattern, bits)
        assert PIXEL_FORMATS[f"Bayer{pattern}12p"].packing == "pfnc12"
        assert PIXEL_FORMATS[f"Bayer{pattern}12Packed"].packing == "gvsp12"
    assert PIXEL_FORMATS["Mono12"].buffer_size(640, 480) == 640 * 480 * 2
    assert PIXEL_FORMATS["Mono12p"].buffer_size(640, 480) == 640 * 480 * 3 // 2
    assert PIXEL_FORMATS["Mono12p"].buffer_size(5, 3) == 23  # 15 samples: 180 bits
    assert PIXEL_FORMATS["RGB8"].buffer_size(640, 480) == 640 * 480 * 3


# --- GenICam's Bayer phases ----------------------------------------------------------------------

# flat colours: every channel different, none a mix of the others
COLOURS = [(200, 40, 10), (10, 180, 60), (30, 70, 220), (250, 250, 20)]


def _quadrants(h: int = 64, w: int = 64) -> np.ndarray:
    img = np.zeros((h, w, 3), dtype=np.uint8)
    for k, colour in enumerate(COLOURS):
        y, x = divmod(k, 2)
        img[y * h // 2:(y + 1) * h // 2, x * w // 2:(x + 1) * w // 2] = colour
    return img


def test_mosaic_follows_genicams_top_left_2x2():
    rgb = np.zeros((2, 2, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 1, 2, 3  # R = 1, G = 2, B = 3 everywhere
    assert mosaic(rgb, "RG").tolist() == [[1, 2], [2, 3]]
    assert mosaic(rgb, "GB").tolist() == [[2, 3], [1, 2]]
    assert mosaic(rgb, "GR").tolist() == [[2, 1], [3, 2]]
    assert mosaic(rgb, "BG").tolist() == [[3, 2], [2, 1]]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_mosaic_of_genicams_pattern_comes_back_in_its_colours(pattern):
    """The GenICam -> OpenCV Bayer mapping: flat colour regions of a known RGB image, taken as a
    GenICam Bayer<pattern> camera takes them, come back as the same colours (bilinear
    demosaicing is exact inside a flat region) on both paths; OpenCV's code of the same name
    would not."""
    rgb = _quadrants()
    raw = mosaic(rgb, pattern)
    for out in (to_rgb8(raw, f"Bayer{pattern}8"), _device(raw, f"Bayer{pattern}8")):
        assert out.shape == (64, 64, 3) and out.dtype == np.uint8
        for k, colour in enumerate(COLOURS):
            y, x = divmod(k, 2)
            inside = out[y * 32 + 2:(y + 1) * 32 - 2, x * 32 + 2:(x + 1) * 32 - 2]
            assert (inside == colour).all(), (pattern, colour, inside[0, 0])
    same_name = cv2.cvtColor(raw, getattr(cv2, f"COLOR_Bayer{pattern}2RGB"))
    assert not (same_name[10, 10] == COLOURS[0]).all()


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("bits", [10, 12, 16])
def test_deep_bayer_phases_with_scaling(pattern, bits):
    top = (1 << bits) - 1
    rgb16 = (_quadrants().astype(np.uint32) * top // 255).astype(np.uint16)
    raw = mosaic(rgb16, pattern)
    out = to_rgb8(raw, f"Bayer{pattern}{bits}")
    assert (np.abs(out[2:30, 2:30].astype(int) - COLOURS[0]) <= 1).all()
    np.testing.assert_array_equal(out, _device(raw, f"Bayer{pattern}{bits}"))


# --- every format against OpenCV ---------------------------------------------------------------

@pytest.mark.parametrize("h,w", SIZES)
@pytest.mark.parametrize("name", sorted(PIXEL_FORMATS))
def test_every_format_from_its_buffer_against_opencv(name, h, w):
    """The buffer a camera sends -> from_buffer -> to_rgb8, against OpenCV's conversion of the
    same samples (for deeper Bayer formats OpenCV demosaics at full depth and scales after:
    within one level); and the torch path equal to the CPU path, bit for bit."""
    fmt = PIXEL_FORMATS[name]
    samples = _samples(fmt, h, w)
    got = from_buffer(_buffer(fmt, samples), name, w, h)
    np.testing.assert_array_equal(got, samples)
    out = to_rgb8(got, name)
    top = fmt.max_value
    if fmt.layout == "mono":
        ref = samples if fmt.bits == 8 else _reference_scale(samples, top)
        np.testing.assert_array_equal(out, ref[:, :, None])
    elif fmt.layout == "rgb":
        np.testing.assert_array_equal(out, samples)
    elif fmt.layout == "bgr":
        np.testing.assert_array_equal(out, cv2.cvtColor(samples, cv2.COLOR_BGR2RGB))
    else:
        code = getattr(cv2, f"COLOR_Bayer{imaging.OPENCV_BAYER[fmt.pattern]}2RGB")
        ref = cv2.cvtColor(samples, code)
        if fmt.bits == 8:
            np.testing.assert_array_equal(out, ref)
        else:
            assert np.abs(out.astype(int) - _reference_scale(ref, top)).max() <= 1
    assert out.dtype == np.uint8 and out.shape == (h, w, 1 if fmt.layout == "mono" else 3)
    np.testing.assert_array_equal(_device(got, name), out)


def test_bilinear_demosaic_matches_opencv_at_a_cameras_size():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (480, 640), dtype=np.uint8)
    for pattern in PATTERNS:
        np.testing.assert_array_equal(_device(raw, f"Bayer{pattern}8"),
                                      to_rgb8(raw, f"Bayer{pattern}8"))


def test_16_bit_tensors_are_taken_as_uint16_or_a_signed_view():
    samples = np.array([[0, 1, 32767, 32768, 65535]], dtype=np.uint16)
    want = _reference_scale(samples, 65535)[:, :, None]
    np.testing.assert_array_equal(_device(samples, "Mono16"), want)
    np.testing.assert_array_equal(_device(samples.view(np.int16), "Mono16"), want)


# --- packed 12-bit formats ---------------------------------------------------------------------

def test_packed_12_bit_layouts_byte_by_byte():
    """Two samples, 0xABC and 0x123, as GigE Vision's Mono12Packed and PFNC's Mono12p lay them
    out."""
    np.testing.assert_array_equal(from_buffer(bytes([0xAB, 0x3C, 0x12]), "Mono12Packed", 2, 1),
                                  [[0xABC, 0x123]])
    np.testing.assert_array_equal(from_buffer(bytes([0xBC, 0x3A, 0x12]), "Mono12p", 2, 1),
                                  [[0xABC, 0x123]])
    # an odd count: the last sample's half group is 2 bytes
    np.testing.assert_array_equal(
        from_buffer(bytes([0xAB, 0x3C, 0x12, 0xFF, 0x0E]), "Mono12Packed", 3, 1),
        [[0xABC, 0x123, 0xFFE]])
    np.testing.assert_array_equal(
        from_buffer(bytes([0xBC, 0x3A, 0x12, 0xFE, 0x0F]), "Mono12p", 3, 1),
        [[0xABC, 0x123, 0xFFE]])


# --- the scaling rule --------------------------------------------------------------------------

@pytest.mark.parametrize("name,top", sorted(DEEP_MONO.items()))
def test_deeper_formats_scale_by_their_maximum_rounding_to_nearest(name, top):
    samples = np.array([[0, 1, top // 2, top // 2 + 1, top - 1, top]], dtype=np.uint16)
    out = to_rgb8(samples, name)[..., 0]
    want = [(v * 255 + top // 2) // top for v in samples[0].tolist()]
    assert out[0].tolist() == want and want[0] == 0 and want[-1] == 255
    np.testing.assert_array_equal(out, _reference_scale(samples, top))


@pytest.mark.parametrize("top", [1023, 4095, 65535, 1000, 4096, 60007])
def test_both_paths_scale_every_16_bit_value_alike(top):
    """Every value, for the formats' maxima and for settings with ties (even) and near ties
    (60007): the device's single-precision product rounds as OpenCV's does."""
    samples = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    out = to_rgb8(samples, "Mono16", max_value=top)
    np.testing.assert_array_equal(_device(samples, "Mono16", max_value=top), out)
    exact = np.minimum((samples.astype(np.int64) * 255 + top // 2) // top, 255)
    assert np.abs(out[..., 0].astype(np.int64) - exact).max() <= 1
    if top in DEEP_MONO.values():
        np.testing.assert_array_equal(out[..., 0], exact)


def test_max_value_sets_what_becomes_255_and_values_above_it_saturate():
    """A 12-bit sensor in a Mono16 container: the model's ``[input] raw_max_value = 4095``."""
    samples = np.array([[0, 2048, 4095, 5000, 65535]], dtype=np.uint16)
    out = to_rgb8(samples, "Mono16", max_value=4095)[..., 0]
    assert out.tolist() == [[0, 128, 255, 255, 255]]
    np.testing.assert_array_equal(_device(samples, "Mono16", max_value=4095)[..., 0], out)
    assert to_rgb8(samples, "Mono16")[..., 0].tolist() == [[0, 8, 16, 19, 255]]
    # 8-bit formats are never scaled
    mono8 = np.array([[0, 100, 255]], dtype=np.uint8)
    np.testing.assert_array_equal(to_rgb8(mono8, "Mono8", max_value=4095)[..., 0], mono8)
    with pytest.raises(ValueError, match="outside 1..65535"):
        to_rgb8(samples, "Mono16", max_value=0)


def test_the_model_setting_raw_max_value():
    base = {"width": 64, "height": 64}
    assert InputSpec(**base).raw_max_value is None
    assert InputSpec(**base, raw_max_value=4095).raw_max_value == 4095
    for bad in (0, 65536):
        with pytest.raises(ValueError, match="raw_max_value"):
            InputSpec(**base, raw_max_value=bad)


# --- faults ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Mono8", "Mono12", "Mono12p", "BayerRG8", "RGB8"])
def test_a_short_buffer_is_an_incomplete_frame(name):
    fmt = PIXEL_FORMATS[name]
    data = _buffer(fmt, _samples(fmt, 48, 64))
    with pytest.raises(CameraFault, match="incomplete frame") as info:
        from_buffer(data[:-1], name, 64, 48)
    assert info.value.reason == "incomplete"
    assert f"holds {len(data) - 1} bytes, a 64x48 {name} frame is {len(data)}" in info.value.message
    with pytest.raises(CameraFault, match="larger than a frame") as info:
        from_buffer(data + b"\0", name, 64, 48)
    assert info.value.reason == "error"


def test_an_unknown_format_names_the_supported_ones():
    with pytest.raises(CameraFault, match="'YUV422_8' is not supported.*Mono8, Mono10") as info:
        from_buffer(b"\0" * 16, "YUV422_8", 4, 2)
    assert info.value.reason == "config"
    with pytest.raises(CameraFault, match="not supported"):
        to_rgb8(np.zeros((4, 4), np.uint8), "Bayer8")


def test_pixels_of_the_wrong_shape_or_type_are_refused():
    with pytest.raises(CameraFault, match="Mono12 pixels are 16-bit samples of shape HxW; got "
                                          "uint8 of shape 4x4"):
        to_rgb8(np.zeros((4, 4), np.uint8), "Mono12")
    with pytest.raises(CameraFault, match="RGB8 pixels are uint8 samples of shape HxWx3"):
        to_rgb8(np.zeros((4, 4), np.uint8), "RGB8")
    with pytest.raises(CameraFault, match="got torch.float32"):
        to_rgb8_device(torch.zeros((4, 4)), "Mono8")
    with pytest.raises(CameraFault, match="of shape 16"):
        to_rgb8(np.zeros(16, np.uint8), "Mono8")


def test_bayer_frames_of_odd_size_are_taken_and_smaller_than_3x3_refused():
    """Odd widths and heights are demosaiced (the phase is the top-left pixel's); a frame with
    no interior pixel cannot be, on either path."""
    raw = mosaic(np.full((5, 7, 3), (90, 160, 30), dtype=np.uint8), "GR")
    assert (to_rgb8(raw, "BayerGR8") == (90, 160, 30)).all()
    assert (_device(raw, "BayerGR8") == (90, 160, 30)).all()
    for h, w in [(2, 8), (8, 2), (1, 1)]:
        with pytest.raises(CameraFault, match="too small to demosaic") as info:
            to_rgb8(np.zeros((h, w), np.uint8), "BayerRG8")
        assert info.value.reason == "config"
        with pytest.raises(CameraFault, match="too small to demosaic"):
            _device(np.zeros((h, w), np.uint8), "BayerRG8")
        with pytest.raises(CameraFault, match="too small to demosaic"):
            from_buffer(b"\0" * (h * w), "BayerRG8", w, h)


# --- into a raw frame --------------------------------------------------------------------------

def test_to_frame_gives_the_raw_frame_the_data_plane_takes():
    """Mono stays one grey channel (a grey model takes it as it is; a colour model gets it
    expanded as any grey frame); colour formats are RGB, as raw frames are."""
    mono = np.arange(48 * 64, dtype=np.uint16).reshape(48, 64) % 4096
    frame = to_frame(mono, "Mono12")
    assert (frame.kind, frame.width, frame.height, frame.channels) == ("raw", 64, 48, 1)
    np.testing.assert_array_equal(imaging.decode(frame, 1), to_rgb8(mono, "Mono12")[..., 0])

    rgb = _quadrants(48, 64)
    frame = to_frame(mosaic(rgb, "BG"), "BayerBG8")
    assert (frame.channels, frame.bayer) == (1, "BG")
    bgr = imaging.decode(frame, 3)  # the raw path's decoded image is BGR
    assert (bgr[4, 4] == COLOURS[0][::-1]).all()
    with pytest.raises(imaging.PayloadTooLarge):
        to_frame(mono, "Mono12", max_pixels=1000)
    with pytest.raises(imaging.PayloadTooLarge):
        to_frame(mosaic(rgb, "BG"), "BayerBG8", max_pixels=48 * 64 - 1)
    assert to_frame(mosaic(rgb, "BG"), "BayerBG8", max_pixels=48 * 64).width == 64


BAYER_FORMATS = sorted(n for n, f in PIXEL_FORMATS.items() if f.layout == "bayer")


@pytest.mark.parametrize("name", BAYER_FORMATS)
def test_a_bayer_frame_is_its_8_bit_mosaic_with_its_pattern(name):
    """A third of the RGB bytes: one scaled sample a pixel, the pattern beside it."""
    fmt = PIXEL_FORMATS[name]
    samples = _samples(fmt, 31, 47, seed=3)
    if fmt.packing != "none":
        samples = from_buffer(pack12(samples, fmt.packing), name, 47, 31)
    frame = to_frame(samples, name)
    assert (frame.kind, frame.width, frame.height, frame.channels, frame.bayer) == \
        ("raw", 47, 31, 1, fmt.pattern)
    assert isinstance(frame.data, np.ndarray) and frame.data.shape == (31, 47, 1)
    assert frame.data.dtype == np.uint8 and frame.data.nbytes == 31 * 47
    np.testing.assert_array_equal(frame.data[..., 0], pixels.to_8bit(samples, fmt))
    np.testing.assert_array_equal(imaging.raw_pixels(frame), to_rgb8(samples, name))


def _opencv_reference(samples: np.ndarray, name: str, max_value: int | None = None
                      ) -> imaging.Frame:
    """The raw frame a Bayer camera's frame was before it travelled as its mosaic: scaled,
    demosaiced by OpenCV's own call, then an RGB raw frame."""
    fmt = PIXEL_FORMATS[name]
    px = samples if fmt.bits == 8 else _reference_scale(samples, max_value or fmt.max_value)
    code = getattr(cv2, f"COLOR_Bayer{imaging.OPENCV_BAYER[fmt.pattern]}2RGB")
    rgb = cv2.cvtColor(px, code)
    return imaging.raw_frame(rgb, rgb.shape)


def _specs() -> list[InputSpec]:
    base = {"width": 40, "height": 32, "scale": 1.0}
    return [InputSpec(**base), InputSpec(**base, color_order="BGR", resize="letterbox"),
            InputSpec(**base, channels=1, color_order="GRAY", mean=[0], std=[1],
                      resize="center_crop"),
            InputSpec(**base, interpolation="linear", mean=[0.2, 0.4, 0.1], std=[2, 3, 4])]


@pytest.mark.parametrize("name", ["BayerRG8", "BayerGB8", "BayerGR8", "BayerBG8",
                                  "BayerRG12", "BayerGB16", "BayerBG12p"])
@pytest.mark.parametrize("h,w", [(3, 3), (37, 53), (96, 128)])
def test_a_bayer_mosaic_through_the_cpu_path_gives_the_pixels_of_opencvs_demosaic(name, h, w):
    """The CPU path demosaics where it prepares the frame: its tensor is, bit for bit, the one
    of the RGB frame OpenCV's demosaic makes of the camera's frame, for every model input."""
    fmt = PIXEL_FORMATS[name]
    samples = _samples(fmt, h, w, seed=h + w)
    frame, ref = to_frame(samples, name), _opencv_reference(samples, name)
    for channels in (1, 3):
        np.testing.assert_array_equal(imaging.decode(frame, channels),
                                      imaging.decode(ref, channels))
    for spec in _specs():
        got, good, bad = imaging.prepare_batch([frame, ref, frame], spec, 4)
        assert good == [0, 1, 2] and not bad
        np.testing.assert_array_equal(got[0], got[1])
        np.testing.assert_array_equal(got[2], got[1])


def test_a_mosaic_scaled_by_the_models_raw_max_value_before_it_travels():
    samples = _samples(PIXEL_FORMATS["BayerRG16"], 24, 32, seed=5) >> 4  # 12 bits in 16
    frame = to_frame(samples, "BayerRG16", max_value=4095)
    ref = _opencv_reference(samples, "BayerRG16", max_value=4095)
    np.testing.assert_array_equal(imaging.raw_pixels(frame), ref.data)


def test_a_bayer_frame_keeps_its_pattern_where_it_is_copied_and_is_checked_when_made():
    samples = np.frombuffer(bytearray(_samples(PIXEL_FORMATS["BayerGB8"], 8, 8).tobytes()),
                            np.uint8).reshape(8, 8)  # memory something else owns
    frame = to_frame(samples, "BayerGB8")
    kept = imaging.owned(frame)
    assert kept.bayer == "GB" and kept.data is not frame.data
    np.testing.assert_array_equal(imaging.raw_pixels(kept), imaging.raw_pixels(frame))
    with pytest.raises(imaging.InvalidInput, match="pattern"):
        imaging.raw_frame(np.zeros((8, 8, 1), np.uint8), (8, 8, 1), bayer="RB")
    with pytest.raises(imaging.InvalidInput, match="one channel"):
        imaging.raw_frame(np.zeros((8, 8, 3), np.uint8), (8, 8, 3), bayer="RG")
    with pytest.raises(imaging.InvalidInput, match="too small"):
        imaging.raw_frame(np.zeros((2, 8, 1), np.uint8), (2, 8, 1), bayer="RG")


@pytest.mark.parametrize("spec", _specs(), ids=["rgb", "bgr-letterbox", "grey-crop", "linear"])
def test_the_gpu_preprocessor_demosaics_the_mosaic_as_the_cpu_path(spec):
    """On the GPU path the mosaic is what is uploaded; demosaiced on the device it gives the
    tensor of the RGB frame, exactly, and the CPU path's within the resize's documented level."""
    from visionserve.gpu.preprocess import TorchPreprocessor

    pre = TorchPreprocessor(spec, device="cpu", dtype=torch.float32, max_batch=4,
                            one_call=False)
    frames, refs = [], []
    for k, (name, (h, w)) in enumerate(zip(["BayerRG8", "BayerGB12", "BayerGR8", "BayerBG16"],
                                           [(48, 64), (37, 53), (48, 64), (96, 128)])):
        samples = _samples(PIXEL_FORMATS[name], h, w, seed=k)
        frames.append(to_frame(samples, name))
        refs.append(_opencv_reference(samples, name))
    got, good, bad = pre.prepare(frames, 4)
    want, want_good, _ = pre.prepare(refs, 4)
    assert good == want_good == [0, 1, 2, 3] and not bad
    assert pre.counts["raw"] == 8
    assert torch.equal(got, want)
    cpu, _, _ = imaging.prepare_batch(frames, spec, 4)
    std = np.asarray(spec.std, np.float32).reshape(1, -1, 1, 1)
    np.testing.assert_allclose(got.numpy() * std, cpu * std, atol=1.0 + 1e-4)
