"""Pinning and stress on a real GPU. Run on a GPU machine: pytest tests/gpu -m gpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from visionserve.gpu.nvml import real_nvml

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not real_nvml().available(), reason="no NVIDIA GPU/driver here"),
]

PIN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from visionserve.gpu.device import resolve, pin_environment, check_contexts
    from visionserve.gpu.nvml import real_nvml
    nvml = real_nvml()
    spec = sys.argv[1]
    r = resolve(spec, nvml)
    assert "torch" not in sys.modules
    pin_environment(r)
    import torch
    x = torch.ones(1024, device="cuda")  # opens the context
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(0)
    holders = {g.uuid: [p.pid for p in nvml.processes(g.index)] for g in nvml.devices()}
    print(json.dumps({
        "pid": os.getpid(), "uuid": r.gpu.uuid, "env": os.environ["CUDA_VISIBLE_DEVICES"],
        "order": os.environ["CUDA_DEVICE_ORDER"], "count": torch.cuda.device_count(),
        "torch_uuid": str(getattr(props, "uuid", "")), "holders": holders,
        "problems": check_contexts(r, nvml),
    }))
""")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("CUDA_DEVICE_ORDER", None)
    return env


def test_pinning_a_real_gpu_in_a_subprocess():
    gpus = real_nvml().devices()
    target = gpus[-1]  # the last card: with several GPUs, not GPU 0
    p = subprocess.run([sys.executable, "-c", PIN_SCRIPT, target.uuid], capture_output=True,
                       text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["env"] == target.uuid and out["order"] == "PCI_BUS_ID"
    assert out["count"] == 1
    if out["torch_uuid"]:
        assert out["torch_uuid"].lower().removeprefix("gpu-") == target.uuid.lower()[4:]
    everywhere = [u for u, pids in out["holders"].items() if out["pid"] in pids]
    if not everywhere:
        pytest.skip("NVML reports host PIDs here (container PID namespace): cannot attribute "
                    "contexts")
    assert everywhere == [target.uuid]
    assert out["problems"] == []


# beside other tests: > 5 fp16 TFLOPS and a clean memory pattern hold on a shared card too
@pytest.mark.slow
def test_stress_three_seconds_reports_sane_throughput(tmp_path):
    out = tmp_path / "stress.json"
    p = subprocess.run([sys.executable, "-m", "visionserve", "stress", "--seconds", "3",
                        "--memory-fraction", "0.1", "--json", str(out)],
                       capture_output=True, text=True, timeout=400, env=_env())
    assert p.returncode in (0, 1), p.stdout + p.stderr
    report = json.loads(out.read_text())
    fp16 = report["matmul"]["fp16"]
    assert fp16["tflops_median"] > 5.0 and fp16["finite"]
    if fp16.get("expected_peak_tflops"):
        assert fp16["tflops_median"] < fp16["expected_peak_tflops"] * 1.05
    assert report["memory"]["mismatches"] == 0 and report["memory"]["bytes_tested"] > 0
    assert report["telemetry"]["samples"] >= 1


def test_doctor_on_the_gpu_machine():
    p = subprocess.run([sys.executable, "-m", "visionserve", "doctor", "--json"],
                       capture_output=True, text=True, timeout=300, env=_env())
    report = json.loads(p.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["nvidia_driver"]["status"] == "ok"
    assert checks["device"]["status"] == "ok"
    assert p.returncode == report["exit_code"]
