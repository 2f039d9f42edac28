"""The README's walkthroughs, run as written on a fresh folder, offline (tests/tools/readme.py):
serving one's own detector, and an anomaly inspector from good parts."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np

from conftest import REPO

from tests.tools import detmodels
from tests.tools.readme import bash_block, section, walk

DETECTOR = "### Serving your own detector"
ANOMALY = "### From 200 good parts"


def two_class_yolo_onnx(path: Path) -> None:
    """A stand-in for the user's ``best.onnx``: a YOLOv8-style raw head ``[N, 4+2, A]`` at
    640x640, dynamic batch (tests/tools/detmodels.py, its red and green classes)."""
    import torch

    head = detmodels.yolo_module(640, 640)

    class TwoClasses(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = head

        def forward(self, x):
            return self.head(x)[:, :6]

    folder = detmodels.export(TwoClasses(), path.parent / "export", 640, 640, ["output0"], "")
    (folder / "1" / "model.onnx").rename(path)


def test_serving_your_own_detector_as_written(tmp_path):
    """The section's commands with the user's export and a frame: the model loads with the
    section's model.toml and its first frame on the CPU is answered with the annotated JPEG,
    not 504 LATE."""
    text = section(DETECTOR)
    assert "yolo export model=runs/detect/train/weights/best.pt" in text  # the offline route
    assert "visionserve serve" not in text.replace(".venv/bin/visionserve serve", "")
    two_class_yolo_onnx(tmp_path / "best.onnx")
    frame = detmodels.scene(640, 480, detmodels.THREE)
    cv2.imwrite(str(tmp_path / "part.jpg"), frame)
    walk(DETECTOR, tmp_path)
    annotated = (tmp_path / "part-annotated.jpg").read_bytes()
    assert annotated[:2] == b"\xff\xd8", annotated[:300]  # a JPEG, not a JSON error (504 LATE)
    assert cv2.imdecode(np.frombuffer(annotated, np.uint8), cv2.IMREAD_COLOR).shape == \
        (480, 640, 3)


def test_from_200_good_parts_as_written(tmp_path):
    """Trial images, fit, serve, inspect, as the section writes them; what it says about the
    false-reject rate is what fit reports in fit.json."""
    # run from a checkout, as the README's install does: its models/ holds the shipped
    # classifier, fit's default backbone
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "defect-classifier").symlink_to(REPO / "models" / "defect-classifier")
    answer = json.loads(walk(ANOMALY, tmp_path, timeout=600))
    assert answer["verdict"] == "NG" and answer["model"] == "line3-anomaly", answer
    fit = json.loads((tmp_path / "models" / "line3-anomaly" / "1" / "fit.json").read_text())
    assert fit["held_out_images"] == 40 and fit["finest_measurable_rate"] == 1 / 40
    assert fit["false_reject_target"] == 0.025 and "note" not in fit
    text = section(ANOMALY)
    assert "40 of 200: they measure false-reject rates down to 1/40" in bash_block(ANOMALY)
    assert "visionserve anomaly" not in text.replace(".venv/bin/visionserve anomaly", "")
    assert "0.5% false rejects" not in text
