from __future__ import annotations

import json
import subprocess
import sys

import pytest

from visionserve.gpu.nvml import GIB, GpuProcess, SimulatedNvml, simulated_gpu
from visionserve.ops.doctor import Check, Facts, arch_supports, exit_code, render_text, run_checks

ARCH = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
TORCH = {"version": "2.14.1+cu130", "cuda_runtime": "13.0", "arch_list": ARCH,
         "cuda_available": True, "device_count": 1}
ORT = {"version": "1.31.1", "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
       "cuda_version": "13.0"}
PID = 4242


def facts(gpus=None, *, env=None, torch=TORCH, ort=ORT, device="auto", budget=None,
          kernel_log=(), driver_cuda=(13, 0), driver="580.65.06") -> Facts:
    gpus = [simulated_gpu()] if gpus is None else gpus
    nvml = SimulatedNvml(gpus, driver_version=driver, cuda_driver_version=driver_cuda)
    return Facts(nvml=nvml, environ=env or {}, torch=torch, onnxruntime=ort, device=device,
                 gpu_memory_budget=budget, pid=PID,
                 kernel_log=list(kernel_log) if kernel_log is not None else None)


def by_name(f: Facts) -> dict[str, Check]:
    return {c.name: c for c in run_checks(f)}


def only_problem(f: Facts, name: str, status: str) -> Check:
    checks = run_checks(f)
    bad = [c for c in checks if c.status in ("warn", "fail")]
    assert [c.name for c in bad] == [name], render_text(checks, f)
    assert bad[0].status == status
    if status in ("warn", "fail"):
        assert bad[0].fix, "every warning/failure carries a fix"
    return bad[0]


def test_healthy_card_is_all_ok():
    checks = run_checks(facts(budget=8 * GIB))
    assert exit_code(checks) == 0, render_text(checks, facts())
    assert {c.name for c in checks} >= {
        "nvidia_driver", "driver_vs_cuda", "torch_cuda", "compute_capability",
        "cuda_visible_devices", "cuda_device_order", "device", "stray_contexts", "temperature",
        "throttling", "pcie_link", "memory_budget", "ecc", "xid"}


def test_exit_code_rule():
    assert exit_code([Check("a", "ok", ""), Check("b", "skip", "")]) == 0
    assert exit_code([Check("a", "ok", ""), Check("b", "warn", "")]) == 1
    assert exit_code([Check("a", "warn", ""), Check("b", "fail", "")]) == 2
    assert exit_code([]) == 0


def test_no_driver_on_cpu_machine_is_skipped():
    f = facts([], torch={**TORCH, "cuda_available": False})
    checks = by_name(f)
    assert checks["nvidia_driver"].status == "skip"
    assert exit_code(list(checks.values())) == 0


def test_no_driver_but_gpu_requested_fails():
    f = facts([], device="cuda", torch={**TORCH, "cuda_available": False})
    c = by_name(f)
    assert c["nvidia_driver"].status == "fail" and "nvidia-smi" in c["nvidia_driver"].fix
    assert c["device"].status == "fail"


def test_driver_too_old_for_torch_cuda():
    c = only_problem(facts(driver_cuda=(12, 4), driver="550.54.15", ort=None),
                     "driver_vs_cuda", "fail")
    assert "needs CUDA 13.0" in c.detail and "R580" in c.fix and "cu124" in c.fix


def test_driver_minor_version_behind_is_a_warning():
    t = {**TORCH, "cuda_runtime": "12.8"}
    c = only_problem(facts(driver_cuda=(12, 6), torch=t, ort=None), "driver_vs_cuda", "warn")
    assert "minor version compatibility" in c.detail


def test_onnxruntime_gpu_cuda_major_checked():
    t = {**TORCH, "cuda_runtime": "12.6"}
    c = only_problem(facts(driver_cuda=(12, 8), torch=t), "driver_vs_cuda", "fail")
    assert "onnxruntime-gpu" in c.detail and "13.0" in c.detail


def test_torch_cannot_use_cuda():
    t = {**TORCH, "cuda_available": False, "device_count": 0,
         "cuda_error": "CUDA driver initialization failed"}
    c = only_problem(facts(torch=t), "torch_cuda", "fail")
    assert "driver initialization failed" in c.detail


