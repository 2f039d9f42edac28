"""What the model scripts share: the network, dataset loading, and the way to the server's
preprocessing.

Every frame becomes model pixels through the server's own functions in
:mod:`visionserve.imaging` (decode -> resize by ``input.resize``/``input.interpolation`` on the
uint8 image -> ``input.color_order``; then ``imaging.normalize``: float32 ``* scale/std -
mean/std`` -> ``input.layout``), so a model trained here sees when served the tensors it was
trained on.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from visionserve import imaging
from visionserve.config import InputSpec, ModelConfig
from visionserve.errors import VisionServeError

from .. import synthetic

LABELS = synthetic.LABELS
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
HELDOUT_SEED = 2026          # held-out set: other seed AND other texture params than training
VALIDATION_SEED = 1          # used during training (training params, other seed)
DEFAULT_WIDTHS = (16, 32, 64, 128)

# The input section every model trained here gets (written into model.toml for new models).
DEFAULT_INPUT = InputSpec(
    name="image", width=160, height=160, channels=3, color_order="RGB", resize="stretch",
    interpolation="area", layout="NCHW", dtype="float32", scale=1.0 / 255.0,
    mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), tensor_name="input",
)
ONNX_INPUT, ONNX_OUTPUT = "input", "logits"


class ScriptError(Exception):
    """Bad input to a script: the message is printed as ``error: ...`` and the exit code is 2."""


def fail(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- preprocessing
# No preprocessing code of its own: the server's functions (visionserve.imaging) make every tensor
# a model sees here, so training, export checks and evaluation cannot drift from serving.


def camera_pixels(img_bgr: np.ndarray, spec: InputSpec) -> np.ndarray:
    """A camera frame held as BGR uint8 pixels (a synthetic image, or one after evaluate.py's
    brightness/rotation/noise) -> uint8 HxWxC at model size: the server's path for a raw frame
    (:func:`visionserve.imaging.raw_frame`, RGB as clients send it, then
    :func:`visionserve.imaging.preprocess`)."""
    rgb = np.ascontiguousarray(img_bgr[..., ::-1]) if img_bgr.ndim == 3 else img_bgr[..., None]
    return imaging.preprocess(imaging.raw_frame(rgb, rgb.shape), spec)


def file_pixels(path: Path, spec: InputSpec) -> np.ndarray | str:
    """An image file -> uint8 HxWxC at model size, as the server treats the same bytes uploaded
    (:func:`visionserve.imaging.encoded_frame`, :func:`visionserve.imaging.preprocess`); or why
    it cannot be read (the server's own reason for refusing it)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        return imaging.preprocess(imaging.encoded_frame(data), spec)
    except VisionServeError as exc:
        return exc.message


def preprocess(images_bgr: Sequence[np.ndarray], spec: InputSpec) -> np.ndarray:
    """BGR uint8 camera frames -> the batch tensor the server builds from them."""
    return imaging.normalize(np.stack([camera_pixels(im, spec) for im in images_bgr]), spec)


# --------------------------------------------------------------------------- network


def build_model(num_classes: int, widths: Sequence[int] = DEFAULT_WIDTHS, in_channels: int = 3):
    """Compact CNN: a stride-2 stem, then per stage a stride-2 conv and a stride-1 conv
    (conv-BN-ReLU), global average pooling, dropout, linear. Thin defects (scratches a pixel wide
    at model resolution) need the first stage at full stem resolution, hence stride 1 there."""
    from torch import nn

    def cbr(cin: int, cout: int, stride: int) -> list:
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]

    layers = cbr(in_channels, widths[0], 2)
    prev = widths[0]
    for i, c in enumerate(widths):
        layers += cbr(prev, c, 1 if i == 0 else 2) + cbr(c, c, 1)
        prev = c
    return nn.Sequential(
        nn.Sequential(*layers), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1),
        nn.Linear(prev, num_classes))


