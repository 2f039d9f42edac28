"""A toy task, as a plant team would ship one in its own package: a regression model whose
answer is one number, OK when it is within a tolerance of a target (a gauge reading, a fill
level). Test code only: the server finds it through the entry point group ``visionserve.tasks``
(``test_custom_task.py`` installs it as a distribution on the server's ``PYTHONPATH``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from visionserve.backends.checks import Subject, TensorSpec, fmt
from visionserve.config import ModelConfig, _Strict
from visionserve.errors import ConfigError
from visionserve.tasks import OipOutput, Rows, Task


class RegressionOutput(_Strict):
    tensor_name: str | None = Field(None, description="Model output; default: the first.")
    unit: str = Field("", description="Unit of the value, for people.")


class RegressionVerdict(_Strict):
    target: float = Field(..., description="The value a good part has.")
    tolerance: float = Field(..., ge=0, description="OK if |value - target| <= this.")


class RegressionConfig(ModelConfig):
    """`task = "regression"`: one number per frame, OK within a tolerance of a target."""

    task: Literal["regression"] = "regression"
    output: RegressionOutput = RegressionOutput()
    verdict: RegressionVerdict


@dataclass(frozen=True, slots=True)
class Measured:
    value: float


class Regression(Task):
    name = "regression"
    schema = RegressionConfig

    def __init__(self, config: RegressionConfig) -> None:
        super().__init__(config)
        self._name: str | None = None

    def bind(self, subject: Subject, outputs: Sequence[TensorSpec]) -> tuple[str, ...]:
        want = self.config.output.tensor_name
        out = outputs[0] if want is None else next((o for o in outputs if o.name == want), None)
        if out is None:
            raise ConfigError(f"{subject.file}: output.tensor_name {want!r} not in model outputs "
                              f"{[o.name for o in outputs]}")
        one = out.dims is None or len(out.dims) == 1 or (len(out.dims) == 2 and out.dims[1] == 1)
        if not one:
            raise subject.error("output.tensor_name", "one value per frame", "[N] or [N, 1]",
                                fmt(out.dims), "name the output that holds it")
        self._name = out.name
        return (out.name,)

    def check_warmup(self, subject: Subject, batch: int, outputs: Mapping[str, Any]) -> None:
        shape = tuple(outputs[self._name].shape)
        if shape not in ((batch,), (batch, 1)):
            raise subject.error("output.tensor_name", "one value per frame", f"[{batch}]",
                                fmt(list(shape)), "name the output that holds it")

    def postprocess(self, outputs: Mapping[str, Any], rows: Rows,
                    sizes: Any = None) -> list[tuple[str, Measured]]:
        values = np.asarray(outputs[self._name]).reshape(-1)[rows].astype(np.float64)
        v = self.config.verdict
        return [("OK" if abs(x - v.target) <= v.tolerance else "NG", Measured(float(x)))
                for x in values]

    def oip_outputs(self) -> tuple[OipOutput, ...]:
        return (OipOutput("value", "FP32"),)

    def oip_tensors(self, results: Sequence[Measured]) -> dict[str, np.ndarray]:
        return {"value": np.array([r.value for r in results], dtype=np.float32)}

    def oip_parameters(self) -> dict[str, str]:
        v = self.config.verdict
        return {"target": str(v.target), "tolerance": str(v.tolerance)}

    def inspect_fields(self, result: Measured) -> dict[str, Any]:
        v = self.config.verdict
        return {"value": round(result.value, 6), "unit": self.config.output.unit,
                "target": v.target, "tolerance": v.tolerance}

    def summary(self, result: Measured) -> tuple[str, int, float]:
        return "value", -1, result.value
