"""The pixel formats industrial cameras send, and their conversion to the pixels a raw frame holds.

A camera source gets a frame as a buffer in one of GenICam's pixel formats (PFNC names: Mono8,
BayerRG12, ...). :func:`from_buffer` reads the buffer into an array (checking its size: a short
buffer is a frame that lost packets, a fault, never a verdict); :func:`to_rgb8` turns that array
into what :func:`visionserve.imaging.raw_frame` takes, on the CPU: ``HxWx3`` uint8 in RGB order
for colour formats, ``HxWx1`` uint8 grey for mono formats (the raw path takes grey as it is, so
a grey model gets it without a conversion and a colour model gets it expanded, as for any grey
frame). :func:`to_rgb8_device` does the same with torch on the tensor's device (a GPU).
:func:`to_frame` makes the raw frame a camera source hands to the data plane: for a Bayer
format that is the 8-bit mosaic with its pattern (:attr:`visionserve.imaging.Frame.bayer`, a
third of the RGB bytes), demosaiced where the frame is prepared for the model: by OpenCV on the
CPU path (:func:`visionserve.imaging.demosaic`, as :func:`to_rgb8`), by torch on the device on
the GPU path (:func:`visionserve.gpu.demosaic.demosaic_bilinear`), so the mosaic is what
crosses to a batch worker process and to the GPU.

The rules, one for both paths (docs/cameras.md, "Pixel formats"):

* Deeper formats are scaled to 8 bits first, by their format's maximum value (Mono10: 1023,
  Mono12: 4095, Mono16: 65535): ``v8 = min(255, round(v * 255 / max))``, unless ``max_value``
  (the model's ``[input] raw_max_value``, e.g. 4095 for a 12-bit sensor in a Mono16 container)
  says otherwise; values above it saturate at 255. It is computed as OpenCV's
  ``convertScaleAbs`` does (SIMD, several times faster than a table): ``v`` times ``255 / max``
  in single precision, rounded to nearest, ties to even. For the formats' own maxima that is
  exactly ``round(v * 255 / max)`` for every ``v``; with another ``max_value``, a tie or a near
  tie may round the other way. 8-bit formats are never scaled.
* Bayer mosaics are then demosaiced bilinearly, as OpenCV's ``COLOR_Bayer*2RGB`` does: every
  missing colour is the rounded mean of its 2 or 4 nearest samples of that colour; the first
  and last row and column, which lack neighbours on one side, repeat the row or column next to
  them. GenICam names a pattern by its first row's first two pixels (BayerRG: R G / G B);
  OpenCV names it by the second row's second and third, so GenICam's BayerRG is OpenCV's
  BayerBG (:data:`~visionserve.imaging.OPENCV_BAYER`). Scaling before demosaicing makes the two
  paths agree bit for bit, and demosaics 8-bit samples (the fast case of OpenCV's code).
* Frames of any size are taken, odd widths and heights included (the pattern's phase is fixed
  by the top-left pixel); a Bayer frame must be at least 3x3, the smallest with an interior.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .. import imaging
from ..gpu.demosaic import demosaic_bilinear
from ..imaging import MIN_BAYER_SIDE, Frame
from .source import CameraFault

Layout = Literal["mono", "bayer", "rgb", "bgr"]
#: how the samples lie in the buffer: one per byte or per little-endian 16-bit word ("none");
#: GigE Vision's 12-bit packing (``Mono12Packed``: 2 pixels in 3 bytes, each pixel's 8 high bits
#: in a byte of its own, the two low nibbles shared in the middle byte); PFNC's LSB-first bit
#: stream (``Mono12p``). Packed frames are one stream over the whole frame, no line padding.
Packing = Literal["none", "gvsp12", "pfnc12"]


@dataclass(frozen=True, slots=True)
class PixelFormat:
    """One GenICam pixel format: its name, significant bits per sample, layout and packing."""

    name: str
    bits: int
    layout: Layout
    packing: Packing = "none"
    #: a Bayer pattern's first row's first two colours, as GenICam names it ("RG", "GB", ...)
    pattern: str = ""

    @property
    def max_value(self) -> int:
        return (1 << self.bits) - 1

    @property
    def channels(self) -> int:
        """Samples per pixel in the buffer (and in :func:`from_buffer`'s array)."""
        return 3 if self.layout in ("rgb", "bgr") else 1

    @property
    def dtype(self) -> np.dtype:
        """The array's sample type: uint8 for 8-bit formats, uint16 for deeper (packed ones
        are unpacked into it)."""
        return np.dtype(np.uint8) if self.bits == 8 else np.dtype(np.uint16)

    def buffer_size(self, width: int, height: int) -> int:
        """Bytes of one ``width`` x ``height`` frame in the buffer."""
        n = width * height * self.channels
        if self.packing != "none":
            return (n * self.bits + 7) // 8
        return n * self.dtype.itemsize


def _formats() -> dict[str, PixelFormat]:
    out = [PixelFormat("Mono8", 8, "mono"), PixelFormat("Mono10", 10, "mono"),
           PixelFormat("Mono12", 12, "mono"), PixelFormat("Mono16", 16, "mono"),
           PixelFormat("Mono12Packed", 12, "mono", "gvsp12"),
           PixelFormat("Mono12p", 12, "mono", "pfnc12"),
           PixelFormat("RGB8", 8, "rgb"), PixelFormat("BGR8", 8, "bgr")]
    for pattern in imaging.BAYER_PATTERNS:
        out += [PixelFormat(f"Bayer{pattern}{bits}", bits, "bayer", pattern=pattern)
                for bits in (8, 10, 12, 16)]
        out += [PixelFormat(f"Bayer{pattern}12Packed", 12, "bayer", "gvsp12", pattern),
                PixelFormat(f"Bayer{pattern}12p", 12, "bayer", "pfnc12", pattern)]
    return {f.name: f for f in out}


#: The supported formats by GenICam (PFNC) name.
PIXEL_FORMATS: dict[str, PixelFormat] = _formats()


def get_format(name: str) -> PixelFormat:
    """The format called ``name``, or a :class:`CameraFault` naming the supported ones."""
    fmt = PIXEL_FORMATS.get(name)
    if fmt is None:
        raise CameraFault(f"pixel format {name!r} is not supported; set the camera's "
                          f"PixelFormat to one of: {', '.join(PIXEL_FORMATS)}", "config")
    return fmt


# --- buffers -----------------------------------------------------------------------------------

def from_buffer(buffer: bytes | bytearray | memoryview, pixel_format: str, width: int,
                height: int) -> np.ndarray:
    """A camera's buffer -> ``HxW`` (mono, Bayer) or ``HxWx3`` (RGB8, BGR8) array of the
    format's sample type (:attr:`PixelFormat.dtype`), 16-bit samples read little-endian as
    GenICam defines them, packed 12-bit formats unpacked.

    The buffer must hold exactly one frame: a short one lost packets on the way, a long one is
    not the frame its format and size say; either is a :class:`CameraFault` (``incomplete``,
    ``error``). Unpacked formats give
    a view over ``buffer`` (no copy): convert or copy it before a buffer that the camera's
    stream reuses is handed back to it."""
    fmt = pixel_format_checked(pixel_format, width, height)
    need = fmt.buffer_size(width, height)
    have = memoryview(buffer).nbytes
    if have != need:
        short = have < need
        what = "incomplete frame (lost packets?)" if short else "buffer larger than a frame"
        raise CameraFault(f"{what}: the buffer holds {have} bytes, a {width}x{height} "
                          f"{fmt.name} frame is {need}", "incomplete" if short else "error")
    if fmt.packing != "none":
        raw = np.frombuffer(buffer, dtype=np.uint8)
        return _unpack12(raw, width * height, fmt.packing).reshape(height, width)
    arr = np.frombuffer(buffer, dtype=fmt.dtype.newbyteorder("<"))
    if arr.dtype != fmt.dtype:  # a big-endian host: native order for what follows
        arr = arr.astype(fmt.dtype)
    shape = (height, width, 3) if fmt.channels == 3 else (height, width)
    return arr.reshape(shape)


def pixel_format_checked(name: str, width: int, height: int) -> PixelFormat:
    """:func:`get_format`, with the frame's size checked for it."""
    fmt = get_format(name)
    if width <= 0 or height <= 0:
        raise CameraFault(f"a {width}x{height} {fmt.name} frame is empty", "config")
    if fmt.layout == "bayer" and min(width, height) < MIN_BAYER_SIDE:
        raise CameraFault(f"a {width}x{height} {fmt.name} frame is too small to demosaic: Bayer "
                          f"frames need at least {MIN_BAYER_SIDE}x{MIN_BAYER_SIDE} pixels",
                          "config")
    return fmt


def _unpack12(raw: np.ndarray, n: int, packing: Packing) -> np.ndarray:
    """``n`` 12-bit samples from their packed bytes: every 3 bytes hold 2 samples."""
    groups = (n + 1) // 2
    if raw.size < 3 * groups:  # an odd count: the last group's third byte is not sent
        raw = np.concatenate([raw, np.zeros(3 * groups - raw.size, dtype=np.uint8)])
    b = raw[:3 * groups].reshape(groups, 3).astype(np.uint16)
    out = np.empty((groups, 2), dtype=np.uint16)
    if packing == "gvsp12":  # B0 = p0[11:4], B1 = p1[3:0] p0[3:0], B2 = p1[11:4]
        out[:, 0] = (b[:, 0] << 4) | (b[:, 1] & 0xF)
        out[:, 1] = (b[:, 2] << 4) | (b[:, 1] >> 4)
    else:  # LSB first: B0 = p0[7:0], B1 = p1[3:0] p0[11:8], B2 = p1[11:4]
        out[:, 0] = b[:, 0] | ((b[:, 1] & 0xF) << 8)
        out[:, 1] = (b[:, 1] >> 4) | (b[:, 2] << 4)
    return out.reshape(-1)[:n]


def pack12(samples: np.ndarray, packing: Packing) -> bytes:
    """The inverse of the unpacking: 12-bit samples (any shape, row-major) -> packed bytes, as a
    camera sends them (synthetic frames for tests and benchmarks)."""
    flat = np.asarray(samples, dtype=np.uint16).reshape(-1) & 0xFFF
    n = flat.size
    pairs = np.zeros(2 * ((n + 1) // 2), dtype=np.uint16)
    pairs[:n] = flat
    p0, p1 = pairs[0::2], pairs[1::2]
    out = np.empty((p0.size, 3), dtype=np.uint8)
    if packing == "gvsp12":
        out[:, 0] = p0 >> 4
        out[:, 1] = (p0 & 0xF) | ((p1 & 0xF) << 4)
        out[:, 2] = p1 >> 4
    else:
        out[:, 0] = p0 & 0xFF
        out[:, 1] = (p0 >> 8) | ((p1 & 0xF) << 4)
        out[:, 2] = p1 >> 4
    return out.reshape(-1)[:(n * 12 + 7) // 8].tobytes()


def mosaic(rgb: np.ndarray, pattern: str) -> np.ndarray:
    """An ``HxWx3`` RGB image -> the ``HxW`` Bayer mosaic a camera with GenICam's ``pattern``
    ("RG", "GB", "GR" or "BG": the top-left 2x2's first row, the second row the other two
    colours in the other order) takes of it (synthetic frames for tests and benchmarks)."""
    colour = {"R": 0, "G": 1, "B": 2}
    second = {"RG": "GB", "GB": "RG", "GR": "BG", "BG": "GR"}[pattern]
    out = np.empty(rgb.shape[:2], dtype=rgb.dtype)
    for dy, row in enumerate((pattern, second)):
        for dx, name in enumerate(row):
            out[dy::2, dx::2] = rgb[dy::2, dx::2, colour[name]]
    return out


# --- the scaling rule ----------------------------------------------------------------------------

def scale_max(fmt: PixelFormat, max_value: int | None = None) -> int | None:
    """The sample value that becomes 255: ``max_value`` if given, else the format's maximum;
    None for 8-bit formats, which are never scaled."""
    if fmt.bits == 8:
        return None
    if max_value is None:
        return fmt.max_value
    if not 1 <= max_value <= 65535:
        raise ValueError(f"max_value {max_value} is outside 1..65535")
    return max_value


def to_8bit(pixels: np.ndarray, fmt: PixelFormat, max_value: int | None = None) -> np.ndarray:
    """Samples of ``fmt`` -> uint8 by the scaling rule (the same array for 8-bit formats)."""
    top = scale_max(fmt, max_value)
    if top is None:
        return pixels
    import cv2

    return cv2.convertScaleAbs(pixels, alpha=255.0 / top)


# --- conversion on the CPU -----------------------------------------------------------------------

def _checked(name: str, shape: tuple[int, ...], sample: str) -> PixelFormat:
    """The format called ``name``, with a frame's array shape and sample kind ("uint8",
    "16-bit", or the type's name) checked for it."""
    fmt = get_format(name)
    want_sample = "uint8" if fmt.bits == 8 else "16-bit"
    if len(shape) >= 2:
        pixel_format_checked(fmt.name, shape[1], shape[0])
    if shape != ((*shape[:2], 3) if fmt.channels == 3 else shape[:2]) or len(shape) < 2 \
            or sample != want_sample:
        raise CameraFault(f"{fmt.name} pixels are {want_sample} samples of shape "
                          f"{'HxWx3' if fmt.channels == 3 else 'HxW'}; got {sample} of shape "
                          f"{'x'.join(map(str, shape))}", "error")
    return fmt


def _to_8bit_checked(pixels: np.ndarray, name: str, max_value: int | None
                     ) -> tuple[PixelFormat, np.ndarray]:
    """(format, its uint8 samples): ``pixels`` checked for the format called ``name``, scaled by
    the module's rule."""
    sample = {np.dtype(np.uint8): "uint8", np.dtype(np.uint16): "16-bit"}.get(pixels.dtype)
    fmt = _checked(name, pixels.shape, sample or str(pixels.dtype))
    return fmt, to_8bit(pixels, fmt, max_value)


def to_rgb8(pixels: np.ndarray, pixel_format: str, *, max_value: int | None = None
            ) -> np.ndarray:
    """A frame's pixels as :func:`from_buffer` gives them -> ``HxWx3`` uint8 RGB for colour
    formats (Bayer demosaiced with OpenCV), ``HxWx1`` uint8 grey for mono ones: what the model
    sees of the frame. Deeper formats are scaled by the module's rule (``max_value``: the model's
    ``[input] raw_max_value``). Mono8 and RGB8 give views of ``pixels``; the rest new arrays."""
    return _rgb8(*_to_8bit_checked(pixels, pixel_format, max_value))


def _rgb8(fmt: PixelFormat, px: np.ndarray) -> np.ndarray:
    """:func:`to_rgb8` of a format's uint8 samples."""
    if fmt.layout == "mono":
        return px[:, :, None]
    if fmt.layout == "rgb":
        return px
    if fmt.layout == "bgr":
        import cv2

        return cv2.cvtColor(px, cv2.COLOR_BGR2RGB)
    return imaging.demosaic(px, fmt.pattern)


def to_frame(pixels: np.ndarray, pixel_format: str, *, max_value: int | None = None,
             max_pixels: int | None = None) -> Frame:
    """The raw :class:`~visionserve.imaging.Frame` a camera source hands to the data plane,
    checked (size limits, aspect ratio): :func:`to_rgb8`'s pixels, except that a Bayer format
    gives its 8-bit mosaic (``HxWx1``, scaled as :func:`to_rgb8` scales it) with its pattern,
    demosaiced where the frame is prepared for the model, to :func:`to_rgb8`'s pixels."""
    limit = imaging.DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels
    fmt, px = _to_8bit_checked(pixels, pixel_format, max_value)
    if fmt.layout == "bayer":
        h, w = px.shape
        return imaging.raw_frame(px, (h, w, 1), max_pixels=limit, bayer=fmt.pattern)
    px = _rgb8(fmt, px)
    h, w, c = px.shape
    return imaging.raw_frame(px, (h, w, c), max_pixels=limit)


# --- conversion on the device (torch) ------------------------------------------------------------

def to_rgb8_device(tensor: Any, pixel_format: str, *, max_value: int | None = None) -> Any:
    """:func:`to_rgb8` with torch, on the tensor's device: a frame's samples (``HxW`` or
    ``HxWx3``; uint8, or 16-bit samples as torch.uint16 or int16, read as unsigned) ->
    a uint8 tensor on the same device, ``HxWx3`` RGB or ``HxWx1`` grey, equal to
    :func:`to_rgb8`'s pixels for the same frame (the same single-precision scaling, then the same
    bilinear demosaic with the same rounding and border rule as OpenCV's)."""
    import torch

    sample = {torch.uint8: "uint8", torch.uint16: "16-bit", torch.int16: "16-bit"}.get(
        tensor.dtype)
    fmt = _checked(pixel_format, tuple(int(n) for n in tensor.shape), sample or str(tensor.dtype))
    top = scale_max(fmt, max_value)
    if top is None:
        px = tensor
    else:  # 16-bit samples, read as unsigned through a signed view (int16 ops are everywhere)
        v = (tensor.view(torch.int16).to(torch.int32) & 0xFFFF).to(torch.float32)
        alpha = float(np.float32(255.0 / top))  # the factor in single precision, as OpenCV's
        px = torch.clamp(torch.round(v * alpha), max=255).to(torch.uint8)  # ties to even
    if fmt.layout == "mono":
        return px.unsqueeze(-1)
    if fmt.layout == "rgb":
        return px
    if fmt.layout == "bgr":
        return px.flip(-1)
    return demosaic_bilinear(px, fmt.pattern)
