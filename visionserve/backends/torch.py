"""torch backend: a ``torch.export`` program (``model.pt2``), eager on the CPU, CUDA graphs on a GPU.

On CUDA the model runs in ``runtime.precision`` (fp16/bf16; fp32 stays fp32) with channels_last
weights, on the runner's own high-priority stream. At warm-up one CUDA graph is captured per
preferred batch size, with static input and output buffers; ``run`` copies the batch into the
static input and replays the graph. A batch size without a graph (larger than the largest
preferred size) runs eagerly. The graphs share one memory pool: they are replayed one at a time
on one stream and each output is copied out before the next replay, so sharing is safe.

Inputs may be numpy arrays (the CPU preprocessing path, and the engine's warm-up) or torch
tensors already on the device (the GPU preprocessing path). Outputs are numpy float32, copied
through a pinned buffer and waited for with an event, never a device-wide synchronisation.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, InternalError
from . import checks
from .base import NP_DTYPES, Backend, input_shape

log = logging.getLogger(__name__)

_PRECISION = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
WARMUP_ITERS = 3  # eager runs before capture: cuDNN picks its kernels, lazy inits happen


def _declared(program: Any) -> tuple[list[checks.Dim], list[checks.Dim]] | None:
    """The first user input's and output's shapes as the exported program records them (a
    dynamic axis with its range); None when the program does not say. Its dtypes are not
    checked: the backend casts the input to the compute precision."""
    try:
        sig = program.graph_signature
        nodes = list(program.graph.nodes)
        inp = next(n for n in nodes if n.op == "placeholder" and n.name == sig.user_inputs[0])
        outs = next(n for n in nodes if n.op == "output").args[0]
        out = next(a for a in outs if getattr(a, "name", None) == sig.user_outputs[0])
        return (_dims(inp.meta["val"].shape, program.range_constraints),
                _dims(out.meta["val"].shape, program.range_constraints))
    except (AttributeError, IndexError, KeyError, StopIteration, TypeError):
        return None


def _dims(shape: Any, ranges: dict) -> list[checks.Dim]:
    dims: list[checks.Dim] = []
    for d in shape:
        if isinstance(d, int):
            dims.append(d)
            continue
        vr = ranges.get(getattr(getattr(d, "node", None), "expr", None))
        try:  # only the most: torch records 2 as the least of an axis that still takes 1
            top = int(vr.upper) if vr is not None and vr.upper.is_finite else None
        except (AttributeError, TypeError, ValueError):
            top = None
        dims.append((0, top))
    return dims


class TorchBackend(Backend):
    def __init__(self) -> None:
        self._config: ModelConfig | None = None
        self._module: Any = None
        self.stream: Any = None  # the runner's CUDA stream (None on the CPU)
        self.compute_dtype: Any = None
        self.input_dtype: Any = None  # what the model's first layer takes on this device
        self.channels_last = False
        self._graphs: dict[int, tuple[Any, Any, Any]] = {}  # bs -> (graph, static in, static out)
        self._static_in: Any = None
        self._pool: Any = None
        self._out_host: Any = None  # pinned output buffer
        self._done: Any = None  # event after the output copy
        self.eager_runs = 0
        self.graph_runs = 0

    # -- load ---------------------------------------------------------------------------------

    def load(self, path: Path, config: ModelConfig, device: str) -> None:
        from ..extras import require

        torch = require("torch", f"{path}: runtime.backend = \"torch\"")
        self._config = config
        self.device = device
        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # noqa: BLE001 - torch raises several types for a bad archive
            raise ConfigError(f"{path}: torch cannot load the exported program: {exc}") from None
        declared = _declared(program)
        if declared is not None:  # the program's own shapes, before anything moves to the device
            checks.check_declared(checks.Subject(Path(path)), config, *declared)
        module = program.module()
        cuda = device.startswith("cuda")
        if cuda:
            if not torch.cuda.is_available():
                raise ConfigError(f"{path}: device {device} asked for but torch sees no CUDA device")
            from ..gpu.memory import high_priority_stream

            self.stream = high_priority_stream(device)
            self.compute_dtype = getattr(torch, _PRECISION[config.runtime.precision])
            self.channels_last = config.input.layout == "NCHW"
        else:
            self.compute_dtype = torch.float32  # CPU: half precision is slow and inexact there
            self.channels_last = False
        self.input_dtype = torch.uint8 if config.input.dtype == "uint8" else self.compute_dtype
        try:
            module = module.to(device=torch.device(device))
            if self.compute_dtype != torch.float32:
                module = module.to(self.compute_dtype)
            if self.channels_last:
                module = module.to(memory_format=torch.channels_last)
        except Exception as exc:  # noqa: BLE001 - any failure here is the model's or the device's
            raise ConfigError(f"{path}: cannot move the model to {device} / "
                              f"{config.runtime.precision}: {exc}") from None
        self._module = module
        log.info("torch loaded %s on %s (%s%s)", path, device, config.runtime.precision
                 if cuda else "fp32", ", channels_last" if self.channels_last else "")

    # -- warm-up: CUDA graphs -----------------------------------------------------------------

    def warmup(self, batch_sizes: tuple[int, ...]) -> None:
        import torch

        assert self._config is not None
        if self.stream is None:
            for bs in batch_sizes:
                self.run(np.zeros(input_shape(self._config, bs), dtype=NP_DTYPES[self._config.input.dtype]))
            return
        top = max(batch_sizes)
        shape = input_shape(self._config, top)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        with torch.cuda.stream(self.stream), torch.inference_mode():
            self._static_in = torch.zeros(shape, dtype=self.input_dtype, device=self.device
                                          ).contiguous(memory_format=fmt)
            self._out_host = torch.empty((top, len(self._config.output.labels)), dtype=torch.float32,
                                         pin_memory=True)
            self._done = torch.cuda.Event()
            # Warm-up iterations on a side stream, as torch.cuda.graphs recommends: lazy
            # initialisation and cuDNN autotuning must not happen inside a capture.
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(self.stream)
            with torch.cuda.stream(side):
                for bs in batch_sizes:
                    for _ in range(WARMUP_ITERS):
                        self._module(self._static_in[:bs])
            self.stream.wait_stream(side)
            # Largest first: later (smaller) captures reuse the shared pool's blocks.
            for bs in sorted(batch_sizes, reverse=True):
                graph = torch.cuda.CUDAGraph()
                static_in = self._static_in[:bs]
                # thread_local: other runners' threads may touch CUDA while this one captures
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    # the float32 cast is part of the graph: no temporary at fetch time
                    static_out = self._module(static_in).float()
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[bs] = (graph, static_in, static_out)
            self.stream.synchronize()
            # replay each once so a broken capture fails here, not on the first request
            for bs in batch_sizes:
                self._replay(bs, None)
            self.stream.synchronize()
        # the eager warm-up's activations were cached for the side stream, where nothing will
        # reuse them; the graphs' private pool is not affected
        torch.cuda.empty_cache()
        log.info("torch captured CUDA graphs for batch sizes %s", sorted(self._graphs))

    # -- run ----------------------------------------------------------------------------------

    def run(self, batch: Any) -> np.ndarray:
        import torch

        assert self._module is not None
        n = int(batch.shape[0])
        if self.stream is None:
            with torch.inference_mode():
                x = torch.from_numpy(np.ascontiguousarray(batch)) if isinstance(batch, np.ndarray) \
                    else batch
                self.eager_runs += 1
                return self._module(x.to(self.input_dtype)).float().numpy()
        try:
            with torch.cuda.stream(self.stream), torch.inference_mode():
                x = self._to_device(batch)
                if n in self._graphs:
                    return self._replay(n, x)
                return self._eager(x)
        except torch.cuda.OutOfMemoryError as exc:
            raise InternalError(f"GPU out of memory running a batch of {n}: {exc}") from None

    def _to_device(self, batch: Any) -> Any:
        import torch

        if isinstance(batch, np.ndarray):
            # the engine's warm-up and CPU-prepared batches: pageable, rare on the GPU path
            return torch.from_numpy(np.ascontiguousarray(batch)).to(self.device, non_blocking=False)
        return batch

    def _replay(self, bs: int, x: Any) -> np.ndarray:
        graph, static_in, static_out = self._graphs[bs]
        if x is not None:
            static_in.copy_(x)  # casts dtype and layout on the device
        graph.replay()
        self.graph_runs += 1
        return self._fetch(static_out)

    def _eager(self, x: Any) -> np.ndarray:
        import torch

        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        self.eager_runs += 1
        return self._fetch(self._module(x.to(self.input_dtype)).float())

    def _fetch(self, out: Any) -> np.ndarray:
        n = int(out.shape[0])
        host = self._out_host[:n] if self._out_host is not None and n <= self._out_host.shape[0] \
            else None
        if host is None:
            return out.float().cpu().numpy()
        host.copy_(out, non_blocking=True)
        self._done.record(self.stream)
        self._done.synchronize()
        return host.numpy().copy()

    def close(self) -> None:
        self._graphs.clear()
        self._module = None
        self._static_in = None
        self._pool = None

    def describe(self) -> dict[str, str]:
        cfg = self._config
        info = {"device": self.device, "backend": "torch"}
        if cfg is not None:
            info["precision"] = cfg.runtime.precision if self.stream is not None else "fp32"
        if self._graphs:
            info["cuda_graphs"] = ",".join(str(b) for b in sorted(self._graphs))
        if self.channels_last:
            info["memory_format"] = "channels_last"
        return info
