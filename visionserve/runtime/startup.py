"""The serving process's start-up: interpreter settings, pinning the device, loading the models
(and the exit code when that fails), and holding on an error instead of exiting into a restart
loop."""

from __future__ import annotations

import gc
import logging
import sys

from ..config import ServerSettings
from ..errors import VisionServeError

log = logging.getLogger("visionserve")


def apply_process_settings(settings: ServerSettings) -> None:
    """Interpreter settings of the serving process (the one with the runner threads)."""
    sys.setswitchinterval(settings.serving_switch_interval_s())
    raise_fd_limit(settings.max_connections or 0)


def raise_fd_limit(connections: int) -> None:
    """Every HTTP connection holds a file descriptor, and many systems start a process with 1,024:
    raise the soft limit to the hard one (front-end processes inherit it), and say so when that is
    still short of ``max_connections`` plus what the server itself keeps open."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft < connections + 256:
        log.warning("only %d file descriptors (RLIMIT_NOFILE) for max_connections %d: past "
                    "about %d connections new ones fail; raise it (ulimit -n, systemd "
                    "LimitNOFILE, docker --ulimit nofile) or lower --max-connections", soft,
                    connections, soft - 256)


def pin_device(spec: str):
    """Resolve the device and pin this process to it before any CUDA library loads.

    Returns the ResolvedDevice; its ``torch_device`` (``cpu`` or ``cuda:0``, the one visible GPU)
    is what the backends use.
    """
    from ..gpu import device as gpu_device
    from ..gpu.nvml import real_nvml

    nvml = real_nvml()
    resolved = gpu_device.resolve(gpu_device.parse_device(spec), nvml)
    if resolved.kind == "cuda":
        from ..extras import gpu_without_torch

        resolved = gpu_without_torch(resolved, lambda: gpu_device.resolve("cpu", nvml))
    gpu_device.pin_environment(resolved)
    log.info("device: %s", gpu_device.describe(resolved))
    return resolved


async def start_engine(engine) -> int:
    """Load and warm up every model; 0 when ready, else the exit code (3), the reason logged."""
    try:
        await engine.start()
    except VisionServeError as exc:
        log.error("start-up failed: %s", exc.message)
    except Exception:
        log.exception("start-up failed")
    else:
        # what start-up made (modules, models) lives as long as the process: out of the garbage
        # collector's way, so that its full collections, which paused the event loop for 30-70 ms
        # under load, walk only what serving allocates
        gc.freeze()
        return 0
    return 3


def hold(code: int) -> int:
    """Stay up, serving nothing, until SIGTERM/SIGINT; then ``code``. Under a restart policy an
    exit would restart into the same error again and again (a crash loop that buries the reason);
    held, the container shows unhealthy and its log holds the reason once."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(60):
        pass
    return code
