"""What a label of a captured frame may say, by its model's task (docs/closed-loop.md):

- a classifier: ``{"label": "scratch"}``, one of the model's ``output.labels``;
- an anomaly model: ``{"label": "good"}`` or ``{"label": "defective"}``;
- a detector: ``{"boxes": [{"label": "scratch", "box": [x1, y1, x2, y2]}, ...]}``, each label one
  of the model's, each box in the frame's pixels, inside it (``[]``: nothing to find there).

Any of them may add ``"verdict_was_wrong": true`` (an operator's flag: the line's verdict was
wrong). :func:`validate` checks a body and gives the label as it is kept; a body it refuses is a
400 (InvalidInput) that says what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import InvalidInput
from ..tasks.anomaly import AnomalyConfig
from ..tasks.classification import ClassificationConfig
from ..tasks.detection import DetectionConfig
from ..tasks.segmentation import SegmentationConfig

#: an anomaly model's labels: a part that is fine, or one that is not
ANOMALY_LABELS = ("good", "defective")
#: the most boxes one label may hold
MAX_BOXES = 1000
#: the tasks whose frames can be labelled
LABELLED_TASKS = ("classification", "anomaly", "detection")


@dataclass(frozen=True)
class Scheme:
    """How a model's frames are labelled: ``task`` one of LABELLED_TASKS, ``labels`` the names a
    label (or a box's label) may take."""

    task: str
    labels: tuple[str, ...]

    @property
    def boxes(self) -> bool:
        return self.task == "detection"


def scheme_of(model: str, config: ModelConfig) -> Scheme:
    """The labelling scheme of a model; InvalidInput for a task that has none yet."""
    if isinstance(config, SegmentationConfig):
        pass  # a detector's subclass: its labels are masks, not boxes
    elif isinstance(config, DetectionConfig):
        return Scheme("detection", tuple(config.output.labels))
    elif isinstance(config, ClassificationConfig):
        return Scheme("classification", tuple(config.output.labels))
    elif isinstance(config, AnomalyConfig):
        return Scheme("anomaly", ANOMALY_LABELS)
    raise InvalidInput(f"model {model!r} (task {config.task!r}): frames can be labelled for "
                       f"{', '.join(LABELLED_TASKS)} models")


def example(scheme: Scheme) -> str:
    """A body of the scheme, for messages."""
    if scheme.boxes:
        return f'{{"boxes": [{{"label": "{scheme.labels[0]}", "box": [x1, y1, x2, y2]}}]}}'
    return f'{{"label": "{scheme.labels[0]}"}}'


def validate(scheme: Scheme, body: dict[str, Any],
             frame_size: Callable[[], tuple[int, int]]) -> dict[str, Any]:
    """The label ``body`` gives, as it is kept; ``frame_size``: (width, height) of the frame,
    asked only for boxes. InvalidInput names what is wrong."""
    key = "boxes" if scheme.boxes else "label"
    unknown = sorted(set(body) - {key, "verdict_was_wrong"})
    if unknown or key not in body:
        raise InvalidInput(f"a {scheme.task} model's label is {example(scheme)} (and "
                           "\"verdict_was_wrong\": true where the line's verdict was wrong)"
                           + (f"; not understood: {', '.join(unknown)}" if unknown else ""))
    out: dict[str, Any] = {}
    if scheme.boxes:
        out["boxes"] = _boxes(scheme, body["boxes"], frame_size)
    else:
        out["label"] = _name(scheme, body["label"], "label")
    wrong = body.get("verdict_was_wrong")
    if wrong is not None:
        if not isinstance(wrong, bool):
            raise InvalidInput(f"verdict_was_wrong {wrong!r}: true or false")
        out["verdict_was_wrong"] = wrong
    return out


def _name(scheme: Scheme, value: Any, where: str) -> str:
    if not isinstance(value, str) or value not in scheme.labels:
        raise InvalidInput(f"{where} {value!r} is not a label of this model: one of "
                           f"{', '.join(scheme.labels)}")
    return value


def _boxes(scheme: Scheme, value: Any, frame_size: Callable[[], tuple[int, int]]
           ) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidInput(f"boxes: a list of {{\"label\": ..., \"box\": [x1, y1, x2, y2]}} "
                           f"(an empty list: nothing to find in the frame), not {value!r}")
    if len(value) > MAX_BOXES:
        raise InvalidInput(f"boxes: {len(value)} boxes, at most {MAX_BOXES}")
    out = []
    size: tuple[int, int] | None = None
    for i, item in enumerate(value):
        where = f"boxes[{i}]"
        if not isinstance(item, dict) or set(item) != {"label", "box"}:
            raise InvalidInput(f"{where}: {{\"label\": ..., \"box\": [x1, y1, x2, y2]}}")
        label = _name(scheme, item["label"], f"{where}.label")
        box = item["box"]
        if not isinstance(box, list) or len(box) != 4 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in box):
            raise InvalidInput(f"{where}.box {box!r}: four numbers [x1, y1, x2, y2] in the "
                               "frame's pixels")
        x1, y1, x2, y2 = (float(v) for v in box)
        if x2 <= x1 or y2 <= y1:
            raise InvalidInput(f"{where}.box {box!r}: x2 must be greater than x1 and y2 than y1")
        size = size or frame_size()
        w, h = size
        if x1 < 0 or y1 < 0 or x2 > w or y2 > h:
            raise InvalidInput(f"{where}.box {box!r} lies outside the frame (0, 0, {w}, {h})")
        out.append({"label": label, "box": [x1, y1, x2, y2]})
    return out
