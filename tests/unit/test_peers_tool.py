"""loadtest/peers/run_peers.py: the visionserve-scaled target serves the same model with
``input.scaled_decode = true`` and nothing else changed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from visionserve.config import load_model_config

REPO = Path(__file__).resolve().parents[2]


def test_the_scaled_target_serves_the_model_with_scaled_decoding(tmp_path, monkeypatch):
    monkeypatch.setenv("PEERS_WORK", str(tmp_path / "work"))
    spec = importlib.util.spec_from_file_location("run_peers", REPO / "loadtest/peers/run_peers.py")
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    models = REPO / "models"
    root = peers.scaled_copy(models, "defect-classifier")
    assert [p.name for p in root.iterdir()] == ["defect-classifier"]
    scaled = load_model_config(root / "defect-classifier" / "model.toml")
    full = load_model_config(models / "defect-classifier" / "model.toml")
    assert scaled.input.scaled_decode and not full.input.scaled_decode
    assert scaled.model_dump(exclude={"input"}) == full.model_dump(exclude={"input"})
    assert (root / "defect-classifier" / "1" / "model.onnx").resolve() == \
        (models / "defect-classifier" / "1" / "model.onnx").resolve()
    assert peers.scaled_copy(models, "defect-classifier") == root  # made again over the old one
    with pytest.raises(SystemExit, match="already sets scaled_decode"):
        peers.scaled_copy(root, "defect-classifier")
