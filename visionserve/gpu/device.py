"""Which device the server runs on, and pinning it before any CUDA library initialises.

The server takes one device, named by ``auto``, ``cpu``, ``cuda``, ``cuda:N``, a GPU UUID or a
PCI bus id. :func:`resolve` maps that name to one physical GPU through NVML (which sees every GPU
and never creates a CUDA context) and :func:`pin_environment` then exposes only that GPU to CUDA:
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES=<uuid>``. The UUID is used because it
means the same card whatever the enumeration order; inside the process the card is ``cuda:0``.

This must happen before torch or onnxruntime are imported: the CUDA runtime reads the variables
once, at initialisation, and a framework that touches CUDA early otherwise opens a context on
physical GPU 0 (the "stray context on GPU 0" of the field notes).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError, InternalError
from .nvml import GpuInfo, Nvml

ACCEPTED_FORMS = ("auto, cpu, cuda, cuda:N (the N-th visible GPU in PCI bus order), "
                  "a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as `nvidia-smi -L` "
                  "shows) or a PCI bus id (0000:17:00.0 or 17:00.0)")

# Modules that initialise (or may initialise) CUDA; once one is imported, pinning is too late.
CUDA_MODULES = ("torch", "onnxruntime", "tensorflow", "jax", "cupy")

_INDEX_RE = re.compile(r"^(?:cuda:)?(\d+)$")
_UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}(?:-[0-9a-f]{1,})*$", re.IGNORECASE)
_PCI_RE = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])$",
                     re.IGNORECASE)


class PinningError(InternalError):
    """Pinning was attempted after a CUDA library had been imported."""


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device name. ``kind`` says which of the other fields is set."""

    kind: Literal["auto", "cpu", "cuda", "index", "uuid", "pci"]
    text: str
    index: int | None = None
    uuid: str | None = None  # upper-case "GPU-" + lower-case hex, possibly a unique prefix
    pci: tuple[int, int, int, int] | None = None  # (domain, bus, device, function)


def parse_device(spec: str) -> DeviceSpec:
    """Parse a device name; :class:`ConfigError` names the bad value and the accepted forms."""
    if not isinstance(spec, str):
        raise ConfigError(f"device: expected a string, got {spec!r}; accepted: {ACCEPTED_FORMS}")
    text = spec.strip()
    low = text.lower()
    if low in ("auto", "cpu", "cuda"):
        return DeviceSpec(kind=low, text=text)  # type: ignore[arg-type]
    m = _INDEX_RE.match(low)
    if m:
        return DeviceSpec(kind="index", text=text, index=int(m.group(1)))
    if low.startswith("mig-"):
        raise ConfigError(
            f"device {text!r}: MIG instances are not supported; pin a whole GPU (its GPU-... UUID, "
            "`nvidia-smi -L`) or disable MIG mode (`nvidia-smi -i N -mig 0`)")
    if _UUID_RE.match(text):
        return DeviceSpec(kind="uuid", text=text, uuid="GPU-" + low[4:])
    m = _PCI_RE.match(low)
    if m:
        dom = int(m.group(1), 16) if m.group(1) else 0
        return DeviceSpec(kind="pci", text=text,
                          pci=(dom, int(m.group(2), 16), int(m.group(3), 16), int(m.group(4))))
    raise ConfigError(f"device {text!r} is not a device name; accepted: {ACCEPTED_FORMS}")


def parse_bus_id(bus_id: str) -> tuple[int, int, int, int] | None:
    """``"00000000:17:00.0"`` -> (0, 0x17, 0, 0); None if it is not a bus id."""
    m = _PCI_RE.match(bus_id.strip())
    if not m:
        return None
    dom = int(m.group(1), 16) if m.group(1) else 0
    return dom, int(m.group(2), 16), int(m.group(3), 16), int(m.group(4))


# -- CUDA_VISIBLE_DEVICES ------------------------------------------------------------------------

@dataclass(frozen=True)
class Visibility:
    """What CUDA will see, given NVML's devices and ``CUDA_VISIBLE_DEVICES``."""

    devices: tuple[GpuInfo, ...]  # in CUDA order (the order of the variable's entries)
    raw: str | None  # the variable's value; None = unset
    problems: tuple[str, ...] = ()  # entries CUDA ignores, with why

    @property
    def masked(self) -> bool:
        return self.raw is not None


