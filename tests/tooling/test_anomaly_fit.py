"""``visionserve anomaly fit`` end to end on a small generated folder: a model folder the server
serves (a spot scores above a good part), and bad folders refused with the files named and
nothing left in the model repository."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
from conftest import REPO, start_server

from visionserve import tasks
from visionserve.backends import base as backends
from visionserve.backends.checks import Subject
from visionserve.config import load_model_config
from tests.tools.notorch import no_torch_site
from visionserve_tools import synthetic

SIZE = (320, 240)


def good_folder(folder: Path, n: int, size: tuple[int, int] = SIZE) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        img = synthetic.generate("ok", synthetic._item_seed(5, i), size)
        cv2.imwrite(str(folder / f"ok_{i:03d}.png"), img)
    return folder


def fit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "visionserve", "anomaly", "fit", "--quiet",
                           "--max-bank", "256", "--threads", "2", *args],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)


def png(img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", img)
    assert ok
    return buf.tobytes()


def test_fit_writes_a_served_model(tmp_path):
    good = good_folder(tmp_path / "good", 24)
    models = tmp_path / "models"
    r = fit("--good", str(good), "--name", "parts", "--models-dir", str(models),
            "--false-reject", "0.1")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    v = models / "parts" / "1"
    for name in ("model.onnx", "model.pt2", "metadata.json", "fit.json", "report.png"):
        assert (v / name).is_file(), name
    assert report["memory_bank_rows"] == 256 and report["memory_bank_bytes"] == 256 * 96 * 4
    assert report["held_out_images"] == 5 and report["fit_images"] == 19
    meta = json.loads((v / "metadata.json").read_text())
    assert meta["image_threshold"] == report["threshold"]
    config = load_model_config(models / "parts" / "model.toml")
    assert (config.task, config.output.format) == ("anomaly", "raw")  # type: ignore[attr-defined]
    assert "visionserve anomaly fit" in (models / "parts" / "model.toml").read_text()
    assert sorted(p.name for p in models.iterdir()) == ["parts"]  # no temporary folder left

    # a second fit is version 2, model.toml kept
    toml = (models / "parts" / "model.toml").read_text()
    r = fit("--good", str(good), "--name", "parts", "--models-dir", str(models), "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert (models / "parts" / "2" / "model.onnx").is_file()
    assert (models / "parts" / "model.toml").read_text() == toml

    # model.pt2 (the torch backend) answers as model.onnx does: named outputs, same scores
    x = np.random.default_rng(0).random((2, 3, 160, 160), np.float32)
    scores = []
    for backend in ("onnxruntime", "torch"):
        cfg = config.model_copy(update={"runtime": config.runtime.model_copy(
            update={"backend": backend})})
        b = backends.create(backend)
        path = v / backends.model_file(backend)
        b.load(path, cfg, "cpu")
        task = tasks.create(cfg)
        b.select_outputs(task.bind(Subject(path), b.outputs))
        scores.append([r.score for _, r in task.postprocess(b.run(x), slice(0, 2))])
    np.testing.assert_allclose(scores[0], scores[1], atol=1e-4)

    s = start_server(models, tmp_path, grpc=False)
    try:
        def inspect(img: np.ndarray) -> dict:
            resp = httpx.post(f"{s.url}/v1/models/parts/inspect", content=png(img),
                              headers={"Content-Type": "image/png"}, timeout=60)
            assert resp.status_code == 200, resp.text
            return resp.json()

        ok = inspect(synthetic.generate("ok", 999, SIZE))
        spot = inspect(synthetic.generate("spot", 999, SIZE))
        assert spot["raw_score"] > ok["raw_score"]
        assert spot["verdict"] == "NG" and spot["regions"]
    finally:
        s.stop()


@pytest.mark.parametrize("suffix", [".pt2", ".onnx"])
def test_a_backbone_of_ones_own(tmp_path, suffix):
    """A .pt2 or .onnx whose outputs are feature maps (here: the classifier's stages, exported
    with other names and a narrower batch range than the fit's own)."""
    import warnings

    import torch

    from visionserve_tools.training import patchcore

    net, _ = patchcore.classifier_backbone(REPO / "models/defect-classifier/1/weights.pt")
    x = torch.zeros(2, 3, 160, 160)
    path = tmp_path / f"backbone{suffix}"
    if suffix == ".pt2":
        batch = torch.export.Dim("batch", min=1, max=1024)
        torch.export.save(torch.export.export(net, (x,), dynamic_shapes=({0: batch},)), str(path))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(net, (x,), str(path), input_names=["images"],
                              output_names=["f1", "f2"], opset_version=17, dynamo=False,
                              dynamic_axes={n: {0: "b"} for n in ("images", "f1", "f2")})
    good = good_folder(tmp_path / "good", 20)
    models = tmp_path / "models"
    r = fit("--good", str(good), "--name", "own", "--models-dir", str(models),
            "--backbone", str(path))
    assert r.returncode == 0, r.stderr
    v = models / "own" / "1"
    assert (v / "model.onnx").is_file() and (v / "model.pt2").is_file() == (suffix == ".pt2")
    # the written model serves: its outputs fit the task
    config = load_model_config(models / "own" / "model.toml")
    b = backends.create("onnxruntime")
    b.load(v / "model.onnx", config, "cpu")
    task = tasks.create(config)
    b.select_outputs(task.bind(Subject(v / "model.onnx"), b.outputs))
    (verdict, result), = task.postprocess(b.run(np.zeros((1, 3, 160, 160), np.float32)),
                                          slice(0, 1))
    assert verdict in ("OK", "NG") and result.map.shape == (80, 80)


def test_fit_without_the_train_extra_says_which_to_install(tmp_path):
    """Without torch, ``fit`` still checks --good first, then names the extra in one line,
    exit 2, no traceback."""
    site = no_torch_site(tmp_path / "site", tmp_path / "torch-imports.txt")
    env = {**os.environ, "PYTHONPATH": f"{site}:{REPO}"}

    def fit_here(good: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "visionserve", "anomaly", "fit", "--good",
                               str(good), "--name", "parts", "--models-dir",
                               str(tmp_path / "models")],
                              cwd=str(REPO), env=env, capture_output=True, text=True, timeout=120)

    r = fit_here(tmp_path / "missing")
    assert r.returncode == 2 and r.stderr == f"error: --good {tmp_path / 'missing'} is not a folder\n"
    r = fit_here(good_folder(tmp_path / "good", 20))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: visionserve anomaly fit needs torch, which this install "
                               "does not have: pip install 'visionserve[train]'")
    assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "models").exists()


