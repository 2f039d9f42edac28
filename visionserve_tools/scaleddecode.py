"""Scaled JPEG decoding on the CPU path against full decoding (issue 19): the shipped model's
scores, labels and verdicts on the held-out test set, and the time of decode + resize per frame.

    python -m visionserve_tools.scaleddecode --out scaled.json [--n-per-label 100] [--quality 90]

The held-out set of models/defect-classifier/README.md (seed 2026, ``HELDOUT_PARAMS``, 640x480
and 1280x1024 alternating), each frame encoded as JPEG, preprocessed twice by
:mod:`visionserve.imaging`: decoded in full (``scale=1``), and as the server does with
``input.scaled_decode = true`` (:func:`visionserve.imaging.jpeg_scale`); both run through the
ONNX model. Times are the
median of ``--rounds`` interleaved passes over the frames of each size, in this process, one
thread: ratios are what to read on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from visionserve import imaging
from visionserve.config import load_model_config
from visionserve.tasks.classification import Classification, ClassificationConfig

from . import synthetic

MODEL = Path(__file__).resolve().parents[1] / "models" / "defect-classifier"


class Agreement(NamedTuple):
    """Full against scaled decoding of the same frames: pixels (N, H, W, C) as the model gets them,
    scores (N, labels) and OK verdicts (N,) from the server's own activation and verdict rule, and
    the scale each frame was decoded at."""
    full: np.ndarray
    scaled: np.ndarray
    scores_full: np.ndarray
    scores_scaled: np.ndarray
    ok_full: np.ndarray
    ok_scaled: np.ndarray
    scales: list[int]


def heldout_jpegs(cfg: ClassificationConfig, n_per_label: int, quality: int,
                  ) -> tuple[list[imaging.Frame], list[int]]:
    """The held-out set as JPEG frames, and each frame's label index."""
    frames, targets = [], []
    for img, label in synthetic.generate_set(n_per_label, 2026, params=synthetic.HELDOUT_PARAMS):
        frames.append(imaging.encoded_frame(synthetic.encode(img, "jpeg", quality)))
        targets.append(cfg.output.labels.index(label))
    return frames, targets


def compare(model: Path, frames: list[imaging.Frame]) -> Agreement:
    """``frames`` through ``model`` (a classification model folder, version 1's ONNX file on the
    CPU, one thread), decoded in full and as the server does with ``input.scaled_decode = true``."""
    import onnxruntime as ort

    cfg = load_model_config(model / "model.toml")
    if not isinstance(cfg, ClassificationConfig):
        raise TypeError(f"{model}: a classification model is needed (labels and a verdict)")
    spec = cfg.input.model_copy(update={"scaled_decode": True})
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(model / "1" / "model.onnx"), opts,
                                providers=["CPUExecutionProvider"])
    in_name = spec.tensor_name or sess.get_inputs()[0].name
    full = np.stack([imaging.to_model_pixels(imaging.decode(f, spec.channels, 1), spec)
                     for f in frames])
    scaled = np.stack([imaging.preprocess(f, spec) for f in frames])
    task = Classification(cfg)  # the server's own activation and verdict rule

    def classify(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = task.classify(np.concatenate([
            sess.run(None, {in_name: imaging.normalize(pixels[i:i + 32], spec)})[0]
            for i in range(0, len(pixels), 32)]))
        return (np.stack([r.scores for _, r in rows]),
                np.asarray([v == "OK" for v, _ in rows]))

    (pf, vf), (ps, vs) = classify(full), classify(scaled)
    return Agreement(full, scaled, pf, ps, vf, vs, [imaging.jpeg_scale(f, spec) for f in frames])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m visionserve_tools.scaleddecode",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--n-per-label", type=int, default=100)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = load_model_config(args.model / "model.toml")
    if not isinstance(cfg, ClassificationConfig):
        ap.error(f"{args.model}: a classification model is needed (labels and a verdict)")
    spec = cfg.input.model_copy(update={"scaled_decode": True})
    frames, targets = heldout_jpegs(cfg, args.n_per_label, args.quality)
    agr = compare(args.model, frames)
    full, scaled, scales = agr.full, agr.scaled, agr.scales
    pf, ps, vf, vs = agr.scores_full, agr.scores_scaled, agr.ok_full, agr.ok_scaled
    target = np.asarray(targets)
    differ = (pf.argmax(1) != ps.argmax(1)) | (vf != vs)
    diff = np.abs(pf - ps)
    pixel = np.abs(full.astype(np.int16) - scaled.astype(np.int16))
    res: dict = {
        "frames": len(frames), "quality": args.quality, "model": str(args.model.name),
        "scales": {str(s): scales.count(s) for s in sorted(set(scales))},
        "pixel_mean_abs_diff": round(float(pixel.mean()), 4),
        "pixel_max_abs_diff": int(pixel.max()),
        "score_max_abs_diff": round(float(diff.max()), 5),
        "score_p99_abs_diff": round(float(np.quantile(diff.max(1), 0.99)), 5),
        "score_mean_abs_diff": round(float(diff.mean()), 6),
        "labels_equal": int((pf.argmax(1) == ps.argmax(1)).sum()),
        "verdicts_equal": int((vf == vs).sum()),
        # every frame whose label or verdict differs: how near a tie the full decode's scores were
        "disagreements": [
            {"frame": int(i), "size": f"{frames[i].width}x{frames[i].height}",
             "top2_margin_full": round(float(np.diff(np.sort(pf[i])[-2:])[0]), 4),
             "scores_full": [round(float(v), 4) for v in pf[i]],
             "scores_scaled": [round(float(v), 4) for v in ps[i]]}
            for i in np.flatnonzero(differ)],
        "accuracy_full": round(float((pf.argmax(1) == target).mean()), 4),
        "accuracy_scaled": round(float((ps.argmax(1) == target).mean()), 4),
        "times_ms": {},
    }
    for size in sorted({(f.width, f.height) for f in frames}):
        group = [f for f in frames if (f.width, f.height) == size]
        t_full: list[float] = []
        t_scaled: list[float] = []
        for _ in range(args.rounds):
            for fn, acc in ((lambda f: imaging.to_model_pixels(
                    imaging.decode(f, spec.channels, 1), spec), t_full),
                            (lambda f: imaging.preprocess(f, spec), t_scaled)):
                t0 = time.perf_counter()
                for f in group:
                    fn(f)
                acc.append((time.perf_counter() - t0) * 1000 / len(group))
        a, b = statistics.median(t_full), statistics.median(t_scaled)
        res["times_ms"][f"{size[0]}x{size[1]}"] = {
            "full": round(a, 3), "scaled": round(b, 3), "speedup": round(a / b, 2),
            "scale": imaging.jpeg_scale(group[0], spec)}
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
