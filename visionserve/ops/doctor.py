"""Diagnose GPU, driver and environment faults; every failing check comes with a fix.

  visionserve doctor [--device SPEC] [--gpu-memory-budget SIZE] [--pid PID] [--json]

What it checks: the driver against the CUDA runtime of torch and onnxruntime, whether torch was
built for the card, CUDA_VISIBLE_DEVICES and the configured device, stray CUDA contexts, temperature
and throttling, the PCIe link, Xid and ECC errors in the kernel log, and whether the server's GPU
memory budget is free (or taken by training jobs). Run it first when the server will not start on
its GPU, or got slower for no visible reason.

Exit code: 0 all checks ok (or skipped), 1 warnings, 2 failures.
"""

# The checks read their inputs from a Facts object (NVML, torch/onnxruntime build facts,
# environment variables, kernel log), so that each fault of the field notes can be reproduced in a
# test with simulated answers.

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..config import parse_bytes
from ..errors import ConfigError
from ..gpu.device import (
    ResolvedDevice,
    check_contexts,
    describe,
    format_gpu,
    resolve,
    visible_devices,
)
from ..gpu.nvml import GpuInfo, Nvml, real_nvml

Status = Literal["ok", "warn", "fail", "skip"]

TEMP_WARN_C = 83  # most data-centre boards start slowing down in the high 80s
TEMP_FAIL_C = 90

# Oldest driver branch for each CUDA release (NVIDIA's CUDA toolkit release notes, table 3).
MIN_DRIVER_BRANCH = {
    (11, 8): "R520", (12, 0): "R525", (12, 1): "R530", (12, 2): "R535", (12, 3): "R545",
    (12, 4): "R550", (12, 5): "R555", (12, 6): "R560", (12, 8): "R570", (12, 9): "R575",
    (13, 0): "R580",
}

# Xid -> (status, meaning, fix). Xids 13/31/43 are usually an application fault, the others the
# card, its link or its power.
XID_TABLE: dict[int, tuple[Status, str, str]] = {
    13: ("warn", "graphics engine exception (often an out-of-range access in a kernel)",
         ("rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel; if no code changed, run "
          "`visionserve stress`")),
    31: ("warn", "GPU memory page fault (illegal address, usually application or driver bug)",
         "rerun with CUDA_LAUNCH_BLOCKING=1 / compute-sanitizer; update the driver"),
    43: ("warn", "GPU stopped processing (a process was killed or faulted)",
         "usually follows an application fault; check the log of the process named in the Xid"),
    48: ("fail", "double-bit ECC error",
         ("drain the GPU, `nvidia-smi -q -d ECC`, reset it (`sudo nvidia-smi -r -i N`); RMA if "
          "it recurs")),
    61: ("fail", "internal micro-controller breakpoint", "update the driver; reset the GPU"),
    62: ("fail", "internal micro-controller halt", "update the driver; reset the GPU"),
    63: ("warn", "ECC page retirement / row remapping event",
         "`nvidia-smi -q -d PAGE_RETIREMENT,ROW_REMAPPER`; reset the GPU to apply the remap"),
    64: ("fail", "ECC page retirement / row remapping failure", "drain the GPU and RMA it"),
    74: ("fail", "NVLink error", "check NVLink bridges/cables; `nvidia-smi nvlink --status`"),
    79: ("fail", "GPU has fallen off the bus (PCIe link lost)",
         ("check the power supply and PCIe power cables, reseat the card or riser, try another "
          "slot; lower the slot's PCIe generation in the BIOS to test; update the driver")),
    92: ("warn", "high single-bit ECC error rate", "watch `nvidia-smi -q -d ECC`; plan an RMA"),
    94: ("warn", "contained ECC error (the affected process was stopped)",
         "restart the affected process; reset the GPU when convenient"),
    95: ("fail", "uncontained ECC error",
         "drain the GPU and reset it (`sudo nvidia-smi -r -i N`) or reboot"),
    119: ("fail", "GSP firmware timeout", "update the driver; reset the GPU or reboot"),
    120: ("fail", "GSP firmware error", "update the driver; reset the GPU or reboot"),
}
_XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass
class Facts:
    """Everything the checks look at. Build the real one with :func:`gather_facts`."""

    nvml: Nvml
    environ: Mapping[str, str]
    torch: dict[str, Any] | None  # envrecord.torch_info(): version, cuda_runtime, arch_list, ...
    onnxruntime: dict[str, Any] | None  # envrecord.onnxruntime_info()
    device: str = "auto"
    gpu_memory_budget: int | None = None
    pid: int = field(default_factory=os.getpid)
    kernel_log: Sequence[str] | None = None  # None: not readable here
    #: the server's settings (VISIONSERVE_*), for the records and capture checks; None: skipped
    settings: Any = None


