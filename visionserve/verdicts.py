"""A model's ``[verdict]`` changed while it serves: checked, then written back to its model.toml.

``PUT /v1/models/{m}/verdict`` ends here (through the engine, which serialises changes per
model and swaps the served tasks' settings). A change is validated by the schema of the model's
task, the whole file with the new values in, so a value out of range, an unknown field or a
rule that no longer fits the outputs (classification's ``ok_labels``) is refused with the field
named and nothing written. The file is rewritten atomically (a temporary file in the same folder,
flushed, then renamed over it): a reader sees the old file or the new one, never a torn one.
Only the changed keys' lines of ``[verdict]`` are rewritten; comments, the other sections and
the layout stay as they were (a multi-line value's inner comments go with it).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .config import ModelConfig
from .errors import ConfigError, InternalError, InvalidInput, describe_validation

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SECTION = "verdict"

_HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\"' -]+?)\s*\]\s*(#.*)?$")
_ANY_HEADER = re.compile(r"^\s*\[")
_KEY = re.compile(r"^(\s*)([A-Za-z0-9_-]+)\s*=\s*(.*)$")


def current(config: ModelConfig) -> dict[str, Any]:
    """The ``[verdict]`` values in force (defaults included), as JSON values."""
    if SECTION not in type(config).model_fields:
        raise InvalidInput(f"task {config.task!r} has no [{SECTION}] section to read or change")
    return getattr(config, SECTION).model_dump(mode="json")


def change(toml: Path, changes: Any) -> tuple[ModelConfig, str]:
    """``toml`` with ``[verdict]``'s fields in ``changes`` set (None: removed, i.e. back to its
    default): (the new config, the new file text), validated; nothing is written. InvalidInput
    names the field for a change the schema refuses."""
    if not isinstance(changes, Mapping) or not changes:
        raise InvalidInput(f"the body must be a JSON object of [{SECTION}] fields to change, "
                           f"e.g. {{\"image_threshold\": 0.6}}; got {json.dumps(changes)[:80]}")
    try:
        text = toml.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{toml}: cannot be read ({exc}); the change is not applied") from None
    section = dict(data.get(SECTION) or {})
    for key, value in changes.items():
        if value is None:
            section.pop(key, None)
        else:
            section[key] = value
    data[SECTION] = section
    try:
        config = ModelConfig.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(describe_validation(exc, field=True, got=True))
        raise InvalidInput(f"[{SECTION}] not changed: {errs}") from None
    if SECTION not in type(config).model_fields:
        raise InvalidInput(f"task {config.task!r} has no [{SECTION}] section to change")
    new_text = edit_section(text, SECTION, {k: changes[k] for k in changes})
    # the text must say what was validated (the editor is for people's files: check it)
    again = ModelConfig.model_validate(tomllib.loads(new_text))
    if again != config:
        raise InternalError(f"{toml}: rewriting [{SECTION}] would not give the validated values")
    return config, new_text


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename: readers see the old file or the new one.
    ConfigError (nothing changed) when the folder cannot be written."""
    try:
        _write_atomic(Path(path), text)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be rewritten ({exc.strerror or exc}); the change is "
                          "not applied. The model repository must be writable by the server to "
                          "change settings at run time (the container image's shipped models "
                          "are read-only: mount a writable repository)") from None


def _write_atomic(path: Path, text: str) -> None:
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


# --- TOML text ---------------------------------------------------------------------------------

def toml_value(value: Any) -> str:
    """A JSON value as a TOML value (arrays and inline tables for lists and objects)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise InvalidInput(f"{value!r} cannot be written to model.toml")


def _strip_comment(rest: str) -> tuple[str, str]:
    """A value's text and its trailing comment (``#`` outside strings)."""
    quote = None
    i = 0
    while i < len(rest):
        c = rest[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            return rest[:i].rstrip(), rest[i:]
        i += 1
    return rest.rstrip(), ""


def _depth(text: str) -> int:
    """Open brackets/braces left by ``text`` (strings and comments ignored)."""
    value, _ = _strip_comment(text)
    depth, quote = 0, None
    for i, c in enumerate(value):
        if quote:
            if c == quote and (quote == "'" or value[i - 1] != "\\"):
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
    return depth


def edit_section(text: str, section: str, values: Mapping[str, Any]) -> str:
    """``text`` with each key of ``values`` set in ``[section]`` (None: the key's line removed),
    the rest of the text as it was: a changed key keeps its line's place and trailing comment,
    a new key goes after the section's last key, a missing section is added at the end."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines)
                  if (m := _HEADER.match(ln)) and m.group(1).strip() == section), None)
    if start is None:
        add = [f"{k} = {toml_value(v)}\n" for k, v in values.items() if v is not None]
        if not add:
            return text
        sep = "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
        return text + sep + f"[{section}]\n" + "".join(add)
    todo = dict(values)
    out = lines[:start + 1]
    last_key = start  # index in out after which new keys go
    i = start + 1
    while i < len(lines) and not _ANY_HEADER.match(lines[i]):  # the next table ends it
        m = _KEY.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent, key, rest = m.groups()
        span = 1  # a multi-line array or table: through its closing bracket
        depth = _depth(rest)
        while depth > 0 and i + span < len(lines):
            depth += _depth(lines[i + span])
            span += 1
        if key in todo:
            value = todo.pop(key)
            if value is not None:
                _, comment = _strip_comment(rest) if span == 1 else ("", "")
                newline = "\n" if lines[i + span - 1].endswith("\n") else ""
                gap = "  " if comment else ""
                out.append(f"{indent}{key} = {toml_value(value)}{gap}{comment}{newline}")
                last_key = len(out) - 1
        else:
            out.extend(lines[i:i + span])
            last_key = len(out) - 1
        i += span
    add = [f"{k} = {toml_value(v)}\n" for k, v in todo.items() if v is not None]
    if add and not out[last_key].endswith("\n"):
        out[last_key] += "\n"
    out[last_key + 1:last_key + 1] = add
    return "".join(out + lines[i:])
