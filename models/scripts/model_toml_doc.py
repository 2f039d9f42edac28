"""Regenerate ``docs/model-toml.md`` from the pydantic schemas: ``visionserve/config.py`` (what
every model has) and each built-in task's (``visionserve/tasks/``).

    python models/scripts/model_toml_doc.py            # writes docs/model-toml.md
    python models/scripts/model_toml_doc.py --check    # exit 1 if the file is out of date
"""

from __future__ import annotations

import argparse
import inspect
import sys
import typing
from pathlib import Path

from visionserve.backends import checks
from visionserve.config import ModelConfig
from visionserve.errors import ConfigError
from visionserve.plugins import TASKS

REPO = Path(__file__).resolve().parents[2]  # a checkout tool: it rewrites the checkout's docs/
DOC = REPO / "docs" / "model-toml.md"
EXAMPLE = REPO / "models" / "defect-classifier" / "model.toml"

# Rules that live in model validators rather than in single fields.
CROSS_FIELD_RULES = {
    "input": ["`mean` and `std` need one value per channel; every `std` value must be > 0.",
              "`color_order = \"GRAY\"` goes with `channels = 1`; `RGB`/`BGR` with `channels = 3`."],
    "classification.output": ["`labels` must be unique."],
    "classification": ["Every `verdict.ok_labels` entry must be one of `output.labels`."],
    "batching": [("`preferred_batch_sizes` must be increasing positive integers, the largest "
                  "<= `max_batch_size`.")],
    "runtime": ["`gpu_memory_budget` takes sizes such as `512MiB`, `2GiB`, `800MB` or a byte count."],
    "anomaly.normalization": ["`max` > `min` (and `pixel_max` > `pixel_min`), all finite.",
                              "A raw-scale model with neither this section nor a `metadata.json` "
                              "next to its model file is refused at load."],
    "anomaly.verdict": ["`area_unit = \"mm2\"` needs `pixels_per_mm`.",
                        "Each `roi` polygon has 3 or more points; a map pixel counts when its "
                        "centre is inside one (on an edge counts).",
                        "Changed while serving with `PUT /v1/models/{m}/verdict` (docs/anomaly.md)."],
    "training": ["`command` names `{data}` and `{out}`, and no placeholder but those listed "
                 "(a literal brace is written twice); its first item is the program. How each "
                 "model is trained, and the labelled set's layout: docs/closed-loop.md.",
                 "`gpu_memory` takes sizes as `runtime.gpu_memory_budget` does."],
    "version_policy": ["Set one of `latest`, `specific`, `all`; `specific` versions must each "
                       "have their folder, and `default_version` must be one of the served "
                       "versions."],
    "": ["Unknown fields anywhere are refused (a typo must not be silently ignored)."],
}


