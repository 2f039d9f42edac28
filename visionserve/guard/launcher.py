"""Starting one job: its environment (device pinning, memory caps), its process group, its log.

What the job sees is documented in ``docs/guard.md``; in short:

- ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES=<the guarded GPU's UUID>`` (a job
  that declared no GPU memory gets ``CUDA_VISIBLE_DEVICES=""``: no GPU at all);
- ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the job sets its own;
- ``VISIONSERVE_GUARD_JOB_ID``, ``VISIONSERVE_GPU_MEM_LIMIT`` (declared need, bytes),
  ``VISIONSERVE_GUARD_ALLOCATOR_CAP`` (bytes) and ``VISIONSERVE_GPU_MEM_FRACTION`` (cap / total);
- a ``sitecustomize.py`` directory first on ``PYTHONPATH``: when the job imports torch it queues
  ``torch.cuda.set_per_process_memory_fraction(fraction)`` to run at CUDA initialisation
  (PyTorch has no environment variable for it), and, when the guard publishes the server's busy
  word (``VISIONSERVE_GUARD_SHARE``), installs cooperative yielding (:mod:`.yieldhook`, copied
  there as ``visionserve_guard_yield.py``). It chains to any other ``sitecustomize``;
- with a busy word: ``VISIONSERVE_GUARD_SHARE``, ``VISIONSERVE_GUARD_YIELD_STATS`` (the job's
  ``<log>.yield``) and the hook's settings ``VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS`` / ``_MIN_SHARE``
  / ``_QUEUE_MS`` / ``_DEPTH`` / ``_MODE`` (the job's own values win). A job that sets
  ``VISIONSERVE_GUARD_YIELD=0`` gets none of them and is handled by the process-level policies
  only.
- with CUDA MPS (``serve --guard-mps``, :mod:`.mps`): ``CUDA_MPS_PIPE_DIRECTORY`` /
  ``CUDA_MPS_LOG_DIRECTORY`` of the server's daemon, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
  ``CUDA_MPS_CLIENT_PRIORITY=1`` (the job's own values of those two win), its declared memory as
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (always the guard's), and no busy word.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from . import mps, proc
from .store import Job

log = logging.getLogger(__name__)

JOBWRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobwrap.py")
YIELDHOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "yieldhook.py")
YIELD_MODULE = "visionserve_guard_yield"

SITECUSTOMIZE = '''\
# Written by `visionserve guard`: caps PyTorch's CUDA caching allocator for guard jobs.
# PyTorch has no environment variable for set_per_process_memory_fraction, so this hook runs
# it when torch is imported, queued to CUDA's lazy initialisation (no context is created here).
# With VISIONSERVE_GUARD_SHARE it also installs cooperative yielding (visionserve_guard_yield.py).
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


def _cap(torch):
    frac = os.environ.get("VISIONSERVE_GPU_MEM_FRACTION")
    if not frac:
        return
    try:
        fraction = min(1.0, max(0.0, float(frac)))
    except ValueError:
        return

    def apply():
        torch.cuda.set_per_process_memory_fraction(fraction)

    try:
        lazy = getattr(torch.cuda, "_lazy_call", None)
        if lazy is not None:
            lazy(apply)
        elif torch.cuda.is_initialized():
            apply()
    except Exception as exc:
        sys.stderr.write("visionserve guard: could not cap the CUDA allocator: %s\\n" % exc)


def _yield(torch):
    if not os.environ.get("VISIONSERVE_GUARD_SHARE"):
        return
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(
            "visionserve_guard_yield", os.path.join(here, "visionserve_guard_yield.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["visionserve_guard_yield"] = module
        spec.loader.exec_module(module)
        module.install(torch)
    except Exception as exc:
        sys.stderr.write("visionserve guard: cooperative yielding not installed: %s\\n" % exc)


class _TorchHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # one shot
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _cap(module)
            _yield(module)

        loader.exec_module = exec_module
        return spec


if "torch" in sys.modules:
    _cap(sys.modules["torch"])
    _yield(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _TorchHook())


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


try:
    _chain()
except Exception as exc:
    sys.stderr.write("visionserve guard: the other sitecustomize failed: %s\\n" % exc)
'''


@dataclass(frozen=True)
class LaunchSettings:
    #: GPU UUID for CUDA_VISIBLE_DEVICES; None: no GPU known (serial-queue mode), not set
    gpu_uuid: str | None
    #: total memory of the device, for the fraction; None without a GPU
    gpu_total: int | None
    #: CUDA context + library workspaces NVML counts but the allocator cap does not
    context_reserve: int = 768 * 1024**2
    nice: int = 10
    #: SCHED_IDLE for the job: it runs on CPU time nothing else wants
    sched_idle: bool = True
    site_dir: str = ""
    #: CPUs the job may run on (``sched_setaffinity``), e.g. "4-15"; "": all
    cpus: str = ""
    #: the server's busy word (:mod:`.share`); "": no cooperative yielding
    share_path: str = ""
    yield_max_wait_ms: float = 50.0
    yield_min_share: float = 0.3
    yield_depth: int = 16
    yield_queue_ms: float = 2.0
    yield_mode: str = "wait"
    #: CUDA MPS (:mod:`.mps`): the daemon's pipe and log directories; "": jobs are no MPS clients
    mps_pipe_dir: str = ""
    mps_log_dir: str = ""
    mps_job_sm_percent: int = 50


def write_site_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, "sitecustomize.py")
    tmp = target + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(SITECUSTOMIZE)
    os.replace(tmp, target)
    hook = os.path.join(path, YIELD_MODULE + ".py")
    shutil.copyfile(YIELDHOOK, hook + ".tmp")
    os.replace(hook + ".tmp", hook)
    return path


def yield_stats_path(job: Job) -> str:
    """Where the job's yield hook writes its statistics (:func:`.share.read_stats`)."""
    return f"{job.log_path}.yield"


