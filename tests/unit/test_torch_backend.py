"""The torch backend on the CPU, against onnxruntime on the same model; device faults in the runner."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import numpy as np
import pytest

from visionserve.backends.base import Backend
from visionserve.backends.onnx import OnnxBackend
from visionserve.backends.torch import TorchBackend
from visionserve.batching import CostModel, Pending
from visionserve.config import ModelConfig, load_model_config
from visionserve.errors import ConfigError, Unavailable
from visionserve.execution.results import device_fault, padded_size
from visionserve.execution.threads import ThreadExecutor

TOML = """\
[input]
width = 32
height = 32
tensor_name = "input"
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]
[output]
labels = ["ok", "dent", "scratch"]
tensor_name = "logits"
[batching]
max_batch_size = 8
preferred_batch_sizes = [1, 2, 4, 8]
takt_ms = 5000
[runtime]
backend = "torch"
precision = "fp16"
"""

pytestmark = pytest.mark.gpu_path  # takes CUDA branches where CUDA is: run with the GPU tests


def export_both(folder: Path) -> Path:
    """One nn.Module exported to version 1's model.onnx and model.pt2 (+ model.toml)."""
    import warnings

    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    v = folder / "1"
    v.mkdir(parents=True, exist_ok=True)
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), str(v / "model.onnx"), input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17,
                          dynamo=False)
        ep = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    torch.export.save(ep, str(v / "model.pt2"))
    (folder / "model.toml").write_text(TOML)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return export_both(tmp_path_factory.mktemp("torchrepo") / "tiny")


@pytest.fixture(scope="module")
def config(model_dir) -> ModelConfig:
    return load_model_config(model_dir / "model.toml")


def test_torch_matches_onnxruntime_on_cpu(model_dir, config):
    tb, ob = TorchBackend(), OnnxBackend()
    tb.load(model_dir / "1" / "model.pt2", config, "cpu")
    ob.load(model_dir / "1" / "model.onnx", config, "cpu")
    tb.warmup((1, 2, 4, 8))
    # the ONNX graph names its output; the torch.export program returns an unnamed tensor
    assert [(o.name, o.named) for o in ob.outputs] == [("logits", True)]
    assert [(o.name, o.named) for o in tb.outputs] == [("output0", False)]
    x = np.random.default_rng(0).normal(size=(8, 3, 32, 32)).astype(np.float32)
    for n in (1, 3, 8):
        a, b = tb.run(x[:n])["output0"], ob.run(x[:n])["logits"]
        assert a.shape == (n, 3) and a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    d = tb.describe()
    # on the CPU: eager fp32 whatever model.toml says (fp16 is for the GPU), no graphs
    assert d["backend"] == "torch" and d["precision"] == "fp32" and "cuda_graphs" not in d
    assert tb.stream is None and tb.eager_runs >= 3


