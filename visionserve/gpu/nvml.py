"""A small facade over NVML: what the driver sees, without initialising CUDA.

Everything that asks "which GPUs exist, how full are they, who holds a context on them" goes
through :class:`Nvml`, so that the server, the training-queue guard, ``doctor`` and the tests can
swap the real driver (:func:`real_nvml`, pynvml based) for a :class:`SimulatedNvml`.

NVML never creates a CUDA context, so it is safe to call before the server pins its device.
Devices are listed in NVML order, which is PCI bus order (the order ``nvidia-smi`` shows), and are
*not* filtered by ``CUDA_VISIBLE_DEVICES``: that variable only affects CUDA, never NVML.

Per-device attributes that some boards do not report (temperature on some boards, ECC on
consumer cards, processes inside some containers) degrade to ``None`` / empty instead of raising.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import InternalError

log = logging.getLogger(__name__)


class NvmlError(InternalError):
    """NVML is not available, or a device index does not exist."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None where the driver does not report it (e.g. WDDM, some containers)


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML index = position in PCI bus order
    name: str
    uuid: str  # "GPU-xxxxxxxx-xxxx-..."
    pci_bus_id: str  # as NVML reports it, e.g. "00000000:17:00.0"
    memory_total: int
    memory_used: int
    memory_free: int
    compute_capability: tuple[int, int] | None
    temperature_c: int | None
    power_w: float | None
    throttle_reasons: tuple[str, ...]  # active ones, human names e.g. "hw_thermal_slowdown"
    pcie_gen: int | None
    pcie_gen_max: int | None
    pcie_width: int | None
    pcie_width_max: int | None
    ecc_uncorrected: int | None  # volatile (since driver load) uncorrected ECC errors
    processes: tuple[GpuProcess, ...]  # compute processes holding a context

    @property
    def sm(self) -> str | None:
        """``"sm_90"`` for compute capability 9.0."""
        if self.compute_capability is None:
            return None
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compute_capability"] = (
            f"{self.compute_capability[0]}.{self.compute_capability[1]}"
            if self.compute_capability else None)
        d["throttle_reasons"] = list(self.throttle_reasons)
        d["processes"] = [dataclasses.asdict(p) for p in self.processes]
        return d


@runtime_checkable
class Nvml(Protocol):
    def available(self) -> bool:
        """False: no driver / no NVML library / no GPU."""

    def driver_version(self) -> str | None: ...

    def cuda_driver_version(self) -> tuple[int, int] | None:
        """The newest CUDA version the driver supports, e.g. (12, 4)."""

    def devices(self) -> list[GpuInfo]:
        """All GPUs the driver sees, NVML (PCI bus) order, not filtered by CUDA_VISIBLE_DEVICES."""

    def memory(self, index: int) -> tuple[int, int, int]:
        """(total, used, free) bytes of GPU ``index``; the cheap call for polling loops."""

    def processes(self, index: int) -> list[GpuProcess]: ...


# Clock event ("throttle") reason bits, from nvml.h. Kept here so simulated answers and
# rendering need no pynvml.
THROTTLE_REASON_BITS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_REASON_BITS.items() if mask & bit)


def _text(value: Any) -> str:
    # Older pynvml releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else str(value)


