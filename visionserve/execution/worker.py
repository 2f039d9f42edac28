"""A batch worker process (:mod:`.workers`): it prepares an instance's batches into the slots
the serving process gave it, or with a model (``--gpu-batch-processes``) prepares and runs them
and answers with the model's outputs, until the serving process closes the channel.

Run as ``python -m visionserve.execution.worker`` by :class:`~.link.WorkerLink` only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from .. import framing
from ..config import InputSpec, ModelConfig
from .protocol import SLOTS, SPEC_ENV, STAGE_BYTES, cpu_slots, encode_errors, requests
from .results import device_fault

log = logging.getLogger(__name__)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _load_model(model: dict, device: str, preferred: tuple[int, ...]) -> Any:
    """The model loaded and warmed up as the serving process loads it (its outputs on the host:
    the task reads them there)."""
    from pathlib import Path

    from .. import tasks
    from ..backends import base as backends
    from ..backends import checks

    config = ModelConfig.model_validate(model["config"])
    path = Path(model["path"])
    backend = backends.create(config.runtime.backend)
    backend.load(path, config, device)
    task = tasks.create(config)
    backend.select_outputs(task.bind(checks.Subject(path), backend.outputs), on_device=False)
    backend.warmup(preferred)
    return backend


def _prepare_into_slots(sock: socket.socket, stage: np.ndarray, prep: Any, slots: list[Any],
                        stream: Any) -> None:
    """Preparation-only workers (off in the server): each batch prepared into its slot; answered
    with its rows."""
    import torch

    for job, k, padded, frames in requests(sock, stage):
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), \
                    torch.inference_mode():
                tensor, good, bad = prep.prepare(frames, padded)
                slots[k][:tensor.shape[0]].copy_(tensor)
            if stream is not None:
                stream.synchronize()
            reply: tuple = ("done", job, int(tensor.shape[0]), good, encode_errors(bad))
        except Exception as exc:  # noqa: BLE001 - the serving process prepares it instead
            reply = ("failed", job, f"{type(exc).__name__}: {exc}")
        del frames
        framing.send(sock, reply)


def _prepare_and_run(sock: socket.socket, stage: np.ndarray, prep: Any, backend: Any) -> None:
    """``--gpu-batch-processes``: this thread prepares batch k+1 while a compute thread runs
    batch k (both on the model's stream, as the serving process's runner threads do) and
    answers with its outputs, in the order asked. A device fault (a sticky CUDA error: this
    process's context is unusable) is answered as the batch's failure, and then the worker stops
    reading: the serving process sees the channel close and runs what it had sent itself."""
    import torch

    handoff: queue.Queue = queue.Queue(maxsize=1)

    def compute() -> None:
        broken = False  # the device failed, or the serving process is gone: answer no more
        while (item := handoff.get()) is not None:
            job, outcome = item
            del item
            if broken:  # drained until the reading side ends
                continue
            failure: BaseException | None = None
            if isinstance(outcome, BaseException):
                failure = outcome
            else:
                tensor, good, bad = outcome
                try:
                    t0 = time.perf_counter()
                    outputs = backend.run(tensor)
                    reply: tuple = ("ran", job, outputs, good, encode_errors(bad),
                                    int(tensor.shape[0]), time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001 - the serving process runs it instead
                    failure = exc.with_traceback(None)
                del tensor
            del outcome
            if failure is not None:
                reply = ("failed", job, f"{type(failure).__name__}: {failure}")
            try:
                framing.send(sock, reply)
            except OSError:
                broken = True
            if failure is not None and device_fault(failure):
                log.error("the device failed (%s); this worker stops", str(failure)[:300])
                broken = True
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    thread = threading.Thread(target=compute, name="compute", daemon=True)
    thread.start()
    for job, _k, padded, frames in requests(sock, stage):
        try:
            with torch.inference_mode():
                outcome: Any = prep.prepare(frames, padded)
        except Exception as exc:  # noqa: BLE001 - the serving process prepares it instead
            outcome = exc.with_traceback(None)
        del frames
        handoff.put((job, outcome))
        del outcome
    handoff.put(None)
    thread.join(timeout=30)


def serve(spec: dict) -> int:
    """The worker's main: prepare (and with a model, run) batches until the channel closes."""
    import torch

    from ..gpu.memory import PinnedPool, cap_torch_allocator
    from ..gpu.preprocess import TorchPreprocessor

    sock = socket.socket(fileno=spec["channel_fd"])
    reader = framing.Reader(sock)
    stage = np.frombuffer(mmap.mmap(spec["stage_fd"], STAGE_BYTES * SLOTS), np.uint8)
    backend = None
    slots: list[Any] = []
    try:
        head = reader.message()
        assert head[0] == "slots", head
        device = spec["device"]
        cuda = device.startswith("cuda")
        dtype = getattr(torch, spec["dtype"])
        stream = None
        if cuda:
            torch.cuda.set_device(torch.device(device))
        if spec.get("model") is not None:
            backend = _load_model(spec["model"], device, tuple(spec["preferred"]))
            stream = backend.stream
        elif cuda:
            from ..gpu.memory import high_priority_stream

            stream = high_priority_stream(device)
            slots = [pickle.loads(b) for b in head[1]]
        else:
            template = torch.empty_strided(spec["shape"], spec["stride"], dtype=dtype)
            slots = cpu_slots(template, spec["slot_fd"])
        prep = TorchPreprocessor(
            InputSpec.model_validate_json(spec["input"]), device=device, dtype=dtype,
            max_batch=spec["max_batch"], stream=stream, channels_last=spec["channels_last"],
            pool=PinnedPool(2, spec["stage_bytes"]) if cuda else None, one_call=spec["one_call"])
        capped = 0
        if cuda:  # grows nvJPEG's and the allocator's buffers (nothing to grow on the CPU)
            prep.warmup(tuple(spec["preferred"]))
            # what it holds now, and room for one batch's preparation more: its share of the
            # server's budget, which the serving process takes off its own cap
            torch.cuda.synchronize()
            capped = int(torch.cuda.memory_reserved(device)) + int(spec["growth"])
            cap_torch_allocator(capped, device)
    except Exception as exc:  # noqa: BLE001 - said to the serving process, which goes on
        with contextlib.suppress(OSError):
            framing.send(sock, ("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    framing.send(sock, ("ready", capped))
    if backend is not None:
        _prepare_and_run(sock, stage, prep, backend)
    else:
        _prepare_into_slots(sock, stage, prep, slots, stream)
    # the serving process closed the channel: let its slots go before exiting, so that torch
    # does not warn there of CUDA tensors still shared with a process that ended
    slots.clear()
    if cuda:
        torch.cuda.synchronize()
    return 0


def main() -> int:
    spec = json.loads(os.environ.pop(SPEC_ENV))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the serving process stops it (channel closed)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s batch worker: %(message)s")
    threading.Thread(target=_watch_parent, args=(spec["parent"],), daemon=True).start()
    return serve(spec)


if __name__ == "__main__":
    sys.exit(main())
