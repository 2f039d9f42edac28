"""The shipped model.toml validates; bad files are refused with the file and the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionserve.config import ModelConfig, load_model_config
from visionserve.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "models" / "defect-classifier" / "model.toml"


def test_shipped_model_toml_validates():
    cfg = load_model_config(SHIPPED)
    assert isinstance(cfg, ModelConfig)
    assert cfg.output.labels == ("ok", "scratch", "spot", "crack", "contamination")
    assert cfg.output.activation == "softmax"
    assert cfg.verdict.ok_labels == ("ok",)
    assert cfg.input.tensor_name == "input" and cfg.output.tensor_name == "logits"
    assert cfg.input.name == "image"
    assert cfg.batching.preferred_batch_sizes[-1] <= cfg.batching.max_batch_size


def _variant(tmp_path: Path, old: str, new: str) -> Path:
    text = SHIPPED.read_text()
    assert old in text
    path = tmp_path / "model.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize("old, new, field, words", [
    ("width = 160\n", "width = 160\nwidht = 160\n", "input.widht", "unknown field"),
    ("[verdict]\n", "[verdict]\nthreshold = 0.5\n", "verdict.threshold", "unknown field"),
    ("width = 160\n", "width = 0\n", "input.width", "greater than or equal"),
    ('resize = "stretch"', 'resize = "squash"', "input.resize", "squash"),
    ("ok_threshold = 0.5", "ok_threshold = 1.5", "verdict.ok_threshold", "1.5"),
    ("max_batch_size = 32", "max_batch_size = 16", "batching", "exceed max_batch_size"),
    ('labels = ["ok", "scratch", "spot", "crack", "contamination"]', "", "output.labels", "required"),
    ("height = 160\n", "", "input.height", "required"),
])
def test_bad_model_toml_is_refused_with_file_and_field(tmp_path, old, new, field, words):
    path = _variant(tmp_path, old, new)
    with pytest.raises(ConfigError) as info:
        load_model_config(path)
    msg = str(info.value)
    assert str(path) in msg and f"'{field}" in msg and words in msg


def test_ok_labels_must_be_output_labels(tmp_path):
    path = _variant(tmp_path, 'ok_labels = ["ok"]', 'ok_labels = ["good"]')
    with pytest.raises(ConfigError, match="good"):
        load_model_config(path)


def test_not_toml_is_refused_with_file(tmp_path):
    path = tmp_path / "model.toml"
    path.write_text("[input\nwidth = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_model_config(path)


@pytest.mark.parametrize("command, words", [
    ('["python", "train.py", "{data}"]', "must name {out}"),
    ('["python", "train.py", "{out}"]', "must name {data}"),
    ('["python", "{data}", "{out}", "{epochs}"]', "names {epochs}; the placeholders are {data}"),
    ('["python", "{data", "{out}"]', "a literal brace is written twice"),
    ("[]", "needs the program to run first"),
])
def test_a_training_command_is_checked(tmp_path, command, words):
    """[training] command: the labelled set and the output named, no unknown placeholder."""
    path = tmp_path / "model.toml"
    path.write_text(SHIPPED.read_text() + f"\n[training]\ncommand = {command}\n")
    with pytest.raises(ConfigError) as info:
        load_model_config(path)
    assert "'training.command" in str(info.value) and words in str(info.value)


def test_a_training_section():
    cfg = ModelConfig.model_validate({
        "input": {"width": 8, "height": 8}, "output": {"labels": ["ok", "ng"]},
        "training": {"command": ["{python}", "t.py", "{data}", "{out}", "--lit", "{{x}}"],
                     "gpu_memory": "4GiB", "good": "good"}})
    assert cfg.training.command == ("{python}", "t.py", "{data}", "{out}", "--lit", "{{x}}")
    assert ModelConfig.model_validate({"input": {"width": 8, "height": 8},
                                       "output": {"labels": ["ok"]}}).training.command is None
    with pytest.raises(ValueError, match="gpu_memory"):
        ModelConfig.model_validate({"input": {"width": 8, "height": 8},
                                    "output": {"labels": ["ok"]},
                                    "training": {"gpu_memory": "lots"}})
