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


# --------------------------------------------------------------------------- annotations


def _box_holds_mask_tightly(d: synthetic.Defect, shape: tuple[int, ...]) -> None:
    assert d.mask.shape == shape[:2] and d.mask.dtype == bool and d.mask.any()
    x1, y1, x2, y2 = (int(v) for v in d.box)
    assert (x1, y1, x2, y2) == d.box                 # pixel edges
    assert 0 <= x1 < x2 <= shape[1] and 0 <= y1 < y2 <= shape[0]
    outside = d.mask.copy()
    outside[y1:y2, x1:x2] = False
    assert not outside.any()                          # the box contains the mask ...
    inner = d.mask[y1:y2, x1:x2]
    assert inner[0].any() and inner[-1].any() and inner[:, 0].any() and inner[:, -1].any()


@pytest.mark.parametrize("params", [TRAIN_PARAMS, HELDOUT_PARAMS], ids=["train", "heldout"])
@pytest.mark.parametrize("label", LABELS)
def test_annotated_image_is_the_same_image(label, params):
    """Annotating takes no random numbers: the classifier's images stay byte for byte."""
    for seed, size in ((3, SMALL), (8, (200, 150))):
        img, defects = synthetic.generate_annotated(label, seed, size, params)
        assert img.tobytes() == synthetic.generate(label, seed, size, params).tobytes()
        if label == "ok":
            assert defects == ()
        else:
            (d,) = defects
            assert d.label == label
            _box_holds_mask_tightly(d, img.shape)


@pytest.mark.parametrize("label", synthetic.DEFECT_LABELS)
def test_mask_is_where_the_defect_was_drawn(label):
    """The mask each drawing function returns marks the pixels it changed."""
    rng = np.random.default_rng(5)
    surface = synthetic._surface(rng, "painted", 240, 180, TRAIN_PARAMS)
    img = surface.copy()
    soft = synthetic._DRAW[label](rng, img, 180)
    on = soft > synthetic.MASK_THRESHOLD
    changed = np.abs(img - surface).max(axis=2) > 0.02
    assert on.any() and changed[on].mean() > 0.9     # the mask is changed surface ...
    near = cv2.dilate(on.astype(np.uint8), np.ones((7, 7), np.uint8)).astype(bool)
    assert changed[~near].mean() < 0.01              # ... and little changed outside it


def test_masks_follow_the_camera_pose():
    """A bright square drawn before the camera's rotation and shift: its mask lands where the
    square is in the final image."""
    params = SurfaceParams(gradient=(0, 0), vignette=(0, 0), exposure=(1, 1), noise_sigma=(0, 0),
                           blur_sigma=(0, 0), max_rotation_deg=6.0, max_shift=0.05)
    img = np.full((120, 160, 3), 0.2, np.float32)
    mask = np.zeros((120, 160), np.float32)
    mask[40:70, 60:100] = 1.0
    img[mask > 0] = 0.9
    out, (warped,) = synthetic._camera(np.random.default_rng(1), img, 160, 120, params, [mask])
    bright = out[..., 0] > 140
    on = warped > 0.5
    assert (bright != on).mean() < 0.005 and on.sum() > 900
    assert not np.array_equal(on, mask > 0.5)        # it did move


def test_scenes_are_deterministic_and_annotated():
    kinds, counts = set(), set()
    for seed in range(16):
        img, defects = synthetic.generate_scene(seed, SMALL)
        again, defects2 = synthetic.generate_scene(seed, SMALL)
        assert img.tobytes() == again.tobytes()
        assert [(d.label, d.box) for d in defects] == [(d.label, d.box) for d in defects2]
        assert all(np.array_equal(a.mask, b.mask) for a, b in zip(defects, defects2))
        assert len(defects) <= 3
        counts.add(len(defects))
        for d in defects:
            assert d.label in synthetic.DEFECT_LABELS
            kinds.add(d.label)
            _box_holds_mask_tightly(d, img.shape)
        for i, a in enumerate(defects):          # defects are drawn apart from each other
            for b in defects[i + 1:]:
                assert not (a.mask & b.mask).any()
    assert kinds == set(synthetic.DEFECT_LABELS) and counts == {0, 1, 2, 3}


def test_scenes_differ_by_seed_size_and_params_and_from_single_defect_images():
    base = synthetic.generate_scene(1, SMALL)[0].tobytes()
    assert base != synthetic.generate_scene(2, SMALL)[0].tobytes()
    assert base != synthetic.generate_scene(1, SMALL, HELDOUT_PARAMS)[0].tobytes()
    assert synthetic.generate_scene(1, (200, 120))[0].shape == (120, 200, 3)
    assert all(base != synthetic.generate(lab, 1, SMALL).tobytes() for lab in LABELS)


def test_scene_counts_choose_the_number_of_defects():
    for seed in range(4):
        assert synthetic.generate_scene(seed, SMALL, counts=(1.0,))[1] == ()
        assert len(synthetic.generate_scene(seed, SMALL, counts=(0, 1.0))[1]) == 1


@pytest.mark.parametrize("call, match", [
    (lambda: synthetic.generate_scene(-1), "seed"),
    (lambda: synthetic.generate_scene(1, (8, 8)), "size"),
    (lambda: synthetic.generate_scene(1, params="heldout"), "SurfaceParams"),
    (lambda: synthetic.generate_scene(1, counts=()), "counts"),
    (lambda: synthetic.generate_scene(1, counts=(0.5, -0.1)), "counts"),
    (lambda: synthetic.generate_scene(1, counts="many"), "counts"),
    (lambda: synthetic.generate_annotated("dent", 1), "unknown label 'dent'"),
])
def test_bad_scene_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_new_look_of_a_scratch_is_wider_and_fainter():
    """``scratch_width`` and ``scratch_contrast`` draw another look of a scratch; the default
    look's ranges, named, draw the very images of the default params."""
    named = SurfaceParams(scratch_width=(0.004, 0.009), scratch_contrast=(1.0, 1.0))
    assert np.array_equal(synthetic.generate("scratch", 3, SMALL, named),
                          synthetic.generate("scratch", 3, SMALL))
    new = SurfaceParams(scratch_width=(0.03, 0.05), scratch_contrast=(0.25, 0.4))

    def drawn(params: SurfaceParams) -> tuple[int, float]:
        rng = np.random.default_rng(5)
        surface = synthetic._surface(rng, "painted", 240, 180, TRAIN_PARAMS)
        img = surface.copy()
        on = synthetic._scratch(rng, img, 180, params) > synthetic.MASK_THRESHOLD
        return int(on.sum()), float(np.abs(img - surface).max(axis=2)[on].mean())

    (area, step), (new_area, new_step) = drawn(TRAIN_PARAMS), drawn(new)
    assert new_area > 3 * area and new_step < 0.5 * step
    with pytest.raises(ValueError, match="scratch_contrast"):
        SurfaceParams(scratch_contrast=(0.5, 0.2))