def _type_name(ann: object) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`".replace("'", '"') for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " (optional)"
    if origin is tuple:
        inner = _type_name(args[0]) if args else "any"
        return f"list of {inner}"
    return getattr(ann, "__name__", str(ann))


def _constraints(field) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "min length")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    d = field.default
    if d is None:
        return "none"
    if hasattr(d, "model_dump"):
        return "(section defaults)"
    if isinstance(d, tuple):
        d = list(d)
    if isinstance(d, float) and abs(d - 1 / 255) < 1e-12:
        return "`1/255`"
    return f"`{d!r}`".replace("'", '"')


def _table(model: type, skip: set[str]) -> list[str]:
    rows = ["| field | type | default | limits | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, f in model.model_fields.items():
        if name in skip:
            continue
        desc = (f.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | {_type_name(f.annotation)} | {_default(f)} | {_constraints(f)} | {desc} |")
    return rows


def _start_up_error() -> str:
    """What the server says of an ONNX model exported with a fixed batch of 1 (the real message)."""
    config = ModelConfig.model_validate({"input": {"width": 224, "height": 224},
                                         "output": {"labels": ["ok", "defect"]},
                                         "batching": {"max_batch_size": 8, "preferred_batch_sizes": [1, 2, 4, 8]}})
    try:
        checks.check_input(checks.Subject(Path("models/my-model/1/model.onnx")), config,
                           [1, 3, 224, 224], "float32")
    except ConfigError as exc:
        return exc.message
    raise AssertionError("a fixed batch of 1 with max_batch_size = 8 was not refused")


def _exporting() -> list[str]:
    return [
        "## Exporting your model",
        "",
        "`torch.onnx.export` and `torch.export` need torch (and, for ONNX, `onnx` and `onnxscript`),",
        "which the serving install does not bring: install the `[train]` extra,",
        "`pip install -e '.[train]' -c requirements/constraints.txt`. Export the scores the classifier",
        "gives, `[batch, classes]` in `output.labels` order (logits with `activation = \"softmax\"`,",
        "probabilities with `\"none\"`), and give the batch axis a dynamic size, so that every",
        "`preferred_batch_sizes` entry runs. Trace with a batch of 2 or more: torch.export refuses a",
        "dynamic axis it sees with size 1.",
        "",
        "ONNX (`model.onnx`), opset 17 as the shipped model (`visionserve_tools/training/export.py`);",
        "an opset the installed onnxruntime does not know is refused at load. `dynamo=False` picks the",
        "exporter that takes `dynamic_axes` (the newer one, the default since torch 2.9, takes",
        "`dynamic_shapes` as torch.export does):",
        "",
        "```python",
        "torch.onnx.export(model.eval(), (torch.zeros(2, 3, 224, 224),), \"models/my-model/1/model.onnx\",",
        "                  input_names=[\"input\"], output_names=[\"logits\"], opset_version=17, dynamo=False,",
        "                  dynamic_axes={\"input\": {0: \"batch\"}, \"logits\": {0: \"batch\"}})",
        "```",
        "",
        "torch.export (`model.pt2`, `runtime.backend = \"torch\"`); the axis' `max` must be at least",
        "`batching.max_batch_size`:",
        "",
        "```python",
        "batch = torch.export.Dim(\"batch\", min=1, max=4096)",
        "program = torch.export.export(model.eval(), (torch.zeros(2, 3, 224, 224),), dynamic_shapes=({0: batch},))",
        "torch.export.save(program, \"models/my-model/1/model.pt2\")",
        "```",
        "",
        "A model that only takes a batch of 1 is served one frame at a time with `max_batch_size = 1`",
        "and `preferred_batch_sizes = [1]` (no batching gain).",
        "",
        "What the server checks at start-up, before it reports ready:",
        "",
        "- At load, from what the file declares (the ONNX graph's input and output, the torch.export",
        "  program's): the input has four axes in `input.layout` order, with `input.channels`,",
        "  `input.height` and `input.width` (an NCHW/NHWC mix-up is named as such); for ONNX, the input",
        "  dtype is `input.dtype`; the batch axis takes every batch up to `batching.max_batch_size` (a",
        "  fixed batch serves only when `max_batch_size` and every preferred size equal it, and above 1",
        "  with `pad_to_preferred = \"always\"`); the output is `[batch, labels]`, floating point, with one",
        "  score per `output.labels` entry.",
        "- At warm-up, which runs every preferred batch size: the model runs on the input described",
        "  (sizes the file leaves open, such as a dynamic height a later layer does not take) and returns",
        "  `[batch, len(output.labels)]`.",
        "",
        "A mismatch stops the start (exit code 3) with one line naming `model.toml`, the field, the",
        "model file, the expected and the actual shape, and what to do, e.g.",
        "",
        "```",
        _start_up_error(),
        "```",
    ]


def _sections(schema: type, skip: set[str] = frozenset()) -> dict[str, type]:
    """The schema's sections: fields whose type is a model, optional ones too."""
    out = {}
    for n, f in schema.model_fields.items():
        ann = f.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1 and typing.get_origin(ann) in (
                typing.Union, getattr(__import__("types"), "UnionType", None)):
            ann = args[0]  # an optional section
        if n not in skip and isinstance(ann, type) and hasattr(ann, "model_fields"):
            out[n] = ann
    return out


def _section(title: str, model: type, rules: list[str]) -> list[str]:
    out = ["", title, ""]
    doc = inspect.cleandoc(model.__doc__ or "")
    if doc and not doc.startswith("!!!") and "A base class" not in doc:
        out += [doc, ""]
    out += _table(model, set())
    if rules:
        out += [""] + [f"- {r}" for r in rules]
    return out


def _tasks() -> list[str]:
    """Each built-in task's own sections (those its schema adds to ModelConfig's)."""
    out = ["", "## Tasks", "",
           "`task` selects what the model's outputs mean, and with it the sections below that",
           "only that task reads. The built-in tasks are below; a package can add more",
           "(entry point group `visionserve.tasks`; docs/architecture.md, \"Adding a task\"). A",
           "task nobody registered is refused like any bad value, naming the known ones."]
    for name in TASKS.builtins:
        schema = TASKS.load(name).schema
        out += ["", f"### `task = \"{name}\"`", ""]
        doc = inspect.cleandoc(schema.__doc__ or "")
        if doc:
            out += [doc]
        if CROSS_FIELD_RULES.get(name):
            out += [""] + [f"- {r}" for r in CROSS_FIELD_RULES[name]]
        for section, model in _sections(schema, set(ModelConfig.model_fields)).items():
            out += _section(f"#### `[{section}]`", model,
                            CROSS_FIELD_RULES.get(f"{name}.{section}", []))
            out += _nested(section, model)
    return out


