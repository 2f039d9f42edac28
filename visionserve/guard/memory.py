"""Where the guard learns how full the card is: free/total of the pinned device and the bytes
each pid holds on it.

:class:`NvmlMemorySource` reads the driver through :mod:`visionserve.gpu.nvml` (NVML never creates
a CUDA context, so the guard itself holds no GPU memory). :class:`SimulatedMemorySource` answers
from a small JSON side file that tests and job subprocesses write (:func:`simulate_usage`), and
goes through the same NVML adapter over a ``SimulatedNvml``.

Containers: NVML reports host pids. In a container without the host pid namespace the per-pid
figures cannot be matched to the job, so only the card-level floor check protects the server.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError
from ..gpu.nvml import GpuInfo, GpuProcess, Nvml, SimulatedNvml, simulated_gpu
from . import proc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySample:
    total: int
    free: int
    used_by_pid: dict[int, int]  # pids the driver reports on this device, bytes each


class MemorySource(Protocol):
    #: "GPU 0 (NVIDIA H200, GPU-...)" for logs
    description: str
    #: what CUDA_VISIBLE_DEVICES gets for the jobs
    uuid: str

    def device_memory(self) -> tuple[int, int]:
        """(total, free) bytes of the device."""

    def pid_usage(self) -> dict[int, int]:
        """pid -> bytes that pid holds on the device."""

    def sample(self) -> MemorySample: ...


class NvmlMemorySource:
    """Memory of one device seen through an :class:`~visionserve.gpu.nvml.Nvml`."""

    def __init__(self, nvml: Nvml, info: GpuInfo) -> None:
        self._nvml = nvml
        self.index = info.index
        self.uuid = info.uuid
        self.description = f"GPU {info.index} ({info.name}, {info.uuid}, {info.pci_bus_id})"

    def device_memory(self) -> tuple[int, int]:
        total, _used, free = self._nvml.memory(self.index)
        return total, free

    def pid_usage(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self._nvml.processes(self.index):
            # None: the driver cannot attribute memory to pids (some containers); count as 0
            out[p.pid] = out.get(p.pid, 0) + (p.used_bytes or 0)
        return out

    def sample(self) -> MemorySample:
        total, free = self.device_memory()
        return MemorySample(total=total, free=free, used_by_pid=self.pid_usage())

    def process_sm_util(self, since_us: int) -> tuple[dict[int, float], int] | None:
        """pid -> mean SM utilisation (percent) since ``since_us``; None where not available."""
        fn = getattr(self._nvml, "process_sm_util", None)
        return fn(self.index, since_us) if fn is not None else None




def open_nvml_source(spec: str, nvml: Nvml | None = None) -> NvmlMemorySource | None:
    """The pinned device's memory source, or None where no GPU is visible (or ``spec`` is
    ``cpu``/``none``): the guard then runs as a plain serial queue."""
    if spec.strip().lower() in ("cpu", "none"):
        return None
    if nvml is None:
        from ..gpu.nvml import real_nvml
        nvml = real_nvml()
    if not nvml.available():
        if spec.strip() not in ("auto", ""):
            raise ConfigError(f"--device {spec}: no GPU available "
                              f"({getattr(nvml, 'reason', None) or 'NVML not available'})")
        return None
    from ..gpu.device import resolve

    resolved = resolve(spec, nvml)  # the server's own rules: cuda:N, GPU-<uuid>, PCI bus id
    return None if resolved.gpu is None else NvmlMemorySource(nvml, resolved.gpu)


# -- simulation ----------------------------------------------------------------------------------
# Side file: {"total": bytes, "base_used": bytes (the inference server and others),
#             "pids": {"<pid>": bytes}}, and what a job process declares itself in
# <side file>.pids/<pid> (bytes, as text), written without the side file's lock: the guard may
# stop (pause) a job at any instruction, and a job stopped holding the lock would stall every
# other writer. Dead pids are ignored, as the driver forgets them.

def _locked_update(path: str, fn) -> dict:
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            data = {}
        data = fn(data)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # readers never see a half-written file
        return data
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def write_simulation(path: str, *, total: int | None = None, base_used: int | None = None,
                     pids: dict[int, int] | None = None) -> dict:
    """Create or change the side file (fields left None keep their value)."""
    def fn(d: dict) -> dict:
        d.setdefault("total", 80 * 1024**3)
        d.setdefault("base_used", 0)
        d.setdefault("pids", {})
        if total is not None:
            d["total"] = int(total)
        if base_used is not None:
            d["base_used"] = int(base_used)
        if pids is not None:
            d["pids"] = {str(k): int(v) for k, v in pids.items()}
        return d
    return _locked_update(path, fn)


def simulate_usage(path: str, used_bytes: int, pid: int | None = None) -> None:
    """Declare that ``pid`` (default: the caller) holds ``used_bytes`` on the simulated GPU.
    Job subprocesses call this: ``python -c "from visionserve.guard.memory import
    simulate_usage; simulate_usage(PATH, 2**30)"``."""
    pid = os.getpid() if pid is None else pid
    folder = path + ".pids"
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{pid}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(int(used_bytes)))
    os.replace(tmp, os.path.join(folder, str(pid)))  # readers never see a half-written file


def _declared(path: str) -> dict[str, int]:
    """What job processes declared in ``path``.pids (see :func:`simulate_usage`)."""
    folder = path + ".pids"
    out: dict[str, int] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                out[name] = int(f.read() or 0)
        except (OSError, ValueError):  # removed meanwhile, or being replaced
            continue
    return out


class SimulatedMemorySource:
    """A simulated GPU whose memory use comes from the side file at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        if not os.path.exists(self.path):
            write_simulation(self.path)
        info = self._info()
        self.uuid = info.uuid
        self.index = 0
        self.description = f"simulated GPU ({self.path})"

    def _info(self) -> GpuInfo:
        try:
            with open(self.path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read simulated GPU memory file {self.path}: {exc}") from None
        total = int(d.get("total", 80 * 1024**3))
        declared = {**d.get("pids", {}), **_declared(self.path)}
        procs = {int(p): int(b) for p, b in declared.items() if proc.is_alive(int(p), None)}
        used = min(total, int(d.get("base_used", 0)) + sum(procs.values()))
        return simulated_gpu(0, memory_total=total, memory_used=used,
                             processes=tuple(GpuProcess(p, b) for p, b in procs.items()))

    def _nvml_source(self) -> NvmlMemorySource:
        return NvmlMemorySource(SimulatedNvml([self._info()]), self._info())

    def device_memory(self) -> tuple[int, int]:
        return self._nvml_source().device_memory()

    def pid_usage(self) -> dict[int, int]:
        return self._nvml_source().pid_usage()

    def sample(self) -> MemorySample:
        info = self._info()  # one read of the file: total, free and pids consistent
        return NvmlMemorySource(SimulatedNvml([info]), info).sample()
