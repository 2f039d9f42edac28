"""PatchCore-style anomaly model from good parts only: ``visionserve anomaly fit``.

1. Patch features: a backbone's feature maps (default: the project's own defect classifier,
   ``models/defect-classifier/1/weights.pt``, its 40x40 and 20x20 stages at 160x160; or a
   ``.pt2``/``.onnx`` file whose outputs are feature maps ``[N, C, h, w]``), each averaged over
   its 3x3 neighbourhood, brought to the finest map's size and stacked: one vector per patch.
2. A memory bank: the training images' patch vectors, cut down by greedy coreset subsampling
   (k-center on a random projection, as in the PatchCore paper) to at most ``max_bank`` rows.
3. The exported graph: the nearest bank row's distance for every patch, as one matrix product
   (``|p|^2 - 2 p.B^T + |b|^2``, then the minimum), upsampled and smoothed into the anomaly map
   ``[N, 1, h, w]``; the image score is the map's maximum. Outputs ``pred_score`` and
   ``anomaly_map`` on the raw scale (``format = "raw"``).
4. Calibration on good images held out from the bank: the threshold is the score that rejects
   the chosen fraction of them; the normalisation's values go to the version's
   ``metadata.json`` (anomalib 1.x's keys), which the server reads.

Everything is written into a temporary folder first and renamed into place at the end: a fit
that fails leaves nothing in the model repository.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from visionserve import imaging
from visionserve.config import InputSpec

from . import common
from .common import ScriptError, scan_good

#: the classifier's stages whose outputs are the patch features (after these layer indices of
#: its ``features``: stage 1, 40x40x32 at 160x160, and stage 2, 20x20x64)
CLASSIFIER_TAPS = (14, 20)
DEFAULT_BACKBONE = Path("models/defect-classifier/1/weights.pt")
MIN_HOLDOUT = 5
OPSET = 17
#: the map is smoothed with a Gaussian of this sigma, in feature-map pixels (PatchCore: 4 px at
#: the input's resolution over a map 8 times coarser)
BLUR_SIGMA = 1.0
#: bank rows per matrix product in the graph: bounds its largest intermediate to
#: batch x patches x this floats
BANK_CHUNK = 1024


@dataclass
class FitOptions:
    good: Path
    name: str
    models_dir: Path = Path("models")
    backbone: Path | None = None
    image_size: tuple[int, int] | None = None  # (width, height); default: the backbone's
    holdout: float = 0.2
    false_reject: float = 0.005
    coreset: float = 0.1
    max_bank: int = 4096
    seed: int = 0
    threads: int = 0
    batch: int = 16
    device: str = "cpu"  # features, coreset and calibration; the export is always on the CPU
    command: str = ""


@dataclass
class FitResult:
    version_dir: Path
    report: dict[str, Any] = field(default_factory=dict)


class Progress:
    """A one-line progress bar on stderr (a plain line per step when stderr is no terminal)."""

    def __init__(self, enabled: bool = True, stream=None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, what: str, total: int) -> Callable[[int], None]:
        start = time.monotonic()
        last = [-1.0]

        def update(done: int) -> None:
            if not self.enabled:
                return
            now = time.monotonic()
            end = done >= total
            if not end and now - last[0] < (0.2 if self.tty else 10.0):
                return
            last[0] = now
            frac = done / total if total else 1.0
            bar = "#" * int(frac * 30)
            line = f"{what:<28} [{bar:<30}] {done}/{total} {now - start:6.1f} s"
            if self.tty:
                self.stream.write("\r" + line + ("\n" if end else ""))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

        update(0)
        return update


# --- input ------------------------------------------------------------------------------------

def load_pixels(files: Sequence[Path], spec: InputSpec, root: Path,
                tick: Callable[[int], None]) -> np.ndarray:
    """Files -> the model's float input batch, through the server's own preprocessing."""
    out = []
    bad = []
    for i, p in enumerate(files):
        px = common.file_pixels(p, spec)
        if isinstance(px, str):
            bad.append(f"{p.relative_to(root)} ({px})")
        else:
            out.append(px)
        tick(i + 1)
    if bad:
        raise ScriptError(f"--good {root}: {len(bad)} unreadable image file(s): "
                          + ", ".join(bad[:20]))
    return imaging.normalize(np.stack(out), spec)


# --- backbones --------------------------------------------------------------------------------

def classifier_backbone(weights: Path):
    """The project's classifier, cut at its feature stages: (module, its input spec)."""
    model, meta = common.load_checkpoint(weights)
    features = model[0]
    taps = CLASSIFIER_TAPS

    class Taps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(list(features)[:taps[-1] + 1])

        def forward(self, x):
            out = []
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i in taps:
                    out.append(x)
            return tuple(out)

    return Taps().eval(), InputSpec(**meta["input"])