def read_kernel_log() -> list[str] | None:
    """Kernel messages (for Xid lines) or None when they cannot be read without root."""
    for cmd in (["dmesg", "--notime"], ["journalctl", "-k", "-b", "--no-pager", "-q"]):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        if p.returncode == 0 and p.stdout:
            return p.stdout.splitlines()
    return None


def gather_facts(device: str = "auto", gpu_memory_budget: int | None = None,
                 pid: int | None = None) -> Facts:
    from .envrecord import onnxruntime_info, torch_info

    return Facts(nvml=real_nvml(), environ=dict(os.environ), torch=torch_info(),
                 onnxruntime=onnxruntime_info(), device=device,
                 gpu_memory_budget=gpu_memory_budget, pid=os.getpid() if pid is None else pid,
                 kernel_log=read_kernel_log())


# -- helpers -----------------------------------------------------------------------------------

def _vt(text: Any) -> tuple[int, int] | None:
    if not text:
        return None
    m = re.match(r"(\d+)(?:\.(\d+))?", str(text))
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def _v(t: tuple[int, int]) -> str:
    return f"{t[0]}.{t[1]}"


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def _torch_cuda(facts: Facts) -> tuple[int, int] | None:
    t = facts.torch
    return _vt(t.get("cuda_runtime")) if t and "error" not in t else None


def arch_supports(arch_list: Sequence[str], cc: tuple[int, int]) -> tuple[bool, str]:
    """Can a build with ``arch_list`` (``torch.cuda.get_arch_list()``) run on compute
    capability ``cc``? SASS ``sm_XY`` runs on the same major with minor >= Y (``sm_XYa`` only on
    exactly X.Y); PTX ``compute_XY`` is JIT-compiled for any newer card."""
    for arch in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)([af]?)", arch)
        if not m:
            continue
        kind, major, minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "sm":
            if suffix == "a" and (major, minor) == cc:
                return True, f"{arch} (exact)"
            if suffix != "a" and major == cc[0] and minor <= cc[1]:
                return True, arch + (" (exact)" if minor == cc[1] else " (binary compatible)")
        elif (major, minor) <= cc and suffix == "":
            return True, f"{arch} (PTX, JIT-compiled at first use: slow start)"
    return False, ""


# -- the checks --------------------------------------------------------------------------------

class _Ctx:
    """Shared, computed once: NVML view, visibility, resolved device."""

    def __init__(self, facts: Facts) -> None:
        self.facts = facts
        self.available = facts.nvml.available()
        self.gpus: list[GpuInfo] = facts.nvml.devices() if self.available else []
        self.visibility = visible_devices(self.gpus, facts.environ.get("CUDA_VISIBLE_DEVICES"))
        self.resolved: ResolvedDevice | None = None
        self.resolve_error: str | None = None
        try:
            self.resolved = resolve(facts.device, facts.nvml, facts.environ)
        except ConfigError as exc:
            self.resolve_error = exc.message
        self.wants_gpu = facts.device.strip().lower() not in ("auto", "cpu")

    @property
    def targets(self) -> list[GpuInfo]:
        """GPUs the per-card checks look at: the configured one, or all if it did not resolve."""
        if self.resolved is not None:
            return [self.resolved.gpu] if self.resolved.gpu is not None else []
        return self.gpus


def check_nvml(c: _Ctx) -> Check:
    f = c.facts
    if c.available:
        cuda = f.nvml.cuda_driver_version()
        return Check("nvidia_driver", "ok",
                     f"driver {f.nvml.driver_version()} (supports CUDA up to "
                     f"{_v(cuda) if cuda else '?'}), {len(c.gpus)} GPU(s): "
                     + "; ".join(format_gpu(g) for g in c.gpus))
    reason = getattr(f.nvml, "reason", None) or "NVML not available"
    fix = ("check `nvidia-smi`. Not found: install the NVIDIA driver (e.g. `sudo apt install "
           "nvidia-driver-570-server`, or the .run installer with the display manager stopped). "
           "Driver not loaded: `sudo modprobe nvidia`, check `dmesg | grep -i nvrm` (Secure Boot "
           "may block the module). In a container: run with `--gpus all` / the NVIDIA container "
           "toolkit so the driver library is mounted.")
    torch_sees = bool(f.torch and f.torch.get("cuda_available"))
    if c.wants_gpu or torch_sees:
        return Check("nvidia_driver", "fail", f"no usable NVIDIA driver: {reason}", fix)
    return Check("nvidia_driver", "skip",
                 f"no GPU ({reason}); the server runs on the CPU", "")


