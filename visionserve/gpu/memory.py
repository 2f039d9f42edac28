"""GPU memory: the reserved budget, the pinned host staging pool, allocator statistics, and the
runner's high-priority CUDA stream.

The server is given a budget (``--gpu-memory-budget``, or ``runtime.gpu_memory_budget`` per model)
and reserves it at start-up: the torch allocator is capped to its share
(``set_per_process_memory_fraction``), each onnxruntime CUDA session gets ``gpu_mem_limit`` with
an arena that grows only by what is asked, and every preferred batch size is warmed up before
ready. After that, serving should need no new ``cudaMalloc``: :class:`AllocationWatch` counts the
allocator's segments so that a test (and ``/metrics``) can show it.

Pure planning (:func:`plan_budget`, :func:`check_free`) imports nothing heavy and is unit-tested
with a simulated NVML; the torch parts import torch inside functions.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import ModelConfig, parse_bytes
from ..errors import ConfigError
from ..plugins import BACKENDS

if TYPE_CHECKING:
    from .nvml import GpuInfo, GpuProcess, Nvml

log = logging.getLogger(__name__)

MIB = 1024**2

#: Raw frames up to this many bytes each are staged through the pinned pool without being split;
#: larger ones are streamed through it in slot-sized pieces (a 1080p RGB frame is 6.2 MB).
DEFAULT_STAGE_FRAME_BYTES = 1920 * 1080 * 3
#: Upper bound of one pinned slot, so a large max_batch_size cannot pin gigabytes of host memory.
MAX_SLOT_BYTES = 256 * MIB
#: Device memory the GPU preprocessing of one batch may use, per frame, beyond the model input:
#: the decoded uint8 frame plus one fp16 working copy of it (chunked, see gpu/preprocess.py).
PREP_BYTES_PER_FRAME = DEFAULT_STAGE_FRAME_BYTES * 3


# --- the budget (pure) -----------------------------------------------------------------------

@dataclass(frozen=True)
class SessionShare:
    """What one model version's instances may reserve."""

    model: str
    backend: str
    instances: int
    share: int  # bytes for all instances of this model, backend + preprocessing
    prep_allowance: int  # of which the GPU preprocessing (torch allocator) may use
    #: limit of its own arena per instance (onnxruntime's gpu_mem_limit; 0 for backends that use
    #: the torch allocator)
    ort_limit_per_instance: int = 0


@dataclass(frozen=True)
class BudgetPlan:
    total: int | None  # None: no budget given, nothing is capped
    sessions: tuple[SessionShare, ...] = ()
    #: cap of the torch caching allocator (torch models, GPU preprocessing), bytes
    torch_cap: int | None = None

    def share_of(self, model: str) -> SessionShare | None:
        return next((s for s in self.sessions if s.model == model), None)


def prep_allowance(config: ModelConfig) -> int:
    """Device bytes the GPU preprocessing of one batch of this model needs, generously."""
    s = config.input
    bs = config.batching.max_batch_size
    model_in = s.width * s.height * s.channels * 4
    return bs * (PREP_BYTES_PER_FRAME + 2 * model_in)