def allocator_cap(need: int, reserve: int) -> int:
    """Bytes the job's torch allocator may hold: the declared need minus what NVML will also count
    for the CUDA context, so a well-behaved job gets a catchable OOM from its own allocator before
    the watchdog sees it over its declaration. Never below half the need."""
    return max(need - reserve, need // 2)


def job_env(job: Job, s: LaunchSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(job.env)
    env["VISIONSERVE_GUARD_JOB_ID"] = str(job.id)
    env["VISIONSERVE_GUARD_POLICY"] = job.policy
    env["VISIONSERVE_GPU_MEM_LIMIT"] = str(job.gpu_mem)
    if s.gpu_uuid is not None:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # a job that declared no GPU memory gets no GPU: any CUDA use would be over its need
        env["CUDA_VISIBLE_DEVICES"] = s.gpu_uuid if job.gpu_mem > 0 else ""
        if job.gpu_mem > 0 and s.gpu_total:
            cap = allocator_cap(job.gpu_mem, s.context_reserve)
            env["VISIONSERVE_GUARD_ALLOCATOR_CAP"] = str(cap)
            env["VISIONSERVE_GPU_MEM_FRACTION"] = f"{cap / s.gpu_total:.6f}"
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for key in ("VISIONSERVE_GUARD_SHARE", "VISIONSERVE_GUARD_YIELD_STATS"):
        if key not in job.env:  # the guard's to give, not inherited from the supervisor's env
            env.pop(key, None)
    mps.job_env(env, job.env, s.mps_pipe_dir, s.mps_log_dir, s.mps_job_sm_percent, job.gpu_mem)
    # under MPS the job's kernels run beside the server's: no waiting for batches
    if s.share_path and not s.mps_pipe_dir and env.get("VISIONSERVE_GUARD_YIELD") != "0":
        env["VISIONSERVE_GUARD_SHARE"] = s.share_path
        if job.log_path:
            env["VISIONSERVE_GUARD_YIELD_STATS"] = yield_stats_path(job)
        env.setdefault("VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS", f"{s.yield_max_wait_ms:g}")
        env.setdefault("VISIONSERVE_GUARD_YIELD_MIN_SHARE", f"{s.yield_min_share:g}")
        env.setdefault("VISIONSERVE_GUARD_YIELD_DEPTH", str(s.yield_depth))
        env.setdefault("VISIONSERVE_GUARD_YIELD_QUEUE_MS", f"{s.yield_queue_ms:g}")
        env.setdefault("VISIONSERVE_GUARD_YIELD_MODE", s.yield_mode)
    if s.site_dir:
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = s.site_dir + (os.pathsep + old if old else "")
    return env


@dataclass
class Launched:
    popen: subprocess.Popen
    pid: int
    starttime: int | None


def launch(job: Job, s: LaunchSettings) -> Launched:
    """Start ``job`` in its own session (pgid = sid = pid of the wrapper), output to its log.
    Raises OSError if it cannot be started (e.g. its working directory vanished)."""
    assert job.log_path and job.status_path
    os.makedirs(os.path.dirname(job.log_path), exist_ok=True)
    try:
        os.unlink(job.status_path)
    except FileNotFoundError:
        pass
    env = job_env(job, s)
    with open(job.log_path, "ab") as logf:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        logf.write(f"[visionserve guard] {stamp} job {job.id} ({job.name}) starting: "
                   f"{' '.join(job.command)}\n".encode())
        logf.flush()
        popen = subprocess.Popen(
            [sys.executable, "-I", JOBWRAP, "--status", job.status_path, "--nice", str(s.nice),
             *(["--sched-idle"] if s.sched_idle else []), *(["--cpus", s.cpus] if s.cpus else []),
             "--", *job.command],
            cwd=job.cwd, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True)
    return Launched(popen, popen.pid, proc.starttime(popen.pid))
