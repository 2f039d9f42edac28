"""Classification: one score per label; OK when the top label is a good one, confidently.

Outputs: ``scores`` FP32 ``[N, labels]``, ``label`` BYTES ``[N]`` (then ``verdict``). The math
is numpy on the host (the scores are a few floats per frame).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from ..backends.checks import Dim, Subject, TensorSpec, fmt
from ..config import Labels, ModelConfig, _Strict
from ..errors import ConfigError
from .base import OipOutput, Rows, Task
from .geometry import Size


class OutputSpec(_Strict):
    labels: Labels = Field(
        ..., min_length=1, description="Class labels in model output order.")
    tensor_name: str | None = Field(
        None, description="Model graph output name; default: the first output.")
    activation: Literal["softmax", "sigmoid", "none"] = Field(
        "softmax", description="Applied to the model's output to get scores: softmax for logits, "
        "none if the model already outputs probabilities.")


class VerdictSpec(_Strict):
    ok_labels: tuple[str, ...] = Field(
        ("ok",), min_length=1, description="Labels that mean a good part.")
    ok_threshold: float = Field(
        0.5, ge=0.0, le=1.0,
        description="Verdict is OK only if the top label is in ok_labels with score >= this; "
        "else NG.")


class ClassificationConfig(ModelConfig):
    """The default task: the model gives one score per label for each frame (`[batch, labels]`);
    the top label and its score make the answer, `[verdict]` the rule. OIP outputs: `scores`
    FP32 `[N, labels]`, `label` BYTES `[N]`, then `verdict` BYTES `[N]`."""

    task: Literal["classification"] = "classification"
    output: OutputSpec
    verdict: VerdictSpec = VerdictSpec()

    @model_validator(mode="after")
    def _check_verdict(self) -> ClassificationConfig:
        missing = [x for x in self.verdict.ok_labels if x not in self.output.labels]
        if missing:
            raise ValueError(f"verdict.ok_labels {missing} are not in output.labels")
        return self


@dataclass(frozen=True, slots=True)
class Classified:
    """One frame's classification."""

    label: str
    index: int  # of label in output.labels
    score: float
    scores: np.ndarray  # (num_labels,) float32

    def __reduce__(self):
        # to a front-end process: the scores as float32 bytes (an array's own pickling costs the
        # engine's loop about 5 us a frame)
        return (_classified, (self.label, self.index, self.score,
                              np.asarray(self.scores, np.float32).tobytes()))


def _classified(label: str, index: int, score: float, scores: bytes) -> Classified:
    return Classified(label, index, score, np.frombuffer(scores, np.float32))


def activate(raw: np.ndarray, activation: str) -> np.ndarray:
    x = raw.astype(np.float32, copy=False)
    if activation == "softmax":
        x = x - x.max(axis=1, keepdims=True)
        e = np.exp(x)
        return e / e.sum(axis=1, keepdims=True)
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-np.clip(x, -80.0, 80.0)))  # no float32 overflow
    return x


def _verdict(label: str, score: float, ok_labels: frozenset[str], threshold: float) -> str:
    """OK only when the top label is a good one with score >= threshold."""
    return "OK" if label in ok_labels and score >= threshold else "NG"


_ONE_ROW = "list one label per model output, in the model's output order"
_NAME_IT = "name the model output that holds the [batch, labels] scores"


