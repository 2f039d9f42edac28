"""Cooperative yielding inside a PyTorch job the guard launched (stdlib and torch only).

The guard copies this file into the job's ``sitecustomize`` folder; the ``sitecustomize`` there
calls :func:`install` when the job imports torch, if ``VISIONSERVE_GUARD_SHARE`` names the
inference server's busy word (see :mod:`visionserve.guard.share` for its layout). Nothing in the
user's script changes. At fine-grained points of the job's own work:

- before every module's forward (``register_module_forward_pre_hook``),
- when the gradient of a module's output is computed in backward (a hook on that tensor, added by
  a global forward hook),
- before every optimizer step (``register_optimizer_step_pre_hook``),

the hook

1. **waits while the server runs a batch** (the word's ``running`` is non-zero), polling the word
   (50 us, backing off to 1 ms) for at most ``VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS`` (default 50);
   and never more than ``1 - VISIONSERVE_GUARD_YIELD_MIN_SHARE`` (default 0.3) of the recent
   wall time (decaying window of about 2 s), so a line that is always busy slows the job to that
   share but never stops it. A wait cut short by either limit is a *forced pass*;
2. **bounds the GPU work it has queued ahead** (once CUDA is initialised): every point records a
   CUDA event on the current stream; the hook learns the GPU time per point from those events and
   waits (blocking sync, no spinning) for the oldest outstanding one while more than
   ``VISIONSERVE_GUARD_YIELD_QUEUE_MS`` (default 2) of GPU work, and never more than
   ``VISIONSERVE_GUARD_YIELD_DEPTH`` (default 16) points, are queued. Waiting in step 1 stops new
   work from being queued, but what is already queued still runs: this bound is what limits how
   long a batch that arrives can wait for the job. While frames wait for their batch (the word's
   ``busy``) it tightens to a quarter, while a batch runs to one point;
   ``VISIONSERVE_GUARD_YIELD_MODE=bound`` keeps only this bound and never waits in step 1 (more
   training, a batch shares the GPU with one point of the job's work);
3. **holds a duty cycle** when the word carries one (the guard's latency budget, hosted in the
   server): it sleeps at its points so that it runs at most that share of the time;

and counts what it did into ``VISIONSERVE_GUARD_YIELD_STATS`` (a small file the guard reads).
Points inside ``torch.compile`` regions are skipped (no graph breaks), as are forked children
(data-loader workers). Any error disables the hook with one line on stderr; the job goes on.
``VISIONSERVE_GUARD_YIELD=0`` in the job's environment turns it off (the guard's process-level
policies then apply).
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import struct
import sys
import time

WORD_MAGIC = 0x57425356
STATS_MAGIC = 0x53595356
_STATS = struct.Struct("<IIIIQQQQQQQ")
TAU_S = 2.0  # the min-share window (exponential decay)
OWNER_CHECK_S = 1.0
FLUSH_NS = 250_000_000  # statistics written at least this often while points come (and per wait)

_installed = None


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class Yielder:
    def __init__(self, torch, share_path: str, stats_path: str | None = None, *,
                 max_wait_s: float = 0.05, min_share: float = 0.3, depth: int = 16,
                 queue_ms: float = 2.0, mode: str = "wait") -> None:
        self.torch = torch
        fd = os.open(share_path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, 64, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        if struct.unpack_from("<I", mm, 0)[0] != WORD_MAGIC:
            raise ValueError(f"{share_path} is not a visionserve busy word")
        self._mm = mm
        self._word = memoryview(mm).cast("Q")
        self.owner = struct.unpack_from("<I", mm, 24)[0]
        self._owner_alive, self._owner_at = True, 0.0
        self.max_wait = max(0.0, max_wait_s)
        self.min_share = min(1.0, max(0.0, min_share))
        self.depth = max(1, int(depth))
        self.queue_ms = max(0.0, queue_ms)
        #: "wait": wait while a batch runs; "bound": never wait, only keep one point queued then
        self.waits = mode != "bound"
        self.point_ms = 0.25  # GPU time per point, learnt from the events (a guess to start)
        self.pid = os.getpid()
        self.hooks = self.yields = self.forced = self.waited_ns = self.syncs = self.slept_ns = 0
        # decayed wall time, and time waited and slept in it (min share, duty cycle)
        self._span, self._waited, self._slept = TAU_S, 0.0, 0.0
        self._last = time.monotonic()
        self._ring: list | None = None  # CUDA events, created once CUDA is up
        self._done = 0  # marks the GPU is known to have passed (the oldest outstanding one next)
        self._n = 0
        self._off = False  # after an error, and in forked children (data-loader workers)
        self._flushed = 0
        self._stats = None
        if stats_path:
            fd = os.open(stats_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, _STATS.size)
                self._stats = mmap.mmap(fd, _STATS.size, mmap.MAP_SHARED,
                                        mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        compiler = getattr(torch, "compiler", None)
        self._compiling = getattr(compiler, "is_compiling", None) or (lambda: False)
        self.flush()

    # -- the point --------------------------------------------------------------------------
    def point(self, *_args, **_kwargs):
        """Every hook lands here. Returns None (a hook that changes nothing)."""
        if self._off or self._compiling():
            return
        try:
            self.hooks += 1
            word = self._word
            running = word[1] and self._live()
            if running and self.waits:
                self._wait()
            if self._ring is not None or self.torch.cuda.is_initialized():
                self._bound(2 if running else 1 if word[4] else 0)
            duty = word[5]
            if duty and self._live():
                self._throttle(duty / 1000.0)
            if not self.hooks & 15 and time.monotonic_ns() - self._flushed > FLUSH_NS:
                self.flush()
        except Exception as exc:  # noqa: BLE001 never break the job
            self._off = True
            sys.stderr.write(f"visionserve guard: cooperative yielding off ({exc!r})\n")

    def _live(self) -> bool:
        """The server that owns the word is alive (checked once a second): a dead server's word
        may read busy for ever."""
        now = time.monotonic()
        if now - self._owner_at >= OWNER_CHECK_S:
            self._owner_at = now
            try:
                os.kill(self.owner, 0)
                self._owner_alive = True
            except ProcessLookupError:
                self._owner_alive = False
            except OSError:
                self._owner_alive = True  # exists, not ours to signal
        return self._owner_alive

    def _decay(self, now: float) -> None:
        f = math.exp(-(now - self._last) / TAU_S)
        self._span = self._span * f + TAU_S * (1.0 - f)
        self._waited *= f
        self._slept *= f
        self._last = now

    def _throttle(self, duty: float) -> None:
        """Run at most ``duty`` of the time (rate limiting set by the guard from the served p99):
        sleep what is missing in the window, 20 ms at most per point."""
        now = time.monotonic()
        self._decay(now)
        need = (1.0 - max(duty, self.min_share)) * self._span - self._waited - self._slept
        if need > 0:
            need = min(need, 0.02)
            time.sleep(need)
            self._slept += need
            self.slept_ns += int(need * 1e9)

    def _wait(self) -> None:
        t0 = time.monotonic()
        self._decay(t0)
        allowed = min(self.max_wait,
                      (1.0 - self.min_share) * self._span - self._waited - self._slept)
        if allowed <= 0:
            self.forced += 1
            return
        poll, word, end = 50e-6, self._word, t0 + allowed
        forced = True
        while True:
            time.sleep(poll)
            if not word[1]:
                forced = False
                break
            if time.monotonic() >= end:
                break
            poll = min(poll * 1.5, 1e-3)
        waited = time.monotonic() - t0
        self._waited += waited
        self.yields += 1
        self.forced += forced
        self.waited_ns += int(waited * 1e9)
        self.flush()

    def _bound(self, level: int) -> None:
        """Mark this point with a CUDA event; then, oldest first, note which marks the GPU has
        passed (learning its time per point from the events' timing), and wait (blocking sync) for
        the oldest while more points are outstanding than ``queue_ms`` of GPU time allows (at most
        ``depth``). ``level`` 1 (frames wait for their batch): a quarter of that, so little is
        queued when the batch starts; 2 (a batch runs): one point."""
        if self.torch.cuda.is_current_stream_capturing():
            return  # inside a CUDA graph capture: no event may be queried
        ring = self._ring
        if ring is None:
            ring = self._ring = [self.torch.cuda.Event(enable_timing=True, blocking=True)
                                 for _ in range(self.depth + 2)]  # + the last passed mark
        n = len(ring)
        ring[self._n % n].record()
        self._n += 1
        allowed = max(1, min(self.depth, int(self.queue_ms / self.point_ms)))
        if level:
            allowed = 1 if level == 2 else max(1, allowed // 4)
        while self._done < self._n:
            ev = ring[self._done % n]
            if not ev.query():
                if self._n - self._done <= allowed:
                    break
                ev.synchronize()
                self.syncs += 1
            if self._done:  # the GPU time between the previous mark and this one
                ms = ring[(self._done - 1) % n].elapsed_time(ev)
                self.point_ms += 0.1 * (max(0.001, ms) - self.point_ms)
            self._done += 1

    def disable(self) -> None:
        self._off = True

    # -- statistics ---------------------------------------------------------------------------
    def flush(self) -> None:
        self._flushed = time.monotonic_ns()
        if self._stats is None:
            return
        flags = (1 if self._ring is not None else 0) | (0 if self.waits else 2)
        _STATS.pack_into(self._stats, 0, STATS_MAGIC, 1, self.pid, flags,
                         self.hooks, self.yields, self.forced, self.waited_ns, self.syncs,
                         self._flushed, self.slept_ns)


def install(torch, env=None) -> Yielder | None:
    """Register the hooks (once per process) when the environment names a busy word; returns the
    :class:`Yielder`, or None when off or the word cannot be read (said on stderr)."""
    global _installed
    env = os.environ if env is None else env
    share = env.get("VISIONSERVE_GUARD_SHARE")
    if _installed is not None or not share or env.get("VISIONSERVE_GUARD_YIELD", "1") == "0":
        return _installed
    try:
        y = Yielder(torch, share, env.get("VISIONSERVE_GUARD_YIELD_STATS"),
                    max_wait_s=_env_float("VISIONSERVE_GUARD_YIELD_MAX_WAIT_MS", 50.0) / 1000,
                    min_share=_env_float("VISIONSERVE_GUARD_YIELD_MIN_SHARE", 0.3),
                    depth=int(_env_float("VISIONSERVE_GUARD_YIELD_DEPTH", 16)),
                    queue_ms=_env_float("VISIONSERVE_GUARD_YIELD_QUEUE_MS", 2.0),
                    mode=env.get("VISIONSERVE_GUARD_YIELD_MODE", "wait"))
        from torch.nn.modules import module as nn_module

        def forward_post(_module, _args, output):
            if y._off:
                return
            out = output if isinstance(output, torch.Tensor) else (
                output[0] if isinstance(output, (tuple, list)) and output
                and isinstance(output[0], torch.Tensor) else None)
            if out is not None and out.requires_grad and torch.is_grad_enabled() \
                    and not y._compiling():
                out.register_hook(y.point)  # a point in backward, when this gradient is computed

        nn_module.register_module_forward_pre_hook(y.point)
        nn_module.register_module_forward_hook(forward_post)
        import importlib

        # torch.optim deletes its submodules' names: import this one by its path
        optim_module = importlib.import_module("torch.optim.optimizer")
        register_step = getattr(optim_module, "register_optimizer_step_pre_hook", None)
        if register_step is not None:  # torch >= 2.0
            register_step(y.point)
    except Exception as exc:  # noqa: BLE001 a hook must never stop the job
        sys.stderr.write(f"visionserve guard: cooperative yielding not installed ({exc!r})\n")
        return None
    atexit.register(y.flush)
    os.register_at_fork(after_in_child=y.disable)
    _installed = y
    return y
