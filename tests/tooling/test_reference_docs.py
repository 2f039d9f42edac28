"""The reference pages that models/scripts generate from the code are current: docs/settings.md
from the server's settings, docs/model-toml.md from the ``model.toml`` schema."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from visionserve.config import ModelConfig, ServerSettings

REPO = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    path = REPO / "models" / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_settings_reference_is_generated_from_the_code():
    text = _script("settings_doc").render()
    assert (REPO / "docs" / "settings.md").read_text() == text, \
        "docs/settings.md is stale: run python models/scripts/settings_doc.py"
    for name in ServerSettings.model_fields:
        assert f"`VISIONSERVE_{name.upper()}`" in text


def test_model_toml_reference_is_generated_from_the_schema():
    text = _script("model_toml_doc").render()
    assert (REPO / "docs" / "model-toml.md").read_text() == text, \
        "docs/model-toml.md is stale: run python models/scripts/model_toml_doc.py"
    for name in ModelConfig.model_fields["input"].annotation.model_fields:
        assert f"`{name}`" in text
