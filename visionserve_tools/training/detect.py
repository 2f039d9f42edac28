"""Train, export and evaluate the defect detector (``models/defect-detector``).

    nice -n 10 python -m visionserve_tools.training.detect train --version 1
    python -m visionserve_tools.training.detect export models/defect-detector/1
    python -m visionserve_tools.training.detect evaluate models/defect-detector/1
    python -m visionserve_tools.training.detect finetune --data labelled \
        --init models/defect-detector/1/weights.pt --out candidates/c-1 --steps 300

The data are synthetic scenes (:func:`visionserve_tools.synthetic.generate_scene`): a surface
with 0-3 defects of the four kinds, each with the box the generator drew it in. Frames are made
model pixels by the server's own preprocessing (letterbox to the input size, as model.toml says),
so the detector sees in training what it sees when served. The network is
:mod:`.detector` (the team's own); its export is the ``yolo`` format, one output ``[B, 4+nc, A]``
(cx, cy, w, h in input pixels, then the class scores in [0, 1]), which the server's detection
task reads like any third-party YOLO export.

``train`` writes ``<models-dir>/<name>/<N>/`` (weights.pt, model.onnx, model.pt2, metrics.json,
export.json) and the model's model.toml if it has none; ``export`` re-exports a version and checks
it; ``evaluate`` measures mAP on held-out scenes (other seed, ``HELDOUT_PARAMS``, a frame size
training never saw), decoding the ONNX model's output through the server's detection task, and
writes ``<version>/eval.json``; ``finetune`` is the closed loop's (docs/closed-loop.md): from a
version's weights, on labelled frames (``boxes.json`` and the images it names, frame pixels) with
synthetic scenes mixed in as ``--mix-synthetic`` of the training set, for ``--steps`` steps, each
printed as a JSON line (``{"step": i, "steps": N, "loss": ...}``: the job's progress), written
exactly into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from visionserve import imaging
from visionserve.config import InputSpec
from visionserve.tasks.geometry import FrameMap

from . import common, detmap, export
from .common import ScriptError

LABELS = common.synthetic.DEFECT_LABELS
ONNX_OUTPUT = "output0"
DEFAULT_INPUT = common.DEFAULT_INPUT.model_copy(
    update={"width": 320, "height": 320, "resize": "letterbox", "pad_value": 114})
TRAIN_SIZES = "640x480,1280x1024,1024x576"
# 1920x1080 is not among the training sizes: the held-out set includes a frame size never seen
HELDOUT_SIZES = "640x480,1280x1024,1920x1080"
# what the served model.toml says (the verdict's operating point) ...
SCORE_THRESHOLD, IOU_THRESHOLD, MAX_DETECTIONS = 0.25, 0.45, 100
# ... and what mAP is measured with: every detection, as COCO scores them
MAP_SCORE_THRESHOLD = 0.001
# the shipped classifier: its network is the detector's backbone, its weights the start
CLASSIFIER_WEIGHTS = Path("models/defect-classifier/1/weights.pt")
TOLERANCE = 1e-2        # export check: output values are pixels (0..320) and scores
DECODER = "visionserve.tasks.detection (the server's own decoding)"
HISTORY_EVERY = 25      # a fine-tune's metrics.json keeps every 25th step's loss


# --------------------------------------------------------------------------- data


@dataclass
class Scenes:
    pixels: np.ndarray              # N x H x W x C uint8: model input, preprocessed as served
    sizes: list[tuple[int, int]]    # each frame's (width, height)
    boxes: list[np.ndarray]         # [K, 4] float32 x1, y1, x2, y2 in frame pixels
    classes: list[np.ndarray]       # [K] int64, indices into LABELS

    def input_boxes(self, spec: InputSpec, i: int) -> np.ndarray:
        """Scene ``i``'s boxes in model-input pixels (where the letterbox put them)."""
        fm = FrameMap.of(spec, self.sizes[i])
        b = self.boxes[i].astype(np.float32).copy()
        b[:, 0::2] = b[:, 0::2] / fm.scale_x + fm.offset_x
        b[:, 1::2] = b[:, 1::2] / fm.scale_y + fm.offset_y
        return b

    def truths(self) -> list[detmap.ImageTruth]:
        return [detmap.ImageTruth(b, c) for b, c in zip(self.boxes, self.classes)]

    def joined(self, other: Scenes) -> Scenes:
        return Scenes(np.concatenate([self.pixels, other.pixels]), self.sizes + other.sizes,
                      self.boxes + other.boxes, self.classes + other.classes)