def pt2_backbone(path: Path):
    try:
        module = torch.export.load(str(path)).module()
    except Exception as exc:  # noqa: BLE001 - any load failure is bad input
        raise ScriptError(f"--backbone {path}: not a torch.export program: {exc}") from None

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def train(self, mode: bool = True):
            # an exported program has no train/eval mode (its module refuses .train()): the
            # flag only, so that .eval() and the ONNX exporter's mode switch pass it by
            self.training = mode
            return self

        def forward(self, x):
            out = self.inner(x)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return Wrapped()


class OnnxBackbone:
    """An ``.onnx`` backbone: run by onnxruntime while fitting, joined to the head's graph at
    export (``onnx.compose``)."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(path), so,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - any load failure is bad input
            raise ScriptError(f"--backbone {path}: onnxruntime cannot load it: {exc}") from None
        self.path = path
        self.input = self.session.get_inputs()[0].name
        self.outputs = [o.name for o in self.session.get_outputs()]

    def __call__(self, x):
        outs = self.session.run(self.outputs, {self.input: x.cpu().numpy()})
        return tuple(torch.from_numpy(o).to(x.device) for o in outs)


def make_head(shapes: Sequence[tuple[int, int, int]]):
    """Feature maps ``[(C, h, w), ...]`` -> patch vectors ``[N, h0*w0, sum C]`` at the finest
    map's size (3x3 neighbourhood average, then bilinear up)."""
    h0, w0 = max((h, w) for _, h, w in shapes)

    class Patches(nn.Module):
        def forward(self, *maps):
            parts = []
            for m in maps:
                m = F.avg_pool2d(m, 3, stride=1, padding=1, count_include_pad=False)
                if m.shape[-2:] != (h0, w0):
                    m = F.interpolate(m, size=(h0, w0), mode="bilinear", align_corners=False)
                parts.append(m)
            f = torch.cat(parts, dim=1)
            return f.flatten(2).transpose(1, 2)  # [N, h0*w0, D]

    return Patches(), (h0, w0)


def gaussian_kernel(sigma: float) -> np.ndarray:
    r = max(1, math.ceil(3 * sigma))
    x = np.arange(-r, r + 1, dtype=np.float64)
    g = np.exp(-x ** 2 / (2 * sigma ** 2))
    k = np.outer(g, g)
    return (k / k.sum()).astype(np.float32)


