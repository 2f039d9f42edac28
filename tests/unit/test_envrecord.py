from __future__ import annotations

import json
import subprocess
import sys

from visionserve.gpu.nvml import GpuInfo, SimulatedNvml, real_nvml, simulated_gpu
from visionserve.ops.envrecord import collect, render_text


def test_env_json_runs_here_and_says_no_gpu():
    p = subprocess.run([sys.executable, "-m", "visionserve", "env", "--json"],
                       capture_output=True, text=True, timeout=180, check=False,
                       env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "1"})
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert set(rec) == {"host", "packages", "torch", "onnxruntime", "nvidia", "env"}
    for key in ("hostname", "os", "kernel", "python", "cpu_count"):
        assert rec["host"][key]
    for pkg in ("torch", "torchvision", "onnxruntime", "opencv", "numpy", "fastapi", "uvicorn",
                "grpcio", "visionserve"):
        assert pkg in rec["packages"]
    assert rec["packages"]["visionserve"]["version"]
    assert {"version", "cuda_runtime", "cudnn", "arch_list", "cuda_available"} <= set(rec["torch"])
    assert "CPUExecutionProvider" in rec["onnxruntime"]["providers"]
    assert rec["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_DEVICE_ORDER" in rec["env"] and "NVIDIA_VISIBLE_DEVICES" in rec["env"]
    if not real_nvml().available():
        assert rec["nvidia"]["available"] is False
        assert rec["nvidia"]["summary"].startswith("no GPU")
        assert rec["nvidia"]["gpus"] == []


def test_env_text_says_no_gpu_here():
    p = subprocess.run([sys.executable, "-m", "visionserve", "env"], capture_output=True,
                       text=True, timeout=180, check=False)
    assert p.returncode == 0, p.stderr
    assert "python" in p.stdout and "torch" in p.stdout
    if not real_nvml().available():
        assert "no GPU" in p.stdout


def test_collect_with_simulated_gpus_has_every_gpu_field():
    n = SimulatedNvml([simulated_gpu(0), simulated_gpu(1, name="NVIDIA L4")],
                      driver_version="580.65.06", cuda_driver_version=(13, 0))
    rec = collect(n, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, include_frameworks=False)
    nv = rec["nvidia"]
    assert nv["driver_version"] == "580.65.06" and nv["cuda_driver_version"] == "13.0"
    assert len(nv["gpus"]) == 2 and nv["summary"] == "2 GPU(s)"
    assert set(nv["gpus"][1]) == set(GpuInfo.__dataclass_fields__)
    assert rec["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert rec["torch"] is None  # not imported when asked not to
    json.dumps(rec)
    text = render_text(rec)
    assert "NVIDIA L4" in text and "580.65.06" in text and "x16/x16" in text


def test_gpu_providers_are_unusable_without_a_gpu(monkeypatch):
    from visionserve.ops import envrecord

    built_in = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(envrecord, "torch_info", lambda: None)
    monkeypatch.setattr(envrecord, "onnxruntime_info", lambda: {
        "version": "1.31.1", "providers": list(built_in), "package": "onnxruntime-gpu",
        "cuda_version": "13.0"})
    rec = collect(SimulatedNvml([]), {})
    assert rec["onnxruntime"]["providers"] == built_in  # what is built in, still recorded
    assert rec["onnxruntime"]["usable_providers"] == ["CPUExecutionProvider"]
    (line,) = [ln for ln in render_text(rec).splitlines() if ln.startswith("onnxrt")]
    assert "providers CPUExecutionProvider " in line and "unusable without a GPU" in line
    rec = collect(SimulatedNvml([simulated_gpu(0)]), {})
    assert rec["onnxruntime"]["usable_providers"] == built_in
    assert "unusable" not in render_text(rec)


def test_a_framework_that_cannot_be_asked_is_a_line_of_the_record():
    """torch and onnxruntime are asked in a child interpreter; when it fails, the record says
    so instead of ``env`` or ``doctor`` failing with it."""
    from visionserve.ops.frameworks import framework_info

    info = framework_info("no-such-framework")  # the child exits 1 (KeyError)
    assert info["error"].startswith("import failed: the interpreter exited with 1:"), info