def check_driver_cuda(c: _Ctx) -> Check:
    f = c.facts
    name = "driver_vs_cuda"
    if not c.available:
        return Check(name, "skip", "no NVIDIA driver")
    drv = f.nvml.cuda_driver_version()
    needs: list[tuple[str, tuple[int, int]]] = []
    tc = _torch_cuda(f)
    if tc:
        needs.append((f"torch {f.torch.get('version')}", tc))  # type: ignore[union-attr]
    o = f.onnxruntime
    if o and "error" not in o and "CUDAExecutionProvider" in (o.get("providers") or []):
        oc = _vt(o.get("cuda_version"))
        if oc:
            needs.append((f"onnxruntime-gpu {o.get('version')}", oc))
    if not needs:
        return Check(name, "skip", "no CUDA build of torch or onnxruntime installed")
    if drv is None:
        return Check(name, "warn", "the driver does not report its CUDA version",
                     "update the driver; `nvidia-smi` shows 'CUDA Version' at the top right")
    fails, warns, oks = [], [], []
    for who, need in needs:
        if need[0] > drv[0]:
            fails.append(f"{who} needs CUDA {_v(need)}, the driver supports only {_v(drv)}")
        elif need > drv:
            warns.append(f"{who} uses CUDA {_v(need)} on a driver for {_v(drv)} (minor version "
                         "compatibility: runs, but PTX JIT and newer features fail)")
        else:
            oks.append(f"{who}: CUDA {_v(need)} <= driver's {_v(drv)}")
    newest = max(n for _, n in needs)
    branch = MIN_DRIVER_BRANCH.get(newest)
    target = f"{branch} or newer" if branch else f"a release for CUDA {_v(newest)}"
    fix = (f"upgrade the NVIDIA driver to {target}"
           f" (driver {f.nvml.driver_version()} supports CUDA {_v(drv)}), or install builds for "
           f"CUDA <= {_v(drv)}, e.g. `pip install torch --index-url "
           f"https://download.pytorch.org/whl/cu{drv[0]}{drv[1]}` (pick an index that exists)")
    if fails:
        return Check(name, "fail", "; ".join(fails + warns), fix)
    if warns:
        return Check(name, "warn", "; ".join(warns), fix)
    return Check(name, "ok", "; ".join(oks))


def check_torch_cuda(c: _Ctx) -> Check:
    """torch cannot initialise CUDA although the driver sees visible GPUs."""
    f, name = c.facts, "torch_cuda"
    t = f.torch
    if t is None:
        if c.gpus:
            from ..extras import install_hint

            return Check(name, "warn", f"torch is not installed (the CPU install) but "
                         f"{len(c.gpus)} GPU(s) are present: the server can only use the CPU",
                         install_hint("gpu"))
        return Check(name, "skip", "torch is not installed (the CPU install)")
    if "error" in t:
        return Check(name, "fail", f"torch does not import: {t['error']}",
                     "reinstall torch in this environment (`pip install --force-reinstall torch`)")
    if not t.get("cuda_runtime"):
        if c.gpus:
            return Check(name, "warn", f"torch {t.get('version')} is a CPU-only build but "
                         f"{len(c.gpus)} GPU(s) are present",
                         "install a CUDA build: `pip install torch --index-url "
                         "https://download.pytorch.org/whl/cu128` (match the driver)")
        return Check(name, "skip", f"torch {t.get('version')} is a CPU-only build; no GPU")
    if not c.visibility.devices:
        return Check(name, "skip", "no GPU visible to CUDA")
    if t.get("cuda_available"):
        return Check(name, "ok", f"torch sees {t.get('device_count')} CUDA device(s)")
    err = t.get("cuda_error") or "torch.cuda.is_available() is False"
    return Check(name, "fail", f"the driver sees GPUs but torch cannot use CUDA: {err}",
                 "see the driver_vs_cuda check; in a container check `ls /dev/nvidia*` and that "
                 "it runs with `--gpus`; `python -c 'import torch; torch.zeros(1).cuda()'` shows "
                 "the CUDA error")