def test_torch_cpu_build_with_gpu_present():
    t = {"version": "2.14.1+cpu", "cuda_runtime": None, "arch_list": [], "cuda_available": False}
    c = only_problem(facts(torch=t, ort=None), "torch_cuda", "warn")
    assert "download.pytorch.org" in c.fix


@pytest.mark.parametrize("cc,arch,ok,how", [
    ((8, 9), ["sm_80", "sm_86"], True, "binary compatible"),
    ((9, 0), ["sm_90"], True, "exact"),
    ((9, 0), ["sm_90a"], True, "exact"),
    ((10, 0), ["sm_90a"], False, ""),
    ((9, 0), ["sm_80", "compute_80"], True, "PTX"),
    ((8, 0), ["compute_86"], False, ""),
    ((12, 0), ["sm_90", "sm_100"], False, ""),
    ((7, 0), ARCH, False, ""),
])
def test_arch_rule(cc, arch, ok, how):
    got, text = arch_supports(arch, cc)
    assert got is ok and how in text


def test_card_too_new_for_torch_build():
    t = {**TORCH, "arch_list": ["sm_80", "sm_86", "sm_90"]}
    g = simulated_gpu(name="NVIDIA GeForce RTX 5090", compute_capability=(12, 0))
    c = only_problem(facts([g], torch=t), "compute_capability", "fail")
    assert "sm_120" in c.detail and "sm_120" in c.fix and "cu128" in c.fix


def test_card_too_old_for_torch_build():
    g = simulated_gpu(name="Tesla V100-SXM2-32GB", compute_capability=(7, 0))
    c = only_problem(facts([g]), "compute_capability", "fail")
    assert "sm_70" in c.detail


def test_card_served_only_by_ptx_is_a_warning():
    t = {**TORCH, "arch_list": ["sm_80", "compute_80"]}
    only_problem(facts(torch=t), "compute_capability", "warn")


def test_cuda_visible_devices_invalid():
    c = only_problem(facts(env={"CUDA_VISIBLE_DEVICES": "3"}, device="cpu"),
                     "cuda_visible_devices", "fail")
    assert "there is no GPU 3" in c.detail and "--device" in c.fix


def test_cuda_visible_devices_empty_while_gpus_exist():
    c = only_problem(facts(env={"CUDA_VISIBLE_DEVICES": ""}), "cuda_visible_devices", "warn")
    assert "hides all 1 GPU" in c.detail


def test_cuda_visible_devices_hides_configured_gpu():
    gpus = [simulated_gpu(0), simulated_gpu(1)]
    env = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    c = by_name(facts(gpus, env=env, device=gpus[0].uuid))
    assert c["cuda_visible_devices"].status == "warn"
    assert c["device"].status == "fail"
    assert "hidden by CUDA_VISIBLE_DEVICES='1'" in c["device"].detail


def test_cuda_visible_devices_by_uuid_all_visible_ok():
    g = simulated_gpu()
    checks = by_name(facts([g], env={"CUDA_VISIBLE_DEVICES": g.uuid}))
    assert checks["cuda_visible_devices"].status == "ok"


