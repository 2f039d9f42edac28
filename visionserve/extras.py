"""Optional extras: what a feature needs that the CPU core install leaves out, and how to get it.

The core install (`pip install visionserve`) serves ONNX models on the CPU with onnxruntime and
never imports torch. torch and torchvision come with the ``gpu`` extra (on PyPI, torch for x86-64
Linux is the CUDA build: about 4 GB of nvidia-* wheels), and with ``train``. Code that needs them
imports them through :func:`require`, so a missing extra is a one-line error naming the extra
instead of a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType

from .errors import ConfigError

log = logging.getLogger(__name__)

#: top-level module -> the extra that installs it
EXTRA_OF = {"torch": "gpu", "torchvision": "gpu", "onnx": "train", "onnxscript": "train",
            "locust": "load", "psycopg": "records-pg", "minio": "s3", "pyarrow": "records-parquet",
            "gi": "cameras"}

#: what each extra is for, said in the message
PURPOSE = {"gpu": "torch and torchvision; from PyPI with their CUDA libraries, about 4 GB",
           "train": "training and exporting models",
           "load": "the load-test tools",
           "records-pg": "the PostgreSQL record store (psycopg 3)",
           "s3": "image capture to an S3-compatible bucket (the MinIO client)",
           "records-parquet": "records export to Parquet (pyarrow)",
           "cameras": "gige:// cameras: PyGObject, built against Debian's libgirepository1.0-dev "
                      "and libcairo2-dev"}


def install_hint(extra: str) -> str:
    return (f"pip install 'visionserve[{extra}]' -c requirements/constraints.txt "
            f"({PURPOSE.get(extra, extra)}; from a checkout: pip install -e '.[{extra}]' ...)")


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise :class:`ConfigError` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.partition(".")[0]
        if exc.name is not None and exc.name.partition(".")[0] != top:
            raise  # the module is there but one of its own imports is broken: show that
        extra = EXTRA_OF.get(top, "gpu")
        raise ConfigError(f"{feature} needs {top}, which this install does not have: "
                          f"{install_hint(extra)}") from None


def missing(module: str) -> bool:
    """True when ``module`` cannot be imported here; it is looked up, not imported (torch must
    not load before the process is pinned to its GPU)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def gpu_without_torch(resolved, cpu):
    """A GPU was chosen but torch, which the GPU path runs on (CUDA libraries, memory budget,
    nvJPEG decode), is not installed: ``auto`` takes the CPU (``cpu()``) with a warning, a named
    GPU is a :class:`ConfigError`. Both name the extra."""
    if not missing("torch"):
        return resolved
    gpu = f"GPU {resolved.gpu.name} ({resolved.gpu.uuid})" if resolved.gpu else "a GPU"
    if resolved.spec == "auto":
        log.warning("device auto: %s is present, but this is the CPU install (no torch), so the "
                    "server runs on the CPU. To serve on the GPU: %s", gpu, install_hint("gpu"))
        return cpu()
    raise ConfigError(f"device {resolved.spec!r} is {gpu}, but this is the CPU install: serving "
                      f"on a GPU needs torch. {install_hint('gpu')}; or --device cpu")