def plan_budget(server_budget: str | int | None,
                models: Sequence[tuple[str, ModelConfig]]) -> BudgetPlan:
    """Split the server's budget among the models; :class:`ConfigError` when it cannot be done.

    A model's ``runtime.gpu_memory_budget`` is its share (all instances together); models
    without one share what is left equally. The server setting caps the total; without it the
    total is the sum of the models' budgets, or no cap at all if any model has none.
    Backends with an arena of their own (``Backend.device_memory == "arena"``: onnxruntime) get
    their share minus the preprocessing allowance as its limit (``gpu_mem_limit``); the torch
    allocator (torch models and every model's GPU preprocessing) gets the rest.
    """

    total = parse_bytes(server_budget) if server_budget is not None else None
    explicit = {name: parse_bytes(cfg.runtime.gpu_memory_budget)
                for name, cfg in models if cfg.runtime.gpu_memory_budget is not None}
    rest = [name for name, _ in models if name not in explicit]
    if total is None:
        if rest or not models:
            return BudgetPlan(total=None)
        total = sum(explicit.values())
    claimed = sum(explicit.values())
    if claimed > total:
        listed = ", ".join(f"{n}={v / MIB:.0f} MiB" for n, v in explicit.items())
        raise ConfigError(f"gpu memory budget {total / MIB:.0f} MiB is smaller than the models' "
                          f"own runtime.gpu_memory_budget values together ({listed})")
    each = (total - claimed) // len(rest) if rest else 0
    sessions = []
    for name, cfg in models:
        share = explicit.get(name, each)
        prep = prep_allowance(cfg)
        inst = cfg.runtime.instances
        ort = 0
        if BACKENDS.load(cfg.runtime.backend).device_memory == "arena":
            ort = (share - prep * inst) // inst
            if ort <= 0:
                raise ConfigError(
                    f"gpu memory budget share of model {name} ({share / MIB:.0f} MiB) leaves "
                    f"nothing for {cfg.runtime.backend}: GPU preprocessing of "
                    f"{cfg.batching.max_batch_size} frames needs {prep / MIB:.0f} MiB per "
                    "instance; raise the budget or lower max_batch_size")
        elif share < prep * inst:
            raise ConfigError(f"gpu memory budget share of model {name} ({share / MIB:.0f} MiB) is "
                              f"below what preprocessing alone needs ({prep * inst / MIB:.0f} MiB)")
        sessions.append(SessionShare(model=name, backend=cfg.runtime.backend, instances=inst,
                                     share=share, prep_allowance=prep * inst,
                                     ort_limit_per_instance=ort))
    torch_cap = total - sum(s.ort_limit_per_instance * s.instances for s in sessions)
    return BudgetPlan(total=total, sessions=tuple(sessions), torch_cap=torch_cap)


# --- is the budget free? (pure, NVML) --------------------------------------------------------

def pinned_gpu(nvml: Nvml, environ: Mapping[str, str] | None = None) -> GpuInfo | None:
    """The physical GPU this (pinned) process uses as ``cuda:0``, seen through NVML."""
    from .device import visible_devices

    if not nvml.available():
        return None
    env = os.environ if environ is None else environ
    vis = visible_devices(nvml.devices(), env.get("CUDA_VISIBLE_DEVICES"))
    return vis.devices[0] if vis.devices else None


@dataclass(frozen=True)
class FreeCheck:
    ok: bool
    free: int
    total: int
    budget: int
    holders: tuple[GpuProcess, ...] = field(default=())

    def message(self, gpu: str = "the GPU") -> str:
        gib = 1024**3
        if self.ok:
            return (f"gpu memory budget {self.budget / gib:.2f} GiB available on {gpu} "
                    f"({self.free / gib:.2f} GiB free of {self.total / gib:.2f} GiB)")
        who = ", ".join(f"pid {p.pid} uses " + (f"{p.used_bytes / gib:.2f} GiB" if p.used_bytes
                                                  is not None else "an unknown amount")
                        for p in self.holders) or "no process NVML can see (another container?)"
        return (f"gpu memory budget {self.budget / gib:.2f} GiB is not available on {gpu}: only "
                f"{self.free / gib:.2f} GiB of {self.total / gib:.2f} GiB is free; held by: {who}. "
                "Not ready until it is free (or lower --gpu-memory-budget).")


def check_free(nvml: Nvml, gpu: GpuInfo, budget: int) -> FreeCheck:
    total, _used, free = nvml.memory(gpu.index)
    procs = sorted(nvml.processes(gpu.index), key=lambda p: -(p.used_bytes or 0))
    return FreeCheck(ok=free >= budget, free=free, total=total, budget=budget,
                     holders=tuple(p for p in procs if p.pid != os.getpid()))


# --- torch allocator -------------------------------------------------------------------------

def cap_torch_allocator(cap: int, device: str = "cuda:0") -> float:
    """Cap torch's caching allocator at ``cap`` bytes of the device; returns the fraction set."""
    import torch

    if not torch.cuda.is_available():
        log.warning("no CUDA device: the torch allocator cap of %.0f MiB is not applied", cap / MIB)
        return 0.0
    dev = torch.device(device)
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = max(0.0, min(1.0, cap / total))
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    log.info("torch allocator capped at %.0f MiB (%.4f of %.0f MiB)", cap / MIB, fraction,
             total / MIB)
    return fraction