def check_compute_capability(c: _Ctx) -> Check:
    f, name = c.facts, "compute_capability"
    t = f.torch
    if not t or "error" in t or not t.get("cuda_runtime"):
        return Check(name, "skip", "no CUDA build of torch")
    targets = c.targets
    if not targets:
        return Check(name, "skip", "no GPU in use")
    arch = t.get("arch_list") or []
    bad: list[str] = []
    good: list[str] = []
    for g in targets:
        if g.compute_capability is None:
            continue
        ok, how = arch_supports(arch, g.compute_capability)
        (good if ok else bad).append(f"{g.name} is {g.sm}" + (f": {how}" if ok else ""))
    if bad:
        cc = max(g.compute_capability for g in targets if g.compute_capability)
        return Check(name, "fail",
                     f"torch {t.get('version')} is built for {' '.join(arch) or 'no arch'}; "
                     + "; ".join(bad) + " is not among them ('no kernel image is available' / "
                     "'requires device with capability')",
                     f"install a torch build that includes sm_{cc[0]}{cc[1]}: newer cards need a "
                     "newer CUDA (Blackwell sm_100/sm_120: CUDA 12.8+, `pip install torch "
                     "--index-url https://download.pytorch.org/whl/cu128`); older cards (sm_70 and "
                     "below) need an older torch/CUDA build, or use the onnxruntime backend")
    if not good:
        return Check(name, "skip", "the GPU does not report its compute capability")
    status: Status = "warn" if any("PTX" in s for s in good) else "ok"
    return Check(name, status, "; ".join(good),
                 "install a torch build with native kernels for this card" if status == "warn"
                 else "")


def check_visible_devices(c: _Ctx) -> Check:
    name = "cuda_visible_devices"
    vis = c.visibility
    if not vis.masked:
        return Check(name, "ok", "CUDA_VISIBLE_DEVICES unset: CUDA sees every GPU"
                     + (f" ({len(c.gpus)})" if c.gpus else ""))
    if not c.available:
        return Check(name, "skip", f"CUDA_VISIBLE_DEVICES={vis.raw!r} but no NVIDIA driver")
    fix = ("unset CUDA_VISIBLE_DEVICES and choose the GPU with `--device` / VISIONSERVE_DEVICE "
           "(UUID from `nvidia-smi -L`): visionserve pins it itself. If you keep it, list "
           "devices by UUID, e.g. CUDA_VISIBLE_DEVICES="
           + (c.gpus[0].uuid if c.gpus else "GPU-..."))
    if vis.problems:
        return Check(name, "fail", f"CUDA_VISIBLE_DEVICES={vis.raw!r}: " + "; ".join(vis.problems)
                     + f"; CUDA sees {len(vis.devices)} of {len(c.gpus)} GPU(s)", fix)
    if not vis.devices:
        return Check(name, "warn" if not c.wants_gpu else "fail",
                     f"CUDA_VISIBLE_DEVICES={vis.raw!r} hides all {len(c.gpus)} GPU(s): "
                     "`nvidia-smi` shows them but CUDA programs find no device", fix)
    hidden = [g for g in c.gpus if g not in vis.devices]
    if hidden:
        return Check(name, "warn",
                     f"CUDA_VISIBLE_DEVICES={vis.raw!r} hides {len(hidden)} of {len(c.gpus)} "
                     f"GPU(s) ({'; '.join(format_gpu(g) for g in hidden)}); cuda:N counts only the "
                     "visible ones, so cuda:0 here is " + format_gpu(vis.devices[0]), fix)
    return Check(name, "ok", f"CUDA_VISIBLE_DEVICES={vis.raw!r}: all GPUs visible")


def check_device_order(c: _Ctx) -> Check:
    name = "cuda_device_order"
    order = c.facts.environ.get("CUDA_DEVICE_ORDER")
    if len(c.gpus) < 2:
        return Check(name, "skip", "fewer than two GPUs: the order cannot differ")
    if order == "PCI_BUS_ID":
        return Check(name, "ok", "CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA numbers GPUs like nvidia-smi")
    shown = repr(order) if order else "unset"
    return Check(name, "warn",
                 f"CUDA_DEVICE_ORDER is {shown} (FASTEST_FIRST) with "
                 f"{len(c.gpus)} GPUs: CUDA's device numbers may differ from nvidia-smi's, so "
                 "'GPU 1' in one tool can be another card in the other (visionserve serve sets "
                 "PCI_BUS_ID itself; training jobs and other tools do not)",
                 "export CUDA_DEVICE_ORDER=PCI_BUS_ID (e.g. in /etc/environment or the service "
                 "unit), and name GPUs by UUID")


