"""A batch of JPEGs of one size prepared in one call that does not hold the interpreter.

Every torch call from Python releases the interpreter and takes it back. In the serving process
taking it back is a wait behind the busy event loop, up to a switch interval each time (docs/
gpu.md, "the next limit"): the eager preparation of 32 JPEGs made about 40 such calls (one per
``record_stream``, the decode, the stream wait, the resize and normalisation steps), and took
2-3 ms alone but 30-35 ms beside one busy Python thread. The function below is TorchScript: the
whole preparation - nvJPEG decode on the decode stream, the instance stream's wait for it, the
images marked as used on the instance stream, resize products, rounding, padding rows, colour
order, normalisation, dtype and layout - runs as one call, with the interpreter released for all
of it.

The arithmetic is shared with the eager path (``TorchPreprocessor._assemble`` calls
:func:`resized` and :func:`finish` from Python), so the two give identical tensors
(tests/unit/test_gpu_memory.py). It covers the common case only: every frame a JPEG for nvJPEG,
all of one size, resized to the whole input (stretch, centre crop, or a letterbox that fits).
Anything else - a PNG or raw frame, two frame sizes, letterbox bars, a JPEG nvJPEG refuses -
takes the eager path, which falls back per frame.

This module has no ``from __future__ import annotations``: TorchScript reads the annotations.
"""

import logging
import threading
import warnings
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_compiled: Any = None
_failed = False


def prepare_jpegs(datas: list[torch.Tensor], mode: int, device: torch.device,
                  decode_stream: Optional[torch.classes.cuda.Stream],  # noqa: UP045
                  consumer: torch.Stream | None,
                  wy: torch.Tensor, wx: torch.Tensor, resize: bool, per: int, padded: int,
                  add: torch.Tensor, mul: torch.Tensor, bgr: bool, as_uint8: bool,
                  dtype: torch.dtype, nhwc: bool, channels_last: bool) -> torch.Tensor:
    """The model's input (``padded`` rows) from ``datas``, each a JPEG's bytes (uint8, CPU).

    On CUDA the caller makes the instance stream current (``consumer``, the same stream); nvJPEG
    decodes into blocks of ``decode_stream``'s pool (it does not wait for the current stream,
    so the images must not come from the instance stream's pool), the instance stream waits
    for the decode stream, and the images are marked as used on it so their blocks are reused
    only once it is past them. ``per``: images resized in one product (the working copy's
    bound, ``CHUNK_BYTES``)."""
    if device.type == "cuda":
        if decode_stream is not None:
            current = torch.cuda.current_stream(device.index)
            with torch.cuda.stream(decode_stream):
                images = torch.ops.image.decode_jpegs_cuda(datas, mode, device)
            current.wait_stream(decode_stream)
        else:
            images = torch.ops.image.decode_jpegs_cuda(datas, mode, device)
        if consumer is not None:
            for img in images:
                img.record_stream(consumer)
    else:
        images = [torch.ops.image.decode_jpeg(d, mode, False) for d in datas]
    parts: list[torch.Tensor] = []
    for k in range(0, len(images), per):
        parts.append(resized(images[k:k + per], wy, wx, resize))
    pix = parts[0] if len(parts) == 1 else torch.cat(parts)
    n = pix.shape[0]
    if padded > n:
        shape = pix.shape
        pad = torch.zeros([padded - n, shape[1], shape[2], shape[3]], dtype=pix.dtype,
                          device=pix.device)
        pix = torch.cat([pix, pad])
    return finish(pix, add, mul, bgr, as_uint8, dtype, nhwc, channels_last)


# The two steps below are the eager path's too (``TorchPreprocessor._assemble`` calls them from
# Python): one definition of the arithmetic, scripted here and run op by op there.

def resized(images: list[torch.Tensor], wy: torch.Tensor, wx: torch.Tensor,
            resize: bool) -> torch.Tensor:
    """(C,H,W) uint8 images of one size -> ``wy @ img @ wx`` in ``wy``'s dtype, rounded to
    integers like OpenCV's uint8 result (fp16 holds every integer to 255 exactly);
    ``resize=False``: the frames are the input's size, the weights would be the identity."""
    x = torch.stack(images).to(wy.dtype)
    if resize:
        x = torch.matmul(wy, torch.matmul(x, wx))
    return x.round_().clamp_(0, 255)


def finish(pix: torch.Tensor, add: torch.Tensor, mul: torch.Tensor, bgr: bool, as_uint8: bool,
           dtype: torch.dtype, nhwc: bool, channels_last: bool) -> torch.Tensor:
    """Pixels (N,C,H,W; RGB or grey) -> the model's tensor: colour order, normalisation
    (``pix * mul + add``), dtype and layout (NHWC, or NCHW in channels_last memory)."""
    if bgr:
        pix = pix.flip(1)
    if not as_uint8 and channels_last and not nhwc:
        return torch.addcmul(add, pix, mul).to(dtype=dtype, memory_format=torch.channels_last)
    out = pix.to(torch.uint8) if as_uint8 else torch.addcmul(add, pix, mul).to(dtype)
    if nhwc:
        return out.permute(0, 2, 3, 1).contiguous()
    if channels_last:
        return out.contiguous(memory_format=torch.channels_last)
    return out


def compiled() -> Any:
    """The scripted :func:`prepare_jpegs`, compiled once per process; None where TorchScript or
    torchvision's image ops are missing (logged once; the eager path serves)."""
    global _compiled, _failed
    with _lock:
        if _compiled is None and not _failed:
            try:
                import torchvision.io.image  # noqa: F401 -- registers torch.ops.image

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch >= 2.10: torch.jit is deprecated
                    _compiled = torch.jit.script(prepare_jpegs)
            except Exception as exc:  # noqa: BLE001 -- any failure: serve with the eager path
                _failed = True
                log.warning("GPU preprocessing in one call is unavailable (%s); each batch "
                            "takes the eager path", exc)
        return _compiled


def decode_stream(device: torch.device) -> tuple[Any, Any]:
    """A stream for nvJPEG's output blocks: (the TorchScript handle, the same stream as a
    ``torch.cuda.Stream``, for the eager path and the budget's pool reservation)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    scripted = torch.classes.cuda.Stream(torch.device("cuda", index), 0)
    stream = torch.cuda.Stream(stream_id=scripted.id(), device_index=index,
                               device_type=1)  # c10::DeviceType::CUDA
    return scripted, stream
