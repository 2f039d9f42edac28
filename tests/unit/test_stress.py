from __future__ import annotations

import json
import subprocess
import sys

import pytest

from visionserve.gpu.nvml import real_nvml
from visionserve.ops.stress import (Report, expected_peak, judge, matmul_throughput,
                                    memory_pattern_test)

no_gpu = pytest.mark.skipif(real_nvml().available(), reason="this machine has a GPU")


def _stress(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "visionserve", "stress", *args],
                          capture_output=True, text=True, timeout=180)


@no_gpu
def test_no_cuda_exits_2_with_a_clear_message(tmp_path):
    out = tmp_path / "stress.json"
    p = _stress("--seconds", "1", "--json", str(out))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no CUDA device" in p.stdout and "Traceback" not in p.stderr
    report = json.loads(out.read_text())
    assert report["exit_code"] == 2 and report["findings"][0]["status"] == "fail"


@no_gpu
def test_explicit_cuda_device_without_gpu_exits_2():
    p = _stress("--device", "cuda:0", "--seconds", "1")
    assert p.returncode == 2 and "no CUDA device" in p.stdout and "cuda:0" in p.stdout


def test_bad_arguments_exit_2():
    p = _stress("--memory-fraction", "2")
    assert p.returncode == 2 and "--memory-fraction" in p.stdout


def test_memory_pattern_logic_on_cpu():
    torch = pytest.importorskip("torch")
    r = memory_pattern_test(torch, "cpu", 3 * 2**20 + 8, chunk_bytes=2**20)
    assert r["bytes_tested"] == 3 * 2**20 + 8 and r["mismatches"] == 0
    assert set(r["patterns"]) == {"zeros", "ones", "0xAAAAAAAA", "0x55555555", "address",
                                  "address_inverted"}


def test_matmul_throughput_logic_on_cpu():
    torch = pytest.importorskip("torch")
    r = matmul_throughput(torch, "cpu", torch.float32, 0.3, n=128, window_s=0.05)
    assert r["windows"] >= 1 and r["tflops_median"] > 0 and r["finite"]


def test_expected_peak_table():
    assert expected_peak("NVIDIA H200") == 989.0
    assert expected_peak("NVIDIA H200 NVL") == 835.0
    assert expected_peak("NVIDIA H100 PCIe") == 756.0
    assert expected_peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert expected_peak("NVIDIA A10G") == 70.0
    assert expected_peak("NVIDIA L40S") == 362.0 and expected_peak("NVIDIA L4") == 121.0
    assert expected_peak("Tesla T4") == 65.0
    assert expected_peak("Some Future GPU") is None


def _report(tflops: float, mismatches: int = 0, reasons=()) -> Report:
    r = Report(device="cuda:0")
    r.matmul["fp16"] = {"tflops_median": tflops, "finite": True}
    r.memory = {"bytes_tested": 2**30, "patterns": {"zeros": mismatches}, "mismatches": mismatches}
    r.telemetry = {"temperature_max_c": 70, "throttle_reasons_seen": list(reasons)}
    return r


@pytest.mark.parametrize("tflops,code", [(700.0, 0), (400.0, 1), (100.0, 2)])
def test_verdict_against_the_table(tflops, code):
    r = _report(tflops)
    judge(r, "NVIDIA H200")
    assert r.finish().exit_code == code
    assert r.matmul["fp16"]["expected_peak_tflops"] == 989.0


def test_unknown_card_has_no_verdict():
    r = _report(5.0)
    judge(r, "Mystery Accelerator")
    assert r.finish().exit_code == 0
    assert any("no verdict" in f.what for f in r.findings)


def test_memory_mismatch_and_hw_slowdown_fail():
    r = _report(700.0, mismatches=3)
    judge(r, "NVIDIA H200")
    assert r.finish().exit_code == 2
    r = _report(700.0, reasons=("hw_thermal_slowdown",))
    judge(r, "NVIDIA H200")
    assert r.finish().exit_code == 2
