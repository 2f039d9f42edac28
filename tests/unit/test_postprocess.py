"""Scores and verdicts: the rule a PLC acts on."""

from __future__ import annotations

import numpy as np
import pytest

from visionserve.config import ModelConfig
from visionserve.postprocess import activate, classify


def config(**kw) -> ModelConfig:
    data = {"input": {"width": 32, "height": 32},
            "output": {"labels": ["ok", "dent", "scratch"], "activation": kw.pop("activation", "softmax")}}
    if kw:
        data["verdict"] = kw
    return ModelConfig.model_validate(data)


def test_softmax_rows_sum_to_one_and_are_stable_for_large_logits():
    raw = np.array([[1000.0, 0.0, -1000.0], [1.0, 2.0, 3.0]], np.float32)
    s = activate(raw, "softmax")
    assert np.allclose(s.sum(axis=1), 1.0)
    assert np.isfinite(s).all()
    assert s[0, 0] == pytest.approx(1.0)
    assert s[1].argmax() == 2


def test_sigmoid_and_none():
    raw = np.array([[0.0, 80.0, -80.0]], np.float32)
    assert np.allclose(activate(raw, "sigmoid"), [[0.5, 1.0, 0.0]], atol=1e-6)
    assert np.array_equal(activate(raw, "none"), raw)


def test_ok_verdict_needs_an_ok_label_above_the_threshold():
    raw = np.log(np.array([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.4, 0.35, 0.25]], np.float32))
    out = classify(raw, config(ok_threshold=0.5))
    assert [(c.verdict, c.label) for c in out] == [("OK", "ok"), ("NG", "dent"), ("NG", "ok")]
    assert out[0].score == pytest.approx(0.8, abs=1e-5)
    assert out[0].scores.shape == (3,)
    # lower threshold: the unsure "ok" passes
    assert classify(raw, config(ok_threshold=0.3))[2].verdict == "OK"


def test_threshold_is_inclusive():
    raw = np.array([[0.5, 0.3, 0.2]], np.float32)
    assert classify(raw, config(activation="none", ok_threshold=0.5))[0].verdict == "OK"


def test_several_ok_labels():
    raw = np.array([[0.1, 0.9, 0.0]], np.float32)
    out = classify(raw, config(activation="none", ok_labels=["ok", "dent"], ok_threshold=0.5))
    assert (out[0].verdict, out[0].label) == ("OK", "dent")


def test_output_shape_must_match_the_labels():
    with pytest.raises(ValueError, match="does not match 3 labels"):
        classify(np.zeros((2, 4), np.float32), config())
    with pytest.raises(ValueError):
        classify(np.zeros((3,), np.float32), config())


def test_empty_batch():
    assert classify(np.zeros((0, 3), np.float32), config()) == []