def labelled(data: Path, spec: InputSpec, labels: Sequence[str]) -> Scenes:
    """The closed loop's labelled frames of a detector (``data``: ``boxes.json`` and the images
    it names, docs/closed-loop.md) as scenes, each frame preprocessed as the server does."""
    from visionserve.errors import VisionServeError

    index = data / "boxes.json"
    try:
        listed = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise ScriptError(f"{index}: {exc} (the loop's export of a detector's labelled frames: "
                          "boxes.json and images/)") from None
    if not isinstance(listed, dict) or not listed:
        raise ScriptError(f"{index}: no labelled frames")
    out = Scenes(np.zeros((0,)), [], [], [])
    pixels = []
    for rel, items in sorted(listed.items()):
        try:
            frame = imaging.encoded_frame((data / rel).read_bytes())
            pixels.append(imaging.preprocess(frame, spec))
        except OSError as exc:
            raise ScriptError(f"{data / rel}: {exc.strerror or exc}") from None
        except VisionServeError as exc:
            raise ScriptError(f"{data / rel}: {exc.message}") from None
        unknown = sorted({b["label"] for b in items} - set(labels))
        if unknown:
            raise ScriptError(f"{index}: {rel}: labels {unknown} are not the detector's "
                              f"{list(labels)}")
        out.sizes.append((frame.width, frame.height))
        out.boxes.append(np.array([b["box"] for b in items], np.float32).reshape(-1, 4))
        out.classes.append(np.array([list(labels).index(b["label"]) for b in items], np.int64))
    out.pixels = np.stack(pixels)
    return out


def _scene_chunk(args: tuple) -> tuple[list, list, list, list]:
    """Scenes ``start..stop`` of a set: scene i has seed ``_item_seed(seed, i)`` and size
    ``sizes[i % len(sizes)]``, so a chunk is the same whichever process makes it."""
    seed, sizes, params, spec, start, stop = args
    pixels, sz, boxes, classes = [], [], [], []
    for i in range(start, stop):
        size = sizes[i % len(sizes)]
        img, defects = common.synthetic.generate_scene(common.synthetic._item_seed(seed, i), size,
                                                       params)
        pixels.append(common.camera_pixels(img, spec))
        sz.append(size)
        boxes.append(np.array([d.box for d in defects], np.float32).reshape(-1, 4))
        classes.append(np.array([LABELS.index(d.label) for d in defects], np.int64))
    return pixels, sz, boxes, classes