def check_device(c: _Ctx) -> Check:
    name = "device"
    if c.resolve_error:
        return Check(name, "fail", c.resolve_error,
                     "choose a GPU that exists and is visible: `nvidia-smi -L` lists UUIDs; set "
                     "`--device GPU-...` / VISIONSERVE_DEVICE, or fix CUDA_VISIBLE_DEVICES")
    assert c.resolved is not None
    return Check(name, "ok", f"{c.facts.device!r} -> {describe(c.resolved)}")


def check_stray_contexts(c: _Ctx) -> Check:
    name = "stray_contexts"
    f = c.facts
    if not c.available or c.resolved is None:
        return Check(name, "skip", "no GPU" if not c.available else "device not resolved")
    problems = check_contexts(c.resolved, f.nvml, f.pid)
    if problems:
        return Check(name, "fail", "; ".join(problems),
                     "pin the device before any CUDA library is imported (visionserve serve "
                     "does; for other programs start them with CUDA_DEVICE_ORDER=PCI_BUS_ID "
                     "CUDA_VISIBLE_DEVICES=<uuid>), and never call .cuda()/cuda:0 before pinning; "
                     "restart the process to release the stray context")
    return Check(name, "ok", f"process {f.pid} holds no CUDA context outside "
                 + (format_gpu(c.resolved.gpu) if c.resolved.gpu else "the CPU")
                 + " (in a container without the host PID namespace NVML cannot tell)")


def check_temperature(c: _Ctx) -> Check:
    name = "temperature"
    temps = [(g, g.temperature_c) for g in c.targets if g.temperature_c is not None]
    if not temps:
        return Check(name, "skip", "no GPU in use or no temperature sensor reported")
    hot = max(temps, key=lambda x: x[1])
    detail = ", ".join(f"{g.name} (NVML {g.index}) {t} C" for g, t in temps)
    fix = ("improve cooling: clean dust from the heatsink and fans, check the fans spin "
           "(`nvidia-smi -q -d TEMPERATURE,PERFORMANCE`), keep the cabinet's air path free and "
           "its filter clean; meanwhile cap the power (`sudo nvidia-smi -i N -pl WATTS`)")
    if hot[1] >= TEMP_FAIL_C:
        return Check(name, "fail", detail + f": at or above {TEMP_FAIL_C} C the card slows down",
                     fix)
    if hot[1] >= TEMP_WARN_C:
        return Check(name, "warn", detail + f": close to slowdown (warn at {TEMP_WARN_C} C)", fix)
    return Check(name, "ok", detail)


_THROTTLE = {
    "hw_thermal_slowdown": ("fail", "hardware thermal slowdown (the card is too hot)"),
    "sw_thermal_slowdown": ("warn", "driver thermal slowdown (GPU or memory temperature)"),
    "hw_slowdown": ("fail", "hardware slowdown (temperature or power brake from the board/PSU)"),
    "hw_power_brake_slowdown": ("fail", "external power brake (power supply asserted it)"),
    "sw_power_cap": ("warn", ("power cap reached (normal at full load; a problem when idle or "
                              "when the limit was lowered)")),
}


def check_throttling(c: _Ctx) -> Check:
    name = "throttling"
    if not c.targets:
        return Check(name, "skip", "no GPU in use")
    found: list[tuple[str, str]] = []
    for g in c.targets:
        for r in g.throttle_reasons:
            if r in _THROTTLE:
                st, what = _THROTTLE[r]
                found.append((st, f"{g.name} (NVML {g.index}): {what}"))
    if not found:
        reasons = sorted({r for g in c.targets for r in g.throttle_reasons})
        return Check(name, "ok", "no slowdown active" + (f" (informational: {', '.join(reasons)})"
                                                          if reasons else ""))
    status: Status = "fail" if any(st == "fail" for st, _ in found) else "warn"
    return Check(name, status, "; ".join(w for _, w in found),
                 "`nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE` shows which limit is hit: for "
                 "thermal, improve cooling (clean fans/heatsink, airflow); for power brake/HW "
                 "slowdown, check the PSU rating and the PCIe power cables; for the power cap, "
                 "check `nvidia-smi -q -d POWER` (restore the default limit with "
                 "`sudo nvidia-smi -i N -pl DEFAULT_WATTS`)")


