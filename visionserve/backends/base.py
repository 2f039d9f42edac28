"""The small interface every backend implements, and lookup by name (imported lazily)."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from ..config import ModelConfig

# runtime.backend in model.toml -> (module, class, model file inside the version folder)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "onnxruntime": ("visionserve.backends.onnx", "OnnxBackend", "model.onnx"),
    "torch": ("visionserve.backends.torch", "TorchBackend", "model.pt2"),
}


class Backend(ABC):
    """Load on a device, warm up, run batches, close. Called from one runner thread only."""

    #: the device this backend runs on, e.g. "cpu" or "cuda:0"
    device: str = "cpu"

    @abstractmethod
    def load(self, path: Path, config: ModelConfig, device: str) -> None:
        """Load the model file ``path`` for ``config`` onto ``device``."""

    @abstractmethod
    def warmup(self, batch_sizes: tuple[int, ...]) -> None:
        """Run every batch size once (arenas grown, kernels chosen, graphs captured)."""

    @abstractmethod
    def run(self, batch: np.ndarray) -> np.ndarray:
        """Input tensor (N, ...) in the model's layout and dtype -> raw output (N, num_labels)."""

    def close(self) -> None:
        """Release sessions and device memory."""

    def describe(self) -> dict[str, str]:
        """What the backend chose (providers, precision): for logs and model metadata."""
        return {"device": self.device}


def model_file(backend: str) -> str:
    return BACKENDS[backend][2]


def create(backend: str) -> Backend:
    module_name, class_name, _ = BACKENDS[backend]
    module = importlib.import_module(module_name)
    return getattr(module, class_name)()


def input_shape(config: ModelConfig, batch: int) -> tuple[int, ...]:
    s = config.input
    if s.layout == "NCHW":
        return (batch, s.channels, s.height, s.width)
    return (batch, s.height, s.width, s.channels)


NP_DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}
