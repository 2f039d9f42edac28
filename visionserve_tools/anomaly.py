"""Anomaly models from good parts only.

    visionserve anomaly fit --good photos/ok --name line3-anomaly
    visionserve anomaly evaluate models/line3-anomaly --data photos/labelled

``fit`` builds a PatchCore-style model (a backbone's patch features, a memory bank of good
patches cut down by greedy coreset subsampling, nearest-neighbour distances inside the exported
graph) and calibrates its threshold on good images it held out, to the false-reject rate asked
for. It writes ``<models-dir>/<name>/<N>/`` (model.onnx, model.pt2, metadata.json with the
normalisation, fit.json, report.png: the score histogram with the threshold) and
``<models-dir>/<name>/model.toml`` when the model has none; a failed fit writes nothing.
``evaluate`` scores a model folder on labelled images (a folder per label, ``ok`` the good one)
or on the synthetic held-out set: image AUROC, the rates at the threshold, and region IoU
against the defect masks where the generator gives them. Needs the train extra (torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _size(text: str) -> tuple[int, int]:
    parts = text.lower().replace("x", " ").replace(",", " ").split()
    try:
        w, h = (int(parts[0]), int(parts[-1])) if parts else (0, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: WIDTHxHEIGHT or one number") from None
    if not (32 <= w <= 2048 and 32 <= h <= 2048):
        raise argparse.ArgumentTypeError(f"{text!r}: sides from 32 to 2048 pixels")
    return w, h


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="anomaly_command", metavar="{fit,evaluate}")
    f = sub.add_parser("fit", help="build an anomaly model from a folder of good images",
                       description="Build a PatchCore-style anomaly model from good images only.")
    f.add_argument("--good", type=Path, required=True,
                   help="folder of good images (PNG/JPEG/BMP, one camera size; sub-folders too)")
    f.add_argument("--name", required=True, help="model name: <models-dir>/<name>")
    f.add_argument("--models-dir", type=Path, default=Path("models"),
                   help="model repository (default ./models)")
    f.add_argument("--backbone", type=Path,
                   help="feature extractor: the project's classifier weights (.pt, default "
                        "models/defect-classifier/1/weights.pt) or a .pt2/.onnx whose outputs are "
                        "feature maps [N, C, h, w]")
    f.add_argument("--image-size", type=_size,
                   help="model input WIDTHxHEIGHT (default: the backbone's, 160x160)")
    f.add_argument("--false-reject", type=float, default=0.005,
                   help="share of good parts the threshold may reject (default 0.005 = 0.5%%)")
    f.add_argument("--holdout", type=float, default=0.2,
                   help="share of the good images held out to calibrate (default 0.2)")
    f.add_argument("--coreset", type=float, default=0.1,
                   help="share of the patches kept in the memory bank (default 0.1)")
    f.add_argument("--max-bank", type=int, default=4096,
                   help="most rows the memory bank keeps, whatever the share (default 4096)")
    f.add_argument("--device", default="cpu",
                   help="where features, coreset and calibration run: cpu, cuda[:N] or auto "
                        "(default cpu); the export is on the CPU")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    e = sub.add_parser("evaluate", help="image AUROC and region IoU of an anomaly model",
                       description="Score an anomaly model on labelled or synthetic images.")
    e.add_argument("model_dir", type=Path, help="models/<name> (its default version)")
    e.add_argument("--data", type=Path,
                   help="a folder per label, 'ok' the good one (default: the synthetic held-out "
                        "set, every defect kind)")
    e.add_argument("--n-per-label", type=int, default=60,
                   help="synthetic images per label (default 60)")
    e.add_argument("--sizes", default="640x480,1280x1024", help="synthetic frame sizes")
    e.add_argument("--out", type=Path, help="write the result as JSON here too")
    e.add_argument("--threads", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from visionserve import extras

    from .training import common

    command = getattr(args, "anomaly_command", None)
    if command is None:
        print("usage: visionserve anomaly {fit,evaluate} ... (see --help)", file=sys.stderr)
        return 2
    try:
        if command == "fit":
            common.scan_good(args.good)  # the folder's faults first, with or without torch
            try:
                from .training import patchcore
            except ImportError as exc:
                if (exc.name or "").partition(".")[0] not in extras.EXTRA_OF:
                    raise
                raise common.ScriptError(f"visionserve anomaly fit needs {exc.name}, which this "
                                         f"install does not have: {extras.install_hint('train')}"
                                         ) from None
            opts = patchcore.FitOptions(
                good=args.good, name=args.name, models_dir=args.models_dir,
                backbone=args.backbone, image_size=args.image_size, holdout=args.holdout,
                false_reject=args.false_reject, coreset=args.coreset, max_bank=args.max_bank,
                seed=args.seed, threads=args.threads, device=args.device,
                command=patchcore.command_line())
            result = patchcore.fit(opts, patchcore.Progress(enabled=not args.quiet))
            print(json.dumps({"version_dir": str(result.version_dir), **result.report},
                             indent=2))
            return 0
        from .training import anomaly_eval

        report = anomaly_eval.evaluate(args.model_dir, data=args.data,
                                       n_per_label=args.n_per_label,
                                       sizes=common.parse_sizes(args.sizes), threads=args.threads)
        text = json.dumps(report, indent=2)
        if args.out:
            args.out.write_text(text + "\n")
        print(text)
        return 0
    except common.ScriptError as exc:
        return common.fail(exc)
