"""The Models page's form for a model's ``[verdict]``: one input per field of the rule in force,
of the kind the field's schema says (the model's task's ``[verdict]`` model, as model.toml is
validated by it). Numbers are number inputs with their limits, a choice is a select, a list of
the model's labels (classification's ``ok_labels``) is a set of checkboxes; anything else (ROI
polygons, detection's defect and count rules) is edited as its JSON text. The server validates
whatever the form sends, as any client's ``PUT /v1/models/{m}/verdict``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..verdicts import SECTION

NUMBER, INTEGER, CHOICE, LABELS, JSON = "number", "integer", "choice", "labels", "json"


@dataclass(frozen=True)
class Field:
    """One input of the form."""

    name: str
    kind: str  #: NUMBER, INTEGER, CHOICE, LABELS or JSON
    value: Any  #: the value in force (JSON text for JSON)
    optional: bool = False  #: may be left empty (null: back to its default, none)
    minimum: float | None = None
    maximum: float | None = None
    options: tuple[str, ...] = ()  #: CHOICE's choices, LABELS' labels
    help: str = ""  #: the schema's description of the field


def fields(config: ModelConfig, values: dict[str, Any]) -> list[Field]:
    """The form's inputs for ``values`` (the ``[verdict]`` in force of ``config``'s model)."""
    schema = type(config).model_json_schema()
    spec = _resolve(schema, schema["properties"].get(SECTION, {}))
    props = spec.get("properties", {})
    labels = tuple((config.model_dump().get("output") or {}).get("labels") or ())
    return [_field(schema, name, _resolve(schema, props.get(name, {})), value, labels)
            for name, value in values.items()]


def _resolve(schema: dict, node: dict) -> dict:
    """``node`` with a ``$ref`` (also the one inside ``allOf``) replaced by what it names."""
    ref = node.get("$ref") or next((n["$ref"] for n in node.get("allOf", ()) if "$ref" in n), None)
    if ref is None:
        return node
    target = schema
    for part in ref.lstrip("#/").split("/"):
        target = target[part]
    return {**target, **{k: v for k, v in node.items() if k not in ("$ref", "allOf")}}


def _field(schema: dict, name: str, node: dict, value: Any, labels: tuple[str, ...]) -> Field:
    variants = [_resolve(schema, v) for v in node.get("anyOf", [node])]
    kinds = [v for v in variants if v.get("type") != "null"]
    optional = len(kinds) < len(variants)
    help_text = node.get("description", "")
    one = kinds[0] if len(kinds) == 1 else {}
    if one.get("type") in (NUMBER, INTEGER):
        low = one.get("minimum", one.get("exclusiveMinimum"))
        high = one.get("maximum", one.get("exclusiveMaximum"))
        return Field(name, one["type"], value, optional, low, high, help=help_text)
    if "enum" in one and all(isinstance(x, str) for x in one["enum"]):
        return Field(name, CHOICE, value, optional, options=tuple(one["enum"]), help=help_text)
    if (one.get("type") == "array" and one.get("items", {}).get("type") == "string" and labels
            and isinstance(value, list) and set(value) <= set(labels)):
        return Field(name, LABELS, value, optional, options=labels, help=help_text)
    return Field(name, JSON, json.dumps(value), optional, help=help_text)
