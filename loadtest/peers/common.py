"""What every peer server does per frame, the same work as visionserve: JPEG decode, resize,
normalise, the model, softmax, verdict. On the CPU (:func:`load`): OpenCV and the ONNX model on
onnxruntime. On a GPU (:func:`load_torch`): the whole batch decoded by nvJPEG
(``torchvision.io.decode_jpeg``), resized and normalised on the device, the model's ``.pt2``
(``torch.export``) in fp16, eager, as one would write it without a serving framework.

Self-contained (numpy, OpenCV, onnxruntime or torch, tomllib): the peers run in their own virtual
environments (or, on the GPU machine, beside the project) without importing visionserve. The
preprocessing follows ``model.toml`` the way ``visionserve.imaging`` does for
``resize = "stretch"`` models (the shipped default and the GPU benchmark's model).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np


@dataclass
class Verdicts:
    """A model's labels and verdict settings (``[output]``, ``[verdict]``, ``[batching]``)."""
    name: str
    labels: list[str]
    ok_labels: set[str]
    ok_threshold: float
    max_batch_size: int
    takt_ms: float

    def verdicts(self, scores: np.ndarray) -> list[tuple[str, str, float]]:
        out = []
        for row in scores:
            t = int(row.argmax())
            label, score = self.labels[t], float(row[t])
            ok = label in self.ok_labels and score >= self.ok_threshold
            out.append(("OK" if ok else "NG", label, score))
        return out


@dataclass
class Model(Verdicts):
    session: object
    in_name: str
    out_name: str
    width: int
    height: int
    rgb: bool
    mul: np.ndarray
    add: np.ndarray
    interpolation: int

    def prepare(self, frames: list[bytes]) -> np.ndarray:
        """Encoded images -> (N, C, H, W) float32 batch; ValueError names an undecodable one."""
        return np.stack([self.preprocess(f) for f in frames])

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


_INTERP = {"area": cv2.INTER_AREA, "linear": cv2.INTER_LINEAR, "nearest": cv2.INTER_NEAREST,
           "cubic": cv2.INTER_CUBIC}


def read(models: Path, name: str, file: str) -> tuple[dict, Path, dict]:
    """``models/name``'s model.toml, its served version's ``file`` and the label settings."""
    folder = Path(models) / name
    cfg = tomllib.loads((folder / "model.toml").read_text())
    inp = cfg["input"]
    if inp.get("resize", "stretch") != "stretch" or inp.get("layout", "NCHW") != "NCHW":
        raise SystemExit(f"{folder}: the peers implement resize=stretch, layout=NCHW only")
    versions = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()
                      and (p / file).is_file())
    if not versions:
        raise SystemExit(f"{folder}: no <version>/{file}")
    version = cfg.get("default_version") or versions[-1]
    b, v = cfg.get("batching", {}), cfg.get("verdict", {})
    labels = {"name": name, "labels": list(cfg["output"]["labels"]),
              "ok_labels": set(v.get("ok_labels", ["ok"])),
              "ok_threshold": float(v.get("ok_threshold", 0.5)),
              "max_batch_size": int(b.get("max_batch_size", 32)),
              "takt_ms": float(b.get("takt_ms", 200.0))}
    return cfg, folder / str(version) / file, labels


def load(models: Path, name: str, intra_op_threads: int = 0) -> Model:
    import onnxruntime as ort

    cfg, path, labels = read(models, name, "model.onnx")
    inp, out = cfg["input"], cfg["output"]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.inter_op_num_threads = 1
    threads = intra_op_threads or cfg.get("runtime", {}).get("intra_op_threads", 0)
    if threads:
        opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    scale = np.float32(inp.get("scale", 1 / 255))
    mean = np.asarray(inp.get("mean", [0, 0, 0]), np.float32)
    std = np.asarray(inp.get("std", [1, 1, 1]), np.float32)
    m = Model(**labels, session=sess, in_name=inp.get("tensor_name") or sess.get_inputs()[0].name,
              out_name=out.get("tensor_name") or sess.get_outputs()[0].name, width=inp["width"],
              height=inp["height"], rgb=inp.get("color_order", "RGB") == "RGB", mul=scale / std, add=mean / std,
              interpolation=_INTERP[inp.get("interpolation", "area")])
    # warm up every batch size the peer may see, as visionserve does before it reports ready
    for bs in sorted({1, 2, 4, 8, 16, 32, m.max_batch_size}):
        if bs <= m.max_batch_size:
            m.run(np.zeros((bs, 3, m.height, m.width), np.float32))
    return m