def check_pcie(c: _Ctx) -> Check:
    name = "pcie_link"
    rows = [g for g in c.targets if g.pcie_width is not None and g.pcie_width_max is not None]
    if not rows:
        return Check(name, "skip", "no GPU in use or PCIe link not reported")
    narrow = [g for g in rows if g.pcie_width < g.pcie_width_max]  # type: ignore[operator]
    detail = "; ".join(f"{g.name} (NVML {g.index}) gen {g.pcie_gen}/{g.pcie_gen_max} "
                       f"x{g.pcie_width}/x{g.pcie_width_max}" for g in rows)
    if narrow:
        return Check(name, "warn", detail + ": link narrower than the card supports (host to "
                     "device copies run at a fraction of the expected bandwidth)",
                     "reseat the card, use a slot wired x16 (slots can share lanes: see the "
                     "board manual), replace a riser/extension; check `sudo lspci -vv -s BUS | "
                     "grep -E 'LnkCap|LnkSta'`")
    low_gen = [g for g in rows if g.pcie_gen and g.pcie_gen_max and g.pcie_gen < g.pcie_gen_max]
    note = (" (an idle card lowers its link generation to save power: that is normal; run "
            "`visionserve stress` and look again under load)") if low_gen else ""
    return Check(name, "ok", detail + note)


def check_memory_budget(c: _Ctx) -> Check:
    name = "memory_budget"
    budget = c.facts.gpu_memory_budget
    if budget is None:
        return Check(name, "skip", "no GPU memory budget configured (--gpu-memory-budget)")
    if c.resolved is None or c.resolved.gpu is None:
        return Check(name, "skip", "no GPU in use")
    g = c.resolved.gpu
    try:
        total, used, free = c.facts.nvml.memory(g.index)
    except Exception:  # noqa: BLE001 - NVML cannot read it now: the figures listed before
        total, used, free = g.memory_total, g.memory_used, g.memory_free
    procs = [p for p in c.facts.nvml.processes(g.index)]
    holders = ", ".join(f"pid {p.pid}" + (f" {_gib(p.used_bytes)}" if p.used_bytes else "")
                        for p in procs) or "no compute process listed"
    detail = (f"budget {_gib(budget)}; {g.name}: {_gib(free)} free of {_gib(total)} "
              f"({_gib(used)} used: {holders})")
    if budget > total:
        return Check(name, "fail", detail + ": the budget is larger than the card",
                     f"lower --gpu-memory-budget / VISIONSERVE_GPU_MEMORY_BUDGET below "
                     f"{_gib(total)}")
    fix = ("free memory on this GPU: see who holds it (`nvidia-smi --query-compute-apps="
           "pid,used_memory --format=csv`), stop or pause those jobs, run training through "
           "`visionserve guard` so it is admitted only when it fits; or lower the budget")
    if free < budget:
        return Check(name, "fail", detail + ": not enough free memory; the server would stay "
                     "not-ready", fix)
    if free < budget * 1.1:
        return Check(name, "warn", detail + ": less than 10% headroom above the budget", fix)
    return Check(name, "ok", detail)


def check_ecc(c: _Ctx) -> Check:
    name = "ecc"
    rows = [g for g in c.targets if g.ecc_uncorrected is not None]
    if not rows:
        return Check(name, "skip", "no GPU in use, or ECC not supported/enabled")
    bad = [g for g in rows if g.ecc_uncorrected]
    if bad:
        return Check(name, "fail", "; ".join(
            f"{g.name} (NVML {g.index}): {g.ecc_uncorrected} uncorrected ECC error(s) since the "
            "driver loaded" for g in bad),
            "drain the GPU; `nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER`; reset it "
            "(`sudo nvidia-smi -r -i N`) or reboot so pending remaps apply; run `visionserve "
            "stress`; RMA the card if errors come back")
    return Check(name, "ok", "no uncorrected ECC errors")


