"""A stand-in for the shipped default model, for benchmarking before its trained weights exist.

Same network (``visionserve_tools.training.common.build_model``), same ``model.toml`` (input
size, normalisation, batching), random weights: the cost per frame is the trained model's, the
verdicts are meaningless. Writes ``OUT/defect-classifier/{model.toml,1/model.onnx}``.

    .venv/bin/python loadtest/peers/make_standin_model.py /tmp/bench-arch
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(out: Path) -> None:
    import torch

    from visionserve.config import load_model_config
    from visionserve_tools.training.common import DEFAULT_WIDTHS, build_model, count_macs

    toml = ROOT / "models" / "defect-classifier" / "model.toml"
    cfg = load_model_config(toml)
    folder = out / "defect-classifier"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(toml, folder / "model.toml")
    torch.manual_seed(0)
    model = build_model(len(cfg.output.labels)).eval()
    h, w = cfg.input.height, cfg.input.width
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(2, cfg.input.channels, h, w),), str(folder / "1" / "model.onnx"),
                          input_names=[cfg.input.tensor_name or "input"],
                          output_names=[cfg.output.tensor_name or "logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17,
                          dynamo=False)
    print(f"{folder}: {count_macs(DEFAULT_WIDTHS, w, h) / 1e6:.1f} M MACs per frame at {w}x{h}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_standin_model.py OUT_FOLDER")
    main(Path(sys.argv[1]))