@dataclass(frozen=True)
class AllocatorStats:
    """The torch caching allocator's counters that show new device allocations."""

    segments_allocated: int  # cudaMalloc calls so far
    segments_current: int
    reserved_bytes: int
    allocated_bytes: int
    alloc_retries: int  # a cudaMalloc failed, the cache was flushed and the call retried
    ooms: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def allocator_stats(device: str = "cuda:0") -> AllocatorStats:
    import torch

    s = torch.cuda.memory_stats(torch.device(device))
    return AllocatorStats(
        segments_allocated=int(s.get("segment.all.allocated", 0)),
        segments_current=int(s.get("segment.all.current", 0)),
        reserved_bytes=int(s.get("reserved_bytes.all.current", 0)),
        allocated_bytes=int(s.get("allocated_bytes.all.current", 0)),
        alloc_retries=int(s.get("num_alloc_retries", 0)),
        ooms=int(s.get("num_ooms", 0)),
    )


def reserve_small_pool(device: str, streams: Sequence[Any] = (), blocks: int = 96) -> None:
    """Grow the caching allocator's small-block pool (allocations up to 1 MiB live in 2 MiB
    segments) ahead of time, on every stream that serves. Warm-up runs one batch at a time; under
    load several batches' small temporaries (decode metadata, resize weights, outputs) are alive
    at once and would otherwise make the pool grow: new device allocations after ready. Cached
    blocks are reused only on the stream they were allocated on, hence one reserve per stream."""
    import torch

    for stream in list(streams) or [None]:
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            held = [torch.empty(1024 * 1024 - 512, dtype=torch.uint8, device=device)
                    for _ in range(blocks)]
        torch.cuda.synchronize(device)
        del held


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class AllocationWatch:
    """Marks the allocator's state when the server turns ready; :meth:`new_since_mark` then says
    whether serving has needed new device memory (it should not, with a warmed-up budget)."""

    def __init__(self, device: str = "cuda:0") -> None:
        self.device = device
        self.baseline: AllocatorStats | None = None

    def mark(self) -> AllocatorStats:
        self.baseline = allocator_stats(self.device)
        return self.baseline

    def new_since_mark(self) -> dict[str, int]:
        now = allocator_stats(self.device)
        base = self.baseline or now
        return {
            "new_segments": now.segments_allocated - base.segments_allocated,
            "reserved_growth_bytes": now.reserved_bytes - base.reserved_bytes,
            "alloc_retries": now.alloc_retries - base.alloc_retries,
            "ooms": now.ooms - base.ooms,
        }


# --- the runner's stream ---------------------------------------------------------------------

def high_priority_stream(device: str = "cuda:0") -> Any:
    """A CUDA stream at the device's highest priority, so inference kernels are scheduled ahead
    of a co-located training job's (which run on default-priority streams)."""
    import torch

    dev = torch.device(device)
    # priority_range() is (least, greatest) = (0, -N) on current GPUs: lower is more urgent
    # a staticmethod; torch's stub declares it an instance method
    least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    return torch.cuda.Stream(device=dev, priority=min(least, greatest))


# --- pinned host staging ---------------------------------------------------------------------

