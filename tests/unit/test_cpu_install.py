"""The CPU install (issue 15, item 7): the core dependencies bring no torch and no CUDA wheels,
the core serves the shipped default model without torch, and a feature that needs torch says
which extra brings it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.tools.notorch import no_torch_site

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")

#: what makes the GPU install 6 GB: torch itself, triton, and the CUDA libraries as wheels
HEAVY = re.compile(r"^(torch|torchvision|triton|nvidia-(?!ml-py)\S+|cuda-\S+)$")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_core_dependencies_bring_no_torch_and_no_cuda_wheels(project):
    heavy = [r for r in project["dependencies"] if HEAVY.match(_name(r))]
    assert not heavy, f"the core (CPU) install would pull {heavy}"
    names = {_name(r) for r in project["dependencies"]}
    assert {"onnxruntime-gpu", "onnxruntime"} & names, "the core must serve ONNX models"


def test_gpu_extra_brings_torch_and_test_extra_everything_the_suite_needs(project):
    extras = project["optional-dependencies"]
    assert {"torch", "torchvision"} <= {_name(r) for r in extras["gpu"]}
    assert "torch" in {_name(r) for r in extras["train"]}, "torch.onnx.export needs torch"
    test_self = [r for r in extras["test"] if _name(r) == "visionserve"]
    assert test_self and all(e in test_self[0] for e in ("gpu", "train", "load"))


def test_constraints_pin_the_gpu_extra():
    pins = {_name(line) for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines()
            if "==" in line}
    assert {"torch", "torchvision", "onnxruntime-gpu"} <= pins


@pytest.mark.slow
def test_core_serves_the_default_model_on_cpu_without_torch(tmp_path):
    """The shipped models/defect-classifier, served and answered with torch unimportable, and no
    attempt to import it on the way (the log of attempts stays empty)."""
    from conftest import start_server

    attempts = tmp_path / "torch-imports.txt"
    site = no_torch_site(tmp_path / "site", attempts)
    server = start_server(ROOT / "models", tmp_path, grpc=False,
                          env={"PYTHONPATH": f"{site}:{ROOT}"})
    try:
        import httpx

        from visionserve_tools import synthetic

        frame = synthetic.encode(synthetic.generate("scratch", seed=7))
        r = httpx.post(f"{server.url}/v1/models/defect-classifier/inspect", content=frame,
                       headers={"Content-Type": "image/jpeg", "X-Part-Id": "A-1",
                                "X-Deadline-Ms": "20000"},  # about the install, not the takt
                       timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["verdict"] in ("OK", "NG") and r.json()["part_id"] == "A-1"
    finally:
        server.stop()
    assert Path(f"{attempts}.loaded").exists(), "the torch blocker did not load"
    log = server.log_path.read_text()
    assert "onnxruntime" in log
    assert not attempts.exists(), f"torch imported on the CPU path: {attempts.read_text()}\n{log}"


def test_torch_backend_without_torch_names_the_extra(monkeypatch, tmp_path):
    from visionserve.backends.torch import TorchBackend
    from visionserve.errors import ConfigError

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(ConfigError) as err:
        TorchBackend().load(tmp_path / "model.pt2", None, "cpu")  # type: ignore[arg-type]
    msg = err.value.message
    assert "runtime.backend" in msg and "visionserve[gpu]" in msg and "model.pt2" in msg


@pytest.fixture
def one_gpu_no_torch(monkeypatch):
    from visionserve import extras
    from visionserve.gpu import device, nvml

    monkeypatch.setattr(nvml, "real_nvml", lambda: nvml.SimulatedNvml([nvml.simulated_gpu()]))
    monkeypatch.setattr(extras, "missing", lambda module: module == "torch")
    pinned = []
    monkeypatch.setattr(device, "pin_environment", pinned.append)
    return pinned


def test_named_gpu_without_torch_is_a_start_up_error_naming_the_extra(one_gpu_no_torch):
    from visionserve.errors import ConfigError
    from visionserve.runtime.startup import pin_device

    with pytest.raises(ConfigError) as err:
        pin_device("cuda:0")
    assert "visionserve[gpu]" in err.value.message and "--device cpu" in err.value.message
    assert not one_gpu_no_torch  # nothing pinned


def test_auto_without_torch_takes_the_cpu_and_says_why(one_gpu_no_torch, caplog):
    from visionserve.runtime.startup import pin_device

    resolved = pin_device("auto")
    assert resolved.kind == "cpu" and one_gpu_no_torch == [resolved]
    assert "visionserve[gpu]" in caplog.text and "CPU install" in caplog.text


def test_doctor_warns_when_a_gpu_is_there_but_torch_is_not():
    from visionserve.gpu.nvml import SimulatedNvml, simulated_gpu
    from visionserve.ops.doctor import Facts, run_checks

    def check(gpus):
        f = Facts(nvml=SimulatedNvml(gpus), environ={}, torch=None, onnxruntime=None,
                  device="auto", gpu_memory_budget=None, pid=1, kernel_log=[])
        return {c.name: c for c in run_checks(f)}["torch_cuda"]

    c = check([simulated_gpu()])
    assert c.status == "warn" and "visionserve[gpu]" in c.fix
    assert check([]).status == "skip"
