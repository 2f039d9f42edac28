"""onnxruntime backend: CPU execution provider, or CUDA when the runner's device is a GPU."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError
from . import checks
from .base import NP_DTYPES, Backend, input_shape

log = logging.getLogger(__name__)


def _dims(shape) -> list[checks.Dim]:
    """onnxruntime's declared shape: a number for a fixed axis, a name or None for a dynamic one."""
    return [d if isinstance(d, int) and d > 0 else checks.ANY for d in shape]


def _dtype(onnx_type: str) -> str:
    """``tensor(float)`` -> ``float32``, ``tensor(uint8)`` -> ``uint8`` (numpy names)."""
    name = onnx_type.removeprefix("tensor(").removesuffix(")")
    return {"float": "float32", "double": "float64"}.get(name, name)


class OnnxBackend(Backend):
    def __init__(self) -> None:
        self._session = None
        self._in_name = ""
        self._out_name = ""
        self._config: ModelConfig | None = None
        self.providers: list[str] = []

    def load(self, path: Path, config: ModelConfig, device: str) -> None:
        import onnxruntime as ort

        self._config = config
        self.device = device
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if config.runtime.intra_op_threads:
            opts.intra_op_num_threads = config.runtime.intra_op_threads
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
            self._session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own Fail/InvalidGraph types
            raise ConfigError(f"{path}: onnxruntime cannot load the model: {exc}") from None
        self.providers = self._session.get_providers()
        if device.startswith("cuda") and "CUDAExecutionProvider" not in self.providers:
            raise ConfigError(f"{path}: CUDA execution provider unavailable; providers: {self.providers}")
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = [o.name for o in self._session.get_outputs()]
        self._in_name = config.input.tensor_name or next(iter(inputs))
        self._out_name = config.output.tensor_name or outputs[0]
        if self._in_name not in inputs:
            raise ConfigError(f"{path}: input.tensor_name {self._in_name!r} not in model inputs {list(inputs)}")
        if self._out_name not in outputs:
            raise ConfigError(f"{path}: output.tensor_name {self._out_name!r} not in model outputs {outputs}")
        out = next(o for o in self._session.get_outputs() if o.name == self._out_name)
        inp = inputs[self._in_name]
        checks.check_declared(checks.Subject(Path(path)), config, _dims(inp.shape), _dims(out.shape),
                              _dtype(inp.type), _dtype(out.type))
        log.info("onnxruntime loaded %s on %s (providers %s)", path, device, self.providers)

    def warmup(self, batch_sizes: tuple[int, ...]) -> None:
        assert self._config is not None
        dtype = NP_DTYPES[self._config.input.dtype]
        for bs in batch_sizes:
            self.run(np.zeros(input_shape(self._config, bs), dtype=dtype))

    def run(self, batch: np.ndarray) -> np.ndarray:
        assert self._session is not None
        if not isinstance(batch, np.ndarray):  # a torch tensor from the GPU preprocessing
            return self._run_bound(batch)
        return self._session.run([self._out_name], {self._in_name: batch})[0]

    # -- CUDA: budget, the runner's stream, IOBinding (device buffers, no host round trip) ------

    stream = None  # the runner's high-priority CUDA stream, when torch is there to make one
    input_dtype = None  # torch dtype of the input, for the GPU preprocessing

    def _cuda_options(self, config: ModelConfig, device: str) -> dict:
        opts: dict = {"device_id": 0, "cudnn_conv_algo_search": "HEURISTIC",
                      "arena_extend_strategy": "kSameAsRequested"}
        if config.runtime.gpu_memory_budget is not None:
            # the engine put this instance's onnxruntime share here (gpu/memory.plan_budget)
            from ..config import parse_bytes

            opts["gpu_mem_limit"] = str(parse_bytes(config.runtime.gpu_memory_budget))
        try:
            import torch

            if torch.cuda.is_available():
                from ..gpu.memory import high_priority_stream

                self.stream = high_priority_stream(device)
                self.input_dtype = getattr(torch, config.input.dtype)
                # onnxruntime's kernels go on the runner's stream, behind its preprocessing
                opts["user_compute_stream"] = str(self.stream.cuda_stream)
        except ImportError:
            pass
        return opts

    def _run_bound(self, x) -> np.ndarray:
        import torch

        assert self._session is not None and self._config is not None
        n = int(x.shape[0])
        with torch.cuda.stream(self.stream):
            out = torch.empty((n, len(self._config.output.labels)), dtype=torch.float32, device=x.device)
            x = x.contiguous()
            # the input was written on this stream: wait for it (the stream only, not the device)
            self.stream.synchronize()
            binding = self._session.io_binding()
            binding.bind_input(self._in_name, "cuda", 0, NP_DTYPES[self._config.input.dtype],
                               tuple(x.shape), x.data_ptr())
            binding.bind_output(self._out_name, "cuda", 0, np.float32, tuple(out.shape), out.data_ptr())
            self._session.run_with_iobinding(binding)
            return out.cpu().numpy()

    def close(self) -> None:
        self._session = None

    def describe(self) -> dict[str, str]:
        return {"device": self.device, "backend": "onnxruntime", "providers": ",".join(self.providers)}
