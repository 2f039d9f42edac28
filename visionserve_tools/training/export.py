"""Export a trained version's weights to ONNX (dynamic batch) and torch.export ``.pt2``, and
check that both agree with the eager model (max abs logit difference <= --tolerance).

    python -m visionserve_tools.training.export models/defect-classifier/1

Reads ``<version>/weights.pt``, writes ``<version>/model.onnx`` and ``<version>/model.pt2``.
The agreement check runs on the held-out synthetic set (models with the synthetic labels) or on
``--data`` (a folder-per-label set of real images). Exit 1 if the check fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from visionserve import imaging

from . import common
from .common import ScriptError

OPSET = 17


class ExportMismatch(Exception):
    """An exported model disagrees with the eager model."""


def export_onnx(model, example, path: Path, output_name: str = common.ONNX_OUTPUT) -> None:
    import torch

    # The classic exporter gives a plain opset-17 graph with a named dynamic batch dimension and
    # no external-data side files; the dynamo exporter needs more care for the same result.
    torch.onnx.export(
        model, (example,), str(path), dynamo=False, opset_version=OPSET,
        input_names=[common.ONNX_INPUT], output_names=[output_name],
        dynamic_axes={common.ONNX_INPUT: {0: "batch"}, output_name: {0: "batch"}},
        do_constant_folding=True,
    )
    import onnx

    m = onnx.load(str(path))
    # The exporter can leave an output's fixed axes symbolic (a detector's concatenated head:
    # 'Concatoutput0_dim_1'); the server checks a model's declared shape against model.toml at
    # load, so every axis but the batch is declared with the size the model gives.
    shape = model(example).shape
    dims = m.graph.output[0].type.tensor_type.shape.dim
    if len(dims) == len(shape) and any(d.dim_param for d in list(dims)[1:]):
        for d, n in zip(list(dims)[1:], shape[1:]):
            d.Clear()
            d.dim_value = int(n)
        onnx.save(m, str(path))
    onnx.checker.check_model(m)
    dim0 = m.graph.input[0].type.tensor_type.shape.dim[0]
    if dim0.dim_param != "batch" or m.opset_import[0].version < OPSET:
        raise ExportMismatch(f"{path}: expected a dynamic 'batch' dim and opset >= {OPSET}, got "
                             f"dim {dim0} opset {m.opset_import[0].version}")


def export_pt2(model, example, path: Path) -> None:
    import torch

    batch = torch.export.Dim("batch", min=1, max=4096)
    ep = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(ep, str(path))


def run_onnx(path: Path, x: np.ndarray, threads: int = 1,
             output_name: str = common.ONNX_OUTPUT) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run([output_name], {common.ONNX_INPUT: x[i:i + 16]})[0]
                           for i in range(0, len(x), 16)])


def run_pt2(path: Path, x: np.ndarray) -> np.ndarray:
    import torch

    mod = torch.export.load(str(path)).module()
    with torch.no_grad():
        return np.concatenate([mod(torch.from_numpy(x[i:i + 16])).numpy()
                               for i in range(0, len(x), 16)])


def export_version(version_dir: Path, check_x: np.ndarray, tolerance: float = 1e-3) -> dict:
    """Write model.onnx and model.pt2 next to weights.pt; raise ExportMismatch on disagreement."""
    model, _ = common.load_checkpoint(version_dir / "weights.pt")
    return export_checked(model, version_dir, check_x, tolerance)


def export_checked(model, version_dir: Path, check_x: np.ndarray, tolerance: float,
                   output_name: str = common.ONNX_OUTPUT) -> dict:
    """Export an eval-mode model to ``version_dir``'s model.onnx and model.pt2, check both (and
    batch 1 against batched) on ``check_x``, write export.json; raise ExportMismatch when they
    disagree by more than ``tolerance`` (max abs difference of any output value)."""
    import torch

    if len(check_x) < 2:  # torch.export specialises a batch of 1; trace with 2
        check_x = np.concatenate([check_x, check_x])
    example = torch.from_numpy(check_x[:2].copy())
    t0 = time.perf_counter()
    with torch.no_grad():
        export_onnx(model, example, version_dir / "model.onnx", output_name)
        export_pt2(model, example, version_dir / "model.pt2")
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        eager = torch.cat([model(torch.from_numpy(check_x[i:i + 16]))
                           for i in range(0, len(check_x), 16)]).numpy()
    onnx_out = run_onnx(version_dir / "model.onnx", check_x, output_name=output_name)
    pt2_out = run_pt2(version_dir / "model.pt2", check_x)
    # Batch sizes the server pads to must give the same answers as batch 1.
    single = run_onnx(version_dir / "model.onnx", check_x[:1], output_name=output_name)
    diffs = {
        "onnx_vs_eager": float(np.abs(onnx_out - eager).max()),
        "pt2_vs_eager": float(np.abs(pt2_out - eager).max()),
        "onnx_vs_pt2": float(np.abs(onnx_out - pt2_out).max()),
        "onnx_batch1_vs_batched": float(np.abs(single - onnx_out[:1]).max()),
    }
    report = {"images_checked": len(check_x), "tolerance": tolerance,
              "max_abs_diff": diffs, "opset": OPSET, "export_seconds": round(seconds, 2),
              "onnx_bytes": (version_dir / "model.onnx").stat().st_size,
              "pt2_bytes": (version_dir / "model.pt2").stat().st_size}
    (version_dir / "export.json").write_text(json.dumps(report, indent=2) + "\n")
    bad = {k: v for k, v in diffs.items() if not v <= tolerance}
    if bad:
        raise ExportMismatch(f"{version_dir}: exported models disagree with the eager model on "
                             f"{len(check_x)} images: max abs diff {bad} > {tolerance}")
    return report


def check_inputs(meta: dict, data: Path | None, n_per_label: int) -> np.ndarray:
    """The tensors the agreement check runs on, preprocessed as the server would."""
    spec = common.InputSpec(**meta["input"])
    if data is not None:
        ds = common.load_folder(data, spec, meta["labels"])
        return imaging.normalize(ds.pixels, spec)
    if tuple(meta["labels"]) != common.LABELS:
        raise ScriptError("this model's labels are not the synthetic ones; pass --data with a "
                          "folder-per-label set of its images for the agreement check")
    ds = common.synthetic_dataset(n_per_label, common.HELDOUT_SEED, ((640, 480), (1280, 1024)),
                                  common.synthetic.HELDOUT_PARAMS, spec)
    return imaging.normalize(ds.pixels, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("version_dir", type=Path, help="models/<name>/<N> holding weights.pt")
    ap.add_argument("--data", type=Path, help="folder-per-label images for the agreement check")
    ap.add_argument("--check-per-label", type=int, default=20,
                    help="held-out synthetic images per label for the check (default 20)")
    ap.add_argument("--tolerance", type=float, default=1e-3)
    args = ap.parse_args(argv)
    try:
        _, meta = common.load_checkpoint(args.version_dir / "weights.pt")
        x = check_inputs(meta, args.data, args.check_per_label)
        report = export_version(args.version_dir, x, args.tolerance)
    except ScriptError as exc:
        return common.fail(exc)
    except ExportMismatch as exc:
        print(f"error: EXPORT CHECK FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
