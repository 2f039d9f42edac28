"""The synthetic surface generator: deterministic, distinct, strict about its arguments."""

from __future__ import annotations

import subprocess
import sys

import cv2
import numpy as np
import pytest

from visionserve_tools import synthetic
from visionserve_tools.synthetic import HELDOUT_PARAMS, LABELS, TRAIN_PARAMS, SurfaceParams

SMALL = (160, 120)


def test_labels_are_the_public_contract():
    assert LABELS == ("ok", "scratch", "spot", "crack", "contamination")


@pytest.mark.parametrize("label", LABELS)
def test_same_arguments_give_identical_bytes(label):
    a = synthetic.generate(label, 7, SMALL)
    b = synthetic.generate(label, 7, SMALL)
    assert a.shape == (120, 160, 3) and a.dtype == np.uint8
    assert a.tobytes() == b.tobytes()
    assert synthetic.encode(a, "png") == synthetic.encode(b, "png")
    assert synthetic.encode(a, "jpeg", 80) == synthetic.encode(b, "jpeg", 80)


def test_camera_size_frame_is_deterministic():
    a = synthetic.generate("crack", 3)
    assert a.shape == (480, 640, 3)
    assert a.tobytes() == synthetic.generate("crack", 3).tobytes()


def test_different_seeds_labels_params_and_sizes_differ():
    base = synthetic.generate("scratch", 1, SMALL)
    assert base.tobytes() != synthetic.generate("scratch", 2, SMALL).tobytes()
    assert base.tobytes() != synthetic.generate("spot", 1, SMALL).tobytes()
    assert base.tobytes() != synthetic.generate("scratch", 1, SMALL, HELDOUT_PARAMS).tobytes()
    assert synthetic.generate("ok", 1, (200, 120)).shape == (120, 200, 3)


def test_images_are_not_degenerate():
    img = synthetic.generate("ok", 11, SMALL)
    assert 20 < img.mean() < 235
    assert img.std() > 1.0          # texture and noise, not a flat fill


def test_generate_set_is_deterministic_interleaved_and_alternates_sizes():
    sizes = ((64, 48), (96, 80))
    one = list(synthetic.generate_set(2, 5, sizes=sizes))
    two = list(synthetic.generate_set(2, 5, sizes=sizes))
    assert [lab for _, lab in one] == list(LABELS) * 2
    assert [im.shape[:2] for im, _ in one] == [(48, 64)] * 5 + [(80, 96)] * 5
    assert all(a.tobytes() == b.tobytes() for (a, _), (b, _) in zip(one, two))
    other = list(synthetic.generate_set(2, 6, sizes=sizes))
    assert all(a.tobytes() != b.tobytes() for (a, _), (b, _) in zip(one, other))
    # A larger set starts with the images of a smaller one.
    bigger = list(synthetic.generate_set(3, 5, sizes=sizes))
    assert all(a.tobytes() == b.tobytes() for (a, _), (b, _) in zip(one, bigger))


@pytest.mark.parametrize("fmt", ["png", "bmp"])
def test_lossless_encodings_round_trip(fmt):
    img = synthetic.generate("contamination", 4, SMALL)
    back = cv2.imdecode(np.frombuffer(synthetic.encode(img, fmt), np.uint8), cv2.IMREAD_COLOR)
    assert np.array_equal(back, img)


def test_jpeg_encoding_decodes_and_quality_matters():
    img = synthetic.generate("spot", 4, SMALL)
    hi, lo = synthetic.encode(img, "jpeg", 95), synthetic.encode(img, "jpg", 30)
    assert hi[:2] == b"\xff\xd8" and len(lo) < len(hi)
    back = cv2.imdecode(np.frombuffer(hi, np.uint8), cv2.IMREAD_COLOR)
    assert back.shape == img.shape


@pytest.mark.parametrize("call, match", [
    (lambda: synthetic.generate("dent", 1), "unknown label 'dent'"),
    (lambda: synthetic.generate("ok", 1, (0, 480)), "size"),
    (lambda: synthetic.generate("ok", 1, (640, -1)), "size"),
    (lambda: synthetic.generate("ok", 1, (640,)), "size"),
    (lambda: synthetic.generate("ok", 1, "640x480"), "size"),
    (lambda: synthetic.generate("ok", 1, (64.0, 48)), "size"),
    (lambda: synthetic.generate("ok", -1), "seed"),
    (lambda: synthetic.generate("ok", 1, params="train"), "SurfaceParams"),
    (lambda: list(synthetic.generate_set(0, 1)), "n_per_label"),
    (lambda: list(synthetic.generate_set(1, 1, sizes=((10, 0),))), "size"),
    (lambda: synthetic.encode(np.zeros((8, 8, 3), np.uint8), "gif"), "unknown image format 'gif'"),
    (lambda: synthetic.encode(np.zeros((8, 8, 3), np.uint8), "jpeg", 0), "quality"),
    (lambda: synthetic.encode(np.zeros((8, 8, 3), np.float32), "png"), "uint8"),
    (lambda: SurfaceParams(textures=("wood",)), "unknown texture"),
    (lambda: SurfaceParams(noise_sigma=(5.0, 1.0)), "noise_sigma"),
])
def test_bad_arguments_raise_value_error_naming_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_train_and_heldout_params_differ():
    assert TRAIN_PARAMS != HELDOUT_PARAMS


def test_import_is_cheap():
    code = ("import sys, visionserve_tools.synthetic; "
            "print(sorted(m for m in ('torch', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
