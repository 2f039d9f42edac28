"""What a candidate's training job is: the guard job's command and where it runs, what it must
leave in the candidate's folder, and what it is trained on. Each way of training a candidate
(the project's fine-tune, :mod:`.refit`, :mod:`.usercommand`) makes one; the routes
(:mod:`.http`) submit it and write it into ``job.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: GPU memory a training job declares to the guard where the guard has a GPU, by default
TRAIN_GPU_MEM = 2 << 30


@dataclass(frozen=True)
class Plan:
    #: ``finetune`` (the project's classifier), ``refit`` (an anomaly model), ``command`` (the
    #: model's own [training] command)
    kind: str
    command: list[str]
    #: files the job must leave in the candidate's folder for it to be a candidate
    expects: list[str]
    #: the job's report in the candidate's folder, kept as candidate.json's ``metrics``
    metrics_file: str
    trained_on: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    recipe: dict[str, Any]
    cwd: str
    gpu_mem: int = TRAIN_GPU_MEM
    env: dict[str, str] = field(default_factory=dict)

    def job_info(self) -> dict[str, Any]:
        """job.json's fields of the plan (the routes add the job, who and when)."""
        return {"kind": self.kind, "expects": self.expects, "metrics_file": self.metrics_file,
                "trained_on": self.trained_on, "held_out": self.held_out, "recipe": self.recipe}
