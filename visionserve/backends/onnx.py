"""onnxruntime backend: CPU execution provider, or CUDA when the runner's device is a GPU."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError
from .base import NP_DTYPES, Backend, input_shape

log = logging.getLogger(__name__)


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
        opts.log_severity_level = 3  # quiet: onnxruntime warns about missing CUDA on CPU boxes
        providers: list = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            # The process is pinned (CUDA_VISIBLE_DEVICES holds one GPU), so it is device 0 here.
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": 0}))
        try:
            self._session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
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
        log.info("onnxruntime loaded %s on %s (providers %s)", path, device, self.providers)

    def warmup(self, batch_sizes: tuple[int, ...]) -> None:
        assert self._config is not None
        dtype = NP_DTYPES[self._config.input.dtype]
        for bs in batch_sizes:
            self.run(np.zeros(input_shape(self._config, bs), dtype=dtype))

    def run(self, batch: np.ndarray) -> np.ndarray:
        assert self._session is not None
        return self._session.run([self._out_name], {self._in_name: batch})[0]

    def close(self) -> None:
        self._session = None

    def describe(self) -> dict[str, str]:
        return {"device": self.device, "backend": "onnxruntime", "providers": ",".join(self.providers)}