def make_scorer(bank: np.ndarray, grid: tuple[int, int], map_size: tuple[int, int]):
    """Patch vectors -> (pred_score [N], anomaly_map [N, 1, H, W]): nearest-neighbour distance
    to the bank as a matrix product, inside the graph."""
    class Scorer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            b = torch.from_numpy(np.ascontiguousarray(bank, np.float32))
            self.bank_t: torch.Tensor
            self.bank_sq: torch.Tensor
            self.kernel: torch.Tensor
            self.register_buffer("bank_t", b.t().contiguous())  # [D, M]
            self.register_buffer("bank_sq", (b * b).sum(1))  # [M]
            k = torch.from_numpy(gaussian_kernel(BLUR_SIGMA * map_size[0] / grid[0]))
            self.register_buffer("kernel", k[None, None])
            self.pad = k.shape[-1] // 2

        def forward(self, p):  # [N, P, D]
            # in float32 whatever the model runs in: |p|^2 - 2 p.b + |b|^2 cancels, and fp16
            # would lose the small distances that tell good from bad
            p = p.float()
            pp = (p * p).sum(-1, keepdim=True)
            best = None
            # the bank in chunks: [N, P, chunk] at a time, not [N, P, M] (838 MB at batch 32)
            for start in range(0, self.bank_t.shape[1], BANK_CHUNK):
                d2 = pp - 2.0 * torch.matmul(p, self.bank_t[:, start:start + BANK_CHUNK].float()) \
                    + self.bank_sq[start:start + BANK_CHUNK].float()
                m = d2.min(dim=-1).values
                best = m if best is None else torch.minimum(best, m)
            assert best is not None
            dist = best.clamp_min(0.0).sqrt()  # [N, P]
            amap = dist.reshape(-1, 1, grid[0], grid[1])
            amap = F.interpolate(amap, size=map_size, mode="bilinear", align_corners=False)
            amap = F.conv2d(F.pad(amap, [self.pad] * 4, mode="replicate"),
                            self.kernel.float())
            return amap.amax(dim=(1, 2, 3)), amap

    return Scorer().eval()


# --- the memory bank --------------------------------------------------------------------------

def greedy_coreset(x: np.ndarray, m: int, seed: int, tick: Callable[[int], None],
                   project: int = 32, device: str = "cpu") -> np.ndarray:
    """Indices of ``m`` rows of ``x`` chosen by greedy k-center (each next row is the one
    farthest from those chosen), distances taken on a random projection to ``project`` dims
    (Johnson-Lindenstrauss: the order of distances is kept closely, at a fraction of the cost)."""
    n, d = x.shape
    if m >= n:
        return np.arange(n)
    g = torch.Generator().manual_seed(seed)
    xt = torch.from_numpy(x).to(device)
    if d > project:
        proj = torch.randn(d, project, generator=g) / math.sqrt(project)
        xt = xt @ proj.to(device)
    xt = xt.contiguous()
    sq = (xt * xt).sum(1)
    first = int(torch.randint(n, (1,), generator=g))
    chosen = [first]
    # |x - c|^2 = |x|^2 - 2 x.c + |c|^2: one matrix-vector product per step, no n x d temporary
    mind = sq - 2.0 * torch.mv(xt, xt[first]) + sq[first]
    d = torch.empty_like(mind)
    for i in range(1, m):
        nxt = int(torch.argmax(mind))
        chosen.append(nxt)
        torch.mv(xt, xt[nxt], out=d)
        d.mul_(-2.0).add_(sq).add_(sq[nxt])
        torch.minimum(mind, d, out=mind)
        if i % 64 == 0:
            tick(i)
    tick(m)
    return np.asarray(chosen)


def load_backbone(backbone: Path | None, device: str, threads: int = 0):
    """(device, file, module, its input spec, the OnnxBackbone or None) of ``--backbone``
    (default: the project's classifier), on ``device`` (``auto``: CUDA where torch sees it)."""
    backbone_file = backbone or DEFAULT_BACKBONE
    if not backbone_file.is_file():
        raise ScriptError(f"--backbone {backbone_file}: no such file" + (
            " (the default is the project's classifier; pass --backbone FILE with a .pt2 or "
            ".onnx whose outputs are feature maps)" if backbone is None else ""))
    dev = device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ScriptError(f"--device {dev}: torch sees no CUDA device")
    suffix = backbone_file.suffix.lower()
    onnx_backbone: OnnxBackbone | None = None
    if suffix == ".pt":
        net, spec = classifier_backbone(backbone_file)
    else:
        spec = common.DEFAULT_INPUT
        if suffix == ".pt2":
            net = pt2_backbone(backbone_file)
        elif suffix == ".onnx":
            onnx_backbone = OnnxBackbone(backbone_file, threads)
            net = onnx_backbone
        else:
            raise ScriptError(f"--backbone {backbone_file}: a .pt (the project's classifier "
                              "weights), .pt2 or .onnx file")
    if onnx_backbone is None:
        net.to(dev)
    return dev, backbone_file, net, spec, onnx_backbone