class _RealNvml:
    """pynvml-backed implementation. Initialises NVML lazily, once, and never raises from
    :meth:`available`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: str = "new"  # new | ok | unavailable
        self._reason: str | None = None
        self._nv: Any = None
        self._handles: dict[int, Any] = {}

    # -- set-up -------------------------------------------------------------------------------
    def _init(self) -> bool:
        with self._lock:
            if self._state != "new":
                return self._state == "ok"
            try:
                import pynvml  # lazy: the CLI must import nothing heavy at module import
            except ImportError as exc:
                self._state, self._reason = "unavailable", f"pynvml not installed ({exc})"
                return False
            try:
                pynvml.nvmlInit()
                count = pynvml.nvmlDeviceGetCount()
            except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
                self._state, self._reason = "unavailable", f"NVML: {exc}"
                log.debug("NVML not available: %s", exc)
                return False
            self._nv = pynvml
            self._state = "ok" if count > 0 else "unavailable"
            if count == 0:
                self._reason = "NVML sees no GPU"
            return self._state == "ok"

    @property
    def reason(self) -> str | None:
        """Why :meth:`available` is False (for messages)."""
        self._init()
        return self._reason

    def _handle(self, index: int) -> Any:
        if not self._init():
            raise NvmlError(f"NVML is not available: {self._reason}")
        h = self._handles.get(index)
        if h is None:
            try:
                h = self._nv.nvmlDeviceGetHandleByIndex(index)
            except Exception as exc:  # noqa: BLE001 - any NVML error: NvmlError
                raise NvmlError(f"no GPU with NVML index {index}: {exc}") from None
            self._handles[index] = h
        return h

    def _try(self, fn: Any, *args: Any) -> Any:
        """Call an NVML function that some boards do not support; None on any NVML error."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - unsupported on this board: None
            log.debug("NVML %s failed: %s", getattr(fn, "__name__", fn), exc)
            return None

    # -- Nvml ---------------------------------------------------------------------------------
    def available(self) -> bool:
        return self._init()

    def driver_version(self) -> str | None:
        if not self._init():
            return None
        v = self._try(self._nv.nvmlSystemGetDriverVersion)
        return _text(v) if v is not None else None

    def cuda_driver_version(self) -> tuple[int, int] | None:
        if not self._init():
            return None
        fn = getattr(self._nv, "nvmlSystemGetCudaDriverVersion_v2", None) or \
            self._nv.nvmlSystemGetCudaDriverVersion
        v = self._try(fn)
        if not v:
            return None
        return int(v) // 1000, (int(v) % 1000) // 10

    def device_count(self) -> int:
        if not self._init():
            return 0
        return int(self._try(self._nv.nvmlDeviceGetCount) or 0)

    def devices(self) -> list[GpuInfo]:
        out = []
        for i in range(self.device_count()):
            try:
                out.append(self._info(i))
            except NvmlError as exc:  # a device fell off the bus between count and query
                log.warning("skipping GPU %d: %s", i, exc)
        return out

    def _info(self, index: int) -> GpuInfo:
        nv, h, t = self._nv, self._handle(index), self._try
        name = t(nv.nvmlDeviceGetName, h)
        uuid = t(nv.nvmlDeviceGetUUID, h)
        pci = t(nv.nvmlDeviceGetPciInfo, h)
        total, used, free = self._memory_of(h, index)
        cc = t(nv.nvmlDeviceGetCudaComputeCapability, h)
        temp = t(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        power_mw = t(nv.nvmlDeviceGetPowerUsage, h)
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = t(reasons_fn, h)
        ecc = t(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC)
        gen_max_fn = getattr(nv, "nvmlDeviceGetGpuMaxPcieLinkGeneration", None) or \
            nv.nvmlDeviceGetMaxPcieLinkGeneration
        return GpuInfo(
            index=index,
            name=_text(name) if name is not None else "unknown",
            uuid=_text(uuid) if uuid is not None else "",
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            memory_total=total, memory_used=used, memory_free=free,
            compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
            temperature_c=int(temp) if temp is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            throttle_reasons=throttle_names(int(mask)) if mask is not None else (),
            pcie_gen=t(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            pcie_gen_max=t(gen_max_fn, h),
            pcie_width=t(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            pcie_width_max=t(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            ecc_uncorrected=int(ecc) if ecc is not None else None,
            processes=tuple(self._processes_of(h)),
        )

    def _memory_of(self, h: Any, index: int) -> tuple[int, int, int]:
        try:
            m = self._nv.nvmlDeviceGetMemoryInfo(h)
        except Exception as exc:  # noqa: BLE001 - any NVML error: NvmlError
            raise NvmlError(f"cannot read memory of GPU {index}: {exc}") from None
        return int(m.total), int(m.used), int(m.free)

    def _processes_of(self, h: Any) -> list[GpuProcess]:
        """Compute processes, and CUDA MPS clients (NVML lists those apart: under MPS the compute
        list has the MPS server, and the clients, with their own memory, are in the MPS list)."""
        procs = list(self._try(self._nv.nvmlDeviceGetComputeRunningProcesses, h) or [])
        mps = getattr(self._nv, "nvmlDeviceGetMPSComputeRunningProcesses", None)
        if mps is not None:
            seen = {int(p.pid) for p in procs}
            procs += [p for p in self._try(mps, h) or [] if int(p.pid) not in seen]
        out = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            # NVML_VALUE_NOT_AVAILABLE (2**64-1) where the driver cannot account per process
            if used is not None and (used < 0 or used >= 2**63):
                used = None
            out.append(GpuProcess(pid=int(p.pid),
                                  used_bytes=int(used) if used is not None else None))
        return out

    def memory(self, index: int) -> tuple[int, int, int]:
        return self._memory_of(self._handle(index), index)

    def processes(self, index: int) -> list[GpuProcess]:
        try:
            h = self._handle(index)
        except NvmlError:
            return []
        return self._processes_of(h)

    # -- extension (not part of the Protocol): used by ``stress`` for the clock trend ---------
    def sm_clock_mhz(self, index: int) -> int | None:
        try:
            h = self._handle(index)
        except NvmlError:
            return None
        v = self._try(self._nv.nvmlDeviceGetClockInfo, h, self._nv.NVML_CLOCK_SM)
        return int(v) if v is not None else None

    # -- extension: used by the guard for a job's share of the GPU ------------------------------
    def process_sm_util(self, index: int, since_us: int) -> tuple[dict[int, float], int] | None:
        """pid -> mean SM utilisation (percent) over the driver's per-process samples newer than
        ``since_us`` (its clock, microseconds), and the newest sample's time; None where the driver
        gives no per-process samples."""
        try:
            h = self._handle(index)
            samples = self._nv.nvmlDeviceGetProcessUtilization(h, since_us)
        except NvmlError:
            return None
        except Exception as exc:  # noqa: BLE001 NVMLError; NOT_FOUND = no sample since then
            if getattr(exc, "value", None) == getattr(self._nv, "NVML_ERROR_NOT_FOUND", -1):
                return {}, since_us
            log.debug("NVML process utilisation: %s", exc)
            return None
        sums: dict[int, list[float]] = {}
        newest = since_us
        for smp in samples:
            sums.setdefault(int(smp.pid), []).append(float(smp.smUtil))
            newest = max(newest, int(smp.timeStamp))
        return {pid: sum(v) / len(v) for pid, v in sums.items()}, newest


_real: _RealNvml | None = None
_real_lock = threading.Lock()


def real_nvml() -> Nvml:
    """The process-wide pynvml-backed :class:`Nvml`. Never raises: on a machine without a
    driver, without pynvml or without a GPU, ``available()`` is False."""
    global _real
    with _real_lock:
        if _real is None:
            _real = _RealNvml()
        return _real


class SimulatedNvml:
    """An :class:`Nvml` answering from a list of :class:`GpuInfo`.

    Tests and the guard's simulated memory source mutate it (thread-safe):
    :meth:`set_memory_used`, :meth:`add_process`, :meth:`remove_process`, :meth:`update`.
    With no GPUs, or ``driver_version=None``, it behaves like a machine without a driver.
    """

    def __init__(self, gpus: list[GpuInfo] | None = None, *,
                 driver_version: str | None = "550.54.15",
                 cuda_driver_version: tuple[int, int] | None = (12, 4),
                 sm_clock_mhz: int | None = 1980) -> None:
        self._lock = threading.Lock()
        self._gpus = [dataclasses.replace(g, index=i) for i, g in enumerate(gpus or [])]
        self._driver = driver_version
        self._cuda = cuda_driver_version
        self._clock = sm_clock_mhz

    def available(self) -> bool:
        return self._driver is not None and bool(self._gpus)

    @property
    def reason(self) -> str | None:
        if self._driver is None:
            return "NVML: driver not loaded (simulated)"
        return None if self._gpus else "NVML sees no GPU (simulated)"

    def driver_version(self) -> str | None:
        return self._driver

    def cuda_driver_version(self) -> tuple[int, int] | None:
        return self._cuda if self._driver is not None else None

    def devices(self) -> list[GpuInfo]:
        if self._driver is None:
            return []
        with self._lock:
            return list(self._gpus)

    def _get(self, index: int) -> GpuInfo:
        if not self.available():
            raise NvmlError("NVML is not available (simulated)")
        if not 0 <= index < len(self._gpus):
            raise NvmlError(f"no GPU with NVML index {index} (simulated: {len(self._gpus)} GPUs)")
        return self._gpus[index]

    def memory(self, index: int) -> tuple[int, int, int]:
        with self._lock:
            g = self._get(index)
            return g.memory_total, g.memory_used, g.memory_free

    def processes(self, index: int) -> list[GpuProcess]:
        with self._lock:
            try:
                return list(self._get(index).processes)
            except NvmlError:
                return []

    def sm_clock_mhz(self, index: int) -> int | None:
        return self._clock

    # -- mutation -----------------------------------------------------------------------------
    def update(self, index: int, **changes: Any) -> GpuInfo:
        """Replace fields of GPU ``index`` (e.g. ``temperature_c=91``)."""
        with self._lock:
            g = dataclasses.replace(self._get(index), **changes)
            self._gpus[index] = g
            return g

    def set_memory_used(self, index: int, used: int) -> None:
        with self._lock:
            g = self._get(index)
            used = max(0, min(int(used), g.memory_total))
            self._gpus[index] = dataclasses.replace(
                g, memory_used=used, memory_free=g.memory_total - used)

    def add_process(self, index: int, pid: int, used_bytes: int | None = None) -> None:
        """A process opens a context on GPU ``index``; its memory counts as used."""
        with self._lock:
            g = self._get(index)
            procs = tuple(p for p in g.processes if p.pid != pid) + (GpuProcess(pid, used_bytes),)
            used = min(g.memory_total, g.memory_used + (used_bytes or 0))
            self._gpus[index] = dataclasses.replace(
                g, processes=procs, memory_used=used, memory_free=g.memory_total - used)

    def remove_process(self, index: int, pid: int) -> None:
        with self._lock:
            g = self._get(index)
            gone = [p for p in g.processes if p.pid == pid]
            freed = sum(p.used_bytes or 0 for p in gone)
            used = max(0, g.memory_used - freed)
            self._gpus[index] = dataclasses.replace(
                g, processes=tuple(p for p in g.processes if p.pid != pid),
                memory_used=used, memory_free=g.memory_total - used)


GIB = 1024**3


def simulated_gpu(index: int = 0, *, name: str = "NVIDIA H200",
                  memory_total: int = 141 * GIB, memory_used: int = 1 * GIB,
                  compute_capability: tuple[int, int] | None = (9, 0), **overrides: Any) -> GpuInfo:
    """A healthy simulated GPU; override any field. UUID and bus id derive from ``index``."""
    fields: dict[str, Any] = {
        "index": index, "name": name,
        "uuid": f"GPU-{index:08x}-1111-2222-3333-{index:012x}",
        "pci_bus_id": f"00000000:{(0x17 + 0x10 * index) & 0xFF:02X}:00.0",
        "memory_total": memory_total, "memory_used": memory_used,
        "memory_free": memory_total - memory_used,
        "compute_capability": compute_capability, "temperature_c": 45, "power_w": 110.0,
        "throttle_reasons": (), "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16,
        "pcie_width_max": 16, "ecc_uncorrected": 0, "processes": (),
    }
    fields.update(overrides)
    if "memory_free" not in overrides:
        fields["memory_free"] = fields["memory_total"] - fields["memory_used"]
    return GpuInfo(**fields)
