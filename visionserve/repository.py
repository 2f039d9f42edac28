"""The model repository: ``<root>/<name>/model.toml`` +
``<root>/<name>/<version>/model.{onnx,pt2}``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .backends.base import model_file
from .config import ModelConfig, load_model_config
from .errors import ConfigError, NotFound

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    config: ModelConfig
    versions: dict[int, Path]  # version -> model file

    @property
    def default_version(self) -> int:
        return self.config.default_version or max(self.versions)


def scan(root: Path) -> dict[str, ModelEntry]:
    """Read every model under ``root``; the first problem found is a ConfigError naming the file."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a folder")
    entries: dict[str, ModelEntry] = {}
    try:
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            toml = folder / "model.toml"
            if not toml.is_file():
                continue
            entry = load_entry(folder)
            entries[entry.name] = entry
    except PermissionError as exc:
        # typically a host folder mounted into a container that runs as another user
        raise ConfigError(f"model repository {root}: {exc.filename or root} is not readable by "
                          f"this process (uid {os.getuid()}, gid {os.getgid()}): "
                          f"{exc.strerror}") from None
    if not entries:
        raise ConfigError(f"model repository {root} holds no model (expected <name>/model.toml)")
    return entries


def load_entry(folder: Path) -> ModelEntry:
    toml = folder / "model.toml"
    config = load_model_config(toml)
    name = folder.name
    if not _NAME_RE.match(name):
        raise ConfigError(f"{folder}: model folder name {name!r} is not a valid model name")
    if config.name is not None and config.name != name:
        raise ConfigError(f"{toml}: field 'name': {config.name!r} differs from the folder name "
                          f"{name!r}")
    filename = model_file(config.runtime.backend)
    versions = {int(v.name): v / filename for v in folder.iterdir()
                if v.is_dir() and v.name.isdigit() and int(v.name) > 0 and (v / filename).is_file()}
    if not versions:
        raise ConfigError(f"{folder}: no version folder holds {filename} "
                          f"(expected {folder}/1/{filename})")
    if config.default_version is not None and config.default_version not in versions:
        raise ConfigError(f"{toml}: field 'default_version': version {config.default_version} "
                          f"not found (have {sorted(versions)})")
    return ModelEntry(name, folder, config, versions)


def parse_version(entry: ModelEntry, version: str | int | None) -> int:
    """'' / None -> the default version; otherwise it must exist (404 otherwise)."""
    if version in (None, ""):
        return entry.default_version
    try:
        v = int(version)
    except (TypeError, ValueError):
        raise NotFound(f"model {entry.name} has no version {version!r} "
                       f"(have {sorted(entry.versions)})") from None
    if v not in entry.versions:
        raise NotFound(f"model {entry.name} has no version {v} (have {sorted(entry.versions)})")
    return v