def visible_devices(devices: Sequence[GpuInfo], cuda_visible_devices: str | None) -> Visibility:
    """Apply CUDA's rules for ``CUDA_VISIBLE_DEVICES`` to NVML's device list.

    Entries are integer indices (PCI bus order, assuming ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) or
    UUIDs / unique UUID prefixes. Like the CUDA runtime, enumeration stops at the first entry that
    names no device (or repeats one): that entry and everything after it are ignored.
    """
    if cuda_visible_devices is None:
        return Visibility(devices=tuple(devices), raw=None)
    out: list[GpuInfo] = []
    problems: list[str] = []
    entries = [e.strip() for e in cuda_visible_devices.split(",")]
    if entries == [""]:
        return Visibility(devices=(), raw=cuda_visible_devices)
    for pos, entry in enumerate(entries):
        found: GpuInfo | None = None
        why = ""
        if re.fullmatch(r"-?\d+", entry):
            i = int(entry)
            if i < 0:
                why = "a negative index hides this and every later entry"
            elif i >= len(devices):
                why = f"there is no GPU {i} (the driver sees {len(devices)})"
            else:
                found = devices[i]
        elif entry.upper().startswith("GPU-"):
            hits = [d for d in devices if d.uuid.lower().startswith(entry.lower())]
            if len(hits) == 1:
                found = hits[0]
            else:
                why = "no GPU has this UUID" if not hits else "this UUID prefix is ambiguous"
        elif entry.upper().startswith("MIG-"):
            why = "MIG instances are not supported by visionserve"
        else:
            why = "not an index or a GPU-... UUID"
        if found is not None and found in out:
            found, why = None, "the same GPU is listed twice"
        if found is None:
            rest = entries[pos + 1:]
            problems.append(f"entry {entry!r}: {why}; CUDA ignores it"
                            + (f" and the entries after it ({','.join(rest)})" if rest else ""))
            break
        out.append(found)
    return Visibility(devices=tuple(out), raw=cuda_visible_devices, problems=tuple(problems))


def format_gpu(g: GpuInfo) -> str:
    """``NVML index 1: NVIDIA H200 GPU-... bus 00000000:27:00.0``"""
    return f"NVML index {g.index}: {g.name} {g.uuid} bus {g.pci_bus_id}"


def _format_list(gpus: Sequence[GpuInfo]) -> str:
    return "; ".join(format_gpu(g) for g in gpus) if gpus else "none"


# -- resolving ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResolvedDevice:
    kind: Literal["cpu", "cuda"]
    gpu: GpuInfo | None  # the physical GPU (NVML view) when kind == "cuda"
    cuda_visible_devices: str | None  # value to export; None = leave the variable alone
    spec: str = "auto"
    note: str = ""  # why cpu was chosen, for the log line

    @property
    def torch_device(self) -> str:
        """The device name inside the pinned process: the pinned GPU is always ``cuda:0``."""
        return "cuda:0" if self.kind == "cuda" else "cpu"