class PinnedPool:
    """A few page-locked uint8 buffers, reused round-robin for host->device copies.

    Pinning is slow (it maps pages with the driver), so it happens once, here, never per
    request. A slot is handed out only when the copy that last read it has finished, which the
    event recorded by :meth:`release` tells without synchronising the device, and never while
    another thread is filling it: the versions of a model share their pool (:func:`shared_pool`),
    so two prep threads can use one during a swap.

    On a machine without CUDA (tests, the CPU path) the buffers are ordinary memory.
    """

    def __init__(self, slots: int, slot_bytes: int, *, pin: bool = True) -> None:
        import torch

        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"pinned pool needs >= 1 slot of >= 1 byte, got {slots} x "
                             f"{slot_bytes}")
        self.pinned = bool(pin and torch.cuda.is_available())
        self.slot_bytes = int(slot_bytes)
        self._buffers = [torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pinned)
                         for _ in range(slots)]
        self._events: list[Any] = [None] * slots
        self._busy = [False] * slots
        self._next = 0
        self._free = threading.Condition()
        log.debug("pinned pool: %d x %.1f MiB (%s)", slots, slot_bytes / MIB,
                  "page-locked" if self.pinned else "pageable")

    @property
    def slots(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def acquire(self) -> tuple[int, Any]:
        """(slot index, uint8 host tensor) of the next slot nobody is filling; waits only for
        that slot's last copy. Give it back with :meth:`release`."""
        n = len(self._buffers)
        with self._free:
            while all(self._busy):
                self._free.wait()
            i = next(k % n for k in range(self._next, self._next + n) if not self._busy[k % n])
            self._busy[i] = True
            self._next = (i + 1) % n
            ev = self._events[i]
            self._events[i] = None
        if ev is not None:
            ev.synchronize()
        return i, self._buffers[i]

    def release(self, slot: int, stream: Any = None) -> None:
        """Slot ``slot`` is filled and its copies are queued on ``stream`` (None: nothing was
        queued): the next user waits for them."""
        ev = None
        if stream is not None and self.pinned:
            import torch

            ev = torch.cuda.Event()
            ev.record(stream)
        with self._free:
            self._events[slot] = ev
            self._busy[slot] = False
            self._free.notify()

    def upload(self, arrays: Sequence[Any], device: Any, stream: Any = None) -> list[Any]:
        """Copy host uint8 arrays (numpy) to ``device`` through the pool; one device tensor per
        array, same shape. Arrays larger than a slot are streamed through it in pieces."""
        import numpy as np
        import torch

        sizes = [int(a.nbytes) for a in arrays]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        srcs = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
        slot: int | None = None
        buf: Any = None  # the slot's uint8 host tensor
        used = 0
        dst_off = 0
        pending_start = 0  # where the slot's unflushed bytes go in ``flat``

        def flush() -> None:
            nonlocal slot, used
            if slot is None or used == 0:
                return
            flat[pending_start:pending_start + used].copy_(buf[:used], non_blocking=self.pinned)
            self.release(slot, stream)
            slot, used = None, 0

        try:
            for src in srcs:
                pos = 0
                while pos < src.size:
                    if slot is None:
                        slot, buf = self.acquire()
                        used, pending_start = 0, dst_off
                    k = min(src.size - pos, self.slot_bytes - used)
                    buf[used:used + k].numpy()[:] = src[pos:pos + k]
                    used += k
                    pos += k
                    dst_off += k
                    if used == self.slot_bytes:
                        flush()
            flush()
        finally:
            if slot is not None:  # failed while filling it: nothing of it was queued
                self.release(slot)
        out, off = [], 0
        for a, n in zip(arrays, sizes):
            out.append(flat[off:off + n].view(*a.shape))
            off += n
        return out


_SHARED: weakref.WeakValueDictionary[tuple, PinnedPool] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def shared_pool(key: tuple, slots: int, slot_bytes: int) -> PinnedPool:
    """The pinned pool of ``key`` (model, instance) while any version of it still holds it, else
    a new one. ``cudaHostAlloc`` holds a driver lock while it pins: on the H200 each 200 MB slot
    of the ResNet-50 bench model took 106-170 ms, during which every other thread's kernel
    launches waited, so a version loading beside the serving one must not pin its own."""
    with _SHARED_LOCK:
        pool = _SHARED.get((key, slots, slot_bytes))
        if pool is None:
            pool = PinnedPool(slots, slot_bytes)
            _SHARED[(key, slots, slot_bytes)] = pool
        return pool


def stage_slot_bytes(config: ModelConfig, frame_bytes: int = DEFAULT_STAGE_FRAME_BYTES) -> int:
    """Slot size: the largest batch at the model's input size, and raw frames up to
    ``frame_bytes`` each, capped at :data:`MAX_SLOT_BYTES` (larger batches are streamed)."""
    s = config.input
    bs = config.batching.max_batch_size
    return int(min(MAX_SLOT_BYTES, bs * max(s.width * s.height * s.channels, frame_bytes)))

