"""Evaluate a model version as served: its ``model.onnx`` in onnxruntime, on frames preprocessed
as the server does.

    python -m visionserve_tools.training.evaluate models/defect-classifier/1

Default test set: held-out synthetic frames (seed and texture parameters unlike training, 640x480
and 1280x1024). ``--data`` evaluates a folder-per-label set of real photos instead. Reports
accuracy per class, a confusion matrix (PNG), robustness to brightness +-30 %, rotation +-10 deg,
Gaussian noise and JPEG quality 60 (applied to the camera frame, before preprocessing), and
single-image CPU latency (onnxruntime, 1 intra-op thread). Writes ``<version>/eval.json`` and
``<out>/confusion_matrix.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from visionserve import imaging
from visionserve.tasks.classification import ClassificationConfig

from . import common
from .common import ScriptError

NOISE_SIGMA = 15.0      # 8-bit levels, added to the camera frame
JPEG_QUALITY = 60


def _brightness(img: np.ndarray, factor: float) -> np.ndarray:
    return np.clip(img.astype(np.float32) * factor + 0.5, 0, 255).astype(np.uint8)


def _rotate(img: np.ndarray, deg: float) -> np.ndarray:
    h, w = img.shape[:2]
    m = cv2.getRotationMatrix2D((w / 2, h / 2), deg, 1.0)
    return cv2.warpAffine(img, m, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT_101)


def _noise(img: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    noisy = img.astype(np.float32) + rng.standard_normal(img.shape, dtype=np.float32) * NOISE_SIGMA
    return np.clip(noisy + 0.5, 0, 255).astype(np.uint8)


def _jpeg(img: np.ndarray) -> np.ndarray:
    _, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
    out = cv2.imdecode(buf, cv2.IMREAD_COLOR)
    assert out is not None  # it decodes what it just encoded
    return out


CONDITIONS = {
    "clean": lambda im, k: im,
    "brightness +30%": lambda im, k: _brightness(im, 1.3),
    "brightness -30%": lambda im, k: _brightness(im, 0.7),
    "rotation +10 deg": lambda im, k: _rotate(im, 10.0),
    "rotation -10 deg": lambda im, k: _rotate(im, -10.0),
    f"gaussian noise sigma {NOISE_SIGMA:g}": lambda im, k: _noise(im, 7919 + k),
    f"jpeg quality {JPEG_QUALITY}": lambda im, k: _jpeg(im),
}


def _frames_chunk(args: tuple) -> tuple[dict[str, list[np.ndarray]], list[str]]:
    """Generate held-out frames start..stop and preprocess each under every condition."""
    seed, sizes, params, spec, start, stop, robustness = args
    imgs, labs = common._synthetic_chunk((seed, sizes, params, spec, start, stop, True))
    out: dict[str, list[np.ndarray]] = {c: [] for c in CONDITIONS}
    for k, img in enumerate(imgs, start):
        for name, fn in CONDITIONS.items():
            if name == "clean" or robustness:
                out[name].append(common.camera_pixels(fn(img, k), spec))
    return out, labs


def heldout_sets(n_per_label: int, seed: int, spec, robustness: bool, workers: int):
    total = n_per_label * len(common.LABELS)
    sizes = ((640, 480), (1280, 1024))
    step = -(-total // (max(workers, 1) * 4))
    jobs = [(seed, sizes, common.synthetic.HELDOUT_PARAMS, spec, a, min(a + step, total),
             robustness) for a in range(0, total, step)]
    sets: dict[str, list[np.ndarray]] = {c: [] for c in CONDITIONS}
    labs: list[str] = []
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_frames_chunk, jobs))
    else:
        results = [_frames_chunk(j) for j in jobs]
    for out, chunk_labs in results:
        for c in CONDITIONS:
            sets[c] += out[c]
        labs += chunk_labs
    targets = np.asarray([common.LABELS.index(x) for x in labs], np.int64)
    return {c: np.stack(v) for c, v in sets.items() if v}, targets


def predict(sess, pixels: np.ndarray, spec) -> tuple[np.ndarray, np.ndarray]:
    logits = np.concatenate([
        sess.run([common.ONNX_OUTPUT],
                 {common.ONNX_INPUT: imaging.normalize(pixels[i:i + 32], spec)})[0]
        for i in range(0, len(pixels), 32)])
    e = np.exp(logits - logits.max(1, keepdims=True))
    return logits.argmax(1), e / e.sum(1, keepdims=True)


def latency(onnx_path: Path, spec, runs: int) -> dict:
    """Single-image onnxruntime CPU latency with one intra-op thread, and the server-side
    preprocessing (JPEG decode + resize + normalise) of one camera frame."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    x = np.zeros((1, spec.channels, spec.height, spec.width), np.float32)
    for _ in range(20):
        sess.run(None, {common.ONNX_INPUT: x})
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, {common.ONNX_INPUT: x})
        times.append((time.perf_counter() - t0) * 1000)
    t = np.asarray(times)
    out: dict[str, Any] = {"model_ms": {"median": round(float(np.median(t)), 3),
                        "p90": round(float(np.percentile(t, 90)), 3),
                        "p99": round(float(np.percentile(t, 99)), 3), "runs": runs}}
    for size in ((640, 480), (1280, 1024)):
        jpg = common.synthetic.encode(common.synthetic.generate("ok", 1, size), "jpeg", 90)
        pt = []
        for _ in range(30):
            t0 = time.perf_counter()
            imaging.normalize(imaging.preprocess(imaging.encoded_frame(jpg), spec)[None], spec)
            pt.append((time.perf_counter() - t0) * 1000)
        out[f"preprocess_jpeg_{size[0]}x{size[1]}_ms"] = round(float(np.median(pt)), 3)
    return out


