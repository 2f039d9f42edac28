"""The task and backend registries: built-ins, plug-ins from entry points, and the model.toml
errors for names nobody registered."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from visionserve import tasks
from visionserve.backends.base import backend_class, model_file
from visionserve.config import ModelConfig, load_model_config
from visionserve.errors import ConfigError
from visionserve.plugins import BACKENDS, TASKS, Registry

PLUGINS = Path(__file__).resolve().parents[1] / "integration" / "plugins"

TOML = """\
task = "{task}"
[input]
width = 32
height = 32
[output]
{output}
[verdict]
{verdict}
"""


def write(tmp_path: Path, task: str, output: str = "",
          verdict: str = "target = 1.0\ntolerance = 0.1") -> Path:
    path = tmp_path / "model.toml"
    path.write_text(TOML.format(task=task, output=output, verdict=verdict))
    return path


def dist(site: Path, group: str, line: str, name: str = "plugin") -> None:
    d = site / f"{name}-0.1.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (d / "entry_points.txt").write_text(f"[{group}]\n{line}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for distributions made by the test; the registries forget them after."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.syspath_prepend(str(PLUGINS))
    for r in (TASKS, BACKENDS):
        r.refresh()
    yield folder
    for r in (TASKS, BACKENDS):
        r.refresh()
        for name in [n for n in r._loaded if n not in r.builtins]:
            r._loaded.pop(name)


def test_the_built_ins():
    assert TASKS.names()[0] == "classification" and "classification" in TASKS
    assert BACKENDS.names()[:2] == ["onnxruntime", "torch"]
    assert (model_file("onnxruntime"), model_file("torch")) == ("model.onnx", "model.pt2")
    assert backend_class("onnxruntime").platform == "onnxruntime_onnx"
    assert backend_class("onnxruntime").device_memory == "arena"
    assert backend_class("torch").device_memory == "torch"


def test_an_unknown_task_names_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_model_config(write(tmp_path, "regresion"))
    msg = str(info.value)
    known = ", ".join(TASKS.names())
    assert "classification" in known and "detection" in known
    assert f"{tmp_path / 'model.toml'}: field 'task': unknown task 'regresion'; tasks: " \
           f"{known} (more come from installed packages, entry point group " \
           "visionserve.tasks) (got 'regresion')" == msg


def test_an_unknown_backend_names_the_known_ones(tmp_path):
    path = tmp_path / "model.toml"
    path.write_text('[input]\nwidth = 32\nheight = 32\n[output]\nlabels = ["ok"]\n'
                    '[runtime]\nbackend = "tensorrt"\n')
    with pytest.raises(ConfigError, match=r"field 'runtime.backend': unknown backend 'tensorrt'; "
                                          r"backends: onnxruntime, torch \(more come"):
        load_model_config(path)


def test_a_task_from_an_entry_point(site, tmp_path):
    dist(site, "visionserve.tasks", "regression = regression_task:Regression")
    assert TASKS.names() == [*TASKS.builtins, "regression"]
    cfg = load_model_config(write(tmp_path, "regression", 'tensor_name = "level"'))
    assert type(cfg).__name__ == "RegressionConfig" and cfg.verdict.tolerance == 0.1
    assert tasks.create(cfg).name == "regression"
    # its own sections, validated by its schema, with the file and the field named
    with pytest.raises(ConfigError, match=r"field 'verdict.tolerance': .*greater than or equal"):
        load_model_config(write(tmp_path, "regression", verdict="target = 1.0\ntolerance = -1"))
    with pytest.raises(ConfigError, match=r"field 'output.labels': unknown field"):
        load_model_config(write(tmp_path, "regression", 'labels = ["ok"]'))
    # ModelConfig.model_validate is the union too
    assert type(ModelConfig.model_validate(cfg.model_dump())) is type(cfg)


def test_a_plug_in_that_cannot_be_imported_is_named(site, tmp_path):
    dist(site, "visionserve.tasks", "broken = no_such_module_here:Task")
    with pytest.raises(ConfigError, match=r"field 'task': task 'broken' cannot be loaded: "
                                          r"ModuleNotFoundError: No module named 'no_such_module"):
        load_model_config(write(tmp_path, "broken"))


def test_a_plug_in_may_not_replace_a_built_in(site, caplog):
    dist(site, "visionserve.tasks", "classification = regression_task:Regression")
    with caplog.at_level(logging.WARNING, logger="visionserve.plugins"):
        assert TASKS.names() == list(TASKS.builtins)
        assert TASKS.load("classification").__module__ == "visionserve.tasks.classification"
    assert "a built-in has that name" in caplog.text


def test_a_registry_loads_dotted_attributes():
    r = Registry("thing", "visionserve.test-none", {"path": "os:path.join"})
    import os

    assert r.load("path") is os.path.join and "path" in r and "other" not in r