# --- the fit ----------------------------------------------------------------------------------

def fit(opts: FitOptions, progress: Progress | None = None) -> FitResult:
    """Fit, export and write the model version; ScriptError for bad input (nothing written)."""
    progress = progress or Progress()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    if not (0 < opts.false_reject < 0.5):
        raise ScriptError(f"--false-reject {opts.false_reject}: a fraction in (0, 0.5), e.g. "
                          "0.005 for 0.5%")
    if not (0 < opts.holdout < 0.9):
        raise ScriptError(f"--holdout {opts.holdout}: a fraction in (0, 0.9)")
    t0 = time.monotonic()
    files = scan_good(opts.good)
    model_dir = Path(opts.models_dir) / opts.name
    if (model_dir / "model.toml").is_file():
        existing = common.read_model_config(model_dir)
        if existing is not None and existing.task != "anomaly":
            raise ScriptError(f"{model_dir} holds a {existing.task} model; choose another --name")

    # the backbone and its input
    dev, backbone_file, net, spec, onnx_backbone = load_backbone(opts.backbone, opts.device,
                                                                 opts.threads)
    if opts.image_size is not None:
        w, h = opts.image_size
        spec = spec.model_copy(update={"width": w, "height": h})

    rng = np.random.default_rng(opts.seed)
    order = rng.permutation(len(files))
    n_hold = max(MIN_HOLDOUT, round(len(files) * opts.holdout))
    hold_files = [files[i] for i in sorted(order[:n_hold])]
    train_files = [files[i] for i in sorted(order[n_hold:])]

    x_train = load_pixels(train_files, spec, opts.good,
                          progress.step("reading good images", len(train_files)))
    x_hold = load_pixels(hold_files, spec, opts.good,
                         progress.step("reading held-out images", len(hold_files)))

    def feature_maps(x: np.ndarray):
        with torch.no_grad():
            try:
                return net(torch.from_numpy(x).to(dev))
            except Exception as exc:  # noqa: BLE001 - a backbone that does not fit the input
                raise ScriptError(f"--backbone {backbone_file}: fails on a [{len(x)}, "
                                  f"{spec.channels}, {spec.height}, {spec.width}] input: "
                                  f"{type(exc).__name__}: {exc}") from None

    probe = feature_maps(x_train[:2])
    if not probe or any(f.ndim != 4 for f in probe):
        raise ScriptError(f"--backbone {backbone_file}: its outputs must be feature maps "
                          f"[N, C, h, w]; got shapes {[tuple(f.shape) for f in probe]}")
    shapes = [(int(f.shape[1]), int(f.shape[2]), int(f.shape[3])) for f in probe]
    head, grid = make_head(shapes)
    map_size = (grid[0] * 2, grid[1] * 2)

    def patches(x: np.ndarray, tick: Callable[[int], None]) -> np.ndarray:
        out = []
        for i in range(0, len(x), opts.batch):
            with torch.no_grad():
                out.append(head(*feature_maps(x[i:i + opts.batch])).cpu().numpy())
            tick(min(i + opts.batch, len(x)))
        return np.concatenate(out)

    feats = patches(x_train, progress.step("patch features", len(x_train)))
    all_patches = feats.reshape(-1, feats.shape[-1]).astype(np.float32)
    target = max(1, min(opts.max_bank, math.ceil(opts.coreset * len(all_patches))))
    idx = greedy_coreset(all_patches, target, opts.seed,
                         progress.step("coreset (memory bank)", target), device=dev)
    bank = all_patches[idx]
    scorer = make_scorer(bank, grid, map_size).to(dev)

    # calibration on the held-out good images
    tick = progress.step("calibrating", len(x_hold))
    hold_scores, hold_maps = [], []
    for i in range(0, len(x_hold), opts.batch):
        with torch.no_grad():
            s, m = scorer(head(*feature_maps(x_hold[i:i + opts.batch])))
        hold_scores.append(s.cpu().numpy())
        hold_maps.append(m.cpu().numpy())
        tick(min(i + opts.batch, len(x_hold)))
    scores = np.concatenate(hold_scores).astype(np.float64)
    threshold = float(np.quantile(scores, 1.0 - opts.false_reject, method="higher"))
    lo = float(scores.min())
    hi = 2.0 * threshold - lo if threshold > lo else threshold + 1e-6
    finest = 1.0 / len(scores)
    rejected = float((scores >= threshold).mean())
    meta = {"image_threshold": threshold, "pixel_threshold": threshold,
            "pred_scores.min": lo, "pred_scores.max": hi,
            "anomaly_maps.min": lo, "anomaly_maps.max": hi}

    # write: a temporary folder, renamed into place at the end
    models_dir = Path(opts.models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    versions = common.version_dirs(model_dir)
    version = (max(versions) + 1) if versions else 1
    fresh = not (model_dir / "model.toml").is_file()
    tmp = Path(tempfile.mkdtemp(prefix=f".{opts.name}.fit-", dir=models_dir))
    try:
        vdir = tmp / str(version)
        vdir.mkdir()
        export_t0 = time.monotonic()
        if onnx_backbone is None:
            net.cpu()
        scorer.cpu()
        full = _full_model(net, onnx_backbone, head, scorer)
        _export(full, onnx_backbone, head, scorer, shapes, x_hold, spec, vdir)
        export_s = time.monotonic() - export_t0
        (vdir / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
        report: dict[str, Any] = {
            "command": opts.command,
            "good": str(Path(opts.good).absolute()),
            "good_images": len(files), "fit_images": len(train_files),
            "held_out_images": len(hold_files),
            "image_size": [spec.width, spec.height],
            "backbone": str(backbone_file),
            "patch_grid": list(grid), "feature_dims": int(bank.shape[1]),
            "patches": len(all_patches), "memory_bank_rows": len(bank),
            "memory_bank_bytes": int(bank.nbytes),
            "anomaly_map_size": list(map_size),
            "false_reject_target": opts.false_reject,
            "threshold": threshold,
            "held_out_rejected": rejected,
            "finest_measurable_rate": finest,
            "held_out_scores": {"min": lo, "median": float(np.median(scores)),
                                "max": float(scores.max())},
            "seconds": {"total": round(time.monotonic() - t0, 1),
                        "export": round(export_s, 1)},
            "onnx_bytes": (vdir / "model.onnx").stat().st_size,
            "pt2_bytes": (vdir / "model.pt2").stat().st_size if (vdir / "model.pt2").exists()
            else 0,
        }
        if opts.false_reject < finest:
            report["note"] = (f"{len(scores)} held-out images measure false-reject rates down to "
                              f"{finest:.3g}; the threshold is the highest held-out score: hold "
                              f"out {math.ceil(1 / opts.false_reject)} or more good images to "
                              f"calibrate to {opts.false_reject:g}")
        histogram_png(scores, threshold, opts.false_reject, vdir / "report.png",
                      f"{opts.name}: {len(scores)} held-out good images")
        (vdir / "fit.json").write_text(json.dumps(report, indent=2) + "\n")
        toml_text = model_toml(opts.name, spec, backend_onnx_only=onnx_backbone is not None,
                               command=opts.command)
        if fresh:
            (tmp / "model.toml").write_text(toml_text)
        # into place: the version folder, then (a new model) model.toml, each by one rename
        model_dir.mkdir(exist_ok=True)
        final = model_dir / str(version)
        os.replace(vdir, final)
        if fresh:
            os.replace(tmp / "model.toml", model_dir / "model.toml")
        report["seconds"]["total"] = round(time.monotonic() - t0, 1)
        (final / "fit.json").write_text(json.dumps(report, indent=2) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return FitResult(final, report)


class PatchCore(nn.Module):
    """The whole model: backbone -> patch vectors -> (score, map)."""

    def __init__(self, backbone: nn.Module, head: nn.Module, scorer: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head, self.scorer = backbone, head, scorer

    def forward(self, x):
        return self.scorer(self.head(*self.backbone(x)))


def _full_model(net, onnx_backbone, head, scorer):
    if onnx_backbone is not None:
        return None
    return PatchCore(net, head, scorer).eval()


#: the exported graph's input and outputs: (input, score, map)
NAMES = ("input", "pred_score", "anomaly_map")


def _export(full, onnx_backbone: OnnxBackbone | None, head, scorer, shapes, check_x: np.ndarray,
            spec: InputSpec, vdir: Path, names: tuple[str, str, str] = NAMES) -> None:
    """model.onnx (dynamic batch) and, for a torch backbone, model.pt2, with ``names``; both
    checked against the fitting code on held-out images."""
    import warnings
    example = torch.from_numpy(np.ascontiguousarray(check_x[:2]))
    axes = {n: {0: "batch"} for n in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if full is not None:
            torch.onnx.export(full, (example,), str(vdir / "model.onnx"), dynamo=False,
                              opset_version=OPSET, dynamic_axes=axes, do_constant_folding=True,
                              input_names=[names[0]], output_names=list(names[1:]))
            batch = torch.export.Dim.DYNAMIC  # its range: what the backbone takes (4096 for ours)
            ep = torch.export.export(_Named(full, names[1:]), (example,),
                                     dynamic_shapes=({0: batch},))
            torch.export.save(ep, str(vdir / "model.pt2"))
        else:
            assert onnx_backbone is not None
            _export_composed(onnx_backbone, head, scorer, shapes, example, vdir / "model.onnx")
    # the exported graph gives what the fitting code gives
    x = check_x[:8]
    with torch.no_grad():
        if full is not None:
            want_s, want_m = full(torch.from_numpy(x))
        else:
            want_s, want_m = scorer(head(*onnx_backbone(torch.from_numpy(x))))  # type: ignore[misc]
    import onnxruntime as ort

    sess = ort.InferenceSession(str(vdir / "model.onnx"), providers=["CPUExecutionProvider"])
    got = [sess.run(list(names[1:]), {names[0]: x})]
    if full is not None:
        with torch.no_grad():
            out = torch.export.load(str(vdir / "model.pt2")).module()(torch.from_numpy(x))
        got.append([out[names[1]].numpy(), out[names[2]].numpy()])
    diff = max(max(float(np.abs(s - want_s.numpy()).max()),
                   float(np.abs(m - want_m.numpy()).max())) for s, m in got)
    scale = max(1e-6, float(np.abs(want_m.numpy()).max()))
    if diff > 1e-3 * scale:
        raise ScriptError(f"the exported model disagrees with the fitted one by {diff:.3g} "
                          f"(scores up to {scale:.3g}); nothing was written")


class _Named(nn.Module):
    """The outputs by name (a dict), so the torch backend serves them as named outputs."""

    def __init__(self, inner: nn.Module, names: tuple[str, str] = NAMES[1:]) -> None:
        super().__init__()
        self.inner, self.names = inner, names

    def forward(self, x):
        score, amap = self.inner(x)
        return {self.names[0]: score, self.names[1]: amap}


def _export_composed(backbone: OnnxBackbone, head, scorer, shapes, example, path: Path) -> None:
    """The head and scorer as ONNX taking the backbone's outputs, joined to the backbone."""
    import onnx
    from onnx import compose

    class Rest(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head, self.scorer = head, scorer

        def forward(self, *maps):
            return self.scorer(self.head(*maps))

    maps = tuple(backbone(example))
    ins = [f"feat{i}" for i in range(len(maps))]
    tmp = path.with_name("rest.onnx")
    torch.onnx.export(Rest().eval(), maps, str(tmp), dynamo=False, opset_version=OPSET,
                      input_names=ins, output_names=["pred_score", "anomaly_map"],
                      dynamic_axes={**{n: {0: "batch"} for n in ins},
                                    "pred_score": {0: "batch"}, "anomaly_map": {0: "batch"}})
    bb = onnx.load(str(backbone.path))
    rest = onnx.load(str(tmp))
    tmp.unlink()
    if bb.opset_import[0].version != rest.opset_import[0].version:
        from onnx import version_converter

        bb = version_converter.convert_version(bb, rest.opset_import[0].version)
    bb = compose.add_prefix(bb, "backbone/", rename_inputs=False)
    merged = compose.merge_models(bb, rest, io_map=[(f"backbone/{o}", n)
                                                   for o, n in zip(backbone.outputs, ins)])
    merged.graph.input[0].name  # noqa: B018 - the backbone's input stays the graph's input
    onnx.checker.check_model(merged)
    onnx.save(merged, str(path))
    # the server names the input in model.toml; the composed graph keeps the backbone's name
    if backbone.input != "input":
        m = onnx.load(str(path))
        for node in m.graph.node:
            node.input[:] = ["input" if i == backbone.input else i for i in node.input]
        m.graph.input[0].name = "input"
        onnx.save(m, str(path))


def model_toml(name: str, spec: InputSpec, backend_onnx_only: bool, command: str) -> str:
    return f"""\
# Anomaly model fitted from good images only (PatchCore-style) by:
#   {command}
# Every field: docs/model-toml.md. The normalisation of each version is its metadata.json.
name = "{name}"
description = "PatchCore-style anomaly model fitted on good parts"
task = "anomaly"

{common.input_toml(spec.model_copy(update={'tensor_name': 'input'}))}
[output]
format = "raw"                 # the server normalises: 0.5 = the calibrated threshold
score = "pred_score"
map = "anomaly_map"

[verdict]
image_threshold = 0.5          # normalised; 0.5 rejects the --false-reject share of good parts
pixel_threshold = 0.5          # map pixels at or above this form the regions answers list

[batching]
max_batch_size = 32
preferred_batch_sizes = [1, 2, 4, 8, 16, 32]
max_queue_delay_ms = 2.0
takt_ms = 200.0
dispatch_when_idle = true

[runtime]
backend = "onnxruntime"        # {"model.onnx only (an .onnx backbone)" if backend_onnx_only
                                  else "or torch: model.pt2"}
"""


def histogram_png(scores: np.ndarray, threshold: float, target: float, path: Path, title: str,
                  others: dict[str, np.ndarray] | None = None) -> None:
    """The score histogram with the threshold marked (matplotlib, the train extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    allv = np.concatenate([scores] + list((others or {}).values()))
    bins = np.linspace(float(allv.min()), float(allv.max()) * 1.02 + 1e-9, 40).tolist()
    ax.hist(scores, bins=bins, alpha=0.7, label=f"good, held out ({len(scores)})")
    for name, v in (others or {}).items():
        ax.hist(v, bins=bins, alpha=0.5, label=f"{name} ({len(v)})")
    ax.axvline(threshold, color="red", linestyle="--",
               label=f"threshold {threshold:.4g} (false-reject target {target:g})")
    ax.set_xlabel("image score (raw: distance to the nearest good patch)")
    ax.set_ylabel("images")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def command_line() -> str:
    return "visionserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
