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


#: on a GPU, front-end processes and batch workers per model instance, chosen from the cores
#: the process may use: a front end reads, parses and answers HTTP for about two cores' worth
#: of clients, and each batch worker prepares and runs batches on about four
FRONTEND_CORES, MAX_FRONTENDS = 2, 8
WORKER_CORES, MAX_WORKERS = 4, 3


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset limits)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_execution(settings: ServerSettings, on_gpu: bool,
                     cores: int | None = None) -> ServerSettings:
    """``settings`` with ``frontends`` and ``gpu_batch_processes`` decided where they were left
    to the server (None): on a GPU, a front-end process per two cores (at most 8) and a batch
    worker per four (at most 3), so that the HTTP parsing and the batches' preparation spread
    over the machine; on the CPU none, the model's own threads use the cores. With ``--guard``
    no batch worker unless named: each holds a CUDA context outside the budget, which the
    guard's margin would have to cover (docs/gpu.md). Logged, with why. A batch worker that does
    not fit the GPU memory budget, or a task that reads its outputs on the device, leaves its
    batches in the serving process (said when the model loads)."""
    if settings.frontends is not None and settings.gpu_batch_processes is not None:
        return settings
    cores = cores or usable_cores()
    frontends = settings.frontends
    workers = settings.gpu_batch_processes
    if frontends is None:
        frontends = min(MAX_FRONTENDS, cores // FRONTEND_CORES) if on_gpu else 0
        frontends = frontends if frontends > 1 else 0  # one front end only adds a hop
    why = f"{cores} cores, {'a GPU' if on_gpu else 'no GPU'}"
    if workers is None:
        workers = min(MAX_WORKERS, cores // WORKER_CORES) if on_gpu and not settings.guard else 0
        if on_gpu and settings.guard:
            why += ", --guard"
    log.info("execution: %s front-end process(es), %s batch worker(s) per model instance (%s; "
             "--frontends and --gpu-batch-processes set them)", frontends, workers, why)
    return settings.model_copy(update={"frontends": frontends, "gpu_batch_processes": workers})


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
