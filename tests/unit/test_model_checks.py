"""A model file that does not fit its model.toml stops the start with one line naming model.toml,
the field, the expected and the actual shape and a hint, instead of going ready and failing every
frame (or dying with onnxruntime's traceback). Real tiny models, exported here."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from conftest import TINY_TOML, export_onnx, make_tiny_model, start_server

from visionserve import tasks
from visionserve.backends import checks
from visionserve.config import ModelConfig, ServerSettings
from visionserve.engine import Engine
from visionserve.errors import ConfigError


def net(flat: bool = False):
    """Conv + mean + Linear (any H/W), or with ``flat`` a Linear on the flattened 32x32 map."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
            self.fc = torch.nn.Linear(4 * 16 * 16 if flat else 4, 3)

        def forward(self, x):
            y = torch.relu(self.conv(x))
            return self.fc(y.flatten(1) if flat else y.mean(dim=(2, 3)))

    torch.manual_seed(0)
    return Net().eval()


def toml(**sections: str) -> str:
    """TINY_TOML with lines added at the top of its sections, e.g. ``input='height = 48'``."""
    text = TINY_TOML
    for name, lines in sections.items():
        text = text.replace(f"[{name}]\n", f"[{name}]\n{lines}\n")
    return text


def onnx_fixed_batch(folder: Path, toml_text: str, batch: int = 1) -> Path:
    import torch

    (folder / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net(), (torch.zeros(batch, 3, 32, 32),), str(folder / "1" / "model.onnx"),
                          input_names=["input"], output_names=["logits"], opset_version=17, dynamo=False)
    (folder / "model.toml").write_text(toml_text)
    return folder


def pt2(folder: Path, toml_text: str, dynamic_shapes=None) -> Path:
    import torch

    (folder / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(net(), (torch.zeros(2, 3, 32, 32),), dynamic_shapes=dynamic_shapes)
    torch.export.save(ep, str(folder / "1" / "model.pt2"))
    (folder / "model.toml").write_text(toml_text + '[runtime]\nbackend = "torch"\n')
    return folder


async def start(root: Path) -> Engine:
    eng = Engine(ServerSettings(models=root), device="cpu")
    try:
        await eng.start()
    except BaseException:
        await eng.close()
        raise
    return eng


async def refused(root: Path, field: str) -> str:
    """The ConfigError's message at start: it names model.toml and ``field``."""
    with pytest.raises(ConfigError) as info:
        await start(root)
    msg = info.value.message
    assert f"{root / 'm' / 'model.toml'}: field '{field}'" in msg, msg
    assert f"model m version 1 ({root / 'm' / '1'}" in msg, msg
    assert "\n" not in msg
    return msg


async def test_a_model_that_fits_starts(tmp_path):
    make_tiny_model(tmp_path / "m")
    eng = await start(tmp_path)
    assert eng.ready
    await eng.close()


async def test_labels_of_the_wrong_length(tmp_path):
    make_tiny_model(tmp_path / "m", TINY_TOML.replace('"scratch"]', '"scratch", "crack"]'))
    msg = await refused(tmp_path, "output.labels")
    assert "4 labels, but the model gives 3 scores per frame" in msg
    assert "expected [N, 4], got [N, 3]" in msg and "list one label per model output" in msg


async def test_labels_checked_on_warm_up_when_the_file_does_not_say(tmp_path):
    # one score per input column: the file cannot say how many before the model runs
    import torch

    class PerColumn(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=(1, 2))

    (tmp_path / "m" / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(PerColumn(), (torch.zeros(2, 3, 32, 32),), str(tmp_path / "m" / "1" / "model.onnx"),
                          input_names=["input"], output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"input": {0: "b", 3: "w"}, "logits": {0: "b", 1: "w"}})
    (tmp_path / "m" / "model.toml").write_text(TINY_TOML)
    msg = await refused(tmp_path, "output.labels")
    assert "expected [1, 3] for a batch of 1, got [1, 32]" in msg


@pytest.mark.parametrize("line, field, expected", [
    ("height = 48", "input.height", "[N, 3, 48, 32]"), ("width = 64", "input.width", "[N, 3, 32, 64]"),
])
async def test_wrong_input_size(tmp_path, line, field, expected):
    export_onnx(net(), tmp_path / "m", (2, 3, 32, 32), TINY_TOML.replace(line[:-2] + "32", line))
    msg = await refused(tmp_path, field)
    assert f"expected {expected} float32 (NCHW), got [N, 3, 32, 32]" in msg
    assert f"set `{field[6:]} = 32`" in msg


async def test_wrong_channel_count(tmp_path):
    export_onnx(net(), tmp_path / "m", (2, 3, 32, 32),
                toml(input='channels = 1\ncolor_order = "GRAY"\nmean = [0.0]\nstd = [1.0]'))
    msg = await refused(tmp_path, "input.channels")
    assert "expected [N, 1, 32, 32] float32 (NCHW), got [N, 3, 32, 32]" in msg
    assert "set `channels = 3`" in msg


async def test_wrong_layout_and_dtype(tmp_path):
    export_onnx(net(), tmp_path / "m", (2, 3, 32, 32), toml(input='layout = "NHWC"'))
    msg = await refused(tmp_path, "input.layout")
    assert "set `layout = \"NCHW\"`" in msg
    export_onnx(net(), tmp_path / "m", (2, 3, 32, 32), toml(input='dtype = "uint8"'))
    msg = await refused(tmp_path, "input.dtype")
    assert "got [N, 3, 32, 32] float32; set `dtype = \"float32\"`" in msg


async def test_onnx_with_a_fixed_batch_of_one(tmp_path):
    onnx_fixed_batch(tmp_path / "m", TINY_TOML)  # max_batch_size = 8
    msg = await refused(tmp_path, "batching.max_batch_size")
    assert "the model takes a fixed batch of 1" in msg and "got [1, 3, 32, 32]" in msg
    assert "export with a dynamic batch axis (torch.onnx.export(..., dynamic_axes=" in msg
    assert "or set `max_batch_size = 1`" in msg
    # the hint works: a batch of one is served
    (tmp_path / "m" / "model.toml").write_text(
        TINY_TOML.replace("max_batch_size = 8", "max_batch_size = 1")
        .replace("preferred_batch_sizes = [1, 2, 4, 8]", "preferred_batch_sizes = [1]"))
    await (await start(tmp_path)).close()


async def test_input_size_the_file_does_not_declare_fails_on_warm_up(tmp_path):
    # H and W exported as dynamic, but the flattening Linear takes 32x32 only
    import torch

    (tmp_path / "m" / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net(flat=True), (torch.zeros(2, 3, 32, 32),),
                          str(tmp_path / "m" / "1" / "model.onnx"), input_names=["input"],
                          output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"input": {0: "b", 2: "h", 3: "w"}, "logits": {0: "b"}})
    (tmp_path / "m" / "model.toml").write_text(TINY_TOML.replace("height = 32", "height = 48"))
    msg = await refused(tmp_path, "input")
    assert "the model fails on the input model.toml describes" in msg
    assert "expected [N, 3, 48, 32] float32 (NCHW)" in msg and "Traceback" not in msg


