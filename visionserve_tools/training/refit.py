"""The closed loop's anomaly refit, run as a guard job (docs/closed-loop.md):

    python -m visionserve_tools.training.refit --model-toml M/model.toml --source M/1 \\
        --good M/candidates/c-1/train [--original DIR] --out M/candidates/c-1

refits the PatchCore-style model of :mod:`.patchcore` with the new good parts (the captured
frames labelled good and the OK frames sampled for learning, exported by the server) and writes
a version folder's files exactly into ``--out``: ``model.onnx``, ``model.pt2``,
``metadata.json`` (the normalisation), ``fit.json`` (the report). The model's own ``model.toml``
serves the result unchanged: the input is the one it names (size, normalisation, tensor name:
the backbone's own normalisation is put in front of it inside the graph), the outputs carry the
names of its ``[output]``, and a model of ``format = "anomalib"`` gets the normalisation inside
the graph as anomalib exports it.

Two ways, by what there is to fit on:

* ``--original DIR``, the good images the model was fitted on: a fresh memory bank from them and
  the new good parts, calibrated (as ``visionserve anomaly fit``) on a share of the original
  images held out, to the false-reject rate the source version was fitted for;
* without: the source version's memory bank (read from its ``model.pt2``) kept whole, with the
  coreset of the new good parts' patches added. No patch of the bank goes, so no good part it
  passed scores higher; its normalisation is kept.

The server's held-out frames are never read here: they are the comparison's. Prints its
progress as JSON lines (``{"step": 2, "steps": 5, "stage": "..."}``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from visionserve.config import InputSpec, load_model_config
from visionserve.errors import ConfigError
from visionserve.tasks.anomaly import ANOMALIB_METADATA, AnomalyConfig

from . import common, patchcore
from .common import ScriptError

STEPS = 5
#: the source's false-reject target where its fit.json names none (``anomaly fit``'s default)
FALSE_REJECT = 0.005


def _step(n: int, stage: str, **more: Any) -> None:
    print(json.dumps({"step": n, "steps": STEPS, "stage": stage, **more}), flush=True)


class Renormalize(nn.Module):
    """The model.toml's input tensor -> the backbone's: undo one normalisation (and channel
    order), apply the other, inside the graph."""

    def __init__(self, given: InputSpec, wanted: InputSpec) -> None:
        super().__init__()

        def column(v) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1)

        # pixel = (x * std + mean) / scale; wanted = (pixel * scale' - mean') / std'
        self.flip = given.color_order != wanted.color_order
        self.register_buffer("a", column(given.std) / given.scale * wanted.scale)
        self.register_buffer("b", column(given.mean) / given.scale * wanted.scale)
        self.register_buffer("mean", column(wanted.mean))
        self.register_buffer("std", column(wanted.std))

    def forward(self, x):
        x = x * self.a + self.b
        if self.flip:
            x = x.flip(1)
        return (x - self.mean) / self.std


def same_normalisation(a: InputSpec, b: InputSpec) -> bool:
    return (a.scale, tuple(a.mean), tuple(a.std), a.color_order) == \
        (b.scale, tuple(b.mean), tuple(b.std), b.color_order)


class Normalized(nn.Module):
    """anomalib's normalisation inside the graph: 0.5 at the threshold, clipped to [0, 1]."""

    def __init__(self, inner: nn.Module, meta: dict[str, float]) -> None:
        super().__init__()
        self.inner = inner
        self.image = (meta["image_threshold"], meta["pred_scores.max"] - meta["pred_scores.min"])
        self.pixel = (meta["pixel_threshold"], meta["anomaly_maps.max"] - meta["anomaly_maps.min"])

    def forward(self, x):
        score, amap = self.inner(x)
        return (((score - self.image[0]) / self.image[1] + 0.5).clamp(0.0, 1.0),
                ((amap - self.pixel[0]) / self.pixel[1] + 0.5).clamp(0.0, 1.0))


class Backbone(nn.Module):
    def __init__(self, adapter: nn.Module | None, net: nn.Module) -> None:
        super().__init__()
        self.adapter, self.net = adapter, net

    def forward(self, x):
        return self.net(self.adapter(x) if self.adapter is not None else x)


def source_bank(source: Path) -> np.ndarray:
    """The memory bank ``[M, D]`` of a version ``anomaly fit`` (or a refit) wrote: its
    ``model.pt2``'s scorer buffer."""
    path = source / "model.pt2"
    if not path.is_file():
        raise ScriptError(f"{source}: no model.pt2 to read the memory bank from, and no original "
                          "good images (--original): nothing to keep the model's good parts by")
    state = torch.export.load(str(path)).state_dict
    banks = [v for k, v in state.items() if k.endswith("scorer.bank_t")]
    if len(banks) != 1:
        raise ScriptError(f"{path}: not a PatchCore model of visionserve anomaly fit (no memory "
                          "bank in it): refit it from its good images (--original)")
    return banks[0].t().contiguous().numpy().astype(np.float32)


