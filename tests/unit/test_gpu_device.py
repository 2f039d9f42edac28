from __future__ import annotations

import subprocess
import sys

import pytest

from visionserve.errors import ConfigError
from visionserve.gpu.device import (PinningError, check_contexts, describe, parse_device,
                                    pin_environment, resolve, visible_devices)
from visionserve.gpu.nvml import SimulatedNvml, simulated_gpu


def nvml3() -> SimulatedNvml:
    return SimulatedNvml([simulated_gpu(0, name="NVIDIA RTX A4000"), simulated_gpu(1),
                          simulated_gpu(2, name="NVIDIA L4")])


G = [simulated_gpu(i) for i in range(3)]  # same UUIDs/bus ids as nvml3()


@pytest.mark.parametrize("text,kind,attr,value", [
    ("auto", "auto", None, None), ("CPU", "cpu", None, None), ("cuda", "cuda", None, None),
    ("cuda:3", "index", "index", 3), ("2", "index", "index", 2),
    (" GPU-00000001-1111-2222-3333-000000000001 ", "uuid", "uuid",
     "GPU-00000001-1111-2222-3333-000000000001"),
    ("gpu-ABCDEF12", "uuid", "uuid", "GPU-abcdef12"),
    ("0000:17:00.0", "pci", "pci", (0, 0x17, 0, 0)),
    ("00000001:B3:00.0", "pci", "pci", (1, 0xB3, 0, 0)),
    ("17:00.0", "pci", "pci", (0, 0x17, 0, 0)),
])
def test_parse_device_accepts_every_form(text, kind, attr, value):
    spec = parse_device(text)
    assert spec.kind == kind
    if attr:
        assert getattr(spec, attr) == value


@pytest.mark.parametrize("bad", ["gpu0", "cuda:-1", "cuda:x", "", "17:00", "GPU-xyz", "0000:17:00.9"])
def test_parse_device_rejects_bad_syntax_naming_value_and_forms(bad):
    with pytest.raises(ConfigError) as e:
        parse_device(bad)
    assert repr(bad.strip()) in e.value.message and "accepted" in e.value.message


def test_mig_is_refused_clearly():
    with pytest.raises(ConfigError, match="MIG instances are not supported"):
        parse_device("MIG-4f3e2c1a-aaaa-bbbb-cccc-0123456789ab")


def test_resolve_by_index_uuid_and_bus_id():
    n = nvml3()
    assert resolve("cuda:2", n, {}).gpu.name == "NVIDIA L4"
    assert resolve("2", n, {}).gpu.index == 2
    r = resolve(G[1].uuid, n, {})
    assert r.kind == "cuda" and r.gpu.index == 1 and r.cuda_visible_devices == G[1].uuid
    assert resolve(G[1].uuid[:12], n, {}).gpu.index == 1  # unique prefix
    assert resolve("27:00.0", n, {}).gpu.index == 1
    assert resolve("0000:27:00.0", n, {}).gpu.index == 1
    assert resolve("00000000:27:00.0".lower(), n, {}).gpu.index == 1
    assert resolve("cuda", n, {}).gpu.index == 0
    assert resolve("auto", n, {}).torch_device == "cuda:0"


def test_cuda_n_counts_visible_devices_integer_form():
    n = nvml3()
    env = {"CUDA_VISIBLE_DEVICES": "1,2"}
    assert resolve("cuda:0", n, env).gpu.index == 1
    assert resolve("cuda:1", n, env).gpu.index == 2
    assert resolve("auto", n, env).gpu.index == 1


def test_cuda_n_counts_visible_devices_uuid_form():
    n = nvml3()
    env = {"CUDA_VISIBLE_DEVICES": f"{G[2].uuid},{G[0].uuid[:12]}"}
    assert resolve("cuda:0", n, env).gpu.index == 2
    assert resolve("cuda:1", n, env).gpu.index == 0


def test_missing_device_error_lists_what_is_visible():
    with pytest.raises(ConfigError) as e:
        resolve("cuda:7", nvml3(), {})
    msg = e.value.message
    assert "'cuda:7'" in msg
    for g in G:
        assert g.uuid in msg and g.pci_bus_id in msg
    assert "NVIDIA RTX A4000" in msg


def test_hidden_device_is_refused_naming_the_mask():
    with pytest.raises(ConfigError) as e:
        resolve(G[0].uuid, nvml3(), {"CUDA_VISIBLE_DEVICES": "2"})
    assert "hidden by CUDA_VISIBLE_DEVICES='2'" in e.value.message
    assert "cuda:0 = NVML index 2" in e.value.message
    with pytest.raises(ConfigError, match="no such GPU"):
        resolve("99:00.0", nvml3(), {})
    with pytest.raises(ConfigError, match="no such GPU"):
        resolve("GPU-deadbeef", nvml3(), {})


