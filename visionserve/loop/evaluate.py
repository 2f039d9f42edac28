"""The held-out comparison, run as a guard job (never through the serving engine's batcher):

    python -m visionserve.loop.evaluate --model-toml M/model.toml --live M/1 \\
        --candidate M/candidates/c-1 --out M/candidates/c-1/comparison.json

loads the live version and the candidate with the model's backend on the CPU, runs both on the
candidate's held-out labelled frames (candidate.json's ``held_out``) with the server's own
preprocessing and the task's verdict rule, and writes per record its label and each model's
verdict, label and score (a detector's boxes too), with the summary (:func:`summarize`). Prints
its progress as JSON lines.
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
from ..tasks.anomaly import Anomaly
from ..tasks.classification import ClassificationConfig, Classified
from ..tasks.detection import Detected
from .candidates import read_json, write_json

#: the tasks the comparison and the shadow judge (a segmenter's masks are not compared)
JUDGED = ("classification", "anomaly", "detection")
#: a detection matches a labelled box of its label at this IoU or more (box recall)
MATCH_IOU = 0.5


class Judge:
    """The model file in ``folder`` loaded with the model's backend on the CPU, judging batches
    with the task's verdict rule (:meth:`__call__`) until :meth:`close`: a classifier's verdict,
    label and score; an anomaly model's or a detector's verdict, the frame's label
    (:func:`frame_label`) and score (an anomaly model's normalised score: model.toml's or the
    folder's metadata.json; a detector's best box's), and a detector's boxes."""

    def __init__(self, config: ModelConfig, folder: Path) -> None:
        path = folder / model_file(config.runtime.backend)
        self.backend = create(config.runtime.backend)
        self.backend.load(path, config, "cpu")
        self.step = max(1, config.batching.max_batch_size)
        self.task = tasks.create(config)
        self.backend.select_outputs(self.task.bind(Subject(path), self.backend.outputs))

    def __call__(self, batch: np.ndarray,
                 sizes: list[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
        """Verdict, label and score of each row of ``batch`` (the model's input tensor);
        ``sizes``: the frames' (width, height), where a detector's boxes lie."""
        out = []
        for i in range(0, len(batch), self.step):
            part = batch[i:i + self.step]
            found = self.task.postprocess(self.backend.run(part), slice(0, len(part)),
                                          sizes[i:i + self.step] if sizes else None)
            out += [self._row(verdict, result) for verdict, result in found]
        return out

    def _row(self, verdict: str, result: Any) -> dict[str, Any]:
        judged = label_score(verdict, result)
        assert judged is not None  # a judged task's result: :func:`ok_labels` let it load
        label, score = judged
        row: dict[str, Any] = {"verdict": verdict, "label": label, "score": round(score, 6)}
        if isinstance(result, Detected):
            row["boxes"] = [{"label": d.label, "score": round(d.score, 4),
                             "box": [round(v, 1) for v in d.box]} for d in result.detections]
        return row

    def close(self) -> None:
        self.backend.close()


def frame_label(verdict: str) -> str:
    """An anomaly model's or a detector's verdict as the label of its frame (the labels an
    anomaly model's frames are given; a detector's frame is ``defective`` where it has boxes)."""
    return "defective" if verdict == "NG" else "good"


def label_score(verdict: str, result: Any) -> tuple[str, float] | None:
    """A judged frame's label and score: a classifier's own; an anomaly model's or a detector's
    :func:`frame_label` with its normalised score or its best box's; None for another task's
    result."""
    if isinstance(result, Classified):
        return result.label, result.score
    if isinstance(result, Anomaly):
        return frame_label(verdict), result.score
    if isinstance(result, Detected):
        return frame_label(verdict), max((d.score for d in result.detections), default=0.0)
    return None


def judge(config: ModelConfig, folder: Path, batch: np.ndarray,
          sizes: list[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """Verdict, label and score of each row of ``batch`` by the model file in ``folder``."""
    judging = Judge(config, folder)
    try:
        return judging(batch, sizes)
    finally:
        judging.close()


def tensor(frames: list[imaging.Frame], spec: InputSpec) -> np.ndarray:
    """The model's input batch of ``frames``: the server's own preprocessing, on the CPU."""
    pixels = np.stack([imaging.preprocess(f, spec) for f in frames])
    return imaging.normalize(pixels.reshape(len(frames), spec.height, spec.width, spec.channels),
                             spec)


def ok_labels(config: ModelConfig) -> frozenset[str] | None:
    """The labels of the OK frames of a model the comparison and the shadow judge; None for a
    task they do not judge."""
    if config.task not in JUDGED:
        return None
    if isinstance(config, ClassificationConfig):
        return frozenset(config.verdict.ok_labels)
    return frozenset({"good"})


def found(boxes: list[dict[str, Any]], answer: dict[str, Any]) -> int:
    """How many of a frame's labelled ``boxes`` a detector's ``answer`` found: a box of the same
    label overlapping it by :data:`MATCH_IOU` or more, each answer's box matched once."""
    left = list(answer.get("boxes", ()))
    hits = 0
    for want in boxes:
        best = max(((iou(want["box"], got["box"]), k) for k, got in enumerate(left)
                    if got["label"] == want["label"]), default=(0.0, -1))
        if best[0] >= MATCH_IOU:
            hits += 1
            left.pop(best[1])
    return hits


def iou(a: list[float], b: list[float]) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, w) * max(0.0, h)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def rates(rows: list[dict[str, Any]], which: str, ok_labels: frozenset[str]) -> dict[str, Any]:
    """Accuracy (the label), NG recall (frames labelled NG judged NG) and false reject rate
    (frames labelled OK judged NG) of ``which`` ("live" or "candidate")."""
    ng = [r for r in rows if r["label"] not in ok_labels]
    ok = [r for r in rows if r["label"] in ok_labels]

    def share(part: list, hit) -> float | None:
        return round(sum(1 for r in part if hit(r)) / len(part), 4) if part else None

    out = {"accuracy": share(rows, lambda r: r[which]["label"] == r["label"]),
           "ng_recall": share(ng, lambda r: r[which]["verdict"] == "NG"),
           "false_reject_rate": share(ok, lambda r: r[which]["verdict"] == "NG"),
           "frames": len(rows), "ng_frames": len(ng), "ok_frames": len(ok)}
    boxes = sum(len(r.get("boxes", ())) for r in rows)
    if boxes:  # a detector's: the labelled boxes it found
        out["box_recall"] = round(sum(found(r["boxes"], r[which]) for r in rows
                                      if r.get("boxes")) / boxes, 4)
        out["boxes"] = boxes
    return out


def summarize(rows: list[dict[str, Any]], ok_labels: frozenset[str]) -> dict[str, Any]:
    """Each model's rates and the records where the two disagree (verdict or label; for a
    detector also how many of the labelled boxes each found)."""
    return {"live": rates(rows, "live", ok_labels),
            "candidate": rates(rows, "candidate", ok_labels),
            "disagree": [r["record_id"] for r in rows if disagree(r)]}


def disagree(row: dict[str, Any]) -> bool:
    live, cand = row["live"], row["candidate"]
    if (live["verdict"], live["label"]) != (cand["verdict"], cand["label"]):
        return True
    return bool(row.get("boxes")) and found(row["boxes"], live) != found(row["boxes"], cand)


def held_label(item: dict[str, Any]) -> str:
    """A held-out frame's label: its own, or a detector's frame's (``defective`` where it has
    labelled boxes)."""
    return item["label"] if "label" in item else "defective" if item["boxes"] else "good"


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
    oks = ok_labels(config)
    if oks is None:
        print(f"error: {args.model_toml}: the comparison is made for classifiers, anomaly models "
              "and detectors", file=sys.stderr)
        return 2
    items = read_json(args.candidate / "candidate.json")["held_out"]
    frames = [imaging.encoded_frame((args.candidate / it["file"]).read_bytes()) for it in items]
    batch, sizes = tensor(frames, config.input), [(f.width, f.height) for f in frames]
    print(json.dumps({"step": 1, "steps": 2, "frames": len(items)}), flush=True)
    live = judge(config, args.live, batch, sizes)
    print(json.dumps({"step": 2, "steps": 2}), flush=True)
    cand = judge(config, args.candidate, batch, sizes)
    rows = [{"record_id": it["record_id"], "label": held_label(it), "file": it["file"],
             **({"boxes": it["boxes"]} if "boxes" in it else {}), "live": a, "candidate": b}
            for it, a, b in zip(items, live, cand, strict=True)]
    write_json(args.out, {"live_version": args.live.name, "candidate": args.candidate.name,
                          "seconds": round(time.time() - t0, 2),
                          "summary": summarize(rows, oks), "records": rows})
    print(f"wrote {args.out} ({len(rows)} held-out frames)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
