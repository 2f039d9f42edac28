"""The held-out comparison, run as a guard job (never through the serving engine's batcher):

    python -m visionserve.loop.evaluate --model-toml M/model.toml --live M/1 \\
        --candidate M/candidates/c-1 --out M/candidates/c-1/comparison.json

loads the live version and the candidate with the model's backend on the CPU, runs both on the
candidate's held-out labelled frames (candidate.json's ``held_out``) with the server's own
preprocessing and the task's verdict rule, and writes per record its label and each model's
verdict, label and score, with the summary (:func:`summarize`). Prints its progress as JSON
lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import imaging, tasks
from ..backends.base import create, model_file
from ..backends.checks import Subject
from ..config import InputSpec, ModelConfig, load_model_config
from ..tasks.anomaly import AnomalyConfig
from ..tasks.classification import Classification, ClassificationConfig
from .candidates import read_json, write_json


class Judge:
    """The model file in ``folder`` loaded with the model's backend on the CPU, judging batches
    with the task's verdict rule (:meth:`__call__`) until :meth:`close`."""

    def __init__(self, config: ClassificationConfig, folder: Path) -> None:
        self.backend = create(config.runtime.backend)
        self.backend.load(folder / model_file(config.runtime.backend), config, "cpu")
        self.task = Classification(config)
        self.step = max(1, config.batching.max_batch_size)
        self.name = config.output.tensor_name  # none named: the model's one output

    def _scores(self, outputs: dict[str, Any]) -> np.ndarray:
        return np.asarray(outputs[self.name] if self.name else next(iter(outputs.values())))

    def __call__(self, batch: np.ndarray) -> list[dict[str, Any]]:
        """Verdict, label and score of each row of ``batch`` (the model's input tensor)."""
        raw = np.concatenate([self._scores(self.backend.run(batch[i:i + self.step]))
                              for i in range(0, len(batch), self.step)])
        return [{"verdict": verdict, "label": result.label, "score": round(result.score, 6)}
                for verdict, result in self.task.classify(raw)]

    def close(self) -> None:
        self.backend.close()


def judge(config: ClassificationConfig, folder: Path, batch: np.ndarray) -> list[dict[str, Any]]:
    """Verdict, label and score of each row of ``batch`` by the model file in ``folder``."""
    judging = Judge(config, folder)
    try:
        return judging(batch)
    finally:
        judging.close()


def tensor(frames: list[imaging.Frame], spec: InputSpec) -> np.ndarray:
    """The model's input batch of ``frames``: the server's own preprocessing, on the CPU."""
    pixels = np.stack([imaging.preprocess(f, spec) for f in frames])
    return imaging.normalize(pixels.reshape(len(frames), spec.height, spec.width, spec.channels),
                             spec)


def judge_anomaly(config: AnomalyConfig, folder: Path,
                  batch: np.ndarray) -> list[dict[str, Any]]:
    """Verdict, label (``good`` for OK, ``defective`` for NG: the labels of an anomaly model's
    frames) and normalised score of each row of ``batch`` by the version in ``folder`` (its
    normalisation: model.toml's or the folder's metadata.json)."""
    backend = create(config.runtime.backend)
    path = folder / model_file(config.runtime.backend)
    backend.load(path, config, "cpu")
    task = tasks.create(config)
    backend.select_outputs(task.bind(Subject(path), backend.outputs))
    step = max(1, config.batching.max_batch_size)
    out: list[dict[str, Any]] = []
    try:
        for i in range(0, len(batch), step):
            part = batch[i:i + step]
            out += [{"verdict": verdict, "label": "defective" if verdict == "NG" else "good",
                     "score": round(result.score, 6)}
                    for verdict, result in task.postprocess(backend.run(part),
                                                            slice(0, len(part)))]
    finally:
        backend.close()
    return out


def judges(config: ModelConfig):
    """(the judge of the model's task, its OK labels); None for a task not compared."""
    if isinstance(config, ClassificationConfig):
        return (lambda folder, batch: judge(config, folder, batch),
                frozenset(config.verdict.ok_labels))
    if isinstance(config, AnomalyConfig):
        return (lambda folder, batch: judge_anomaly(config, folder, batch),
                frozenset({"good"}))
    return None


def rates(rows: list[dict[str, Any]], which: str, ok_labels: frozenset[str]) -> dict[str, Any]:
    """Accuracy (the label), NG recall (frames labelled NG judged NG) and false reject rate
    (frames labelled OK judged NG) of ``which`` ("live" or "candidate")."""
    ng = [r for r in rows if r["label"] not in ok_labels]
    ok = [r for r in rows if r["label"] in ok_labels]

    def share(part: list, hit) -> float | None:
        return round(sum(1 for r in part if hit(r)) / len(part), 4) if part else None

    return {"accuracy": share(rows, lambda r: r[which]["label"] == r["label"]),
            "ng_recall": share(ng, lambda r: r[which]["verdict"] == "NG"),
            "false_reject_rate": share(ok, lambda r: r[which]["verdict"] == "NG"),
            "frames": len(rows), "ng_frames": len(ng), "ok_frames": len(ok)}


def summarize(rows: list[dict[str, Any]], ok_labels: frozenset[str]) -> dict[str, Any]:
    """Each model's rates and the records where the two disagree (verdict or label)."""
    return {"live": rates(rows, "live", ok_labels),
            "candidate": rates(rows, "candidate", ok_labels),
            "disagree": [r["record_id"] for r in rows
                         if (r["live"]["verdict"], r["live"]["label"])
                         != (r["candidate"]["verdict"], r["candidate"]["label"])]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-toml", type=Path, required=True)
    ap.add_argument("--live", type=Path, required=True, help="the live version's folder")
    ap.add_argument("--candidate", type=Path, required=True, help="the candidate's folder")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t0 = time.time()
    config = load_model_config(args.model_toml)
    judged = judges(config)
    if judged is None:
        print(f"error: {args.model_toml}: the comparison is made for classifiers and anomaly "
              "models", file=sys.stderr)
        return 2
    run, ok_labels = judged
    items = read_json(args.candidate / "candidate.json")["held_out"]
    spec = config.input
    batch = tensor([imaging.encoded_frame((args.candidate / it["file"]).read_bytes())
                    for it in items], spec)
    print(json.dumps({"step": 1, "steps": 2, "frames": len(items)}), flush=True)
    live = run(args.live, batch)
    print(json.dumps({"step": 2, "steps": 2}), flush=True)
    cand = run(args.candidate, batch)
    rows = [{"record_id": it["record_id"], "label": it["label"], "file": it["file"],
             "live": a, "candidate": b} for it, a, b in zip(items, live, cand, strict=True)]
    write_json(args.out, {"live_version": args.live.name, "candidate": args.candidate.name,
                          "seconds": round(time.time() - t0, 2),
                          "summary": summarize(rows, ok_labels), "records": rows})
    print(f"wrote {args.out} ({len(rows)} held-out frames)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