def test_device_order_not_pci_bus_id_with_several_gpus():
    c = only_problem(facts([simulated_gpu(0), simulated_gpu(1)]), "cuda_device_order", "warn")
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in c.fix
    ok = facts([simulated_gpu(0), simulated_gpu(1)], env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert exit_code(run_checks(ok)) == 0


def test_configured_device_missing():
    c = only_problem(facts(device="cuda:3"), "device", "fail")
    assert simulated_gpu().uuid in c.detail and "nvidia-smi -L" in c.fix


def test_stray_context_on_gpu0():
    gpus = [simulated_gpu(0, processes=(GpuProcess(PID, 500 << 20),)),
            simulated_gpu(1, processes=(GpuProcess(PID, 3 << 30),))]
    c = only_problem(facts(gpus, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, device="cuda:1"),
                     "stray_contexts", "fail")
    assert "NVML index 0" in c.detail and "CUDA_VISIBLE_DEVICES" in c.fix


@pytest.mark.parametrize("temp,status", [(85, "warn"), (93, "fail")])
def test_temperature(temp, status):
    c = only_problem(facts([simulated_gpu(temperature_c=temp)]), "temperature", status)
    assert f"{temp} C" in c.detail and "nvidia-smi" in c.fix


def test_missing_temperature_sensor_is_skipped():
    assert by_name(facts([simulated_gpu(temperature_c=None)]))["temperature"].status == "skip"


@pytest.mark.parametrize("reason,status", [
    ("hw_thermal_slowdown", "fail"), ("hw_power_brake_slowdown", "fail"),
    ("hw_slowdown", "fail"), ("sw_thermal_slowdown", "warn"), ("sw_power_cap", "warn")])
def test_throttle_reasons(reason, status):
    only_problem(facts([simulated_gpu(throttle_reasons=(reason,))]), "throttling", status)


def test_idle_reason_is_informational():
    c = by_name(facts([simulated_gpu(throttle_reasons=("gpu_idle",))]))["throttling"]
    assert c.status == "ok" and "gpu_idle" in c.detail


def test_pcie_width_degraded():
    c = only_problem(facts([simulated_gpu(pcie_width=8)]), "pcie_link", "warn")
    assert "x8/x16" in c.detail and "lspci" in c.fix


def test_pcie_low_generation_at_idle_is_not_a_fault():
    c = by_name(facts([simulated_gpu(pcie_gen=1)]))["pcie_link"]
    assert c.status == "ok" and "idle" in c.detail


def test_memory_budget_not_available_because_training_holds_it():
    g = simulated_gpu(memory_total=80 * GIB, memory_used=76 * GIB,
                      processes=(GpuProcess(5151, 75 * GIB),))
    c = only_problem(facts([g], budget=8 * GIB), "memory_budget", "fail")
    assert "pid 5151" in c.detail and "visionserve guard" in c.fix


def test_memory_budget_little_headroom_warns():
    g = simulated_gpu(memory_total=80 * GIB, memory_used=int(71.5 * GIB))
    only_problem(facts([g], budget=8 * GIB), "memory_budget", "warn")


def test_memory_budget_larger_than_card():
    g = simulated_gpu(memory_total=24 * GIB)
    c = only_problem(facts([g], budget=32 * GIB), "memory_budget", "fail")
    assert "larger than the card" in c.detail


def test_ecc_uncorrected():
    c = only_problem(facts([simulated_gpu(ecc_uncorrected=3)]), "ecc", "fail")
    assert "3 uncorrected" in c.detail and "nvidia-smi -r" in c.fix
    assert by_name(facts([simulated_gpu(ecc_uncorrected=None)]))["ecc"].status == "skip"


def test_xid_79_fallen_off_the_bus():
    log = ["[ 12.1] NVRM: Xid (PCI:0000:17:00): 79, pid=1234, GPU has fallen off the bus."]
    c = only_problem(facts(kernel_log=log), "xid", "fail")
    assert "fallen off the bus" in c.detail and "power" in c.fix


def test_xid_13_is_a_warning_and_unreadable_log_is_skipped():
    log = ["NVRM: Xid (PCI:0000:17:00): 13, Graphics Exception"]
    only_problem(facts(kernel_log=log), "xid", "warn")
    assert by_name(facts(kernel_log=None))["xid"].status == "skip"


def test_a_crashing_check_is_reported_not_raised():
    class Broken(SimulatedNvml):
        def processes(self, index):
            raise RuntimeError("boom")

    f = facts(budget=GIB)
    f.nvml = Broken([simulated_gpu()])
    c = by_name(f)["memory_budget"]
    assert c.status == "fail" and "boom" in c.detail


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "visionserve", "doctor", *args],
                          capture_output=True, text=True, timeout=180)


def test_cli_doctor_runs_here_and_exits_by_the_rules():
    p = _cli("--json")
    assert not p.stderr.strip().startswith("Traceback"), p.stderr
    report = json.loads(p.stdout)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    expected = 2 if "fail" in statuses.values() else 1 if "warn" in statuses.values() else 0
    assert p.returncode == expected == report["exit_code"]
    assert statuses["device"] in ("ok", "fail")


def test_cli_doctor_fails_for_a_missing_gpu_and_bad_budget():
    p = _cli("--device", "cuda:9", "--gpu-memory-budget", "4GiB")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "[FAIL] device" in p.stdout and "fix:" in p.stdout
    p = _cli("--gpu-memory-budget", "lots")
    assert p.returncode == 2 and "not a size: 'lots'" in p.stdout and "Traceback" not in p.stderr