def count_macs(widths: Sequence[int], width: int, height: int, in_channels: int = 3) -> int:
    """Multiply-accumulates of one forward pass (convs + linear), for the model card."""
    macs, h, w, prev = 0, -(-height // 2), -(-width // 2), widths[0]
    macs += h * w * widths[0] * in_channels * 9
    for i, c in enumerate(widths):
        if i:
            h, w = -(-h // 2), -(-w // 2)
        macs += h * w * c * prev * 9 + h * w * c * c * 9
        prev = c
    return macs + prev * 8


def set_determinism(seed: int, threads: int) -> None:
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def load_checkpoint(path: Path):
    """weights.pt -> (eval-mode torch model, meta dict)."""
    import torch

    if not Path(path).is_file():
        raise ScriptError(f"no weights file at {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    meta = json.loads(ckpt["meta"])
    model = build_model(len(meta["labels"]), meta["widths"], InputSpec(**meta["input"]).channels)
    model.load_state_dict(ckpt["state_dict"])
    return model.eval(), meta


# --------------------------------------------------------------------------- data


@dataclass
class Dataset:
    pixels: np.ndarray         # N x H x W x C uint8 at model resolution
    targets: np.ndarray        # N int64
    labels: tuple[str, ...]
    names: list[str]           # file names (or synthetic ids) for error messages


def scan_folder(root: Path, labels: Sequence[str] | None = None,
                ) -> tuple[list[Path], list[int], tuple[str, ...]]:
    """Folder-per-label layout -> (files, label indices, labels). ``labels`` pins the label set
    and order (e.g. the shipped model's); otherwise the sorted folder names are the labels."""
    root = Path(root)
    if not root.is_dir():
        raise ScriptError(f"dataset folder {root} does not exist or is not a folder")
    entries = [p for p in sorted(root.iterdir()) if not p.name.startswith(".")]
    loose = [p.name for p in entries if p.is_file()]
    folders = [p for p in entries if p.is_dir()]
    if not entries:
        raise ScriptError(f"dataset folder {root} is empty; expected one sub-folder per label "
                          f"(e.g. {root}/ok/, {root}/scratch/) holding PNG/JPEG/BMP images")
    if loose:
        raise ScriptError(f"{root} has files outside label folders: {', '.join(loose[:10])}; "
                          "expected one sub-folder per label holding the images")
    names = [p.name for p in folders]
    if labels is None:
        labels = tuple(names)
    else:
        labels = tuple(labels)
        unknown = [n for n in names if n not in labels]
        if unknown:
            raise ScriptError(f"{root}: label folder(s) {unknown} are not labels of this model "
                              f"{list(labels)}")
    if len(labels) < 2:
        raise ScriptError(f"{root}: need at least two label folders, found {names}")
    files: list[Path] = []
    targets: list[int] = []
    problems: list[str] = []
    for folder in folders:
        imgs = []
        for p in sorted(folder.rglob("*")):
            if p.is_dir() or any(part.startswith(".") for part in p.relative_to(folder).parts):
                continue
            if p.suffix.lower() not in IMAGE_SUFFIXES:
                problems.append(f"{p.relative_to(root)} (not .png/.jpg/.jpeg/.bmp)")
                continue
            imgs.append(p)
        if not imgs:
            problems.append(f"{folder.name}/ (no images)")
        files += imgs
        targets += [labels.index(folder.name)] * len(imgs)
    if problems:
        raise ScriptError(f"{root}: {len(problems)} problem(s): " + "; ".join(problems[:20])
                          + (" ..." if len(problems) > 20 else ""))
    return files, targets, labels


def load_folder(root: Path, spec: InputSpec, labels: Sequence[str] | None = None) -> Dataset:
    files, targets, labels = scan_folder(root, labels)
    pixels, bad = [], []
    for p in files:
        px = file_pixels(p, spec)
        if isinstance(px, str):
            bad.append(f"{p.relative_to(root)} ({px})")
            continue
        pixels.append(px)
    if bad:
        raise ScriptError(f"{root}: {len(bad)} unreadable image file(s): {', '.join(bad[:20])}"
                          + (" ..." if len(bad) > 20 else ""))
    return Dataset(np.stack(pixels), np.asarray(targets, np.int64), labels,
                   [str(p.relative_to(root)) for p in files])


def _synthetic_chunk(args: tuple) -> tuple[list[np.ndarray], list[str]]:
    """Items ``start..stop`` of ``generate_set``'s sequence (same seeds, sizes and order)."""
    seed, sizes, params, spec, start, stop, keep_raw = args
    out, labs = [], []
    for k in range(start, stop):
        i, label = divmod(k, len(LABELS))
        img = synthetic.generate(LABELS[label], synthetic._item_seed(seed, i),
                                 sizes[i % len(sizes)], params)
        out.append(img if keep_raw else camera_pixels(img, spec))
        labs.append(LABELS[label])
    return out, labs


def synthetic_images(n_per_label: int, seed: int, sizes: Sequence[tuple[int, int]],
                     params: synthetic.SurfaceParams, spec: InputSpec, workers: int = 1,
                     keep_raw: bool = False) -> tuple[list[np.ndarray], list[str]]:
    """``synthetic.generate_set`` (optionally in worker processes), each image resized as the
    server would (or the camera-size frame with ``keep_raw``). Same result for any ``workers``."""
    total = n_per_label * len(LABELS)
    chunk_sizes = tuple(tuple(s) for s in sizes)  # plain tuples: they travel to the workers
    if workers <= 1:
        return _synthetic_chunk((seed, chunk_sizes, params, spec, 0, total, keep_raw))
    # Chunks follow generate_set's order; the per-image seeds make each chunk independent.
    step = -(-total // (workers * 4))
    jobs = [(seed, chunk_sizes, params, spec, a, min(a + step, total), keep_raw)
            for a in range(0, total, step)]
    imgs, labs = [], []
    with ProcessPoolExecutor(workers) as pool:
        for chunk_imgs, chunk_labs in pool.map(_synthetic_chunk, jobs):
            imgs += chunk_imgs
            labs += chunk_labs
    return imgs, labs


def synthetic_dataset(n_per_label: int, seed: int, sizes: Sequence[tuple[int, int]],
                      params: synthetic.SurfaceParams, spec: InputSpec,
                      workers: int = 1) -> Dataset:
    imgs, labs = synthetic_images(n_per_label, seed, sizes, params, spec, workers)
    return Dataset(np.stack(imgs), np.asarray([LABELS.index(x) for x in labs], np.int64), LABELS,
                   [f"synthetic:{seed}:{i}:{x}" for i, x in enumerate(labs)])


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"640x480,1280x1024"`` -> ((640, 480), (1280, 1024))."""
    out = []
    for part in text.split(","):
        try:
            w, h = (int(v) for v in part.lower().strip().split("x"))
        except ValueError:
            raise ScriptError(f"bad size {part!r}; use WIDTHxHEIGHT, e.g. 640x480") from None
        if not (16 <= w <= 8192 and 16 <= h <= 8192):
            raise ScriptError(f"size {part!r} out of range 16..8192")
        out.append((w, h))
    return tuple(out)


def input_toml(spec: InputSpec) -> str:
    """model.toml's ``[input]`` section for ``spec``: every field set, in the schema's order."""
    from visionserve.verdicts import toml_value

    fields = spec.model_dump(mode="json")
    return "[input]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in fields.items()
                                 if v is not None)


def toml_list(values: Iterable[object]) -> str:
    """A TOML array of strings or numbers (floats as ``%g``)."""
    return "[" + ", ".join(f"{v:g}" if isinstance(v, float) else f'"{v}"' for v in values) + "]"


def input_section(spec: InputSpec) -> str:
    """The ``[input]`` section of model.toml for a model trained here (graph input
    :data:`ONNX_INPUT`), ending in a newline."""
    pad = f"pad_value = {spec.pad_value}\n" if spec.resize == "letterbox" else ""
    return f"""[input]
name = "{spec.name}"
tensor_name = "{ONNX_INPUT}"
width = {spec.width}
height = {spec.height}
channels = {spec.channels}
color_order = "{spec.color_order}"
resize = "{spec.resize}"
{pad}interpolation = "{spec.interpolation}"
layout = "{spec.layout}"
dtype = "{spec.dtype}"
scale = {spec.scale!r}
mean = {toml_list(spec.mean)}
std = {toml_list(spec.std)}
"""


def read_model_config(model_dir: Path) -> ModelConfig | None:
    from visionserve.config import load_model_config

    path = Path(model_dir) / "model.toml"
    return load_model_config(path) if path.is_file() else None


def run_facts(model, threads: int, t_start: float, t_data: float, t_train: float) -> dict:
    """What metrics.json records of every training run: the model's size, where the time went
    (``t_start``: ``time.perf_counter()`` at the start; seconds making the data, training, and
    all up to now), torch and the machine."""
    import platform
    import time

    import torch

    return {"params": int(sum(p.numel() for p in model.parameters())),
            "seconds": {"data": round(t_data, 1), "train": round(t_train, 1),
                        "total": round(time.perf_counter() - t_start, 1)},
            "torch": torch.__version__, "threads": threads,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}


def check_new_version(model_dir: Path, version: int | None) -> None:
    """``--version``, if given, must be >= 1 and not exist yet (checked before training)."""
    if version is not None and (version < 1 or (Path(model_dir) / str(version)).exists()):
        raise ScriptError(f"--version {version}: must be >= 1 and not exist yet in "
                          f"{model_dir} (move the old one away first)")


def make_version_dir(model_dir: Path, version: int | None) -> Path:
    """Create the version folder a training run writes: ``version``, or highest + 1."""
    versions = version_dirs(model_dir)
    version_dir = Path(model_dir) / str(version or (versions[-1] if versions else 0) + 1)
    try:
        version_dir.mkdir(parents=True)
    except FileExistsError:
        raise ScriptError(f"{version_dir} appeared while training; not overwriting it") from None
    return version_dir


def version_dirs(model_dir: Path) -> list[int]:
    if not Path(model_dir).is_dir():
        return []
    return sorted(int(p.name) for p in Path(model_dir).iterdir() if p.is_dir() and p.name.isdigit())


def per_class_accuracy(targets: np.ndarray, preds: np.ndarray, labels: Iterable[str]) -> dict:
    labels = list(labels)
    out = {"overall": float((targets == preds).mean()) if len(targets) else float("nan")}
    for i, lab in enumerate(labels):
        m = targets == i
        out[lab] = float((preds[m] == i).mean()) if m.any() else float("nan")
    return out


def confusion(targets: np.ndarray, preds: np.ndarray, n: int) -> np.ndarray:
    cm = np.zeros((n, n), np.int64)
    np.add.at(cm, (targets, preds), 1)
    return cm


#: the fewest good images an anomaly fit takes: some are held out to calibrate the threshold
MIN_IMAGES = 20


def scan_good(folder: Path) -> list[Path]:
    """The image files of ``folder`` (sorted; sub-folders too); ScriptError when there are too
    few, or when some cannot be read or are of another size than the rest (all named)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ScriptError(f"--good {folder} is not a folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file()
                   and p.suffix.lower() in IMAGE_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if len(files) < MIN_IMAGES:
        raise ScriptError(f"--good {folder}: {len(files)} image file(s) (.png/.jpg/.jpeg/.bmp); "
                          f"a fit needs at least {MIN_IMAGES} good images (200 or more make a "
                          "better model), some of them held out to calibrate the threshold")
    sizes: dict[Path, tuple[int, int]] = {}
    bad = []
    for p in files:
        try:
            f = imaging.encoded_frame(p.read_bytes())
            sizes[p] = (f.width, f.height)
        except (OSError, VisionServeError) as exc:
            bad.append(f"{p.relative_to(folder)} ({getattr(exc, 'message', None) or exc})")
    if bad:
        raise ScriptError(f"--good {folder}: {len(bad)} unreadable image file(s): "
                          + ", ".join(bad[:20]) + (" ..." if len(bad) > 20 else ""))
    counts: dict[tuple[int, int], int] = {}
    for s in sizes.values():
        counts[s] = counts.get(s, 0) + 1
    if len(counts) > 1:
        common_size = max(counts, key=lambda s: counts[s])
        odd = [f"{p.relative_to(folder)} ({w}x{h})" for p, (w, h) in sizes.items()
               if (w, h) != common_size]
        raise ScriptError(f"--good {folder}: the images are of {len(counts)} sizes; one camera "
                          f"gives one size ({common_size[0]}x{common_size[1]} for "
                          f"{counts[common_size]} of them). Other sizes: " + ", ".join(odd[:20])
                          + (" ..." if len(odd) > 20 else ""))
    return files