def test_no_gpu_auto_is_cpu_and_cuda_is_an_error():
    n = SimulatedNvml([])
    r = resolve("auto", n, {})
    assert r.kind == "cpu" and r.cuda_visible_devices is None and r.torch_device == "cpu"
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        resolve("cuda", n, {})
    with pytest.raises(ConfigError, match="no visible GPU 0"):
        resolve("cuda:0", n, {})


def test_cpu_with_gpus_hides_them():
    r = resolve("cpu", nvml3(), {})
    assert r.kind == "cpu" and r.cuda_visible_devices == ""
    r = resolve("auto", nvml3(), {"CUDA_VISIBLE_DEVICES": ""})
    assert r.kind == "cpu" and "none" in r.note


def test_visible_devices_follows_cuda_rules():
    v = visible_devices(G, "0,7,1")
    assert [g.index for g in v.devices] == [0]
    assert "'7'" in v.problems[0] and "(1)" in v.problems[0]
    assert [g.index for g in visible_devices(G, "2,2").devices] == [2]
    assert visible_devices(G, "2,2").problems
    assert visible_devices(G, "").devices == () and not visible_devices(G, "").problems
    assert visible_devices(G, "-1").devices == ()
    assert "MIG" in visible_devices(G, "MIG-abc").problems[0]
    assert visible_devices(G, None).devices == tuple(G) and not visible_devices(G, None).masked


def test_pin_environment_sets_uuid_and_order():
    r = resolve("cuda:1", nvml3(), {})
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "1,2"}
    pin_environment(r, env, modules={})
    assert env == {"CUDA_VISIBLE_DEVICES": G[1].uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_pin_environment_cpu():
    env: dict[str, str] = {}
    pin_environment(resolve("cpu", nvml3(), {}), env, modules={})
    assert env == {"CUDA_VISIBLE_DEVICES": ""}
    env = {}
    pin_environment(resolve("auto", SimulatedNvml([]), {}), env, modules={})
    assert env == {}  # a GPU-less machine is left alone


@pytest.mark.parametrize("mod", ["torch", "onnxruntime"])
def test_pin_environment_refuses_after_cuda_library_import(mod):
    env: dict[str, str] = {}
    with pytest.raises(PinningError, match=f"{mod} is already imported"):
        pin_environment(resolve("cuda:0", nvml3(), {}), env, modules={mod: object()})
    assert env == {}


def test_pin_environment_refuses_after_real_import_in_a_fresh_process():
    code = (
        "import onnxruntime\n"
        "from visionserve.gpu.device import resolve, pin_environment, PinningError\n"
        "from visionserve.gpu.nvml import SimulatedNvml, simulated_gpu\n"
        "r = resolve('cuda:0', SimulatedNvml([simulated_gpu()]), {})\n"
        "try:\n    pin_environment(r, {})\nexcept PinningError as e:\n    print('refused:', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "refused: cannot pin device 'cuda:0': onnxruntime is already imported" in p.stdout


def test_check_contexts_finds_stray_context_on_gpu0():
    n = nvml3()
    r = resolve("cuda:1", n, {})
    n.add_process(1, 4242, 2 << 30)  # on the pinned GPU: fine
    assert check_contexts(r, n, pid=4242) == []
    n.add_process(0, 4242, 300 << 20)
    n.add_process(2, 999, 1 << 30)  # someone else's context: not ours
    problems = check_contexts(r, n, pid=4242)
    assert len(problems) == 1
    assert "NVML index 0" in problems[0] and G[0].uuid in problems[0] and "300 MiB" in problems[0]


def test_check_contexts_for_cpu_server_flags_any_gpu_context():
    n = nvml3()
    n.add_process(0, 77)
    assert len(check_contexts(resolve("cpu", n, {}), n, pid=77)) == 1
    assert check_contexts(resolve("auto", SimulatedNvml([]), {}), SimulatedNvml([]), pid=77) == []


def test_describe_names_the_card():
    text = describe(resolve("cuda:2", nvml3(), {}))
    assert "NVIDIA L4" in text and G[2].uuid in text and G[2].pci_bus_id in text
    assert "GiB total" in text
    assert describe(resolve("auto", SimulatedNvml([]), {})).startswith("device cpu")
