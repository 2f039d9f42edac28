"""CUDA MPS for the hosted guard (``serve --guard --guard-mps``): the server and its training jobs
as clients of one MPS control daemon, so that their kernels run side by side on the GPU instead
of time-slicing it, with each job's share of the SMs capped.

- **The daemon**: the one whose pipe directory ``CUDA_MPS_PIPE_DIRECTORY`` names, if that is set
  and its daemon runs (a site-wide daemon: used, never stopped); else a private one in
  ``/tmp/visionserve-mps-<uid>`` (``pipe``, ``log``), started with ``nvidia-cuda-mps-control -d``
  and the guarded GPU only (``CUDA_VISIBLE_DEVICES``) unless one runs there already (left by a
  server that died), and quit when the server stops.
- **The server** joins it by having ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` in its
  own environment before CUDA is initialised (:func:`start` runs before the engine exists), at
  the normal client priority and with every SM.
- **A job** gets the same directories, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (``--guard-mps-job-
  sm-percent``: the share of SMs its kernels may occupy, so the rest stay free for the server's
  batches) and ``CUDA_MPS_CLIENT_PRIORITY=1`` (below normal: a hint to the MPS server to schedule
  the server's work first). A job's own value of either wins. No yield hook: its kernels need not
  wait for a batch, they only leave it room. Its declared memory is a hard limit
  (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``). Its mechanism is ``mps``.

Where MPS cannot run (no daemon binary, it does not start, no GPU), the guard says why once, and
jobs share the GPU by the other mechanisms (cooperative yielding, then the process-level
policies). Costs and limits are in docs/guard.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
PERCENT_ENV, PRIORITY_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_CLIENT_PRIORITY"
MEM_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
#: CUDA_MPS_CLIENT_PRIORITY: 0 normal (the server), 1 below normal (jobs)
JOB_PRIORITY = 1
START_TIMEOUT_S = 10.0


def private_root() -> str:
    """Short on purpose: the pipe directory holds Unix sockets (108-byte paths)."""
    return f"/tmp/visionserve-mps-{os.getuid()}"


def daemon_pid(pipe_dir: str) -> int | None:
    """The pid of the control daemon serving ``pipe_dir`` if it runs, else None."""
    try:
        with open(os.path.join(pipe_dir, PID_FILE)) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


@dataclass
class Mps:
    """The MPS state of this server: ``active`` when the server is (to be) a client of a running
    daemon; ``reason`` says why not otherwise."""

    pipe_dir: str = ""
    log_dir: str = ""
    job_sm_percent: int = 50
    active: bool = False
    started_here: bool = False  # the server's own (private) daemon: quit when it stops
    reason: str = ""
    daemon: int | None = None
    env_before: dict[str, str | None] = field(default_factory=dict)

    def stop(self) -> None:
        """Quit the daemon if this server started it (a site-wide one is left running), and take
        the server's environment back."""
        if self.started_here and self.daemon is not None:
            env = dict(os.environ, **{PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir})
            try:
                subprocess.run([shutil.which(CONTROL) or CONTROL], input=b"quit\n", env=env,
                               timeout=10, capture_output=True, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("guard: could not quit the MPS control daemon (pid %d): %s",
                            self.daemon, exc)
        for key, value in self.env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.active = self.started_here = False
        self.daemon = None


def job_env(env: dict[str, str], own: dict[str, str], pipe_dir: str, log_dir: str,
            job_sm_percent: int, gpu_mem: int = 0) -> None:
    """Make ``env`` (a job's, built from the server's) that of a client of the daemon in
    ``pipe_dir`` ("": of no daemon, whatever the server's environment says). ``own``: what the
    job asked for; its percentage and priority win. ``gpu_mem``: its declared need, which MPS then
    enforces as a hard limit on its device memory (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, the
    guard's value always): NVML does not list MPS clients reliably everywhere (on the GPU
    machine of 2026-12-03 it did in one run and not in the next), so the watchdog alone is not
    enough."""
    for key in (PIPE_ENV, LOG_ENV, PERCENT_ENV, PRIORITY_ENV):
        if key not in own:
            env.pop(key, None)
    env.pop(MEM_LIMIT_ENV, None)
    if not pipe_dir:
        return
    env[PIPE_ENV], env[LOG_ENV] = pipe_dir, log_dir
    env.setdefault(PERCENT_ENV, str(job_sm_percent))
    env.setdefault(PRIORITY_ENV, str(JOB_PRIORITY))
    if gpu_mem > 0:  # device 0: the job sees only the guarded GPU
        env[MEM_LIMIT_ENV] = f"0={max(1, gpu_mem // 2**20)}M"


def start(job_sm_percent: int, gpu_uuid: str | None, *, root: str | None = None,
          timeout_s: float = START_TIMEOUT_S) -> Mps:
    """Join (or start) an MPS control daemon and make this process a client of it: call before
    anything initialises CUDA here. Never raises: an inactive :class:`Mps` says why."""
    named = os.environ.get(PIPE_ENV)
    if named:
        pipe_dir = named
        log_dir = os.environ.get(LOG_ENV) or os.path.join(os.path.dirname(named), "log")
    else:
        base = root or private_root()
        pipe_dir, log_dir = os.path.join(base, "pipe"), os.path.join(base, "log")
    m = Mps(pipe_dir=pipe_dir, log_dir=log_dir, job_sm_percent=job_sm_percent)
    if gpu_uuid is None:
        m.reason = "no GPU: MPS needs one"
        return m
    m.daemon = daemon_pid(pipe_dir)
    if m.daemon is None:
        binary = shutil.which(CONTROL)
        if binary is None:
            m.reason = f"{CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities)"
            return m
        try:
            os.makedirs(pipe_dir, mode=0o700, exist_ok=True)
            os.makedirs(log_dir, mode=0o700, exist_ok=True)
            env = dict(os.environ, **{PIPE_ENV: pipe_dir, LOG_ENV: log_dir,
                                      "CUDA_VISIBLE_DEVICES": gpu_uuid})
            done = subprocess.run([binary, "-d"], env=env, timeout=timeout_s,
                                  capture_output=True, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            m.reason = f"{CONTROL} -d failed: {exc}"
            return m
        deadline = time.monotonic() + timeout_s
        m.daemon = daemon_pid(pipe_dir)
        while m.daemon is None and time.monotonic() < deadline:
            time.sleep(0.05)
            m.daemon = daemon_pid(pipe_dir)
        if m.daemon is None:
            said = (done.stderr or done.stdout or b"").decode("utf-8", "replace").strip()
            m.reason = (f"{CONTROL} -d exited {done.returncode} and no daemon runs in "
                        f"{pipe_dir}" + (f": {said[:300]}" if said else ""))
            return m
    # a private daemon is the server's to quit, whichever of its runs started it; a named one not
    m.started_here = not named
    m.env_before = {k: os.environ.get(k) for k in (PIPE_ENV, LOG_ENV, PERCENT_ENV, PRIORITY_ENV)}
    os.environ[PIPE_ENV], os.environ[LOG_ENV] = pipe_dir, log_dir
    # the server: every SM, normal priority, whatever the environment it was started with says
    os.environ.pop(PERCENT_ENV, None)
    os.environ[PRIORITY_ENV] = "0"
    m.active = True
    return m