async def test_torch_program_with_a_static_batch(tmp_path):
    pt2(tmp_path / "m", TINY_TOML)
    msg = await refused(tmp_path, "batching.max_batch_size")
    assert "the model takes a fixed batch of 2" in msg and "got [2, 3, 32, 32]" in msg
    assert "torch.export.export(..., dynamic_shapes=" in msg


async def test_torch_program_batch_range_input_size_and_labels(tmp_path):
    import torch

    pt2(tmp_path / "m", TINY_TOML, ({0: torch.export.Dim("batch", min=1, max=4)},))
    msg = await refused(tmp_path, "batching.max_batch_size")
    assert "the model's batch axis takes at most 4" in msg and "set `max_batch_size = 4`" in msg
    fits = TINY_TOML.replace("max_batch_size = 8", "max_batch_size = 4").replace(", 8]", "]") \
        + '[runtime]\nbackend = "torch"\n'
    (tmp_path / "m" / "model.toml").write_text(fits.replace("width = 32", "width = 40"))
    msg = await refused(tmp_path, "input.width")
    assert "expected [N, 3, 32, 40] float32 (NCHW), got [N, 3, 32, 32]" in msg
    (tmp_path / "m" / "model.toml").write_text(fits.replace('"scratch"]', '"scratch", "crack"]'))
    msg = await refused(tmp_path, "output.labels")
    assert "expected [N, 4], got [N, 3]" in msg
    (tmp_path / "m" / "model.toml").write_text(fits)
    await (await start(tmp_path)).close()


def test_checks_are_shape_arithmetic():
    """The declared-shape rules without a model file (a fixed batch equal to every batch serves):
    the input here, the outputs by the model's task."""
    cfg = ModelConfig.model_validate({
        "input": {"width": 32, "height": 32}, "output": {"labels": ["ok", "ng"]},
        "batching": {"max_batch_size": 8, "preferred_batch_sizes": [8], "pad_to_preferred": "always"}})
    s = checks.Subject(Path("/r/m/1/model.onnx"))
    task = tasks.create(cfg)
    checks.check_input(s, cfg, [8, 3, 32, 32], "float32")
    assert task.bind(s, [checks.TensorSpec("logits", (8, 2), "float32")]) == ("logits",)
    checks.check_input(s, cfg, [checks.ANY, 3, 32, 32], "float32")
    task.bind(s, [checks.TensorSpec("logits", (checks.ANY, 2), "float16")])
    with pytest.raises(ConfigError, match="field 'output.tensor_name'.*scores must be floating point"):
        task.bind(s, [checks.TensorSpec("logits", (checks.ANY, 2), "int64")])
    with pytest.raises(ConfigError, match=r"field 'output.tensor_name'.*expected \[N, 2\], got \[N, 2, 7\]"):
        task.bind(s, [checks.TensorSpec("logits", (checks.ANY, 2, 7))])
    with pytest.raises(ConfigError, match=r"field 'input.layout'.*has 3 dimensions"):
        checks.check_input(s, cfg, [checks.ANY, 32, 32])


def test_the_server_exits_with_one_line(tmp_path):
    """The process: exit code 3, the reason in one log line, no traceback."""
    onnx_fixed_batch(tmp_path / "models" / "m", TINY_TOML)
    server = start_server(tmp_path / "models", tmp_path, grpc=False, wait=False)
    assert server.proc.wait(120) == 3
    log = server.log()
    assert "Traceback" not in log, log
    line = next(x for x in log.splitlines() if "start-up failed" in x)
    assert "model.toml: field 'batching.max_batch_size'" in line and "max_batch_size = 1" in line


@pytest.mark.parametrize("error", ["CUDA out of memory. Tried to allocate 2.00 GiB",
                                   "CUDA error: an illegal memory access was encountered"])
def test_a_device_failing_on_warm_up_is_no_model_toml_error(tmp_path, error):
    from visionserve.batching import CostModel

    class Failing:
        config = ModelConfig.model_validate({"input": {"width": 32, "height": 32},
                                              "output": {"labels": ["ok", "ng"]}})

        def warmup(self, sizes):
            raise RuntimeError(error)

    with pytest.raises(RuntimeError, match=error[:10]):
        Engine._warmup(Failing(), (1,), CostModel(lambda n: n), tmp_path / "m" / "1" / "model.onnx",
                       tasks.create(Failing.config))
