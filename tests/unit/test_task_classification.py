"""The classification task: scores and verdicts (the rule a PLC acts on), its OIP outputs and
inspect fields, and the model outputs it binds to."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from visionserve import tasks
from visionserve.backends.checks import ANY, Subject, TensorSpec
from visionserve.config import ModelConfig
from visionserve.errors import ConfigError
from visionserve.tasks.classification import Classification, activate


def config(**kw) -> ModelConfig:
    data = {"input": {"width": 32, "height": 32},
            "output": {"labels": ["ok", "dent", "scratch"],
                       "activation": kw.pop("activation", "softmax")}}
    if kw:
        data["verdict"] = kw
    return ModelConfig.model_validate(data)


def classify(raw: np.ndarray, cfg: ModelConfig) -> list:
    return Classification(cfg).classify(raw)


def test_the_default_task_is_classification():
    task = tasks.create(config())
    assert isinstance(task, Classification) and task.name == "classification"


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
    assert [(v, c.label) for v, c in out] == [("OK", "ok"), ("NG", "dent"), ("NG", "ok")]
    assert out[0][1].score == pytest.approx(0.8, abs=1e-5)
    assert out[0][1].scores.shape == (3,) and out[1][1].index == 1
    # lower threshold: the unsure "ok" passes
    assert classify(raw, config(ok_threshold=0.3))[2][0] == "OK"


def test_threshold_is_inclusive():
    raw = np.array([[0.5, 0.3, 0.2]], np.float32)
    assert classify(raw, config(activation="none", ok_threshold=0.5))[0][0] == "OK"


def test_several_ok_labels():
    raw = np.array([[0.1, 0.9, 0.0]], np.float32)
    out = classify(raw, config(activation="none", ok_labels=["ok", "dent"], ok_threshold=0.5))
    assert (out[0][0], out[0][1].label) == ("OK", "dent")


def test_output_shape_must_match_the_labels():
    with pytest.raises(ValueError, match="does not match 3 labels"):
        classify(np.zeros((2, 4), np.float32), config())
    with pytest.raises(ValueError):
        classify(np.zeros((3,), np.float32), config())


def test_empty_batch():
    assert classify(np.zeros((0, 3), np.float32), config()) == []


def test_postprocess_answers_the_rows_asked_for_from_the_bound_output():
    subject = Subject(Path("/r/m/1/model.onnx"))
    outputs = (TensorSpec("features", (ANY, 16), "float32"),
               TensorSpec("logits", (ANY, 3), "float32"))
    task = Classification(ModelConfig.model_validate({
        "input": {"width": 32, "height": 32},
        "output": {"labels": ["ok", "dent", "scratch"], "activation": "none",
                   "tensor_name": "logits"}}))
    assert task.bind(subject, outputs) == ("logits",)
    raw = {"features": np.zeros((4, 16), np.float32),
           "logits": np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]], np.float32)}
    assert [r.label for _, r in task.postprocess(raw, slice(0, 3))] == ["ok", "dent", "scratch"]
    assert [r.label for _, r in task.postprocess(raw, [2, 0])] == ["scratch", "ok"]


def test_bind_checks_the_declared_output():
    subject = Subject(Path("/r/m/1/model.onnx"))
    task = Classification(config())
    assert task.bind(subject, ()) == ()  # a backend that declares none: the first it returns
    assert task.bind(subject, (TensorSpec("logits", (ANY, 3), "float16"),)) == ("logits",)
    with pytest.raises(ConfigError, match=r"'output.labels'.*expected \[N, 3\], got \[N, 4\]"):
        task.bind(subject, (TensorSpec("logits", (ANY, 4), "float32"),))
    with pytest.raises(ConfigError, match="'output.tensor_name'.*scores must be floating point"):
        task.bind(subject, (TensorSpec("logits", (ANY, 3), "int64"),))
    with pytest.raises(ConfigError, match=r"'output.tensor_name'.*got \[N, 3, 7\]"):
        task.bind(subject, (TensorSpec("logits", (ANY, 3, 7), "float32"),))
    named = Classification(ModelConfig.model_validate({
        "input": {"width": 32, "height": 32},
        "output": {"labels": ["ok", "b", "c"], "tensor_name": "x"}}))
    with pytest.raises(ConfigError, match=r"tensor_name 'x' not in model outputs \['logits'\]"):
        named.bind(subject, (TensorSpec("logits", (ANY, 3), "float32"),))
    # outputs the file does not name (a torch.export program's): the first, whatever
    # tensor_name says
    assert named.bind(subject, (TensorSpec("output0", None, None, named=False),)) == ("output0",)


def test_oip_outputs_and_inspect_fields():
    task = Classification(config())
    results = [r for _, r in classify(np.log(np.array([[0.7, 0.2, 0.1]], np.float32)), config())]
    assert [(o.name, o.datatype, o.dims) for o in task.oip_outputs()] == [
        ("scores", "FP32", (3,)), ("label", "BYTES", ())]
    t = task.oip_tensors(results)
    assert t["scores"].shape == (1, 3) and t["scores"].dtype == np.float32
    assert t["label"].tolist() == [b"ok"]
    fields = task.inspect_fields(results[0])
    assert list(fields) == ["label", "score", "scores"]
    assert list(fields["scores"]) == ["ok", "dent", "scratch"]
    assert task.summary(results[0]) == ("ok", 0, results[0].score)
    assert task.oip_parameters() == {"labels": "ok,dent,scratch", "ok_labels": "ok",
                                     "ok_threshold": "0.5"}
