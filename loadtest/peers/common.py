"""What every peer server does per frame, the same work as visionserve: JPEG decode, resize,
normalise, the ONNX model on onnxruntime (CPU), softmax, verdict.

Self-contained (numpy, OpenCV, onnxruntime, tomllib): the peers run in their own virtual
environments without visionserve installed. The preprocessing follows ``model.toml`` the way
``visionserve.imaging`` does for ``resize = "stretch"`` models (the shipped default).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np


@dataclass
class Model:
    name: str
    session: object
    in_name: str
    out_name: str
    width: int
    height: int
    rgb: bool
    mul: np.ndarray
    add: np.ndarray
    labels: list[str]
    ok_labels: set[str]
    ok_threshold: float
    max_batch_size: int
    takt_ms: float
    interpolation: int

    def preprocess(self, data: bytes) -> np.ndarray:
        """Encoded image -> CHW float32 tensor (one frame)."""
        img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
        if img is None:
            raise ValueError("cannot decode the image")
        if img.shape[:2] != (self.height, self.width):
            img = cv2.resize(img, (self.width, self.height), interpolation=self.interpolation)
        if self.rgb:
            img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        x = img.astype(np.float32) * self.mul - self.add
        return np.ascontiguousarray(x.transpose(2, 0, 1))

    def run(self, batch: np.ndarray) -> np.ndarray:
        """(N, C, H, W) -> softmax scores (N, labels)."""
        logits = self.session.run([self.out_name], {self.in_name: batch})[0].astype(np.float32)
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(axis=1, keepdims=True)

    def verdicts(self, scores: np.ndarray) -> list[tuple[str, str, float]]:
        out = []
        for row in scores:
            t = int(row.argmax())
            label, score = self.labels[t], float(row[t])
            ok = label in self.ok_labels and score >= self.ok_threshold
            out.append(("OK" if ok else "NG", label, score))
        return out


_INTERP = {"area": cv2.INTER_AREA, "linear": cv2.INTER_LINEAR, "nearest": cv2.INTER_NEAREST,
           "cubic": cv2.INTER_CUBIC}


def load(models: Path, name: str, intra_op_threads: int = 0) -> Model:
    import onnxruntime as ort

    folder = Path(models) / name
    cfg = tomllib.loads((folder / "model.toml").read_text())
    inp, out = cfg["input"], cfg["output"]
    if inp.get("resize", "stretch") != "stretch" or inp.get("layout", "NCHW") != "NCHW":
        raise SystemExit(f"{folder}: the peers implement resize=stretch, layout=NCHW only")
    versions = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()
                      and (p / "model.onnx").is_file())
    if not versions:
        raise SystemExit(f"{folder}: no <version>/model.onnx")
    version = cfg.get("default_version") or versions[-1]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.inter_op_num_threads = 1
    threads = intra_op_threads or cfg.get("runtime", {}).get("intra_op_threads", 0)
    if threads:
        opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(folder / str(version) / "model.onnx"), sess_options=opts,
                                providers=["CPUExecutionProvider"])
    scale = np.float32(inp.get("scale", 1 / 255))
    mean = np.asarray(inp.get("mean", [0, 0, 0]), np.float32)
    std = np.asarray(inp.get("std", [1, 1, 1]), np.float32)
    b = cfg.get("batching", {})
    v = cfg.get("verdict", {})
    m = Model(name=name, session=sess, in_name=inp.get("tensor_name") or sess.get_inputs()[0].name,
              out_name=out.get("tensor_name") or sess.get_outputs()[0].name, width=inp["width"],
              height=inp["height"], rgb=inp.get("color_order", "RGB") == "RGB", mul=scale / std, add=mean / std,
              labels=list(out["labels"]), ok_labels=set(v.get("ok_labels", ["ok"])),
              ok_threshold=float(v.get("ok_threshold", 0.5)), max_batch_size=int(b.get("max_batch_size", 32)),
              takt_ms=float(b.get("takt_ms", 200.0)),
              interpolation=_INTERP[inp.get("interpolation", "area")])
    # warm up every batch size the peer may see, as visionserve does before it reports ready
    for bs in sorted({1, 2, 4, 8, 16, 32, m.max_batch_size}):
        if bs <= m.max_batch_size:
            m.run(np.zeros((bs, 3, m.height, m.width), np.float32))
    return m


def answer(part_id: str | None, model: str, verdict: tuple[str, str, float], scores: np.ndarray,
           labels: list[str], batch_size: int, deadline_ms: float | None, took_ms: float) -> dict:
    """The same answer shape as visionserve's inspect API."""
    v, label, score = verdict
    return {"part_id": part_id, "model": model, "verdict": v, "label": label, "score": round(score, 6),
            "scores": {k: round(float(s), 6) for k, s in zip(labels, scores)}, "batch_size": batch_size,
            "deadline_met": deadline_ms is None or took_ms <= deadline_ms,
            "timing": {"total_ms": round(took_ms, 3)}}