def resolve(spec: str | DeviceSpec, nvml: Nvml,
            environ: Mapping[str, str] | None = None) -> ResolvedDevice:
    """Map a device name to a physical GPU (or the CPU); :class:`ConfigError` when it names a
    GPU that does not exist or is hidden, with the visible GPUs listed."""
    ds = spec if isinstance(spec, DeviceSpec) else parse_device(spec)
    env = os.environ if environ is None else environ
    gpus = tuple(nvml.devices()) if nvml.available() else ()
    vis = visible_devices(gpus, env.get("CUDA_VISIBLE_DEVICES"))
    visible = vis.devices
    # Hide every GPU from a CPU server, so that no library grabs one behind its back.
    cpu_mask = "" if gpus else None

    def cpu(note: str) -> ResolvedDevice:
        return ResolvedDevice(kind="cpu", gpu=None, cuda_visible_devices=cpu_mask, spec=ds.text,
                              note=note)

    def cuda(g: GpuInfo) -> ResolvedDevice:
        return ResolvedDevice(kind="cuda", gpu=g, cuda_visible_devices=g.uuid, spec=ds.text)

    def what_is_visible() -> str:
        if not gpus:
            reason = getattr(nvml, "reason", None)
            return "NVML sees no GPU" + (f" ({reason})" if reason else "")
        listed = "; ".join(f"cuda:{i} = {format_gpu(g)}" for i, g in enumerate(visible))
        text = f"visible GPUs: {listed or 'none'}"
        if vis.masked:
            text += f" (CUDA_VISIBLE_DEVICES={vis.raw!r}; the driver sees {_format_list(gpus)})"
        return text

    if ds.kind == "cpu":
        return cpu("device = cpu")
    if ds.kind == "auto":
        if visible:
            return cuda(visible[0])
        return cpu("device = auto and " + (what_is_visible() if gpus else "no GPU found"))
    if ds.kind == "cuda":
        if visible:
            return cuda(visible[0])
        raise ConfigError(f"device {ds.text!r}: no CUDA GPU is visible; {what_is_visible()}")
    if ds.kind == "index":
        assert ds.index is not None
        if ds.index < len(visible):
            return cuda(visible[ds.index])
        raise ConfigError(f"device {ds.text!r}: there is no visible GPU {ds.index}; "
                          f"{what_is_visible()}")
    if ds.kind == "uuid":
        assert ds.uuid is not None
        hits = [g for g in gpus if g.uuid.lower().startswith(ds.uuid.lower())]
        if len(hits) > 1:
            raise ConfigError(f"device {ds.text!r}: this UUID prefix matches several GPUs: "
                              f"{_format_list(hits)}")
        target = hits[0] if hits else None
    else:
        target = next((g for g in gpus if parse_bus_id(g.pci_bus_id) == ds.pci), None)
    if target is None:
        raise ConfigError(f"device {ds.text!r}: no such GPU; {what_is_visible()}")
    if target not in visible:
        raise ConfigError(f"device {ds.text!r} ({format_gpu(target)}) is hidden by "
                          f"CUDA_VISIBLE_DEVICES={vis.raw!r}; {what_is_visible()}")
    return cuda(target)


# -- pinning -----------------------------------------------------------------------------------

def pin_environment(resolved: ResolvedDevice,
                    environ: MutableMapping[str, str] | None = None,
                    modules: Mapping[str, object] | None = None) -> None:
    """Expose only the resolved GPU to CUDA (or no GPU for a CPU server).

    Raises :class:`PinningError` if a CUDA library is already imported: its runtime may already
    have read the variables, and setting them now would change nothing.
    """
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    loaded = [m for m in CUDA_MODULES if m in mods]
    if loaded:
        raise PinningError(
            f"cannot pin device {resolved.spec!r}: {', '.join(loaded)} is already imported, and "
            "CUDA reads CUDA_VISIBLE_DEVICES only once, when it initialises. Pin the device "
            "before importing torch/onnxruntime (visionserve serve does this first), or start "
            "the process with CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES="
            f"{resolved.cuda_visible_devices or ''} set.")
    if resolved.kind == "cuda":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if resolved.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = resolved.cuda_visible_devices


def check_contexts(resolved: ResolvedDevice, nvml: Nvml, pid: int | None = None) -> list[str]:
    """Problems: this process holds a CUDA context on a GPU other than the pinned one.

    In a container without the host's PID namespace NVML reports host PIDs, so finding nothing
    there proves nothing; finding something is always real.
    """
    pid = os.getpid() if pid is None else pid
    if not nvml.available():
        return []
    pinned_uuid = resolved.gpu.uuid if resolved.gpu is not None else None
    target = format_gpu(resolved.gpu) if resolved.gpu is not None else "the CPU"
    problems = []
    for g in nvml.devices():
        if g.uuid == pinned_uuid:
            continue
        mine = [p for p in nvml.processes(g.index) if p.pid == pid]
        for p in mine:
            used = f", {p.used_bytes / 2**20:.0f} MiB" if p.used_bytes else ""
            problems.append(
                f"process {pid} holds a CUDA context on GPU {format_gpu(g)}{used} although it is "
                f"pinned to {target}: something initialised CUDA before CUDA_VISIBLE_DEVICES "
                "was set (import order), or code names a device explicitly")
    return problems


def describe(resolved: ResolvedDevice) -> str:
    """One line for the start-up log."""
    if resolved.kind == "cpu":
        return f"device cpu ({resolved.note})" if resolved.note else "device cpu"
    g = resolved.gpu
    assert g is not None
    gib = 1024**3
    cc = f", compute capability {g.compute_capability[0]}.{g.compute_capability[1]}" \
        if g.compute_capability else ""
    return (f"device cuda:0 = {g.name} {g.uuid}, bus {g.pci_bus_id}, NVML index {g.index}, "
            f"memory {g.memory_total / gib:.1f} GiB total / {g.memory_free / gib:.1f} GiB free"
            f"{cc} (requested {resolved.spec!r})")
