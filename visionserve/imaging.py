"""Frames: what a client sent, checked cheaply at the door, decoded and preprocessed in the runner.

The front ends build :class:`Frame` objects with :func:`encoded_frame` / :func:`raw_frame`. Those
only read headers (a few bytes), so a hostile file (a PNG declaring 40000x40000 pixels, a
truncated JPEG, random bytes) is refused before it costs a decode, and the event loop never
decodes. Decoding and resizing run in the runner thread (:func:`decode`, :func:`preprocess`);
OpenCV releases the GIL there.

A camera's Bayer frame is a raw frame of one channel, its 8-bit mosaic, with its pattern
(:attr:`Frame.bayer`): a third of the bytes of its RGB pixels as it crosses to the runner, to a
batch worker process or to the GPU. It is demosaiced where the frame is prepared: here by
OpenCV (:func:`demosaic`), on the GPU path by torch on the device (``gpu/demosaic.py``), the
two equal bit for bit. Whatever shows or keeps the frame (the records' capture) takes
:func:`raw_pixels`, the demosaiced RGB the model saw.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType, VisionServeError
from .threads import usable_cpus

if TYPE_CHECKING:
    from .config import InputSpec

Kind = Literal["jpeg", "png", "bmp", "raw"]

MEDIA_TYPES: dict[str, Kind] = {
    "image/jpeg": "jpeg",
    "image/jpg": "jpeg",
    "image/png": "png",
    "image/bmp": "bmp",
    "image/x-ms-bmp": "bmp",
    "image/x-bmp": "bmp",
    "application/octet-stream": "raw",
}

DEFAULT_MAX_PIXELS = 40_000_000

#: A frame's long side may be at most this many times its short side. Resizing to the model's
#: input costs memory that grows with the long side (a centre crop's intermediate image, the GPU
#: path's resize weights), so a tiny PNG of 400000x2 pixels must not reach the resize.
MAX_ASPECT_RATIO = 64

#: A resize may make an intermediate image (before the centre crop) of at most this many times
#: the model's input pixels. Implied by MAX_ASPECT_RATIO for square inputs; checked anyway.
MAX_RESIZE_FACTOR = 64


#: Bayer patterns by GenICam's name: the colours of the top-left 2x2's first row (RG: R G / G B)
BAYER_PATTERNS = ("RG", "GB", "GR", "BG")
#: GenICam's Bayer pattern -> OpenCV's name of the same mosaic (for ``COLOR_Bayer<name>2RGB``):
#: OpenCV names a mosaic by its second row's second and third pixels
OPENCV_BAYER = {"RG": "BG", "GB": "GR", "GR": "GB", "BG": "RG"}
#: The smallest Bayer frame: demosaicing needs an interior pixel with all its neighbours.
MIN_BAYER_SIDE = 3


@dataclass(frozen=True, slots=True)
class Frame:
    """One image as received: encoded bytes, or raw uint8 pixels ``HxWxC`` (RGB, or grey if C=1;
    with ``bayer`` set, C=1 is a Bayer mosaic of that GenICam pattern, demosaiced where the frame
    is prepared: :func:`raw_pixels`)."""

    kind: Kind
    data: bytes | np.ndarray
    width: int
    height: int
    channels: int = 3
    #: a raw Bayer mosaic's pattern (one of :data:`BAYER_PATTERNS`); None for any other frame
    bayer: str | None = None


def owned(frame: Frame) -> Frame:
    """``frame``, or a copy of it whose bytes are its own where they are a view of memory that
    something else owns (a frame read in place from a front end's arena, in zero-copy mode):
    what keeps a frame long (a record's capture queue) must not keep the arena's space."""
    root: Any = frame.data
    while isinstance(root, np.ndarray) and not root.flags.owndata and root.base is not None:
        root = root.base
    if isinstance(root, (bytes, np.ndarray)):  # immutable bytes, or an array of its own
        return frame
    data = np.array(frame.data) if frame.kind == "raw" else bytes(frame.data)
    return dataclasses.replace(frame, data=data)


def sniff(data: bytes) -> Kind | None:
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:2] == b"BM":
        return "bmp"
    return None


def media_kind(content_type: str | None) -> Kind:
    """Map an HTTP Content-Type to a frame kind, or raise 415."""
    base = (content_type or "").split(";")[0].strip().lower()
    if base not in MEDIA_TYPES:
        supported = "image/jpeg, image/png, image/bmp, application/octet-stream (+ X-Image-Shape)"
        raise UnsupportedMediaType(
            f"unsupported content type {content_type!r}; send one of: {supported}")
    return MEDIA_TYPES[base]


def encoded_frame(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS,
                  expected: Kind | None = None) -> Frame:
    """Check an encoded image's header and size without decoding it."""
    if not data:
        raise InvalidInput("empty image: the body holds no bytes")
    kind = sniff(data)
    if kind is None:
        raise InvalidInput("not an image: unknown format (expected JPEG, PNG or BMP file bytes)")
    if expected is not None and expected != "raw" and expected != kind:
        raise InvalidInput(f"content type says {expected.upper()} but the bytes are a "
                           f"{kind.upper()} file")
    width, height = _dimensions(kind, data)
    if width <= 0 or height <= 0:
        raise InvalidInput(f"{kind.upper()} declares an empty image ({width}x{height})")
    if width * height > max_pixels:
        raise PayloadTooLarge(
            f"{kind.upper()} declares {width}x{height} = {width * height} pixels; "
            f"the limit is {max_pixels} (setting max_image_pixels)")
    check_aspect(kind, width, height)
    if kind == "jpeg" and not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        raise InvalidInput("truncated JPEG: the end-of-image marker is missing")
    return Frame(kind, bytes(data), width, height, 3)


def parse_shape(text: str | None) -> tuple[int, int, int]:
    """Parse ``X-Image-Shape: HxWxC`` (also ``HxW`` for grey)."""
    if not text:
        raise InvalidInput("raw frames need the X-Image-Shape header, "
                           "e.g. 'X-Image-Shape: 480x640x3'")
    parts = text.lower().replace(",", "x").split("x")
    try:
        dims = [int(p.strip()) for p in parts]
    except ValueError:
        raise InvalidInput(f"X-Image-Shape {text!r} is not HxWxC (e.g. 480x640x3)") from None
    if len(dims) == 2:
        dims.append(1)
    if len(dims) != 3:
        raise InvalidInput(f"X-Image-Shape {text!r} is not HxWxC (e.g. 480x640x3)")
    return dims[0], dims[1], dims[2]


def raw_frame(pixels: bytes | np.ndarray, shape: tuple[int, int, int], *,
              max_pixels: int = DEFAULT_MAX_PIXELS, bayer: str | None = None) -> Frame:
    """Raw uint8 pixels, row-major ``HxWxC``, channels RGB (C=3), RGBA (C=4) or grey (C=1);
    with ``bayer`` (a pattern of :data:`BAYER_PATTERNS`), C=1 is a Bayer mosaic of at least
    :data:`MIN_BAYER_SIDE` pixels a side."""
    h, w, c = shape
    if h <= 0 or w <= 0:
        raise InvalidInput(f"raw frame shape {h}x{w}x{c} is empty")
    if c not in (1, 3, 4):
        raise InvalidInput(f"raw frame has {c} channels; 1 (grey), 3 (RGB) or 4 (RGBA) are "
                           "accepted")
    if bayer is not None:
        if bayer not in BAYER_PATTERNS or c != 1:
            raise InvalidInput(f"a Bayer mosaic is one channel of pattern "
                               f"{', '.join(BAYER_PATTERNS)}; got {c} of pattern {bayer!r}")
        if min(h, w) < MIN_BAYER_SIDE:
            raise InvalidInput(f"a {w}x{h} Bayer mosaic is too small to demosaic: at least "
                               f"{MIN_BAYER_SIDE}x{MIN_BAYER_SIDE} pixels")
    if h * w > max_pixels:
        raise PayloadTooLarge(f"raw frame of {w}x{h} = {w * h} pixels is over the limit of "
                              f"{max_pixels}")
    check_aspect("raw", w, h)
    size = h * w * c
    if isinstance(pixels, np.ndarray):
        if pixels.dtype != np.uint8:
            raise InvalidInput(f"raw frames are uint8, got {pixels.dtype}")
        arr = np.ascontiguousarray(pixels).reshape(-1)
    else:
        arr = np.frombuffer(pixels, dtype=np.uint8)
    if arr.size != size:
        raise InvalidInput(
            f"raw frame holds {arr.size} bytes but its shape {h}x{w}x{c} needs {size}")
    return Frame("raw", arr.reshape(h, w, c), w, h, c, bayer)


def check_aspect(kind: str, width: int, height: int) -> None:
    """Refuse frames whose sides differ by more than :data:`MAX_ASPECT_RATIO` (400)."""
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise InvalidInput(
            f"{kind.upper()} frame of {width}x{height} has an aspect ratio over the limit of "
            f"{MAX_ASPECT_RATIO}:1; crop it to the region to inspect before sending")


def _dimensions(kind: Kind, data: bytes) -> tuple[int, int]:
    try:
        if kind == "png":
            if data[12:16] != b"IHDR":
                raise InvalidInput("corrupt PNG: the IHDR header is missing")
            w, h = struct.unpack(">II", data[16:24])
            return w, h
        if kind == "bmp":
            w, h = struct.unpack("<ii", data[18:26])
            return abs(w), abs(h)
        return _jpeg_dimensions(data)
    except struct.error:
        raise InvalidInput(f"truncated {kind.upper()}: the header is incomplete") from None


# JPEG start-of-frame markers carry the dimensions (C4, C8 and CC are not frames).
SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_dimensions(data: bytes) -> tuple[int, int]:
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            raise InvalidInput("corrupt JPEG: bad marker structure")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if length < 2:
            raise InvalidInput("corrupt JPEG: bad segment length")
        if marker in SOF_MARKERS:
            precision, h, w = struct.unpack(">BHH", data[i + 4:i + 9])
            if precision != 8:  # 12-bit (and lossless 16-bit) JPEGs: OpenCV returns nothing
                raise InvalidInput(f"a {precision}-bit JPEG: JPEGs of 8 bits per sample are "
                                   "decoded; convert it, or send PNG")
            return w, h
        if marker == 0xDA:
            break
        i += 2 + length
    raise InvalidInput("corrupt or truncated JPEG: no frame header found")


# --- decode and preprocess (runner thread) ---------------------------------------------------


def configure_opencv(max_pixels: int) -> None:
    """OpenCV's own decode limit, a second wall behind the header check. Read when cv2 first
    decodes, so this must run before the first decode (the server calls it at start-up)."""
    os.environ["OPENCV_IO_MAX_IMAGE_PIXELS"] = str(int(max_pixels))


def _cv2():
    import cv2

    return cv2


def decode(frame: Frame, channels: int, scale: int = 1) -> np.ndarray:
    """Decoded pixels: ``HxWx3`` BGR uint8 (channels=3) or ``HxW`` grey (channels=1); a JPEG at
    1/``scale`` of its size (2, 4 or 8: :func:`jpeg_scale`).

    The pixels are the file's stored pixels: an EXIF orientation is ignored (machine-vision
    cameras do not rotate), as nvJPEG on the GPU path ignores it, so the image is the size its
    header declares (``frame.width`` x ``frame.height``) and answers are in those pixels."""
    cv2 = _cv2()
    if frame.kind == "raw":
        px = raw_pixels(frame)
        if channels == 1:
            if px.shape[2] == 1:
                return px[:, :, 0]
            return cv2.cvtColor(px, cv2.COLOR_RGBA2GRAY if px.shape[2] == 4 else cv2.COLOR_RGB2GRAY)
        code = {1: cv2.COLOR_GRAY2BGR, 3: cv2.COLOR_RGB2BGR, 4: cv2.COLOR_RGBA2BGR}[px.shape[2]]
        return cv2.cvtColor(px, code)
    flag = cv2.IMREAD_GRAYSCALE if channels == 1 else cv2.IMREAD_COLOR
    if scale > 1 and frame.kind == "jpeg":
        flag = getattr(cv2, f"IMREAD_REDUCED_{'GRAYSCALE' if channels == 1 else 'COLOR'}_{scale}")
    flag |= cv2.IMREAD_IGNORE_ORIENTATION
    try:
        img = cv2.imdecode(np.frombuffer(frame.data, dtype=np.uint8), flag)
    except cv2.error as exc:  # OpenCV's own size limit or a decoder fault
        reason = str(exc).strip().splitlines()[-1]
        raise InvalidInput(f"cannot decode {frame.kind.upper()}: {reason}") from None
    if img is None:
        raise InvalidInput(f"cannot decode {frame.kind.upper()}: the file is corrupt or truncated")
    return img


def raw_pixels(frame: Frame) -> np.ndarray:
    """A raw frame's pixels, ``HxWxC`` uint8: grey, RGB or RGBA as they came, a Bayer mosaic
    demosaiced to RGB (:func:`demosaic`): what the model sees of it, and what is shown or
    kept of it."""
    px = frame.data
    assert isinstance(px, np.ndarray)
    if frame.bayer is not None:
        return demosaic(px.reshape(frame.height, frame.width), frame.bayer)
    return px


def demosaic(mosaic: np.ndarray, pattern: str) -> np.ndarray:
    """A uint8 ``HxW`` Bayer mosaic of GenICam ``pattern`` -> ``HxWx3`` uint8 RGB, by OpenCV's
    bilinear ``COLOR_Bayer*2RGB`` (docs/cameras.md, "Pixel formats"; the GPU path's
    ``gpu/demosaic.py`` gives the same pixels)."""
    cv2 = _cv2()
    code = getattr(cv2, f"COLOR_Bayer{OPENCV_BAYER[pattern]}2RGB")
    return cv2.cvtColor(np.ascontiguousarray(mosaic), code)


def jpeg_scale(frame: Frame, spec: InputSpec) -> int:
    """How much smaller the CPU path may decode a JPEG (1, 2, 4 or 8): the largest scale whose
    image's short side still holds the resize's target in either orientation (a bound simpler
    than the exact one, and never too small). libjpeg scales in the DCT, which averages blocks as
    ``area`` does, so only with ``area``; and only when both sides divide by the scale, so that
    letterbox and centre-crop geometry is exactly the full frame's."""
    if frame.kind != "jpeg" or not spec.scaled_decode or spec.interpolation != "area":
        return 1
    iw, ih = frame.width, frame.height
    need = 0
    for h, w in ((ih, iw), (iw, ih)):
        nh, nw, *_ = geometry(spec, h, w)
        need = max(need, nh, nw)
    for f in (8, 4, 2):
        if iw % f == 0 and ih % f == 0 and min(iw, ih) // f >= need:
            return f
    return 1


def geometry(spec: InputSpec, ih: int, iw: int) -> tuple[int, int, int, int, int, int]:
    """(nh, nw, y0, x0, crop_y, crop_x): resize to nh x nw; place at (y0, x0) on the canvas
    (letterbox) or cut the window at (crop_y, crop_x) (centre crop). The one definition of the
    geometry: the CPU path (:func:`resize`) and the GPU path (``gpu/preprocess.py``) both use it.
    An intermediate over :data:`MAX_RESIZE_FACTOR` times the model's input is refused (413)."""
    w, h = spec.width, spec.height
    if spec.resize == "stretch" or (iw, ih) == (w, h):
        return h, w, 0, 0, 0, 0
    if spec.resize == "letterbox":
        s = min(w / iw, h / ih)
        nw, nh = max(1, round(iw * s)), max(1, round(ih * s))
        return nh, nw, (h - nh) // 2, (w - nw) // 2, 0, 0
    s = max(w / iw, h / ih)
    nw, nh = max(w, round(iw * s)), max(h, round(ih * s))
    if nw * nh > MAX_RESIZE_FACTOR * w * h:
        raise PayloadTooLarge(
            f"a {iw}x{ih} frame centre-cropped to {w}x{h} needs a {nw}x{nh} intermediate image, "
            f"over {MAX_RESIZE_FACTOR}x the model's input; crop it before sending")
    return nh, nw, 0, 0, (nh - h) // 2, (nw - w) // 2


_INTERP = {"area": "INTER_AREA", "linear": "INTER_LINEAR", "nearest": "INTER_NEAREST",
           "cubic": "INTER_CUBIC"}


def resize(img: np.ndarray, spec: InputSpec) -> np.ndarray:
    """Geometry as ``model.toml`` says: stretch, letterbox (keep aspect, pad) or centre crop."""
    cv2 = _cv2()
    interp = getattr(cv2, _INTERP[spec.interpolation])
    w, h = spec.width, spec.height
    ih, iw = img.shape[:2]
    if (iw, ih) == (w, h):
        return img
    nh, nw, y0, x0, cy, cx = geometry(spec, ih, iw)
    sized = cv2.resize(img, (nw, nh), interpolation=interp)
    if spec.resize == "letterbox":
        out = np.full((h, w) + img.shape[2:], spec.pad_value, dtype=np.uint8)
        out[y0:y0 + nh, x0:x0 + nw] = sized
        return out
    return sized[cy:cy + h, cx:cx + w]  # stretch: the whole image; centre crop: the window


def to_model_pixels(img: np.ndarray, spec: InputSpec) -> np.ndarray:
    """Decoded BGR/grey image -> resized ``HxWxC`` uint8 in the model's colour order."""
    cv2 = _cv2()
    out = resize(img, spec)
    if spec.color_order == "RGB":
        out = cv2.cvtColor(out, cv2.COLOR_BGR2RGB)
    elif spec.color_order == "GRAY" and out.ndim == 2:
        out = out[:, :, None]
    return out


def normalize(pixels: np.ndarray, spec: InputSpec, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 ``NxHxWxC`` -> the model's tensor (dtype, scale, mean/std, layout)."""
    if spec.dtype == "uint8":
        arr = pixels
    else:
        scale = np.float32(spec.scale)
        mean = np.asarray(spec.mean, dtype=np.float32)
        std = np.asarray(spec.std, dtype=np.float32)
        # (x*scale - mean)/std == x*(scale/std) - mean/std: one multiply-add per pixel
        arr = pixels.astype(np.float32) * (scale / std) - (mean / std)
        arr = arr.astype(np.float16 if spec.dtype == "float16" else np.float32, copy=False)
    if spec.layout == "NCHW":
        arr = arr.transpose(0, 3, 1, 2)
    if out is not None:
        out[...] = arr
        return out
    return np.ascontiguousarray(arr)


def preprocess(frame: Frame, spec: InputSpec) -> np.ndarray:
    """One frame -> ``HxWxC`` uint8 at model size (the CPU path)."""
    return to_model_pixels(decode(frame, spec.channels, jpeg_scale(frame, spec)), spec)


_POOL = None


def _decode_pool():
    """Threads that decode and resize the frames of one batch in parallel (OpenCV releases the
    GIL); shared by every runner of the process, sized to the machine."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=min(8, usable_cpus()),
                                   thread_name_prefix="decode")
    return _POOL


def _preprocess_or_error(frame: Frame, spec: InputSpec) -> np.ndarray | VisionServeError:
    try:
        return preprocess(frame, spec)
    except (InvalidInput, PayloadTooLarge) as exc:
        return exc


def prepare_batch(frames: list[Frame], spec: InputSpec, padded: int
                  ) -> tuple[np.ndarray, list[int], list[tuple[int, Exception]]]:
    """Decode and preprocess ``frames`` into one model tensor of ``padded`` rows (CPU path).

    Returns the tensor (good frames first, zero rows as padding), the indices of the good frames
    in tensor order, and (index, error) for each frame that failed to decode: a bad frame fails
    alone, never its batch.
    """
    if len(frames) > 1 and usable_cpus() > 1:
        decoded = list(_decode_pool().map(_preprocess_or_error, frames, [spec] * len(frames)))
    else:
        decoded = [_preprocess_or_error(f, spec) for f in frames]
    pixels = np.zeros((padded, spec.height, spec.width, spec.channels), dtype=np.uint8)
    good: list[int] = []
    bad: list[tuple[int, Exception]] = []
    for i, out in enumerate(decoded):
        if isinstance(out, VisionServeError):
            bad.append((i, out))
            continue
        pixels[len(good)] = out.reshape(spec.height, spec.width, spec.channels)
        good.append(i)
    return normalize(pixels, spec), good, bad
