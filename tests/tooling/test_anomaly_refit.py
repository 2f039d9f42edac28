"""The refit's pieces (visionserve_tools/training/refit.py): the input of another normalisation
brought to the backbone's inside the graph, and the shipped model's memory bank and
normalisation read back from its version folder."""

from __future__ import annotations

import numpy as np
import torch
from conftest import REPO

from visionserve import imaging
from visionserve.config import InputSpec, load_model_config
from visionserve_tools.training import refit

MODEL = REPO / "models" / "surface-anomaly"


def test_another_normalisation_is_brought_to_the_backbones():
    given = InputSpec(width=8, height=8, color_order="BGR", mean=(0.5, 0.4, 0.3),
                      std=(0.2, 0.25, 0.3))
    wanted = InputSpec(width=8, height=8, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    rgb = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    x_given = imaging.normalize(rgb[..., ::-1].copy(), given)  # the same pixels, BGR
    x_wanted = imaging.normalize(rgb, wanted)
    got = refit.Renormalize(given, wanted)(torch.from_numpy(x_given)).numpy()
    np.testing.assert_allclose(got, x_wanted, atol=1e-5)
    assert refit.same_normalisation(wanted, wanted) and not refit.same_normalisation(given, wanted)


def test_the_shipped_models_bank_and_normalisation():
    bank = refit.source_bank(MODEL / "1")
    assert bank.shape == (4096, 96) and bank.dtype == np.float32
    meta = refit.source_normalization(load_model_config(MODEL / "model.toml"), MODEL / "1")
    fitted = refit.read_json(MODEL / "1" / "fit.json")
    assert meta["image_threshold"] == fitted["threshold"]
    assert meta["pred_scores.max"] > meta["image_threshold"] > meta["pred_scores.min"]
