"""The model repository: ``<root>/<name>/model.toml`` +
``<root>/<name>/<version>/model.{onnx,pt2}``.

A model's served versions are the version folders its ``[version_policy]`` selects
(:attr:`ModelEntry.versions`); :func:`signature` tells a poll of the repository whether a model
changed on disk since it was read.

A model file is code the server runs (a torch.export program is Python that torch evaluates when
it reads it), and a poll loads whatever lands in the folder: :func:`check_writers` refuses a
repository, model folder or model file that a user other than the server's own (or root) can
write (docs/security.md, model files).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import tomllib

from .backends.base import model_file
from .config import ModelConfig, load_model_config
from .errors import ConfigError, NotFound

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    config: ModelConfig
    versions: dict[int, Path]  # version -> model file: the versions the version policy serves

    @property
    def default_version(self) -> int:
        return self.config.default_version or max(self.versions)


def scan(root: Path) -> dict[str, ModelEntry]:
    """Read every model under ``root``; the first problem found is a ConfigError naming the file."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a folder")
    entries: dict[str, ModelEntry] = {}
    for folder in model_folders(root):
        entry = load_entry(folder)
        entries[entry.name] = entry
    if not entries:
        raise ConfigError(f"model repository {root} holds no model (expected <name>/model.toml)")
    return entries


def check_writers(path: Path) -> None:
    """ConfigError unless only this process's user or root can change ``path`` (what a symlink
    points to, and the folder that holds it): not group- or world-writable, owned by this user
    or root. A read-only file system passes: nobody writes it through this mount."""
    real = Path(path).resolve()
    for p in dict.fromkeys((Path(path), real, real.parent if real.is_file() else real)):
        try:
            st = os.stat(p)
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                continue
        except OSError:  # unreadable or gone: the caller's own read says so
            continue
        uid = os.geteuid()
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = "every user" if st.st_mode & stat.S_IWOTH else f"group {st.st_gid}"
            raise ConfigError(
                f"{p} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}): model files are "
                f"code the server runs, so only its own user may change them; run "
                f"'chmod go-w {p}' (docs/security.md#model-files)")
        if st.st_uid not in (uid, 0):
            raise ConfigError(
                f"{p} is owned by uid {st.st_uid}, not by the server's user (uid {uid}) or root: "
                f"model files are code the server runs, so only its own user may change them; "
                f"run 'chown {uid} {p}' or mount the repository read-only "
                f"(docs/security.md#model-files)")


def model_folders(root: Path) -> list[Path]:
    """The folders of ``root`` that hold a ``model.toml``, by name."""
    check_writers(root)
    try:
        return [p for p in sorted(Path(root).iterdir())
                if p.is_dir() and (p / "model.toml").is_file()]
    except FileNotFoundError:
        raise ConfigError(f"model repository {root} is not a folder") from None
    except PermissionError as exc:
        # typically a host folder mounted into a container that runs as another user
        raise ConfigError(f"model repository {root}: {exc.filename or root} is not readable by "
                          f"this process (uid {os.getuid()}, gid {os.getgid()}): "
                          f"{exc.strerror}") from None


def load_entry(folder: Path) -> ModelEntry:
    toml = folder / "model.toml"
    check_writers(folder)
    check_writers(toml)
    config = load_model_config(toml)
    name = folder.name
    if not _NAME_RE.match(name):
        raise ConfigError(f"{folder}: model folder name {name!r} is not a valid model name")
    if config.name is not None and config.name != name:
        raise ConfigError(f"{toml}: field 'name': {config.name!r} differs from the folder name "
                          f"{name!r}")
    filename = model_file(config.runtime.backend)
    found = {int(v.name): v / filename for v in folder.iterdir()
             if v.is_dir() and v.name.isdigit() and int(v.name) > 0 and (v / filename).is_file()}
    if not found:
        raise ConfigError(f"{folder}: no version folder holds {filename} "
                          f"(expected {folder}/1/{filename})")
    policy = config.version_policy
    missing = sorted(set(policy.specific or ()) - set(found))
    if missing:
        raise ConfigError(f"{toml}: field 'version_policy.specific': version(s) {missing} not "
                          f"found (have {sorted(found)} with {filename})")
    versions = {v: found[v] for v in policy.select(found)}
    for file in versions.values():  # the model file and what it may name beside it (ONNX data)
        check_writers(file.parent)
        for beside in file.parent.iterdir():
            check_writers(beside)
    if config.default_version is not None and config.default_version not in versions:
        of = f": the versions [version_policy] serves of {sorted(found)}" \
            if len(versions) != len(found) else ""
        raise ConfigError(f"{toml}: field 'default_version': version {config.default_version} "
                          f"not found (have {sorted(versions)}{of})")
    return ModelEntry(name, folder, config, versions)


def signature(folder: Path) -> tuple:
    """What a poll compares to see whether model ``folder`` changed: the size and modification
    time of its model.toml and of every file in its version folders (empty: no such model).
    Other folders (a model's ``candidates`` area, docs/closed-loop.md) are not read."""
    out = []
    try:
        versions = [p for p in sorted(Path(folder).glob("*/*")) if p.parent.name.isdigit()]
        for path in sorted(Path(folder).glob("model.toml")) + versions:
            st = path.stat()
            out.append((str(path.relative_to(folder)), st.st_size, st.st_mtime_ns))
    except OSError:  # removed or changing while read: the next poll sees it settled
        return ("unreadable",)
    return tuple(out)


def folder_of(root: Path, name: str) -> Path:
    """Model ``name``'s folder in the repository at ``root`` (NotFound when there is none: a name
    is never a path, so ``..`` or ``/`` find nothing)."""
    folder = Path(root) / name
    if not _NAME_RE.match(name) or not (folder / "model.toml").is_file():
        raise NotFound(f"no model {name!r} in the model repository {root} (expected "
                       f"{folder}/model.toml)")
    return folder


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


_DEFAULT_LINE = re.compile(r"^default_version[ \t]*=[ \t]*[0-9]+", re.MULTILINE)


def with_default_version(text: str, version: int) -> str | None:
    """model.toml ``text`` with its top-level ``default_version`` set to ``version``, the rest of
    the file as written; None where it names no default version (the newest is the default)."""
    head_end = re.search(r"^[ \t]*\[", text, re.MULTILINE)
    head = text[:head_end.start()] if head_end else text
    if not _DEFAULT_LINE.search(head):
        return None
    new = _DEFAULT_LINE.sub(f"default_version = {version}", head, count=1) + text[len(head):]
    if tomllib.loads(new).get("default_version") != version:
        raise ConfigError(f"model.toml: default_version could not be set to {version}")
    return new