def check_xid(c: _Ctx) -> Check:
    name = "xid"
    log_lines = c.facts.kernel_log
    if log_lines is None:
        return Check(name, "skip", "kernel log not readable (run as root, or `sudo dmesg | "
                     "grep -i xid`)")
    seen: dict[int, list[str]] = {}
    for line in log_lines:
        m = _XID_RE.search(line)
        if m:
            seen.setdefault(int(m.group(2)), []).append(m.group(1))
    if not seen:
        return Check(name, "ok", "no NVIDIA Xid errors in the kernel log")
    parts, fixes, status = [], [], "ok"
    for xid, buses in sorted(seen.items()):
        st, what, fix = XID_TABLE.get(xid, ("warn", "see NVIDIA's Xid catalog",
                                             "look the Xid up in NVIDIA's Xid catalog"))
        status = "fail" if "fail" in (status, st) else "warn"
        parts.append(f"Xid {xid} x{len(buses)} on {', '.join(sorted(set(buses)))}: {what}")
        fixes.append(f"Xid {xid}: {fix}")
    return Check(name, status, "; ".join(parts), "; ".join(fixes))  # type: ignore[arg-type]


def check_records(c: _Ctx) -> Check:
    """The record store: writable, room on its disk, retention keeping up (records.health)."""
    from ..records.health import check_records as records

    return Check("records", *records(c.facts.settings))


def check_capture(c: _Ctx) -> Check:
    """The capture target: writable or reachable, its quota against the disk's free space."""
    from ..records.health import check_capture as capture

    return Check("capture", *capture(c.facts.settings))


CHECKS: tuple[Callable[[_Ctx], Check], ...] = (
    check_nvml, check_driver_cuda, check_torch_cuda, check_compute_capability,
    check_visible_devices, check_device_order, check_device, check_stray_contexts,
    check_temperature, check_throttling, check_pcie, check_memory_budget, check_ecc, check_xid,
    check_records, check_capture,
)


def run_checks(facts: Facts) -> list[Check]:
    ctx = _Ctx(facts)
    out = []
    for fn in CHECKS:
        try:
            out.append(fn(ctx))
        except Exception as exc:  # noqa: BLE001 - a check must never take the whole report down
            out.append(Check(fn.__name__.removeprefix("check_"), "fail",
                             f"the check itself failed: {exc!r}", "report this as a bug"))
    return out


def exit_code(checks: Sequence[Check]) -> int:
    statuses = {c.status for c in checks}
    return 2 if "fail" in statuses else 1 if "warn" in statuses else 0


def render_text(checks: Sequence[Check], facts: Facts) -> str:
    label = {"ok": " ok ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
    lines = [f"visionserve doctor (device {facts.device!r})"]
    for ch in checks:
        lines.append(f"[{label[ch.status]}] {ch.name:<20} {ch.detail}")
        if ch.fix and ch.status in ("warn", "fail"):
            lines.append(f"       {'':<20} fix: {ch.fix}")
    counts = {s: sum(1 for c in checks if c.status == s) for s in ("ok", "warn", "fail", "skip")}
    lines.append(f"{counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failure(s), "
                 f"{counts['skip']} skipped -> exit {exit_code(checks)}")
    return "\n".join(lines)


def server_settings():
    """The server's settings from VISIONSERVE_* (what ``serve`` would run with), or None when
    they do not validate (``serve`` says why)."""
    from pydantic import ValidationError

    from ..config import ServerSettings

    try:
        return ServerSettings()
    except ValidationError:
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="device the server will use (default: VISIONSERVE_DEVICE or auto)")
    parser.add_argument("--gpu-memory-budget", default=None, metavar="SIZE",
                        help="GPU memory the server will reserve, e.g. 4GiB "
                             "(default: VISIONSERVE_GPU_MEMORY_BUDGET)")
    parser.add_argument("--pid", type=int, default=None,
                        help="look for stray CUDA contexts of this process (e.g. a running "
                             "server) instead of this one")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    device = args.device or os.environ.get("VISIONSERVE_DEVICE") or "auto"
    budget_text = args.gpu_memory_budget or os.environ.get("VISIONSERVE_GPU_MEMORY_BUDGET")
    try:
        budget = parse_bytes(budget_text) if budget_text else None
    except ValueError as exc:
        print(f"visionserve doctor: --gpu-memory-budget: {exc}")
        return 2
    facts = gather_facts(device, budget, args.pid)
    facts.settings = server_settings()
    checks = run_checks(facts)
    code = exit_code(checks)
    if args.json:
        print(json.dumps({"device": device, "exit_code": code,
                          "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render_text(checks, facts))
    return code
