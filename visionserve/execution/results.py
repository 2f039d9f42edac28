"""What an executor hands on: a frame's answer (:class:`FrameResult`), a batch's record
(:class:`BatchRecord`), a batch run in a worker process (:class:`RanBatch`), the preparation's
contract (:data:`Prepare`), and the two rules every executor applies: the padded batch size and
what counts as a device fault."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..imaging import Frame
from ..tasks.base import pickled_as_fields

#: a prepared batch: (its input tensor, the frames in it by index, (index, error) of each frame
#: that failed preparation, alone)
Prepared = tuple[Any, list[int], list[tuple[int, Exception]]]
#: prepare(frames, padded) -> the batch prepared, padded to ``padded`` rows
Prepare = Callable[[list[Frame], int], Prepared]


@pickled_as_fields  # to a front-end process, from the engine's loop
@dataclass(frozen=True, slots=True)
class FrameResult:
    """A frame's answer, the envelope every task shares; always in time (``deadline_met`` is
    kept for the wire: always true). ``result`` is the task's own (``Task.postprocess``): the
    front ends have the model's task render it."""

    verdict: str
    result: Any
    batch_size: int
    queue_ms: float
    compute_ms: float
    total_ms: float
    deadline_met: bool


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """What one batch did, for statistics and metrics (sent to the loop thread)."""

    size: int
    padded: int
    ok: int  # answered with a verdict
    failed: int  # failed in preprocessing (bad image, fault)
    late: int  # answered LATE: the deadline passed during decode, or before the verdict was ready
    queue_s: tuple[float, ...]
    prep_s: float
    infer_s: float
    post_s: float


@dataclass(frozen=True, slots=True)
class RanBatch:
    """A batch prepared and run in a process of its own (``--gpu-batch-processes``,
    :mod:`.worker`): the model's outputs (host arrays, a row per frame in ``good``, in order,
    then padding), the frames that failed preparation (each alone) and the time its model took
    there."""

    outputs: dict[str, Any]
    good: list[int]
    bad: list[tuple[int, Exception]]
    padded: int
    infer_s: float


def padded_size(n: int, preferred: tuple[int, ...]) -> int:
    for p in preferred:
        if p >= n:
            return p
    return n


# Messages of errors raised by torch / onnxruntime when the device itself failed (a sticky CUDA
# error: the context is unusable, further results would be garbage). Out-of-memory is not one.
_DEVICE_FAULTS = ("CUDA error", "CUDA driver error", "CUDA failure", "cuDNN error", "CUDNN failure",
                  "CUBLAS_STATUS_EXECUTION_FAILED", "CUBLAS failure", "illegal memory access",
                  "device-side assert", "unspecified launch failure", "uncorrectable ECC error",
                  "GPU has fallen off the bus")


def device_fault(exc: BaseException) -> bool:
    """True when ``exc`` means the device is broken (as opposed to a bad input or OOM)."""
    if type(exc).__name__ == "AcceleratorError":  # torch >= 2.8 raises this for CUDA errors
        return True
    text = str(exc)
    return "out of memory" not in text and any(k in text for k in _DEVICE_FAULTS)