def test_torch_takes_torch_tensors(model_dir, config):
    import torch

    tb = TorchBackend()
    tb.load(model_dir / "1" / "model.pt2", config, "cpu")
    x = np.random.default_rng(1).normal(size=(4, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(tb.run(torch.from_numpy(x))["output0"], tb.run(x)["output0"],
                               rtol=1e-6)


def test_warm_up_input_is_made_where_the_model_runs(model_dir, config):
    """The engine seeds its cost model with example inputs: on the GPU a device tensor (no copy
    from pageable host memory while serving versions run), on the CPU numpy zeros."""
    import torch

    from visionserve.backends.base import input_shape

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device != "cpu":  # an engine of an earlier test in this process capped the allocator
        torch.cuda.set_per_process_memory_fraction(1.0)
    tb = TorchBackend()
    tb.load(model_dir / "1" / "model.pt2", config, device)
    tb.warmup((1, 2))
    x = tb.example_input(2)
    assert tuple(x.shape) == input_shape(config, 2)
    if device == "cpu":
        assert isinstance(x, np.ndarray) and not x.any()
    else:
        assert x.device.type == "cuda" and x.dtype == tb.input_dtype and not x.any()
    out = tb.run(x)
    assert all(v.shape[0] == 2 for v in out.values())


def test_bad_model_files_are_config_errors(tmp_path, config):
    (tmp_path / "model.pt2").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="torch cannot load"):
        TorchBackend().load(tmp_path / "model.pt2", config, "cpu")


@pytest.mark.slow
def test_an_isolated_load_reads_the_program_in_a_child_process(model_dir, config, monkeypatch):
    """A load beside serving versions (``isolated``) reads the exported program in a child
    process: this process never runs torch.export.load, and serves the same module, outputs and
    answers as an ordinary load (docs/benchmarks.md, model swaps on the H200)."""
    import torch

    here = TorchBackend()
    here.load(model_dir / "1" / "model.pt2", config, "cpu")

    def not_here(*args, **kwargs):
        raise AssertionError("torch.export.load ran in the serving process")

    monkeypatch.setattr(torch.export, "load", not_here)
    child = TorchBackend()
    child.isolated = True
    child.load(model_dir / "1" / "model.pt2", config, "cpu")
    child.warmup((1, 2, 4, 8))
    assert child.outputs == here.outputs
    x = np.random.default_rng(2).normal(size=(8, 3, 32, 32)).astype(np.float32)
    for n in (1, 5, 8):
        np.testing.assert_array_equal(child.run(x[:n])["output0"], here.run(x[:n])["output0"])


def test_an_isolated_load_whose_child_fails_reads_the_program_here(model_dir, config,
                                                                   monkeypatch, caplog):
    """A child process that cannot start or dies (not the model file's fault): the program is
    read in this process after all, with a warning; the swap does not fail for it."""
    import sys

    monkeypatch.setattr(sys, "executable", "/bin/false")
    backend = TorchBackend()
    backend.isolated = True
    with caplog.at_level(logging.WARNING):
        backend.load(model_dir / "1" / "model.pt2", config, "cpu")
    assert "reading it in the serving process" in caplog.text
    x = np.zeros((2, 3, 32, 32), np.float32)
    assert backend.run(x)["output0"].shape == (2, 3)


@pytest.mark.slow
def test_an_isolated_load_of_a_broken_file_says_why(tmp_path, config):
    (tmp_path / "model.pt2").write_bytes(b"not a zip")
    backend = TorchBackend()
    backend.isolated = True
    with pytest.raises(ConfigError, match="torch cannot load the exported program"):
        backend.load(tmp_path / "model.pt2", config, "cpu")


def crafted(src: Path, dst: Path, member: str, change) -> Path:
    """A copy of the archive ``src`` whose member ending in ``member`` is ``change(bytes)``."""
    import zipfile

    dst.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            zout.writestr(item, change(data) if item.filename.endswith(member) else data)
    return dst


class _Marker:
    """Unpickled, it creates the file ``path``: what a crafted model file would run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("isolated", [False, True])
def test_a_model_file_with_a_pickled_object_is_refused_without_running_it(model_dir, config,
                                                                          tmp_path, isolated):
    """torch.export.load unpickles parts of the archive (here its sample inputs) with
    weights_only=False: a crafted program file ran its own code in the server. It is refused,
    and its code never runs, in the serving process or in the child of an isolated load."""
    import io

    import torch

    marker = tmp_path / "ran"
    pickled = io.BytesIO()
    torch.save(((_Marker(marker),), {}), pickled)
    evil = crafted(model_dir / "1" / "model.pt2", tmp_path / "evil" / "model.pt2",
                   "sample_inputs/model.pt", lambda _: pickled.getvalue())
    backend = TorchBackend()
    backend.isolated = isolated
    with pytest.raises(ConfigError, match="pickled Python objects other than tensors"):
        backend.load(evil, config, "cpu")
    assert not marker.exists()


def test_guard_code_in_a_model_file_is_not_run(model_dir, config, tmp_path):
    """An exported program's guard code is Python source in the archive that the module would
    run on every call: a crafted one ran its own code at the first frame. It is left out."""
    import json

    marker = tmp_path / "ran"

    def with_guard(data: bytes) -> bytes:
        program = json.loads(data)
        program["guards_code"] = [f"open({str(marker)!r}, 'w') is None or True"]
        return json.dumps(program).encode()

    evil = crafted(model_dir / "1" / "model.pt2", tmp_path / "evil" / "model.pt2",
                   "models/model.json", with_guard)
    backend = TorchBackend()
    backend.load(evil, config, "cpu")
    assert backend.run(np.zeros((2, 3, 32, 32), np.float32))["output0"].shape == (2, 3)
    assert not marker.exists()


def test_an_isolated_load_takes_tensors_and_plain_data_from_its_child(model_dir, config,
                                                                      monkeypatch):
    """What the child of an isolated load hands over is read with weights_only=True: the
    serving process unpickles no object a model file could have put there."""
    import torch

    real = torch.load
    asked: list = []

    def load(*args, **kwargs):
        asked.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    backend = TorchBackend()
    backend.isolated = True
    backend.load(model_dir / "1" / "model.pt2", config, "cpu")
    assert asked == [True]
    here = TorchBackend()
    here.load(model_dir / "1" / "model.pt2", config, "cpu")
    x = np.random.default_rng(3).normal(size=(4, 3, 32, 32)).astype(np.float32)
    np.testing.assert_array_equal(backend.run(x)["output0"], here.run(x)["output0"])


def test_cuda_without_cuda_is_a_config_error(model_dir, config):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="no CUDA device"):
        TorchBackend().load(model_dir / "1" / "model.pt2", config, "cuda:0")


# --- device faults ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,fault", [
    ("CUDA error: an illegal memory access was encountered", True),
    ("CUDA error: device-side assert triggered", True),
    ("[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access", True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("shape mismatch: expected 3 channels", False),
])
def test_device_fault_classification(text, fault):
    assert device_fault(RuntimeError(text)) is fault


class FaultyBackend(Backend):
    """Answers until told to fail, then raises what torch raises after a sticky CUDA error."""

    def __init__(self) -> None:
        self.fail = False
        self.calls = 0

    def load(self, path, config, device) -> None: ...

    def warmup(self, batch_sizes) -> None: ...

    def run(self, batch):
        self.calls += 1
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel "
                               "errors might be asynchronously reported")
        return {"output0": np.zeros((batch.shape[0], 3), dtype=np.float32)}


def test_device_fault_marks_the_runner_unhealthy(config, jpeg_bytes, caplog):
    from visionserve import imaging

    backend = FaultyBackend()
    preferred = (1, 2, 4, 8)

    async def scenario():
        loop = asyncio.get_running_loop()
        runner = ThreadExecutor(name="tiny:1#0", backend=backend, config=config,
                                preferred=preferred, on_batch=lambda r: None,
                                cost=CostModel(lambda n: padded_size(n, preferred)))
        runner.start(loop)
        frame = imaging.encoded_frame(jpeg_bytes)

        async def batch(n):
            now = time_now()
            items = [Pending(payload=frame, future=loop.create_future(), arrival=now, deadline=now + 30,
                             dispatched=now) for _ in range(n)]
            await runner.execute(items)
            return [p.future.exception() or p.future.result() for p in items]

        first = await batch(2)
        backend.fail = True
        second = await batch(3)
        third = await batch(1)
        await asyncio.to_thread(runner.stop)
        return runner, first, second, third

    with caplog.at_level(logging.ERROR, logger="visionserve.execution.threads"):
        runner, first, second, third = asyncio.run(scenario())
    assert all(r.verdict in ("OK", "NG") for r in first)
    assert all(isinstance(e, Unavailable) for e in second + third)
    assert not runner.healthy
    assert backend.calls == 2  # after the fault nothing more runs on the broken device
    lines = [r.getMessage() for r in caplog.records if "device fault" in r.getMessage()]
    assert len(lines) == 1 and "illegal memory access" in lines[0] and "\n" not in lines[0]


def time_now() -> float:
    import time

    return time.monotonic()


# --- a real server with the torch backend ----------------------------------------------------

@pytest.mark.slow
def test_server_serves_the_torch_backend(model_dir, server_factory, jpeg_bytes):
    srv = server_factory(model_dir.parent, grpc=False)
    r = httpx.post(f"{srv.url}/v1/models/tiny/inspect", content=jpeg_bytes,
                   headers={"Content-Type": "image/jpeg", "X-Part-Id": "p-1"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["label"] in ("ok", "dent", "scratch") and body["verdict"] in ("OK", "NG")
    meta = httpx.get(f"{srv.url}/v2/models/tiny", timeout=10).json()
    assert meta["platform"].startswith("pytorch") or "torch" in str(meta)


@pytest.mark.slow
def test_a_swap_of_a_torch_model_reads_the_new_version_in_a_child_process(model_dir, tmp_path,
                                                                           server_factory,
                                                                           jpeg_bytes):
    """Start-up reads the program in the serving process; a version loaded beside a serving one
    is read in a child process, and serves."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(model_dir, repo / "tiny")
    toml = repo / "tiny" / "model.toml"
    toml.write_text(toml.read_text() + "[version_policy]\nlatest = 1\n")
    srv = server_factory(repo, "--model-control-mode", "explicit", grpc=False)
    assert "in a child process" not in srv.log()
    shutil.copytree(repo / "tiny" / "1", repo / "tiny" / "2")
    r = httpx.post(f"{srv.url}/v2/repository/models/tiny/load", timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["versions"] == ["2"]
    assert f"read {repo / 'tiny' / '2' / 'model.pt2'} in a child process" in srv.log()
    r = httpx.post(f"{srv.url}/v1/models/tiny/inspect", content=jpeg_bytes,
                   headers={"Content-Type": "image/jpeg"}, timeout=30)
    assert r.status_code == 200 and r.json()["version"] == "2", r.text


def test_an_exported_cast_runs_in_another_precision():
    """A model exported in fp32 on the CPU that casts inside (x.float(), to keep a sum in fp32)
    runs in another dtype (and on a GPU): torch.export's checks of the traced dtype and device
    before each cast are dropped at load, the casts stay (found serving the anomaly model fitted
    on the CPU on the H200: "Tensor dtype mismatch", then "Tensor device mismatch")."""
    import copy

    import torch

    from visionserve.backends.torch import portable

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, x):
            y = self.conv(x).float()
            return (y * y).sum(dim=(1, 2, 3))

    x = torch.rand(2, 3, 8, 8)
    ep = torch.export.export(Net().eval(), (x,))
    want = ep.module()(x)
    raw = copy.deepcopy(ep.module()).to(torch.bfloat16)  # .to() would change ep's weights too
    with pytest.raises(Exception, match="mismatch"):
        raw(x.to(torch.bfloat16))
    fixed = portable(copy.deepcopy(ep.module())).to(torch.bfloat16)
    assert "_assert_tensor_metadata" not in fixed.code
    out = fixed(x.to(torch.bfloat16))
    assert out.dtype == torch.float32
    assert torch.allclose(out, want, rtol=0.05)
