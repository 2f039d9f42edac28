"""Score an anomaly model as the server would: ``visionserve anomaly evaluate``.

The frames go through the server's own path (:mod:`visionserve.imaging` preprocessing, the
model's backend, the anomaly task's postprocess with the frames' sizes), so the figures are
those of the served model. Reported: image AUROC (raw scores, good against every defect, and
per defect kind), the false-reject and miss rates at the model's verdict settings, and region
IoU: the thresholded map in frame pixels against the generator's defect masks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from visionserve import imaging, tasks
from visionserve.backends import base as backends
from visionserve.backends import checks
from visionserve.repository import load_entry
from visionserve.tasks.geometry import FrameMap

from . import common
from .common import ScriptError

#: pixels sampled per image and side (defect / not) for the pixel AUROC
PIXELS = 2000


def auroc(neg: Sequence[float], pos: Sequence[float]) -> float:
    """Area under the ROC curve: the chance that a positive scores above a negative (ties
    count half), by ranks (Mann-Whitney)."""
    neg_a, pos_a = np.asarray(neg, np.float64), np.asarray(pos, np.float64)
    if not len(neg_a) or not len(pos_a):
        return float("nan")
    allv = np.concatenate([neg_a, pos_a])
    order = allv.argsort(kind="mergesort")
    ranks = np.empty(len(allv), np.float64)
    sorted_v = allv[order]
    i = 0
    while i < len(allv):  # average ranks over ties
        j = i
        while j + 1 < len(allv) and sorted_v[j + 1] == sorted_v[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    r_pos = ranks[len(neg_a):].sum()
    return float((r_pos - len(pos_a) * (len(pos_a) + 1) / 2.0) / (len(pos_a) * len(neg_a)))


def _synthetic(n_per_label: int, sizes: Sequence[tuple[int, int]]):
    """(label, BGR image, defect mask or None) of the held-out synthetic set."""
    syn = common.synthetic
    annotated = getattr(syn, "generate_annotated", None)
    for i in range(n_per_label):
        for label in common.LABELS:
            seed = syn._item_seed(common.HELDOUT_SEED, i)
            size = sizes[i % len(sizes)]
            if annotated is not None:
                img, defects = annotated(label, seed, size, syn.HELDOUT_PARAMS)
                mask = None
                if label != "ok":
                    mask = np.zeros(img.shape[:2], bool)
                    for d in defects:
                        mask |= d.mask
                yield label, img, mask
            else:
                yield label, syn.generate(label, seed, size, syn.HELDOUT_PARAMS), None


def _folder(root: Path):
    files, targets, labels = common.scan_folder(root)
    if "ok" not in labels:
        raise ScriptError(f"{root}: no 'ok' folder: the good images are the negatives")
    for p, t in zip(files, targets):
        data = p.read_bytes()
        try:
            frame = imaging.encoded_frame(data)
            img = imaging.decode(frame, 3)
        except Exception as exc:  # noqa: BLE001 - named in the message
            raise ScriptError(f"{p}: cannot be read: {exc}") from None
        yield labels[t], img[..., ::-1] if img.ndim == 3 else img, None  # RGB -> BGR


def evaluate(model_dir: Path, data: Path | None = None, n_per_label: int = 60,
             sizes: Sequence[tuple[int, int]] = ((640, 480), (1280, 1024)), threads: int = 0,
             batch: int = 8) -> dict[str, Any]:
    entry = load_entry(Path(model_dir))
    config = entry.config
    if config.task != "anomaly":
        raise ScriptError(f"{model_dir} is a {config.task} model, not an anomaly model")
    version = entry.default_version
    path = entry.versions[version]
    cfg = config.model_copy(update={"runtime": config.runtime.model_copy(
        update={"intra_op_threads": threads})})
    backend = backends.create(cfg.runtime.backend)
    backend.load(path, cfg, "cpu")
    task = tasks.create(cfg)
    backend.select_outputs(task.bind(checks.Subject(path), backend.outputs), on_device=False)
    spec = cfg.input
    v = cfg.verdict  # type: ignore[attr-defined]
    items = _folder(data) if data is not None else _synthetic(n_per_label, sizes)
    scores: dict[str, list[float]] = {}
    verdicts: dict[str, list[str]] = {}
    ious: dict[str, list[float]] = {}
    t0 = time.monotonic()
    pending: list[tuple[str, np.ndarray, np.ndarray | None]] = []
    annotated = data is None and hasattr(common.synthetic, "generate_annotated")
    rng = np.random.default_rng(0)
    pix_pos: list[float] = []
    pix_neg: list[float] = []

    def flush() -> None:
        frames = []
        for _, img, _ in pending:
            rgb = np.ascontiguousarray(img[..., ::-1])
            frames.append(imaging.raw_frame(rgb, rgb.shape))
        x = imaging.normalize(np.stack([imaging.preprocess(f, spec) for f in frames]), spec)
        out = backend.run(x)
        sizes_ = [(f.width, f.height) for f in frames]
        for (label, img, mask), (verdict, r) in zip(pending,
                                                    task.postprocess(out, slice(0, len(frames)),
                                                                     sizes_)):
            raw = r.raw_score if np.isfinite(r.raw_score) else r.score
            scores.setdefault(label, []).append(float(raw))
            verdicts.setdefault(label, []).append(verdict)
            if r.map is not None and (mask is not None or label == "ok") and annotated:
                h, w = img.shape[:2]
                frame_map = FrameMap.of(spec, (w, h)).mask(r.map, spec.width, spec.height)
                truth = mask if mask is not None else np.zeros((h, w), bool)
                # pixel AUROC on a sample: the defect's pixels and as many others, per image
                flat, tflat = frame_map.ravel(), truth.ravel()
                on = np.flatnonzero(tflat)
                off = rng.choice(np.flatnonzero(~tflat), size=min(PIXELS, int((~tflat).sum())),
                                 replace=False)
                pix_pos.extend(flat[rng.choice(on, min(PIXELS, len(on)), replace=False)]
                               if len(on) else [])
                pix_neg.extend(flat[off])
                if mask is not None:
                    pred = frame_map >= v.pixel_threshold
                    union = (pred | mask).sum()
                    ious.setdefault(label, []).append(float((pred & mask).sum() / union)
                                                      if union else 1.0)
        pending.clear()

    for item in items:
        pending.append(item)
        if len(pending) >= batch:
            flush()
    if pending:
        flush()
    backend.close()
    good = scores.get("ok", [])
    kinds = [k for k in scores if k != "ok"]
    bad = [s for k in kinds for s in scores[k]]
    report: dict[str, Any] = {
        "model": entry.name, "version": version,
        "data": str(data) if data is not None else
        f"synthetic held-out set (HELDOUT_PARAMS, seed {common.HELDOUT_SEED}), "
        f"{n_per_label} per label, sizes {[f'{w}x{h}' for w, h in sizes]}",
        "images": {k: len(s) for k, s in scores.items()},
        "image_auroc": round(auroc(good, bad), 4),
        "image_auroc_by_kind": {k: round(auroc(good, scores[k]), 4) for k in kinds},
        "verdict": {"image_threshold": v.image_threshold, "pixel_threshold": v.pixel_threshold},
        "false_reject_rate": round(float(np.mean([x == "NG" for x in verdicts.get("ok", [])]))
                                   if good else float("nan"), 4),
        "miss_rate_by_kind": {k: round(float(np.mean([x == "OK" for x in verdicts[k]])), 4)
                              for k in kinds},
        "seconds": round(time.monotonic() - t0, 1),
    }
    if ious:
        allv = [x for k in ious for x in ious[k]]
        report["pixel_auroc"] = round(auroc(pix_neg, pix_pos), 4)
        report["region_iou_mean"] = round(float(np.mean(allv)), 4)
        report["region_iou_by_kind"] = {k: round(float(np.mean(x)), 4) for k, x in ious.items()}
    else:
        report["region_iou_mean"] = None
        report["region_iou_note"] = ("no defect masks: the synthetic generator has no "
                                     "generate_annotated here" if data is None else
                                     "no defect masks for folder data")
    return report
