"""Batch preprocessing with torch on the runner's device: the GPU path of ``imaging``.

A batch's JPEGs are decoded in one nvJPEG call (``torchvision.io.decode_jpeg(list,
device="cuda")``); PNG/BMP are decoded on the CPU with OpenCV exactly as the CPU path does, and
they and raw frames reach the device through the pinned staging pool. A camera's Bayer frame
goes up as its 8-bit mosaic (a third of its RGB bytes) and is demosaiced on the device
(:mod:`.demosaic`), bit for bit as the CPU path's OpenCV does. Then resize, letterbox /
centre crop, colour order, normalisation, dtype and layout all happen on the device, on the
runner's stream, and the result is the model's input tensor.

Same verdicts as the CPU path, by construction:

* Resizing is two small matrix products per image size, ``Wy @ img @ Wx^T``, with the weights
  OpenCV's ``resize`` uses (INTER_AREA: exact pixel-area overlap; INTER_LINEAR / NEAREST /
  CUBIC: OpenCV's sample positions), then rounded to integers like OpenCV's uint8 output. The
  remaining differences are OpenCV's 11-bit fixed-point coefficients (at most 1 level) and, on
  CUDA, fp16 matmul rounding (at most ~0.2 level before rounding).
* JPEG decoders differ: nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's, typically
  by 1-2 levels, more on sharp colour edges. So the GPU and CPU paths agree on labels, and on
  scores within a tolerance (tests/gpu/test_gpu_path.py), not bit for bit.
* A JPEG nvJPEG rejects (or one of CMYK/YCCK components, whose colours OpenCV's decoder
  defines) is decoded by OpenCV instead; only if that fails too does the frame fail, alone,
  with 400.
* An EXIF orientation is ignored on both paths (nvJPEG never applies it; the CPU decoder is told
  not to): a frame's pixels are its stored pixels, the size its header declares.

A batch of JPEGs of one size, resized to the whole input, is prepared by one TorchScript call
(:mod:`.onecall`, the same ops) that holds the interpreter once instead of at every torch call;
other batches take the eager path here.

The class runs on the CPU as well (``device="cpu"``), which is how it is unit-tested here.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np

from .. import imaging
from ..config import InputSpec, ModelConfig
from ..errors import InvalidInput, VisionServeError
from ..imaging import BAYER_PATTERNS, SOF_MARKERS, Frame, geometry
from .demosaic import demosaic_bilinear
from .memory import DEFAULT_STAGE_FRAME_BYTES, PinnedPool, shared_pool, stage_slot_bytes

log = logging.getLogger(__name__)

#: bytes of the working copy of the images resized together in one matrix product: 32 frames of
#: 640x480 in one product (each torch call costs the prep thread the interpreter once more), five
#: of 1080p
CHUNK_BYTES = 64 << 20
#: device memory the cached resize weights may hold (least recently used dropped first); a
#: client sending ever new frame sizes costs at most this much, not memory without bound
WEIGHT_CACHE_BYTES = 64 << 20
_GRAY = (4899, 9617, 1868)  # OpenCV's fixed-point RGB->grey weights (R, G, B), 14 bits
# A JPEG's bytes reach the decoder as a tensor over the frame's own ``bytes`` (read-only; the
# decoders only read them), not over a copy: a copy is a memcpy per frame in the prep thread,
# holding the interpreter (about 9 us for a 1080p JPEG). torch warns once that the tensor could
# write to a read-only buffer; nothing here writes to it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


# --- resize weights (OpenCV's) ---------------------------------------------------------------

def axis_weights(n_in: int, n_out: int, mode: str, start: int = 0, count: int | None = None
                 ) -> np.ndarray:
    """(count, n_in) float64 matrix: rows ``start:start+count`` (default: all ``n_out``) of the
    resize along one axis; output pixel = weights @ input pixels.

    Only the rows asked for are built, so a centre crop's weights are (model side x frame side),
    whatever the size of the intermediate image the crop is cut from.

    ``mode``: "area" (downscale: exact overlap), "area_up" (OpenCV's INTER_AREA when enlarging),
    "linear", "nearest", "cubic".
    """
    count = n_out - start if count is None else count
    w = np.zeros((count, n_in), dtype=np.float64)
    scale = n_in / n_out
    last = n_in - 1
    for row in range(count):
        dx = start + row
        if mode == "area":
            f1, f2 = dx * scale, (dx + 1) * scale
            s = int(np.floor(f1))
            while s < n_in and s < f2:
                w[row, s] = min(f2, s + 1) - max(f1, s)
                s += 1
        elif mode == "nearest":
            w[row, min(int(np.floor(dx * scale)), last)] = 1.0
        elif mode in ("linear", "area_up"):
            if mode == "linear":
                fx = (dx + 0.5) * scale - 0.5
                sx = int(np.floor(fx))
                fx -= sx
            else:
                sx = int(np.floor(dx * scale))
                fx = (dx + 1) - (sx + 1) / scale
                fx = 0.0 if fx <= 0 else fx - np.floor(fx)
            if sx < 0:
                sx, fx = 0, 0.0
            if sx >= last:
                sx, fx = last, 0.0
            w[row, sx] += 1.0 - fx
            w[row, min(sx + 1, last)] += fx
        elif mode == "cubic":
            fx = (dx + 0.5) * scale - 0.5
            sx = int(np.floor(fx))
            fx -= sx
            a = -0.75
            cs = [((a * (fx + 1) - 5 * a) * (fx + 1) + 8 * a) * (fx + 1) - 4 * a,
                  ((a + 2) * fx - (a + 3)) * fx * fx + 1,
                  ((a + 2) * (1 - fx) - (a + 3)) * (1 - fx) * (1 - fx) + 1]
            cs.append(1.0 - sum(cs))
            for k, c in enumerate(cs):
                w[row, min(max(sx - 1 + k, 0), last)] += c
        else:
            raise ValueError(f"unknown resize mode {mode!r}")
    w /= w.sum(axis=1, keepdims=True)
    return w


def resize_modes(interp: str, in_hw: tuple[int, int], out_hw: tuple[int, int]) -> str:
    """OpenCV uses true area averaging only when neither axis grows; else its linear variant."""
    if interp != "area":
        return interp
    (ih, iw), (oh, ow) = in_hw, out_hw
    return "area" if (ih >= oh and iw >= ow) else "area_up"


# --- JPEGs for the CPU decoder ----------------------------------------------------------------

def host_decoded(frame_bytes: bytes | np.ndarray) -> bool:
    """True for a JPEG that the CPU decodes, not nvJPEG: one of other than 1 or 3 components
    (CMYK, YCCK: OpenCV undoes Adobe's inverted CMYK, and the CPU path's colours are the
    reference). An EXIF orientation is no reason: neither path applies it. ``frame_bytes``: the
    file's bytes, or a uint8 array of them (a frame read in place from a front end's arena)."""
    data = memoryview(frame_bytes)  # type: ignore[arg-type]  # ints when indexed, as bytes
    i, n = 2, min(len(data), 1 << 16)
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xDA:  # start of scan: no more headers
            return False
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if marker in SOF_MARKERS and i + 9 < n and data[i + 9] not in (1, 3):
            return True
        i += 2 + length
    return False


# --- the preprocessor ------------------------------------------------------------------------

class TorchPreprocessor:
    """``prepare(frames, padded)`` -> (model input tensor on ``device``, good, bad), the same
    contract as :func:`visionserve.imaging.prepare_batch`.

    ``dtype`` is the tensor dtype the backend wants (fp16 for a torch model in half precision,
    the ONNX input dtype for onnxruntime); ``channels_last`` gives NCHW tensors in NHWC memory.
    Called from the runner's prep thread only; everything queued on ``stream``.
    """

    def __init__(self, spec: InputSpec, *, device: str, dtype: Any, max_batch: int,
                 stream: Any = None, pool: PinnedPool | None = None, channels_last: bool = False,
                 stage_frame_bytes: int = DEFAULT_STAGE_FRAME_BYTES, one_call: bool = True
                 ) -> None:
        import torch

        from . import onecall

        self.spec = spec
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = dtype
        self.max_batch = max_batch
        self.stream = stream
        self.channels_last = channels_last
        self.pool = pool
        self.stage_frame_bytes = stage_frame_bytes
        # fp16 products on the GPU (tensor cores); exact float32 on the CPU
        self._mm_dtype = torch.float16 if self.cuda else torch.float32
        c = spec.channels
        std = torch.tensor(spec.std, dtype=torch.float32).view(1, c, 1, 1)
        mean = torch.tensor(spec.mean, dtype=torch.float32).view(1, c, 1, 1)
        self._mul = (spec.scale / std).to(self.device)
        self._add = (-mean / std).to(self.device)
        self._weights: OrderedDict[tuple[int, int, str, int, int], Any] = OrderedDict()
        self._weight_bytes = 0
        # nvJPEG decodes on a stream of torchvision's own, into tensors allocated on the caller's
        # current stream, without waiting for what is queued there. Decoding with ``stream``
        # current could overwrite blocks that queued kernels of the previous batch have not read
        # yet. So decode with a stream of our own current, mark the images as used on ``stream``
        # (their blocks are reused only once ``stream`` is past them) and make ``stream`` wait.
        # ``one_call``: a batch of JPEGs of one size is prepared by one TorchScript call that
        # releases the interpreter once (onecall.py); the decode stream is then made there, so
        # that the script and the eager path share it
        self._one_call = onecall.compiled() if one_call else None
        self._decode_scripted: Any = None
        self.decode_stream: Any = None
        if self.cuda and self._one_call is not None:
            self._decode_scripted, self.decode_stream = onecall.decode_stream(self.device)
        elif self.cuda:
            self.decode_stream = torch.cuda.Stream(device=self.device)
        #: frames by decoder, and ``one_call``: batches prepared by the one call
        self.counts = {"nvjpeg": 0, "cpu_decoded": 0, "raw": 0, "fallback": 0, "one_call": 0}

    @classmethod
    def for_config(cls, config: ModelConfig, *, device: str, dtype: Any, stream: Any = None,
                   channels_last: bool = False, slots: int = 3,
                   pool_key: tuple | None = None, one_call: bool = True) -> TorchPreprocessor:
        """``pool_key``: share the pinned staging pool with the live preprocessors of that key
        (the other versions of the same model instance) instead of pinning a new one."""
        pool = None
        if device.startswith("cuda"):
            pool = shared_pool((device, *pool_key), slots, stage_slot_bytes(config)) \
                if pool_key is not None else PinnedPool(slots, stage_slot_bytes(config))
        return cls(config.input, device=device, dtype=dtype,
                   max_batch=config.batching.max_batch_size, stream=stream, pool=pool,
                   channels_last=channels_last, one_call=one_call)

    # -- public -------------------------------------------------------------------------------

    def prepare(self, frames: list[Frame], padded: int
                ) -> tuple[Any, list[int], list[tuple[int, Exception]]]:
        import torch

        ctx = torch.cuda.stream(self.stream) if (self.cuda and self.stream is not None) \
            else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            tensor = self._prepare_one_call(frames, padded)
            if tensor is not None:
                return tensor, list(range(len(frames))), []
            images, bad = self._decode_all(frames)
            good = sorted(images)
            tensor = self._assemble([images[i] for i in good], padded)
        return tensor, good, bad

    def warmup(self, batch_sizes: tuple[int, ...],
               frame_hw: tuple[int, int] = (1080, 1920)) -> None:
        """Run the largest batch of the largest expected frames (JPEG and raw) through, so the
        allocator and nvJPEG have grown their buffers before the server reports ready."""
        cv2 = imaging._cv2()
        h, w = frame_hw
        y, x = np.mgrid[0:h, 0:w]
        img = np.dstack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1),
                         (x + y) % 256]).astype(np.uint8)
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 95])
        assert ok
        jpeg = imaging.encoded_frame(buf.tobytes(), max_pixels=h * w)
        raw = imaging.raw_frame(img, (h, w, 3), max_pixels=h * w)
        top = max(batch_sizes)
        for bs in sorted(set(batch_sizes)):
            self.prepare([jpeg] * bs, bs)
        for _ in range(2):  # under load decoded images of ~2 batches wait on the stream at once
            self.prepare([jpeg] * top, top)
        self.prepare([raw] * top, top)
        self.prepare([jpeg, raw] * (top // 2) + [jpeg] * (top % 2), top)
        if self.cuda:
            torch_sync(self.stream)

    def _prepare_one_call(self, frames: list[Frame], padded: int) -> Any:
        """The model's input from one TorchScript call (onecall.py), or None where the batch is
        not for it (not all JPEGs of one size for nvJPEG, resized to the whole input) or the
        call failed (a JPEG nvJPEG refuses): then the eager path prepares it, frame by frame
        where it must."""
        if self._one_call is None or not frames:
            return None
        import torch

        s = self.spec
        ih, iw = frames[0].height, frames[0].width
        if any(f.kind != "jpeg" or f.height != ih or f.width != iw for f in frames):
            return None
        try:
            nh, nw, y0, x0, cy, cx = geometry(s, ih, iw)
        except VisionServeError:
            return None
        mode = resize_modes(s.interpolation, (ih, iw), (nh, nw))
        wy = self._w(ih, nh, mode, cy, min(nh, s.height) if s.resize == "center_crop" else nh)
        wx = self._w(iw, nw, mode, cx, min(nw, s.width) if s.resize == "center_crop" else nw).T
        if (wy.shape[0], wx.shape[1]) != (s.height, s.width) or y0 or x0 \
                or any(host_decoded(f.data) for f in frames):
            return None  # letterboxed, or a JPEG for the CPU decoder
        from torchvision.io import ImageReadMode

        datas = [torch.frombuffer(f.data, dtype=torch.uint8) for f in frames]
        consumer = torch.cuda.current_stream(self.device) if self.cuda else None
        read = ImageReadMode.GRAY if s.channels == 1 else ImageReadMode.RGB
        per = max(1, CHUNK_BYTES // (s.channels * ih * iw * 2))  # images in one product
        try:
            with torch.jit.optimized_execution(False):  # the ops as written: no fusion
                tensor = self._one_call(
                    datas, read.value, self.device, self._decode_scripted, consumer, wy, wx,
                    (ih, iw) != (s.height, s.width), per, padded, self._add, self._mul,
                    s.color_order == "BGR", s.dtype == "uint8", self.dtype, s.layout == "NHWC",
                    self.channels_last)
        except (RuntimeError, torch.jit.Error) as exc:
            if consumer is not None:  # the script may have left the decode stream current
                torch.cuda.set_stream(consumer)
            log.debug("one-call preparation failed (%s); preparing the batch eagerly",
                      str(exc).strip().splitlines()[-1][:300])
            return None
        self.counts["nvjpeg"] += len(frames)
        self.counts["one_call"] += 1
        return tensor

    # -- decoding -----------------------------------------------------------------------------

    def _decode_all(self, frames: list[Frame],
                    ) -> tuple[dict[int, Any], list[tuple[int, Exception]]]:
        images: dict[int, Any] = {}
        bad: list[tuple[int, Exception]] = []
        # (index, pixels, "bgr"|"rgb"|"gray"|"rgba", or a Bayer mosaic's pattern)
        host: list[tuple[int, np.ndarray, str]] = []
        skip: set[int] = set()
        for i, f in enumerate(frames):  # a frame whose resize is refused fails alone, undecoded
            try:
                geometry(self.spec, f.height, f.width)
            except VisionServeError as exc:
                bad.append((i, exc))
                skip.add(i)
        jpegs = [i for i, f in enumerate(frames)
                 if f.kind == "jpeg" and i not in skip
                 and not host_decoded(f.data)]  # a JPEG frame is its bytes
        for i, img in self._nvjpeg(frames, jpegs).items():
            if img is None:
                self.counts["fallback"] += 1
                self._host_decode(i, frames[i], host, bad)
            else:
                images[i] = img
        done = set(jpegs) | skip
        for i, f in enumerate(frames):
            if i in done:
                continue
            if f.kind == "raw":
                px = f.data
                assert isinstance(px, np.ndarray)
                host.append((i, px, f.bayer or {1: "gray", 3: "rgb", 4: "rgba"}[px.shape[2]]))
                self.counts["raw"] += 1
            else:
                self._host_decode(i, f, host, bad)
        if host:
            uploaded = self._upload([h[1] for h in host])
            for (i, _px, order), t in zip(host, uploaded):
                images[i] = self._canonical(t, order)
        bad.sort(key=lambda b: b[0])
        return images, bad

    def _host_decode(self, i: int, frame: Frame, host: list, bad: list) -> None:
        try:
            px = imaging.decode(frame, self.spec.channels)
        except InvalidInput as exc:
            bad.append((i, exc))
            return
        self.counts["cpu_decoded"] += 1
        host.append((i, px, "gray" if px.ndim == 2 else "bgr"))

    def _nvjpeg(self, frames: list[Frame], idx: list[int]) -> dict[int, Any]:
        """index -> (C,H,W) uint8 on the device (RGB or grey), or None where decoding failed."""
        if not idx:
            return {}
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg

        mode = ImageReadMode.GRAY if self.spec.channels == 1 else ImageReadMode.RGB
        datas = [torch.frombuffer(frames[i].data, dtype=torch.uint8) for i in idx]
        result: dict[int, Any] = {}
        consumer = torch.cuda.current_stream(self.device) if self.cuda else None
        ctx = torch.cuda.stream(self.decode_stream) if self.decode_stream is not None \
            else contextlib.nullcontext()
        with ctx, warnings.catch_warnings():
            # torchvision >= 0.29 warns that decode_jpeg is deprecated
            warnings.simplefilter("ignore")
            try:
                result = dict(zip(idx, decode_jpeg(datas, mode=mode, device=self.device)))
                self.counts["nvjpeg"] += len(idx)
            except RuntimeError as exc:
                log.debug("batched JPEG decode failed (%s); decoding one by one", exc)
                for i, d in zip(idx, datas):
                    try:
                        result[i] = decode_jpeg([d], mode=mode, device=self.device)[0]
                        self.counts["nvjpeg"] += 1
                    except RuntimeError:
                        result[i] = None
        if self.decode_stream is not None and consumer is not None:
            consumer.wait_stream(self.decode_stream)
            for img in result.values():
                if img is not None:
                    img.record_stream(consumer)
        return result

    def _upload(self, arrays: list[np.ndarray]) -> list[Any]:
        import torch

        if self.pool is not None:
            return self.pool.upload(arrays, self.device, self.stream)
        return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]

    def _canonical(self, t: Any, order: str) -> Any:
        """Host-layout uint8 HxW[xC] -> (C,H,W), C=3 in RGB order or C=1 grey, for the model;
        ``order`` a Bayer pattern: an ``HxWx1`` mosaic, demosaiced to RGB first."""
        import torch

        if order in BAYER_PATTERNS:
            t, order = demosaic_bilinear(t[:, :, 0], order), "rgb"
        if t.dim() == 2:
            t = t.unsqueeze(-1)
        t = t.permute(2, 0, 1)
        if self.spec.channels == 1:
            if order == "gray":
                return t
            r, g, b = (t[2], t[1], t[0]) if order == "bgr" else (t[0], t[1], t[2])
            y = (r.int() * _GRAY[0] + g.int() * _GRAY[1] + b.int() * _GRAY[2] + (1 << 13)) >> 14
            return y.to(torch.uint8).unsqueeze(0)
        if order == "gray":
            return t.expand(3, -1, -1)
        if order == "bgr":
            return t.flip(0)
        return t[:3]

    # -- geometry, colour, normalisation ------------------------------------------------------

    def _assemble(self, images: list[Any], padded: int) -> Any:
        """The model's input from the decoded (C,H,W) images; ``padded`` rows (the rest zeros).

        Every torch call here makes the prep thread give up the interpreter and wait for it
        again, which under load is a wait behind the event loop: so the common case, one frame
        size filling the batch, resized to the whole input in one product, goes from the product
        to the normalised tensor without a staging buffer (about 8 calls a batch, not 13)."""
        import torch

        from . import onecall

        s = self.spec
        c, h, w = s.channels, s.height, s.width
        groups: dict[tuple[int, int], list[int]] = {}
        for row, img in enumerate(images):
            groups.setdefault((int(img.shape[1]), int(img.shape[2])), []).append(row)
        pix: Any = None  # staging buffer: several sizes, padding rows, letterbox or crop offsets
        for (ih, iw), rows in groups.items():
            nh, nw, y0, x0, cy, cx = geometry(s, ih, iw)
            mode = resize_modes(s.interpolation, (ih, iw), (nh, nw))
            wy = self._w(ih, nh, mode, cy, min(nh, h) if s.resize == "center_crop" else nh)
            wx = self._w(iw, nw, mode, cx, min(nw, w) if s.resize == "center_crop" else nw).T
            oh, ow = wy.shape[0], wx.shape[1]
            per = max(1, CHUNK_BYTES // (c * ih * iw * 2))
            whole = len(rows) == padded <= per and (oh, ow) == (h, w)
            if pix is None and not whole:
                pix = torch.zeros((padded, c, h, w), dtype=torch.float32, device=self.device)
            if s.resize == "letterbox" and (oh, ow) != (h, w):
                pix[rows] = float(s.pad_value)
            for k in range(0, len(rows), per):
                part = rows[k:k + per]
                out = onecall.resized([images[r] for r in part], wy, wx, (ih, iw) != (oh, ow))
                if whole:
                    pix = out
                elif part[-1] - part[0] == len(part) - 1:  # consecutive rows: a view
                    pix[part[0]:part[-1] + 1, :, y0:y0 + oh, x0:x0 + ow].copy_(out)
                else:
                    pix[part, :, y0:y0 + oh, x0:x0 + ow] = out.float()
        if pix is None:  # no images at all
            pix = torch.zeros((padded, c, h, w), dtype=torch.float32, device=self.device)
        return onecall.finish(pix, self._add, self._mul, s.color_order == "BGR",
                              s.dtype == "uint8", self.dtype, s.layout == "NHWC",
                              self.channels_last)

    def _w(self, n_in: int, n_out: int, mode: str, start: int, count: int) -> Any:
        """(count, n_in) weights on the device: rows ``start:start+count`` (the crop window) of
        :func:`axis_weights`; cached up to :data:`WEIGHT_CACHE_BYTES`. Columns use it transposed."""
        key = (n_in, n_out, mode, start, count)
        t = self._weights.get(key)
        if t is not None:
            self._weights.move_to_end(key)
            return t
        import torch

        m = axis_weights(n_in, n_out, mode, start, count)
        t = torch.from_numpy(m).to(self.device, self._mm_dtype)
        size = t.numel() * t.element_size()
        while self._weights and self._weight_bytes + size > WEIGHT_CACHE_BYTES:
            _, old = self._weights.popitem(last=False)
            self._weight_bytes -= old.numel() * old.element_size()
        self._weights[key] = t
        self._weight_bytes += size
        return t


def torch_sync(stream: Any) -> None:
    """Wait for ``stream`` (or the current stream): never the whole device."""
    import torch

    (stream or torch.cuda.current_stream()).synchronize()
