"""onnxruntime backend: CPU execution provider, or CUDA when the runner's device is a GPU."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError
from ..threads import usable_cpus
from . import checks
from .base import NP_DTYPES, Backend, Outputs, input_shape

log = logging.getLogger(__name__)


def _dims(shape) -> list[checks.Dim]:
    """onnxruntime's declared shape: a number for a fixed axis, a name or None for a dynamic one."""
    return [d if isinstance(d, int) and d > 0 else checks.ANY for d in shape]


def _dtype(onnx_type: str) -> str:
    """``tensor(float)`` -> ``float32``, ``tensor(uint8)`` -> ``uint8`` (numpy names)."""
    name = onnx_type.removeprefix("tensor(").removesuffix(")")
    return {"float": "float32", "double": "float64"}.get(name, name)


class OnnxBackend(Backend):
    model_file = "model.onnx"
    platform = "onnxruntime_onnx"
    device_memory = "arena"  # its CUDA arena, capped by gpu_mem_limit

    def __init__(self) -> None:
        self._session: Any = None  # an onnxruntime.InferenceSession once loaded (no stubs)
        self._in_name = ""
        self._out_names: list[str] = []
        self.providers: list[str] = []

    def load(self, path: Path, config: ModelConfig, device: str) -> None:
        import onnxruntime as ort

        self.config = config
        self.device = device
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if config.runtime.intra_op_threads:
            opts.intra_op_num_threads = config.runtime.intra_op_threads
        elif usable_cpus() < (os.cpu_count() or 1):
            # onnxruntime sizes its pool to the machine's cores, not to those the server was given
            opts.intra_op_num_threads = usable_cpus()
        opts.inter_op_num_threads = 1
        if not device.startswith("cuda") and os.environ.get("VISIONSERVE_ORT_SPIN", "0") != "1":
            # Idle intra-op threads spin by default: on a small edge CPU that burns the cores the
            # decode threads and the event loop need. They sleep instead unless asked otherwise.
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.log_severity_level = 3  # quiet: onnxruntime warns about missing CUDA on CPU boxes
        providers: list = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            # CUDA/cuDNN come from the nvidia-* wheels torch installs: load them before the EP looks
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()
            # The process is pinned (CUDA_VISIBLE_DEVICES holds one GPU), so it is device 0 here.
            providers.insert(0, ("CUDAExecutionProvider", self._cuda_options(config, device)))
        try:
            session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own Fail/InvalidGraph types
            raise ConfigError(f"{path}: onnxruntime cannot load the model: {exc}") from None
        self._session = session
        self.providers = session.get_providers()
        if device.startswith("cuda") and "CUDAExecutionProvider" not in self.providers:
            raise ConfigError(f"{path}: CUDA execution provider unavailable; providers: "
                              f"{self.providers}")
        inputs = {i.name: i for i in session.get_inputs()}
        self._in_name = config.input.tensor_name or next(iter(inputs))
        if self._in_name not in inputs:
            raise ConfigError(f"{path}: input.tensor_name {self._in_name!r} not in model inputs "
                              f"{list(inputs)}")
        inp = inputs[self._in_name]
        checks.check_input(checks.Subject(Path(path)), config, _dims(inp.shape), _dtype(inp.type))
        self.outputs = tuple(checks.TensorSpec(o.name, tuple(_dims(o.shape)), _dtype(o.type))
                             for o in session.get_outputs())
        self._out_names = [o.name for o in self.outputs]
        log.info("onnxruntime loaded %s on %s (providers %s)", path, device, self.providers)

    def select_outputs(self, names, on_device: bool = False) -> None:
        self._out_names = list(names) or [o.name for o in self.outputs]

    def warmup(self, batch_sizes: tuple[int, ...]) -> None:
        assert self.config is not None
        dtype = NP_DTYPES[self.config.input.dtype]
        for bs in batch_sizes:
            self.run(np.zeros(input_shape(self.config, bs), dtype=dtype))

    def run(self, batch: np.ndarray) -> Outputs:
        assert self._session is not None
        if not isinstance(batch, np.ndarray):  # a torch tensor from the GPU preprocessing
            return self._run_bound(batch)
        outs = self._session.run(self._out_names, {self._in_name: batch})
        return dict(zip(self._out_names, outs))

    # -- CUDA: budget, the runner's stream, IOBinding (device buffers, no host round trip) ------

    def _cuda_options(self, config: ModelConfig, device: str) -> dict:
        opts: dict = {"device_id": 0, "cudnn_conv_algo_search": "HEURISTIC",
                      "arena_extend_strategy": "kSameAsRequested"}
        if config.runtime.gpu_memory_budget is not None:
            # the engine put this instance's onnxruntime share here (gpu/memory.plan_budget)
            from ..config import parse_bytes

            opts["gpu_mem_limit"] = str(parse_bytes(config.runtime.gpu_memory_budget))
        try:
            import torch

            if torch.cuda.is_available():  # then it takes device tensors, on the runner's stream
                from ..gpu.memory import high_priority_stream

                self.stream = high_priority_stream(device)
                self.input_dtype = getattr(torch, config.input.dtype)
                # onnxruntime's kernels go on the runner's stream, behind its preprocessing
                opts["user_compute_stream"] = str(self.stream.cuda_stream)
        except ImportError:
            pass
        return opts

    def _run_bound(self, x) -> Outputs:
        import torch

        assert self._session is not None and self.config is not None
        with torch.cuda.stream(self.stream):
            x = x.contiguous()
            # the input was written on this stream: wait for it (the stream only, not the device)
            self.stream.synchronize()
            binding = self._session.io_binding()
            binding.bind_input(self._in_name, "cuda", 0, NP_DTYPES[self.config.input.dtype],
                               tuple(x.shape), x.data_ptr())
            for name in self._out_names:  # in onnxruntime's arena, whatever their shapes
                binding.bind_output(name, "cuda", 0)
            self._session.run_with_iobinding(binding)  # returns when its stream is done
            return dict(zip(self._out_names, binding.copy_outputs_to_cpu()))

    def close(self) -> None:
        self._session = None

    def describe(self) -> dict[str, str]:
        return {"device": self.device, "backend": "onnxruntime",
                "providers": ",".join(self.providers)}