def confusion_png(cm: np.ndarray, labels, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.8), dpi=100)
    norm = cm / np.maximum(cm.sum(1, keepdims=True), 1)
    ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    for i in range(cm.shape[0]):
        for j in range(cm.shape[1]):
            ax.text(j, i, str(cm[i, j]), ha="center", va="center",
                    color="white" if norm[i, j] > 0.5 else "black", fontsize=10)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("version_dir", type=Path, help="models/<name>/<N> holding model.onnx")
    ap.add_argument("--data", type=Path,
                    help="folder-per-label photos (default: held-out synthetic)")
    ap.add_argument("--n-per-label", type=int, default=100,
                    help="held-out synthetic frames per label")
    ap.add_argument("--seed", type=int, default=common.HELDOUT_SEED)
    ap.add_argument("--out", type=Path,
                    help="where confusion_matrix.png goes (default: the model folder)")
    ap.add_argument("--no-robustness", action="store_true")
    ap.add_argument("--latency-runs", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2,
                    help="onnxruntime threads for the accuracy runs")
    args = ap.parse_args(argv)
    try:
        return evaluate(args)
    except ScriptError as exc:
        return common.fail(exc)


def evaluate(args: argparse.Namespace) -> int:
    import onnxruntime as ort

    onnx_path = args.version_dir / "model.onnx"
    if not onnx_path.is_file():
        raise ScriptError(f"no model.onnx in {args.version_dir}")
    if args.n_per_label < 1:
        raise ScriptError(f"--n-per-label must be >= 1, got {args.n_per_label}")
    cfg = common.read_model_config(args.version_dir.parent)
    if cfg is None:
        raise ScriptError(f"no model.toml in {args.version_dir.parent}")
    if not isinstance(cfg, ClassificationConfig):
        raise ScriptError(f"{args.version_dir.parent}: a {cfg.task} model; this evaluates "
                          "classification models")
    spec, labels = cfg.input, tuple(cfg.output.labels)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])

    t0 = time.perf_counter()
    if args.data is not None:
        ds = common.load_folder(args.data, spec, labels)
        sets, targets = {"clean": ds.pixels}, ds.targets
        test_set = str(args.data)
    else:
        if labels != common.LABELS:
            raise ScriptError(f"model labels {list(labels)} are not the synthetic ones; pass "
                              "--data")
        sets, targets = heldout_sets(args.n_per_label, args.seed, spec, not args.no_robustness,
                                     args.workers)
        test_set = (f"synthetic held-out: {args.n_per_label} per label, seed {args.seed}, "
                    "HELDOUT_PARAMS, 640x480 and 1280x1024 alternating")
    t_data = time.perf_counter() - t0

    results = {}
    for cond, pixels in sets.items():
        preds, probs = predict(sess, pixels, spec)
        results[cond] = common.per_class_accuracy(targets, preds, labels)
        if cond == "clean":
            clean_preds, clean_probs = preds, probs
    cm = common.confusion(targets, clean_preds, len(labels))
    # Verdict view: what the PLC sees (OK vs NG) with the model.toml threshold.
    ok_idx = [labels.index(x) for x in cfg.verdict.ok_labels]
    is_ok_true = np.isin(targets, ok_idx)
    ok_pred = np.isin(clean_preds, ok_idx) & (clean_probs.max(1) >= cfg.verdict.ok_threshold)
    verdict = {"escapes (NG part judged OK)": int((~is_ok_true & ok_pred).sum()),
               "false rejects (OK part judged NG)": int((is_ok_true & ~ok_pred).sum()),
               "parts": len(targets)}
    out_dir = args.out or args.version_dir.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "confusion_matrix.png"
    confusion_png(cm, labels, png, f"{args.version_dir.parent.name} v{args.version_dir.name}: "
                  f"{results['clean']['overall'] * 100:.1f}% on {len(targets)} images")
    lat = latency(onnx_path, spec, args.latency_runs)
    report = {"test_set": test_set, "accuracy": results, "confusion_matrix": cm.tolist(),
              "labels": list(labels), "verdict": verdict, "latency_cpu_1thread": lat,
              "onnx_bytes": onnx_path.stat().st_size, "data_seconds": round(t_data, 1)}
    (args.version_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"test set: {test_set}")
    print("| condition | overall | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 2) + "|")
    for cond, acc in results.items():
        print(f"| {cond} | {acc['overall'] * 100:.1f}% | "
              + " | ".join(f"{acc[x] * 100:.1f}%" for x in labels) + " |")
    print(f"confusion matrix (rows true, cols predicted {list(labels)}):")
    for lab, row in zip(labels, cm):
        print(f"  {lab:>14}: {row.tolist()}")
    print(f"verdict: {verdict}")
    print(f"latency (onnxruntime CPU, 1 thread, batch 1): {lat}")
    print(f"wrote {args.version_dir / 'eval.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
