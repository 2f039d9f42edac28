"""Header checks at the door, decoding, resize geometry and normalisation."""

from __future__ import annotations

import os
import struct
import zlib

import cv2
import numpy as np
import pytest

from visionserve import imaging
from visionserve.config import InputSpec
from visionserve.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType, http_status


def encode(ext: str, img: np.ndarray, params: list[int] | None = None) -> bytes:
    ok, buf = cv2.imencode(ext, img, params or [])
    assert ok
    return buf.tobytes()


@pytest.fixture(scope="module")
def picture() -> np.ndarray:
    """A 123 (w) x 45 (h) BGR picture with structure in it."""
    y, x = np.mgrid[0:45, 0:123]
    return np.dstack([x * 2 % 256, y * 5 % 256, (x + y) % 256]).astype(np.uint8)


def png_header(width: int, height: int) -> bytes:
    """A PNG signature + a well-formed IHDR chunk (CRC and all) and nothing else."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + chunk + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


def spec(**kw) -> InputSpec:
    return InputSpec.model_validate({"width": 32, "height": 32, **kw})


# --- header checks -----------------------------------------------------------------------------


def test_jpeg_dimensions_from_the_sof_header(picture):
    f = imaging.encoded_frame(encode(".jpg", picture))
    assert (f.kind, f.width, f.height) == ("jpeg", 123, 45)


def test_progressive_jpeg_dimensions(picture):
    f = imaging.encoded_frame(encode(".jpg", picture, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1]))
    assert (f.width, f.height) == (123, 45)


def test_jpeg_header_read_from_the_sof_not_the_thumbnail(jpeg_bytes):
    f = imaging.encoded_frame(jpeg_bytes)
    assert (f.width, f.height) == (640, 480)


def test_a_12_bit_jpeg_is_refused_at_the_door_with_the_reason():
    from tests.tools import jpegs

    with pytest.raises(InvalidInput, match="a 12-bit JPEG: JPEGs of 8 bits per sample"):
        imaging.encoded_frame(jpegs.twelve_bit())


def test_progressive_and_cmyk_jpegs_decode_to_the_pictures_colours():
    from tests.tools import jpegs

    picture = jpegs.scene(96, 128)
    for data in (jpegs.progressive(picture), jpegs.cmyk(picture)):
        px = imaging.decode(imaging.encoded_frame(data), 3)
        assert px.shape == picture.shape
        assert np.abs(px.astype(np.int16) - picture).mean() < 4  # JPEG's loss, colours right


def test_png_dimensions_from_ihdr(picture):
    f = imaging.encoded_frame(encode(".png", picture))
    assert (f.kind, f.width, f.height) == ("png", 123, 45)


def test_bmp_dimensions(picture):
    data = encode(".bmp", picture)
    f = imaging.encoded_frame(data)
    assert (f.kind, f.width, f.height) == ("bmp", 123, 45)
    # a top-down BMP stores a negative height
    top_down = data[:22] + struct.pack("<i", -45) + data[26:]
    assert imaging.encoded_frame(top_down).height == 45


def test_png_declaring_40000x40000_is_refused_by_the_header_without_decoding(monkeypatch):
    def no_decoding():
        raise AssertionError("the header check must not decode")

    monkeypatch.setattr(imaging, "_cv2", no_decoding)
    data = png_header(40000, 40000) + b"\x00" * 64
    with pytest.raises(PayloadTooLarge, match="40000x40000") as info:
        imaging.encoded_frame(data, max_pixels=40_000_000)
    assert http_status(info.value) == 413
    assert "max_image_pixels" in info.value.message


def test_oversized_bmp_and_jpeg_headers_refused(picture):
    bmp = encode(".bmp", picture)
    huge = bmp[:18] + struct.pack("<ii", 50000, 50000) + bmp[26:]
    with pytest.raises(PayloadTooLarge, match="50000x50000"):
        imaging.encoded_frame(huge)
    jpg = encode(".jpg", picture)
    with pytest.raises(PayloadTooLarge):
        imaging.encoded_frame(jpg, max_pixels=123 * 45 - 1)
    assert imaging.encoded_frame(jpg, max_pixels=123 * 45).width == 123


def test_truncated_jpeg(jpeg_bytes):
    with pytest.raises(InvalidInput, match="truncated JPEG"):
        imaging.encoded_frame(jpeg_bytes[: len(jpeg_bytes) // 2])
    with pytest.raises(InvalidInput, match="truncated"):
        imaging.encoded_frame(jpeg_bytes[:20])  # cut inside the headers, before the SOF


def test_truncated_png_header():
    with pytest.raises(InvalidInput, match="truncated PNG"):
        imaging.encoded_frame(png_header(10, 10)[:20])
    with pytest.raises(InvalidInput, match="IHDR"):
        imaging.encoded_frame(b"\x89PNG\r\n\x1a\n" + b"\x00" * 30)


def test_random_bytes_are_not_an_image():
    rng = np.random.default_rng(1)
    data = b"\x00\x01" + rng.bytes(5000)
    with pytest.raises(InvalidInput, match="not an image"):
        imaging.encoded_frame(data)


@pytest.mark.parametrize("signature", [b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"BM"])
def test_random_bytes_after_a_signature_are_refused_cleanly(signature):
    """Garbage behind a valid signature: a clear 400/413, never an IndexError or struct.error."""
    rng = np.random.default_rng(2)
    for _ in range(300):
        data = signature + rng.bytes(int(rng.integers(0, 64)))
        try:
            f = imaging.encoded_frame(data)
        except (InvalidInput, PayloadTooLarge) as exc:
            assert exc.message
            continue
        assert f.width > 0 and f.height > 0  # a header that happens to parse: decode decides


def test_empty_body():
    with pytest.raises(InvalidInput, match="empty"):
        imaging.encoded_frame(b"")


def test_declared_content_type_must_match_the_bytes(picture):
    with pytest.raises(InvalidInput, match="content type says PNG but the bytes are a JPEG"):
        imaging.encoded_frame(encode(".jpg", picture), expected="png")


def test_zero_sized_png_refused():
    with pytest.raises(InvalidInput, match="empty image"):
        imaging.encoded_frame(png_header(0, 10))


def test_media_kind():
    assert imaging.media_kind("image/jpeg") == "jpeg"
    assert imaging.media_kind("IMAGE/PNG; charset=binary") == "png"
    assert imaging.media_kind("image/x-ms-bmp") == "bmp"
    assert imaging.media_kind("application/octet-stream") == "raw"
    for bad in ("text/plain", "", None, "image/gif"):
        with pytest.raises(UnsupportedMediaType, match="unsupported content type") as info:
            imaging.media_kind(bad)
        assert http_status(info.value) == 415


# --- raw frames and X-Image-Shape --------------------------------------------------------------


@pytest.mark.parametrize("text, shape", [
    ("480x640x3", (480, 640, 3)),
    ("480X640X1", (480, 640, 1)),
    ("480x640", (480, 640, 1)),
    (" 480 x 640 x 4 ", (480, 640, 4)),
    ("480,640,3", (480, 640, 3)),
])
def test_parse_shape(text, shape):
    assert imaging.parse_shape(text) == shape


@pytest.mark.parametrize("text", [None, "", "abc", "480x640x3x1", "480", "4.5x6x3", "480xx3"])
def test_parse_shape_refuses(text):
    with pytest.raises(InvalidInput, match="X-Image-Shape"):
        imaging.parse_shape(text)


def test_raw_frame_wrong_size():
    with pytest.raises(InvalidInput, match="holds 100 bytes but its shape 10x10x3 needs 300"):
        imaging.raw_frame(bytes(100), (10, 10, 3))


@pytest.mark.parametrize("shape, error", [
    ((0, 10, 3), InvalidInput), ((-1, 10, 3), InvalidInput), ((10, 10, 2), InvalidInput),
    ((100_000, 100_000, 3), PayloadTooLarge),
])
def test_raw_frame_bad_shapes(shape, error):
    with pytest.raises(error):
        imaging.raw_frame(bytes(300), shape)


def test_raw_frame_numpy_and_bytes_agree():
    px = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    a = imaging.raw_frame(px.tobytes(), (4, 5, 3))
    b = imaging.raw_frame(px, (4, 5, 3))
    assert (a.width, a.height, a.channels) == (5, 4, 3)
    assert np.array_equal(a.data, b.data)
    with pytest.raises(InvalidInput, match="uint8"):
        imaging.raw_frame(px.astype(np.float32), (4, 5, 3))


# --- decode and geometry -----------------------------------------------------------------------


def test_decode_jpeg_png_bmp(picture):
    for ext in (".png", ".bmp"):
        img = imaging.decode(imaging.encoded_frame(encode(ext, picture)), 3)
        assert np.array_equal(img, picture)  # lossless formats round-trip exactly (BGR)
    img = imaging.decode(imaging.encoded_frame(encode(".jpg", picture)), 3)
    assert img.shape == (45, 123, 3)
    grey = imaging.decode(imaging.encoded_frame(encode(".png", picture)), 1)
    assert grey.shape == (45, 123)


def test_decode_of_a_corrupt_body_is_invalid_input():
    f = imaging.Frame("png", png_header(16, 16) + b"\x00" * 40, 16, 16)
    with pytest.raises(InvalidInput, match="cannot decode PNG"):
        imaging.decode(f, 3)


def test_raw_rgb_frame_reaches_the_model_unchanged():
    rng = np.random.default_rng(3)
    px = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = imaging.preprocess(imaging.raw_frame(px, (32, 32, 3)), spec(color_order="RGB"))
    assert np.array_equal(out, px)  # RGB in, model size already: no change
    bgr = imaging.preprocess(imaging.raw_frame(px, (32, 32, 3)), spec(color_order="BGR"))
    assert np.array_equal(bgr, px[:, :, ::-1])


def test_colour_order_of_decoded_files():
    blue_bgr = np.zeros((32, 32, 3), np.uint8)
    blue_bgr[:, :, 0] = 255
    f = imaging.encoded_frame(encode(".png", blue_bgr))
    rgb = imaging.preprocess(f, spec(color_order="RGB"))
    assert tuple(rgb[5, 5]) == (0, 0, 255)
    assert tuple(imaging.preprocess(f, spec(color_order="BGR"))[5, 5]) == (255, 0, 0)


def test_grey_model():
    px = np.full((20, 30, 3), 200, np.uint8)
    out = imaging.preprocess(imaging.raw_frame(px, (20, 30, 3)),
                             spec(channels=1, color_order="GRAY", mean=[0.0], std=[1.0]))
    assert out.shape == (32, 32, 1)
    assert int(out.mean()) == 200


def test_stretch_ignores_aspect():
    img = np.full((100, 100, 3), 255, np.uint8)
    out = imaging.resize(img, spec(width=64, height=32, resize="stretch"))
    assert out.shape == (32, 64, 3) and out.min() == 255


def test_letterbox_keeps_aspect_and_pads():
    img = np.full((100, 100, 3), 255, np.uint8)  # square into a 64x32 box -> 32x32 in the middle
    out = imaging.resize(img, spec(width=64, height=32, resize="letterbox", pad_value=114))
    assert out.shape == (32, 64, 3)
    assert (out[:, :16] == 114).all() and (out[:, 48:] == 114).all()
    assert (out[:, 16:48] == 255).all()
    tall = np.full((200, 50, 3), 255, np.uint8)  # 1:4 into 32x32 -> 8 wide, 32 high
    out = imaging.resize(tall, spec(width=32, height=32, resize="letterbox", pad_value=0))
    assert (out[:, 12:20] == 255).all() and (out[:, :12] == 0).all() and (out[:, 20:] == 0).all()


def test_center_crop_keeps_the_middle():
    img = np.zeros((100, 200, 3), np.uint8)  # 200 wide, 100 high: the middle half is white
    img[:, 50:150] = 255
    out = imaging.resize(img, spec(width=32, height=32, resize="center_crop"))
    # short side 100 -> 32 (scale 0.32): 64x32, crop the centre 32 columns = the white part
    assert out.shape == (32, 32, 3)
    assert out.min() == 255


def test_same_size_is_not_resized():
    img = np.arange(32 * 32 * 3, dtype=np.uint8).reshape(32, 32, 3)
    for mode in ("stretch", "letterbox", "center_crop"):
        assert np.array_equal(imaging.resize(img, spec(resize=mode)), img)


# --- normalisation -----------------------------------------------------------------------------


def test_normalize_nchw_float32_mean_std():
    px = np.full((2, 32, 32, 3), 255, np.uint8)
    px[1] = 0
    out = imaging.normalize(px, spec(mean=[0.5, 0.5, 0.5], std=[0.5, 0.25, 0.5]))
    assert out.shape == (2, 3, 32, 32) and out.dtype == np.float32 and out.flags.c_contiguous
    assert np.allclose(out[0, 0], 1.0) and np.allclose(out[0, 1], 2.0)
    assert np.allclose(out[1, 0], -1.0) and np.allclose(out[1, 1], -2.0)


def test_normalize_channel_order_survives_the_transpose():
    px = np.zeros((1, 32, 32, 3), np.uint8)
    px[..., 2] = 255
    out = imaging.normalize(px, spec())
    assert np.allclose(out[0, 2], 1.0) and np.allclose(out[0, :2], 0.0)


def test_normalize_nhwc_float16_and_uint8():
    px = np.full((1, 32, 32, 3), 51, np.uint8)
    half = imaging.normalize(px, spec(layout="NHWC", dtype="float16"))
    assert half.shape == (1, 32, 32, 3) and half.dtype == np.float16
    assert np.allclose(half, 0.2, atol=1e-3)
    raw = imaging.normalize(px, spec(dtype="uint8"))
    assert raw.shape == (1, 3, 32, 32) and raw.dtype == np.uint8 and (raw == 51).all()


def test_prepare_batch_bad_frame_fails_alone_and_rows_are_compacted():
    good = imaging.raw_frame(np.full((32, 32, 3), 255, np.uint8), (32, 32, 3))
    bad = imaging.Frame("png", png_header(32, 32) + b"\x00" * 16, 32, 32)
    tensor, ok, failed = imaging.prepare_batch([bad, good, good], spec(), padded=4)
    assert tensor.shape == (4, 3, 32, 32)
    assert ok == [1, 2]
    assert [i for i, _ in failed] == [0] and isinstance(failed[0][1], InvalidInput)
    assert np.allclose(tensor[:2], 1.0)  # good frames first
    assert np.allclose(tensor[2:], 0.0)  # padding


def test_configure_opencv_sets_the_decoder_limit(monkeypatch):
    # set through monkeypatch first, so that the value is undone after the test (a server that a
    # later test starts from this process would inherit it)
    monkeypatch.setenv("OPENCV_IO_MAX_IMAGE_PIXELS", "1")
    imaging.configure_opencv(1234)
    assert os.environ["OPENCV_IO_MAX_IMAGE_PIXELS"] == "1234"


# --- frames whose resize would cost without bound ---------------------------------------------


@pytest.mark.parametrize("w,h", [(4000, 1), (1, 4000), (400000, 2), (65, 1)])
def test_extreme_aspect_ratios_are_refused_at_the_door(w, h):
    with pytest.raises(InvalidInput, match=rf"{w}x{h} has an aspect ratio over the limit of 64:1"):
        imaging.encoded_frame(png_header(w, h) + b"\x00" * 100)
    if w * h <= 1_000_000:
        with pytest.raises(InvalidInput, match="aspect ratio"):
            imaging.raw_frame(bytes(w * h * 3), (h, w, 3))


def test_the_largest_aspect_ratio_allowed_still_resizes():
    img = np.full((8, 512, 3), 77, np.uint8)  # 64:1
    frame = imaging.raw_frame(img, (8, 512, 3))
    for mode in ("stretch", "letterbox", "center_crop"):
        out = imaging.preprocess(frame, spec(resize=mode))
        assert out.shape == (32, 32, 3)


# --- scaled JPEG decoding (input.scaled_decode) ------------------------------------------------

def _scene(w: int, h: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    img = np.dstack([(x * 255) // w, (y * 255) // h, ((x // 16 + y // 16) % 2) * 200 + 20])
    return cv2.GaussianBlur(img.astype(np.uint8), (5, 5), 1.5)


def _spec(**kw) -> InputSpec:
    return InputSpec(**{"width": 160, "height": 160, "scaled_decode": True, **kw})


@pytest.mark.parametrize("size, spec, scale", [
    ((640, 480), {}, 2),                                     # 320x240 still >= 160x160
    ((1280, 1024), {}, 4),
    ((1920, 1080), {}, 4),                                   # 1/8 would be 240x135
    ((1920, 1080), {"resize": "letterbox", "width": 224, "height": 224}, 4),
    ((1920, 1080), {"resize": "center_crop", "width": 224, "height": 224}, 2),  # 398x224 crop source
    ((642, 482), {}, 2),
    ((641, 480), {}, 1),                                     # an odd side: geometry would shift
    ((640, 480), {"interpolation": "linear"}, 1),            # the DCT averages: only with area
    ((640, 480), {"scaled_decode": False}, 1),
    ((160, 160), {}, 1),
])
def test_jpeg_scale_is_the_largest_that_still_covers_the_resize(size, spec, scale):
    w, h = size
    frame = imaging.encoded_frame(encode(".jpg", _scene(w, h)))
    assert imaging.jpeg_scale(frame, _spec(**spec)) == scale


def test_scaled_decode_is_off_by_default_and_never_for_png():
    frame = imaging.encoded_frame(encode(".jpg", _scene(640, 480)))
    assert imaging.jpeg_scale(frame, InputSpec(width=160, height=160)) == 1
    png = imaging.encoded_frame(encode(".png", _scene(640, 480)))
    assert imaging.jpeg_scale(png, _spec()) == 1


@pytest.mark.parametrize("resize", ["stretch", "letterbox", "center_crop"])
def test_scaled_decode_gives_nearly_the_full_decodes_pixels(resize):
    spec = _spec(resize=resize, width=128, height=96)
    frame = imaging.encoded_frame(encode(".jpg", _scene(1024, 512), [cv2.IMWRITE_JPEG_QUALITY, 95]))
    scale = imaging.jpeg_scale(frame, spec)  # centre crop: 2 (its source may need 256 px)
    assert scale == (2 if resize == "center_crop" else 4)
    assert imaging.decode(frame, 3, scale).shape == (512 // scale, 1024 // scale, 3)
    full = imaging.to_model_pixels(imaging.decode(frame, 3), spec).astype(np.int16)
    scaled = imaging.preprocess(frame, spec).astype(np.int16)
    assert scaled.shape == full.shape == (96, 128, 3)
    # sharp 16 px squares: the DCT's averaging differs from area's by a level or two along their
    # edges; a geometry one pixel off would put whole edges out of place (tens of levels there)
    assert np.abs(full - scaled).mean() < 3.0
    assert np.abs(full[:, 2:] - scaled[:, :-2]).mean() > 2 * np.abs(full - scaled).mean()


@pytest.mark.parametrize("channels, scale", [(3, 1), (1, 1), (3, 2), (1, 2)])
def test_an_exif_orientation_is_ignored_the_pixels_are_the_stored_ones(channels, scale):
    """Decoded as the header's width x height, the same pixels as the untagged file (colour,
    grey and scaled decodes); OpenCV's default would turn the image."""
    from tests.tools import jpegs

    plain = encode(".jpg", _scene(64, 32))
    tagged = jpegs.with_orientation(plain, 6)
    assert cv2.imdecode(np.frombuffer(tagged, np.uint8), cv2.IMREAD_COLOR).shape[:2] == (64, 32)
    frame = imaging.encoded_frame(tagged)
    assert (frame.width, frame.height) == (64, 32)
    got = imaging.decode(frame, channels, scale)
    assert got.shape[:2] == (32 // scale, 64 // scale)
    assert np.array_equal(got, imaging.decode(imaging.encoded_frame(plain), channels, scale))
