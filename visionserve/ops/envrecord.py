"""Print the environment record: host, packages, CUDA/cuDNN, driver and every GPU.

Keep one with every benchmark and every fault report: most "the model got slower / stopped
working" stories are an environment that changed silently (driver, torch build, a variable).

  visionserve env            human-readable
  visionserve env --json     the same as JSON (what ``bench`` embeds in its report)

Works on a GPU-less machine (it then says "no GPU"). torch and onnxruntime are asked in a child
interpreter, so this process imports neither: a broken install is a line of the record.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import socket
import sys
from collections.abc import Mapping
from typing import Any

from ..gpu.nvml import Nvml, real_nvml
from .frameworks import framework_info

ENV_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES",
            "PYTORCH_CUDA_ALLOC_CONF", "VISIONSERVE_DEVICE", "VISIONSERVE_GPU_MEMORY_BUDGET")

# label -> distributions that provide it (first one installed wins)
# onnxruntime execution providers that need an NVIDIA GPU: onnxruntime-gpu lists them whenever
# they are built in, GPU or not
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")

PACKAGES: dict[str, tuple[str, ...]] = {
    "visionserve": ("visionserve",),
    "torch": ("torch",),
    "torchvision": ("torchvision",),
    "onnxruntime": ("onnxruntime-gpu", "onnxruntime"),
    "opencv": ("opencv-python-headless", "opencv-python", "opencv-contrib-python-headless",
               "opencv-contrib-python"),
    "numpy": ("numpy",),
    "fastapi": ("fastapi",),
    "uvicorn": ("uvicorn",),
    "grpcio": ("grpcio",),
    "pydantic": ("pydantic",),
    "nvidia-ml-py": ("nvidia-ml-py",),
}


def package_versions() -> dict[str, dict[str, str] | None]:
    """Installed versions from package metadata (nothing is imported)."""
    out: dict[str, dict[str, str] | None] = {}
    for label, dists in PACKAGES.items():
        out[label] = None
        for dist in dists:
            try:
                out[label] = {"distribution": dist, "version": md.version(dist)}
                break
            except md.PackageNotFoundError:
                continue
    if out["visionserve"] is None:  # running from a checkout that is not pip-installed
        from .. import __version__
        out["visionserve"] = {"distribution": "visionserve (source tree)", "version": __version__}
    return out


def host_info() -> dict[str, Any]:
    cpu_model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_total = None
    try:
        mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_total": mem_total,
    }


def torch_info() -> dict[str, Any] | None:
    """torch build facts (version, CUDA runtime, cuDNN, arch list, CUDA available); None if torch
    is not installed. Asked in a child interpreter (:mod:`.frameworks`)."""
    return framework_info("torch")


def onnxruntime_info() -> dict[str, Any] | None:
    """onnxruntime's version, package and providers; None if not installed. Asked in a child
    interpreter (:mod:`.frameworks`)."""
    return framework_info("onnxruntime")


def nvidia_info(nvml: Nvml) -> dict[str, Any]:
    available = nvml.available()
    cuda = nvml.cuda_driver_version() if available else None
    reason = None if available else getattr(nvml, "reason", None)
    gpus = [g.to_dict() for g in nvml.devices()] if available else []
    return {
        "available": available,
        "summary": f"{len(gpus)} GPU(s)" if gpus else f"no GPU ({reason or 'NVML not available'})",
        "reason": reason,
        "driver_version": nvml.driver_version() if available else None,
        "cuda_driver_version": f"{cuda[0]}.{cuda[1]}" if cuda else None,
        "gpus": gpus,
    }


def collect(nvml: Nvml | None = None, environ: Mapping[str, str] | None = None,
            *, include_frameworks: bool = True) -> dict[str, Any]:
    """The environment record as a JSON-ready dict.

    ``include_frameworks=False`` skips asking torch/onnxruntime (each costs an interpreter that
    imports it).
    """
    env = os.environ if environ is None else environ
    record: dict[str, Any] = {
        "host": host_info(),
        "packages": package_versions(),
        "torch": torch_info() if include_frameworks else None,
        "onnxruntime": onnxruntime_info() if include_frameworks else None,
        "nvidia": nvidia_info(nvml if nvml is not None else real_nvml()),
        "env": {k: env.get(k) for k in ENV_VARS},
    }
    ort = record["onnxruntime"]
    if ort is not None and "providers" in ort:
        # built in is not usable: without a GPU the CUDA and TensorRT providers cannot run
        gpu = bool(record["nvidia"]["gpus"])
        ort["usable_providers"] = [p for p in ort["providers"] if gpu or p not in GPU_PROVIDERS]
    return record


# -- rendering ---------------------------------------------------------------------------------

def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024**3:.1f} GiB"


def render_text(record: Mapping[str, Any]) -> str:
    h = record["host"]
    lines = [
        f"host      {h['hostname']}  {h['os']}  ({h['machine']})",
        f"kernel    {h['kernel']}",
        f"python    {h['python']}  {h['python_executable']}",
        f"cpu       {h['cpu_count']} x {h['cpu_model'] or '?'}, memory {_gib(h['memory_total'])}",
        "packages  " + ", ".join(
            f"{k} {v['version']}" if v else f"{k} -" for k, v in record["packages"].items()),
    ]
    t = record.get("torch")
    if t is None:
        lines.append("torch     not installed" if "torch" in record else "torch     not queried")
    elif "error" in t:
        lines.append(f"torch     {t['error']}")
    else:
        arch = " ".join(t.get("arch_list") or []) or "-"
        runtime = t["cuda_runtime"] or "- (CPU build)"
        lines.append(f"torch     {t['version']}  CUDA runtime {runtime}"
                     f"  cuDNN {t.get('cudnn') or '-'}  arch {arch}"
                     f"  cuda available: {t.get('cuda_available')}")
    o = record.get("onnxruntime")
    if o is not None and "error" not in o:
        usable = o.get("usable_providers", o["providers"])
        unusable = [p for p in o["providers"] if p not in usable]
        lines.append(f"onnxrt    {o['version']} ({o.get('package') or '?'}, CUDA "
                     f"{o.get('cuda_version') or '-'})  providers {', '.join(usable)}"
                     + (f"  (built in, unusable without a GPU: {', '.join(unusable)})"
                        if unusable else ""))
    elif o is not None:
        lines.append(f"onnxrt    {o['error']}")
    nv = record["nvidia"]
    if not nv["available"]:
        lines.append(f"nvidia    {nv['summary']}")
    else:
        lines.append(f"nvidia    driver {nv['driver_version']}, supports CUDA up to "
                     f"{nv['cuda_driver_version'] or '?'}, {len(nv['gpus'])} GPU(s)")
        for g in nv["gpus"]:
            pcie = (f"PCIe gen {g['pcie_gen']}/{g['pcie_gen_max']} x{g['pcie_width']}/"
                    f"x{g['pcie_width_max']}")
            lines.append(
                f"gpu {g['index']}     {g['name']}  {g['uuid']}  bus {g['pci_bus_id']}  "
                f"cc {g['compute_capability'] or '?'}")
            lines.append(
                f"          memory {_gib(g['memory_used'])} used / {_gib(g['memory_total'])}, "
                f"{g['temperature_c'] if g['temperature_c'] is not None else '?'} C, "
                f"{g['power_w'] if g['power_w'] is not None else '?'} W, {pcie}, "
                f"ECC uncorrected "
                f"{g['ecc_uncorrected'] if g['ecc_uncorrected'] is not None else '-'}, "
                f"throttle {','.join(g['throttle_reasons']) or 'none'}, "
                f"{len(g['processes'])} compute process(es)")
    lines.append("env       " + "  ".join(
        f"{k}={v!r}" if v is not None else f"{k} unset" for k, v in record["env"].items()))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the record as JSON")


def run(args: argparse.Namespace) -> int:
    record = collect()
    if args.json:
        print(json.dumps(record, indent=2, default=str))
    else:
        print(render_text(record))
    return 0
