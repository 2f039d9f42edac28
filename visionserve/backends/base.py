"""The interface every backend implements, what it declares, and lookup by name.

A backend loads one model file, warms it up and runs batches: ``run`` takes the input tensor and
returns the model's outputs by name. What the engine, the runner and the GPU path need to know
of it is declared here rather than guessed: before loading (class attributes: the model file,
the OIP platform, where its device memory comes from) and after (instance attributes: device,
stream, input dtype and memory format, static shapes, whether outputs may stay on the device,
the outputs its file declares).

Backends are named in :data:`visionserve.plugins.BACKENDS` (``runtime.backend`` in model.toml),
the one list of them; :func:`backend_class` imports one lazily.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from ..config import ModelConfig
from ..plugins import BACKENDS
from .checks import TensorSpec

#: a batch's outputs: model output name -> array (numpy; a device tensor where the backend
#: keeps outputs on the device, see ``Backend.select_outputs``), batch axis first
Outputs = dict[str, Any]


class Backend(ABC):
    """Load on a device, warm up, run batches, close. Called from one runner thread only."""

    # --- declared before loading (the repository, the GPU budget, OIP metadata) ---------------

    #: the model file this backend serves, inside a version folder
    model_file: ClassVar[str]
    #: Triton's platform name for it (OIP model metadata and configuration)
    platform: ClassVar[str]
    #: where its device memory comes from, for the GPU budget: "torch", the torch caching
    #: allocator (capped as a whole); "arena", an arena of its own, capped per instance through
    #: ``runtime.gpu_memory_budget`` of the config it loads with
    device_memory: ClassVar[Literal["torch", "arena"]] = "torch"

    # --- declared by ``load`` (the engine, the runner, the GPU preprocessing) ---------------

    #: the device it runs on, e.g. "cpu" or "cuda:0"
    device: str = "cpu"
    #: the model.toml it was loaded with
    config: ModelConfig | None = None
    #: the CUDA stream its work is queued on (the runner's); None on the CPU
    stream: Any = None
    #: the torch dtype a device input tensor must have; None: it takes numpy input only
    input_dtype: Any = None
    #: a device input in channels_last memory format saves it a copy (its layout is model.toml's
    #: ``input.layout``; numpy input is always contiguous in that layout)
    channels_last: bool = False
    #: only the warmed-up batch sizes run at full speed (CUDA graphs): batches are padded up
    static_shapes: bool = False
    #: ``run`` can leave its outputs on the device (``select_outputs(..., on_device=True)``)
    device_outputs: bool = False
    #: the model's outputs as its file declares them, in the file's order
    outputs: tuple[TensorSpec, ...] = ()

    # --- set by the engine before ``load`` ------------------------------------------------------

    #: the load runs beside serving versions (a swap): a backend whose file format is slow to
    #: read in Python reads it in a child process, so that the serving threads keep the
    #: interpreter (the torch backend; onnxruntime reads its file in C++)
    isolated: bool = False

    @property
    def takes_device_input(self) -> bool:
        """``run`` takes a torch tensor already on ``device`` (the GPU preprocessing's)."""
        return self.stream is not None and self.input_dtype is not None

    @abstractmethod
    def load(self, path: Path, config: ModelConfig, device: str) -> None:
        """Load the model file ``path`` for ``config`` onto ``device``; check its input against
        model.toml (:func:`checks.check_input`) and declare its ``outputs``."""

    def select_outputs(self, names: Sequence[str], on_device: bool = False) -> None:
        """From now on ``run`` returns only ``names`` (the outputs the task reads; none named, or
        by default: all), left on the device if ``on_device`` and ``device_outputs``. Called
        before ``warmup``."""

    @abstractmethod
    def warmup(self, batch_sizes: tuple[int, ...]) -> None:
        """Run every batch size once (arenas grown, kernels chosen, graphs captured)."""

    def example_input(self, batch: int) -> Any:
        """Zeros for a batch of ``batch`` in the form ``run`` takes, made where the model runs:
        a device tensor on the backend's stream where it takes device input, so warming a
        version up beside serving ones copies nothing from pageable host memory."""
        assert self.config is not None
        shape = input_shape(self.config, batch)
        if self.takes_device_input:
            import torch

            with torch.cuda.stream(self.stream):
                return torch.zeros(shape, dtype=self.input_dtype, device=self.device)
        return np.zeros(shape, dtype=NP_DTYPES[self.config.input.dtype])

    @abstractmethod
    def run(self, batch: Any) -> Outputs:
        """Input tensor (N, ...) in the model's layout and dtype -> outputs by name, N rows each."""

    def close(self) -> None:
        """Release sessions and device memory."""

    def describe(self) -> dict[str, str]:
        """What the backend chose (providers, precision): for logs and model metadata."""
        return {"device": self.device}


def backend_class(backend: str) -> type[Backend]:
    """The class of ``runtime.backend`` = ``backend`` (registered: model.toml was validated)."""
    return BACKENDS.load(backend)


def model_file(backend: str) -> str:
    return backend_class(backend).model_file


def create(backend: str) -> Backend:
    return backend_class(backend)()


def input_shape(config: ModelConfig, batch: int) -> tuple[int, ...]:
    s = config.input
    if s.layout == "NCHW":
        return (batch, s.channels, s.height, s.width)
    return (batch, s.height, s.width, s.channels)


NP_DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}
