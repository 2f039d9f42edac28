"""Tasks: what a model's outputs mean (classification, ...), the only place that knows.

``model.toml``'s ``task`` names one through :data:`visionserve.plugins.TASKS`: the built-ins,
and tasks of installed packages (entry point group ``visionserve.tasks``). See
:mod:`visionserve.tasks.base` for the interface and docs/architecture.md, "Adding a task".
"""

from __future__ import annotations

from ..config import ModelConfig
from ..plugins import TASKS
from .base import VERDICT, OipOutput, Rows, Task


def create(config: ModelConfig) -> Task:
    """The task object for a model version of ``config`` (its ``task`` is registered: the
    config was validated by that task's schema)."""
    return TASKS.load(config.task)(config)


__all__ = ["VERDICT", "OipOutput", "Rows", "Task", "create"]
