"""Model file against ``model.toml``: mismatches stop the start instead of failing every frame.

A backend checks what its model file says it takes (ONNX graph inputs, a torch.export program's
placeholders) with :func:`check_input` at load, before anything runs, and declares what the file
says it gives as :class:`TensorSpec` values; the model's task checks those (it knows which
outputs it needs, and their shapes), and at warm-up what the model actually returned. A failure
is a :class:`ConfigError` naming model.toml, the field, the model and its file, the expected and
the actual shape, and what to do (:meth:`Subject.error`). Shape arithmetic only: nothing here
touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
from ..errors import ConfigError

#: one dimension as a model file declares it: an int when fixed, else the (min, max) a dynamic
#: axis takes (max None: unbounded)
Dim = int | tuple[int, int | None]

ANY: Dim = (0, None)


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output as the model file declares it."""

    name: str
    #: its axes (the batch axis first); None when the file does not say
    dims: tuple[Dim, ...] | None = None
    #: numpy name of its dtype (``float32``); None when the file does not say
    dtype: str | None = None
    #: False where the file gives no name and the backend numbered it (a torch.export program
    #: that returns a tensor or a tuple: ``output0``, ``output1``, ...)
    named: bool = True


#: how to export a dynamic batch axis, by model file suffix
_DYNAMIC_BATCH = {
    ".onnx": "export with a dynamic batch axis (torch.onnx.export(..., dynamic_axes={'input': {0: "
             "'batch'}, 'output': {0: 'batch'}}))",
    ".pt2": "export with a dynamic batch axis (torch.export.export(..., dynamic_shapes=({0: "
            "torch.export.Dim('batch', max=...)},)))",
}
_FIX = "docs/model-toml.md, \"Exporting your model\""


@dataclass(frozen=True)
class Subject:
    """The model version being checked: ``file`` is
    ``<repository>/<name>/<version>/<model file>``."""

    file: Path
    #: the docs section that tells how to fix a mismatch (a task with its own page names it)
    see: str = _FIX

    @property
    def toml(self) -> Path:
        return self.file.parent.parent / "model.toml"

    def error(self, field: str, problem: str, expected: str, actual: str, hint: str) -> ConfigError:
        folder = self.file.parent
        return ConfigError(f"{self.toml}: field '{field}' does not fit model {folder.parent.name} "
                           f"version {folder.name} ({self.file}): {problem}: expected {expected}, "
                           f"got {actual}; {hint} (see {self.see})")


def fmt(dims: tuple[Dim, ...] | list[Dim]) -> str:
    """``[N, 3, 32, 32]``: fixed sizes as numbers, a dynamic batch axis as N, other dynamic axes
    ?."""
    return "[" + ", ".join(str(d) if isinstance(d, int) else ("N" if i == 0 else "?")
                           for i, d in enumerate(dims)) + "]"


def _geometry(config: ModelConfig) -> list[tuple[str, int]]:
    """The input's (field, size) after the batch axis, in the layout's order."""
    s = config.input
    c, h, w = ("input.channels", s.channels), ("input.height", s.height), ("input.width", s.width)
    return [c, h, w] if s.layout == "NCHW" else [h, w, c]


def expected_input(config: ModelConfig) -> str:
    return f"{fmt([ANY] + [size for _, size in _geometry(config)])} {config.input.dtype} " \
           f"({config.input.layout})"


def check_input(subject: Subject, config: ModelConfig, inputs: list[Dim],
                input_dtype: str | None = None) -> None:
    """The model's declared input against ``[input]`` and ``[batching]``; ``input_dtype`` is a
    numpy name (None: not known)."""
    _check_batch(subject, config, inputs)
    _check_geometry(subject, config, inputs)
    if input_dtype is not None and input_dtype != config.input.dtype:
        hint = f"set `dtype = \"{input_dtype}\"`" \
            if input_dtype in ("float32", "float16", "uint8") \
            else "export the model with a float32, float16 or uint8 input"
        raise subject.error("input.dtype", "the model's input has another dtype",
                            expected_input(config), f"{fmt(inputs)} {input_dtype}", hint)


def _check_batch(subject: Subject, config: ModelConfig, inputs: list[Dim]) -> None:
    if not inputs:
        return
    b = config.batching
    sizes = b.preferred_batch_sizes or (b.max_batch_size,)
    expected = f"a batch axis that takes 1 to {b.max_batch_size} frames " \
               f"(batching.max_batch_size = {b.max_batch_size}, " \
               f"preferred_batch_sizes = {list(sizes)})"
    dynamic = _DYNAMIC_BATCH.get(subject.file.suffix, "export with a dynamic batch axis")
    first = inputs[0]
    if isinstance(first, int):
        # a fixed batch serves only when every batch is exactly that size
        if b.max_batch_size == first and set(sizes) == {first} and (first == 1 or b.pad_to_preferred
                                                                     == "always"):
            return
        other = f"`max_batch_size = {first}` and `preferred_batch_sizes = [{first}]`" + \
            ("" if first == 1 else " and `pad_to_preferred = \"always\"`")
        raise subject.error("batching.max_batch_size", f"the model takes a fixed batch of {first}",
                            expected, fmt(inputs), f"{dynamic}, or set {other}")
    top = first[1]
    if top is not None and top < b.max_batch_size:
        raise subject.error("batching.max_batch_size",
                            f"the model's batch axis takes at most {top}",
                            expected, f"{fmt(inputs)} with N <= {top}",
                            f"set `max_batch_size = {top}` or lower, or export with a larger "
                            "maximum")


def _check_geometry(subject: Subject, config: ModelConfig, inputs: list[Dim]) -> None:
    want = _geometry(config)
    if len(inputs) != 1 + len(want):
        raise subject.error("input.layout", f"the model's input has {len(inputs)} dimensions",
                            expected_input(config), fmt(inputs),
                            "serve a model that takes a batch of images, [N, C, H, W] or "
                            "[N, H, W, C]")
    wrong = [(f, size, got) for (f, size), got in zip(want, inputs[1:])
             if isinstance(got, int) and got != size]
    if not wrong:
        return
    other = "NHWC" if config.input.layout == "NCHW" else "NCHW"
    rotated = want[1:] + want[:1] if other == "NHWC" else want[2:] + want[:2]
    flipped = [size for _, size in rotated]
    if all(not isinstance(got, int) or got == size for size, got in zip(flipped, inputs[1:])):
        raise subject.error("input.layout", f"the model takes {other}", expected_input(config),
                            fmt(inputs), f"set `layout = \"{other}\"`")
    field, size, got = wrong[0]
    key = field.split(".")[1]
    hint = f"set `{key} = {got}`" + (" (with the matching `color_order`, `mean` and `std`)"
                                       if key == "channels" else "") + \
        f", or export the model for {size}"
    raise subject.error(field, f"the model's input takes {key} {got}", expected_input(config),
                        fmt(inputs), hint)


def run_failed(subject: Subject, config: ModelConfig, sizes: tuple[int, ...],
               exc: Exception) -> ConfigError:
    """The model raised on the warm-up input model.toml describes (shapes the file does not
    declare)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return subject.error("input", "the model fails on the input model.toml describes (batch sizes "
                         f"{list(sizes)})", expected_input(config), f"an error: {text}",
                         "check input.width, height, channels, layout and dtype, and the batch "
                         "axis, against the model's export")
