"""GPU metrics for ``/metrics``: the budget, what the allocator reserved and uses, and NVML's view
of the card (memory, temperature, power, throttle reasons), sampled by a small asyncio task.

NVML calls take a millisecond or so; they run in a worker thread every few seconds, never on the
event loop and never per scrape.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from .nvml import THROTTLE_REASON_BITS

if TYPE_CHECKING:
    from .memory import AllocatorStats
    from .nvml import Nvml

log = logging.getLogger(__name__)

BUDGET = Gauge("visionserve_gpu_memory_budget_bytes", "GPU memory budget the server reserves")
RESERVED = Gauge("visionserve_gpu_memory_reserved_bytes",
                 "GPU memory held by the torch caching allocator (graphs, buffers, preprocessing)")
ALLOCATED = Gauge("visionserve_gpu_memory_allocated_bytes", "GPU memory in live torch tensors")
USED = Gauge("visionserve_gpu_memory_used_bytes",
             "GPU memory this process and its worker processes use by NVML (CUDA contexts, "
             "torch, onnxruntime, nvJPEG)")
DEVICE_USED = Gauge("visionserve_gpu_device_memory_used_bytes",
                    "GPU memory used by all processes (NVML)")
DEVICE_TOTAL = Gauge("visionserve_gpu_device_memory_total_bytes", "GPU memory of the card (NVML)")
NEW_SEGMENTS = Gauge(
    "visionserve_gpu_allocator_new_segments",
    "cudaMalloc calls by the torch allocator since the server turned ready (should stay 0)")
TEMPERATURE = Gauge("visionserve_gpu_temperature_celsius", "GPU temperature (NVML)")
POWER = Gauge("visionserve_gpu_power_watts", "GPU power draw (NVML)")
THROTTLE = Gauge("visionserve_gpu_throttle_active",
                 "1 while NVML reports this clock throttle reason", ["reason"])


@dataclass(frozen=True)
class GpuSample:
    budget: int | None
    reserved: int | None = None
    allocated: int | None = None
    new_segments: int | None = None
    process_used: int | None = None
    device_used: int | None = None
    device_total: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    throttle_reasons: tuple[str, ...] = field(default=())


class GpuTelemetry:
    """Samples one GPU. ``allocator`` returns the torch allocator stats (None: no torch
    statistics, e.g. in tests); ``baseline`` the stats at ready time, for new segments."""

    def __init__(self, nvml: Nvml, gpu_index: int | None, budget: int | None,
                 allocator: Callable[[], AllocatorStats | None] | None = None,
                 baseline: Callable[[], AllocatorStats | None] | None = None,
                 pid: int | None = None,
                 workers: Callable[[], list[int]] = list) -> None:
        self.nvml = nvml
        self.gpu_index = gpu_index
        self.budget = budget
        self.allocator = allocator
        self.baseline = baseline
        self.pid = os.getpid() if pid is None else pid
        self.workers = workers  # the pids of its worker processes, whose memory is its too
        self._task: asyncio.Task | None = None

    def sample(self) -> GpuSample:
        stats = self.allocator() if self.allocator else None
        base = self.baseline() if self.baseline else None
        values: dict = {"budget": self.budget}
        if stats is not None:
            values.update(reserved=stats.reserved_bytes, allocated=stats.allocated_bytes)
            if base is not None:
                values["new_segments"] = stats.segments_allocated - base.segments_allocated
        if self.gpu_index is not None and self.nvml.available():
            try:
                g = next((d for d in self.nvml.devices() if d.index == self.gpu_index), None)
            except Exception as exc:  # noqa: BLE001 - NVML hiccups must not stop the sampler
                log.debug("NVML sample failed: %s", exc)
                g = None
            if g is not None:
                ours = {self.pid, *self.workers()}
                used = {p.pid: p.used_bytes for p in g.processes
                        if p.pid in ours and p.used_bytes is not None}
                values.update(device_used=g.memory_used, device_total=g.memory_total,
                              temperature_c=g.temperature_c, power_w=g.power_w,
                              throttle_reasons=g.throttle_reasons,
                              process_used=sum(used.values()) if self.pid in used else None)
        return GpuSample(**values)

    @staticmethod
    def publish(s: GpuSample) -> None:
        for gauge, value in ((BUDGET, s.budget), (RESERVED, s.reserved), (ALLOCATED, s.allocated),
                             (NEW_SEGMENTS, s.new_segments), (USED, s.process_used),
                             (DEVICE_USED, s.device_used), (DEVICE_TOTAL, s.device_total),
                             (TEMPERATURE, s.temperature_c), (POWER, s.power_w)):
            if value is not None:
                gauge.set(value)
        if s.device_total is not None:
            active = set(s.throttle_reasons)
            for name in THROTTLE_REASON_BITS.values():
                THROTTLE.labels(name).set(1 if name in active else 0)

    def update(self) -> GpuSample:
        s = self.sample()
        self.publish(s)
        return s

    def start(self, interval_s: float = 5.0) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(interval_s))

    async def _run(self, interval_s: float) -> None:
        while True:
            try:
                await asyncio.to_thread(self.update)
            except Exception:
                log.exception("GPU telemetry sample failed")
            await asyncio.sleep(interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