@dataclass
class TorchModel(Verdicts):
    """The model's ``.pt2`` on a CUDA device in fp16 (channels_last, eager), fed by nvJPEG."""
    net: object
    device: str
    width: int
    height: int
    rgb: bool
    mul: object  # (1, 3, 1, 1) device tensors: x * mul - add
    add: object
    mode: str  # torch.nn.functional.interpolate's mode

    def prepare(self, frames: list[bytes]):
        """Encoded JPEGs -> (N, 3, H, W) fp16 device batch (one nvJPEG call for the batch);
        ValueError names an undecodable one."""
        import torch
        import torchvision

        data = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in frames]
        try:
            images = torchvision.io.decode_jpeg(data, device=self.device)
        except RuntimeError as exc:
            raise ValueError(f"cannot decode the image: {exc}") from None
        out = torch.empty((len(frames), 3, self.height, self.width), dtype=torch.float16,
                          device=self.device)
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, img in enumerate(images):
            by_size.setdefault(tuple(img.shape), []).append(i)
        for rows in by_size.values():  # one resize and one normalisation per frame size
            x = torch.stack([images[i] for i in rows]).float()
            if x.shape[-2:] != (self.height, self.width):
                x = torch.nn.functional.interpolate(x, size=(self.height, self.width),
                                                    mode=self.mode)
            if not self.rgb:
                x = x.flip(1)
            x = x * self.mul - self.add
            if len(rows) == len(frames):
                out.copy_(x)
            else:
                out[torch.tensor(rows, device=self.device)] = x.half()
        return out

    def run(self, batch) -> np.ndarray:
        """(N, C, H, W) device batch -> softmax scores (N, labels) on the host."""
        import torch

        with torch.inference_mode():
            logits = self.net(batch.contiguous(memory_format=torch.channels_last))
            return torch.softmax(logits.float(), dim=1).cpu().numpy()


def load_torch(models: Path, name: str, device: str = "cuda") -> TorchModel:
    import torch

    cfg, path, labels = read(models, name, "model.pt2")
    inp = cfg["input"]
    net = torch.export.load(str(path)).module().to(device).half()
    net = net.to(memory_format=torch.channels_last)
    scale = float(inp.get("scale", 1 / 255))
    mean = torch.tensor(inp.get("mean", [0, 0, 0]), device=device).view(1, 3, 1, 1)
    std = torch.tensor(inp.get("std", [1, 1, 1]), device=device).view(1, 3, 1, 1)
    mode = {"area": "area", "linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}[
        inp.get("interpolation", "area")]
    m = TorchModel(**labels, net=net, device=device, width=inp["width"], height=inp["height"],
                   rgb=inp.get("color_order", "RGB") == "RGB", mul=scale / std, add=mean / std,
                   mode=mode)
    for bs in sorted({1, 2, 4, 8, 16, 32, m.max_batch_size}):  # warm up, as visionserve does
        if bs <= m.max_batch_size:
            m.run(torch.zeros((bs, 3, m.height, m.width), dtype=torch.float16, device=device))
    return m


def load_for(device: str, models: Path, name: str) -> Model | TorchModel:
    """The torch model on a CUDA device, or where the model has a ``.pt2`` and no ``.onnx``;
    else the CPU peers' onnxruntime one."""
    folder = Path(models) / name
    if device.startswith("cuda") or not any(folder.glob("*/model.onnx")):
        return load_torch(models, name, device)
    return load(models, name)


def answer(part_id: str | None, model: str, verdict: tuple[str, str, float], scores: np.ndarray,
           labels: list[str], batch_size: int, deadline_ms: float | None, took_ms: float) -> dict:
    """The same answer shape as visionserve's inspect API."""
    v, label, score = verdict
    return {"part_id": part_id, "model": model, "verdict": v, "label": label, "score": round(score, 6),
            "scores": {k: round(float(s), 6) for k, s in zip(labels, scores)}, "batch_size": batch_size,
            "deadline_met": deadline_ms is None or took_ms <= deadline_ms,
            "timing": {"total_ms": round(took_ms, 3)}}