class Classification(Task):
    name = "classification"
    schema = ClassificationConfig
    config: ClassificationConfig

    def __init__(self, config: ClassificationConfig) -> None:
        super().__init__(config)
        self.labels = config.output.labels
        # (ok labels, threshold): one object, swapped whole by reconfigure
        self._rule = (frozenset(config.verdict.ok_labels), config.verdict.ok_threshold)
        self._scores: str | None = None  # the model output holding the scores (bound at load)

    def reconfigure(self, config: ModelConfig) -> None:
        assert isinstance(config, ClassificationConfig)
        rule = (frozenset(config.verdict.ok_labels), config.verdict.ok_threshold)
        self.config = config
        self._rule = rule

    # --- the model ----------------------------------------------------------------------------

    def bind(self, subject: Subject, outputs: Sequence[TensorSpec]) -> tuple[str, ...]:
        want = self.config.output.tensor_name
        if not outputs:  # the backend declares none: the first it returns
            return ()
        out: TensorSpec | None
        if want is None or not outputs[0].named:  # unnamed outputs: the first, as exported
            out = outputs[0]
        else:
            out = next((o for o in outputs if o.name == want), None)
            if out is None:
                raise ConfigError(f"{subject.file}: output.tensor_name {want!r} not in model "
                                  f"outputs {[o.name for o in outputs]}")
        if out.dims is not None:
            self._check_declared(subject, list(out.dims), out.dtype)
        self._scores = out.name
        return (out.name,)

    def _check_declared(self, subject: Subject, dims: list[Dim], dtype: str | None) -> None:
        labels = len(self.labels)
        if len(dims) != 2:
            raise subject.error("output.tensor_name", "a classification model gives one score per "
                                "label for each frame", f"[N, {labels}]", fmt(dims), _NAME_IT)
        if isinstance(dims[1], int) and dims[1] != labels:
            raise subject.error("output.labels", f"{labels} labels, but the model gives {dims[1]} "
                                "scores per frame", f"[N, {labels}]", fmt(dims), _ONE_ROW)
        if dtype is not None and dtype not in ("float32", "float16", "float64", "bfloat16"):
            raise subject.error("output.tensor_name", "scores must be floating point",
                                f"[N, {labels}] float32", f"{fmt(dims)} {dtype}", _NAME_IT)

    def check_warmup(self, subject: Subject, batch: int, outputs: Mapping[str, Any]) -> None:
        shape = tuple(self._raw(outputs).shape)
        labels = len(self.labels)
        if shape == (batch, labels):
            return
        expected, actual = f"[{batch}, {labels}] for a batch of {batch}", fmt(list(shape))
        if len(shape) == 2 and shape[0] == batch:
            raise subject.error("output.labels", f"{labels} labels, but the model gives {shape[1]} "
                                "scores per frame", expected, actual, _ONE_ROW)
        raise subject.error("output.tensor_name", "a classification model gives one row of scores "
                            "per frame", expected, actual, _NAME_IT)

    def _raw(self, outputs: Mapping[str, Any]) -> Any:
        return outputs[self._scores] if self._scores is not None else next(iter(outputs.values()))

    def postprocess(self, outputs: Mapping[str, Any], rows: Rows,
                    sizes: Sequence[Size] | None = None) -> list[tuple[str, Classified]]:
        """NG unless the top label is one of ``verdict.ok_labels`` with score >=
        ``ok_threshold``."""
        return self.classify(np.asarray(self._raw(outputs))[rows])

    def classify(self, raw: np.ndarray) -> list[tuple[str, Classified]]:
        """Raw model output rows (N, labels) -> (verdict, result) per row."""
        labels = self.labels
        if raw.ndim != 2 or raw.shape[1] != len(labels):
            raise ValueError(f"model output shape {raw.shape} does not match {len(labels)} labels")
        ok_labels, threshold = self._rule  # once: a verdict change applies from the next batch
        scores = activate(raw, self.config.output.activation)
        top = scores.argmax(axis=1)
        out = []
        for i, t in enumerate(top):
            label, score = labels[t], float(scores[i, t])
            out.append((_verdict(label, score, ok_labels, threshold),
                        Classified(label, int(t), score, scores[i])))
        return out

    def rejudge(self, result: Classified, judged: ModelConfig, config: ModelConfig) -> str:
        assert isinstance(config, ClassificationConfig)
        v = config.verdict
        return _verdict(result.label, result.score, frozenset(v.ok_labels), v.ok_threshold)

    # --- the answer ---------------------------------------------------------------------------

    def oip_outputs(self) -> tuple[OipOutput, ...]:
        return (OipOutput("scores", "FP32", (len(self.labels),)), OipOutput("label", "BYTES"))

    def oip_tensors(self, results: Sequence[Classified]) -> dict[str, np.ndarray]:
        scores = np.stack([r.scores for r in results]).astype(np.float32) if results \
            else np.zeros((0, len(self.labels)), np.float32)
        labels = np.array([r.label.encode() for r in results], dtype=object)
        return {"scores": scores, "label": labels}

    def oip_parameters(self) -> dict[str, str]:
        v = self.config.verdict
        return {"labels": ",".join(self.labels), "ok_labels": ",".join(v.ok_labels),
                "ok_threshold": str(v.ok_threshold)}

    def inspect_fields(self, result: Classified) -> dict[str, Any]:
        return {"label": result.label, "score": round(result.score, 6),
                "scores": {label: round(float(s), 6)
                           for label, s in zip(self.labels, result.scores)}}

    def annotate(self, image: np.ndarray, verdict: str, result: Classified) -> None:
        from . import annotate

        annotate.banner(image, verdict, [f"{result.label} {result.score:.2f}"])

    def summary(self, result: Classified) -> tuple[str, int, float]:
        return result.label, result.index, result.score

    def margin(self, result: Classified) -> float | None:
        """The best OK label's score against ``ok_threshold``: near it, the verdict could have
        gone either way (a clear NG has its OK scores near 0, a clear OK near 1)."""
        ok_labels, threshold = self._rule
        best = max((float(s) for label, s in zip(self.labels, result.scores)
                    if label in ok_labels), default=None)
        return None if best is None else abs(best - threshold)

