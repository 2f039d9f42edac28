"""loadtest/peers/run_peers.py: the visionserve-full and visionserve-scaled targets serve the same
model with ``input.scaled_decode`` false or true, and nothing else changed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from visionserve.config import load_model_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scaled", [False, True])
def test_the_decode_targets_serve_the_model_with_that_decoding(tmp_path, monkeypatch, scaled):
    monkeypatch.setenv("PEERS_WORK", str(tmp_path / "work"))
    spec = importlib.util.spec_from_file_location("run_peers", REPO / "loadtest/peers/run_peers.py")
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    models = REPO / "models"
    shipped = load_model_config(models / "defect-classifier" / "model.toml")
    assert not shipped.input.scaled_decode  # the shipped model decodes JPEGs in full
    root = peers.decode_copy(models, "defect-classifier", scaled=scaled)
    assert [p.name for p in root.iterdir()] == ["defect-classifier"]
    copy = load_model_config(root / "defect-classifier" / "model.toml")
    assert copy.input.scaled_decode is scaled
    assert copy.model_dump(exclude={"input"}) == shipped.model_dump(exclude={"input"})
    assert copy.input.model_dump(exclude={"scaled_decode"}) == \
        shipped.input.model_dump(exclude={"scaled_decode"})
    assert (root / "defect-classifier" / "1" / "model.onnx").resolve() == \
        (models / "defect-classifier" / "1" / "model.onnx").resolve()
    assert peers.decode_copy(models, "defect-classifier", scaled=scaled) == root  # made again
    # a model.toml without the field gets it
    bare = tmp_path / "bare" / "m"
    bare.mkdir(parents=True)
    text = (models / "defect-classifier" / "model.toml").read_text()
    (bare / "model.toml").write_text(
        "\n".join(line for line in text.splitlines() if not line.startswith("scaled_decode")))
    (bare / "1").symlink_to((models / "defect-classifier" / "1").resolve())
    again = peers.decode_copy(bare.parent, "m", scaled=scaled)
    assert load_model_config(again / "m" / "model.toml").input.scaled_decode is scaled


def test_the_gpu_peers_torch_model_gives_the_verdicts_of_the_onnx_peer(tmp_path):
    """loadtest/peers/common.py's torch model (the GPU peers': nvJPEG decode, resize and
    normalise on the device, the .pt2 in fp16) does the work of the CPU peers' onnxruntime model
    on the same network: the same labels, scores within fp16's reach; a bad JPEG is a
    ValueError. On the CPU here (torchvision decodes there too); on the GPU machine in
    loadtest/peers/run_peers_gpu.py."""
    import sys

    import cv2
    import torch

    from tests.unit.test_torch_backend import export_both

    export_both(tmp_path / "tiny")
    sys.path.insert(0, str(REPO / "loadtest" / "peers"))
    try:
        import common
    finally:
        sys.path.remove(str(REPO / "loadtest" / "peers"))
    rng = np.random.default_rng(3)
    frames = [cv2.imencode(".jpg", rng.integers(0, 255, shape, np.uint8))[1].tobytes()
              for shape in [(48, 64, 3)] * 4 + [(40, 40, 3)] * 2]  # two sizes in one batch
    onnx, torch_model = common.load(tmp_path, "tiny"), common.load_torch(tmp_path, "tiny", "cpu")
    x = torch_model.prepare(frames)
    assert tuple(x.shape) == (6, 3, 32, 32) and x.dtype == torch.float16
    expected, got = onnx.run(onnx.prepare(frames)), torch_model.run(x)
    assert np.abs(expected - got).max() < 0.02
    assert [v[:2] for v in torch_model.verdicts(got)] == [v[:2] for v in onnx.verdicts(expected)]
    with pytest.raises(ValueError, match="cannot decode"):
        torch_model.prepare([frames[0], b"not a jpeg"])


def test_the_gpu_peers_compare_each_visionserve_target_with_the_bare_model_and_each_peer():
    """loadtest/peers/run_peers_gpu.py's ratios: every target's saturation against the bare
    model's batch-32 throughput of the same run, and each visionserve target (torch over the
    inspect API and over OIP, onnxruntime-gpu over the inspect API) against each peer that
    answered; a target that failed is left out, not counted as zero."""
    import sys

    sys.path.insert(0, str(REPO / "loadtest" / "peers"))
    try:
        import run_peers_gpu
    finally:
        sys.path.remove(str(REPO / "loadtest" / "peers"))

    def sat(rate, p99):
        return {"saturation": {"answers": 100, "throughput_per_s": rate, "p99_ms": p99}}

    assert run_peers_gpu.TARGETS["visionserve-ort"] == "inspect"
    res = {"bare": {"bs32_img_per_s": 1000.0},
           "targets": {"visionserve": sat(500.0, 20.0), "visionserve-ort": sat(300.0, 30.0),
                       "triton": sat(100.0, 100.0), "naive": {"error": "server exited"}}}
    got = run_peers_gpu.ratios(res)
    assert got["visionserve_vs_bare_bs32"] == 0.5
    assert got["visionserve-ort_vs_bare_bs32"] == 0.3
    assert got["visionserve-ort_vs_triton"] == {"throughput": 3.0, "p99_ms": [30.0, 100.0]}
    assert got["visionserve_vs_triton"] == {"throughput": 5.0, "p99_ms": [20.0, 100.0]}
    assert not any("naive" in k for k in got)