def source_normalization(config: AnomalyConfig, source: Path) -> dict[str, float]:
    """The source version's normalisation in metadata.json's keys: model.toml's
    ``[normalization]`` or its metadata.json."""
    n = config.normalization
    if n is not None:
        (t, _), (pt, _) = n.image(), n.pixel()
        return {"image_threshold": t, "pixel_threshold": pt, "pred_scores.min": n.min,
                "pred_scores.max": n.max,
                "anomaly_maps.min": n.pixel_min if n.pixel_min is not None else n.min,
                "anomaly_maps.max": n.pixel_max if n.pixel_max is not None else n.max}
    meta = read_json(source / ANOMALIB_METADATA)
    keys = ("image_threshold", "pred_scores.min", "pred_scores.max")
    if not all(isinstance(meta.get(k), (int, float)) for k in keys):
        raise ScriptError(f"{source}: no normalisation to keep ({ANOMALIB_METADATA} or "
                          "model.toml's [normalization])")
    return {"image_threshold": meta["image_threshold"],
            "pixel_threshold": meta.get("pixel_threshold", meta["image_threshold"]),
            "pred_scores.min": meta["pred_scores.min"], "pred_scores.max": meta["pred_scores.max"],
            "anomaly_maps.min": meta.get("anomaly_maps.min", meta["pred_scores.min"]),
            "anomaly_maps.max": meta.get("anomaly_maps.max", meta["pred_scores.max"])}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; {} where there is none (or it is no object)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*")
                  if p.is_file() and p.suffix.lower() in common.IMAGE_SUFFIXES)


