"""The two plug-in registries: tasks (what a model's outputs mean) and backends (what runs it).

A registry maps a name, as ``model.toml`` spells it (``task = "classification"``,
``runtime.backend = "torch"``), to a class given as ``"module:Class"``. The built-in ones are
listed here; more come from installed packages through entry points, the way pytest and
setuptools find plug-ins::

    # the plug-in package's pyproject.toml
    [project.entry-points."visionserve.tasks"]
    regression = "my_package.tasks:Regression"

Classes are imported on first use, by name: this module imports nothing of the server, so the
lowest layer (``config.py``, which validates the names) may use it.
"""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from typing import Any

log = logging.getLogger(__name__)


class Registry:
    """Names -> classes of one kind of plug-in: the built-ins, then entry points of ``group``."""

    def __init__(self, kind: str, group: str, builtins: dict[str, str]) -> None:
        self.kind = kind
        self.group = group
        self.builtins = dict(builtins)
        self._found: dict[str, str] | None = None
        self._loaded: dict[str, Any] = {}

    def _targets(self) -> dict[str, str]:
        if self._found is None:
            found = dict(self.builtins)
            for ep in metadata.entry_points(group=self.group):
                if ep.name in self.builtins:  # a package may not replace a built-in
                    log.warning("%s %r from entry point %s ignored: a built-in has that name",
                                self.kind, ep.name, ep.value)
                    continue
                found.setdefault(ep.name, ep.value)
            self._found = found
        return self._found

    def names(self) -> list[str]:
        """Built-ins first, in their order, then the installed plug-ins."""
        return list(self._targets())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._targets()

    def load(self, name: str) -> Any:
        """The class registered as ``name`` (imported now if it was not yet); KeyError if none."""
        cls = self._loaded.get(name)
        if cls is None:
            target = self._targets()[name]
            module, _, attr = target.partition(":")
            cls = importlib.import_module(module)
            for part in attr.split(".") if attr else ():
                cls = getattr(cls, part)
            self._loaded[name] = cls
        return cls

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered."""
        return (f"unknown {self.kind} {name!r}; {self.kind}s: {', '.join(self.names())} (more "
                f"come from installed packages, entry point group {self.group})")

    def refresh(self) -> None:
        """Look for entry points again (after installing a package into the running process)."""
        self._found = None


TASKS = Registry("task", "visionserve.tasks", {
    "classification": "visionserve.tasks.classification:Classification",
    "anomaly": "visionserve.tasks.anomaly:AnomalyDetection",
    "detection": "visionserve.tasks.detection:DetectionTask",
    "segmentation": "visionserve.tasks.segmentation:SegmentationTask",
})

BACKENDS = Registry("backend", "visionserve.backends", {
    "onnxruntime": "visionserve.backends.onnx:OnnxBackend",
    "torch": "visionserve.backends.torch:TorchBackend",
})
