"""What a task is: the one place that knows what a model's outputs mean.

The server around a task knows none: the runner hands a batch's named model outputs to
:meth:`Task.postprocess` and gets one ``(verdict, result)`` per frame; the front ends ask the
task for the OIP outputs it declares and to render a result as OIP tensors or as the inspect
answer's fields. A result is the task's own object (picklable: it travels to front-end
processes), wrapped by the runner in the envelope every task shares (``runner.FrameResult``:
verdict, batch size, timings).

One task object serves one model version: it is made from the version's ``model.toml``, bound
to the model's outputs at load, and called from every runner thread of the version at once, so
``postprocess`` keeps no state between calls.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from ..backends.checks import Subject, TensorSpec
from ..config import ModelConfig
from .geometry import Size

#: rows of a batch's outputs that answer frames: the first n (``slice(0, n)``), or, when frames
#: dropped out of a batch already on the device, the kept rows in frame order
Rows = slice | list[int]

_D = TypeVar("_D", bound=type)


def pickled_as_fields(cls: _D) -> _D:
    """A dataclass decorator (put it above ``@dataclass``): instances pickle as the class and
    its fields' values, unpickled by calling the class with them.

    Results travel to front-end processes, pickled in the engine's loop (the one interpreter
    every front end shares). A frozen dataclass's own pickling runs a Python function over its
    fields and sets each back with ``object.__setattr__``: a detection answer of five objects
    cost the loop 14 us that way, 4 us this way (``python -m visionserve_tools.benchwire``).
    Only for a dataclass whose fields are all ``__init__`` arguments, in order, that does
    nothing more with them at construction, and that has no subclass (it would come back as
    this class)."""
    names = [f.name for f in fields(cls)]
    if any(not f.init for f in fields(cls)) or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: pickled_as_fields needs plain __init__ fields")
    get = operator.attrgetter(*names)
    one = len(names) == 1

    def __reduce__(self: Any) -> tuple[Any, tuple[Any, ...]]:
        values = get(self)
        return cls, ((values,) if one else values)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign,assignment]
    return cls


@dataclass(frozen=True)
class OipOutput:
    """One OIP output tensor a task gives for each frame (``GET /v2/models/{m}`` lists them).

    ``dims`` are per frame, without the batch axis (``()``: one value per frame). A variable
    number of items per frame (detections) takes its fixed-capacity form: ``dims`` holds the
    capacity K (``(K, 4)`` for boxes), rows past the frame's count are zeros, and ``count`` names
    the output (INT32, ``()``) that holds how many rows are valid.
    """

    name: str
    datatype: str  # OIP datatype: FP32, INT32, BYTES, ...
    dims: tuple[int, ...] = ()
    count: str | None = None


#: the output every task ends with: the frame's verdict (OK / NG), from the envelope
VERDICT = OipOutput("verdict", "BYTES")


class Unjudgeable(Exception):
    """A kept answer cannot be judged again under other ``[verdict]`` values: the rule needs
    outputs the answer does not keep (the message says which)."""


class Task(ABC):
    """A kind of model (classification, detection, ...): its schema, outputs, verdict rule."""

    #: ``task = "..."`` in model.toml
    name: ClassVar[str]
    #: the task's model.toml schema: a ModelConfig subclass with ``task: Literal[name]`` and the
    #: task's own sections
    schema: ClassVar[type[ModelConfig]]
    #: postprocess takes device tensors where the backend can leave its outputs on the device
    #: (torch on a GPU: ``Backend.device_outputs``); else it always gets numpy arrays
    on_device: ClassVar[bool] = False
    #: its answers hold boxes, masks or regions in frame pixels: the inspect answer then gives
    #: the frame's stored size (``"frame": {"width", "height"}``), the pixels they are in
    geometry: ClassVar[bool] = False

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    # --- the model ----------------------------------------------------------------------------

    @abstractmethod
    def bind(self, subject: Subject, outputs: Sequence[TensorSpec]) -> tuple[str, ...]:
        """Check the model's outputs, as its file declares them, against model.toml (a
        ConfigError from ``subject.error`` naming the field); return the names of those
        :meth:`postprocess` reads: the backend computes and fetches only these."""

    def check_warmup(self, subject: Subject, batch: int, outputs: Mapping[str, Any]) -> None:
        """What the model returned for a warm-up batch of ``batch`` frames (shapes a file may
        leave open); a ConfigError naming the field if it does not fit."""

    def reconfigure(self, config: ModelConfig) -> None:
        """Serve with ``config`` from the next batch on: the same model, other ``[verdict]``
        values (``PUT /v1/models/{m}/verdict``; validated by :attr:`schema`). Runner threads may
        be in :meth:`postprocess` meanwhile, so the new settings must be taken whole: a task that
        reads ``self.config`` once per batch needs nothing more than this reference swap; one
        that derives settings from it builds them first and swaps one immutable object."""
        self.config = config

    @abstractmethod
    def postprocess(self, outputs: Mapping[str, Any], rows: Rows,
                    sizes: Sequence[Size] | None = None) -> list[tuple[str, Any]]:
        """A batch's outputs (name -> array, batch axis first; device tensors only for an
        ``on_device`` task) -> ``(verdict, result)`` for each of ``rows``, in order. ``sizes``:
        each of those frames' (width, height) as it arrived, for a task that answers in frame
        pixels (:class:`visionserve.tasks.geometry.FrameMap` undoes the resize); None: frames
        of the model input's size. Runs on the runner's compute thread: whatever it returns must
        not alias the outputs, which the backend reuses for the next batch."""

    # --- the answer ---------------------------------------------------------------------------

    @abstractmethod
    def oip_outputs(self) -> tuple[OipOutput, ...]:
        """The task's OIP outputs, in order (the server adds ``verdict`` after them)."""

    @abstractmethod
    def oip_tensors(self, results: Sequence[Any]) -> dict[str, np.ndarray]:
        """Frames' results -> every output of :meth:`oip_outputs`, shape ``[len(results), *dims]``
        (BYTES: an object array of ``bytes``)."""

    def oip_parameters(self) -> dict[str, str]:
        """Model configuration parameters (``GET /v2/models/{m}/config``): the verdict rule."""
        return {}

    @abstractmethod
    def inspect_fields(self, result: Any) -> dict[str, Any]:
        """The task's part of the inspect answer (after ``verdict``); JSON values."""

    def annotate(self, image: np.ndarray, verdict: str, result: Any) -> None:
        """Draw the answer on the frame (BGR, the frame's size, drawn in place) for the inspect
        API's ``Accept: image/jpeg``; the default draws the verdict (helpers:
        :mod:`visionserve.tasks.annotate`)."""
        from . import annotate

        annotate.banner(image, verdict)

    def capture_fields(self, result: Any, size: Size) -> dict[str, Any]:
        """What a captured frame's sidecar keeps beside its record so that the answer can be
        drawn on the stored image later (:mod:`visionserve.records.overlay`), for a frame of
        ``size`` (width, height): compact JSON values, computed off the hot path (the capture
        thread). The default: nothing, the record's fields (boxes, masks, regions) suffice."""
        return {}

    def rejudge(self, result: Any, judged: ModelConfig, config: ModelConfig) -> str:
        """The verdict ``result`` (answered under ``judged``) would get under ``config``'s
        ``[verdict]``, the same model and outputs (the verdict preview, ``POST
        /v1/models/{m}/verdict/preview``); Unjudgeable where the rule needs outputs the result
        does not keep. The default: none can be judged again."""
        raise Unjudgeable(f"the {self.name} task keeps no outputs to judge again")

    def summary(self, result: Any) -> tuple[str, int, float]:
        """(label, class index, score) for the PLC's result registers; ("", -1, nan) if none."""
        return "", -1, float("nan")

    def reasons(self, result: Any) -> tuple[str, ...]:
        """Why the frame is NG, in a few words each (the live results feed); () when the task
        says no more than its label."""
        return ()

    def margin(self, result: Any) -> float | None:
        """How far the frame's deciding score lies from the verdict's threshold, on the score's
        own scale (0: on the threshold); image capture's ``uncertain`` policy keeps frames within
        a band of it. None: the task has no single score threshold."""
        return None