def refit(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        config = load_model_config(args.model_toml)
    except ConfigError as exc:
        raise ScriptError(str(exc)) from None
    if not isinstance(config, AnomalyConfig):
        raise ScriptError(f"{args.model_toml}: a {config.task} model; the refit is for anomaly "
                          "models")
    spec = config.input
    if (spec.channels, spec.layout, spec.dtype) != (3, "NCHW", "float32"):
        raise ScriptError(f"{args.model_toml}: the refit builds a colour NCHW float32 model; this "
                          f"model takes {spec.channels} channel(s), {spec.layout}, {spec.dtype}")
    fitted = read_json(args.source / "fit.json")
    named = Path(fitted["backbone"]) if fitted.get("backbone") else None
    dev, backbone_file, net, backbone_spec, onnx_backbone = patchcore.load_backbone(
        named if named is not None and named.is_file() else None, args.device, args.threads)
    if onnx_backbone is not None:
        raise ScriptError(f"{backbone_file}: the refit takes a torch backbone (.pt or .pt2)")
    adapter = None if same_normalisation(spec, backbone_spec) else Renormalize(spec, backbone_spec)
    backbone = Backbone(adapter, net).to(dev).eval()

    new_files = image_files(args.good)
    if not new_files:
        raise ScriptError(f"--good {args.good}: no good images to refit with")
    original = common.scan_good(args.original) if args.original else []
    quiet = patchcore.Progress(enabled=False)
    _step(1, "reading images", new=len(new_files), original=len(original))
    x_new = patchcore.load_pixels(new_files, spec, args.good, quiet.step("", len(new_files)))
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(original))
    n_hold = max(patchcore.MIN_HOLDOUT, round(len(original) * 0.2)) if original else 0
    hold_files = [original[i] for i in sorted(order[:n_hold])]
    orig_train = [original[i] for i in sorted(order[n_hold:])]
    x_train = x_new if not orig_train else np.concatenate(
        [patchcore.load_pixels(orig_train, spec, args.original, quiet.step("", len(orig_train))),
         x_new])

    def maps(x: np.ndarray):
        with torch.no_grad():
            return backbone(torch.from_numpy(x).to(dev))

    shapes = [(int(f.shape[1]), int(f.shape[2]), int(f.shape[3])) for f in maps(x_train[:2])]
    head, grid = patchcore.make_head(shapes)
    map_size = (grid[0] * 2, grid[1] * 2)

    def patches(x: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(x), 16):
            with torch.no_grad():
                out.append(head(*maps(x[i:i + 16])).cpu().numpy())
        feats = np.concatenate(out)
        return feats.reshape(-1, feats.shape[-1]).astype(np.float32)

    _step(2, "patch features", images=len(x_train))
    found = patches(x_train)
    target = max(1, min(args.max_bank, math.ceil(args.coreset * len(found))))
    _step(3, "coreset (memory bank)", patches=len(found), rows=target)
    chosen = found[patchcore.greedy_coreset(found, target, args.seed, lambda _: None,
                                            device=dev)]
    report: dict[str, Any] = {"source": str(args.source), "backbone": str(backbone_file),
                              "new_good_images": len(new_files),
                              "original_good_images": len(original),
                              "image_size": [spec.width, spec.height]}
    hold_scores = None
    if original:
        bank = chosen
        scorer = patchcore.make_scorer(bank, grid, map_size).to(dev)
        _step(4, "calibrating", images=len(hold_files))
        x_hold = patchcore.load_pixels(hold_files, spec, args.original,
                                       quiet.step("", len(hold_files)))
        with torch.no_grad():
            hold_scores = np.concatenate([scorer(head(*maps(x_hold[i:i + 16])))[0].cpu().numpy()
                                          for i in range(0, len(x_hold), 16)]).astype(np.float64)
        target_frr = float(fitted.get("false_reject_target") or FALSE_REJECT)
        threshold = float(np.quantile(hold_scores, 1.0 - target_frr, method="higher"))
        lo = float(hold_scores.min())
        hi = 2.0 * threshold - lo if threshold > lo else threshold + 1e-6
        meta = {"image_threshold": threshold, "pixel_threshold": threshold,
                "pred_scores.min": lo, "pred_scores.max": hi,
                "anomaly_maps.min": lo, "anomaly_maps.max": hi}
        report.update(mode="refitted on the original good images and the new good parts",
                      held_out_images=len(hold_files), false_reject_target=target_frr,
                      held_out_rejected=float((hold_scores >= threshold).mean()))
    else:
        kept = source_bank(args.source)
        if kept.shape[1] != chosen.shape[1]:
            raise ScriptError(f"{args.source}: its memory bank has {kept.shape[1]} features a "
                              f"patch, the backbone gives {chosen.shape[1]}: refit it from its "
                              "good images (--original)")
        bank = np.concatenate([kept, chosen])
        scorer = patchcore.make_scorer(bank, grid, map_size).to(dev)
        meta = source_normalization(config, args.source)
        _step(4, "keeping the source's normalisation")
        report.update(mode="the source's memory bank with the new good parts' patches added",
                      kept_rows=len(kept))
    report.update(memory_bank_rows=len(bank), added_rows=len(chosen),
                  memory_bank_bytes=int(bank.nbytes), threshold=meta["image_threshold"],
                  normalization=meta)

    _step(5, "export")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".refit-", dir=args.out))
    try:
        backbone.cpu()
        scorer.cpu()
        full: nn.Module = patchcore.PatchCore(backbone, head, scorer)
        if config.output.format == "anomalib":
            full = Normalized(full, meta)
        names = (spec.tensor_name or patchcore.NAMES[0],
                 config.output.score or patchcore.NAMES[1], config.output.map or patchcore.NAMES[2])
        # checked on the new images mirrored: frames whose patches are not in the bank (a
        # patch's own distance, near 0, is where float32 rounding differs most between runtimes)
        check = np.ascontiguousarray(x_new[:8, :, :, ::-1])
        patchcore._export(full.eval(), None, head, scorer, shapes, check, spec, tmp, names)
        (tmp / ANOMALIB_METADATA).write_text(json.dumps(meta, indent=2) + "\n")
        if hold_scores is not None:
            patchcore.histogram_png(hold_scores, meta["image_threshold"],
                                    report["false_reject_target"], tmp / "report.png",
                                    f"{config.name or args.model_toml.parent.name}: refit")
        report["seconds"] = round(time.monotonic() - t0, 1)
        (tmp / "fit.json").write_text(json.dumps(report, indent=2) + "\n")
        for f in tmp.iterdir():
            os.replace(f, args.out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-toml", type=Path, required=True)
    ap.add_argument("--source", type=Path, required=True, help="the version refitted from")
    ap.add_argument("--good", type=Path, required=True, help="the new good parts (a folder)")
    ap.add_argument("--original", type=Path, help="the good images the model was fitted on")
    ap.add_argument("--out", type=Path, required=True, help="where the version's files go")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--coreset", type=float, default=0.25,
                    help="share of the new patches (with --original: of all) kept in the bank")
    ap.add_argument("--max-bank", type=int, default=4096,
                    help="most rows the new patches add (with --original: the whole bank)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        report = refit(args)
    except ScriptError as exc:
        return common.fail(exc)
    print(json.dumps({"wrote": str(args.out), "memory_bank_rows": report["memory_bank_rows"],
                      "seconds": report["seconds"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