def scenes(n: int, seed: int, sizes: Sequence[tuple[int, int]],
           params: common.synthetic.SurfaceParams, spec: InputSpec, workers: int = 1) -> Scenes:
    """``n`` scenes, made in ``workers`` processes; the same for any ``workers``."""
    sizes = tuple((int(w), int(h)) for w, h in sizes)  # plain tuples: they travel to workers
    step = max(1, -(-n // (max(workers, 1) * 4)))
    jobs = [(seed, sizes, params, spec, a, min(a + step, n)) for a in range(0, n, step)]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            parts = list(pool.map(_scene_chunk, jobs))
    else:
        parts = [_scene_chunk(j) for j in jobs]
    out = Scenes(np.zeros((0,)), [], [], [])
    pixels = []
    for px, sz, bx, cl in parts:
        pixels += px
        out.sizes += sz
        out.boxes += bx
        out.classes += cl
    out.pixels = np.stack(pixels)
    return out


def augment(px: np.ndarray, boxes: np.ndarray, rng: np.random.Generator
            ) -> tuple[np.ndarray, np.ndarray]:
    """One square uint8 input image and its input-pixel boxes: flips, a transpose (a portrait
    frame's letterbox), sometimes a JPEG re-encode."""
    size = px.shape[1]
    b = boxes.copy()
    if rng.random() < 0.5:
        px = px[:, ::-1]
        b[:, [0, 2]] = size - b[:, [2, 0]]
    if rng.random() < 0.5:
        px = px[::-1]
        b[:, [1, 3]] = size - b[:, [3, 1]]
    if rng.random() < 0.25:
        px = px.transpose(1, 0, 2)
        b = b[:, [1, 0, 3, 2]]
    px = np.ascontiguousarray(px)
    if rng.random() < 0.2:
        _, buf = cv2.imencode(".jpg", px, [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(50, 96))])
        decoded = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
        assert decoded is not None  # it decodes what it just encoded
        px = decoded.reshape(px.shape)
    return px, b


# --------------------------------------------------------------------------- decoding


def decode(out: np.ndarray, score_threshold: float, iou_threshold: float,
           max_dets: int = MAX_DETECTIONS) -> list[detmap.ImageDetections]:
    """Raw ``[B, 4+nc, A]`` output -> per image: each anchor's best class above the threshold,
    class-aware NMS (torchvision), the best ``max_dets``; boxes in input pixels. Training's
    validation uses it; served answers come from the server's detection task."""
    import torch
    from torchvision.ops import batched_nms

    res = []
    for o in out:
        scores_all = o[4:]
        cls = scores_all.argmax(0)
        score = scores_all[cls, np.arange(o.shape[1])]
        keep = score > score_threshold
        cx, cy, w, h = (o[k, keep] for k in range(4))
        boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
        s, c = score[keep], cls[keep]
        idx = batched_nms(torch.from_numpy(boxes).float(), torch.from_numpy(s).float(),
                          torch.from_numpy(c), iou_threshold).numpy()[:max_dets]
        res.append(detmap.ImageDetections(boxes[idx], s[idx], c[idx]))
    return res


# --------------------------------------------------------------------------- model files


def load_detector(path: Path):
    """weights.pt -> (eval-mode Detector, meta dict)."""
    import torch

    from .detector import Detector

    if not Path(path).is_file():
        raise ScriptError(f"no weights file at {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    meta = json.loads(ckpt["meta"])
    if meta.get("kind") != "detector":
        raise ScriptError(f"{path} holds no detector (a classifier's weights?)")
    spec = InputSpec(**meta["input"])
    model = Detector(len(meta["labels"]), spec.width, spec.height, meta["widths"], meta["top"],
                     meta["neck"], spec.channels)
    model.load_state_dict(ckpt["state_dict"])
    return model.eval(), meta


def write_model_toml(model_dir: Path, spec: InputSpec) -> None:
    text = f"""# Written by visionserve_tools.training.detect; docs/model-toml.md has every field.
name = "{model_dir.name}"
description = "Surface defect detector trained with visionserve_tools.training.detect"
task = "detection"

{common.input_section(spec)}
[output]
format = "yolo"
tensor_name = "{ONNX_OUTPUT}"
labels = {common.toml_list(LABELS)}
score_threshold = {SCORE_THRESHOLD}
iou_threshold = {IOU_THRESHOLD}
class_agnostic_nms = false
max_detections = {MAX_DETECTIONS}
"""
    (model_dir / "model.toml").write_text(text)
    common.read_model_config(model_dir)  # refuse to leave an invalid file behind


def check_inputs(spec: InputSpec, n: int) -> np.ndarray:
    """Held-out scenes as model tensors: what the export check runs on."""
    ds = scenes(n, common.HELDOUT_SEED, common.parse_sizes(HELDOUT_SIZES),
                common.synthetic.HELDOUT_PARAMS, spec)
    return imaging.normalize(ds.pixels, spec)


def export_version(version_dir: Path, check_x: np.ndarray, tolerance: float = TOLERANCE) -> dict:
    model, _ = load_detector(version_dir / "weights.pt")
    return export.export_checked(model, version_dir, check_x, tolerance, ONNX_OUTPUT)


# --------------------------------------------------------------------------- train


class _Ema:
    """Exponential moving average of the weights (and BN statistics) over about the last
    ``steps`` updates: the weights shipped. The decay ramps up from 0, so the average forgets
    the start."""

    def __init__(self, model, steps: float) -> None:
        import copy

        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.steps, self.updates = steps, 0

    def update(self, model) -> None:
        import math

        import torch

        self.updates += 1
        d = (1 - 1 / self.steps) * (1 - math.exp(-self.updates / self.steps))
        with torch.no_grad():
            src = model.state_dict()
            for k, v in self.model.state_dict().items():
                if v.dtype.is_floating_point:
                    v.mul_(d).add_(src[k].detach(), alpha=1 - d)
                else:
                    v.copy_(src[k])


def predict(model, pixels: np.ndarray, spec: InputSpec, batch: int = 32) -> np.ndarray:
    """Eager model on uint8 input pixels -> raw ``[N, 4+nc, A]``."""
    import torch

    model.eval()
    with torch.no_grad():
        return np.concatenate([model(torch.from_numpy(imaging.normalize(pixels[i:i + batch],
                                                                        spec))).numpy()
                               for i in range(0, len(pixels), batch)])


def batch(ds: Scenes, boxes: Sequence[np.ndarray], idx: np.ndarray, rng: np.random.Generator,
          gen: Any, spec: InputSpec, device: str = "cpu") -> tuple[Any, Any]:
    """A training batch: scenes ``idx`` of ``ds`` augmented (:func:`augment`, then the
    classifier's photometric changes), normalised as served; and their boxes (``boxes``: each
    scene's in input pixels)."""
    import torch

    from . import detector
    from .train import photometric

    pxs, bxs = zip(*(augment(ds.pixels[i], boxes[i], rng) for i in idx))
    x = photometric(torch.from_numpy(np.stack(pxs)).float(), gen).numpy()
    x = torch.from_numpy(imaging.normalize(x, spec)).contiguous(memory_format=torch.channels_last)
    gt = detector.Targets([torch.from_numpy(v) for v in bxs],
                          [torch.from_numpy(ds.classes[i]) for i in idx])
    return x.to(device), gt.to(device)


def fit_step(model, opt, x, gt) -> tuple[float, dict[str, float]]:
    """One optimizer step on a batch; (its loss, the loss's parts)."""
    import torch

    from . import detector

    total, parts = detector.loss(model, x, gt)
    opt.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    opt.step()
    return float(total.detach()), parts


def train(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from . import detector

    for name in ("scenes", "val_scenes", "epochs", "batch_size", "threads", "workers",
                 "check_scenes"):
        if getattr(args, name) < 1:
            raise ScriptError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model_dir = args.models_dir / args.name
    common.check_new_version(model_dir, args.version)
    if args.input_size % 32:
        raise ScriptError(f"--input-size {args.input_size}: must be a multiple of 32")
    widths = tuple(int(v) for v in args.widths.split(","))
    if len(widths) != 4:
        raise ScriptError(f"--widths: four numbers (strides 2 to 16), got {args.widths!r}")
    classifier = None
    if args.init_backbone is not None:
        classifier, cmeta = common.load_checkpoint(args.init_backbone)
        if tuple(cmeta["widths"]) != widths:
            raise ScriptError(f"--init-backbone {args.init_backbone}: its widths "
                              f"{cmeta['widths']} are not --widths {list(widths)}")
    common.set_determinism(args.seed, args.threads)
    t_start = time.perf_counter()
    spec = DEFAULT_INPUT.model_copy(update={"width": args.input_size, "height": args.input_size})
    sizes = common.parse_sizes(args.sizes)
    train_ds = scenes(args.scenes, args.seed, sizes, common.synthetic.TRAIN_PARAMS, spec,
                      args.workers)
    val_ds = scenes(args.val_scenes, common.VALIDATION_SEED + args.seed * 1000, sizes,
                    common.synthetic.TRAIN_PARAMS, spec, args.workers)
    check_x = check_inputs(spec, args.check_scenes)
    train_boxes = [train_ds.input_boxes(spec, i) for i in range(args.scenes)]
    val_truth = [detmap.ImageTruth(val_ds.input_boxes(spec, i), val_ds.classes[i])
                 for i in range(args.val_scenes)]
    t_data = time.perf_counter() - t_start
    n_boxes = sum(len(b) for b in train_boxes)
    print(f"data ready: {args.scenes} training scenes ({n_boxes} defects), {args.val_scenes} "
          f"validation ({t_data:.0f} s)", flush=True)

    model = detector.Detector(len(LABELS), spec.width, spec.height, widths, args.top, args.neck,
                              spec.channels)
    if classifier is not None:
        detector.init_backbone(model, classifier)
    model.to(memory_format=torch.channels_last)  # ~20 % faster convolutions on the CPU
    steps_per_epoch = max(1, args.scenes // args.batch_size)
    # the average spans about the last tenth of training
    ema = _Ema(model, max(20.0, args.epochs * steps_per_epoch / 10))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=steps_per_epoch, pct_start=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    history = []
    for epoch in range(args.epochs):
        model.train()
        rng = np.random.default_rng([args.seed, epoch])
        order = rng.permutation(args.scenes)
        t0, sums, seen = time.perf_counter(), {"loss": 0.0, "cls": 0.0, "box": 0.0}, 0
        for b in range(steps_per_epoch):
            idx = np.sort(order[b * args.batch_size:(b + 1) * args.batch_size])
            total, parts = fit_step(model, opt, *batch(train_ds, train_boxes, idx, rng, gen, spec))
            sched.step()
            ema.update(model)
            sums["loss"] += total
            sums["cls"] += parts["cls"]
            sums["box"] += parts["box"]
            seen += 1
        val = detmap.evaluate(decode(predict(ema.model, val_ds.pixels, spec),
                                     MAP_SCORE_THRESHOLD, IOU_THRESHOLD), val_truth, LABELS)
        history.append({"epoch": epoch + 1, **{k: round(v / seen, 4) for k, v in sums.items()},
                        "val_mAP@0.5": val["mAP@0.5"], "val_mAP@0.5:0.95": val["mAP@0.5:0.95"],
                        "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(history[-1]), flush=True)
    t_train = time.perf_counter() - t_start - t_data

    version_dir = common.make_version_dir(model_dir, args.version)
    final = ema.model.cpu().eval()
    meta = {"kind": "detector", "labels": list(LABELS), "widths": list(widths), "top": args.top,
            "neck": args.neck, "input": spec.model_dump(mode="json"), "seed": args.seed,
            "init_backbone": str(args.init_backbone) if args.init_backbone else None}
    torch.save({"state_dict": final.state_dict(), "meta": json.dumps(meta)},
               version_dir / "weights.pt")
    if not (model_dir / "model.toml").is_file():
        write_model_toml(model_dir, spec)
    report = export_version(version_dir, check_x)
    metrics = {
        "command": "python -m visionserve_tools.training.detect " + shlex.join(argv),
        "train_scenes": args.scenes, "train_defects": n_boxes, "val_scenes": args.val_scenes,
        "sizes": [list(s) for s in sizes], "labels": list(LABELS), "input": meta["input"],
        "widths": list(widths), "top": args.top, "neck": args.neck,
        "init_backbone": meta["init_backbone"], "history": history, "final_val": history[-1],
        **common.run_facts(final, args.threads, t_start, t_data, t_train),
        "export": report,
    }
    (version_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"wrote {version_dir} (val mAP@0.5 {history[-1]['val_mAP@0.5']}, "
          f"{metrics['seconds']['total']:.0f} s)")
    return 0


# --------------------------------------------------------------------------- fine-tune


def finetune(args: argparse.Namespace, argv: list[str]) -> int:
    """The closed loop's fine-tune: from ``--init`` on the labelled frames of ``--data``, the
    synthetic scenes mixed in, for ``--steps`` steps, written exactly into ``--out``."""
    if args.steps < 1 or args.batch_size < 1 or args.threads < 1 or args.workers < 1:
        raise ScriptError("--steps, --batch-size, --threads and --workers must be >= 1")
    if not 0.0 <= args.mix_synthetic < 1.0:
        raise ScriptError(f"--mix-synthetic must be from 0 to below 1, got {args.mix_synthetic}")
    if args.keep_batch_norm and args.freeze_backbone:
        raise ScriptError("--keep-batch-norm trains every layer, --freeze-backbone the layers "
                          "after the backbone: pass one of them")
    if (args.out / "weights.pt").exists():
        raise ScriptError(f"--out {args.out} already holds weights.pt; not overwriting it")
    t_start = time.perf_counter()
    model, meta = load_detector(args.init)
    spec = InputSpec(**meta["input"])
    own = labelled(args.data, spec, meta["labels"])
    n_own = len(own.sizes)
    n_syn = round(n_own * args.mix_synthetic / (1.0 - args.mix_synthetic))
    ds = own.joined(scenes(n_syn, args.seed + 7, common.parse_sizes(TRAIN_SIZES),
                           common.synthetic.TRAIN_PARAMS, spec, args.workers)) if n_syn else own
    boxes = [ds.input_boxes(spec, i) for i in range(len(ds.sizes))]
    check_x = check_inputs(spec, args.check_scenes)
    t_data = time.perf_counter() - t_start
    print(f"data ready: {n_own} labelled frames, {n_syn} synthetic scenes ({t_data:.0f} s)",
          flush=True)

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ScriptError(f"--device {args.device}: CUDA is not available here")
    common.set_determinism(args.seed, args.threads)
    model.to(args.device, memory_format=torch.channels_last)
    if args.freeze_backbone:
        model.backbone.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps,
                                                pct_start=0.15)
    gen = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    n = len(ds.sizes)
    order = np.concatenate([rng.permutation(n)
                            for _ in range(-(-args.steps * args.batch_size // n))])
    model.train()
    if args.freeze_backbone or args.keep_batch_norm:
        model.backbone.eval()  # its batch-norm statistics stay the served version's
    history = []
    for b in range(args.steps):
        idx = np.sort(order[b * args.batch_size:(b + 1) * args.batch_size])
        total, parts = fit_step(model, opt, *batch(ds, boxes, idx, rng, gen, spec, args.device))
        sched.step()
        line = {"step": b + 1, "steps": args.steps, "loss": round(total, 4),
                **{k: round(v, 4) for k, v in parts.items()}}
        print(json.dumps(line), flush=True)
        if (b + 1) % HISTORY_EVERY == 0 or b + 1 == args.steps:
            history.append(line)
    t_train = time.perf_counter() - t_start - t_data

    args.out.mkdir(parents=True, exist_ok=True)
    final = model.cpu().eval()
    meta = {**meta, "seed": args.seed, "init": str(args.init)}
    torch.save({"state_dict": final.state_dict(), "meta": json.dumps(meta)},
               args.out / "weights.pt")
    report = export_version(args.out, check_x)
    metrics = {
        "command": "python -m visionserve_tools.training.detect " + shlex.join(argv),
        "data": str(args.data), "init": str(args.init), "train_images": n_own,
        "synthetic_scenes": n_syn, "mix_synthetic": args.mix_synthetic, "steps": args.steps,
        "lr": args.lr, "freeze_backbone": args.freeze_backbone,
        "keep_batch_norm": args.keep_batch_norm, "history": history, "device": args.device,
        **common.run_facts(final, args.threads, t_start, t_data, t_train), "export": report,
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"wrote {args.out} (last loss {history[-1]['loss']}, "
          f"{metrics['seconds']['total']:.0f} s)")
    return 0


# --------------------------------------------------------------------------- evaluate


def served_decoder(version_dir: Path, onnx_outputs: Sequence[Any]) -> tuple[Any, float]:
    """The server's detection task for this version, bound to the ONNX model's outputs as the
    server binds it, with the score threshold lowered to :data:`MAP_SCORE_THRESHOLD` (mAP scores
    every detection); and the served score threshold (model.toml's)."""
    from visionserve import tasks
    from visionserve.backends.checks import Subject, TensorSpec
    from visionserve.errors import VisionServeError

    try:
        cfg = common.read_model_config(version_dir.parent)
        if cfg is None:
            raise ScriptError(f"no model.toml in {version_dir.parent}")
        if cfg.task != "detection":
            raise ScriptError(f"{version_dir.parent}: a {cfg.task} model; this evaluates "
                              "detectors")
        output: Any = cfg.output  # type: ignore[attr-defined]  # the detection schema's section
        low = cfg.model_copy(update={"output": output.model_copy(
            update={"score_threshold": MAP_SCORE_THRESHOLD, "max_detections": MAX_DETECTIONS})})
        task = tasks.create(low)
        task.bind(Subject(version_dir / "model.onnx"),
                  [TensorSpec(o.name, tuple(o.shape), "float32") for o in onnx_outputs])
    except VisionServeError as exc:
        raise ScriptError(exc.message) from None
    return task, float(output.score_threshold)


def evaluate(args: argparse.Namespace) -> int:
    import onnxruntime as ort

    from .evaluate import latency

    version_dir = args.version_dir
    onnx_path = version_dir / "model.onnx"
    if not onnx_path.is_file():
        raise ScriptError(f"no model.onnx in {version_dir}")
    if args.scenes < 1:
        raise ScriptError(f"--scenes must be >= 1, got {args.scenes}")
    _, meta = load_detector(version_dir / "weights.pt")
    spec = InputSpec(**meta["input"])
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    task, threshold = served_decoder(version_dir, sess.get_outputs())

    t0 = time.perf_counter()
    sizes = common.parse_sizes(args.sizes)
    ds = scenes(args.scenes, args.seed, sizes, common.synthetic.HELDOUT_PARAMS, spec,
                args.workers)
    t_data = time.perf_counter() - t0
    out = np.concatenate([
        sess.run([ONNX_OUTPUT], {common.ONNX_INPUT: imaging.normalize(ds.pixels[i:i + 16],
                                                                      spec)})[0]
        for i in range(0, len(ds.pixels), 16)])
    dets = []
    for i in range(0, len(out), 32):
        chunk = out[i:i + 32]
        for _, res in task.postprocess({ONNX_OUTPUT: chunk}, slice(0, len(chunk)),
                                       ds.sizes[i:i + 32]):
            d = res.detections
            dets.append(detmap.ImageDetections(
                np.array([x.box for x in d], np.float32).reshape(-1, 4),
                np.array([x.score for x in d], np.float32),
                np.array([x.index for x in d], np.int64)))
    result = detmap.evaluate(dets, ds.truths(), LABELS)
    served = operating_point(dets, ds.truths(), threshold)
    per_size = {f"{w}x{h}": detmap.evaluate(
        [d for d, s in zip(dets, ds.sizes) if s == (w, h)],
        [t for t, s in zip(ds.truths(), ds.sizes) if s == (w, h)], LABELS)["mAP@0.5"]
        for w, h in sizes}
    lat = latency(onnx_path, spec, args.latency_runs)
    report = {
        "test_set": (f"synthetic held-out scenes: {args.scenes}, seed {args.seed}, "
                     f"HELDOUT_PARAMS, sizes {args.sizes} alternating"),
        "command": "python -m visionserve_tools.training.detect evaluate " + shlex.join(
            args.argv),
        "decoder": DECODER, **result, "mAP@0.5 by frame size": per_size,
        f"at score_threshold {threshold:g}, IoU 0.5": served,
        "latency_cpu_1thread": lat, "onnx_bytes": onnx_path.stat().st_size,
        "data_seconds": round(t_data, 1),
    }
    (version_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"test set: {report['test_set']}\ndecoder: {DECODER}")
    print(f"mAP@0.5 {result['mAP@0.5']}  mAP@0.5:0.95 {result['mAP@0.5:0.95']}")
    print("| class | defects | AP@0.5 | AP@0.5:0.95 |\n|---|---|---|---|")
    for lab in LABELS:
        print(f"| {lab} | {result['truth'][lab]} | {result['AP@0.5'][lab]} | "
              f"{result['AP@0.5:0.95'][lab]} |")
    print(f"mAP@0.5 by frame size: {per_size}")
    print(f"at the served threshold {threshold:g}: {served}")
    print(f"latency (onnxruntime CPU, 1 thread, batch 1): {lat}")
    print(f"wrote {version_dir / 'eval.json'}")
    return 0


def operating_point(dets: Sequence[detmap.ImageDetections],
                    truths: Sequence[detmap.ImageTruth], threshold: float) -> dict:
    """What the served model answers at ``threshold``: precision and recall of the boxes (same
    class, IoU >= 0.5), and per scene whether it says 'defect' when there is one."""
    tp = fp = n_truth = 0
    missed_scenes = false_scenes = defect_scenes = 0
    for d, t in zip(dets, truths):
        keep = d.scores >= threshold
        hits = np.zeros(int(keep.sum()), bool)
        for c in np.unique(np.concatenate([d.classes[keep], t.classes])):
            mine = np.flatnonzero(d.classes[keep] == c)
            mine = mine[np.argsort(-d.scores[keep][mine], kind="mergesort")]
            iou = detmap.iou_matrix(d.boxes[keep][mine], t.boxes[t.classes == c])
            hits[mine] = detmap._match(iou, 0.5)
        tp += int(hits.sum())
        fp += int((~hits).sum())
        n_truth += len(t.classes)
        defect_scenes += bool(len(t.classes))
        missed_scenes += bool(len(t.classes)) and not keep.any()
        false_scenes += (not len(t.classes)) and bool(keep.any())
    return {"precision": round(tp / max(tp + fp, 1), 4), "recall": round(tp / max(n_truth, 1), 4),
            "defect scenes with no detection": missed_scenes, "defect scenes": defect_scenes,
            "clean scenes with a detection": false_scenes,
            "clean scenes": len(truths) - defect_scenes}


# --------------------------------------------------------------------------- command line


def _path_or_none(text: str) -> Path | None:
    return None if text.lower() == "none" else Path(text)


def main(argv: list[str] | None = None) -> int:
    from . import detector

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train, export and check a new version")
    tr.add_argument("--name", default="defect-detector", help="model name (folder)")
    tr.add_argument("--models-dir", type=Path, default=Path("models"))
    tr.add_argument("--scenes", type=int, default=1600, help="synthetic training scenes")
    tr.add_argument("--val-scenes", type=int, default=100,
                    help="synthetic validation scenes (training params, other seed)")
    tr.add_argument("--sizes", default=TRAIN_SIZES, help="frame sizes, alternating")
    tr.add_argument("--input-size", type=int, default=DEFAULT_INPUT.width,
                    help="model input width = height (multiple of 32)")
    tr.add_argument("--widths", default=",".join(str(w) for w in detector.DEFAULT_WIDTHS),
                    help="backbone channels at strides 2, 4, 8, 16 (the classifier's)")
    tr.add_argument("--top", type=int, default=detector.DEFAULT_TOP,
                    help="channels of the stride-32 stage")
    tr.add_argument("--init-backbone", type=_path_or_none, default=CLASSIFIER_WEIGHTS,
                    help="classifier weights.pt the backbone starts from ('none': random)")
    tr.add_argument("--neck", type=int, default=detector.DEFAULT_NECK,
                    help="pyramid and head channels")
    tr.add_argument("--epochs", type=int, default=8)
    tr.add_argument("--batch-size", type=int, default=16)
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    tr.add_argument("--workers", type=int, default=2, help="processes generating scenes")
    tr.add_argument("--version", type=int, help="version to write (default: highest + 1)")
    tr.add_argument("--check-scenes", type=int, default=16,
                    help="held-out scenes for the export agreement check")
    ft = sub.add_parser("finetune", help="the closed loop's fine-tune of a version on labelled "
                        "frames (boxes.json and images/), written into one folder")
    ft.add_argument("--data", type=Path, required=True,
                    help="the labelled frames: boxes.json and the images it names")
    ft.add_argument("--init", type=Path, required=True, help="the detector's weights.pt")
    ft.add_argument("--out", type=Path, required=True, help="the folder the version is written to")
    ft.add_argument("--steps", type=int, default=300, help="optimizer steps")
    ft.add_argument("--lr", type=float, default=1e-3)
    ft.add_argument("--mix-synthetic", type=float, default=0.5,
                    help="the share of synthetic scenes (the original data) in the training set")
    ft.add_argument("--keep-batch-norm", action="store_true",
                    help="train every layer, the backbone's batch-norm statistics kept")
    ft.add_argument("--freeze-backbone", action="store_true",
                    help="train the layers after the backbone only")
    ft.add_argument("--batch-size", type=int, default=16)
    ft.add_argument("--seed", type=int, default=0)
    ft.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ft.add_argument("--workers", type=int, default=1, help="processes generating scenes")
    ft.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ft.add_argument("--check-scenes", type=int, default=8,
                    help="held-out scenes for the export agreement check")
    ex = sub.add_parser("export", help="re-export a version's weights.pt and check it")
    ex.add_argument("version_dir", type=Path)
    ex.add_argument("--check-scenes", type=int, default=16)
    ex.add_argument("--tolerance", type=float, default=TOLERANCE)
    ev = sub.add_parser("evaluate", help="mAP on held-out scenes, decoded as served")
    ev.add_argument("version_dir", type=Path)
    ev.add_argument("--scenes", type=int, default=600, help="held-out scenes")
    ev.add_argument("--seed", type=int, default=common.HELDOUT_SEED)
    ev.add_argument("--sizes", default=HELDOUT_SIZES, help="frame sizes, alternating")
    ev.add_argument("--threads", type=int, default=2, help="onnxruntime threads")
    ev.add_argument("--workers", type=int, default=2, help="processes generating scenes")
    ev.add_argument("--latency-runs", type=int, default=300)
    args = ap.parse_args(argv)
    args.argv = argv[1:]
    try:
        if args.command == "train":
            return train(args, argv)
        if args.command == "finetune":
            return finetune(args, argv)
        if args.command == "export":
            _, meta = load_detector(args.version_dir / "weights.pt")
            x = check_inputs(InputSpec(**meta["input"]), args.check_scenes)
            print(json.dumps(export_version(args.version_dir, x, args.tolerance), indent=2))
            return 0
        return evaluate(args)
    except ScriptError as exc:
        return common.fail(exc)
    except export.ExportMismatch as exc:
        print(f"error: EXPORT CHECK FAILED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