def _nested(section: str, model: type) -> list[str]:
    """Tables of a section's own tables: ``dict[str, Model]`` fields (``[verdict.defects.<x>]``)
    and ``tuple[Model, ...]`` ones (``[[verdict.count]]``)."""
    out = []
    for field_name, f in model.model_fields.items():
        args = [a for a in typing.get_args(f.annotation) if a is not type(None)]
        if len(args) == 1 and typing.get_args(args[0]):  # Optional[dict[...]]
            origin, args = typing.get_origin(args[0]), list(typing.get_args(args[0]))
        else:
            origin = typing.get_origin(f.annotation)
        args = [a for a in args if a is not Ellipsis]
        inner = args[-1] if args else None
        if not (isinstance(inner, type) and hasattr(inner, "model_fields")):
            continue
        title = (f"##### `[{section}.{field_name}.<label>]`" if origin is dict
                 else f"##### `[[{section}.{field_name}]]`")
        out += _section(title, inner, [])
    return out


def render() -> str:
    sections = _sections(ModelConfig)
    out = [
        "# `model.toml` reference",
        "",
        "<!-- Generated by models/scripts/model_toml_doc.py from the Field(description=...) texts in",
        "     visionserve/config.py and visionserve/tasks/; edit those, then regenerate. -->",
        "",
        "Every model in the repository is a folder `models/<name>/` holding `model.toml` and one",
        "folder per version (`1/`, `2/`, ...) with `model.onnx` and/or `model.pt2`. `model.toml` says how",
        "the server turns a camera frame into the model's input tensor, what the outputs mean, how",
        "a verdict (OK/NG) is reached, and how requests are batched. It is validated when the",
        "repository is loaded: an unknown field, a bad value or a missing required field is refused",
        "with the file and the field named, e.g.",
        "",
        "```",
        "models/defect-classifier/model.toml: field 'input.widht': unknown field (got 160)",
        "```",
        "",
        "Model files must come from a source you trust: a `model.pt2` is Python code that torch",
        "evaluates as it reads the file, and a model file decides every verdict. The server refuses a",
        "repository, model folder or file that users other than its own (or root) can write",
        "([security: model files](security.md#model-files)).",
        "",
        "How a frame becomes the input tensor, in this order (`visionserve/imaging.py`): decode to",
        "BGR uint8 (grey when `channels = 1`; the file's stored pixels, EXIF orientation ignored, so",
        "boxes, masks, regions and polygons are in the width and height of its header) -> resize to `input.width` x `input.height` by",
        "`input.resize` with `input.interpolation` (on the uint8 image) -> convert to",
        "`input.color_order` -> float32 `* scale/std - mean/std` (per channel: `* scale`, `- mean`,",
        "`/ std` in one multiply-add) -> `input.layout`. Training code must do exactly the same: the",
        "shipped model's scripts (`visionserve_tools/training/`) call these very functions.",
        "",
        "## Top level",
        "",
        *_table(ModelConfig, set(sections)),
        "",
        *[f"- {r}" for r in CROSS_FIELD_RULES[""]],
    ]
    for name, model in sections.items():
        out += _section(f"## `[{name}]`", model, CROSS_FIELD_RULES.get(name, []))
    out += _tasks()
    out += [
        "",
        "## Annotated example: the shipped `models/defect-classifier/model.toml`",
        "",
        "```toml",
        EXAMPLE.read_text(encoding="utf-8").rstrip(),
        "```",
        "",
        "A minimal file needs only the required fields; everything else takes the defaults above:",
        "",
        "```toml",
        "[input]",
        "width = 224",
        "height = 224",
        "",
        "[output]",
        'labels = ["ok", "defect"]',
        "```",
        "",
        *_exporting(),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None, doc: Path = DOC, render_doc=render, script: str = __file__,
         description: str | None = __doc__) -> int:
    """Write ``doc`` from ``render_doc()``, or with --check exit 1 if it differs (the settings
    reference's script uses it too)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that the file is up to date")
    args = ap.parse_args(argv)
    text = render_doc()
    if args.check:
        current = doc.read_text(encoding="utf-8") if doc.is_file() else ""
        if current != text:
            print(f"{doc} is out of date; run {Path(script).name}", file=sys.stderr)
            return 1
        return 0
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
