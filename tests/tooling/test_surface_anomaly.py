"""The shipped anomaly model meets its card: image AUROC >= 0.98 on the held-out synthetic set
with every defect kind, by the evaluation command of its card (fewer images here), and its
recorded evaluation says the same."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

MODEL = REPO / "models" / "surface-anomaly"


def test_auroc_by_the_cards_command():
    r = subprocess.run([sys.executable, "-m", "visionserve", "anomaly", "evaluate", str(MODEL),
                        "--n-per-label", "12"], cwd=str(REPO), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["images"] == {"ok": 12, "scratch": 12, "spot": 12, "crack": 12,
                                "contamination": 12}
    assert report["image_auroc"] >= 0.98


def test_the_card_matches_its_files():
    recorded = json.loads((MODEL / "1" / "eval.json").read_text())
    assert recorded["image_auroc"] >= 0.98 and min(recorded["images"].values()) == 60
    card = (MODEL / "README.md").read_text()
    fit = json.loads((MODEL / "1" / "fit.json").read_text())
    assert fit["command"].removeprefix("visionserve ") in card
    assert f"**{recorded['image_auroc']}**" in card
