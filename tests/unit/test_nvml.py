from __future__ import annotations

import threading

import pytest

from visionserve.gpu.nvml import (GIB, GpuInfo, GpuProcess, Nvml, NvmlError, SimulatedNvml,
                                  real_nvml, simulated_gpu, throttle_names)


def two_gpus() -> SimulatedNvml:
    return SimulatedNvml([simulated_gpu(0, name="NVIDIA L4", memory_total=24 * GIB),
                          simulated_gpu(1, memory_used=10 * GIB)],
                         driver_version="580.65.06", cuda_driver_version=(13, 0))


def test_simulated_reports_devices_in_order():
    n = two_gpus()
    assert isinstance(n, Nvml)
    assert n.available() and n.driver_version() == "580.65.06"
    assert n.cuda_driver_version() == (13, 0)
    devs = n.devices()
    assert [d.index for d in devs] == [0, 1]
    assert devs[0].name == "NVIDIA L4" and devs[0].memory_free == 23 * GIB
    assert devs[1].memory_free == devs[1].memory_total - 10 * GIB
    assert devs[0].uuid != devs[1].uuid and devs[0].pci_bus_id != devs[1].pci_bus_id
    assert n.memory(1) == (devs[1].memory_total, 10 * GIB, devs[1].memory_total - 10 * GIB)


def test_simulated_mutation_moves_memory():
    n = two_gpus()
    n.add_process(0, pid=123, used_bytes=4 * GIB)
    assert n.processes(0) == [GpuProcess(123, 4 * GIB)]
    assert n.memory(0)[1] == 5 * GIB
    n.remove_process(0, 123)
    assert n.processes(0) == [] and n.memory(0)[1] == 1 * GIB
    n.set_memory_used(0, 30 * GIB)  # clamped to the card
    assert n.memory(0) == (24 * GIB, 24 * GIB, 0)
    g = n.update(1, temperature_c=91, throttle_reasons=("hw_thermal_slowdown",))
    assert n.devices()[1] == g and g.temperature_c == 91


def test_simulated_mutation_from_threads_is_consistent():
    n = two_gpus()

    def work(pid: int) -> None:
        for _ in range(50):
            n.add_process(1, pid, GIB // 1024)
            n.remove_process(1, pid)

    threads = [threading.Thread(target=work, args=(p,)) for p in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total, used, free = n.memory(1)
    assert used == 10 * GIB and free == total - used and n.processes(1) == []


def test_simulated_without_driver_or_gpu_is_unavailable():
    for n in (SimulatedNvml([]), SimulatedNvml([simulated_gpu()], driver_version=None)):
        assert not n.available()
        assert n.devices() == [] and n.processes(0) == []
        assert n.cuda_driver_version() is None or n.devices() == []
        with pytest.raises(NvmlError):
            n.memory(0)


def test_bad_index_raises_nvml_error_for_memory_but_not_processes():
    n = two_gpus()
    with pytest.raises(NvmlError, match="index 5"):
        n.memory(5)
    assert n.processes(5) == []


def test_throttle_names_decode_the_nvml_bitmask():
    assert throttle_names(0) == ()
    assert throttle_names(0x1) == ("gpu_idle",)
    assert set(throttle_names(0x4 | 0x40)) == {"sw_power_cap", "hw_thermal_slowdown"}


def test_gpuinfo_to_dict_is_json_ready():
    import json

    g = simulated_gpu(processes=(GpuProcess(1, None),), throttle_reasons=("sw_power_cap",))
    d = g.to_dict()
    assert d["compute_capability"] == "9.0" and d["processes"] == [{"pid": 1, "used_bytes": None}]
    json.dumps(d)
    assert g.sm == "sm_90"
    assert set(d) == set(GpuInfo.__dataclass_fields__)


def test_real_nvml_never_raises_without_a_driver():
    n = real_nvml()
    assert real_nvml() is n  # one per process
    if n.available():
        pytest.skip("this machine has an NVIDIA driver and GPU")
    assert n.devices() == []
    assert n.driver_version() is None and n.cuda_driver_version() is None
    assert n.processes(0) == []
    assert getattr(n, "reason")  # says why
    with pytest.raises(NvmlError, match="not available"):
        n.memory(0)
