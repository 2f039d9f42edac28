"""torch's and onnxruntime's build facts, asked in a child interpreter.

``visionserve env`` and ``doctor`` report them without importing either framework into their own
process: the child imports one framework, prints its facts as JSON and exits. A command that
only diagnoses stays light, and an install that crashes or hangs on import is a line of the
report ("import failed: ..."), not the end of it.

This file is also the child's program (``python frameworks.py torch``), so it imports nothing of
visionserve: it runs the same from a source checkout and from an installed wheel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from typing import Any

#: how long a framework's import may take in the child (a cold torch import on a slow disk
#: takes tens of seconds)
TIMEOUT_S = 180.0


@cache
def framework_info(name: str) -> dict[str, Any] | None:
    """The facts of ``name`` ("torch" or "onnxruntime"), from a child interpreter; None if it is
    not installed, ``{"error": ...}`` if it cannot be imported."""
    try:
        run = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True,
                             timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"import failed: no answer within {TIMEOUT_S:g} s"}
    except OSError as exc:
        return {"error": f"import failed: cannot start {sys.executable}: {exc}"}
    if run.returncode != 0 or not run.stdout.strip():
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"import failed: the interpreter exited with {run.returncode}: {last}"}
    return json.loads(run.stdout)


# -- in the child --------------------------------------------------------------------------------

def _torch() -> dict[str, Any] | None:
    """torch build facts. Initialises no CUDA context: only ``torch.cuda.is_available()`` and
    build information are queried."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install (missing libs)
        return None if isinstance(exc, ModuleNotFoundError) else {"error": f"import failed: {exc}"}
    info: dict[str, Any] = {"version": torch.__version__, "cuda_runtime": torch.version.cuda}
    try:
        cudnn = torch.backends.cudnn
        info["cudnn"] = cudnn.version() if cudnn.is_available() else None
    except Exception as exc:  # noqa: BLE001 - a fact we could not get is a fact of the report
        info["cudnn"] = None
        info["cudnn_error"] = str(exc)
    try:
        info["arch_list"] = list(torch.cuda.get_arch_list())
    except Exception:  # noqa: BLE001
        info["arch_list"] = []
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        info["device_count"] = int(torch.cuda.device_count()) if info["cuda_available"] else 0
    except Exception as exc:  # noqa: BLE001
        info["cuda_available"] = False
        info["device_count"] = 0
        info["cuda_error"] = str(exc)
    return info


def _onnxruntime() -> dict[str, Any] | None:
    try:
        import onnxruntime as ort
    except Exception as exc:  # noqa: BLE001
        return None if isinstance(exc, ModuleNotFoundError) else {"error": f"import failed: {exc}"}
    info: dict[str, Any] = {"version": ort.__version__,
                            "providers": list(ort.get_available_providers())}
    try:
        from onnxruntime.capi import build_and_package_info as b
        info["package"] = getattr(b, "package_name", None)
        info["cuda_version"] = getattr(b, "cuda_version", None)
    except Exception:  # noqa: BLE001
        info["package"] = info["cuda_version"] = None
    return info


if __name__ == "__main__":
    json.dump({"torch": _torch, "onnxruntime": _onnxruntime}[sys.argv[1]](), sys.stdout)