def test_too_few_images(tmp_path):
    good = good_folder(tmp_path / "good", 5)
    r = fit("--good", str(good), "--name", "parts", "--models-dir", str(tmp_path / "models"))
    assert r.returncode == 2
    assert "5 image file(s)" in r.stderr and "at least 20" in r.stderr
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_unreadable_and_mixed_sizes_named(tmp_path):
    good = good_folder(tmp_path / "good", 22)
    (good / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (good / "notes.jpg").write_text("hello")
    models = tmp_path / "models"
    r = fit("--good", str(good), "--name", "parts", "--models-dir", str(models))
    assert r.returncode == 2
    assert "2 unreadable image file(s)" in r.stderr
    assert "broken.png" in r.stderr and "notes.jpg" in r.stderr
    (good / "broken.png").unlink()
    (good / "notes.jpg").unlink()
    cv2.imwrite(str(good / "big.png"), synthetic.generate("ok", 1, (640, 480)))
    r = fit("--good", str(good), "--name", "parts", "--models-dir", str(models))
    assert r.returncode == 2
    assert "2 sizes" in r.stderr and "big.png (640x480)" in r.stderr
    assert "320x240 for 22" in r.stderr
    assert not models.exists() or not any(models.iterdir())


@pytest.mark.parametrize("args, message", [
    (("--backbone", "nope.pt2"), "--backbone nope.pt2: no such file"),
    (("--false-reject", "0.7"), "--false-reject 0.7"),
])
def test_bad_options(tmp_path, args, message):
    good = good_folder(tmp_path / "good", 20)
    r = fit("--good", str(good), "--name", "p", "--models-dir", str(tmp_path / "m"), *args)
    assert r.returncode == 2 and message in r.stderr
